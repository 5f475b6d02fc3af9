// gpu_pipeline: a producer kernel fills chunk i while chunk i-1 is on the
// wire; the receiver is notified per chunk (write_with_imm), copies it in on
// its stream and a consumer kernel checksums it; checksums are verified end
// to end. Over the tcp provider (staged through pinned bounce buffers) on
// loopback, sender and receiver on one loop; --transport local or auto (the
// local provider: both ends are on this host) take the local provider.
//
//   shuttle-gpu-pipeline [MiB=256] [chunk KiB=1024] [rounds=16] [--transport tcp|local|auto]   (--help: more)
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/cuda/staged.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "cli.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

using namespace shuttle;

int main(int argc, char** argv) {
  std::size_t mib = 256, chunk_kib = 1024;
  unsigned rounds = 16;
  transport_kind kind = transport_kind::tcp;
  CLI::App app{"A staged GPU pipeline on loopback (tcp provider unless --transport), checksums verified per chunk.",
               "shuttle-gpu-pipeline"};
  cli::setup(app, "usage: shuttle-gpu-pipeline [MiB] [CHUNK_KiB] [ROUNDS] [--transport tcp|local|auto]\n");
  app.add_option_function<std::string>(
         "--transport", [&](const std::string& v) { kind = *parse_transport_kind(v); },
         "tcp (default), local or auto (automatic: the local provider, both ends being on this host)")
      ->type_name("T")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            auto k = parse_transport_kind(v);
            return k && *k != transport_kind::verbs ? "" : "bad value '" + v + "' (tcp, local, auto)";
          },
          "", "transport"));
  app.add_option("MiB", mib, "MiB to transfer (default 256)")->type_name("")->transform(cli::count(1, 1u << 16));
  app.add_option("CHUNK_KiB", chunk_kib, "KiB per chunk (default 1024)")->type_name("")->transform(cli::count(1, 1u << 20));
  app.add_option("ROUNDS", rounds, "compute rounds of the producer and consumer kernels, their load (default 16)")->type_name("")->transform(cli::count(1, 1u << 20));
  cli::parse(app, argc, argv);
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device");
    return 77;
  }
  const std::size_t len = mib << 20;
  const std::size_t chunk = chunk_kib << 10;
  const std::size_t chunks = (len + chunk - 1) / chunk;
  io_context ctx;
  domain_options dopt;
  dopt.kind = kind;
  auto sd = domain::open(dopt).value();
  auto cd = domain::open(dopt).value();
  auto l = sd.listen(endpoint::parse("127.0.0.1:0").value()).value();
  auto ep = endpoint::parse("127.0.0.1:" + std::to_string(l.local_endpoint()->port())).value();
  auto [server, client] = ctx.run(when_all(l.accept(), cd.connect(ep)));
  connection rx = std::move(server).value(), tx = std::move(client).value();

  cuda::gpu_registry reg(cd);
  cuda::staged_options o;
  o.chunk = chunk;
  auto [r, s] = ctx.run(when_all(cuda::gpu_receiver::open(rx, sd, o), cuda::gpu_sender::open(tx, cd, &reg)));
  auto rcv = std::move(r).value();
  auto snd = std::move(s).value();

  cuda::stream s_prod, s_cons;
  cuda::device_buffer src(len), dst(len);
  unsigned long long *sent_sums = nullptr, *recv_sums = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&sent_sums), chunks * 8), "cudaMalloc");
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&recv_sums), chunks * 8), "cudaMalloc");
  cuda::check(cudaMemset(sent_sums, 0, chunks * 8), "memset");
  cuda::check(cudaMemset(recv_sums, 0, chunks * 8), "memset");

  std::size_t notified = 0;
  auto produce = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t st) {
    cuda::check(cuda::kernels::produce(src.data() + off, n, off, 2024, rounds, st), "produce");
    cuda::check(cuda::kernels::checksum(src.data() + off, n, off, sent_sums + i, st), "checksum");
  };
  auto consume = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t st) {
    ++notified;  // per-chunk notification: the chunk's H2D copy is enqueued before this kernel
    cuda::check(cuda::kernels::consume(dst.data() + off, n, off, rounds, recv_sums + i, st), "consume");
  };
  auto t0 = std::chrono::steady_clock::now();
  auto [a, b] = ctx.run(when_all(snd.send(src.data(), len, s_prod, produce), rcv.recv(dst.data(), len, s_cons, consume)));
  ctx.run([&]() -> task<void> { (void)co_await cuda::wait(s_cons.get()); }());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!a || !b) {
    std::fprintf(stderr, "transfer failed: %s / %s\n", a ? "ok" : a.error().message().c_str(),
                 b ? "ok" : b.error().message().c_str());
    return 1;
  }
  std::vector<unsigned long long> ss(chunks), rs(chunks);
  cuda::check(cudaMemcpy(ss.data(), sent_sums, chunks * 8, cudaMemcpyDeviceToHost), "copy");
  cuda::check(cudaMemcpy(rs.data(), recv_sums, chunks * 8, cudaMemcpyDeviceToHost), "copy");
  std::size_t bad = 0;
  for (std::size_t i = 0; i < chunks; ++i)
    if (ss[i] != rs[i]) ++bad;
  std::printf("gpu_pipeline: %s, over %s\n  %zu MiB in %zu chunks of %zu KiB, path %s (%s), %zu notifications, %.1f ms, "
              "%.2f GB/s\n"
              "  checksums: %zu/%zu chunks match%s\n",
              cuda::describe_device(0).c_str(), to_string(tx.kind()), len >> 20, chunks, chunk >> 10, cuda::to_string(snd.path()),
              reg.register_memory(src.data(), len, 0)->reason.c_str(), notified, secs * 1e3,
              double(len) / secs / 1e9, chunks - bad, chunks, bad ? "  MISMATCH" : "");
  ctx.run([&]() -> task<void> {
    (void)co_await tx.close();
    (void)co_await rx.close();
  }());
  (void)cudaFree(sent_sums);
  (void)cudaFree(recv_sums);
  return bad ? 1 : 0;
}
