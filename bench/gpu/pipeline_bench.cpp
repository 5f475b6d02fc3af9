// The staged GPU pipeline over the tcp provider (loopback, one loop):
// producer kernel -> D2H -> write_with_imm -> H2D -> consumer kernel, per
// chunk. Measured in one run:
//   T_kernels   producer and consumer kernels over all chunks, no transfer
//   T_transfer  the staged transfer alone, no kernels
//   T_pipeline  both, pipelined by the channel
//   T_serial    per chunk: kernel, await, copy+send one chunk, consume, await
// and the ratios bound/T_pipeline (bound = max(T_kernels, T_transfer),
// target >= 0.9) and T_serial/T_pipeline. The producer's cost is calibrated
// so that kernel and transfer time are about equal (the hardest case).
//
//   gpu_pipeline_bench [MiB=512] [chunk KiB=2048] [sender buffers=2] [receiver slots=4]
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/cuda/staged.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

using namespace shuttle;
using clk = std::chrono::steady_clock;

namespace {
struct setup {
  std::optional<domain> sd, cd;
  listener l;
  connection server, client;
  cuda::gpu_sender snd;
  cuda::gpu_receiver rcv;
};

task<void> open_all(setup& p, cuda::staged_options o) {
  domain_options d;
  d.kind = transport_kind::tcp;
  p.sd.emplace(domain::open(d).value());
  p.cd.emplace(domain::open(d).value());
  p.l = p.sd->listen(endpoint::parse("127.0.0.1:0").value()).value();
  auto ep = endpoint::parse("127.0.0.1:" + std::to_string(p.l.local_endpoint().port())).value();
  auto [s, c] = co_await when_all(p.l.accept(), p.cd->connect(ep));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
  auto [r, w] = co_await when_all(cuda::gpu_receiver::open(p.server, *p.sd, o),
                                  cuda::gpu_sender::open(p.client, *p.cd, nullptr, o.sender_buffers));
  p.rcv = std::move(r).value();
  p.snd = std::move(w).value();
}

double secs(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }
}  // namespace

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 512;
  const std::size_t chunk = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2048) << 10;
  const std::size_t len = mib << 20, chunks = (len + chunk - 1) / chunk;
  std::printf("gpu_pipeline_bench: %s; %zu MiB in %zu chunks of %zu KiB, tcp provider (staged)\n",
              cuda::describe_device(0).c_str(), mib, chunks, chunk >> 10);
  io_context ctx;
  setup p;
  cuda::staged_options o;
  o.chunk = chunk;
  o.sender_buffers = argc > 3 ? unsigned(std::strtoul(argv[3], nullptr, 10)) : 2;
  o.receiver_slots = argc > 4 ? unsigned(std::strtoul(argv[4], nullptr, 10)) : 4;
  std::printf("  sender bounce buffers %u, receiver slots %u\n", o.sender_buffers, o.receiver_slots);
  ctx.run(open_all(p, o));
  cuda::stream s1, s2;
  cuda::device_buffer src(len), dst(len);
  unsigned long long* sums = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&sums), chunks * sizeof *sums), "cudaMalloc");

  auto transfer = [&](unsigned rp, unsigned rc, bool kernels) {
    cuda::check(cudaMemset(sums, 0, chunks * sizeof *sums), "memset");
    cuda::chunk_fn before, after;
    if (kernels) {
      before = [&](std::size_t, std::size_t off, std::size_t n, cudaStream_t s) {
        (void)cuda::kernels::produce(src.data() + off, n, off, 5, rp, s);
      };
      after = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t s) {
        (void)cuda::kernels::consume(dst.data() + off, n, off, rc, sums + i, s);
      };
    }
    auto t0 = clk::now();
    auto [a, b] = ctx.run(when_all(p.snd.send(src.data(), len, s1, before), p.rcv.recv(dst.data(), len, s2, after)));
    ctx.run([&]() -> task<void> {
      (void)co_await cuda::wait(s2.get());
    }());
    double t = secs(t0);
    if (!a || !b) {
      std::fprintf(stderr, "transfer failed: %s / %s\n", a.error().message().c_str(), b.error().message().c_str());
      std::exit(1);
    }
    return t;
  };
  auto kernels_only = [&](unsigned rp, unsigned rc, bool prod = true, bool cons = true) {
    auto t0 = clk::now();
    for (std::size_t i = 0; i < chunks; ++i) {
      std::size_t off = i * chunk, n = std::min(chunk, len - off);
      if (prod) (void)cuda::kernels::produce(src.data() + off, n, off, 5, rp, s1);
      if (cons) (void)cuda::kernels::consume(dst.data() + off, n, off, rc, sums + i, s2);
    }
    s1.synchronize();
    s2.synchronize();
    return secs(t0);
  };
  auto serial = [&](unsigned rp, unsigned rc) {
    auto t0 = clk::now();
    ctx.run([&]() -> task<void> {
      for (std::size_t i = 0; i < chunks; ++i) {
        std::size_t off = i * chunk, n = std::min(chunk, len - off);
        (void)cuda::kernels::produce(src.data() + off, n, off, 5, rp, s1);
        (void)co_await cuda::wait(s1.get());
        auto [a, b] = co_await when_all(p.snd.send(src.data() + off, n, s1), p.rcv.recv(dst.data() + off, n, s2));
        if (!a || !b) std::exit(1);
        (void)cuda::kernels::consume(dst.data() + off, n, off, rc, sums + i, s2);
        (void)co_await cuda::wait(s2.get());
      }
    }());
    return secs(t0);
  };

  (void)transfer(0, 0, false);  // warm-up
  double tx = transfer(0, 0, false);
  // Calibrate the producer and consumer cost to about the transfer time.
  unsigned rounds = 1;
  double tk = kernels_only(rounds, rounds);
  while (tk < 0.9 * tx && rounds < (1u << 16)) {
    rounds *= 2;
    tk = kernels_only(rounds, rounds);
  }
  tk = kernels_only(rounds, rounds);
  double tp = transfer(rounds, rounds, true);
  // Verify the checksums of the pipelined run.
  std::vector<unsigned long long> got(chunks);
  cuda::check(cudaMemcpy(got.data(), sums, chunks * sizeof *sums, cudaMemcpyDeviceToHost), "copy");
  std::size_t bad = 0;
  for (std::size_t i = 0; i < chunks && i < 64; ++i) {
    std::size_t off = i * chunk, n = std::min(chunk, len - off);
    if (got[i] != cuda::kernels::pattern_checksum(n, off, 5)) ++bad;
  }
  double ts = serial(rounds, rounds);
  double tprod = kernels_only(rounds, rounds, true, false), tcons = kernels_only(rounds, rounds, false, true);
  double bound = std::max(tk, tx);
  auto gbs = [&](double t) { return double(len) / t / 1e9; };
  std::printf("producer/consumer rounds %u\n", rounds);
  std::printf("  T_kernels  %8.2f ms  (%6.2f GB/s)\n", tk * 1e3, gbs(tk));
  std::printf("  (producer alone %.2f ms, consumer alone %.2f ms)\n", tprod * 1e3, tcons * 1e3);
  std::printf("  T_transfer %8.2f ms  (%6.2f GB/s)\n", tx * 1e3, gbs(tx));
  std::printf("  T_pipeline %8.2f ms  (%6.2f GB/s)  checksums of first %zu chunks: %s\n", tp * 1e3, gbs(tp),
              std::min<std::size_t>(chunks, 64), bad ? "MISMATCH" : "ok");
  std::printf("  T_serial   %8.2f ms  (%6.2f GB/s)\n", ts * 1e3, gbs(ts));
  std::printf("  bound/pipeline %.3f (target >= 0.9); serial/pipeline %.2fx; credit waits %llu\n", bound / tp, ts / tp,
              (unsigned long long)p.snd.stats().credit_waits);
  (void)cudaFree(sums);
  ctx.run([&]() -> task<void> {
    (void)co_await p.client.close();
    (void)co_await p.server.close();
  }());
  return bad ? 1 : 0;
}
