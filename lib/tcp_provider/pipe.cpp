// The engine over a byte pipe (pipe.hpp): the waits that the socket's
// awaits are otherwise, and the bell loop. Only a pipe's connections come
// here; the socket's path does not change.
#include "conn_state.hpp"

#include <array>

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
