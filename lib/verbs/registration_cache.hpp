// The domain's cache of registrations of memory it does not own, kept
// correct by the memory monitor: an entry whose pages go away (munmap,
// mremap, madvise) is dead before the call that dropped them returns, and is
// never found again (docs/memory-registration.md). Memory the monitor cannot
// watch (shared or file-backed pages, or no monitor at all) is never cached:
// the domain stages or registers it per operation as before.
//
// Threads: the domain's loop calls find/insert; the monitor's thread calls
// on_unmapped. Both under the monitor's lock, during which nothing here
// allocates or frees: entries leave the map as nodes into a graveyard whose
// capacity was reserved up front, and are freed (deregistered) after the
// lock is let go.
#pragma once

#include "memory_monitor.hpp"
#include "registration.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <span>

namespace shuttle::detail::verbs_impl {

class registration_cache final : public unmap_listener {
 public:
  // At most this many entries, pinning at most this many bytes (and at
  // most half of RLIMIT_MEMLOCK, which the user's own registrations count
  // against too); past either, the least recently used entry goes.
  static constexpr std::size_t max_entries = 256;
  static constexpr std::size_t max_bytes = std::size_t(1) << 30;

  struct counters {
    std::uint64_t inserted = 0;     // registrations made for the cache
    std::uint64_t invalidated = 0;  // entries dropped because their pages went away
    std::uint64_t evicted = 0;      // entries dropped for room
    std::uint64_t raced = 0;        // registrations not cached: memory went away while they were made
    std::uint64_t unwatchable = 0;  // sources the monitor cannot watch (not private anonymous memory)
  };

  explicit registration_cache(memory_monitor& m) : mon_(m) {
    if (rlimit lim{}; ::getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
      bytes_cap_ = std::min<std::size_t>(bytes_cap_, lim.rlim_cur / 2);
    graveyard_.reserve(max_entries + 1);
    std::lock_guard g(mon_.lock());
    mon_.subscribe(*this);
  }
  ~registration_cache() {
    std::lock_guard g(mon_.lock());
    mon_.unsubscribe(*this);
    // entries_ is destroyed after the lock is let go (deregistrations free memory)
  }
  registration_cache(const registration_cache&) = delete;
  registration_cache& operator=(const registration_cache&) = delete;

  // A live entry covering [a, a+len) (with local write if asked), else null.
  std::shared_ptr<verbs_region> find(std::uintptr_t a, std::size_t len, bool need_write) {
    std::shared_ptr<verbs_region> out;
    if (!memory_monitor::usable()) return out;  // a child of fork(): no events here
    {
      std::lock_guard g(mon_.lock());
      if (dead_) bury_dead_locked();
      auto it = entries_.upper_bound(a);
      for (int steps = 0; it != entries_.begin() && steps < 16; ++steps) {
        --it;
        entry& e = it->second;
        if (a < e.end && len <= e.end - a && (!need_write || (e.region->access & access::local_write))) {
          e.used = ++tick_;
          out = e.region;  // an atomic increment: no allocation
          break;
        }
      }
    }
    graveyard_.clear();
    return out;
  }

  // Whether [a, a+len) missed the cache recently too (and may be watched):
  // memory used once is staged or registered for its operation, not
  // cached. The domain's loop only.
  bool seen_before(std::uintptr_t a, std::size_t len) noexcept {
    sighting& s = seen_[(a >> 6 ^ len) % seen_.size()];
    if (s.addr == a && s.len == len) return !s.unwatchable;
    s = {a, len, false};
    return false;
  }

  // Registers the pages of [a, a+len) with `reg(span) -> result<shared_ptr<verbs_region>>`
  // and caches the registration, once the monitor watches them; an error
  // when it cannot watch them (the caller takes another path). The
  // registration is returned even when it could not be cached.
  template <class Register>
  result<std::shared_ptr<verbs_region>> insert(std::uintptr_t a, std::size_t len, Register&& reg) {
    constexpr std::uintptr_t page = 4096;
    const std::uintptr_t pb = a & ~(page - 1), pe = (a + len + page - 1) & ~(page - 1);
    const std::uint64_t events = mon_.events();
    if (auto ec = mon_.watch(pb, pe)) {
      seen_[(a >> 6 ^ len) % seen_.size()] = {a, len, true};
      ++c_.unwatchable;
      return ec;
    }
    auto r = reg(std::span<std::byte>(reinterpret_cast<std::byte*>(pb), pe - pb));
    if (!r) return r.error();
    map_type made;  // the node is allocated here, outside the lock
    made.emplace(pb, entry{pe, *r, 0, false});
    auto node = made.extract(made.begin());
    {
      std::lock_guard g(mon_.lock());
      if (mon_.events() != events) {
        // Something was unmapped while registering: perhaps these pages.
        ++c_.raced;
      } else if (pe - pb <= bytes_cap_) {  // (larger: serves this operation alone)
        if (dead_) bury_dead_locked();
        while (!entries_.empty() && (entries_.size() >= max_entries || bytes_ + (pe - pb) > bytes_cap_))
          evict_locked();
        node.mapped().used = ++tick_;
        bytes_ += pe - pb;
        entries_.insert(std::move(node));
        ++c_.inserted;
      }
    }
    graveyard_.clear();
    return r;
  }

  counters stats() const noexcept { return c_; }
  std::size_t size() const {
    std::lock_guard g(mon_.lock());
    return entries_.size();
  }

 private:
  struct entry {
    std::uintptr_t end;
    std::shared_ptr<verbs_region> region;
    std::uint64_t used;
    bool dead;
  };
  using map_type = std::multimap<std::uintptr_t, entry>;
  struct sighting {
    std::uintptr_t addr = 0;
    std::size_t len = 0;
    bool unwatchable = false;
  };

  void on_unmapped(std::uintptr_t begin, std::uintptr_t end) noexcept override {
    for (auto it = entries_.begin(); it != entries_.end() && it->first < end; ++it)
      if (it->second.end > begin && !it->second.dead) {
        it->second.dead = true;
        ++dead_;
      }
  }
  void bury_dead_locked() noexcept {
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      if (it->second.dead) {
        bytes_ -= it->second.end - it->first;
        graveyard_.push_back(entries_.extract(it));  // within the reserved capacity
        ++c_.invalidated;
      }
      it = next;
    }
    dead_ = 0;
  }
  void evict_locked() noexcept {
    auto lru = entries_.begin();
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->second.used < lru->second.used) lru = it;
    bytes_ -= lru->second.end - lru->first;
    graveyard_.push_back(entries_.extract(lru));
    ++c_.evicted;
  }

  memory_monitor& mon_;
  map_type entries_;                             // under mon_.lock()
  std::size_t dead_ = 0, bytes_ = 0;             // under mon_.lock()
  std::size_t bytes_cap_ = max_bytes;
  std::uint64_t tick_ = 0;                       // under mon_.lock()
  std::vector<map_type::node_type> graveyard_;   // filled under the lock, emptied after it
  std::array<sighting, 64> seen_{};              // the loop's
  counters c_{};
};

}  // namespace shuttle::detail::verbs_impl
