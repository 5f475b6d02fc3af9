// The wait poller: one per io_context (created on the first wait of a
// thread, registered with the loop only while waits are pending, freed with
// the context as one of its orphans, so it never outlives the ring it
// watches). See shuttle/cuda/cuda.hpp for the mechanism.
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/io_context.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <vector>

namespace shuttle::cuda {

namespace {
thread_local wait_options tl_options{};
thread_local wait_stats tl_stats{};
thread_local detail::wait_poller* tl_poller = nullptr;
thread_local std::vector<cudaEvent_t> tl_event_pool;

using clock = std::chrono::steady_clock;

// The eventfd that host functions write. Shared with the host functions in
// flight: whichever of them and the poller lets go last closes it, so a
// late callback never writes a closed (or reused) descriptor.
struct shared_fd {
  std::atomic<int> refs{1};
  int fd = -1;
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      ::close(fd);
      delete this;
    }
  }
};

void CUDART_CB host_func(void* arg) {
  auto* f = static_cast<shared_fd*>(arg);
  std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(f->fd, &one, sizeof one);
  f->release();
}
}  // namespace

const char* to_string(wait_mechanism m) noexcept {
  switch (m) {
    case wait_mechanism::hybrid: return "hybrid";
    case wait_mechanism::event_query: return "event_query";
    case wait_mechanism::host_func: return "host_func";
  }
  return "?";
}

void set_wait_options(const wait_options& o) noexcept { tl_options = o; }
wait_options get_wait_options() noexcept { return tl_options; }
wait_stats get_wait_stats() noexcept { return tl_stats; }
void reset_wait_stats() noexcept { tl_stats = {}; }

namespace detail {

void note_immediate() noexcept { ++tl_stats.immediate; }

cudaEvent_t pooled_event() {
  if (!tl_event_pool.empty()) {
    cudaEvent_t e = tl_event_pool.back();
    tl_event_pool.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}
void return_pooled_event(cudaEvent_t e) noexcept {
  if (tl_event_pool.size() < 256)
    tl_event_pool.push_back(e);
  else
    (void)cudaEventDestroy(e);
}

class wait_poller final : public shuttle::poller, public shuttle::detail::orphan_op {
 public:
  explicit wait_poller(io_context& ctx) : ctx_(&ctx) {
    fd_ = new shared_fd;
    fd_->fd = ::eventfd(0, EFD_CLOEXEC);  // blocking: the ring polls it
    if (fd_->fd < 0) {
      int e = errno;
      delete fd_;
      throw std::system_error(e, std::system_category(), "eventfd");
    }
    io_op::complete = &on_fd;
    ctx_->adopt_orphan(this);
    arm_read();
  }
  ~wait_poller() override {
    if (tl_poller == this) tl_poller = nullptr;
    for (auto s : aux_pool_) (void)cudaStreamDestroy(s);
    fd_->release();
  }

  io_context* ctx() const noexcept { return ctx_; }

  void link(wait_node& n) {
    n.poller = this;
    n.next = nullptr;
    n.prev = tail_;
    if (tail_)
      tail_->next = &n;
    else
      head_ = &n;
    tail_ = &n;
    if (!registered_) {
      ctx_->add_poller(*this);
      registered_ = true;
    }
  }
  // completed: the node's event is done, so its auxiliary stream (if any)
  // drains at once and can be reused; a cancelled wait's may wait long.
  void unlink(wait_node& n, bool completed = true) noexcept {
    if (n.prev)
      n.prev->next = n.next;
    else
      head_ = n.next;
    if (n.next)
      n.next->prev = n.prev;
    else
      tail_ = n.prev;
    n.prev = n.next = nullptr;
    n.poller = nullptr;
    if (n.aux) {
      if (completed)
        aux_pool_.push_back(n.aux);  // its host function may still be queued: harmless
      else
        (void)cudaStreamDestroy(n.aux);  // released by CUDA once its work is done
      n.aux = nullptr;
    }
  }

  bool poll() override {
    if (!head_) {
      unregister();
      return false;
    }
    wait_node* ready = nullptr;
    wait_node** tail = &ready;
    for (wait_node* n = head_; n;) {
      wait_node* next = n->next;
      ++tl_stats.queries;
      cudaError_t s = cudaEventQuery(n->ev);
      if (s != cudaErrorNotReady) {
        n->status = s;
        unlink(*n);
        n->ready_next = nullptr;
        *tail = n;
        tail = &n->ready_next;
      }
      n = next;
    }
    if (!ready) return false;
    if (!head_) unregister();
    // Resumed inline, as io_uring completions are: no extra turn of the loop.
    while (ready) {
      wait_node* n = ready;
      ready = n->ready_next;
      n->stop_cb.reset();  // waits for a callback running on another thread
      if (n->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) n->waiter.resume();
    }
    return true;
  }

  bool try_enter_interrupt_mode() override {
    if (!head_) return true;
    const auto& o = tl_options;
    if (o.mechanism == wait_mechanism::event_query) return false;
    auto now = clock::now();
    bool armed_any = false;
    for (wait_node* n = head_; n; n = n->next) {
      if (n->aux) continue;
      if (o.mechanism == wait_mechanism::hybrid && now - n->since < o.spin) return false;
      if (!arm(*n)) return false;  // could not arm: keep polling it
      armed_any = true;
    }
    // A completion before the host function was queued raises it anyway
    // (the wait is on the event); poll once more for what completed meanwhile.
    (void)armed_any;
    return !poll();
  }
  void exit_interrupt_mode() override {}

 private:
  bool arm(wait_node& n) {
    cudaStream_t s = nullptr;
    if (!aux_pool_.empty()) {
      s = aux_pool_.back();
      aux_pool_.pop_back();
    } else if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    fd_->refs.fetch_add(1, std::memory_order_relaxed);
    if (cudaStreamWaitEvent(s, n.ev, 0) != cudaSuccess || cudaLaunchHostFunc(s, &host_func, fd_) != cudaSuccess) {
      (void)cudaGetLastError();
      fd_->refs.fetch_sub(1, std::memory_order_relaxed);
      aux_pool_.push_back(s);
      return false;
    }
    n.aux = s;
    ++tl_stats.host_funcs;
    return true;
  }

  void unregister() noexcept {
    if (registered_) {
      ctx_->remove_poller(*this);
      registered_ = false;
    }
  }

  void arm_read() {
    io_uring_sqe* sqe = ctx_->get_sqe();
    io_uring_prep_read(sqe, fd_->fd, &buf_, sizeof buf_, 0);
    io_uring_sqe_set_data(sqe, static_cast<io_op*>(this));
  }
  static void on_fd(io_op* op, int res, std::uint32_t) noexcept {
    auto* self = static_cast<wait_poller*>(op);
    if (res == -ECANCELED) return;  // the ring is going away
    ++tl_stats.wakeups;
    try {
      self->arm_read();
    } catch (...) {
    }
  }

  io_context* ctx_;
  shared_fd* fd_ = nullptr;
  std::uint64_t buf_ = 0;
  wait_node* head_ = nullptr;
  wait_node* tail_ = nullptr;
  bool registered_ = false;
  std::vector<cudaStream_t> aux_pool_;
};

bool park(wait_node& n, std::coroutine_handle<> h, std::stop_token token) {
  if (token.stop_requested()) {
    n.cancelled = true;
    ++tl_stats.cancelled;
    return false;
  }
  io_context& ctx = io_context::current();
  if (!tl_poller || tl_poller->ctx() != &ctx) tl_poller = new wait_poller(ctx);
  ++tl_stats.waits;
  n.ctx = &ctx;
  n.waiter = h;
  n.since = clock::now();
  n.refs.store(1, std::memory_order_relaxed);
  tl_poller->link(n);
  if (token.stop_possible()) n.stop_cb.emplace(std::move(token), wait_node::cancel_callback{&n});
  return true;
}

void wait_node::cancel_callback::operator()() const noexcept {
  wait_node* n = self;
  if (n->ctx->running_in_this_thread()) {
    if (n->poller) {
      n->poller->unlink(*n, false);
      n->cancelled = true;
      ++tl_stats.cancelled;
      if (n->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) n->ctx->post(n->waiter);
    }
    return;
  }
  n->refs.fetch_add(1, std::memory_order_relaxed);
  n->run = [](shuttle::detail::remote_op* r) noexcept {
    auto* n = static_cast<wait_node*>(r);
    if (n->poller) {
      n->poller->unlink(*n, false);
      n->cancelled = true;
      ++tl_stats.cancelled;
      n->refs.fetch_sub(1, std::memory_order_relaxed);  // the queue's reference
    }
    if (n->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) n->ctx->post(n->waiter);
  };
  n->ctx->post_remote(n);
}

}  // namespace detail
}  // namespace shuttle::cuda
