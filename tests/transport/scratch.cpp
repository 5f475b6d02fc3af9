// lib/transport/scratch.hpp: a block list's large arrays are kept per
// thread from one list to the next (no page faulted in again), within the
// bounds; small ones are not kept.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "scratch.hpp"

#include <cstdint>
#include <memory>
#include <thread>

using shuttle::detail::scratch_cache;
using shuttle::detail::scratch_vector;

namespace {
constexpr std::size_t big = 4 << 20;  // bytes
}

TEST_CASE("a large array freed is handed out again, aligned, to the next of its size or a little smaller") {
  const void* first = nullptr;
  {
    scratch_vector<std::uint64_t> v(big / 8, 7);
    first = v.data();
    CHECK(reinterpret_cast<std::uintptr_t>(v.data()) % alignof(std::max_align_t) == 0);
  }
  const std::size_t kept = scratch_cache::kept_count();
  CHECK(kept >= 1);
  CHECK(scratch_cache::kept_bytes() >= big);
  {
    scratch_vector<std::uint64_t> v(big / 8);
    CHECK(v.data() == first);
    CHECK(scratch_cache::kept_count() == kept - 1);  // taken from the cache
    CHECK(v[0] == 0);  // value-initialized as any vector
  }
  {
    scratch_vector<char> v(big - 1000);
    CHECK(static_cast<const void*>(v.data()) == first);
  }
  {
    scratch_vector<char> v(big / 4);  // less than half of it: a block of its own
    CHECK(static_cast<const void*>(v.data()) != first);
  }
}

TEST_CASE("small arrays are not kept; another thread has its own blocks") {
  const std::size_t kept = scratch_cache::kept_count();
  scratch_vector<char>(1000).swap(*std::make_unique<scratch_vector<char>>());  // one made and freed
  CHECK(scratch_cache::kept_count() == kept);
  const void* big_at = nullptr;
  {
    scratch_vector<char> v(big);
    big_at = v.data();
  }
  std::thread([&] {
    scratch_vector<char> v(big);
    CHECK(static_cast<const void*>(v.data()) != big_at);  // the kept one is the other thread's
  }).join();
  scratch_vector<char> again(big);
  CHECK(static_cast<const void*>(again.data()) == big_at);
}

TEST_CASE("at most max_bytes and max_blocks are kept") {
  {  // More bytes than the bound, freed together.
    std::vector<scratch_vector<char>> many;
    for (std::size_t i = 0; i < scratch_cache::max_bytes / (12 << 20) + 2; ++i) many.emplace_back(12 << 20);
  }
  CHECK(scratch_cache::kept_bytes() <= scratch_cache::max_bytes);
  CHECK(scratch_cache::kept_bytes() >= (12 << 20));
  {  // More blocks than the bound: the larger ones stay.
    std::vector<scratch_vector<char>> many;
    for (std::size_t i = 0; i < scratch_cache::max_blocks + 4; ++i) many.emplace_back(scratch_cache::min_bytes + i);
  }
  CHECK(scratch_cache::kept_count() <= scratch_cache::max_blocks);
  CHECK(scratch_cache::kept_bytes() <= scratch_cache::max_bytes);
  // Two live arrays never share a block.
  scratch_vector<char> a(scratch_cache::min_bytes + 5), b(scratch_cache::min_bytes + 5);
  CHECK(a.data() != b.data());
}
