// Host memory for the local transport provider (transport_kind::local):
// what it shares with peers on the same host without a copy.
//
// A block is a memfd (sealed: it can neither shrink nor grow, so that no
// process mapping it can be made to fault) mapped shared. A region that the
// local provider registers inside a block is opened to a peer, the first
// time the peer names its rkey, by passing the memfd (SCM_RIGHTS): from
// then on the peer's write, read and atomics on it are a memcpy or an
// std::atomic_ref on its own mapping, without this process's loop. Memory
// from anywhere else registers as well and is accessed through the
// connection's socket, as on the tcp provider (lib/local_provider/README.md).
//
// What a peer is handed is the whole block's descriptor: a peer process is
// trusted not to touch the block outside the regions it holds keys to (a
// hostile peer could). Allocate one block per thing to expose.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include <shuttle/result.hpp>

namespace shuttle {

namespace detail {
struct shared_block;
}

class shared_memory {
 public:
  // `size` bytes (rounded up to pages), zero-filled. Any thread; no
  // io_context needed.
  static result<shared_memory> allocate(std::size_t size);

  shared_memory() noexcept = default;
  explicit shared_memory(std::shared_ptr<detail::shared_block> b) noexcept : block_(std::move(b)) {}

  std::byte* data() const noexcept;
  std::size_t size() const noexcept;
  std::span<std::byte> span() const noexcept { return {data(), size()}; }
  explicit operator bool() const noexcept { return static_cast<bool>(block_); }

 private:
  // A registration holds the block too: freeing the memory while it is
  // registered leaves it mapped until the registration goes.
  std::shared_ptr<detail::shared_block> block_;
};

}  // namespace shuttle
