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

}  // namespace shuttle::detail
