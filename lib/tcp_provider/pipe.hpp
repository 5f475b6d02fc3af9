// A byte stream under the engine's reader and writer in place of the
// socket: the local provider's shared-memory rings (lib/local_provider/
// ring.hpp). The engine's frames, credits, order and checks are the same
// over either; only where the bytes go differs. The socket stays open next
// to a pipe: the peer rings its doorbell there (a byte, only while we
// sleep), and its hang-up closes it (conn_state::bell_loop).
#pragma once

#include <shuttle/result.hpp>
#include <shuttle/sync.hpp>

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <span>

namespace shuttle::detail::tcp_provider {

// How long a reader with nothing to read polls the pipe (by loop turns)
// before it sleeps and has the peer ring. 0: polling by loop turns cost
// the spin time itself per message between processes (docs/measurements.md,
// 2026-12-06): a busy-polled pipe belongs in the loop's pollers (to do).
inline constexpr std::chrono::microseconds pipe_spin{0};

struct byte_pipe {
  byte_pipe() = default;
  byte_pipe(const byte_pipe&) = delete;
  byte_pipe& operator=(const byte_pipe&) = delete;
  virtual ~byte_pipe() = default;

  // Copies what the peer has published (up to buf.size()) into `buf`;
  // returns how many bytes (0: wait, arm_reader). Errors: protocol_error
  // (a bad index: kept in `fault`), eof (the peer hung up, nothing left).
  virtual result<std::size_t> read_now(std::span<std::byte> buf) noexcept = 0;
  // As read_now, into `v` (consumed from its front, in place), publishing
  // once for all of it: a list frame's payloads are many buffers, and each
  // publish is a store to a line the peer polls and a fence.
  virtual result<std::size_t> read_now_v(std::span<iovec>& v) noexcept = 0;
  // Copies what fits of `v` (consumed from its front, in place) and
  // publishes it. Error: protocol_error (`fault`).
  virtual result<void> write_now(std::span<iovec>& v) noexcept = 0;
  // About to sleep on `readable` (`writable`): tells the peer to ring, then
  // looks again. False: no sleep (something there, or the peer is gone).
  virtual bool arm_reader() noexcept = 0;
  virtual bool arm_writer() noexcept = 0;
  virtual void disarm_reader() noexcept = 0;
  // Whether the peer has published bytes we have not taken (a look, no check).
  virtual bool readable_now() const noexcept = 0;
  virtual void disarm_writer() noexcept = 0;

  // Set by the bell loop: a doorbell (either sleeper may have something),
  // and the socket's end (the peer hung up).
  event readable, writable;
  bool gone = false;
  std::error_code fault;  // a bad index from the peer: what the connection fails with
  void rung() noexcept {
    readable.set();
    writable.set();
  }
};

}  // namespace shuttle::detail::tcp_provider
