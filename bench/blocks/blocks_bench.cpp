// Block-list transfers against one contiguous transfer of the same bytes,
// measured in the same run (issue 31's targets), printed as nixlbench does:
// block size, batch size, bandwidth, average and p99 post time and transfer
// time per batch, and the ratio of the two bandwidths.
//
// The target is a child process (forked first) that registers its memory
// and hands the initiator its descriptor; the initiator writes (or reads) N
// blocks of B bytes, block i from local slot i to a shuffled remote slot,
// slots 2B apart so that nothing merges, and, alternately, one transfer of
// N*B bytes. "post" is the time write_blocks takes to return to its caller
// (checks, merging and everything posted or queued: the send queue is made
// deep enough for the whole list, as issue 31 measures it); "transfer" is
// the time to its completion.
//
// The doorbell (verbs on Soft-RoCE): with doorbell_shim preloaded
// (LD_PRELOAD=.../libdoorbell_shim.so, see doorbell_shim.cpp), the writes
// on the uverbs command fd are timed, and the list row is followed by a
// line with, per list: the doorbells (POST_SEND commands) rung inside the
// post window and their time, the doorbells rung after the list first
// waited, and "post path" = post minus the doorbells' time inside the
// window, also per block. Under rxe the doorbell runs the requester (the
// wire work) in the kernel, inside ibv_post_send; what is left is the
// loop thread's own work: the checks, merging, the WRs built, chained and
// queued by librxe, one look at the CQ. That covers the whole list only
// if every chain was posted before the list first waited: the verbs
// provider posts a chain of as many WRs as the send queue has free slots
// and, when none is free, waits for completions before the next chain, so
// with a list longer than the queue (--send-queue D < N) the post window
// holds only the first chains. The bench checks it per list: a doorbell
// after the first wait (from the list: nothing else posts meanwhile) means
// that the window was partial; the per-block figure is then not printed.
// Under valgrind, the list's post windows (and only those) are collected
// by callgrind (run it with --collect-atstart=no: bench/blocks/insn-post.sh),
// the user-space instructions of the same window, the kernel's doorbell
// work excluded by construction.
//
// With --rails R, striping instead: one N*B transfer over a
// connection_group of R rails against the same transfer over a group of one
// rail, alternated; the ratio is R rails / one. Each rail has a loop thread
// of its own on each side (a runtime thread and a domain per rail in the
// initiator, a thread and a domain per rail in the target), as multi-rail
// users arrange it, and the one-rail baseline is the same arrangement with
// one rail (its own connection on rail 0's threads): so one connection,
// not one shared loop thread, is what the baseline is bound by. The group
// itself lives on the main thread and hops to each rail's loop.
// --one-loop: every rail and the baseline on one loop thread per side
// (where a second rail adds a socket but no CPU).
//
// Usage: blocks_bench [--blocks N] [--block-size B] [--iters K] [--read]
//                     [--rails R [--one-loop]] [--transport tcp|verbs|local]
//                     [--addr IP] [--no-write-list] [--only blocks|contiguous] [--shared]
//                     [--ascending] [--send-queue D]
//
// --ascending: block i goes to remote slot i (no shuffle; still 2B apart,
// so nothing merges): the list's own cost without the random page order.
//
// --send-queue D: the connections' send_queue_depth (default max(N + 1, 128):
// the whole list fits).
//
// --shared (local): the target's memory comes from shared_memory::allocate,
// so the initiator's accesses are a memcpy on its mapping (without it: a
// std::vector, reached through the engine's frames).
//
// --only: time one of the two transfers alone (no ratio printed), so that a
// profiler's count over a run is the cost of that transfer (callgrind: run
// --iters K and K+10, the difference over 10 is one transfer's instructions).
//
// --no-write-list (tcp and local): the target does not announce the
// WRITE_LIST frame, as a peer that predates it: every block is a WRITE
// frame of its own (the comparison for the frame's gain).
#include <shuttle/shuttle.hpp>
#include <shuttle/local.hpp>
#include <shuttle/transport.hpp>

#include "stats.hpp"  // the tcp engine's tcp_announce_write_list (internal)
#include "doorbell_shim.h"

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define BLOCKS_TOGGLE_COLLECT() CALLGRIND_TOGGLE_COLLECT
#else
#define BLOCKS_TOGGLE_COLLECT() ((void)0)
#endif

#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;
using bench_clock = std::chrono::steady_clock;

namespace {

struct config {
  std::size_t blocks = 1000, block_size = 4096, iters = 30, rails = 1;
  std::size_t send_queue = 0;  // 0: max(blocks + 1, 128)
  bool read = false;
  bool one_loop = false;  // --rails: every rail on one loop thread per side
  bool no_write_list = false;  // tcp/local: the target does not announce WRITE_LIST (a peer from before it)
  int only = 0;                // 1: blocks alone, 2: the contiguous transfer alone
  bool shared = false;         // local: the target's memory from shared_memory::allocate
  bool ascending = false;      // remote slots in order, not shuffled
  transport_kind kind = transport_kind::tcp;
  std::string addr = "127.0.0.1";
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "blocks_bench: %s\nusage: blocks_bench [--blocks N] [--block-size B] [--iters K] [--read] "
               "[--rails R [--one-loop]] [--transport tcp|verbs|local] [--addr IP] [--no-write-list]\n"
               "       [--only blocks|contiguous] [--shared] [--ascending] [--send-queue D]\n",
               why);
  std::exit(2);
}

std::size_t number(const char* s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, 10);
  if (!*s || *end || v == 0) usage("bad number");
  return static_cast<std::size_t>(v);
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage("missing value");
      return argv[++i];
    };
    if (a == "--blocks") c.blocks = number(next());
    else if (a == "--block-size") c.block_size = number(next());
    else if (a == "--iters") c.iters = number(next());
    else if (a == "--read") c.read = true;
    else if (a == "--no-write-list") c.no_write_list = true;
    else if (a == "--shared") c.shared = true;
    else if (a == "--ascending") c.ascending = true;
    else if (a == "--rails") c.rails = number(next());
    else if (a == "--one-loop") c.one_loop = true;
    else if (a == "--send-queue") c.send_queue = number(next());
    else if (a == "--addr") c.addr = next();
    else if (a == "--only") {
      std::string w = next();
      if (w == "blocks") c.only = 1;
      else if (w == "contiguous") c.only = 2;
      else usage("--only takes blocks or contiguous");
    }
    else if (a == "--transport") {
      auto k = parse_transport_kind(next());
      if (!k) usage("bad transport");
      c.kind = *k;
    } else if (a == "--help") {
      std::printf("blocks_bench [--blocks N] [--block-size B] [--iters K] [--read] [--rails R [--one-loop]] "
                  "[--transport K] [--addr IP] [--no-write-list] [--only blocks|contiguous] [--shared] [--ascending] "
                  "[--send-queue D]\n");
      std::exit(0);
    } else usage("unknown argument");
  }
  if (c.blocks * c.block_size > (std::size_t(1) << 30)) usage("N*B over 1 GiB");
  if (c.rails > 64) usage("more than 64 rails");
  if (c.send_queue > UINT32_MAX) usage("--send-queue too large");
  if (c.one_loop && c.rails < 2) usage("--one-loop needs --rails 2 or more");
  if (c.only && c.rails > 1) usage("--only is for one connection");
  if (c.shared && (c.kind != transport_kind::local || c.rails > 1)) usage("--shared is for one local connection");
  return c;
}

connection_options conn_opts(const config& c) {
  connection_options o;
  o.send_queue_depth =
      static_cast<std::uint32_t>(c.send_queue ? c.send_queue : std::max<std::size_t>(c.blocks + 1, 128));
  return o;
}

domain open_domain(const config& c) {
  domain_options o;
  o.kind = c.kind;
  auto d = domain::open(o);
  if (!d) {
    std::fprintf(stderr, "blocks_bench: domain: %s\n", d.error().message().c_str());
    std::exit(d.error() == make_error_code(errc::not_supported) ? 77 : 1);
  }
  return std::move(*d);
}

// The target: 2*N*B bytes registered, its descriptor sent, then it waits
// for the initiator's "done".
int target(const config& c, int port_pipe) {
  io_context ctx;
  return ctx.run([&]() -> task<int> {
    domain d = open_domain(c);
    std::vector<std::byte> vec;
    shared_memory shm;
    std::span<std::byte> mem;
    if (c.shared) {
      shm = shared_memory::allocate(2 * c.blocks * c.block_size).value();
      mem = shm.span();
    } else {
      vec.resize(2 * c.blocks * c.block_size);
      mem = vec;
    }
    std::fill(mem.begin(), mem.end(), std::byte{1});
    auto mr = d.register_memory(mem, access::all).value();
    if (c.no_write_list) detail::tcp_announce_write_list(false);
    auto l = d.listen(endpoint::parse(c.addr + ":0").value(), conn_opts(c)).value();
    std::uint16_t port = l.local_endpoint()->port();
    if (::write(port_pipe, &port, sizeof port) != sizeof port) co_return 1;
    ::close(port_pipe);
    auto conn = co_await with_timeout(l.accept(), 30s);
    if (!conn) co_return 1;
    std::vector<connection> more;  // the other rails
    for (std::size_t i = 1; i < c.rails; ++i) {
      auto m = co_await with_timeout(l.accept(), 30s);
      if (!m) co_return 1;
      more.push_back(std::move(*m));
    }
    std::array<std::byte, remote_buffer::wire_size> desc;
    mr.remote().serialize(desc);
    if (!co_await conn->send(desc)) co_return 1;
    auto done = co_await conn->recv();
    (void)co_await conn->close();
    for (auto& m : more) (void)co_await m.close();
    co_return done ? 0 : 1;
  }());
}

// The doorbell shim's reader, when it is preloaded (doorbell_shim.h).
shuttle_doorbell_read_fn doorbell_reader() {
  static const auto f = reinterpret_cast<shuttle_doorbell_read_fn>(dlsym(RTLD_DEFAULT, "shuttle_doorbell_read"));
  return f;
}

shuttle_doorbell_counts doorbells() {
  shuttle_doorbell_counts d{};
  if (auto f = doorbell_reader()) f(&d);
  return d;
}

struct sample {
  double post_us, transfer_us;
  // With the doorbell shim: inside the post window, the doorbells rung
  // (POST_SEND writes), their time, other uverbs command writes; after the
  // window until the list's completion, the doorbells rung.
  std::uint64_t bells_in = 0, bells_after = 0, other_in = 0;
  double bell_us = 0;
  std::uint64_t faults = 0;  // the thread's page faults (minor and major) inside the post window
};

std::uint64_t page_faults() {
  rusage u{};
  ::getrusage(RUSAGE_THREAD, &u);
  return static_cast<std::uint64_t>(u.ru_minflt + u.ru_majflt);
}

struct summary {
  double gbps, post_avg, post_p99, xfer_avg, xfer_p99;
};

summary summarize(std::vector<sample> v, std::size_t bytes) {
  summary s{};
  double total = 0;
  for (auto& x : v) {
    s.post_avg += x.post_us;
    s.xfer_avg += x.transfer_us;
    total += x.transfer_us;
  }
  s.post_avg /= double(v.size());
  s.xfer_avg /= double(v.size());
  auto p99 = [&](auto field) {
    std::vector<double> a;
    for (auto& x : v) a.push_back(x.*field);
    std::sort(a.begin(), a.end());
    return a[std::min(a.size() - 1, static_cast<std::size_t>(double(a.size()) * 0.99))];
  };
  s.post_p99 = p99(&sample::post_us);
  s.xfer_p99 = p99(&sample::transfer_us);
  s.gbps = double(bytes) * double(v.size()) / (total * 1e-6) / 1e9;
  return s;
}

// One timed batch: `start` makes the awaitable; the scope runs it until it
// first waits (the post), join() until it is done. `profile`: callgrind
// collects inside the post window (a no-op outside valgrind).
template <class Start>
task<sample> timed(Start start, bool& ok, bool profile = false) {
  async_scope scope;
  const auto d0 = doorbells();
  const auto f0 = page_faults();
  if (profile) BLOCKS_TOGGLE_COLLECT();
  auto t0 = bench_clock::now();
  scope.spawn(start(ok));
  auto t1 = bench_clock::now();
  if (profile) BLOCKS_TOGGLE_COLLECT();
  const auto d1 = doorbells();
  const auto f1 = page_faults();
  co_await scope.join();
  auto t2 = bench_clock::now();
  const auto d2 = doorbells();
  sample s{std::chrono::duration<double, std::micro>(t1 - t0).count(),
           std::chrono::duration<double, std::micro>(t2 - t0).count()};
  s.bells_in = d1.post_send_calls - d0.post_send_calls;
  s.bells_after = d2.post_send_calls - d1.post_send_calls;
  s.other_in = d1.other_calls - d0.other_calls;
  s.bell_us = double(d1.post_send_ns - d0.post_send_ns) * 1e-3;
  s.faults = f1 - f0;
  co_return s;
}

// The list row's doorbell line (with the shim preloaded): see the header.
void print_doorbells(const std::vector<sample>& v, std::size_t n) {
  double bell = 0, path = 0, path_min = 1e300;
  std::uint64_t in = 0, after = 0, other = 0, partial = 0, faults = 0;
  for (auto& x : v) {
    bell += x.bell_us;
    const double p = x.post_us - x.bell_us;
    path += p;
    path_min = std::min(path_min, p);
    in += x.bells_in;
    after += x.bells_after;
    other += x.other_in;
    partial += x.bells_after > 0 ? 1 : 0;
    faults += x.faults;
  }
  const double k = double(v.size());
  std::printf("doorbells  per list: %.1f in the post window (%.1f us avg), %.1f after the first wait; "
              "other uverbs commands in the window: %.1f; page faults in the window: %.1f\n",
              double(in) / k, bell / k, double(after) / k, double(other) / k, double(faults) / k);
  if (in == 0) {
    std::printf("post path  not measured: the shim saw no doorbell (not the verbs provider on rxe?)\n");
  } else if (partial > 0) {
    std::printf("post path  not measured over the list: in %llu of %zu lists a chain was posted after the list "
                "first waited (a list longer than the free send queue); window minus doorbells: %.1f us avg\n",
                static_cast<unsigned long long>(partial), v.size(), path / k);
  } else {
    std::printf("post path  (post minus doorbells, whole list in the window): %.1f us avg, %.1f us min; "
                "%.1f ns/block avg, %.1f ns/block min\n",
                path / k, path_min, path / k * 1e3 / double(n), path_min * 1e3 / double(n));
  }
}

// One N*B transfer over a group of c.rails connections (the first is
// `conn`'s twin: a group of its own connections) against one connection.
task<int> striping(const config& c, domain& d, connection& conn, std::vector<connection> others,
                   std::span<std::byte> mem, remote_buffer remote) {
  const std::size_t bytes = c.blocks * c.block_size;
  std::vector<connection> rails;
  for (auto& o : others) rails.push_back(std::move(o));
  // The group gets the other rails plus one more: conn stays the single
  // connection's baseline, used alone, in turn with the group.
  rails.push_back(std::move(conn));
  connection_group g(std::move(rails));
  auto whole = remote.slice(0, bytes).value();
  std::span<std::byte> data = mem.first(bytes);
  auto grouped = [&](bool& ok) -> task<void> {
    auto r = c.read ? co_await g.read(data, whole) : co_await g.write(data, whole);
    ok = ok && r.has_value();
  };
  auto single = [&](bool& ok) -> task<void> {
    connection& one = g.rail(g.size() - 1);
    auto r = c.read ? co_await one.read(data, whole) : co_await one.write(data, whole);
    ok = ok && r.has_value();
  };
  bool ok = true;
  std::vector<sample> gs, ss;
  for (std::size_t i = 0; i < c.iters + 2 && ok; ++i) {
    auto a = co_await timed(grouped, ok);
    auto b = co_await timed(single, ok);
    if (i >= 2) {
      gs.push_back(a);
      ss.push_back(b);
    }
  }
  const char bye[] = "done";
  (void)co_await g.rail(g.size() - 1).send(std::as_bytes(std::span(bye)));  // the target's first connection
  (void)co_await g.close();
  if (!ok) co_return 1;
  auto sg = summarize(gs, bytes), s1 = summarize(ss, bytes);
  std::printf("provider %s, %s of %zu bytes, %zu iterations\n", to_string(d.kind()), c.read ? "read" : "write", bytes,
              c.iters);
  std::printf("%-12s %10s %14s %14s\n", "", "B/W (GB/s)", "avg xfer(us)", "p99 xfer(us)");
  std::printf("%-12s %10.3f %14.1f %14.1f\n", (std::to_string(c.rails) + " rails").c_str(), sg.gbps, sg.xfer_avg,
              sg.xfer_p99);
  std::printf("%-12s %10.3f %14.1f %14.1f\n", "1 connection", s1.gbps, s1.xfer_avg, s1.xfer_p99);
  std::printf("ratio rails/one bandwidth: %.3f\n", sg.gbps / s1.gbps);
  co_return 0;
}

int initiator(const config& c, std::uint16_t port) {
  io_context ctx;
  return ctx.run([&]() -> task<int> {
    domain d = open_domain(c);
    auto conn = co_await with_timeout(d.connect(endpoint::parse(c.addr + ":" + std::to_string(port)).value(), conn_opts(c)), 30s);
    if (!conn) {
      std::fprintf(stderr, "blocks_bench: connect: %s\n", conn.error().message().c_str());
      co_return 1;
    }
    std::vector<connection> others;
    for (std::size_t i = 1; i < c.rails; ++i) {
      auto o = co_await with_timeout(d.connect(endpoint::parse(c.addr + ":" + std::to_string(port)).value(), conn_opts(c)), 30s);
      if (!o) co_return 1;
      others.push_back(std::move(*o));
    }
    auto desc = co_await conn->recv();
    if (!desc || desc->size() != remote_buffer::wire_size) co_return 1;
    remote_buffer remote = remote_buffer::deserialize(desc->data().first<remote_buffer::wire_size>());
    desc->reset();
    const std::size_t n = c.blocks, b = c.block_size;
    std::vector<std::byte> mem(2 * n * b, std::byte{2});
    auto mr = d.register_memory(mem, access::all).value();
    std::vector<std::size_t> slot(n);
    std::iota(slot.begin(), slot.end(), 0);
    if (!c.ascending) std::shuffle(slot.begin(), slot.end(), std::mt19937(1));
    std::vector<block> blocks(n);
    for (std::size_t i = 0; i < n; ++i) blocks[i] = {2 * i * b, 2 * slot[i] * b, b};
    auto whole = remote.slice(0, n * b).value();
    std::span<std::byte> contiguous(mem.data(), n * b);

    auto list = [&](bool& ok) -> task<void> {
      block_result r = c.read ? co_await conn->read_blocks(mem, remote, blocks)
                              : co_await conn->write_blocks(mem, remote, blocks);
      ok = ok && r.has_value();
      if (!r) std::fprintf(stderr, "blocks_bench: block %zu: %s\n", r.failed_block(), r.error().message().c_str());
    };
    auto one = [&](bool& ok) -> task<void> {
      result<void> r = c.read ? co_await conn->read(contiguous, whole) : co_await conn->write(contiguous, whole);
      ok = ok && r.has_value();
      if (!r) std::fprintf(stderr, "blocks_bench: contiguous: %s\n", r.error().message().c_str());
    };
    if (c.rails > 1) co_return co_await striping(c, d, *conn, std::move(others), mem, remote);
    bool ok = true;
    std::vector<sample> lists, ones;
    const auto before = block_transfer_stats();
    for (std::size_t i = 0; i < c.iters + 2 && ok; ++i) {  // 2 warm-up rounds
      // Alternated, so that the host's load drifts over both alike.
      sample sl{1, 1}, so{1, 1};
      if (c.only != 2) sl = co_await timed(list, ok, i >= 2);
      if (c.only != 1) so = co_await timed(one, ok);
      if (i >= 2) {
        lists.push_back(sl);
        ones.push_back(so);
      }
    }
    const auto after = block_transfer_stats();
    const char bye[] = "done";
    (void)co_await conn->send(std::as_bytes(std::span(bye)));
    (void)co_await conn->close();
    if (!ok) co_return 1;
    auto sl = summarize(lists, n * b), so = summarize(ones, n * b);
    std::printf("provider %s (%s), %s, %zu iterations, %.1f operations per list\n", to_string(d.kind()),
                d.describe().c_str(), c.read ? "read" : "write", c.iters,
                after.lists > before.lists
                    ? double(after.operations - before.operations) / double(after.lists - before.lists)
                    : 0.0);
    std::printf("%-10s %10s %8s %10s %12s %12s %14s %14s %10s\n", "", "block size", "batch", "B/W (GB/s)",
                "avg post(us)", "p99 post(us)", "avg xfer(us)", "p99 xfer(us)", "post/block");
    if (c.only != 2)
        std::printf("%-10s %10zu %8zu %10.3f %12.1f %12.1f %14.1f %14.1f %8.1fns\n", "blocks", b, n, sl.gbps, sl.post_avg,
                  sl.post_p99, sl.xfer_avg, sl.xfer_p99, sl.post_avg * 1e3 / double(n));
    if (c.only != 2 && doorbell_reader()) print_doorbells(lists, n);
    if (c.only != 1)
        std::printf("%-10s %10zu %8d %10.3f %12.1f %12.1f %14.1f %14.1f %10s\n", "contiguous", n * b, 1, so.gbps,
                  so.post_avg, so.post_p99, so.xfer_avg, so.xfer_p99, "");
    if (!c.only) std::printf("ratio blocks/contiguous bandwidth: %.3f\n", sl.gbps / so.gbps);
    co_return 0;
  }());
}

// ------------------------------------------------- striping, a loop per rail

// Runs `t` on `loop`'s thread, then comes back.
template <class T>
task<T> on_loop(io_context& loop, task<T> t) {
  io_context& home = io_context::current();
  co_await loop.schedule();
  T v = co_await std::move(t);
  co_await home.schedule();
  co_return v;
}

// The target's rail r: a thread with its own loop and domain, the shared
// memory registered there; it accepts `conns` connections (rail 0's thread:
// its rail and the baseline's), sends each the descriptor, and waits for
// each one's "done".
int target_rail(const config& c, std::span<std::byte> mem, std::size_t conns, std::uint16_t& port_out,
                std::mutex& m, std::condition_variable& cv, std::size_t& ready) {
  io_context ctx;
  return ctx.run([&]() -> task<int> {
    domain d = open_domain(c);
    auto mr = d.register_memory(mem, access::all);
    auto l = d.listen(endpoint::parse(c.addr + ":0").value(), conn_opts(c));
    {
      std::lock_guard lock(m);
      if (mr && l) port_out = l->local_endpoint()->port();
      ++ready;
      cv.notify_all();
    }
    if (!mr || !l) co_return 1;
    std::array<std::byte, remote_buffer::wire_size> desc;
    mr->remote().serialize(desc);
    std::vector<connection> cs;
    for (std::size_t i = 0; i < conns; ++i) {
      auto a = co_await with_timeout(l->accept(), 30s);
      if (!a || !co_await a->send(desc)) co_return 1;
      cs.push_back(std::move(*a));
    }
    bool ok = true;
    for (auto& x : cs) ok = (co_await x.recv()).has_value() && ok;
    for (auto& x : cs) (void)co_await x.close();
    co_return ok ? 0 : 1;
  }());
}

int rails_target(const config& c, int port_pipe) {
  std::vector<std::byte> mem(c.blocks * c.block_size, std::byte{1});
  std::vector<std::uint16_t> ports(c.rails, 0);
  std::vector<int> rc(c.rails, 1);
  std::mutex m;
  std::condition_variable cv;
  std::size_t ready = 0;
  std::vector<std::thread> ts;
  for (std::size_t r = 0; r < c.rails; ++r)
    ts.emplace_back([&, r] { rc[r] = target_rail(c, mem, r == 0 ? 2 : 1, ports[r], m, cv, ready); });
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return ready == c.rails; });
  }
  const bool up = std::all_of(ports.begin(), ports.end(), [](std::uint16_t p) { return p != 0; });
  if (up) {
    const auto n = static_cast<ssize_t>(ports.size() * sizeof(std::uint16_t));
    if (::write(port_pipe, ports.data(), ports.size() * sizeof(std::uint16_t)) != n) std::_Exit(1);
  }
  ::close(port_pipe);  // a short read: the initiator gives up
  for (auto& t : ts) t.join();
  return up && std::all_of(rc.begin(), rc.end(), [](int x) { return x == 0; }) ? 0 : 1;
}

// The initiator's rail r, made and torn down on its runtime thread.
struct rail_end {
  std::optional<domain> d;
  std::optional<memory_region> mr;
  std::vector<connection> cs;
  remote_buffer remote{};
};

task<int> open_rail(const config& c, rail_end& e, std::uint16_t port, std::span<std::byte> mem, std::size_t conns) {
  e.d.emplace(open_domain(c));
  auto mr = e.d->register_memory(mem, access::all);
  if (!mr) co_return 1;
  e.mr.emplace(std::move(*mr));
  for (std::size_t i = 0; i < conns; ++i) {
    auto x = co_await with_timeout(e.d->connect(endpoint::parse(c.addr + ":" + std::to_string(port)).value(), conn_opts(c)), 30s);
    if (!x) {
      std::fprintf(stderr, "blocks_bench: connect: %s\n", x.error().message().c_str());
      co_return 1;
    }
    auto desc = co_await x->recv();
    if (!desc || desc->size() != remote_buffer::wire_size) co_return 1;
    e.remote = remote_buffer::deserialize(desc->data().first<remote_buffer::wire_size>());
    e.cs.push_back(std::move(*x));
  }
  co_return 0;
}

task<int> send_done(connection& x) {
  const char bye[] = "done";
  co_return (co_await x.send(std::as_bytes(std::span(bye)))).has_value() ? 0 : 1;
}

task<int> close_rail(rail_end& e) {
  e.cs.clear();
  e.mr.reset();
  e.d.reset();
  co_return 0;
}

int rails_initiator(const config& c, const std::vector<std::uint16_t>& ports) {
  runtime rt(c.rails);
  io_context ctx;
  return ctx.run([&]() -> task<int> {
    const std::size_t bytes = c.blocks * c.block_size;
    std::vector<std::byte> mem(bytes, std::byte{2});
    std::vector<rail_end> ends(c.rails);
    int bad = 0;
    for (std::size_t r = 0; r < c.rails && !bad; ++r)
      bad = co_await on_loop(rt.context(r), open_rail(c, ends[r], ports[r], mem, r == 0 ? 2 : 1));
    if (bad) {
      for (std::size_t r = 0; r < c.rails; ++r) co_await on_loop(rt.context(r), close_rail(ends[r]));
      co_return 1;
    }
    std::vector<connection> rails, one;
    std::vector<io_context*> loops;
    std::vector<remote_buffer> remotes;
    for (std::size_t r = 0; r < c.rails; ++r) {
      rails.push_back(std::move(ends[r].cs[0]));
      loops.push_back(&rt.context(r));
      remotes.push_back(ends[r].remote);
    }
    one.push_back(std::move(ends[0].cs[1]));
    connection_group g(std::move(rails), loops), g1(std::move(one), {&rt.context(0)});
    std::span<const remote_buffer> remote1(remotes.data(), 1);
    std::span<std::byte> data(mem);
    auto grouped = [&](bool& ok) -> task<void> {
      auto r = c.read ? co_await g.read(data, remotes) : co_await g.write(data, remotes);
      if (!r) std::fprintf(stderr, "blocks_bench: %zu rails: %s\n", c.rails, r.error().message().c_str());
      ok = ok && r.has_value();
    };
    auto single = [&](bool& ok) -> task<void> {
      auto r = c.read ? co_await g1.read(data, remote1) : co_await g1.write(data, remote1);
      if (!r) std::fprintf(stderr, "blocks_bench: one rail: %s\n", r.error().message().c_str());
      ok = ok && r.has_value();
    };
    bool ok = true;
    std::vector<sample> gs, ss;
    for (std::size_t i = 0; i < c.iters + 2 && ok; ++i) {  // 2 warm-up rounds; the order alternates
      sample a{}, b{};
      if (i % 2 == 0) {
        a = co_await timed(grouped, ok);
        b = co_await timed(single, ok);
      } else {
        b = co_await timed(single, ok);
        a = co_await timed(grouped, ok);
      }
      if (i >= 2) {
        gs.push_back(a);
        ss.push_back(b);
      }
    }
    for (std::size_t r = 0; r < g.size(); ++r) bad |= co_await on_loop(rt.context(r), send_done(g.rail(r)));
    bad |= co_await on_loop(rt.context(0), send_done(g1.rail(0)));
    (void)co_await g.close();
    (void)co_await g1.close();
    g = connection_group{};  // each rail is destroyed on its loop, before close_rail below runs there
    g1 = connection_group{};
    for (std::size_t r = 0; r < c.rails; ++r) co_await on_loop(rt.context(r), close_rail(ends[r]));
    if (!ok || bad) co_return 1;
    auto sg = summarize(gs, bytes), s1 = summarize(ss, bytes);
    std::printf("provider %s, %s of %zu bytes, %zu iterations, a loop thread per rail on each side\n",
                to_string(c.kind), c.read ? "read" : "write", bytes, c.iters);
    std::printf("%-12s %10s %14s %14s\n", "", "B/W (GB/s)", "avg xfer(us)", "p99 xfer(us)");
    std::printf("%-12s %10.3f %14.1f %14.1f\n", (std::to_string(c.rails) + " rails").c_str(), sg.gbps, sg.xfer_avg,
                sg.xfer_p99);
    std::printf("%-12s %10.3f %14.1f %14.1f\n", "1 rail", s1.gbps, s1.xfer_avg, s1.xfer_p99);
    std::printf("ratio rails/one bandwidth: %.3f\n", sg.gbps / s1.gbps);
    co_return 0;
  }());
}

int rails_main(const config& c) {
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  pid_t child = ::fork();  // first: before any provider state or thread exists
  if (child < 0) return 1;
  if (child == 0) {
    ::close(fds[0]);
    std::_Exit(rails_target(c, fds[1]));
  }
  ::close(fds[1]);
  std::vector<std::uint16_t> ports(c.rails);
  const auto n = static_cast<ssize_t>(ports.size() * sizeof(std::uint16_t));
  if (::read(fds[0], ports.data(), ports.size() * sizeof(std::uint16_t)) != n) {
    std::fprintf(stderr, "blocks_bench: the target did not start\n");
    ::waitpid(child, nullptr, 0);
    return 1;
  }
  int rc = rails_initiator(c, ports);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) rc = 1;
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  config c = parse(argc, argv);
  if (c.rails > 1 && !c.one_loop) return rails_main(c);
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  pid_t child = ::fork();  // first: before any provider state exists
  if (child < 0) return 1;
  if (child == 0) {
    ::close(fds[0]);
    std::_Exit(target(c, fds[1]));
  }
  ::close(fds[1]);
  std::uint16_t port = 0;
  if (::read(fds[0], &port, sizeof port) != sizeof port) {
    std::fprintf(stderr, "blocks_bench: the target did not start\n");
    ::waitpid(child, nullptr, 0);
    return 1;
  }
  int rc = initiator(c, port);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) rc = 1;
  return rc;
}
