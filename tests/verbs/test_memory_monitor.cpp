// The memory monitor (lib/verbs/memory_monitor.hpp) and the registration
// cache it keeps correct (registration_cache.hpp), on regions that name no
// NIC memory: runs on any host with userfaultfd (exit 77 without).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "registration_cache.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

using namespace shuttle;
namespace vi = shuttle::detail::verbs_impl;

namespace {

constexpr std::size_t page = 4096;

// Records what the monitor reports, under its lock.
struct recorder final : vi::unmap_listener {
  vi::memory_monitor& m;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> seen;
  explicit recorder(vi::memory_monitor& mon) : m(mon) {
    seen.reserve(1024);  // on_unmapped must not allocate
    std::lock_guard g(m.lock());
    m.subscribe(*this);
  }
  ~recorder() {
    std::lock_guard g(m.lock());
    m.unsubscribe(*this);
  }
  void on_unmapped(std::uintptr_t b, std::uintptr_t e) noexcept override {
    if (seen.size() < seen.capacity()) seen.emplace_back(b, e);
  }
  // Whether a report covering [b, e) came, read under the lock: once the
  // call that dropped the pages returned, it must have.
  bool told(void* p, std::size_t len) {
    const auto b = reinterpret_cast<std::uintptr_t>(p), e = b + len;
    std::lock_guard g(m.lock());
    for (auto [sb, se] : seen)
      if (sb <= b && se >= e) return true;
    return false;
  }
};

std::byte* map_anon(std::size_t len, int flags = MAP_PRIVATE | MAP_ANONYMOUS, void* at = nullptr) {
  void* p = ::mmap(at, len, PROT_READ | PROT_WRITE, flags, -1, 0);
  REQUIRE(p != MAP_FAILED);
  std::memset(p, 0x5a, len);
  return static_cast<std::byte*>(p);
}

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

vi::memory_monitor& monitor() { return *vi::memory_monitor::instance(); }

// A stand-in for ibv_reg_mr: a region that names no NIC memory.
struct fake_registrar {
  int calls = 0;
  result<std::shared_ptr<vi::verbs_region>> operator()(std::span<std::byte> pages) {
    ++calls;
    auto r = std::make_shared<vi::verbs_region>();
    r->addr = pages.data();
    r->length = pages.size();
    r->access = access::local_write;
    return r;
  }
};

}  // namespace

TEST_CASE("monitor: munmap, madvise, mremap and MAP_FIXED are reported before they return") {
  auto& m = monitor();
  recorder rec(m);
  std::byte* p = map_anon(8 * page);
  REQUIRE_FALSE(m.watch(addr(p), addr(p) + 8 * page));

  SUBCASE("munmap of part of a watched mapping") {
    REQUIRE(::munmap(p + 2 * page, page) == 0);
    CHECK(rec.told(p + 2 * page, page));
    CHECK_FALSE(rec.told(p, page));  // the rest is still mapped
  }
  SUBCASE("madvise(MADV_DONTNEED): the same address, other pages") {
    REQUIRE(::madvise(p + page, 2 * page, MADV_DONTNEED) == 0);
    CHECK(rec.told(p + page, 2 * page));
    CHECK(p[page] == std::byte{0});  // what the process sees there now
  }
  SUBCASE("mremap moving pages away") {
    void* dst = map_anon(2 * page);
    void* moved = ::mremap(p + 4 * page, 2 * page, 2 * page, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
    REQUIRE(moved == dst);
    CHECK(rec.told(p + 4 * page, 2 * page));
    ::munmap(dst, 2 * page);
  }
  SUBCASE("mmap(MAP_FIXED) over watched pages") {
    std::byte* q = map_anon(page, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, p + 6 * page);
    REQUIRE(q == p + 6 * page);
    CHECK(rec.told(p + 6 * page, page));
  }
  SUBCASE("unmapped from another thread") {
    std::thread t([&] { REQUIRE(::munmap(p + 3 * page, page) == 0); });
    t.join();
    CHECK(rec.told(p + 3 * page, page));
  }
  ::munmap(p, 8 * page);
  CHECK(rec.told(p, page));
}

TEST_CASE("monitor: a large malloc'd block freed from the thread that watched it") {
  auto& m = monitor();
  recorder rec(m);
  constexpr std::size_t len = 4 << 20;  // above glibc's mmap threshold: free() unmaps it
  auto* p = static_cast<std::byte*>(std::malloc(len));
  REQUIRE(p);
  std::memset(p, 1, len);
  REQUIRE_FALSE(m.watch(addr(p), addr(p) + len));
  std::free(p);  // must not wait forever for the monitor
#if defined(__SANITIZE_ADDRESS__)
  MESSAGE("AddressSanitizer keeps freed blocks mapped (quarantine): no unmap to be told of");
#else
  CHECK(rec.told(p, page));
#endif
}

TEST_CASE("monitor: memory that can go away without an event is not watched") {
  auto& m = monitor();
  SUBCASE("shared anonymous") {
    std::byte* p = map_anon(2 * page, MAP_SHARED | MAP_ANONYMOUS);
    CHECK(m.watch(addr(p), addr(p) + 2 * page) == std::errc::not_supported);
    ::munmap(p, 2 * page);
  }
  SUBCASE("a memfd (a hole punched in it drops pages without an event)") {
    int fd = ::memfd_create("shuttle-test", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, 2 * page) == 0);
    void* p = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    REQUIRE(p != MAP_FAILED);
    CHECK(m.watch(addr(p), addr(p) + 2 * page) == std::errc::not_supported);
    ::munmap(p, 2 * page);
    ::close(fd);
  }
  SUBCASE("a range with a hole") {
    std::byte* p = map_anon(3 * page);
    REQUIRE(::munmap(p + page, page) == 0);
    CHECK(m.watch(addr(p), addr(p) + 3 * page) == std::errc::not_supported);
    ::munmap(p, 3 * page);
  }
}

TEST_CASE("cache: cached on the second sighting, dropped when the memory goes") {
  vi::registration_cache c(monitor());
  fake_registrar reg;
  constexpr std::size_t len = 16 * page;
  std::byte* p = map_anon(len);
  const auto a = addr(p) + 100;  // not page-aligned: the cache registers whole pages
  CHECK(c.find(a, 8000, false) == nullptr);
  CHECK_FALSE(c.seen_before(a, 8000));  // first sighting
  CHECK(c.seen_before(a, 8000));
  auto r = c.insert(a, 8000, reg);
  REQUIRE(r);
  CHECK(addr((*r)->addr) == addr(p));
  CHECK((*r)->length == 2 * page);
  CHECK(c.find(a, 8000, true) == *r);
  CHECK(c.find(addr(p), 2 * page, false) == *r);   // the same pages
  CHECK(c.find(addr(p), 2 * page + 1, false) == nullptr);  // past them
  CHECK(c.stats().inserted == 1);

  SUBCASE("unmapped") { REQUIRE(::munmap(p, len) == 0); }
  SUBCASE("one page of it dropped by madvise") { REQUIRE(::madvise(p + page, page, MADV_DONTNEED) == 0); }
  SUBCASE("mapped over at the same address") {
    REQUIRE(::munmap(p, len) == 0);
    REQUIRE(map_anon(len, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, p) == p);
  }
  CHECK(c.find(a, 8000, false) == nullptr);
  CHECK(c.stats().invalidated == 1);
  CHECK(c.size() == 0);
  CHECK(r->use_count() == 1);  // the cache let go of it: ours is the last reference
  ::munmap(p, len);
}

TEST_CASE("cache: other memory near a cached entry is not confused with it") {
  vi::registration_cache c(monitor());
  fake_registrar reg;
  std::byte* p = map_anon(8 * page);
  REQUIRE(c.insert(addr(p), page, reg));
  REQUIRE(c.insert(addr(p) + 4 * page, page, reg));
  CHECK(c.find(addr(p) + page, 8, false) == nullptr);  // between the two
  CHECK(c.find(addr(p) + 5 * page, 8, false) == nullptr);  // past the second
  REQUIRE(::munmap(p + 4 * page, page) == 0);
  CHECK(c.find(addr(p) + 4 * page, 8, false) == nullptr);
  CHECK(c.find(addr(p), 8, false) != nullptr);  // the other is untouched
  CHECK(c.stats().invalidated == 1);
  ::munmap(p, 8 * page);
}

TEST_CASE("cache: memory the monitor cannot watch is refused and not tried again") {
  vi::registration_cache c(monitor());
  fake_registrar reg;
  std::byte* p = map_anon(2 * page, MAP_SHARED | MAP_ANONYMOUS);
  const auto a = addr(p);
  CHECK_FALSE(c.seen_before(a, 64));
  REQUIRE(c.seen_before(a, 64));
  CHECK_FALSE(c.insert(a, 64, reg));
  CHECK(reg.calls == 0);  // refused before registering
  CHECK(c.stats().unwatchable == 1);
  CHECK_FALSE(c.seen_before(a, 64));  // remembered as unwatchable
  ::munmap(p, 2 * page);
}

TEST_CASE("cache: bounded; the least recently used entry goes") {
  vi::registration_cache c(monitor());
  fake_registrar reg;
  const std::size_t n = vi::registration_cache::max_entries + 8;
  std::byte* p = map_anon(n * 2 * page);
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(c.insert(addr(p) + i * 2 * page, page, reg));
    // Keep the first entry in use: it must survive the evictions.
    CHECK(c.find(addr(p), 8, false) != nullptr);
  }
  CHECK(c.size() == vi::registration_cache::max_entries);
  CHECK(c.stats().evicted == 8);
  CHECK(c.find(addr(p), 8, false) != nullptr);
  CHECK(c.find(addr(p) + 2 * page, 8, false) == nullptr);  // the second was the oldest unused
  ::munmap(p, n * 2 * page);
  CHECK(c.find(addr(p) + (n - 1) * 2 * page, 8, false) == nullptr);
  CHECK(c.size() == 0);
}

TEST_CASE("cache: unmaps racing lookups on another thread never leave a stale entry") {
  // One thread caches memory and maps other memory over it, over and over;
  // after each mmap returns, the entry must be gone.
  vi::registration_cache c(monitor());
  fake_registrar reg;
  std::byte* p = map_anon(4 * page);
  std::atomic<bool> stop{false};
  std::thread noise([&] {  // unmaps of other watched memory: events that race the inserts
    while (!stop.load()) {
      void* q = ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (q == MAP_FAILED) continue;
      (void)monitor().watch(addr(q), addr(q) + page);
      ::munmap(q, page);
    }
  });
  int cached = 0;
  for (int i = 0; i < 300; ++i) {
    auto r = c.insert(addr(p), 4 * page, reg);
    REQUIRE(r);
    if (c.find(addr(p), 8, false)) ++cached;
    // Mapped over in one call (no hole the other thread's mmap could take).
    REQUIRE(map_anon(4 * page, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, p) == p);
    CHECK(c.find(addr(p), 8, false) == nullptr);
  }
  stop = true;
  noise.join();
  MESSAGE("cached in " << cached << " of 300 rounds (the others raced an unrelated unmap)");
  ::munmap(p, 4 * page);
}

TEST_CASE("fork: the child has no monitor and its caches find nothing; the parent's is unchanged") {
  vi::registration_cache c(monitor());
  fake_registrar reg;
  std::byte* p = map_anon(4 * page);
  REQUIRE(c.insert(addr(p), 4 * page, reg));
  REQUIRE(c.find(addr(p), 8, false) != nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The child: its unmaps raise no event (the userfaultfd is bound to
    // the parent's address space), so nothing may be found or cached.
    int bad = 0;
    bad += vi::memory_monitor::instance() != nullptr;
    bad += vi::memory_monitor::usable();
    bad += vi::memory_monitor::unavailable_reason() != std::errc::not_supported;
    bad += c.find(addr(p), 8, false) != nullptr;
    bad += c.insert(addr(p) + page, page, reg).has_value();
    ::_exit(bad);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(vi::memory_monitor::usable());
  CHECK(c.find(addr(p), 8, false) != nullptr);
  ::munmap(p, 4 * page);
  CHECK(c.find(addr(p), 8, false) == nullptr);
}

int main(int argc, char** argv) {
  if (!vi::memory_monitor::instance()) {
    std::printf("no memory monitor in this process: %s (skipped)\n",
                vi::memory_monitor::unavailable_reason().message().c_str());
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
