// The engine over a byte pipe (pipe.hpp): the waits that the socket's
// awaits are otherwise, and the bell loop. Only a pipe's connections come
// here; the socket's path does not change.
#include "conn_state.hpp"

#include <array>
#include <cstdlib>

namespace shuttle::detail::tcp_provider {

namespace {
// pipe_spin, or SHUTTLE_PIPE_SPIN_US (microseconds; read once) for measurements.
std::chrono::microseconds spin_time() noexcept {
  static const std::chrono::microseconds t = [] {
    const char* e = std::getenv("SHUTTLE_PIPE_SPIN_US");
    return e ? std::chrono::microseconds(std::strtoul(e, nullptr, 10)) : pipe_spin;
  }();
  return t;
}
}  // namespace

// Sleeps until the peer rings (or hangs up, or the loops stop), unless the
// pipe has something once the peer has been told to ring: the flag is set
// before the last look, so a publish after that look rings (no lost wakeup).
task<result<void>> conn_state::pipe_wait(bool reading) {
  // Hung up: the reader's read_now says eof once the ring is empty; a
  // writer that waits for room would wait for ever (nobody rings).
  if (pipe->gone) co_return reading ? result<void>{} : result<void>(err(errc::disconnected));
  if (reading) {
    // A peer that answers within pipe_spin (a ping-pong, a stream) is
    // waited for by turns of the loop (other work runs meanwhile), not by
    // sleeping: no doorbell, no syscall, on either side.
    const auto until = clock::now() + spin_time();
    while (clock::now() < until) {
      co_await yield();
      if (stop.stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
      if (pipe->readable_now() || pipe->gone) co_return result<void>{};
    }
  }
  event& e = reading ? pipe->readable : pipe->writable;
  e.reset();
  if (!(reading ? pipe->arm_reader() : pipe->arm_writer())) co_return result<void>{};
  auto r = co_await e.wait();
  if (reading) pipe->disarm_reader();
  else pipe->disarm_writer();
  co_return r;
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
