#include <shuttle/receive_stream.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

namespace shuttle {

// ---------------------------------------------------------------- buffer_ring

namespace {
// Group ids are per ring; one counter per thread is enough (one ring per thread).
thread_local std::uint16_t next_group = 1;
// Whether this kernel ends a multishot recv after a total byte count
// (sqe->optlen, Linux 6.17+); older ones refuse the request with EINVAL, and
// the quota then rests on cancelling alone. (Any thread's rings may find out.)
std::atomic<bool> kernel_limits_multishot{true};
}  // namespace

// How the ring is shared (the per-completion work is a few counter updates):
//  - free_ counts the buffers in the kernel's hands: one less per completion
//    that carries a buffer, one more per recycle().
//  - A stream receives ahead of its consumer (a multishot request, many
//    buffers per submission) only on buffers promised to it: promise() gives
//    at most promise_limit() and never touches the last reserve_ free ones,
//    so all read-ahead together, stalled consumers' queues included, leaves
//    the reserve free. The promise shrinks with each buffer delivered and
//    grows again as the consumer takes them; used up, the request is
//    cancelled (it also carries the promise as a byte limit, so a burst of
//    full buffers cannot pass it).
//  - A stream whose consumer waits with nothing queued and that gets no
//    promise receives one buffer per request, out of the reserve.
//  - Requests wait for data before they pick a buffer (POLL_FIRST), so a
//    request that finds the ring dry (ENOBUFS) has data to take: it waits in
//    FIFO order, and each recycled buffer re-arms the next one in line.
buffer_ring::buffer_ring(io_context& ctx, unsigned count, std::size_t buffer_size)
    : ctx_(ctx),
      storage_(std::size_t(count) * buffer_size),
      size_(buffer_size),
      count_(count),
      group_(next_group++),
      free_(count),
      reserve_(std::max(1u, count / 8)),
      promise_limit_(std::max(2u, (count - std::min(count, reserve_)) / 16)) {
  if (count == 0 || count > 32768 || (count & (count - 1)) != 0)
    throw std::invalid_argument("shuttle::buffer_ring: count must be a power of two up to 32768, not " +
                                std::to_string(count));
  if (buffer_size == 0 || buffer_size > (1u << 31)) throw std::invalid_argument("shuttle::buffer_ring: bad buffer size");
  ring_bytes_ = count * sizeof(io_uring_buf);
  void* mem = ::mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
  if (mem == MAP_FAILED) throw_errno(errno, "buffer_ring: mmap");
  ring_ = static_cast<io_uring_buf_ring*>(mem);
  io_uring_buf_reg reg{};
  reg.ring_addr = reinterpret_cast<std::uint64_t>(ring_);
  reg.ring_entries = count;
  reg.bgid = group_;
  if (int r = io_uring_register_buf_ring(ctx_.backend().ring(), &reg, 0); r < 0) {
    ::munmap(ring_, ring_bytes_);
    throw_errno(-r, "io_uring_register_buf_ring (kernel 5.19+)");
  }
  io_uring_buf_ring_init(ring_);
  for (unsigned i = 0; i < count; ++i)
    io_uring_buf_ring_add(ring_, buffer(i), static_cast<unsigned>(size_), static_cast<unsigned short>(i),
                          io_uring_buf_ring_mask(count), static_cast<int>(i));
  io_uring_buf_ring_advance(ring_, static_cast<int>(count));
}

buffer_ring::~buffer_ring() {
  for (auto* c : clients_) c->ring_destroyed();
  io_uring_unregister_buf_ring(ctx_.backend().ring(), group_);
  ::munmap(ring_, ring_bytes_);
}

void buffer_ring::recycle(unsigned id) noexcept {
  io_uring_buf_ring_add(ring_, buffer(id), static_cast<unsigned>(size_), static_cast<unsigned short>(id),
                        io_uring_buf_ring_mask(count_), 0);
  io_uring_buf_ring_advance(ring_, 1);
  ++free_;
  if (first_waiting_) serve_waiters();
}

unsigned buffer_ring::promise(unsigned want) noexcept {
  const std::size_t kept = std::size_t(promised_) + reserve_;
  if (free_ <= kept) return 0;
  unsigned n = static_cast<unsigned>(std::min<std::size_t>(want, free_ - kept));
  promised_ += n;
  return n;
}

void buffer_ring::wait_for_buffers(client& c, bool first) noexcept {
  if (c.waiting) return;
  c.waiting = true;
  if (first) {
    c.next_waiting = first_waiting_;
    first_waiting_ = &c;
    if (!last_waiting_) last_waiting_ = &c;
  } else {
    c.next_waiting = nullptr;
    (last_waiting_ ? last_waiting_->next_waiting : first_waiting_) = &c;
    last_waiting_ = &c;
  }
  // A buffer may have come back since the kernel found the ring dry.
  serve_waiters();
}

// One waiter re-armed per free buffer: each has data waiting, so each takes
// one. (Waking all would only send the rest back to the end of the line.)
void buffer_ring::serve_waiters() noexcept {
  if (serving_) return;  // a waiter's re-arm recycled a buffer: the loop below goes on
  serving_ = true;
  for (unsigned woken = 0; first_waiting_ && woken < free_;) {
    client* c = first_waiting_;
    first_waiting_ = c->next_waiting;
    if (!first_waiting_) last_waiting_ = nullptr;
    c->next_waiting = nullptr;
    c->waiting = false;
    if (c->buffers_available()) ++woken;
  }
  serving_ = false;
}

void buffer_ring::stop_waiting(client& c) noexcept {
  if (!c.waiting) return;
  client* prev = nullptr;
  for (client* p = first_waiting_; p; prev = p, p = p->next_waiting) {
    if (p != &c) continue;
    (prev ? prev->next_waiting : first_waiting_) = c.next_waiting;
    if (last_waiting_ == &c) last_waiting_ = prev;
    break;
  }
  c.next_waiting = nullptr;
  c.waiting = false;
}

void buffer_ring::detach(client& c) noexcept {
  std::erase(clients_, &c);
  stop_waiting(c);
}

// ---------------------------------------------------------------- receive_stream

// Heap state: the armed recv refers to it, so it lives until the request's
// last CQE (or the context's end), even after the stream is gone.
struct receive_stream::state : detail::orphan_op, buffer_ring::client {
  struct arrival {
    int res;  // bytes, 0 at EOF, -errno
    unsigned id;
  };
  io_context* ctx = nullptr;
  buffer_ring* ring = nullptr;
  detail::sqe_file file;  // the socket's slot on ctx's ring, or its fd
  bool armed = false;
  bool multishot = false;  // the armed request is a multishot one
  bool disarming = false;  // a cancel is on its way: promise used up
  bool closed = false;
  bool finished = false;  // EOF or error delivered by the kernel: never re-arm
  bool woken = false;     // re-armed by the ring for a buffer, none received yet
  unsigned max_queued = 1;
  unsigned promised = 0;     // buffers the ring still promises the armed request
  unsigned arm_promise = 0;  // what the ring promised it when armed
  unsigned arm_used = 0;     // buffers it has delivered
  // The promise asked for next: it doubles each time a request uses all of
  // its promise while the consumer is behind, so a stream that needs to
  // receive ahead soon submits rarely, while one that keeps up (or idles)
  // holds only the least of the ring's buffers in promises.
  unsigned window = 2;
  std::size_t queued_buffers = 0;  // arrivals holding a ring buffer
  std::deque<arrival> arrivals;
  detail::wait_list waiters;

  // Arms a request when the stream may receive: for `consumer_waiting`
  // (nothing queued) always, else (receiving ahead) only on a promise.
  // Throws when no SQE is to be had.
  bool try_arm(bool consumer_waiting) {
    if (armed || finished || closed || waiting || !ring) return false;
    if (queued_buffers >= max_queued) return false;
    unsigned room = static_cast<unsigned>(max_queued - queued_buffers);
    unsigned n = ring->promise(std::min({room, window, ring->promise_limit()}));
    if (n == 0 && !consumer_waiting) return false;
    try {
      arm(n);
    } catch (...) {
      ring->unpromise(n);
      throw;
    }
    return true;
  }

  // `n` > 1: a multishot request for up to n buffers; else a single recv.
  void arm(unsigned n) {
    io_uring_sqe* sqe = ctx->backend().get_sqe();
    multishot = n > 1;
    if (multishot) {
      io_uring_prep_recv_multishot(sqe, file.fd, nullptr, 0, 0);
      // The kernel receives in bursts (tens of buffers before a CQE is even
      // seen): a cancel after the promise comes too late, so the request
      // itself stops after the promise's worth of bytes. (The field is
      // sqe->optlen; older headers name it file_index.)
      if (kernel_limits_multishot.load(std::memory_order_relaxed))
        sqe->file_index = static_cast<std::uint32_t>(std::min<std::size_t>(n * ring->buffer_size(), UINT32_MAX));
    } else {
      io_uring_prep_recv(sqe, file.fd, nullptr, 0, 0);  // length 0: the buffer's
    }
    // Wait for data before picking a buffer: ENOBUFS then means data waits.
    sqe->ioprio |= IORING_RECVSEND_POLL_FIRST;
    sqe->flags |= IOSQE_BUFFER_SELECT;
    file.mark(sqe);
    sqe->buf_group = ring->group();
    io_uring_sqe_set_data(sqe, static_cast<detail::io_op*>(this));
    complete = &on_cqe;
    armed = true;
    promised = arm_promise = n;
    arm_used = 0;
  }

  bool rearm() noexcept {
    try {
      return try_arm(!waiters.empty());
    } catch (...) {
      return false;  // no SQE now: the consumer's next wait tries again
    }
  }

  static void on_cqe(detail::io_op* op, int res, std::uint32_t flags) noexcept {
    auto* s = static_cast<state*>(op);
    const unsigned id = (flags & IORING_CQE_F_BUFFER) ? flags >> IORING_CQE_BUFFER_SHIFT : ~0u;
    if (id != ~0u && s->ring) {
      s->ring->taken(s->promised > 0);
      if (s->promised > 0) --s->promised;
      ++s->arm_used;
    }
    if (!(flags & IORING_CQE_F_MORE)) {
      s->armed = false;
      if (s->ring) s->ring->unpromise(s->promised);
      s->promised = 0;
      // Used up with the consumer behind: ask for more next time.
      if (s->multishot && s->arm_used >= s->arm_promise && (s->disarming || s->queued_buffers > 0) &&
          s->window < (1u << 15))
        s->window *= 2;
      s->disarming = false;
    }
    if (s->closed) {
      if (id != ~0u && s->ring) s->ring->recycle(id);
      if (!s->armed) {
        s->ctx->backend().forget_orphan(s);
        delete s;
      }
      return;
    }
    if (res == -EINVAL && s->multishot && !s->armed &&
        kernel_limits_multishot.load(std::memory_order_relaxed)) {
      // A kernel without multishot byte limits: arm without one.
      kernel_limits_multishot.store(false, std::memory_order_relaxed);
      s->rearm();
      return;
    }
    if (res == -ENOBUFS) {
      // The ring ran dry: not this connection's fault, nor an error. Its
      // data waits in the socket; it re-arms in its turn as buffers return.
      if (!s->armed && s->ring) s->ring->wait_for_buffers(*s, std::exchange(s->woken, false));
      return;
    }
    if (res == -ECANCELED && !s->armed) {
      s->rearm();
      return;
    }
    s->woken = false;
    if (res <= 0) s->finished = true;
    s->arrivals.push_back({res, id});
    if (res > 0) ++s->queued_buffers;
    s->waiters.wake_one();
    if (s->armed && !s->disarming && s->promised == 0) {
      // The promise is used up: stop taking the shared ring's buffers.
      try {
        s->ctx->backend().submit_cancel(s);
        s->disarming = true;
      } catch (...) {
        // No SQE now: the next arrival tries again.
      }
    }
    if (!s->armed) s->rearm();
  }

  // The consumer took a buffer: the promise grows back by one (as far as the
  // ring can promise), so a request whose consumer keeps up stays armed.
  void top_up() noexcept {
    if (armed && multishot && !disarming && promised < arm_promise && queued_buffers + promised < max_queued)
      promised += ring->promise(1);
  }

  ~state() {
    if (ring) ring->detach(*this);
  }
  void ring_destroyed() noexcept override { ring = nullptr; }

  bool buffers_available() noexcept override {
    woken = rearm();
    return woken;
  }
};

receive_stream::receive_stream(tcp_socket& socket, buffer_ring& ring, receive_stream_options options)
    : s_(new state) {
  s_->ctx = &io_context::current();
  s_->ring = &ring;
  s_->file = socket.file_for(*s_->ctx);
  s_->max_queued = options.max_queued ? options.max_queued : std::max(1u, ring.count() / 8);
  ring.attach(*s_);
}

std::size_t receive_stream::queued() const noexcept { return s_->queued_buffers; }

receive_stream::~receive_stream() {
  state* s = s_;
  s->closed = true;
  if (s->ring) s->ring->stop_waiting(*s);
  for (auto& a : s->arrivals)
    if (a.res > 0) s->ring->recycle(a.id);
  s->arrivals.clear();
  s->queued_buffers = 0;
  if (s->armed) {
    s->ctx->backend().adopt_orphan(s);
    try {
      s->ctx->backend().submit_cancel(s);
    } catch (...) {
    }
  } else {
    delete s;
  }
}

bool receive_stream::next_awaiter::await_ready() noexcept {
  return !s_->arrivals.empty() || s_->closed || s_->finished;
}

bool receive_stream::next_awaiter::park(std::coroutine_handle<> h, std::stop_token token) {
  // Nothing is queued here (await_ready said so): a stream its quota or its
  // promise stopped starts receiving again.
  s_->try_arm(true);
  return s_->waiters.park(node_, h, std::move(token));
}

result<provided_buffer> receive_stream::next_awaiter::await_resume() {
  if (node_.cancelled) return std::make_error_code(std::errc::operation_canceled);
  if (s_->arrivals.empty()) {
    if (s_->closed) return std::make_error_code(std::errc::bad_file_descriptor);
    if (s_->finished) return provided_buffer{};  // EOF already consumed: stay at EOF
    return std::make_error_code(std::errc::resource_unavailable_try_again);
  }
  auto a = s_->arrivals.front();
  s_->arrivals.pop_front();
  if (a.res > 0) {
    --s_->queued_buffers;
    s_->top_up();
  }
  if (a.res < 0) return errno_code(-a.res);
  if (a.res == 0) return provided_buffer{};
  return provided_buffer{s_->ring, a.id, static_cast<std::size_t>(a.res)};
}

}  // namespace shuttle
