#include <shuttle/io_context.hpp>
#include <shuttle/result.hpp>

#include "spin_policy.hpp"

#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <cstring>
#include <stdexcept>
#include <string>

namespace shuttle {

void throw_errno(int e, const std::string& what) {
  throw std::system_error(errno_code(e), what);
}

namespace {
thread_local io_context* current_context = nullptr;

// Tries the fastest ring set-up first and falls back for older kernels:
// DEFER_TASKRUN (6.1) runs completion work only when this thread enters the
// ring, SINGLE_ISSUER (6.0) drops submission locking, COOP_TASKRUN (5.19)
// avoids interrupting the thread with task work. TASKRUN_FLAG makes the
// kernel say (in the SQ flags) when such work waits, so a busy-polling loop
// can skip io_uring_enter while there is none. Returns whether it is set.
bool init_ring(io_uring& ring, unsigned entries) {
  const unsigned attempts[] = {
      IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
      IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
      IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
      IORING_SETUP_COOP_TASKRUN,
      0,
  };
  int err = 0;
  for (unsigned flags : attempts) {
    io_uring_params p{};
    p.flags = flags | IORING_SETUP_CQSIZE;
    p.cq_entries = entries * 4;
    err = io_uring_queue_init_params(entries, &ring, &p);
    if (err == 0) {
      // Every io_uring_enter then skips looking the ring's fd up (5.18+);
      // best effort: older kernels just keep the lookup.
      (void)io_uring_register_ring_fd(&ring);
      return (flags & IORING_SETUP_TASKRUN_FLAG) != 0;
    }
    if (err != -EINVAL) break;
  }
  throw_errno(-err, "io_uring_queue_init(" + std::to_string(entries) + " entries)");
}
}  // namespace

io_context::io_context() : io_context(options{}) {}

io_context::io_context(options opts) : thread_(std::this_thread::get_id()), opts_(opts) {
  if (current_context)
    throw std::logic_error("shuttle::io_context: this thread already has an io_context (one per thread)");
  taskrun_flag_ = init_ring(ring_, opts_.sq_entries);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    int e = errno;
    io_uring_queue_exit(&ring_);
    throw_errno(e, "eventfd");
  }
  wake_op_.complete = &on_wakeup;
  wake_op_.owner = this;
  arm_wakeup();
  current_context = this;
}

io_context::~io_context() {
  // Work that holds the context (a provider's wind-down) ends first, on
  // the loop: it is stopped already and needs a few turns at most.
  if (holds_ > 0 && running_in_this_thread()) {
    released_ = false;
    try {
      run_until(released_, false);
    } catch (...) {  // a destructor: what could not run is dropped below, as before
    }
  }
  // Work queued for a turn that will not come: self-owned ops (dispatch)
  // free what they captured, while this context is still current (their
  // destructors may cancel ring operations; those end as orphans below).
  for (int round = 0; round < 16; ++round) {  // a discarded op may queue another
    detail::remote_op* head;
    {
      std::lock_guard lock(remote_mutex_);
      head = std::exchange(remote_head_, nullptr);
      remote_tail_ = nullptr;
    }
    if (!head) break;
    while (head) {
      auto* next = head->next;
      if (head->discard) head->discard(head);
      head = next;
    }
  }
  if (current_context == this) current_context = nullptr;
  if (files_) files_->owner = nullptr;  // sockets still registered only close their fds now
  if (buffers_) buffers_->owner = nullptr;
  io_uring_queue_exit(&ring_);  // cancels what is still in flight; drops the file table
  ::close(wake_fd_);
  while (orphans_) {
    auto* o = orphans_;
    forget_orphan(o);
    delete o;
  }
}

io_context& io_context::current() {
  if (!current_context)
    throw std::logic_error("shuttle: no io_context on this thread (create one, or run inside a runtime)");
  return *current_context;
}

io_context* io_context::current_or_null() noexcept { return current_context; }

bool io_context::running_in_this_thread() const noexcept {
  return std::this_thread::get_id() == thread_;
}

io_uring_sqe* detail::uring_backend::get_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) {
    int r = io_uring_submit(&ring_);
    if (r < 0 && r != -EBUSY && r != -EAGAIN) throw_errno(-r, "io_uring_submit");
    sqe = io_uring_get_sqe(&ring_);
    if (!sqe) throw_errno(EBUSY, "io_uring: submission queue full");
  }
  ++sqes_;
  return sqe;
}

void detail::uring_backend::submit_cancel(const detail::io_op* target) {
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_cancel64(sqe, reinterpret_cast<std::uint64_t>(target), 0);
  io_uring_sqe_set_data64(sqe, 0);  // its own completion is ignored
}

// The first post into an empty queue writes the eventfd, whether the loop
// sleeps or not: that keeps the loop's own path free of fences (no "I am
// about to sleep" flag to publish) at the price of one write per batch of
// remote posts. The write happens under the lock: once the loop can take the
// operation it may finish and be destroyed, and the eventfd with it.
void io_context::post_remote(detail::remote_op* op) noexcept {
  op->next = nullptr;
  std::lock_guard lock(remote_mutex_);
  bool was_empty = remote_head_ == nullptr;
  if (remote_tail_)
    remote_tail_->next = op;
  else
    remote_head_ = op;
  remote_tail_ = op;
  remote_pending_.store(true, std::memory_order_release);
  if (was_empty) wake();
}

namespace {
struct function_op : detail::remote_op {
  std::function<void()> fn;
};
}  // namespace

void io_context::dispatch(std::function<void()> fn) {
  auto* op = new function_op;
  op->fn = std::move(fn);
  op->run = [](detail::remote_op* r) noexcept {
    std::unique_ptr<function_op> self(static_cast<function_op*>(r));
    self->fn();
  };
  op->discard = [](detail::remote_op* r) noexcept { delete static_cast<function_op*>(r); };
  post_remote(op);
}

void io_context::stop() noexcept {
  stop_requested_.store(true, std::memory_order_seq_cst);
  wake();
}

void io_context::wake() noexcept {
  std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

void io_context::arm_wakeup() {
  io_uring_sqe* sqe = get_sqe();
  io_uring_prep_read(sqe, wake_fd_, &wake_buf_, sizeof wake_buf_, 0);
  io_uring_sqe_set_data(sqe, static_cast<detail::io_op*>(&wake_op_));
}

void io_context::on_wakeup(detail::io_op* op, int, std::uint32_t) noexcept {
  static_cast<wake_op*>(op)->owner->arm_wakeup();
}

result<detail::registered_file> io_context::register_file(int fd) {
  if (fd < 0) return errno_code(EBADF);
  if (!files_) {
    rlimit lim{};
    unsigned size = opts_.registered_files;
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < size) size = static_cast<unsigned>(lim.rlim_cur);
    if (size == 0) return errno_code(ENFILE);
    int r = io_uring_register_files_sparse(&ring_, size);
    if (r < 0) return errno_code(-r);
    files_ = std::make_shared<detail::file_table>();
    files_->owner = this;
    free_slots_.reserve(size);
    for (unsigned i = size; i-- > 0;) free_slots_.push_back(static_cast<int>(i));  // slot 0 first
  }
  if (free_slots_.empty()) return errno_code(ENFILE);
  int slot = free_slots_.back();
  int r = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
  if (r < 0) return errno_code(-r);
  if (r != 1) return errno_code(EBADF);
  free_slots_.pop_back();
  return detail::registered_file{files_, slot};
}

void io_context::unregister_file(detail::registered_file& f) noexcept {
  if (f.slot < 0 || !f.table || f.table->owner != this) return;
  int none = -1;
  // Fails only if the table is gone, which the owner check rules out.
  (void)io_uring_register_files_update(&ring_, static_cast<unsigned>(f.slot), &none, 1);
  free_slots_.push_back(f.slot);
  f.slot = -1;
  f.table.reset();
}

result<detail::registered_buffer> io_context::register_buffer(std::span<std::byte> buf) {
  if (buf.empty() || buf.size() > (std::size_t{1} << 30)) return errno_code(EINVAL);
  if (!buffers_) {
    if (opts_.registered_buffers == 0) return errno_code(ENFILE);
    int r = io_uring_register_buffers_sparse(&ring_, opts_.registered_buffers);
    if (r < 0) return errno_code(-r);
    buffers_ = std::make_shared<detail::buffer_table>();
    buffers_->owner = this;
    for (unsigned i = opts_.registered_buffers; i-- > 0;) free_buffer_slots_.push_back(static_cast<int>(i));
  }
  if (free_buffer_slots_.empty()) return errno_code(ENFILE);
  int slot = free_buffer_slots_.back();
  iovec iov{buf.data(), buf.size()};
  __u64 tag = 0;
  int r = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(slot), &iov, &tag, 1);
  if (r < 0) return errno_code(-r);
  if (r != 1) return errno_code(EFAULT);
  free_buffer_slots_.pop_back();
  return detail::registered_buffer{buffers_, slot, buf.data(), buf.size()};
}

void io_context::unregister_buffer(detail::registered_buffer& b) noexcept {
  if (!b.usable_on(*this)) return;
  iovec none{nullptr, 0};
  __u64 tag = 0;
  // Fails only if the table is gone, which the owner check rules out.
  (void)io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(b.index), &none, &tag, 1);
  free_buffer_slots_.push_back(b.index);
  b.index = -1;
  b.table.reset();
}

void detail::uring_backend::adopt_orphan(detail::orphan_op* op) noexcept {
  op->orphan_prev = nullptr;
  op->orphan_next = orphans_;
  if (orphans_) orphans_->orphan_prev = op;
  orphans_ = op;
}

void detail::uring_backend::forget_orphan(detail::orphan_op* op) noexcept {
  if (op->orphan_prev)
    op->orphan_prev->orphan_next = op->orphan_next;
  else
    orphans_ = op->orphan_next;
  if (op->orphan_next) op->orphan_next->orphan_prev = op->orphan_prev;
  op->orphan_prev = op->orphan_next = nullptr;
}

void detail::uring_backend::add_poller(poller& p) {
  pollers_.push_back(&p);
  if (p.busy_poll()) {
    try {
      spin_pollers_.push_back(&p);
    } catch (...) {
      pollers_.pop_back();
      throw;
    }
  }
}

void detail::uring_backend::remove_poller(poller& p) noexcept {
  pollers_.erase(std::remove(pollers_.begin(), pollers_.end(), &p), pollers_.end());
  spin_pollers_.erase(std::remove(spin_pollers_.begin(), spin_pollers_.end(), &p), spin_pollers_.end());
}

void io_context::run_ready() {
  // Only what is ready now: coroutines posted while running wait a turn, so
  // completions and remote work are not starved by a yielding loop.
  for (std::size_t n = ready_.size(); n > 0 && !ready_.empty(); --n) {
    auto h = ready_.front();
    ready_.pop_front();
    h.resume();
  }
}

bool io_context::drain_remote() {
  if (!remote_pending_.load(std::memory_order_acquire)) return false;
  detail::remote_op* head;
  {
    std::lock_guard lock(remote_mutex_);
    head = remote_head_;
    remote_head_ = remote_tail_ = nullptr;
    remote_pending_.store(false, std::memory_order_relaxed);
  }
  bool any = head != nullptr;
  while (head) {
    auto* next = head->next;
    head->run(head);
    head = next;
  }
  return any;
}

bool io_context::poll_pollers() {
  bool any = false;
  for (std::size_t i = 0; i < pollers_.size(); ++i) any |= pollers_[i]->poll();
  return any;
}

bool io_context::enter_interrupt_mode() {
  for (std::size_t i = 0; i < pollers_.size(); ++i) {
    if (!pollers_[i]->try_enter_interrupt_mode()) {
      for (std::size_t j = 0; j < i; ++j) pollers_[j]->exit_interrupt_mode();
      return false;
    }
  }
  return true;
}

void io_context::exit_interrupt_mode() {
  for (auto* p : pollers_) p->exit_interrupt_mode();
}

unsigned io_context::reap() {
  unsigned total = 0;
  io_uring_cqe* cqes[64];
  struct completion {
    std::uint64_t data;
    int res;
    std::uint32_t flags;
  } batch[64];
  for (;;) {
    unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
    if (n == 0) return total;
    total += n;
    // Copy then advance first: a completion handler may submit and reap again.
    for (unsigned i = 0; i < n; ++i) batch[i] = {cqes[i]->user_data, cqes[i]->res, cqes[i]->flags};
    io_uring_cq_advance(&ring_, n);
    for (unsigned i = 0; i < n; ++i) {
      if (batch[i].data == 0) continue;
      auto* op = reinterpret_cast<detail::io_op*>(batch[i].data);
      op->complete(op, batch[i].res, batch[i].flags);
    }
  }
}

void io_context::run() {
  bool never = false;
  run_until(never, true);
  stop_requested_.store(false);
}

bool io_context::poll_ring(bool enter_anyway) {
  // Submit what is queued and run deferred completion work, no wait; true
  // if completions were reaped. A turn with nothing queued, nothing flagged
  // and nothing in the CQ makes no call into liburing at all.
  if (!taskrun_flag_ || enter_anyway || io_uring_sq_ready(&ring_) > 0 ||
      (IO_URING_READ_ONCE(*ring_.sq.kflags) & (IORING_SQ_TASKRUN | IORING_SQ_CQ_OVERFLOW)))
    io_uring_submit_and_get_events(&ring_);
  return io_uring_cq_ready(&ring_) > 0 && reap() > 0;
}

void io_context::wait_in_ring() {
  // Remote posts and stop() write the eventfd, whose read is always armed:
  // sleeping here cannot miss them.
  ++sleeps_;
  int r = io_uring_submit_and_wait(&ring_, 1);
  if (r < 0 && r != -EINTR && r != -ETIME && r != -EBUSY && r != -EAGAIN)
    throw_errno(-r, "io_uring_submit_and_wait");
}

// The two ways a completion resumes its coroutine:
//  - inline, on the spot. Ring completions do (uring_op_base::on_complete):
//    reap() copies a batch of CQEs and advances the CQ before it calls any
//    completion, so a resumed coroutine may submit and reap again without
//    harm. The CUDA wait poller does too (lib/cuda/await.cpp, sweep: the
//    finished waits are unlinked first). It saves a trip through ready_.
//  - posted (io_context::post), resumed by the next run_ready. The verbs
//    provider's CQ poller does so (op_wait::complete in lib/verbs): its CQ
//    poll runs not only from poll_pollers but also inside an operation's
//    launch, which peeks at the CQ right after ibv_post_send, that is in
//    the middle of another coroutine's co_await and of the poller's array
//    of work completions. Resuming there would nest coroutines and re-enter
//    the poller. From poll_pollers the coroutine resumes in the run_ready
//    right after the poll (same turn); from a launch's peek, a turn later.
//
// One turn of the loop, step by step (the spin policy, lib/spin_policy.hpp,
// holds the busy-polling budgets):
//  1. run ready work: remote posts, then the coroutines ready now;
//  2. poll the pollers, and run what they woke;
//  3. decide: go on (work was done, coroutines are ready, or the spin
//     policy says spin) or go to sleep;
//  4. going on: submit and reap the ring without waiting, next turn;
//  5. going to sleep: offer the pollers interrupt mode (any may refuse:
//     spin on), then enter the kernel and wait; reap what woke the loop.
void io_context::run_until(const bool& done, bool stoppable) {
  if (!running_in_this_thread())
    throw std::logic_error("shuttle::io_context: run on a thread other than the one that created it");
  struct current_guard {
    io_context* previous = current_context;
    explicit current_guard(io_context* c) { current_context = c; }
    ~current_guard() { current_context = previous; }
  } guard(this);

  detail::spin_policy spin(opts_.spin_budget, opts_.ring_spin_budget, spin_pollers_);
  while (!done && !(stoppable && stop_requested_.load(std::memory_order_relaxed))) {
    // 1. Remote work first: a task posted here before the loop started (a
    // spawn) must be running before the ready coroutines look for it.
    bool work = drain_remote();
    run_ready();
    // 2. What the pollers woke runs now, not after this turn's ring checks.
    if (!pollers_.empty() && poll_pollers()) {
      work = true;
      spin.reaped_completions();  // a poller's completion extends the ring budget as the ring's do
      run_ready();
    }
    if (done) break;
    // 3. Go on or sleep.
    const bool spinning = spin.next_turn(work);
    if (work || !ready_.empty() || spinning) {
      // 4. Go on: poll the ring, no wait.
      if (poll_ring(spin.enter_due())) spin.reaped_completions();
      continue;
    }
    // 5. Sleep, unless a poller saw work while arming (then spin on).
    if (!pollers_.empty() && !enter_interrupt_mode()) {
      spin.interrupt_mode_refused();
      continue;
    }
    wait_in_ring();
    if (!pollers_.empty()) exit_interrupt_mode();
    reap();
    spin.woke_up();
  }
}

}  // namespace shuttle
