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

buffer_ring::buffer_ring(io_context& ctx, unsigned count, std::size_t buffer_size)
    : ctx_(ctx), storage_(std::size_t(count) * buffer_size), size_(buffer_size), count_(count), group_(next_group++) {
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
  if (int r = io_uring_register_buf_ring(ctx_.ring(), &reg, 0); r < 0) {
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
  io_uring_unregister_buf_ring(ctx_.ring(), group_);
  ::munmap(ring_, ring_bytes_);
}

void buffer_ring::recycle(unsigned id) noexcept {
  io_uring_buf_ring_add(ring_, buffer(id), static_cast<unsigned>(size_), static_cast<unsigned short>(id),
                        io_uring_buf_ring_mask(count_), 0);
  io_uring_buf_ring_advance(ring_, 1);
  if (starved* s = starved_) {
    starved_ = s->next_starved;
    s->is_starved = false;
    s->buffers_available();
  }
}

void buffer_ring::wait_for_buffers(starved& s) noexcept {
  if (s.is_starved) return;
  s.is_starved = true;
  s.next_starved = starved_;
  starved_ = &s;
}

void buffer_ring::detach(starved& s) noexcept {
  std::erase(clients_, &s);
  if (!s.is_starved) return;
  for (starved** p = &starved_; *p; p = &(*p)->next_starved) {
    if (*p == &s) {
      *p = s.next_starved;
      break;
    }
  }
  s.is_starved = false;
}

// ---------------------------------------------------------------- receive_stream

// Heap state: the armed multishot recv refers to it, so it lives until the
// request's last CQE (or the context's end), even after the stream is gone.
struct receive_stream::state : detail::orphan_op, buffer_ring::starved {
  struct arrival {
    int res;  // bytes, 0 at EOF, -errno
    unsigned id;
  };
  io_context* ctx = nullptr;
  buffer_ring* ring = nullptr;
  detail::sqe_file file;  // the socket's slot on ctx's ring, or its fd
  bool armed = false;
  bool disarming = false;  // a cancel is on its way: over quota
  bool closed = false;
  bool finished = false;  // EOF or error delivered by the kernel: never re-arm
  bool limited = false;   // the armed request carries a byte limit
  unsigned max_queued = 1;
  std::size_t queued_buffers = 0;  // arrivals holding a ring buffer
  std::deque<arrival> arrivals;
  detail::wait_list waiters;

  bool over_quota() const noexcept { return queued_buffers >= max_queued; }

  void arm() {
    io_uring_sqe* sqe = ctx->get_sqe();
    io_uring_prep_recv_multishot(sqe, file.fd, nullptr, 0, 0);
    sqe->flags |= IOSQE_BUFFER_SELECT;
    file.mark(sqe);
    sqe->buf_group = ring->group();
    // The kernel receives in bursts (tens of buffers before a CQE is even
    // seen, the whole ring if the socket holds enough): a cancel at the
    // quota comes too late. So the request itself stops after the quota's
    // worth of bytes. (The field is sqe->optlen; older headers name it
    // file_index.)
    limited = kernel_limits_multishot.load(std::memory_order_relaxed);
    if (limited) {
      std::size_t room = max_queued > queued_buffers ? max_queued - queued_buffers : 1;
      sqe->file_index = static_cast<std::uint32_t>(std::min<std::size_t>(room * ring->buffer_size(), UINT32_MAX));
    }
    io_uring_sqe_set_data(sqe, static_cast<detail::io_op*>(this));
    complete = &on_cqe;
    armed = true;
  }

  // Arms again where the kernel ended the request (dry ring, its own
  // choice, our quota cancel) and somebody waits: with a consumer parked,
  // nothing is queued, so the quota is not in the way.
  void rearm_for_waiters() noexcept {
    try {
      if (!armed && !finished && !closed && !is_starved && !waiters.empty() && !over_quota()) arm();
    } catch (...) {
    }
  }

  static void on_cqe(detail::io_op* op, int res, std::uint32_t flags) noexcept {
    auto* s = static_cast<state*>(op);
    if (!(flags & IORING_CQE_F_MORE)) {
      s->armed = false;
      s->disarming = false;
    }
    unsigned id = (flags & IORING_CQE_F_BUFFER) ? flags >> IORING_CQE_BUFFER_SHIFT : ~0u;
    if (s->closed) {
      if (id != ~0u && s->ring) s->ring->recycle(id);
      if (!s->armed) {
        s->ctx->forget_orphan(s);
        delete s;
      }
      return;
    }
    if (res == -EINVAL && s->limited && !s->armed) {
      // A kernel without multishot byte limits: arm without one.
      kernel_limits_multishot.store(false, std::memory_order_relaxed);
      try {
        s->arm();
      } catch (...) {
      }
      return;
    }
    if (res == -ENOBUFS) {
      // The ring ran dry: start again when a buffer comes back (unless the
      // quota holds it back: then the consumer's next wait re-arms).
      if (!s->armed && !s->over_quota()) s->ring->wait_for_buffers(*s);
      return;
    }
    if (res == -ECANCELED && !s->armed) {
      s->rearm_for_waiters();
      return;
    }
    if (res <= 0) s->finished = true;
    s->arrivals.push_back({res, id});
    if (res > 0) ++s->queued_buffers;
    s->waiters.wake_one();
    if (s->armed && !s->disarming && s->over_quota()) {
      // The consumer is behind: stop taking the shared ring's buffers.
      try {
        s->ctx->submit_cancel(s);
        s->disarming = true;
      } catch (...) {
        // No SQE now: the next arrival tries again.
      }
    }
    // The kernel may end a multishot at will (and does when the ring is
    // dry): keep it armed while somebody waits.
    s->rearm_for_waiters();
  }

  ~state() {
    if (ring) ring->detach(*this);
  }
  void ring_destroyed() noexcept override { ring = nullptr; }

  void buffers_available() noexcept override {
    try {
      if (!armed && !finished && !closed && !over_quota()) arm();
    } catch (...) {
    }
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
  for (auto& a : s->arrivals)
    if (a.res > 0) s->ring->recycle(a.id);
  s->arrivals.clear();
  s->queued_buffers = 0;
  if (s->armed) {
    s->ctx->adopt_orphan(s);
    try {
      s->ctx->submit_cancel(s);
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
  // Nothing is queued here (await_ready said so): a stream the quota
  // disarmed starts receiving again.
  if (!s_->armed && !s_->finished && !s_->is_starved) s_->arm();
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
  if (a.res > 0) --s_->queued_buffers;
  if (a.res < 0) return errno_code(-a.res);
  if (a.res == 0) return provided_buffer{};
  return provided_buffer{s_->ring, a.id, static_cast<std::size_t>(a.res)};
}

}  // namespace shuttle
