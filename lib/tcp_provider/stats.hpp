// Counters the tcp provider keeps for tests and diagnostics (internal).
#pragma once

#include <cstddef>
#include <cstdint>

namespace shuttle::detail {

// Bytes of receive buffers held by every tcp-provider connection of the
// process (a slot's buffer is allocated when a message first arrives for it).
std::size_t tcp_receive_buffer_bytes() noexcept;

// WRITE_LIST frames (tcp_wire) sent and received by every connection of the
// process (the tcp and the local provider's engine).
struct tcp_list_counts {
  std::uint64_t sent = 0, received = 0;
};
tcp_list_counts tcp_list_frames() noexcept;

// Whether connections set up from now on announce that they read
// WRITE_LIST (default: on). Off, a connection behaves as a peer that
// predates the frame: its peer sends it single WRITEs. For tests.
void tcp_announce_write_list(bool on) noexcept;

}  // namespace shuttle::detail
