// The verbs provider's registration search (lib/verbs/registration.hpp),
// on regions that name no NIC memory: runs on any host.
#include <doctest/doctest.h>

#include "staging.hpp"

#include <cstring>
#include <map>
#include <algorithm>
#include <memory>
#include <vector>

using namespace shuttle;
using shuttle::detail::verbs_impl::find_cover;
using shuttle::detail::verbs_impl::normalize_access;
using shuttle::detail::verbs_impl::verbs_region;
namespace vi = shuttle::detail::verbs_impl;

namespace {

using region_map = std::multimap<std::uintptr_t, std::weak_ptr<verbs_region>>;

struct regions {
  region_map map;
  std::vector<std::shared_ptr<verbs_region>> held;
  std::uint64_t seq = 0;
  std::shared_ptr<verbs_region> add(std::uintptr_t addr, std::size_t len, unsigned acc) {
    auto r = std::make_shared<verbs_region>();  // no ibv_mr: nothing to deregister
    r->addr = reinterpret_cast<std::byte*>(addr);
    r->length = len;
    r->access = acc;
    r->seq = ++seq;
    map.emplace(addr, r);
    held.push_back(r);
    return r;
  }
};

}  // namespace

TEST_CASE("find_cover: the newest live registration that covers the range") {
  regions rs;
  auto a = rs.add(0x10000, 0x1000, access::local_write);
  auto b = rs.add(0x10000, 0x1000, access::local_write);  // the same range, newer
  CHECK(find_cover(rs.map, 0x10000, 0x1000, false) == b);
  CHECK(find_cover(rs.map, 0x10800, 0x100, true) == b);
  // Past its end, before its start, straddling the end: none.
  CHECK(find_cover(rs.map, 0x10f00, 0x101, false) == nullptr);
  CHECK(find_cover(rs.map, 0xff00, 0x10, false) == nullptr);
  CHECK(find_cover(rs.map, 0x11000, 1, false) == nullptr);
  // The newer one dropped by the user: the older one again.
  rs.held.erase(rs.held.begin() + 1);
  b.reset();
  CHECK(find_cover(rs.map, 0x10000, 0x1000, false) == a);
  // Both dropped: none, though their entries are still in the map.
  rs.held.clear();
  a.reset();
  CHECK(find_cover(rs.map, 0x10000, 0x1000, false) == nullptr);
}

TEST_CASE("find_cover: local write asked for, a read-only registration does not do") {
  regions rs;
  auto ro = rs.add(0x20000, 0x2000, 0);
  CHECK(find_cover(rs.map, 0x20000, 0x10, false) == ro);
  CHECK(find_cover(rs.map, 0x20000, 0x10, true) == nullptr);
  auto rw = rs.add(0x20000, 0x1000, access::local_write);
  CHECK(find_cover(rs.map, 0x20000, 0x10, true) == rw);
  CHECK(find_cover(rs.map, 0x21000, 0x10, true) == nullptr);  // only the read-only one covers it
  CHECK(find_cover(rs.map, 0x21000, 0x10, false) == ro);
}

TEST_CASE("find_cover: a larger registration lower down covers an address a smaller one above misses") {
  regions rs;
  auto big = rs.add(0x100000, 0x100000, access::local_write);
  rs.add(0x180000, 0x10, access::local_write);
  CHECK(find_cover(rs.map, 0x180008, 0x100, false) == big);
}

TEST_CASE("find_cover: looks at the 64 nearest entries at or below the address, no further") {
  regions rs;
  auto big = rs.add(0x1000000, 0x1000000, access::local_write);
  for (int i = 0; i < 63; ++i) rs.add(0x1001000 + std::uintptr_t(i) * 0x100, 0x10, access::local_write);
  CHECK(find_cover(rs.map, 0x1800000, 8, false) == big);  // 64th entry: found
  rs.add(0x1001000 + 63 * 0x100, 0x10, access::local_write);
  CHECK(find_cover(rs.map, 0x1800000, 8, false) == nullptr);  // 65th: out of reach (a transient registration then)
}

TEST_CASE("normalize_access: remote write and atomics bring local write; unknown bits dropped") {
  CHECK(normalize_access(0) == 0);
  CHECK(normalize_access(access::remote_read) == access::remote_read);
  CHECK(normalize_access(access::remote_write) == (access::remote_write | access::local_write));
  CHECK(normalize_access(access::remote_atomic) == (access::remote_atomic | access::local_write));
  CHECK(normalize_access(access::all | 0x100u) == access::all);
}

namespace {

// Registers nothing: a region per chunk, with the chunk's bounds, counted.
struct fake_registrar {
  int calls = 0;
  bool fail = false;
  shuttle::result<std::shared_ptr<verbs_region>> operator()(std::span<std::byte> m) {
    ++calls;
    if (fail) return std::make_error_code(std::errc::not_enough_memory);
    auto r = std::make_shared<verbs_region>();
    r->addr = m.data();
    r->length = m.size();
    return r;
  }
};

bool inside(const vi::staging_lease& l, std::size_t bytes) {
  auto a = reinterpret_cast<std::uintptr_t>(l.addr), base = reinterpret_cast<std::uintptr_t>(l.region->addr);
  return a >= base && a + bytes <= base + l.region->length;
}

}  // namespace

TEST_CASE("staging_pool: size classes, slots inside their chunk, no two leases overlap") {
  CHECK(vi::staging_class(1) == 0);
  CHECK(vi::staging_class(4096) == 0);
  CHECK(vi::staging_class(4097) == 1);
  CHECK(vi::staging_class(65536) == 4);
  auto pool = std::make_shared<vi::staging_pool>();
  fake_registrar reg;
  std::vector<vi::staging_lease> held;
  std::vector<std::pair<std::uintptr_t, std::size_t>> slots;  // address, slot size
  // Depth 128 at 4 KiB and at 64 KiB: every operation gets a slot (the old
  // pool had 32 and registered the rest per operation).
  for (std::size_t bytes : {std::size_t(4096), std::size_t(65536), std::size_t(100), std::size_t(20000)})
    for (int i = 0; i < 128; ++i) {
      auto l = pool->take(bytes, reg);
      REQUIRE(l);
      CHECK(inside(*l, bytes));
      CHECK(reinterpret_cast<std::uintptr_t>(l->addr) % vi::staging_min == 0);
      std::memset(l->addr, 0xab, bytes);  // the pages are mapped and writable
      slots.emplace_back(reinterpret_cast<std::uintptr_t>(l->addr), vi::staging_min << vi::staging_class(bytes));
      held.push_back(std::move(*l));
    }
  std::sort(slots.begin(), slots.end());
  for (std::size_t k = 1; k < slots.size(); ++k) CHECK(slots[k - 1].first + slots[k - 1].second <= slots[k].first);
  // 4 KiB x 256 + 64 KiB x 128 + 32 KiB x 128 = 13 MiB: 7 chunks of 2 MiB.
  CHECK(pool->registered_bytes() == 7 * vi::staging_chunk);
  CHECK(reg.calls == 7);
}

TEST_CASE("staging_pool: a slot comes back when its hold goes, and is used again") {
  auto pool = std::make_shared<vi::staging_pool>();
  fake_registrar reg;
  auto a = pool->take(4096, reg);
  REQUIRE(a);
  std::byte* addr = a->addr;
  a->hold.reset();
  auto b = pool->take(4096, reg);
  REQUIRE(b);
  CHECK(b->addr == addr);
  CHECK(reg.calls == 1);
}

TEST_CASE("staging_pool: stops at its cap and when registration fails, and a lease outlives the pool's owner") {
  auto pool = std::make_shared<vi::staging_pool>();
  fake_registrar reg;
  std::vector<vi::staging_lease> held;
  const std::size_t slots = vi::staging_cap / vi::staging_max;
  for (std::size_t i = 0; i < slots; ++i) {
    auto l = pool->take(65536, reg);
    REQUIRE(l);
    held.push_back(std::move(*l));
  }
  CHECK_FALSE(pool->take(65536, reg));
  CHECK_FALSE(pool->take(1, reg));  // every block is carved: smaller classes cannot grow either
  CHECK(pool->registered_bytes() == vi::staging_cap);
  auto fresh = std::make_shared<vi::staging_pool>();
  reg.fail = true;
  CHECK_FALSE(fresh->take(4096, reg));
  CHECK(fresh->registered_bytes() == 0);
  // The domain lets go of its pool while operations still hold slots: the
  // pages stay until the last hold goes.
  std::weak_ptr<vi::staging_pool> weak = pool;
  pool.reset();
  CHECK_FALSE(weak.expired());
  std::memset(held.back().addr, 1, 65536);
  held.clear();
  CHECK(weak.expired());
}

TEST_CASE("copy_or_register: stages until a registration is measured, then takes the cheaper, probing the other") {
  using vi::copy_or_register;
  copy_or_register c;
  const unsigned k = vi::staging_class(64 << 10), small = vi::staging_class(4096);
  auto count_staged = [&](unsigned cls, std::uint32_t n) {
    std::uint32_t staged = 0;
    for (std::uint32_t i = 0; i < n; ++i) staged += c.stage(cls);
    return staged;
  };
  // Nothing measured: stage, except every probe_min-th source, which is
  // registered so that its cost becomes known.
  CHECK(count_staged(k, copy_or_register::probe_min - 1) == copy_or_register::probe_min - 1);
  CHECK_FALSE(c.stage(k));
  // Copies three times dearer than registrations (an emulated guest):
  // register; copy every (3 x probe_min)-th source.
  c.copied(k, 150'000);
  c.registered(k, 50'000);
  CHECK(c.probe_interval(k) == 3 * copy_or_register::probe_min);
  CHECK(count_staged(k, 4 * c.probe_interval(k)) == 4);
  // The figures follow what is measured: copies became cheap again.
  for (int i = 0; i < 40; ++i) c.copied(k, 5'000);
  CHECK(c.copy_ns(k) < c.register_ns(k));
  const auto every = c.probe_interval(k);
  CHECK(every > copy_or_register::probe_min);
  CHECK(count_staged(k, 4 * every) == 4 * every - 4);
  // A path far dearer is probed at most every probe_max-th time.
  for (int i = 0; i < 200; ++i) c.registered(k, 1'000'000'000);
  CHECK(c.probe_interval(k) == copy_or_register::probe_max);
  // Each class on its own: the 4 KiB one has measured nothing.
  CHECK(c.register_ns(small) == 0);
  CHECK(c.probe_interval(small) == copy_or_register::probe_min);
  CHECK(count_staged(small, copy_or_register::probe_min - 1) == copy_or_register::probe_min - 1);
}
