// Operations are type-erased by function pointer (as in Asio): the loop knows
// only io_op::complete, so an operation can resume a coroutine or invoke a
// callback without the loop caring which.
#pragma once

#include <cstdint>

namespace shuttle::detail {

// An io_uring submission's completion target; its address is the SQE's user_data.
struct io_op {
  using complete_fn = void (*)(io_op* self, int res, std::uint32_t cqe_flags) noexcept;
  complete_fn complete = nullptr;
};

// An operation whose owner is gone but whose kernel request may still
// complete (a listener closed while its multishot accept is armed). The
// context keeps it on a list and frees it if the ring is torn down first, so
// nothing leaks whichever comes first.
struct orphan_op : io_op {
  virtual ~orphan_op() = default;
  orphan_op* orphan_prev = nullptr;
  orphan_op* orphan_next = nullptr;
};

// Work handed to a loop from another thread, queued intrusively (no allocation
// when the node lives in the operation).
struct remote_op {
  using run_fn = void (*)(remote_op* self) noexcept;
  run_fn run = nullptr;
  // Set by ops that own themselves: called instead of run when the context
  // ends with the op still queued (it frees what it holds without running).
  run_fn discard = nullptr;
  remote_op* next = nullptr;
};

}  // namespace shuttle::detail
