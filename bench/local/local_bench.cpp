// The local provider against its baselines, in one run (issue 30's targets):
//  - write_bw at 1 MiB into a shared region (shuttle/local.hpp) against a
//    single-threaded memcpy between two buffers (target >= 0.8x), and
//    against the tcp provider on loopback (target >= 5x);
//  - 8-byte write latency (target <= 1 us), and the tcp provider's.
// Both peers run in this process on one loop; the initiator writes through
// its own mapping of the target's memfd, as a peer process would.
// Usage: local_bench [seconds per measurement, default 1]
#include <shuttle/local.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;
using bench_clock = std::chrono::steady_clock;

namespace {

double seconds_per_run = 1.0;

struct peer_pair {
  std::optional<domain> sd, cd;
  listener l;
  connection server, client;
};

task<void> connect_pair(peer_pair& p, transport_kind k) {
  domain_options o;
  o.kind = k;
  p.sd.emplace(domain::open(o).value());
  p.cd.emplace(domain::open(o).value());
  p.l = p.sd->listen(endpoint::loopback(0)).value();
  auto [s, c] = co_await when_all(p.l.accept(), p.cd->connect(endpoint::loopback(p.l.local_endpoint()->port())));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
}

double memcpy_gbps(std::size_t size) {
  std::vector<std::byte> a(size, std::byte{1}), b(size);
  std::size_t n = 0;
  auto t0 = bench_clock::now();
  std::chrono::duration<double> el{};
  do {
    for (int i = 0; i < 64; ++i, ++n) {
      std::memcpy(b.data(), a.data(), size);
      asm volatile("" : : "r"(b.data()) : "memory");
    }
    el = bench_clock::now() - t0;
  } while (el.count() < seconds_per_run);
  return double(n) * double(size) / el.count() / 1e9;
}

// write_bw: `depth` writes of `size` bytes in flight (awaited together).
task<double> write_gbps(connection& c, remote_buffer rb, std::size_t size, int depth) {
  std::vector<std::byte> src(size, std::byte{2});
  for (int i = 0; i < 16; ++i) (void)co_await c.write(src, rb);  // warm-up (and the local mapping)
  (void)co_await sleep_for(20ms);
  for (int i = 0; i < 16; ++i) (void)co_await c.write(src, rb);
  std::size_t n = 0;
  auto t0 = bench_clock::now();
  std::chrono::duration<double> el{};
  do {
    if (depth == 1) {
      for (int i = 0; i < 64; ++i, ++n)
        if (!co_await c.write(src, rb)) std::abort();
    } else {
      std::vector<task<result<void>>> ws;
      for (int i = 0; i < depth; ++i, ++n) ws.push_back(c.write(src, rb));
      for (auto& r : co_await when_all(std::move(ws)))
        if (!r) std::abort();
    }
    el = bench_clock::now() - t0;
  } while (el.count() < seconds_per_run);
  co_return double(n) * double(size) / el.count() / 1e9;
}

// write_lat: one 8-byte write awaited at a time; mean ns per write.
task<double> write_lat_ns(connection& c, remote_buffer rb) {
  std::array<std::byte, 8> src{};
  for (int i = 0; i < 100; ++i) (void)co_await c.write(src, rb);
  (void)co_await sleep_for(20ms);
  for (int i = 0; i < 100; ++i) (void)co_await c.write(src, rb);
  std::size_t n = 0;
  auto t0 = bench_clock::now();
  std::chrono::duration<double> el{};
  do {
    for (int i = 0; i < 256; ++i, ++n)
      if (!co_await c.write(src, rb)) std::abort();
    el = bench_clock::now() - t0;
  } while (el.count() < seconds_per_run);
  co_return el.count() * 1e9 / double(n);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) seconds_per_run = std::max(0.05, std::atof(argv[1]));
  constexpr std::size_t size = 1 << 20;
  io_context ctx;
  double local_bw = 0, tcp_bw = 0, local_lat = 0, tcp_lat = 0;
  ctx.run([&]() -> task<void> {
    {
      peer_pair p;
      co_await connect_pair(p, transport_kind::local);
      auto mem = shared_memory::allocate(size).value();
      auto mr = p.sd->register_memory(mem.span(), access::all).value();
      local_bw = co_await write_gbps(p.client, mr.remote(), size, 1);
      local_lat = co_await write_lat_ns(p.client, mr.remote(0, 8));
      (void)co_await p.client.close();
      (void)co_await p.server.close();
    }
    {
      peer_pair p;
      co_await connect_pair(p, transport_kind::tcp);
      std::vector<std::byte> target(size);
      auto mr = p.sd->register_memory(target, access::all).value();
      tcp_bw = co_await write_gbps(p.client, mr.remote(), size, 8);
      tcp_lat = co_await write_lat_ns(p.client, mr.remote(0, 8));
      (void)co_await p.client.close();
      (void)co_await p.server.close();
    }
  }());
  const double mc = memcpy_gbps(size);
  std::printf("memcpy 1 MiB (one thread):        %8.2f GB/s\n", mc);
  std::printf("local write_bw 1 MiB (depth 1):   %8.2f GB/s  = %.2fx memcpy (target >= 0.8)\n", local_bw,
              local_bw / mc);
  std::printf("tcp   write_bw 1 MiB (depth 8):   %8.2f GB/s  local = %.1fx tcp (target >= 5)\n", tcp_bw,
              local_bw / tcp_bw);
  std::printf("local write_lat 8 B:              %8.1f ns (target <= 1000)\n", local_lat);
  std::printf("tcp   write_lat 8 B:              %8.1f ns  (%.0fx local)\n", tcp_lat, tcp_lat / local_lat);
  return 0;
}
