// weights_push: loads a file into GPU memory with gpu_file and pushes it to
// a peer over the transport API while the rest is still being read:
//
//   disk --read_into--> GPU (sender) --staged channel, tcp provider--> GPU (receiver)
//
// A reader coroutine reads the file in pieces (`--piece-mib`, each one
// read_into with its chunks in flight); after each piece it raises a
// stream_flag. The staged sender's producer for chunk i makes the stream
// wait on that flag (cuStreamWaitValue32), then checksums the chunk on the
// GPU: the chunk goes on the wire as soon as its piece has landed, while
// the next piece is read. The receiver checksums every chunk on its GPU
// after the chunk's copy; every chunk's two checksums are compared, and
// against the file's known pattern when the file is the example's own.
// Then the two bounds are measured alone (the file read into the GPU cold,
// the transfer of GPU memory already loaded) and the pipelined run is
// reported against min(disk, network).
//
//   shuttle-weights-push [FILE] [--mib 2048] [--piece-mib 64] [--chunk-kib 2048]
//
// FILE (default ./weights_push.dat) is created with a pattern of --mib MiB
// when missing. Sender and receiver share one loop on loopback.
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/gpu_file.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/cuda/staged.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "cli.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <vector>

using namespace shuttle;
using clk = std::chrono::steady_clock;
constexpr std::uint32_t seed = 0x5eed;

namespace {
double since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

// Writes `bytes` of the pattern (kernels::pattern_byte) to `path`.
bool make_file(const std::string& path, std::size_t bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  std::vector<std::uint8_t> buf(8 << 20);
  for (std::size_t done = 0; done < bytes;) {
    std::size_t n = std::min(buf.size(), bytes - done);
    for (std::size_t i = 0; i < n; ++i) buf[i] = cuda::kernels::pattern_byte(done + i, seed);
    if (::write(fd, buf.data(), n) != static_cast<ssize_t>(n)) {
      ::close(fd);
      return false;
    }
    done += n;
  }
  bool ok = ::fsync(fd) == 0;
  ::close(fd);
  return ok;
}

void drop_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}
}  // namespace

int main(int argc, char** argv) {
  std::string path = "weights_push.dat";
  std::size_t mib = 2048, piece_mib = 64, chunk_kib = 2048;
  CLI::App app{"Reads a file into GPU memory and pushes it to a peer over the tcp provider while the rest is read; "
               "checksums verified per chunk.",
               "shuttle-weights-push"};
  cli::setup(app, "usage: shuttle-weights-push [FILE] [--mib N] [--piece-mib N] [--chunk-kib N]\n");
  app.add_option("FILE", path, "the file (created with a pattern when missing)")->type_name("");
  app.add_option("--mib", mib, "size of a created file (default 2048)")->transform(cli::count(1, 1u << 20));
  app.add_option("--piece-mib", piece_mib, "MiB per read_into (default 64)")->transform(cli::count(1, 1u << 14));
  app.add_option("--chunk-kib", chunk_kib, "KiB per network chunk (default 2048)")->transform(cli::count(4, 1u << 20));
  cli::parse(app, argc, argv);
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device");
    return 77;
  }
  bool own = false;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (!make_file(path, mib << 20)) {
      std::perror(("creating " + path).c_str());
      return 1;
    }
    own = true;
  }
  io_context ctx;
  auto f = cuda::gpu_file::open(path);
  if (!f) {
    std::fprintf(stderr, "open %s: %s\n", path.c_str(), f.error().message().c_str());
    return 1;
  }
  const std::size_t len = f->size().value();
  const std::size_t chunk = chunk_kib << 10, piece = std::max(piece_mib << 20, chunk) / chunk * chunk;
  const std::size_t chunks = (len + chunk - 1) / chunk;
  std::printf("weights_push: %s, %zu MiB, %s\n  engine: %s\n", path.c_str(), len >> 20,
              cuda::describe_device(0).c_str(), f->note().c_str());

  domain_options dopt;
  dopt.kind = transport_kind::tcp;
  auto sd = domain::open(dopt).value();
  auto cd = domain::open(dopt).value();
  auto l = sd.listen(endpoint::parse("127.0.0.1:0").value()).value();
  auto ep = endpoint::parse("127.0.0.1:" + std::to_string(l.local_endpoint()->port())).value();
  auto [server, client] = ctx.run(when_all(l.accept(), cd.connect(ep)));
  connection rx = std::move(server).value(), tx = std::move(client).value();
  cuda::staged_options o;
  o.chunk = chunk;
  auto [r, s] = ctx.run(when_all(cuda::gpu_receiver::open(rx, sd, o), cuda::gpu_sender::open(tx, cd)));
  auto rcv = std::move(r).value();
  auto snd = std::move(s).value();

  cuda::stream s_prod, s_cons;
  cuda::device_buffer src(len), dst(len);
  unsigned long long *sums = nullptr;  // sent sums, then received sums
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&sums), 2 * chunks * 8), "cudaMalloc");
  cuda::check(cudaMemset(sums, 0, 2 * chunks * 8), "cudaMemset");
  cuda::stream_flag loaded;  // chunks of the file in GPU memory so far
  loaded.set(0);

  // The pipelined run: the reader raises `loaded` piece by piece.
  std::error_code read_error;
  auto reader = [&]() -> task<void> {
    for (std::size_t off = 0; off < len; off += piece) {
      std::size_t n = std::min(piece, len - off);
      auto got = co_await f->read_into({src.data() + off, n}, off);
      if (!got || *got != n) {
        read_error = got ? make_error_code(errc::eof) : got.error();
        co_return;
      }
      loaded.set(static_cast<std::uint32_t>(std::min(chunks, (off + n + chunk - 1) / chunk)));
    }
  };
  bool flag_ok = true;
  auto produce = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t st) {
    flag_ok = flag_ok && loaded.enqueue_wait(st, static_cast<std::uint32_t>(i + 1)).has_value();
    cuda::check(cuda::kernels::checksum(src.data() + off, n, off, sums + i, st), "checksum");
  };
  auto consume = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t st) {
    cuda::check(cuda::kernels::checksum(dst.data() + off, n, off, sums + chunks + i, st), "checksum");
  };
  drop_cache(path);
  auto t0 = clk::now();
  auto [a, b, c] = ctx.run(when_all(snd.send(src.data(), len, s_prod, produce),
                                    rcv.recv(dst.data(), len, s_cons, consume), reader()));
  ctx.run([&]() -> task<void> { (void)co_await cuda::wait(s_cons.get()); }());
  const double t_pipe = since(t0);
  if (!a || !b || read_error || !flag_ok) {
    std::fprintf(stderr, "push failed: send %s, recv %s, read %s%s\n", a ? "ok" : a.error().message().c_str(),
                 b ? "ok" : b.error().message().c_str(), read_error ? read_error.message().c_str() : "ok",
                 flag_ok ? "" : ", stream wait on the flag refused");
    return 1;
  }
  std::vector<unsigned long long> h(2 * chunks);
  cuda::check(cudaMemcpy(h.data(), sums, h.size() * 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::size_t bad = 0, bad_ref = 0;
  for (std::size_t i = 0; i < chunks; ++i) {
    if (h[i] != h[chunks + i]) ++bad;
    if (own && h[chunks + i] != cuda::kernels::pattern_checksum(std::min(chunk, len - i * chunk), i * chunk, seed))
      ++bad_ref;
  }

  // The bounds alone: the file read into the GPU cold; the loaded GPU memory sent.
  drop_cache(path);
  t0 = clk::now();
  auto whole = ctx.run(f->read_into({src.data(), len}, 0));
  const double t_disk = since(t0);
  t0 = clk::now();
  auto [a2, b2] = ctx.run(when_all(snd.send(src.data(), len, s_prod), rcv.recv(dst.data(), len, s_cons)));
  ctx.run([&]() -> task<void> { (void)co_await cuda::wait(s_cons.get()); }());
  const double t_net = since(t0);
  ctx.run([&]() -> task<void> {
    (void)co_await tx.close();
    (void)co_await rx.close();
  }());
  (void)cudaFree(sums);
  if (!whole || !a2 || !b2) {
    std::fprintf(stderr, "bound runs failed\n");
    return 1;
  }
  auto gbs = [&](double t) { return double(len) / t / 1e9; };
  const double bound = std::max(t_disk, t_net);  // min of the two rates
  std::printf("  pipelined disk->GPU->network: %.2f s, %.2f GB/s (%zu chunks of %zu KiB, pieces of %zu MiB)\n"
              "  disk->GPU alone (cold): %.2f GB/s; GPU->network alone: %.2f GB/s\n"
              "  pipelined / min(disk, network) = %.2f (target >= 0.85)\n"
              "  checksums: %zu/%zu chunks match sender and receiver%s\n",
              t_pipe, gbs(t_pipe), chunks, chunk >> 10, piece >> 20, gbs(t_disk), gbs(t_net), bound / t_pipe,
              chunks - bad, chunks, own ? (bad_ref ? ", MISMATCH against the file's pattern" : ", and the file's pattern")
                                        : "");
  return (bad || bad_ref) ? 1 : 0;
}
