// Staged transfers between device buffers over the tcp provider, 1 B to
// 256 MiB, and a producer/consumer pipeline with per-chunk checksums.
#include <doctest/doctest.h>

#include "common.hpp"

#include <cstring>
#include <vector>

using namespace shuttle;

namespace {
task<void> open_channel(gpu_test::pair_t& p, cuda::gpu_sender& snd, cuda::gpu_receiver& rcv, cuda::staged_options o) {
  auto [r, s] = co_await when_all(cuda::gpu_receiver::open(p.server, *p.server_domain, o),
                                  cuda::gpu_sender::open(p.client, *p.client_domain, nullptr, o.sender_buffers));
  rcv = std::move(r).value();
  snd = std::move(s).value();
}
}  // namespace

TEST_CASE("staged transfers between device buffers, 1 B to 256 MiB") {
  io_context ctx;
  gpu_test::pair_t p;
  ctx.run(gpu_test::make_pair(p));
  cuda::gpu_sender snd;
  cuda::gpu_receiver rcv;
  cuda::staged_options o;
  o.chunk = 1 << 20;
  ctx.run(open_channel(p, snd, rcv, o));
  cuda::stream s_send, s_recv;
  const std::size_t max = std::size_t(256) << 20;
  cuda::device_buffer src(max), dst(max + 1);
  const std::size_t sizes[] = {1, 7, 4096, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (16 << 20) + 3, max};
  unsigned seed = 1;
  for (std::size_t n : sizes) {
    CAPTURE(n);
    ++seed;
    REQUIRE(cuda::kernels::fill_pattern(src.data(), n, 0, seed, s_send) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(dst.data(), 0, n + 1, s_recv) == cudaSuccess);  // one guard byte
    s_send.synchronize();
    s_recv.synchronize();
    auto [a, b] = ctx.run(when_all(snd.send(src.data(), n, s_send), rcv.recv(dst.data(), n, s_recv)));
    REQUIRE(a.has_value());
    REQUIRE(b.has_value());
    CHECK(snd.path() == cuda::gpu_path::staged);
    s_recv.synchronize();
    auto want = gpu_test::device_checksum(src.data(), n, 0, s_send);
    CHECK(gpu_test::device_checksum(dst.data(), n, 0, s_recv) == want);
    std::uint8_t guard = 0xff;
    REQUIRE(cudaMemcpy(&guard, dst.data() + n, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(guard == 0);  // nothing written past the end
    if (n <= 4096) {
      std::vector<std::byte> a1(n), b1(n);
      REQUIRE(cudaMemcpy(a1.data(), src.data(), n, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(b1.data(), dst.data(), n, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(std::memcmp(a1.data(), b1.data(), n) == 0);
    }
  }
  CHECK(snd.stats().bytes == rcv.stats().bytes);
  ctx.run(gpu_test::close_pair(p));
}

TEST_CASE("pipeline: producer per chunk, consumer per chunk, checksums end to end") {
  io_context ctx;
  gpu_test::pair_t p;
  ctx.run(gpu_test::make_pair(p));
  cuda::gpu_sender snd;
  cuda::gpu_receiver rcv;
  cuda::staged_options o;
  o.chunk = 256 << 10;
  o.sender_buffers = 2;
  o.receiver_slots = 3;
  ctx.run(open_channel(p, snd, rcv, o));
  cuda::stream s_send, s_recv;
  const std::size_t chunks = 24, len = chunks * o.chunk - 12345;  // a short last chunk
  cuda::device_buffer src(len), dst(len);
  unsigned long long* sums = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&sums), chunks * sizeof *sums) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(sums, 0, chunks * sizeof *sums, s_recv) == cudaSuccess);
  s_recv.synchronize();
  std::size_t produced = 0, consumed = 0;
  auto before = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t s) {
    CHECK(i == produced++);
    REQUIRE(cuda::kernels::produce(src.data() + off, n, off, 99, 8, s) == cudaSuccess);
  };
  auto after = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t s) {
    CHECK(i == consumed++);
    REQUIRE(cuda::kernels::consume(dst.data() + off, n, off, 8, sums + i, s) == cudaSuccess);
  };
  auto [a, b] = ctx.run(when_all(snd.send(src.data(), len, s_send, before), rcv.recv(dst.data(), len, s_recv, after)));
  REQUIRE(a.has_value());
  REQUIRE(b.has_value());
  CHECK(produced == chunks);
  CHECK(consumed == chunks);
  std::vector<unsigned long long> got(chunks);
  s_recv.synchronize();
  REQUIRE(cudaMemcpy(got.data(), sums, chunks * sizeof *sums, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (std::size_t i = 0; i < chunks; ++i) {
    std::size_t off = i * o.chunk, n = std::min<std::size_t>(o.chunk, len - off);
    CHECK(got[i] == cuda::kernels::pattern_checksum(n, off, 99));
  }
  (void)cudaFree(sums);
  ctx.run(gpu_test::close_pair(p));
}

TEST_CASE("staged: one bounce buffer and one slot; credits carry over between transfers") {
  // The smallest ring: every chunk waits for the credit of the one before
  // it, and the last credit of each transfer is read by the next one.
  io_context ctx;
  gpu_test::pair_t p;
  ctx.run(gpu_test::make_pair(p));
  cuda::gpu_sender snd;
  cuda::gpu_receiver rcv;
  cuda::staged_options o;
  o.chunk = 64 << 10;
  o.sender_buffers = 1;
  o.receiver_slots = 1;
  ctx.run(open_channel(p, snd, rcv, o));
  CHECK(snd.lookahead() >= 2);
  cuda::stream s_send, s_recv;
  const std::size_t len = 20 * o.chunk + 5;
  cuda::device_buffer src(len), dst(len);
  for (unsigned round = 0; round < 3; ++round) {
    CAPTURE(round);
    REQUIRE(cuda::kernels::fill_pattern(src.data(), len, 0, 40 + round, s_send) == cudaSuccess);
    auto [a, b] = ctx.run(when_all(snd.send(src.data(), len, s_send), rcv.recv(dst.data(), len, s_recv)));
    REQUIRE(a.has_value());
    REQUIRE(b.has_value());
    CHECK(gpu_test::device_checksum(dst.data(), len, 0, s_recv) == cuda::kernels::pattern_checksum(len, 0, 40 + round));
  }
  CHECK(snd.stats().chunks == 3 * 21);
  CHECK(rcv.stats().chunks == 3 * 21);
  // Every credit the receiver sent but the last was read by the sender.
  CHECK(snd.stats().credit_messages + 1 == rcv.stats().credit_messages);
  ctx.run(gpu_test::close_pair(p));
}

TEST_CASE("staged: the copy of a chunk waits for its producer, even a slow one") {
  // The source holds pattern A; the first chunk's producer spins before it
  // writes pattern B, and every later producer is queued behind it on the
  // same stream. A copy not ordered after its producer reads A; the
  // receiver must see B everywhere. (The earlier cases cannot tell: their
  // producers finish long before the loop starts copying, or the source
  // already holds what the producer writes.)
  io_context ctx;
  gpu_test::pair_t p;
  ctx.run(gpu_test::make_pair(p));
  cuda::gpu_sender snd;
  cuda::gpu_receiver rcv;
  cuda::staged_options o;
  o.chunk = 256 << 10;
  o.sender_buffers = 2;
  o.receiver_slots = 4;
  ctx.run(open_channel(p, snd, rcv, o));
  cuda::stream s_send, s_recv;
  const std::size_t chunks = 8, len = chunks * o.chunk - 777;
  const std::uint32_t seed_a = 7, seed_b = 8;
  REQUIRE(cuda::kernels::pattern_checksum(len, 0, seed_a) != cuda::kernels::pattern_checksum(len, 0, seed_b));
  cuda::device_buffer src(len), dst(len);
  REQUIRE(cuda::kernels::fill_pattern(src.data(), len, 0, seed_a, s_send) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(dst.data(), 0, len, s_recv) == cudaSuccess);
  s_send.synchronize();
  s_recv.synchronize();
  std::size_t produced = 0;
  auto before = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t s) {
    ++produced;
    // 100 ms: far longer than the loop takes to enqueue the first copy.
    if (i == 0) REQUIRE(cuda::kernels::spin(100'000'000, s) == cudaSuccess);
    REQUIRE(cuda::kernels::fill_pattern(src.data() + off, n, off, seed_b, s) == cudaSuccess);
  };
  auto [a, b] = ctx.run(when_all(snd.send(src.data(), len, s_send, before), rcv.recv(dst.data(), len, s_recv)));
  REQUIRE(a.has_value());
  REQUIRE(b.has_value());
  CHECK(snd.path() == cuda::gpu_path::staged);
  CHECK(produced == chunks);
  s_recv.synchronize();
  const auto got = gpu_test::device_checksum(dst.data(), len, 0, s_recv);
  CHECK(got != cuda::kernels::pattern_checksum(len, 0, seed_a));  // the copies did not read the old source
  CHECK(got == cuda::kernels::pattern_checksum(len, 0, seed_b));
  ctx.run(gpu_test::close_pair(p));
}
