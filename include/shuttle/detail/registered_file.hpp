// Registered files (io_uring fixed files): a ring's table of file slots. An
// operation that names a slot (IOSQE_FIXED_FILE) skips the kernel's
// per-operation file lookup and reference count (fget/fput).
#pragma once

#include <cstdint>
#include <memory>

#include <liburing.h>

namespace shuttle {
class io_context;
}

namespace shuttle::detail {

// Shared by a context and the sockets registered in it: `owner` becomes null
// when the context ends (the ring's teardown drops every registration), so a
// socket that outlives its context only closes its fd.
struct file_table {
  io_context* owner = nullptr;
};

// What an SQE names: a slot of the submitting ring's table, or a plain fd.
struct sqe_file {
  int fd = -1;
  bool fixed = false;
  void mark(io_uring_sqe* sqe) const noexcept {
    if (fixed) sqe->flags |= IOSQE_FIXED_FILE;
  }
};

// A file descriptor with an optional slot in one context's table.
struct registered_file {
  std::shared_ptr<file_table> table;
  int slot = -1;
  // The slot, on `ctx`'s own ring; the fd anywhere else.
  sqe_file for_ring(const io_context& ctx, int fd) const noexcept {
    if (slot >= 0 && table->owner == &ctx) return {slot, true};
    return {fd, false};
  }
};

}  // namespace shuttle::detail
