// Counters the tcp provider keeps for tests and diagnostics (internal).
#pragma once

#include <cstddef>

namespace shuttle::detail {

// Bytes of receive buffers held by every tcp-provider connection of the
// process (a slot's buffer is allocated when a message first arrives for it).
std::size_t tcp_receive_buffer_bytes() noexcept;

}  // namespace shuttle::detail
