// Registered buffers (io_uring fixed buffers): memory the ring pinned once,
// named by index in IORING_OP_READ_FIXED / WRITE_FIXED, so the kernel skips
// pinning and unpinning the pages of every operation.
#pragma once

#include <cstddef>
#include <memory>

namespace shuttle {
class io_context;
}

namespace shuttle::detail {

// Shared by a context and its registered buffers: `owner` becomes null when
// the context ends (the ring's teardown drops every registration).
struct buffer_table {
  io_context* owner = nullptr;
};

struct registered_buffer {
  std::shared_ptr<buffer_table> table;
  int index = -1;
  std::byte* data = nullptr;
  std::size_t size = 0;
  // Usable for fixed operations on `ctx`'s ring.
  bool usable_on(const io_context& ctx) const noexcept { return index >= 0 && table && table->owner == &ctx; }
};

}  // namespace shuttle::detail
