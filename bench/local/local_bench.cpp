// The local provider against its baselines, in one run (issue 30's targets):
//  - write_bw at 1 MiB into a shared region (shuttle/local.hpp) against a
//    single-threaded memcpy between two buffers (target >= 0.8x), and
//    against the tcp provider on loopback (target >= 5x);
//  - 8-byte write latency (target <= 1 us), and the tcp provider's.
//  - send/recv round trips (8 B, 4 KiB), send bandwidth (64 KiB messages)
//    and write_bw into memory that is not shared, over the shared-memory
//    rings against the socket path (SHUTTLE_LOCAL_RINGS=0) and tcp.
// Both peers run in this process on one loop; the initiator writes through
// its own mapping of the target's memfd, as a peer process would.
// `--peer`: the peers in two processes (for bench/local/ucx_compare.sh),
// with a write ping-pong (ucp_put_lat's method) after the rows above.
// The latency rows run with io_context::options::ring_spin_budget set on
// both sides (the loops poll the rings instead of sleeping, as ucx_perftest
// busy-polls); `--peer`'s third argument sets it for the whole run (0: the
// loops sleep, a doorbell per message).
// `--rtts N`: exactly N 8-byte send/recv round trips on the rings, both
// peers on one loop (bench/local/insn.sh counts instructions per round trip
// with it: a count does not depend on the host's load, a time does).
// Usage: local_bench [seconds per measurement, default 1] [spin budget in us, default 1000]
//        | --peer [seconds] [spin budget in us, default 1000] [pin: 1 puts the
//          server on CPU 0 and the measuring side on CPU 1, as ucx_compare.sh PIN=1]
//        | --rtts N
#include <shuttle/local.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
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
// The latency rows' ring_spin_budget, on both sides.
std::chrono::microseconds spin_budget{1000};

// Sets the running loop's ring_spin_budget for its lifetime, then puts back the old one.
struct spinning {
  std::chrono::nanoseconds old = io_context::current().ring_spin_budget();
  explicit spinning(std::chrono::nanoseconds b) { io_context::current().set_ring_spin_budget(b); }
  ~spinning() { io_context::current().set_ring_spin_budget(old); }
};

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

// A write ping-pong, as ucx_perftest's ucp_put_lat runs one: each side
// writes a counter into the other's shared region and spins on its own
// region's first word until the peer's arrives (the spin is the
// application's, no loop turn, as ucx_perftest's); half a round trip is the
// latency of a write to a peer that watches for it. (write_lat_ns above is
// a write's completion, which on a shared region is the memcpy alone.)
std::uint64_t word_of(std::span<std::byte> mem) {
  return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(mem.data()))
      .load(std::memory_order_acquire);
}

std::array<std::byte, 8> bytes_of(std::uint64_t v) {
  std::array<std::byte, 8> b;
  std::memcpy(b.data(), &v, 8);
  return b;
}

constexpr std::uint64_t pong_end = ~std::uint64_t{0};

// The set-up both sides go through: descriptors exchanged, one write each
// way (the first write to a region waits for the peer's loop to answer
// for it, so neither side spins yet), then both loops left to settle.
// `mine` is this side's region, its first word zeroed by the peer.
task<remote_buffer> pong_setup(connection& c, const memory_region& mine, bool first) {
  std::array<std::byte, remote_buffer::wire_size> wire{};
  mine.remote().serialize(wire);
  remote_buffer peer{};
  auto take = [&]() -> task<void> {
    auto m = (co_await c.recv()).value();
    peer = remote_buffer::deserialize(m.data().first<remote_buffer::wire_size>());
  };
  if (first) {
    if (!co_await c.send(wire)) std::abort();
    co_await take();
  } else {
    co_await take();
    if (!co_await c.send(wire)) std::abort();
  }
  if (!co_await c.write(bytes_of(0), peer.slice(0, 8).value())) std::abort();
  // Each side's "written" message tells the other its word is zero.
  if (!co_await c.send(bytes_of(0))) std::abort();
  (void)(co_await c.recv()).value();
  (void)co_await sleep_for(20ms);  // acknowledgements and credits go now, not while we spin
  co_return peer.slice(0, 8).value();
}

// The echoing half, until the peer's pong_end.
task<void> pong_echo(connection& c, std::span<std::byte> mine, remote_buffer peer) {
  std::uint64_t last = 0;
  for (;;) {
    std::uint64_t v;
    while ((v = word_of(mine)) == last) __builtin_ia32_pause();
    last = v;
    if (v == pong_end) co_return;
    if (!co_await c.write(bytes_of(v), peer)) std::abort();
  }
}

// The measuring half: mean ns per round trip.
task<double> pong_ns(connection& c, std::span<std::byte> mine, remote_buffer peer) {
  std::uint64_t n = 0;
  std::array<std::byte, 8> out{};
  auto once = [&] {
    out = bytes_of(++n);
    return c.write(out, peer);
  };
  for (int i = 0; i < 2000; ++i) {
    if (!co_await once()) std::abort();
    while (word_of(mine) != n) __builtin_ia32_pause();
  }
  const std::uint64_t n0 = n;
  auto t0 = bench_clock::now();
  std::chrono::duration<double> el{};
  do {
    for (int i = 0; i < 1024; ++i) {
      if (!co_await once()) std::abort();
      while (word_of(mine) != n) __builtin_ia32_pause();
    }
    el = bench_clock::now() - t0;
  } while (el.count() < seconds_per_run);
  if (!co_await c.write(bytes_of(pong_end), peer)) std::abort();
  co_return el.count() * 1e9 / double(n - n0);
}

// send/recv ping-pong: `size`-byte messages, the server echoing each; mean
// ns per round trip.
task<void> echo(connection& c) {
  for (;;) {
    auto m = co_await c.recv();
    if (!m || m->size() == 0) co_return;  // an empty message ends it
    std::vector<std::byte> copy(m->data().begin(), m->data().end());
    m->reset();
    if (!co_await c.send(copy)) co_return;
  }
}

task<double> pingpong_ns(connection& c, std::size_t size) {
  std::vector<std::byte> msg(size, std::byte{3});
  auto once = [&]() -> task<void> {
    if (!co_await c.send(msg)) std::abort();
    auto r = co_await c.recv();
    if (!r || r->size() != size) std::abort();
  };
  for (int i = 0; i < 200; ++i) co_await once();
  std::size_t n = 0;
  auto t0 = bench_clock::now();
  std::chrono::duration<double> el{};
  do {
    for (int i = 0; i < 128; ++i, ++n) co_await once();
    el = bench_clock::now() - t0;
  } while (el.count() < seconds_per_run);
  co_return el.count() * 1e9 / double(n);
}

// send bandwidth: `depth` sends of `size` bytes in flight, the peer
// releasing each message as it comes.
task<void> sink(connection& c, std::size_t& got) {
  for (;;) {
    auto m = co_await c.recv();
    if (!m || m->size() == 0) co_return;
    got += m->size();
  }
}

task<double> send_gbps(connection& c, std::size_t size, int depth) {
  std::vector<std::byte> src(size, std::byte{4});
  std::size_t n = 0;
  auto t0 = bench_clock::now();
  std::chrono::duration<double> el{};
  do {
    std::vector<task<result<void>>> ss;
    for (int i = 0; i < depth; ++i, ++n) ss.push_back(c.send(src));
    for (auto& r : co_await when_all(std::move(ss)))
      if (!r) std::abort();
    el = bench_clock::now() - t0;
  } while (el.count() < seconds_per_run);
  co_return double(n) * double(size) / el.count() / 1e9;
}

// Two-sided figures and one-sided ones on memory that is not shared, on
// the rings (default) or on the socket (SHUTTLE_LOCAL_RINGS=0, read when a
// connection is made).
struct two_sided {
  double lat8 = 0, lat4k = 0, send_bw = 0, write_bw = 0;
};

task<void> measure_two_sided(two_sided& out, transport_kind k, bool rings) {
  ::setenv("SHUTTLE_LOCAL_RINGS", rings ? "1" : "0", 1);
  connection_options o;
  o.receive_buffer_size = 64 << 10;
  o.receive_buffers = 32;
  domain_options d;
  d.kind = k;
  peer_pair p;
  p.sd.emplace(domain::open(d).value());
  p.cd.emplace(domain::open(d).value());
  p.l = p.sd->listen(endpoint::loopback(0), o).value();
  auto [s, c] = co_await when_all(p.l.accept(), p.cd->connect(endpoint::loopback(p.l.local_endpoint()->port()), o));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
  co_await when_all(
      [&]() -> task<void> { co_await echo(p.server); }(),
      [&]() -> task<void> {
        spinning spin(spin_budget);  // one loop: both sides
        out.lat8 = co_await pingpong_ns(p.client, 8);
        out.lat4k = co_await pingpong_ns(p.client, 4096);
        (void)co_await p.client.send({});
      }());
  std::size_t got = 0;
  co_await when_all([&]() -> task<void> { co_await sink(p.server, got); }(),
                    [&]() -> task<void> {
                      out.send_bw = co_await send_gbps(p.client, 64 << 10, 16);
                      (void)co_await p.client.send({});
                    }());
  std::vector<std::byte> target(1 << 20);
  auto mr = p.sd->register_memory(target, access::all).value();
  out.write_bw = co_await write_gbps(p.client, mr.remote(), target.size(), 8);
  (void)co_await p.client.close();
  (void)co_await p.server.close();
  ::unsetenv("SHUTTLE_LOCAL_RINGS");
}

// --peer [seconds]: the peers in two processes (as ucx_perftest runs them,
// bench/local/ucx_compare.sh): a forked server with a shared region that
// echoes messages; this process measures. Prints `name value` lines.
int peer_main(int argc, char** argv) {
  if (argc > 2) seconds_per_run = std::max(0.05, std::atof(argv[2]));
  if (argc > 3) spin_budget = std::chrono::microseconds(std::strtoul(argv[3], nullptr, 10));
  const bool pin = argc > 4 && std::atoi(argv[4]) != 0;
  io_context::options lo;
  lo.ring_spin_budget = spin_budget;  // both processes, the whole run
  int pfd[2];
  if (::pipe(pfd) != 0) return 1;
  const pid_t child = ::fork();
  if (child < 0) return 1;
  domain_options o;
  o.kind = transport_kind::local;
  // Two spinning loops on one core take turns by time slices: pinned, each has its own.
  auto pin_to = [pin](int cpu) {
    if (!pin) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (::sched_setaffinity(0, sizeof set, &set) != 0) std::perror("sched_setaffinity");
  };
  if (child == 0) {
    pin_to(0);
    io_context cctx(lo);
    cctx.run([&]() -> task<void> {
      auto d = domain::open(o).value();
      auto l = d.listen(endpoint::loopback(0)).value();
      const std::uint16_t port = l.local_endpoint()->port();
      if (::write(pfd[1], &port, sizeof port) != sizeof port) std::_Exit(1);
      auto mem = shared_memory::allocate(1 << 20).value();
      auto mr = d.register_memory(mem.span(), access::all).value();
      auto c = (co_await l.accept()).value();
      std::array<std::byte, remote_buffer::wire_size> wire{};
      mr.remote().serialize(wire);
      (void)co_await c.send(wire);
      co_await echo(c);
      auto peer = co_await pong_setup(c, mr, false);
      co_await pong_echo(c, mem.span(), peer);
      (void)co_await c.close();
    }());
    std::_Exit(0);
  }
  pin_to(1);
  std::uint16_t port = 0;
  if (::read(pfd[0], &port, sizeof port) != sizeof port) return 1;
  io_context ctx(lo);
  double bw = 0, lat = 0, rtt = 0, pong = 0;
  std::uint64_t sleeps = 0, msgs = 0;
  ctx.run([&]() -> task<void> {
    auto d = domain::open(o).value();
    auto c = (co_await d.connect(endpoint::loopback(port))).value();
    auto m = (co_await c.recv()).value();
    auto rb = remote_buffer::deserialize(m.data().first<remote_buffer::wire_size>());
    m.reset();
    bw = co_await write_gbps(c, rb, 1 << 20, 1);
    lat = co_await write_lat_ns(c, rb.slice(0, 8).value());
    const auto s0 = ctx.loop_sleeps();
    const auto t0 = bench_clock::now();
    rtt = co_await pingpong_ns(c, 8);
    sleeps = ctx.loop_sleeps() - s0;
    msgs = std::uint64_t(std::chrono::duration<double>(bench_clock::now() - t0).count() * 1e9 / rtt);
    (void)co_await c.send({});
    auto mine = shared_memory::allocate(4096).value();
    auto mr = d.register_memory(mine.span(), access::all).value();
    auto peer = co_await pong_setup(c, mr, true);
    pong = co_await pong_ns(c, mine.span(), peer);
    (void)co_await c.close();
  }());
  int status = 0;
  ::waitpid(child, &status, 0);
  // Bandwidth in MiB/s: ucx_perftest's "MB/s" are 2^20 bytes a second.
  std::printf("write_bw_1MiB_MiBps %.1f\nwrite_lat_8B_us %.4f\nsend_lat_8B_us %.4f\n", bw * 1e9 / 1048576.0,
              lat / 1e3, rtt / 2e3);
  std::printf("write_pingpong_8B_us %.4f\n", pong / 2e3);
  // The measuring side's sleeps per round trip in the ping-pong (about 1
  // with no spin budget, about 0 when the loops poll the rings).
  std::printf("spin_budget_us %lld\nsleeps_per_rtt %.3f\n", static_cast<long long>(spin_budget.count()),
              msgs ? double(sleeps) / double(msgs) : 0.0);
  return 0;
}

}  // namespace

int rtts_main(int argc, char** argv) {
  const long n = argc > 2 ? std::max(1L, std::atol(argv[2])) : 1000;
  double ns = 0;
  io_context ctx;
  ctx.run([&]() -> task<void> {
    peer_pair p;
    co_await connect_pair(p, transport_kind::local);
    co_await when_all([&]() -> task<void> { co_await echo(p.server); }(),
                      [&]() -> task<void> {
                        spinning spin(spin_budget);
                        const std::vector<std::byte> msg(8, std::byte{3});
                        const auto t0 = bench_clock::now();
                        for (long i = 0; i < n; ++i) {
                          if (!co_await p.client.send(msg)) std::abort();
                          auto r = co_await p.client.recv();
                          if (!r || r->size() != msg.size()) std::abort();
                        }
                        ns = std::chrono::duration<double, std::nano>(bench_clock::now() - t0).count() / double(n);
                        (void)co_await p.client.send({});
                      }());
    (void)co_await p.client.close();
    (void)co_await p.server.close();
  }());
  std::printf("rtts %ld\nrtt_8B_ns %.1f\n", n, ns);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--peer") == 0) return peer_main(argc, argv);
  if (argc > 1 && std::strcmp(argv[1], "--rtts") == 0) return rtts_main(argc, argv);
  if (argc > 1) seconds_per_run = std::max(0.05, std::atof(argv[1]));
  if (argc > 2) spin_budget = std::chrono::microseconds(std::strtoul(argv[2], nullptr, 10));
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
  two_sided rings, sock, tcp;
  ctx.run([&]() -> task<void> {
    co_await measure_two_sided(rings, transport_kind::local, true);
    co_await measure_two_sided(sock, transport_kind::local, false);
    co_await measure_two_sided(tcp, transport_kind::tcp, true);
  }());
  const double mc = memcpy_gbps(size);
  std::printf("memcpy 1 MiB (one thread):        %8.2f GB/s\n", mc);
  std::printf("local write_bw 1 MiB (depth 1):   %8.2f GB/s  = %.2fx memcpy (target >= 0.8)\n", local_bw,
              local_bw / mc);
  std::printf("tcp   write_bw 1 MiB (depth 8):   %8.2f GB/s  local = %.1fx tcp (target >= 5)\n", tcp_bw,
              local_bw / tcp_bw);
  std::printf("local write_lat 8 B:              %8.1f ns (target <= 1000)\n", local_lat);
  std::printf("tcp   write_lat 8 B:              %8.1f ns  (%.0fx local)\n", tcp_lat, tcp_lat / local_lat);
  std::printf("(round trips: ring_spin_budget %lld us on the loop)\n", static_cast<long long>(spin_budget.count()));
  std::printf("send/recv round trip, 8 B:   rings %7.2f us  socket %7.2f us  tcp %7.2f us  (rings = %.2fx socket)\n",
              rings.lat8 / 1e3, sock.lat8 / 1e3, tcp.lat8 / 1e3, rings.lat8 / sock.lat8);
  std::printf("send/recv round trip, 4 KiB: rings %7.2f us  socket %7.2f us  tcp %7.2f us  (rings = %.2fx socket)\n",
              rings.lat4k / 1e3, sock.lat4k / 1e3, tcp.lat4k / 1e3, rings.lat4k / sock.lat4k);
  std::printf("send bw 64 KiB (depth 16):   rings %7.2f GB/s socket %7.2f GB/s tcp %7.2f GB/s (rings = %.2fx socket)\n",
              rings.send_bw, sock.send_bw, tcp.send_bw, rings.send_bw / sock.send_bw);
  std::printf("write_bw 1 MiB, not shared:  rings %7.2f GB/s socket %7.2f GB/s tcp %7.2f GB/s (rings = %.2fx socket)\n",
              rings.write_bw, sock.write_bw, tcp.write_bw, rings.write_bw / sock.write_bw);
  return 0;
}
