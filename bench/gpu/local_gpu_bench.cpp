// GPU memory on the local provider, two processes on one GPU (issue 30,
// point 2) or on two GPUs of the host (issue 33: SHUTTLE_GPUS=A,B, this
// process on GPU A, the peer on B), against same-process baselines measured
// in the same run:
//  - GPU->GPU writes of 64 MiB chunks vs cudaMemcpyAsync device copies of
//    the same chunks in this process (target >= 0.9); on two GPUs, vs
//    cudaMemcpyPeerAsync from a buffer on A to one on B in this process;
//  - pinned host->GPU writes of 64 MiB chunks vs pinned cudaMemcpy (>= 0.9),
//    into a buffer on the peer's GPU;
//  - 8-byte GPU->GPU write latency vs a bare cudaMemcpyAsync + event wait
//    on the loop (cuda::wait), the provider's own wait (<= 1.2x), into a
//    buffer on the peer's GPU;
//  - for information, an 8-byte host->host write with the CUDA hooks
//    installed, from unregistered memory (the driver is asked whether the
//    buffer is GPU memory) and from memory registered with the domain (not
//    asked: registered host memory stays host memory).
// Usage: local_gpu_bench [chunks=64] [in_flight=8] [lat_iters=3000]
#include "../../tests/gpu/local_peer.hpp"

#include <algorithm>
#include <cstdio>

using namespace shuttle;
using namespace local_gpu;
using sclock = std::chrono::steady_clock;

namespace {

constexpr std::size_t chunk = 64 << 20;

double secs(sclock::duration d) { return std::chrono::duration<double>(d).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct args {
  int chunks = 64;
  int in_flight = 8;
  int lat_iters = 3000;
};

// `chunks` copies of one chunk, `in_flight` at a time (a sliding window of
// when_all rounds on the provider; one stream's queue for the baseline).
task<double> provider_bw(connection& c, std::span<const std::byte> src, remote_buffer dst, const args& a) {
  auto t0 = sclock::now();
  for (int done = 0; done < a.chunks; done += a.in_flight) {
    std::vector<task<result<void>>> ws;
    for (int i = 0; i < a.in_flight && done + i < a.chunks; ++i) ws.push_back(c.write(src, dst));
    for (auto& r : co_await when_all(std::move(ws)))
      if (!r) throw std::system_error(r.error(), "write");
  }
  co_return double(chunk) * a.chunks / secs(sclock::now() - t0) / 1e9;
}

// The same-process copy: a device copy on one GPU, a peer copy (from this
// process's GPU to the peer's) on two.
task<double> baseline_d2d(void* dst, const void* src, const args& a, gpu_pair g) {
  cuda::stream s;
  auto t0 = sclock::now();
  for (int done = 0; done < a.chunks; done += a.in_flight) {
    for (int i = 0; i < a.in_flight && done + i < a.chunks; ++i) {
      if (g.self == g.peer)
        cuda::check(cudaMemcpyAsync(dst, src, chunk, cudaMemcpyDeviceToDevice, s), "copy");
      else
        cuda::check(cudaMemcpyPeerAsync(dst, g.peer, src, g.self, chunk, s), "peer copy");
    }
    if (auto r = co_await cuda::wait(s); !r) throw std::system_error(r.error(), "wait");
  }
  co_return double(chunk) * a.chunks / secs(sclock::now() - t0) / 1e9;
}

double baseline_pinned_h2d(void* dst, const void* src, const args& a) {
  auto t0 = sclock::now();
  for (int i = 0; i < a.chunks; ++i) cuda::check(cudaMemcpy(dst, src, chunk, cudaMemcpyDefault), "copy");
  return double(chunk) * a.chunks / secs(sclock::now() - t0) / 1e9;
}

task<double> provider_lat(connection& c, std::span<const std::byte> src, remote_buffer dst, int iters) {
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    auto t0 = sclock::now();
    if (auto r = co_await c.write(src, dst); !r) throw std::system_error(r.error(), "write");
    us.push_back(secs(sclock::now() - t0) * 1e6);
  }
  co_return median(us);
}

task<double> baseline_lat(void* dst, const void* src, int iters) {
  cuda::stream s;
  cuda::event ev;
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    auto t0 = sclock::now();
    cuda::check(cudaMemcpyAsync(dst, src, 8, cudaMemcpyDefault, s), "copy");
    ev.record(s);
    if (auto r = co_await cuda::wait(ev); !r) throw std::system_error(r.error(), "wait");
    us.push_back(secs(sclock::now() - t0) * 1e6);
  }
  co_return median(us);
}

const char* verdict(bool met) { return met ? "met" : "NOT met"; }

}  // namespace

int main(int argc, char** argv) {
  if (int rc = peer_main(argc, argv); rc >= 0) return rc;
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  args a;
  if (argc > 1) a.chunks = std::max(1, std::atoi(argv[1]));
  if (argc > 2) a.in_flight = std::max(1, std::atoi(argv[2]));
  if (argc > 3) a.lat_iters = std::max(10, std::atoi(argv[3]));
  std::string why;
  const gpu_pair g = gpus_from_env(cuda::device_count(), why);
  if (!why.empty()) {
    std::fprintf(stderr, "local_gpu_bench: %s\n", why.c_str());
    return 2;
  }
  use_gpu(g.self);
  std::printf("this process: GPU %d: %s\nthe peer:     GPU %d: %s\n", g.self, cuda::describe_device(g.self).c_str(),
              g.peer, cuda::describe_device(g.peer).c_str());
  if (g.self != g.peer) {
    int ab = 0, ba = 0;
    (void)cudaDeviceCanAccessPeer(&ab, g.self, g.peer);
    (void)cudaDeviceCanAccessPeer(&ba, g.peer, g.self);
    std::printf("cudaDeviceCanAccessPeer %d->%d: %d, %d->%d: %d\n", g.self, g.peer, ab, g.peer, g.self, ba);
  }
  std::printf("chunks %d x 64 MiB, %d in flight; latency: median of %d\n", a.chunks, a.in_flight, a.lat_iters);
  ::signal(SIGPIPE, SIG_IGN);
  io_context ctx;
  return ctx.run([](args a, gpu_pair g) -> task<int> {
    auto d = domain::open(local_options()).value();
    peer_process peer;
    bool started =
        peer.spawn("/proc/self/exe", "shuttle-gpu-bench-" + std::to_string(::getpid()), chunk, 4096, g.peer);
    if (started) started = co_await peer.connect(d);
    if (!started) {
      std::puts("could not start the peer");
      co_return 1;
    }
    cuda::device_buffer src(chunk);
    // The baselines' destination, on the peer's GPU (as the peer's region is).
    use_gpu(g.peer);
    cuda::device_buffer dst(chunk);
    use_gpu(g.self);
    cuda::pinned_buffer pinned(chunk);
    cuda::check(cudaMemset(src.data(), 0x3c, chunk), "memset");
    std::memset(pinned.data(), 0x5a, chunk);
    int rc = 0;
    try {
      // Warm-up: imports the region, opens the queue, the first copies.
      (void)co_await provider_bw(peer.c, {src.data(), chunk}, peer.r.gpu, args{4, 4, 0});
      if (g.self != g.peer) {
        // As the import did (cudaIpcMemLazyEnablePeerAccess): the baselines
        // copy over the link too, where there is one (already enabled: fine).
        int ab = 0;
        (void)cudaDeviceCanAccessPeer(&ab, g.self, g.peer);
        if (ab && cudaDeviceEnablePeerAccess(g.peer, 0) != cudaSuccess) (void)cudaGetLastError();
      }
      (void)co_await baseline_d2d(dst.data(), src.data(), args{4, 4, 0}, g);
      // Interleaved, three times each: the best of each (a quiet machine's number).
      double bw = 0, base = 0, hbw = 0, hbase = 0, lat = 1e9, blat = 1e9, hlat = 1e9, rlat = 1e9;
      std::vector<std::byte> host8(8), registered8(8);
      auto mr8 = d.register_memory(registered8, access::all).value();
      for (int rep = 0; rep < 3; ++rep) {
        double v = co_await baseline_d2d(dst.data(), src.data(), a, g);
        base = std::max(base, v);
        v = co_await provider_bw(peer.c, {src.data(), chunk}, peer.r.gpu, a);
        bw = std::max(bw, v);
        v = baseline_pinned_h2d(dst.data(), pinned.data(), a);
        hbase = std::max(hbase, v);
        v = co_await provider_bw(peer.c, {pinned.data(), chunk}, peer.r.gpu, a);
        hbw = std::max(hbw, v);
        v = co_await baseline_lat(dst.data(), src.data(), a.lat_iters);
        blat = std::min(blat, v);
        v = co_await provider_lat(peer.c, {src.data(), 8}, peer.r.gpu.slice(0, 8).value(), a.lat_iters);
        lat = std::min(lat, v);
        v = co_await provider_lat(peer.c, host8, peer.r.host.slice(0, 8).value(), a.lat_iters);
        hlat = std::min(hlat, v);
        v = co_await provider_lat(peer.c, registered8, peer.r.host.slice(0, 8).value(), a.lat_iters);
        rlat = std::min(rlat, v);
      }
      std::printf("GPU->GPU 64 MiB writes (GPU %d -> GPU %d): local provider %.1f GB/s, same-process %s %.1f GB/s, "
                  "ratio %.3f (target >= 0.9: %s)\n", g.self, g.peer, bw,
                  g.self == g.peer ? "cudaMemcpyAsync D2D" : "cudaMemcpyPeerAsync", base, bw / base,
                  verdict(bw / base >= 0.9));
      std::printf("pinned host->GPU 64 MiB writes: local provider %.1f GB/s, pinned cudaMemcpy %.1f GB/s, "
                  "ratio %.3f (target >= 0.9: %s)\n", hbw, hbase, hbw / hbase, verdict(hbw / hbase >= 0.9));
      std::printf("8-byte GPU->GPU write latency (median): local provider %.2f us, cudaMemcpyAsync + event wait "
                  "%.2f us, ratio %.3f (target <= 1.2: %s)\n", lat, blat, lat / blat, verdict(lat / blat <= 1.2));
      // What telling GPU from host memory costs a host write (the CUDA hooks are installed here).
      std::printf("8-byte host->host write latency (median, the peer's shared block, hooks installed): %.3f us "
                  "from unregistered memory (the driver asked), %.3f us from registered memory\n",
                  hlat, rlat);
    } catch (const std::exception& e) {
      std::printf("failed: %s\n", e.what());
      rc = 1;
    }
    (void)co_await peer.ask({'Q', 0, 0, 0, 0});
    peer.c = connection{};
    if (peer.reap() != 0) rc = 1;
    co_return rc;
  }(a, g));
}
