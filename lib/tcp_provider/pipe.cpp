// The engine over a byte pipe (pipe.hpp): the waits that the socket's
// awaits are otherwise, and the bell loop. Only a pipe's connections come
// here; the socket's path does not change.
#include "conn_state.hpp"

#include <array>

namespace shuttle::detail {
namespace {
thread_local std::uint64_t pipe_sends = 0;  // a connection belongs to one thread
}
std::uint64_t local_ring_sends() noexcept { return pipe_sends; }
}  // namespace shuttle::detail

namespace shuttle::detail::tcp_provider {

byte_pipe::~byte_pipe() {
  if (polled_by_) polled_by_->backend().remove_poller(*this);
}

void byte_pipe::wait_begin(io_context& ctx, bool reading) {
  if (!polled_by_) {
    ctx.backend().add_poller(*this);
    polled_by_ = &ctx;
  }
  (reading ? wait_read_ : wait_write_) = true;
}

void byte_pipe::wait_end(bool reading) noexcept {
  (reading ? wait_read_ : wait_write_) = false;
  if (!wait_read_ && !wait_write_ && polled_by_) {
    polled_by_->backend().remove_poller(*this);
    polled_by_ = nullptr;
  }
}

// Every turn of the loop: the peer's index, no syscall. The events post
// their waiters (never inline), so the loop's poller list is not changed
// while it walks it.
bool byte_pipe::poll() {
  bool any = false;
  if (wait_read_ && !readable.is_set() && (readable_now() || gone || fault)) {
    readable.set();
    any = true;
  }
  if (wait_write_ && !writable.is_set() && (writable_now() || gone || fault)) {
    writable.set();
    any = true;
  }
  return any;
}

// The loop is about to sleep: the peer must ring for what it publishes
// from now on. arm_* publish our sleeping flag, then (seq_cst fence) look
// at the peer's index again; the peer publishes its index, then (fence)
// looks at our flag. Of the two fenced stores, at least one is seen by the
// other side's load: either we see its bytes here and do not sleep, or it
// sees our flag and rings (the doorbell's read is always armed in the
// ring, so the loop wakes). A refusal leaves no flag set.
bool byte_pipe::try_enter_interrupt_mode() {
  if (wait_read_ && !readable.is_set() && !arm_reader()) return false;
  if (wait_write_ && !writable.is_set() && !arm_writer()) {
    if (wait_read_) disarm_reader();
    return false;
  }
  return true;
}

// Awake again: no doorbells while this loop polls.
void byte_pipe::exit_interrupt_mode() {
  if (wait_read_) disarm_reader();
  if (wait_write_) disarm_writer();
}

// Sleeps until the pipe has bytes (room), the peer rings or hangs up, or
// the loops stop. Nothing to arm here: the loop polls the pipe while this
// waits, and arms it only if it goes to sleep (the poller above).
task<result<void>> conn_state::pipe_wait(bool reading) {
  // Hung up: the reader's read_now says eof once the ring is empty; a
  // writer that waits for room would wait for ever (nobody rings).
  if (pipe->gone) co_return reading ? result<void>{} : result<void>(err(errc::disconnected));
  event& e = reading ? pipe->readable : pipe->writable;
  e.reset();
  pipe->wait_begin(io_context::current(), reading);
  struct end_wait {
    byte_pipe& p;
    bool reading;
    ~end_wait() { p.wait_end(reading); }  // also when the frame is destroyed suspended
  } guard{*pipe, reading};
  co_return co_await e.wait();
}

task<result<void>> conn_state::pipe_read_exact(std::span<std::byte> buf) {
  for (;;) {
    auto n = pipe->read_now(buf);
    if (!n) co_return n.error();
    buf = buf.subspan(*n);
    if (buf.empty()) co_return result<void>{};
    if (auto r = co_await pipe_wait(true); !r) co_return r.error();
  }
}

task<result<void>> conn_state::pipe_write_all(std::span<iovec> v) {
  for (;;) {
    if (auto w = pipe->write_now(v); !w) co_return w.error();
    if (v.empty()) co_return result<void>{};
    if (auto r = co_await pipe_wait(false); !r) co_return r.error();
  }
}

bool conn_state::try_pipe_send(op_rec& rec, std::span<const std::byte> msg) {
  if (state_ != phase::open || pipe_backlog || !outq.empty() || slot_waiters || credit_waiters ||
      responder_waiters || pipe->fault || pipe->gone)
    return false;
  // In the queue first (it may throw), taken back if the frame does not go.
  rec.op = opcode::send;
  rec.seq = next_seq;
  pending.push_back(&rec);
  if (!slots.try_acquire()) {
    pending.pop_back();
    return false;
  }
  if (!credits.try_acquire()) {
    pending.pop_back();
    slots.release();
    return false;
  }
  header h;
  h.op = opcode::send;
  h.length = static_cast<std::uint32_t>(msg.size());
  h.seq = next_seq;
  // As the writer's last frame of a batch: outq is empty, so the ACK
  // follows every response.
  const bool ack = lim.carried && ack_seq != ack_sent, credit = lim.carried && credits_to_return != 0;
  if (ack) {
    h.flags |= flag_ack;
    h.arg0 = ack_seq;
  }
  if (credit) {
    h.flags |= flag_credit;
    h.arg1 = credits_to_return;
  }
  std::array<std::byte, header_size> hdr;
  encode_header(h, hdr);
  iovec v[2] = {{hdr.data(), header_size}, {const_cast<std::byte*>(msg.data()), msg.size()}};
  if (!pipe->try_write_now(std::span<iovec>(v, msg.empty() ? 1 : 2))) {
    pending.pop_back();
    credits.release();
    slots.release();
    return false;
  }
  if (ack) ack_sent = ack_seq;
  if (credit) credits_to_return = 0;
  ++credits_out;
  ++next_seq;
  rec.owns_slot = true;  // returned on completion, as submit returns it
  idle.reset();
  ++pipe_sends;
  return true;
}

std::coroutine_handle<> pipe_send::suspend(std::coroutine_handle<> h, std::stop_token token) {
  conn_state& c = *s;
  // submit's checks, in its order.
  if (c.error) {
    early = c.later_error();
    return h;
  }
  if (token.stop_requested()) {
    early = std::make_error_code(std::errc::operation_canceled);
    return h;
  }
  if (c.try_pipe_send(rec, msg)) {
    rec.waiter = h;
    if (token.stop_possible()) cb.emplace(std::move(token), canceller{&c, rec.seq});
    return std::noop_coroutine();
  }
  header hd;
  hd.op = opcode::send;
  hd.length = static_cast<std::uint32_t>(msg.size());
  engine.emplace(conn_state::submit_void(s, hd, msg));
  auto child = engine->handle();
  child.promise().set_continuation(h);
  child.promise().set_stop_token(std::move(token));
  return child;
}

result<void> pipe_send::take() {
  if (engine) return engine->handle().promise().take();
  if (early) return early;
  cb.reset();
  if (rec.ec) return rec.ec;
  return {};
}

// Any byte is a doorbell: both sleepers look again. The socket's end (the
// peer closed, shut down its side, or we did: abort_io) is the hang-up: the
// reader takes what is left in the ring, then fails.
task<void> conn_state::bell_loop(std::shared_ptr<conn_state> s) {
  std::array<std::byte, 64> b;
  for (;;) {
    auto n = co_await s->sock.read_some(b);
    if (!n || *n == 0) break;
    s->pipe->rung();
  }
  s->pipe->gone = true;
  s->pipe->rung();
  s->loop_exited();
}

}  // namespace shuttle::detail::tcp_provider
