// A byte stream under the engine's reader and writer in place of the
// socket: the local provider's shared-memory rings (lib/local_provider/
// ring.hpp). The engine's frames, credits, order and checks are the same
// over either; only where the bytes go differs. The socket stays open next
// to a pipe: the peer rings its doorbell there (a byte, only while we
// sleep), and its hang-up closes it (conn_state::bell_loop).
//
// While the engine's reader (or writer) waits on a pipe, the pipe is one of
// the loop's pollers (busy_poll() false: it does not make the loop spin by
// itself): every turn of the loop looks at the peer's index without a
// syscall, and only a loop about to sleep tells the peer to ring
// (try_enter_interrupt_mode: arm_reader/arm_writer, a Dekker pair with the
// peer's publish). So a loop that spins (io_context::options::
// ring_spin_budget: a poller's work extends it) takes the peer's bytes from
// shared memory alone, and one that sleeps costs the peer one doorbell.
#pragma once

#include <shuttle/poller.hpp>
#include <shuttle/result.hpp>
#include <shuttle/sync.hpp>

#include <sys/uio.h>

#include <cstddef>
#include <span>

namespace shuttle::detail::tcp_provider {

struct byte_pipe : poller {
  byte_pipe() = default;
  byte_pipe(const byte_pipe&) = delete;
  byte_pipe& operator=(const byte_pipe&) = delete;
  ~byte_pipe() override;

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
  // All of `v` as one record, or nothing (no room for all of it, larger
  // than a record, or `fault`): false, and nothing was written. A small
  // SEND from the application's call (conn_state::try_pipe_send).
  virtual bool try_write_now(std::span<iovec> v) noexcept = 0;
  // About to sleep on `readable` (`writable`): tells the peer to ring, then
  // looks again. False: no sleep (something there, or the peer is gone).
  virtual bool arm_reader() noexcept = 0;
  virtual bool arm_writer() noexcept = 0;
  virtual void disarm_reader() noexcept = 0;
  // Whether the peer has published bytes we have not taken (a look, no check).
  virtual bool readable_now() const noexcept = 0;
  // Whether the peer has taken bytes since our last write_now (room freed).
  virtual bool writable_now() const noexcept = 0;
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

  // The poller (pipe.cpp). wait_begin/wait_end bracket a wait on
  // `readable` (`writable`): the pipe is a poller of `ctx` while either waits.
  void wait_begin(io_context& ctx, bool reading);
  void wait_end(bool reading) noexcept;
  bool poll() override;
  bool try_enter_interrupt_mode() override;
  void exit_interrupt_mode() override;
  bool busy_poll() const noexcept override { return false; }

 private:
  io_context* polled_by_ = nullptr;
  bool wait_read_ = false, wait_write_ = false;
};

}  // namespace shuttle::detail::tcp_provider
