// Stream-ordered network operations (cuda/ordered.hpp) over the tcp provider:
// the operation reads its buffer only once the stream has reached the point
// of the call (a 2 ms spin kernel before the fill would otherwise let it
// send zeros), and a cancelled one posts nothing.
#include <doctest/doctest.h>

#include "common.hpp"

#include <shuttle/cuda/ordered.hpp>

#include <cstring>
#include <vector>

using namespace shuttle;

namespace {
constexpr std::size_t n = 1 << 20;
constexpr std::uint32_t seed = 77;

// A connected pair, a registered 1 MiB target on the server side, a pinned
// source on the client side, a stream.
struct fixture {
  io_context ctx;
  gpu_test::pair_t p;
  std::vector<std::byte> target = std::vector<std::byte>(n, std::byte{0});
  memory_region mr;
  cuda::pinned_buffer src{n};
  cuda::stream s;
  explicit fixture(int src_byte) {
    ctx.run(gpu_test::make_pair(p));
    mr = p.server_domain->register_memory(target, access::local_write | access::remote_write).value();
    std::memset(src.data(), src_byte, n);
  }
  ~fixture() { ctx.run(gpu_test::close_pair(p)); }
};

bool matches_pattern(const std::vector<std::byte>& v) {
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] != std::byte(cuda::kernels::pattern_byte(i, seed))) return false;
  return true;
}
}  // namespace

TEST_CASE("write_with_imm_after: the write carries what the stream produced before the call") {
  fixture f(0);
  auto& [ctx, p, target, mr, src, s] = f;
  REQUIRE(cuda::kernels::spin(2'000'000, s) == cudaSuccess);
  REQUIRE(cuda::kernels::fill_pattern(src.device_pointer(), n, 0, seed, s) == cudaSuccess);
  auto [w, m] = ctx.run(when_all(cuda::write_with_imm_after(s, p.client, src.span(), mr.remote(), 7), p.server.recv()));
  REQUIRE(w.has_value());
  REQUIRE(m.has_value());
  CHECK(m->imm() == std::optional<std::uint32_t>(7));
  CHECK(matches_pattern(target));
}

TEST_CASE("write_after: cancelled before the stream reaches the point, nothing is posted") {
  fixture f(0xab);
  auto& [ctx, p, target, mr, src, s] = f;
  REQUIRE(cuda::kernels::spin(50'000'000, s) == cudaSuccess);  // 50 ms
  auto timeout = []() -> task<void> { (void)co_await sleep_for(std::chrono::milliseconds(5)); };
  auto r = ctx.run(when_any(cuda::write_after(s, p.client, src.span(), mr.remote()), timeout()));
  REQUIRE(r.index() == 1);  // the timeout won; the write was cancelled while waiting for the stream
  s.synchronize();
  // A later operation on the same connection goes through, and the cancelled
  // write never reached the target.
  auto w = ctx.run(cuda::write_after(s, p.client, std::span(src.data(), 16), mr.remote(n - 16, 16)));
  REQUIRE(w.has_value());
  ctx.run([]() -> task<void> { (void)co_await sleep_for(std::chrono::milliseconds(5)); }());
  CHECK(target[0] == std::byte{0});
  CHECK(target[n - 1] == std::byte{0xab});
}
