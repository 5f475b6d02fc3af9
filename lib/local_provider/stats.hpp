// Counters the local provider keeps for tests and diagnostics (internal).
#pragma once

#include <cstdint>

namespace shuttle::detail {

// One-sided accesses the calling thread's local-provider connections did
// on their own mapping of the peer's memory (not through the socket).
std::uint64_t local_direct_accesses() noexcept;

}  // namespace shuttle::detail
