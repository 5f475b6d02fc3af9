// The tcp provider's domain state (internal): the registration table, its
// cache, and the grants, shared by the domain, its regions and connections.
#pragma once

#include "wire.hpp"

#include "../transport/provider.hpp"
#include <shuttle/sync.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <system_error>
#include <tuple>
#include <unordered_map>

namespace shuttle::detail::tcp_provider {

using namespace tcp_wire;

inline std::error_code err(errc e) noexcept { return make_error_code(e); }

struct domain_state;

struct tcp_region final : region_impl {
  std::shared_ptr<domain_state> dom;
  ~tcp_region() override;
};

// A range of a registration granted to one connection (memory_grant).
struct grant_entry {
  const void* conn = nullptr;  // the conn_state it was granted on: the only one that may use it
  std::shared_ptr<tcp_region> region;
  std::byte* addr = nullptr;
  std::size_t length = 0;
  unsigned access = 0;
  std::uint32_t rkey = 0;
  bool revoked = false;
  std::size_t in_use = 0;  // accesses through it in progress (a payload being read in, a READ response out)
  event idle{true};        // in_use == 0
};

// One access through a grant in progress: revoke waits until the last ends.
class grant_use {
 public:
  grant_use() noexcept = default;
  explicit grant_use(std::shared_ptr<grant_entry> e) noexcept : e_(std::move(e)) {
    if (e_->in_use++ == 0) e_->idle.reset();
  }
  grant_use(grant_use&& o) noexcept : e_(std::move(o.e_)) {}
  grant_use& operator=(grant_use&& o) noexcept {
    if (this != &o) {
      release();
      e_ = std::move(o.e_);
    }
    return *this;
  }
  ~grant_use() { release(); }

 private:
  void release() noexcept {
    if (e_ && --e_->in_use == 0) e_->idle.set();
    e_.reset();
  }
  std::shared_ptr<grant_entry> e_;
};

struct domain_state {
  using cache_key = std::tuple<std::uintptr_t, std::size_t, unsigned>;
  std::unordered_map<std::uint32_t, std::weak_ptr<tcp_region>> table;
  std::map<cache_key, std::uint32_t> cache;
  // Unused random keys, drawn from the kernel's CSPRNG a batch at a time.
  std::array<std::uint32_t, 32> random_keys{};
  std::size_t random_left = 0;

  std::shared_ptr<tcp_region> find(std::uint32_t rkey) const {
    auto it = table.find(rkey);
    return it == table.end() ? nullptr : it->second.lock();
  }

  // An rkey a peer cannot predict from the ones it has seen: each is drawn
  // from getrandom (a key is all a peer needs to access a region).
  result<std::uint32_t> new_key();

  // Grants, by key (new_key's, as regions'): a peer cannot guess
  // another's, and it is honoured only on its own connection.
  std::unordered_map<std::uint32_t, std::shared_ptr<grant_entry>> grants;

  std::shared_ptr<grant_entry> find_grant(std::uint32_t rkey, const void* conn) const {
    auto it = grants.find(rkey);
    return it == grants.end() || it->second->conn != conn ? nullptr : it->second;
  }

  // No access through `e` starts from now on.
  void drop_grant(grant_entry& e) noexcept {
    if (auto it = grants.find(e.rkey); it != grants.end() && it->second.get() == &e) grants.erase(it);
    e.revoked = true;
  }
};

}  // namespace shuttle::detail::tcp_provider
