// Counters the local provider keeps for tests and diagnostics (internal).
#pragma once

#include <cstdint>

namespace shuttle::detail {

// One-sided accesses the calling thread's local-provider connections did
// on their own mapping of the peer's memory (not through the socket).
std::uint64_t local_direct_accesses() noexcept;
// Writes and reads the calling thread's local-provider connections did as
// a copy on the GPU (GPU memory on either side; device.cpp).
std::uint64_t local_gpu_copies() noexcept;
// Connections the calling thread mapped shared-memory rings for (ring.hpp),
// and the bytes its connections published into them.
std::uint64_t local_ring_pipes() noexcept;
std::uint64_t local_ring_bytes() noexcept;
// SENDs the calling thread's connections wrote into a ring from the
// application's call (tcp_provider::conn_state::try_pipe_send).
std::uint64_t local_ring_sends() noexcept;

}  // namespace shuttle::detail
