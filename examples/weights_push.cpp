// weights_push: loads a file into GPU memory with gpu_file and pushes it to
// a peer over the transport API while the rest is still being read:
//
//   disk --read_into--> GPU (sender) --staged channel, tcp provider--> GPU (receiver)
//
// The file is read in pieces (`--piece-mib`, each one read_into with its
// chunks in flight) by two readers taking turns (--readers 1: one); each
// piece goes on the wire (one staged transfer, its chunks checksummed on
// the sender's GPU by the producer) as soon as it has landed, while the
// next ones are read. The receiver checksums every chunk on its GPU after
// the chunk's copy; every chunk's two checksums are compared, and against the file's
// known pattern when the file is the example's own. Then the two bounds are
// measured alone (the file read into the GPU cold, the transfer of GPU
// memory already loaded) and the pipelined run is reported against
// min(disk, network). Each phase is announced on stderr as it starts.
//
// The pieces are handed over on the host, when read_into completes: an
// earlier version made the producer's stream wait on a host-set flag
// (cuStreamWaitValue32) for data still being read. That wait is invisible
// to CUDA, and a stream blocked on it holds up whatever streams share its
// hardware queue (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default) -- here the
// read's own copies once enough streams exist -- so the flag was never set
// (the run hung on the H100, 2026-12-05).
//
//   shuttle-weights-push [FILE] [--mib 2048] [--piece-mib 32] [--chunk-kib 2048] [--rounds 1] [--readers 2]
//
// --rounds N repeats the three runs N times, their order rotating, and
// reports each round's ratio and the median: a disk's speed can move by 2x
// between runs a few seconds apart (docs/measurements.md, 2026-12-06), so a
// pipelined run is judged against the bounds measured beside it.
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
#include "crash_trace.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

using namespace shuttle;
using clk = std::chrono::steady_clock;
constexpr std::uint32_t seed = 0x5eed;

namespace {
double since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

const clk::time_point t_start = clk::now();
// A phase line on stderr (unbuffered): what a run killed by a timeout reached.
void phase(const char* what) { std::fprintf(stderr, "[%7.2f s] %s\n", since(t_start), what); }

// Writes `bytes` of the pattern (kernels::pattern_byte) to `path`, through
// a temporary name: a run killed while writing leaves no short file behind.
bool make_file(const std::string& path, std::size_t bytes) {
  const std::string tmp = path + ".part";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
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
  return ok && ::rename(tmp.c_str(), path.c_str()) == 0;
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
  std::size_t mib = 2048, piece_mib = 32, chunk_kib = 2048, rounds = 1, readers = 2;
  CLI::App app{"Reads a file into GPU memory and pushes it to a peer over the tcp provider while the rest is read; "
               "checksums verified per chunk.",
               "shuttle-weights-push"};
  cli::setup(app,
             "usage: shuttle-weights-push [FILE] [--mib N] [--piece-mib N] [--chunk-kib N] [--rounds N] [--readers 1|2]\n");
  app.add_option("FILE", path, "the file (created with a pattern when missing)")->type_name("");
  app.add_option("--mib", mib, "size of a created file (default 2048)")->transform(cli::count(1, 1u << 20));
  app.add_option("--piece-mib", piece_mib, "MiB per read_into (default 32)")->transform(cli::count(1, 1u << 14));
  app.add_option("--chunk-kib", chunk_kib, "KiB per network chunk (default 2048)")->transform(cli::count(4, 1u << 20));
  app.add_option("--readers", readers, "2 gpu_files taking turns on the pieces (default), or 1")
      ->transform(cli::count(1, 2));
  app.add_option("--rounds", rounds, "pipelined run and bounds, N times in rotating order (default 1)")
      ->transform(cli::count(1, 100));
  cli::parse(app, argc, argv);
  crash_trace::install();
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a pipe as they are printed
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device");
    return 77;
  }
  bool own = false;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    phase(("creating " + path + " (" + std::to_string(mib) + " MiB)").c_str());
    if (!make_file(path, mib << 20)) {
      std::perror(("creating " + path).c_str());
      return 1;
    }
    own = true;
  }
  io_context ctx;
  phase("opening the file");
  auto f = cuda::gpu_file::open(path);
  if (!f) {
    std::fprintf(stderr, "open %s: %s\n", path.c_str(), f.error().message().c_str());
    return 1;
  }
  const std::size_t len = f->size().value();
  const std::size_t chunk = chunk_kib << 10, piece = std::max(piece_mib << 20, chunk) / chunk * chunk;
  const std::size_t chunks = (len + chunk - 1) / chunk, pieces = (len + piece - 1) / piece;
  std::printf("weights_push: %s, %zu MiB, %s\n  engine: %s\n", path.c_str(), len >> 20,
              cuda::describe_device(0).c_str(), f->note().c_str());

  phase("connecting sender and receiver (tcp provider, loopback)");
  domain_options dopt;
  dopt.kind = transport_kind::tcp;
  auto sd = domain::open(dopt).value();
  auto cd = domain::open(dopt).value();
  auto l = sd.listen(endpoint::parse("127.0.0.1:0").value()).value();
  auto ep = endpoint::parse("127.0.0.1:" + std::to_string(l.local_endpoint()->port())).value();
  auto [server, client] = ctx.run(when_all(l.accept(), cd.connect(ep)));
  connection rx = std::move(server).value(), tx = std::move(client).value();
  phase("opening the staged channel");
  cuda::staged_options o;
  o.chunk = chunk;
  auto [r, s] = ctx.run(when_all(cuda::gpu_receiver::open(rx, sd, o), cuda::gpu_sender::open(tx, cd)));
  auto rcv = std::move(r).value();
  auto snd = std::move(s).value();

  phase("allocating GPU memory");
  cuda::stream s_prod, s_cons;
  cuda::device_buffer src(len), dst(len);
  unsigned long long *sums = nullptr;  // sent sums, then received sums
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&sums), 2 * chunks * 8), "cudaMalloc");
  cuda::check(cudaMemset(sums, 0, 2 * chunks * 8), "cudaMemset");

  // The pipelined run: two readers (each on its own gpu_file, taking turns;
  // --readers 1: one) read the pieces, never waiting for the network
  // (the whole file has its place in GPU memory), and hand each one over
  // as it lands; the pusher sends each piece once it is there. An earlier
  // version read piece p+1 and sent piece p in lockstep, so each piece cost
  // the slower of the two plus the hand-over (0.72-0.83 of min(disk,
  // network) on the H100 machine, 2026-12-06). One reader drains the
  // disk's queue at the end of every piece, since a gpu_file runs one
  // read_into at a time; two keep it busy (H100 machine, 2026-12-07:
  // medians 0.87-0.97 with two, 0.84-0.85 with one; docs/measurements.md).
  std::optional<cuda::gpu_file> f2;
  if (readers == 2) {
    auto g = cuda::gpu_file::open(path);
    if (!g) {
      std::fprintf(stderr, "open %s (second reader): %s\n", path.c_str(), g.error().message().c_str());
      return 1;
    }
    f2.emplace(std::move(*g));
  }
  std::error_code read_error;
  std::optional<semaphore> landed[2];  // per reader; made anew for each pipelined run
  auto reader = [&](unsigned which, cuda::gpu_file& file) -> task<void> {
    for (std::size_t p = which; p < pieces; p += readers) {
      const std::size_t off = p * piece, n = std::min(piece, len - off);
      auto got = co_await file.read_into({src.data() + off, n}, off);
      if (!got || *got != n) {
        read_error = got ? make_error_code(errc::eof) : got.error();
        landed[which]->close(read_error);  // the pusher stops at the piece that did not land
        co_return;
      }
      landed[which]->release();
    }
  };
  result<void> a{}, b{};
  auto pusher = [&]() -> task<void> {
    for (std::size_t p = 0; p < pieces && a && b; ++p) {
      if (!co_await landed[p % readers]->acquire()) co_return;  // pieces land in order per reader
      const std::size_t base = p * piece, n = std::min(piece, len - base);
      // off is relative to the piece; a chunk's sum sits at its index in the file.
      auto produce = [&, base](std::size_t, std::size_t off, std::size_t sz, cudaStream_t st) {
        cuda::check(cuda::kernels::checksum(src.data() + base + off, sz, base + off, sums + (base + off) / chunk, st),
                    "checksum");
      };
      auto consume = [&, base](std::size_t, std::size_t off, std::size_t sz, cudaStream_t st) {
        cuda::check(cuda::kernels::checksum(dst.data() + base + off, sz, base + off,
                                            sums + chunks + (base + off) / chunk, st),
                    "checksum");
      };
      auto [x, y] = co_await when_all(snd.send(src.data() + base, n, s_prod, produce),
                                      rcv.recv(dst.data() + base, n, s_cons, consume));
      a = std::move(x);
      b = std::move(y);
    }
  };
  auto pipeline = [&]() -> task<void> {
    if (f2)
      co_await when_all(reader(0, *f), reader(1, *f2), pusher());
    else
      co_await when_all(reader(0, *f), pusher());
  };
  auto gbs = [&](double t) { return double(len) / t / 1e9; };
  std::size_t bad = 0, bad_ref = 0;
  std::vector<unsigned long long> h(2 * chunks);
  // One pipelined run, its checksums compared; < 0: it failed.
  auto run_pipelined = [&]() -> double {
    cuda::check(cudaMemset(sums, 0, 2 * chunks * 8), "cudaMemset");
    a = {};
    b = {};
    read_error = {};
    landed[0].emplace(0);
    landed[1].emplace(0);
    drop_cache(path);
    phase("pipelined run: disk -> GPU -> network");
    auto t0 = clk::now();
    ctx.run(pipeline());
    ctx.run([&]() -> task<void> { (void)co_await cuda::wait(s_cons.get()); }());
    const double t = since(t0);
    if (!a || !b || read_error) {
      std::fprintf(stderr, "push failed: send %s, recv %s, read %s\n", a ? "ok" : a.error().message().c_str(),
                   b ? "ok" : b.error().message().c_str(), read_error ? read_error.message().c_str() : "ok");
      return -1;
    }
    phase("comparing checksums");
    cuda::check(cudaMemcpy(h.data(), sums, h.size() * 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (std::size_t i = 0; i < chunks; ++i) {
      if (h[i] != h[chunks + i]) ++bad;
      if (own && h[chunks + i] != cuda::kernels::pattern_checksum(std::min(chunk, len - i * chunk), i * chunk, seed))
        ++bad_ref;
    }
    return t;
  };
  // The bounds alone: the file read into the GPU cold; the loaded GPU memory sent.
  auto run_disk = [&]() -> double {
    drop_cache(path);
    phase("disk -> GPU alone (cold)");
    auto t0 = clk::now();
    auto whole = ctx.run(f->read_into({src.data(), len}, 0));
    return whole ? since(t0) : -1;
  };
  auto run_net = [&]() -> double {
    phase("GPU -> network alone");
    auto t0 = clk::now();
    auto [a2, b2] = ctx.run(when_all(snd.send(src.data(), len, s_prod), rcv.recv(dst.data(), len, s_cons)));
    ctx.run([&]() -> task<void> { (void)co_await cuda::wait(s_cons.get()); }());
    return a2 && b2 ? since(t0) : -1;
  };
  std::vector<double> ratios;
  for (std::size_t round = 0; round < rounds; ++round) {
    double t_pipe = 0, t_disk = 0, t_net = 0;
    if (round % 2 == 0) {  // rotating: the pipelined run first, then last
      t_pipe = run_pipelined();
      t_disk = run_disk();
      t_net = run_net();
    } else {
      t_disk = run_disk();
      t_net = run_net();
      t_pipe = run_pipelined();
    }
    if (t_pipe < 0) return 1;
    if (t_disk < 0 || t_net < 0) {
      std::fprintf(stderr, "bound runs failed\n");
      return 1;
    }
    const double bound = std::max(t_disk, t_net);  // min of the two rates
    ratios.push_back(bound / t_pipe);
    std::printf("  %spipelined disk->GPU->network: %.2f s, %.2f GB/s (%zu chunks of %zu KiB, pieces of %zu MiB)\n"
                "  disk->GPU alone (cold): %.2f GB/s; GPU->network alone: %.2f GB/s\n"
                "  pipelined / min(disk, network) = %.2f (target >= 0.85)\n",
                rounds > 1 ? ("round " + std::to_string(round + 1) + ": ").c_str() : "", t_pipe, gbs(t_pipe), chunks,
                chunk >> 10, piece >> 20, gbs(t_disk), gbs(t_net), bound / t_pipe);
  }
  phase("closing");
  ctx.run([&]() -> task<void> {
    (void)co_await tx.close();
    (void)co_await rx.close();
  }());
  (void)cudaFree(sums);
  if (rounds > 1) {
    std::vector<double> sorted = ratios;
    std::sort(sorted.begin(), sorted.end());
    std::printf("  median of %zu rounds: pipelined / min(disk, network) = %.2f (%.2f-%.2f; target >= 0.85)\n",
                rounds, sorted[sorted.size() / 2], sorted.front(), sorted.back());
  }
  std::printf("  checksums: %zu/%zu chunks match sender and receiver in %zu pipelined run%s%s\n",
              chunks * rounds - bad, chunks * rounds, rounds, rounds > 1 ? "s" : "",
              own ? (bad_ref ? ", MISMATCH against the file's pattern" : ", and the file's pattern") : "");
  return (bad || bad_ref) ? 1 : 0;
}
