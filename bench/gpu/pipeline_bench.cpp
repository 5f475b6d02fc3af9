// The staged GPU pipeline over the tcp provider (loopback, one loop), or
// over the local provider (--transport local: the same host, a Unix socket):
// producer kernel -> D2H -> write_with_imm -> H2D -> consumer kernel, per
// chunk. Measured in one run:
//   T_kernels   producer and consumer kernels over all chunks, no transfer
//               (two streams, as the pipeline runs them: the GPU's best)
//   T_transfer  the staged transfer alone, no kernels
//   T_pipeline  both, pipelined by the channel
//   T_serial    per chunk: kernel, await, copy+send one chunk, consume, await
// and the ratios bound/T_pipeline (bound = max(T_kernels, T_transfer),
// target >= 0.9) and T_serial/T_pipeline. T_kernels, T_transfer and
// T_pipeline are each the best of three or more runs, interleaved. The
// producer's cost is calibrated so that kernel time is at least 0.9 of the
// transfer time (doubling rounds; the hardest case is kernels ~ transfer).
// The sender's stall times say where a pipeline loses: waiting for a
// chunk's data (producer, D2H) or for credits (receiver slots).
//
//   gpu_pipeline_bench [MiB=512] [chunk KiB=2048] [sender buffers=2] [receiver slots=4] [--transport tcp|local]
//
// SHUTTLE_GPUS=A runs it on GPU A. Both ends share one loop here, so they
// share a GPU; the pipeline across two GPUs is shuttle-gpu-pipeline's
// (SHUTTLE_GPUS=A,B).
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/cuda/staged.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "../../examples/gpus_env.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>
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

task<void> open_all(setup& p, cuda::staged_options o, transport_kind kind) {
  domain_options d;
  d.kind = kind;
  p.sd.emplace(domain::open(d).value());
  p.cd.emplace(domain::open(d).value());
  p.l = p.sd->listen(endpoint::parse("127.0.0.1:0").value()).value();
  auto ep = endpoint::parse("127.0.0.1:" + std::to_string(p.l.local_endpoint()->port())).value();
  auto [s, c] = co_await when_all(p.l.accept(), p.cd->connect(ep));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
  auto [r, w] = co_await when_all(cuda::gpu_receiver::open(p.server, *p.sd, o),
                                  cuda::gpu_sender::open(p.client, *p.cd, nullptr, o.sender_buffers));
  p.rcv = std::move(r).value();
  p.snd = std::move(w).value();
}

double secs(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }
// CPU time of the calling thread (the loop's: the transfer is CPU-bound on it).
double thread_cpu() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}
}  // namespace

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  transport_kind kind = transport_kind::tcp;
  for (int i = 1; i < argc; ++i) {  // --transport K, taken out of the positional arguments
    if (std::string_view(argv[i]) != "--transport") continue;
    const std::string_view v = i + 1 < argc ? argv[i + 1] : "";
    if (v != "tcp" && v != "local") {
      std::fprintf(stderr, "gpu_pipeline_bench: --transport takes tcp or local\n");
      return 2;
    }
    kind = v == "tcp" ? transport_kind::tcp : transport_kind::local;
    for (int j = i; j + 2 <= argc; ++j) argv[j] = argv[j + 2];
    argc -= 2;
    break;
  }
  std::string why;
  const auto gpus = shuttle_gpus::from_env(cuda::device_count(), why);
  if (why.empty() && gpus.self != gpus.peer)
    why = "SHUTTLE_GPUS: both ends share one loop here, so one GPU (A); across two: shuttle-gpu-pipeline";
  if (!why.empty()) {
    std::fprintf(stderr, "gpu_pipeline_bench: %s\n", why.c_str());
    return 2;
  }
  cuda::check(cudaSetDevice(gpus.self), "cudaSetDevice");
  const std::size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 512;
  const std::size_t chunk = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2048) << 10;
  const std::size_t len = mib << 20, chunks = (len + chunk - 1) / chunk;
  std::printf("gpu_pipeline_bench: %s; %zu MiB in %zu chunks of %zu KiB, %s provider (staged)\n",
              cuda::describe_device(gpus.self).c_str(), mib, chunks, chunk >> 10,
              kind == transport_kind::local ? "local" : "tcp");
  io_context ctx;
  setup p;
  cuda::staged_options o;
  o.chunk = chunk;
  o.sender_buffers = argc > 3 ? unsigned(std::strtoul(argv[3], nullptr, 10)) : 2;
  o.receiver_slots = argc > 4 ? unsigned(std::strtoul(argv[4], nullptr, 10)) : 4;
  std::printf("  sender bounce buffers %u, receiver slots %u\n", o.sender_buffers, o.receiver_slots);
  ctx.run(open_all(p, o, kind));
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
  double launch_cpu = 0;  // the loop thread's CPU time per kernel launch, last kernels_only run
  auto kernels_only = [&](unsigned rp, unsigned rc, bool prod = true, bool cons = true) {
    auto t0 = clk::now();
    double c0 = thread_cpu();
    for (std::size_t i = 0; i < chunks; ++i) {
      std::size_t off = i * chunk, n = std::min(chunk, len - off);
      if (prod) (void)cuda::kernels::produce(src.data() + off, n, off, 5, rp, s1);
      if (cons) (void)cuda::kernels::consume(dst.data() + off, n, off, rc, sums + i, s2);
    }
    launch_cpu = (thread_cpu() - c0) / double(chunks * (unsigned(prod) + unsigned(cons)));
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
  double tx = std::min(transfer(0, 0, false), transfer(0, 0, false));
  // Calibrate the producer and consumer cost to at least 0.9 of the transfer time.
  unsigned rounds = 1;
  double tk = kernels_only(rounds, rounds);
  while (tk < 0.9 * tx && rounds < (1u << 16)) {
    rounds *= 2;
    tk = kernels_only(rounds, rounds);
  }
  // The loopback transfer's speed drifts by tens of percent between runs of
  // a few hundred milliseconds: the three quantities are measured
  // interleaved, three times; each is the best of its runs (T_transfer and
  // T_kernels counting those of the calibration too: a bound no worse).
  std::vector<unsigned long long> got(chunks);
  std::size_t bad = 0, checked = 0;
  double tp = 1e300;
  constexpr int reps = 3;
  cuda::transfer_stats stalls;  // the sender's, summed over the pipelined runs
  std::uint64_t credits_sent = 0;
  double transfer_cpu = 0, transfer_wall = 0, pipeline_cpu = 0, pipeline_wall = 0;  // the loop thread's
  double runs_tx[reps] = {}, runs_tp[reps] = {};
  for (int rep = 0; rep < reps; ++rep) {
    double c0 = thread_cpu();
    double t0 = transfer(0, 0, false);
    transfer_cpu += thread_cpu() - c0;
    transfer_wall += t0;
    tx = std::min(tx, t0);
    runs_tx[rep] = t0;
    tk = std::min(tk, kernels_only(rounds, rounds));
    const cuda::transfer_stats s0 = p.snd.stats(), r0 = p.rcv.stats();
    double c1 = thread_cpu();
    double t1 = transfer(rounds, rounds, true);
    pipeline_cpu += thread_cpu() - c1;
    pipeline_wall += t1;
    tp = std::min(tp, t1);
    runs_tp[rep] = t1;
    const cuda::transfer_stats& s1 = p.snd.stats();
    stalls.buffer_wait += s1.buffer_wait - s0.buffer_wait;
    stalls.data_wait += s1.data_wait - s0.data_wait;
    stalls.credit_wait += s1.credit_wait - s0.credit_wait;
    stalls.credit_waits += s1.credit_waits - s0.credit_waits;
    stalls.credit_messages += s1.credit_messages - s0.credit_messages;
    credits_sent += p.rcv.stats().credit_messages - r0.credit_messages;
    // Checksums of the pipelined run: the first 64 chunks and the last.
    cuda::check(cudaMemcpy(got.data(), sums, chunks * sizeof *sums, cudaMemcpyDeviceToHost), "copy");
    for (std::size_t i = 0; i < chunks; ++i) {
      if (i >= 64 && i + 1 != chunks) continue;
      std::size_t off = i * chunk, n = std::min(chunk, len - off);
      ++checked;
      if (got[i] != cuda::kernels::pattern_checksum(n, off, 5)) ++bad;
    }
  }
  double ts = serial(rounds, rounds);
  double tprod = kernels_only(rounds, rounds, true, false), tcons = kernels_only(rounds, rounds, false, true);
  double bound = std::max(tk, tx);
  auto gbs = [&](double t) { return double(len) / t / 1e9; };
  std::printf("producer/consumer rounds %u\n", rounds);
  std::printf("  T_kernels  %8.2f ms  (%6.2f GB/s)\n", tk * 1e3, gbs(tk));
  std::printf("  (producer alone %.2f ms, consumer alone %.2f ms)\n", tprod * 1e3, tcons * 1e3);
  std::printf("  T_transfer %8.2f ms  (%6.2f GB/s)\n", tx * 1e3, gbs(tx));
  std::printf("  T_pipeline %8.2f ms  (%6.2f GB/s)  checksums of %zu chunks in %d runs: %s\n", tp * 1e3, gbs(tp),
              checked, reps, bad ? "MISMATCH" : "ok");
  std::printf("  T_serial   %8.2f ms  (%6.2f GB/s)\n", ts * 1e3, gbs(ts));
  std::printf("  runs, in order: transfer");
  for (double t : runs_tx) std::printf(" %.1f", t * 1e3);
  std::printf(" ms; pipeline");
  for (double t : runs_tp) std::printf(" %.1f", t * 1e3);
  std::printf(" ms\n");
  auto ms = [](std::chrono::nanoseconds d) { return double(d.count()) / 1e6; };
  std::printf("  loop thread CPU: transfer runs %.0f%%, pipelined runs %.0f%% of their time (%.2f vs %.2f ms); "
              "%.1f us per kernel launch\n",
              100 * transfer_cpu / transfer_wall, 100 * pipeline_cpu / pipeline_wall, 1e3 * transfer_cpu / reps,
              1e3 * pipeline_cpu / reps, launch_cpu * 1e6);
  std::printf("  pipelined runs, sender (per run): lookahead %zu chunks; waited %.2f ms for a bounce buffer (wire "
              "busy), %.2f ms for data (GPU), %.2f ms for credits (%.0f of %zu chunks had none at hand and read "
              "messages); credit messages %.0f sent, %.0f read\n",
              p.snd.lookahead(), ms(stalls.buffer_wait) / reps, ms(stalls.data_wait) / reps,
              ms(stalls.credit_wait) / reps,
              double(stalls.credit_waits) / reps, chunks, double(credits_sent) / reps,
              double(stalls.credit_messages) / reps);
  std::printf("  bound/pipeline %.3f (target >= 0.9); serial/pipeline %.2fx\n", bound / tp, ts / tp);
  (void)cudaFree(sums);
  ctx.run([&]() -> task<void> {
    (void)co_await p.client.close();
    (void)co_await p.server.close();
  }());
  return bad ? 1 : 0;
}
