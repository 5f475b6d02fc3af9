// The wait poller: one per io_context (created on the first wait of a
// thread, registered with the loop only while waits are pending, freed with
// the context as one of its orphans, so it never outlives the ring it
// watches). See shuttle/cuda/cuda.hpp for the mechanism.
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/io_context.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

// A quiet ring (no completion for `quiet_ring`, nothing to submit) lets one
// poll() re-query for up to `poll_spin` before the loop's next
// io_uring_enter: the loop would only spin anyway (see cuda.hpp).
constexpr auto quiet_ring = std::chrono::microseconds(20);
constexpr auto poll_spin = std::chrono::microseconds(5);
// The bounds of a sleeping poller's timed polls.
constexpr auto min_sleep = std::chrono::microseconds(10);
constexpr auto max_sleep = std::chrono::milliseconds(1);

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
    timer_.complete = &on_timer;
    timer_.self = this;
    ctx_->backend().adopt_orphan(this);
    arm_read();
    last_cq_tail_ = io_uring_smp_load_acquire(ctx_->backend().ring()->cq.ktail);
    last_cq_change_ = clock::now();
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
    // A new wait is polled on every turn again, whether the poller was idle
    // or sleeping between timed polls.
    if (!registered_) {
      ctx_->backend().add_poller(*this);
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
    if (!head_) idle();
  }

  bool poll() override {
    if (!head_) {
      idle();
      return false;
    }
    const wait_options& o = tl_options;
    auto now = clock::now();
    if (o.mechanism == wait_mechanism::hybrid && now - tail_->since >= o.spin) {
      // Past the spin window the waits are queried once per slice (a
      // fraction of the youngest one's age): on a turn of the loop while the
      // ring is busy, from a ring timeout once it is quiet. Then the poller
      // leaves the poll list so that the loop sleeps in the ring (a
      // registered poller keeps it spinning for its spin budget after every
      // wake-up). Queries on every turn of a busy loop would take the CPU
      // that its sockets need.
      if (now >= next_query_) {
        if (sweep()) return true;
        now = clock::now();
        next_query_ = slice_end(now);
      }
      if (ring_quiet(now)) {
        try {
          arm_timer(now, next_query_);
          unregister();
        } catch (...) {
          // No SQE to be had: stay on the poll list.
        }
      }
      return false;
    }
    if (sweep()) return true;
    if (ring_quiet(now)) {
      // Nothing for the loop to do but this wait: query again here rather
      // than after an io_uring_enter (a finer wake-up, fewer syscalls).
      auto until = now + poll_spin;
      do {
        if (sweep()) return true;
        now = clock::now();
      } while (now < until);
    }
    return false;
  }

  bool try_enter_interrupt_mode() override {
    if (!head_) return true;
    const wait_options& o = tl_options;
    if (o.mechanism == wait_mechanism::event_query) return false;
    if (o.mechanism == wait_mechanism::hybrid) {
      auto now = clock::now();
      if (now - tail_->since < o.spin) return false;
      // Past `spin`, kept on the poll list by a busy ring that has gone
      // idle: the loop sleeps, and a timed poll wakes it for the next query.
      if (now >= next_query_) {
        if (sweep()) return false;
        now = clock::now();
        next_query_ = slice_end(now);
      }
      try {
        arm_timer(now, next_query_);
      } catch (...) {
        return false;
      }
      return true;
    }
    for (wait_node* n = head_; n; n = n->next) {
      if (n->aux) continue;
      if (!arm(*n)) return false;  // could not arm: keep polling it
    }
    // A completion before the host function was queued raises it anyway
    // (it waits on the event); poll once more for what completed meanwhile.
    return !poll();
  }
  void exit_interrupt_mode() override {}

 private:
  struct timer_op : shuttle::detail::io_op {
    wait_poller* self = nullptr;
  };

  // Queries every pending wait; resumes those that finished. True if any did.
  bool sweep() {
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
    // Resumed inline, as io_uring completions are: no extra turn of the loop.
    while (ready) {
      wait_node* n = ready;
      ready = n->ready_next;
      n->stop_cb.reset();  // waits for a callback running on another thread
      if (n->unref()) n->waiter.resume();
    }
    return true;
  }

  // True when the ring has had no completion for `quiet_ring` and holds no
  // unsubmitted entries. With DEFER_TASKRUN completions appear only inside
  // io_uring_enter, so a busy ring shows as a moving CQ tail between polls.
  bool ring_quiet(clock::time_point now) noexcept {
    io_uring* r = ctx_->backend().ring();
    unsigned t = io_uring_smp_load_acquire(r->cq.ktail);
    if (t != last_cq_tail_) {
      last_cq_tail_ = t;
      last_cq_change_ = now;
      return false;
    }
    return io_uring_sq_ready(r) == 0 && now - last_cq_change_ >= quiet_ring;
  }

  // No wait is pending: off the poll list, and a timed poll still armed is
  // withdrawn so that it does not wake a sleeping loop for nothing.
  void idle() noexcept {
    unregister();
    if (timer_armed_ && !timer_cancel_sent_) {
      io_uring_sqe* sqe = nullptr;
      try {
        sqe = ctx_->backend().get_sqe();
      } catch (...) {
        return;  // no SQE to be had: the timed poll fires once for nothing
      }
      io_uring_prep_timeout_remove(sqe, reinterpret_cast<std::uint64_t>(static_cast<io_op*>(&timer_)), 0);
      io_uring_sqe_set_data64(sqe, 0);  // its own completion is ignored
      timer_cancel_sent_ = true;
    }
  }

  // When the next query of waits past `spin` is due: after (age of the
  // youngest wait) / sleep_divisor, clamped.
  clock::time_point slice_end(clock::time_point now) const noexcept {
    const wait_options& o = tl_options;
    auto age = std::chrono::duration_cast<std::chrono::nanoseconds>(now - tail_->since);
    std::chrono::nanoseconds slice = age / std::max(1u, o.sleep_divisor);
    return now + std::clamp<std::chrono::nanoseconds>(slice, min_sleep, max_sleep);
  }

  // Arms (or brings forward) the ring timeout that wakes a sleeping loop
  // for the query due at `deadline`.
  void arm_timer(clock::time_point now, clock::time_point deadline) {
    auto rel = std::max<std::chrono::nanoseconds>(deadline - now, std::chrono::microseconds(1));
    if (timer_armed_ && !timer_cancel_sent_) {
      if (timer_deadline_ <= deadline) return;  // an earlier timed poll is due anyway
      set_timespec(update_ts_, rel);
      io_uring_sqe* sqe = ctx_->backend().get_sqe();
      io_uring_prep_timeout_update(sqe, &update_ts_, reinterpret_cast<std::uint64_t>(static_cast<io_op*>(&timer_)),
                                   0);
      io_uring_sqe_set_data64(sqe, 0);  // -ENOENT if it fired meanwhile: its completion polls anyway
      timer_deadline_ = deadline;
      return;
    }
    if (timer_armed_) return;  // a withdrawn one is still to complete: on_timer arms the next
    set_timespec(timer_ts_, rel);
    io_uring_sqe* sqe = ctx_->backend().get_sqe();
    io_uring_prep_timeout(sqe, &timer_ts_, 0, 0);
    io_uring_sqe_set_data(sqe, static_cast<io_op*>(&timer_));
    timer_armed_ = true;
    timer_deadline_ = deadline;
  }

  static void set_timespec(__kernel_timespec& ts, std::chrono::nanoseconds d) noexcept {
    ts.tv_sec = static_cast<long long>(d.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long long>(d.count() % 1'000'000'000);
  }

  // A timed poll (or the completion of a withdrawn one): query, and arm the
  // next while the poller still sleeps.
  static void on_timer(io_op* op, int res, std::uint32_t) noexcept {
    auto* self = static_cast<timer_op*>(op)->self;
    self->timer_armed_ = false;
    self->timer_cancel_sent_ = false;
    if (res == -ETIME) ++tl_stats.timed_polls;
    if (self->registered_ || !self->head_) return;  // polled on every turn again, or nothing to poll
    (void)self->sweep();
    if (self->head_ && !self->registered_) {
      try {
        auto now = clock::now();
        self->next_query_ = self->slice_end(now);
        self->arm_timer(now, self->next_query_);
      } catch (...) {
        self->ctx_->backend().add_poller(*self);  // no SQE to be had: poll on every turn instead of sleeping
        self->registered_ = true;
      }
    }
  }

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
      ctx_->backend().remove_poller(*this);
      registered_ = false;
    }
  }

  void arm_read() {
    io_uring_sqe* sqe = ctx_->backend().get_sqe();
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
  // Quiet-ring detection.
  unsigned last_cq_tail_ = 0;
  clock::time_point last_cq_change_{};
  // Past `spin` (hybrid): when the waits are queried next, and the timed
  // poll that wakes a sleeping loop for it.
  clock::time_point next_query_{};
  timer_op timer_;
  __kernel_timespec timer_ts_{};
  __kernel_timespec update_ts_{};
  clock::time_point timer_deadline_{};
  bool timer_armed_ = false;
  bool timer_cancel_sent_ = false;
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

void wait_node::release() noexcept {
  if (unref()) ctx->post(waiter);
}

void wait_node::cancel_here() noexcept {
  if (poller) {
    poller->unlink(*this, false);
    cancelled = true;
    ++tl_stats.cancelled;
    release();  // the poller's reference
  }
}

void wait_node::cancel_callback::operator()() const noexcept { self->request_cancel(*self->ctx); }

}  // namespace detail
}  // namespace shuttle::cuda
