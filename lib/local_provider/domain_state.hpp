// The local provider's domain state (internal): the tcp engine's domain
// (lib/tcp_provider/domain_state.hpp: the rkey table every access through
// the socket is checked against, and the grants) and, for registrations
// inside a shared block (shuttle/local.hpp), the key table peers check
// before each access they make on their own mapping.
#pragma once

#include "local_wire.hpp"
#include "shared_memory.hpp"

#include "../tcp_provider/domain_state.hpp"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace shuttle::detail::local_provider {

namespace tp = tcp_provider;

struct domain_state;

// A registration. Its rkey is the engine's (tp::tcp_region, in the
// engine's table): the target's reader checks accesses through the socket
// against it. Inside a shared block it also holds a key-table word, which
// carries its rkey while it is registered: a peer that mapped the block
// checks the word before each access of its own, so that deregistering
// stops peers' direct accesses as it stops the socket's.
//
// GPU memory (device_hooks.hpp) is always shared: its CUDA IPC handle goes
// in the answer, and it has no engine region (the engine's reader would
// touch it with the CPU), so an access through the socket finds no such key.
struct local_region final : region_impl {
  std::shared_ptr<domain_state> dom;
  std::shared_ptr<tp::tcp_region> engine;  // null for GPU memory
  std::shared_ptr<shared_block> block;  // null: not shared, accessed through the socket only
  std::uint32_t slot = 0;               // block's or GPU memory's: its key-table word
  bool gpu = false;                     // GPU memory: exported as `handle`, the region at `gpu_offset` in it
  gpu_handle handle{};
  std::uint64_t gpu_offset = 0;
  int gpu_fd = -1;              // cuMemCreate memory: exported as this fd instead (of gpu_size bytes)
  std::uint64_t gpu_size = 0;
  bool host_range = false;  // in dom->host_ranges
  bool shared() const noexcept { return block || gpu; }
  ~local_region() override;
};

// One word per shared registration, in a sealed memfd that each peer maps
// read-only (the local hello passes it).
class key_table {
 public:
  static result<std::unique_ptr<key_table>> create();
  ~key_table();
  int fd() const noexcept { return fd_; }
  // A free word, or nothing (then the registration is not shared).
  std::optional<std::uint32_t> take() {
    if (free_.empty()) return std::nullopt;
    auto s = free_.back();
    free_.pop_back();
    return s;
  }
  void set(std::uint32_t slot, std::uint32_t rkey) noexcept {
    std::atomic_ref<std::uint64_t>(words_[slot]).store(rkey, std::memory_order_release);
  }
  void clear(std::uint32_t slot) noexcept {
    set(slot, 0);
    free_.push_back(slot);
  }

 private:
  key_table() = default;
  int fd_ = -1;
  std::uint64_t* words_ = nullptr;
  std::vector<std::uint32_t> free_;
};

struct domain_state {
  std::shared_ptr<tp::domain_state> engine = std::make_shared<tp::domain_state>();
  std::unique_ptr<key_table> keys;
  // Shared registrations by rkey: what a peer's query is answered from.
  std::unordered_map<std::uint32_t, std::weak_ptr<local_region>> shared;
  // Registrations by range and rights (as the tcp provider's cache).
  using cache_key = std::tuple<std::uintptr_t, std::size_t, unsigned>;
  std::map<cache_key, std::weak_ptr<local_region>> cache;
  // Host registrations' ranges, start -> end (one entry per registration).
  std::multimap<std::uintptr_t, std::uintptr_t> host_ranges;
};

// Whether [p, p + len) is device memory the CPU must not touch
// (device_hooks.hpp), the driver asked only where no host registration of
// `d` covers the range: memory registered as host memory stays host memory
// while it is registered (registering it checked, and it may not be freed
// meanwhile), and asking the driver costs about 0.6 us an operation.
bool is_device_memory(const device_hooks* h, const domain_state& d, const void* p, std::size_t len) noexcept;

}  // namespace shuttle::detail::local_provider
