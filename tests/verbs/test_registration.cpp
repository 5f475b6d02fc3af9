// The verbs provider's registration search (lib/verbs/registration.hpp),
// on regions that name no NIC memory: runs on any host.
#include <doctest/doctest.h>

#include "registration.hpp"

#include <map>
#include <memory>
#include <vector>

using namespace shuttle;
using shuttle::detail::verbs_impl::find_cover;
using shuttle::detail::verbs_impl::normalize_access;
using shuttle::detail::verbs_impl::verbs_region;

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
