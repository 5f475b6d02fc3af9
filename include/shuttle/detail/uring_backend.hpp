// uring_backend: the loop's calls for code that builds operations and
// completion sources on it (uring_op, the providers, pollers, Asio interop),
// kept out of the application's io_context, as Asio keeps them in its
// io_uring_service. Every io_context is one; io_context::backend() reaches
// it. Loop thread only.
#pragma once

#include <cstdint>
#include <vector>

#include <liburing.h>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/poller.hpp>

namespace shuttle::detail {

class uring_backend {
 public:
  uring_backend(const uring_backend&) = delete;
  uring_backend& operator=(const uring_backend&) = delete;

  // A free SQE (flushes the ring when the SQ is full; throws when it stays
  // full). The caller fills it and sets its user_data to an io_op.
  io_uring_sqe* get_sqe();
  // Asks the kernel to cancel the submission whose user_data is `target`;
  // the cancellation's own completion is ignored.
  void submit_cancel(const io_op* target);
  // The ring, for what liburing does on it directly (buffer rings).
  io_uring* ring() noexcept { return &ring_; }

  // Keeps `op` until forget_orphan (its last CQE) or the context's end,
  // which frees it.
  void adopt_orphan(orphan_op* op) noexcept;
  void forget_orphan(orphan_op* op) noexcept;

  // Puts `p` on the loop's poll list (poller.hpp: the contract), or takes
  // it off.
  void add_poller(poller& p);
  void remove_poller(poller& p) noexcept;

 protected:
  uring_backend() = default;
  ~uring_backend() = default;

  io_uring ring_{};
  std::vector<poller*> pollers_;
  std::vector<poller*> spin_pollers_;  // those of pollers_ that busy_poll(): the spin policy's
  orphan_op* orphans_ = nullptr;
  std::uint64_t sqes_ = 0;
};

}  // namespace shuttle::detail
