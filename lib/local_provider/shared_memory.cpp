// shared_memory (shuttle/local.hpp): sealed memfd blocks, and the table by
// address that register_memory looks them up in.
#include "shared_memory.hpp"

#include <shuttle/error.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>

namespace shuttle::detail {

namespace {
// Blocks by base address. Any thread may allocate or free one: a mutex, off
// every hot path (allocation, registration).
std::mutex blocks_mutex;
std::map<std::uintptr_t, std::weak_ptr<shared_block>>& blocks() {
  static auto* m = new std::map<std::uintptr_t, std::weak_ptr<shared_block>>;  // never destroyed: static dtors
  return *m;
}
}  // namespace

shared_block::~shared_block() {
  {
    std::lock_guard lock(blocks_mutex);
    auto it = blocks().find(reinterpret_cast<std::uintptr_t>(base));
    if (it != blocks().end() && it->second.expired()) blocks().erase(it);
  }
  if (base) ::munmap(base, size);
  if (fd >= 0) ::close(fd);
}

std::shared_ptr<shared_block> find_shared_block(const std::byte* addr, std::size_t len) {
  std::lock_guard lock(blocks_mutex);
  auto& m = blocks();
  auto it = m.upper_bound(reinterpret_cast<std::uintptr_t>(addr));
  if (it == m.begin()) return nullptr;
  --it;
  auto b = it->second.lock();
  if (!b) return nullptr;
  auto off = reinterpret_cast<std::uintptr_t>(addr) - it->first;
  if (off > b->size || len > b->size - off) return nullptr;
  return b;
}

namespace local_provider {

result<int> make_sealed_memfd(const char* name, std::size_t size) {
  int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return errno_code(errno);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int e = errno;
    ::close(fd);
    return errno_code(e);
  }
  return fd;
}

result<std::size_t> check_sealed_memfd(int fd) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return std::make_error_code(std::errc::invalid_argument);  // not a memfd
  if (!(seals & F_SEAL_SHRINK) || (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)))
    return std::make_error_code(std::errc::invalid_argument);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_code(errno);
  return static_cast<std::size_t>(st.st_size);
}

}  // namespace local_provider
}  // namespace shuttle::detail

namespace shuttle {

result<shared_memory> shared_memory::allocate(std::size_t size) {
  if (size == 0) return std::make_error_code(std::errc::invalid_argument);
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  if (size > SIZE_MAX - page) return std::make_error_code(std::errc::not_enough_memory);
  size = (size + page - 1) / page * page;
  auto fd = detail::local_provider::make_sealed_memfd("shuttle-shared", size);
  if (!fd) return fd.error();
  auto b = std::make_shared<detail::shared_block>();
  b->fd = *fd;
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  if (p == MAP_FAILED) return errno_code(errno);  // b closes the fd
  b->base = static_cast<std::byte*>(p);
  b->size = size;
  std::lock_guard lock(detail::blocks_mutex);
  detail::blocks()[reinterpret_cast<std::uintptr_t>(p)] = b;
  return shared_memory(std::move(b));
}

std::byte* shared_memory::data() const noexcept { return block_ ? block_->base : nullptr; }
std::size_t shared_memory::size() const noexcept { return block_ ? block_->size : 0; }

}  // namespace shuttle
