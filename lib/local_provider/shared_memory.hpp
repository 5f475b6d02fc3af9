// The local provider's shared blocks (shuttle/local.hpp): the process-wide
// table by address, which register_memory consults to tell a range that can
// be shared without a copy from any other memory.
#pragma once

#include <shuttle/local.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace shuttle::detail {

// Kinds of memory a peer may map (local_wire.hpp, the answer's `kind`):
// a host memfd passed along (SCM_RIGHTS), GPU memory whose CUDA IPC handle
// the answer carries, or cuMemCreate GPU memory whose POSIX fd is passed
// along (device_hooks.hpp). All with the same answer: a handle, an offset,
// a length.
enum class shared_kind : std::uint32_t { host_memfd = 1, cuda_ipc = 2, cuda_fd = 3 };

struct shared_block {
  int fd = -1;
  std::byte* base = nullptr;
  std::size_t size = 0;
  shared_kind kind = shared_kind::host_memfd;
  ~shared_block();
};

// The block that holds [addr, addr+len), if any.
std::shared_ptr<shared_block> find_shared_block(const std::byte* addr, std::size_t len);

namespace local_provider {
// A sealed memfd of `size` bytes (memfd_create + ftruncate + F_ADD_SEALS).
result<int> make_sealed_memfd(const char* name, std::size_t size);
// Whether `fd` is a memfd whose size cannot change (what we map from a
// peer: a shrinking file would fault our accesses), and its size.
result<std::size_t> check_sealed_memfd(int fd);
}  // namespace local_provider

}  // namespace shuttle::detail
