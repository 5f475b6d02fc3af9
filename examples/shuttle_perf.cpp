// shuttle-perf: perftest-style RDMA micro-benchmarks over the transport API,
// on any provider (tcp, verbs, local, or automatic: local to a server on this
// host).
//
//   server: shuttle-perf [--transport tcp|verbs|local|auto] [--port P] [--bind ADDR] [--loop]
//   client: shuttle-perf HOST [--transport ...] [--port P]
//             --test write_bw|read_bw|send_bw|write_lat|send_lat|read_lat|atomic
//             [--size S | --sweep] [--iters N] [--depth D] [--batch B] [--slots N] [--warmup N] [--json]
//
// The client tells the server what it will run (a hello: test, largest size,
// depth, the client's own remote_buffer); the server registers a buffer and
// sends its remote_buffer back over a send. Each measured point is framed by
// a POINT/READY and END/RESULT exchange of small sends: the server prepares
// (fills or clears its buffer), plays its part (receives for send_bw, pongs
// for the latency ping-pongs) and verifies what landed in its memory (write_bw:
// every slot holds the pattern; atomic: the counter holds the number of adds).
//
// Bandwidth tests keep D operations in flight: D/B worker coroutines, each
// posting a batch of B operations (connection::post_batch: on verbs one
// ibv_post_send of B chained WRs with only the last one signaled) as soon as
// its previous batch completes. This is perftest's post list and completion
// moderation (ib_*_bw: --post_list, --cq-mod, 100 by default) in one knob.
// The default B is D/4 (32 at the default depth 128, at most 64): four
// batches in flight, so the send queue never drains while a worker waits for
// its completion; B = 1 is one signaled operation at a time (no batching).
// atomic is never batched (each fetch_and_add returns a value).
// write_lat is a ping-pong of RDMA writes where each side polls its own
// registered memory for the peer's new value (the last byte, as perftest);
// send_lat a ping-pong of sends; both report half the round trip. read_lat
// times serial reads. atomic is a fetch_and_add rate test (8 B, D in flight).
// Each latency iteration starts one operation prepared before the loop
// (connection::prepare: its WR built once), as perftest posts one pre-built
// WR; --ops single calls read() / write() / send() each time instead.
// Latency tests busy-poll as perftest does: --spin-us (default 5000) is how
// long the loop keeps polling the CQ (verbs: the domain's busy-poll budget
// and the loop's spin budget) and the io_uring ring (tcp: ring_spin_budget)
// after the last completion before it sleeps.
//
// Output: perftest's table (MB = 2^20 bytes, as perftest), and with --json one
// JSON object per row on its own line. Errors: a message on stderr, exit 1
// (2 for bad usage).
// The server ends when its client goes (with --loop: never), or on SIGINT/
// SIGTERM: a clean exit (0) with the line "shuttle-perf: served N sessions
// (F failed)".
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>
#include <shuttle/verbs/verbs.hpp>

#include "cli.hpp"
#include "tool_support.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using namespace shuttle;

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

[[noreturn, gnu::noinline, gnu::cold]] void fail_with(const char* what, std::error_code ec) {
  fail(std::string(what) + ": " + ec.message());
}
template <class T>
T check(result<T> r, const char* what) {
  if (!r) fail_with(what, r.error());
  if constexpr (!std::is_void_v<T>) return std::move(*r);
}
// As check, for the latency loops: the value stays where it is (no move),
// and the check is a test and a branch.
template <class T>
inline void require(const result<T>& r, const char* what) {
  if (!r) [[unlikely]]
    fail_with(what, r.error());
}

enum class test_id : std::uint32_t { write_bw = 1, read_bw, send_bw, write_lat, send_lat, read_lat, atomic };

struct test_info {
  test_id id;
  const char* name;
  bool latency;
};
constexpr std::array<test_info, 7> tests{{{test_id::write_bw, "write_bw", false},
                                          {test_id::read_bw, "read_bw", false},
                                          {test_id::send_bw, "send_bw", false},
                                          {test_id::write_lat, "write_lat", true},
                                          {test_id::send_lat, "send_lat", true},
                                          {test_id::read_lat, "read_lat", true},
                                          {test_id::atomic, "atomic", false}}};

const test_info* find_test(std::string_view name) {
  for (auto& t : tests)
    if (name == t.name) return &t;
  return nullptr;
}

// ---------------------------------------------------------------- wire

constexpr std::uint32_t magic = 0x46504853;  // "SHPF"
enum class cmd : std::uint32_t { hello = 1, region, point, ready, end, outcome, ack };

// Control messages: fixed-size, host byte order (both ends are this program).
struct ctrl {
  std::uint32_t tag = magic;
  cmd op{};
  test_id test{};
  std::uint32_t status = 0;  // outcome: 0 ok, else the verification failed
  std::uint64_t size = 0;
  std::uint64_t iters = 0;
  std::uint64_t warmup = 0;
  std::uint64_t depth = 0;
  std::uint64_t region = 0;  // hello: bytes the server must register
  std::array<std::byte, remote_buffer::wire_size> rb{};
  std::uint32_t imm_pingpong = 0;  // point, write_lat: write_with_imm ping-pong instead of polling memory
};

task<void> send_ctrl(connection& c, const ctrl& m) {
  check(co_await c.send(std::as_bytes(std::span(&m, 1))), "send (control)");
}

task<ctrl> recv_ctrl(connection& c, cmd expect) {
  auto msg = check(co_await c.recv(), "recv (control)");
  ctrl m{};
  if (msg.size() != sizeof m) fail("protocol error: control message of " + std::to_string(msg.size()) + " bytes");
  std::memcpy(&m, msg.data().data(), sizeof m);
  if (m.tag != magic) fail("protocol error: bad magic (not a shuttle-perf peer?)");
  if (m.op != expect)
    fail("protocol error: expected control message " + std::to_string(unsigned(expect)) + ", got " +
         std::to_string(unsigned(m.op)));
  co_return m;
}

// ---------------------------------------------------------------- memory

struct buffer {
  std::byte* p = nullptr;
  std::size_t n = 0;
  explicit buffer(std::size_t bytes) : n(std::max<std::size_t>(bytes, 4096)) {
    n = (n + 4095) & ~std::size_t(4095);
    p = static_cast<std::byte*>(std::aligned_alloc(4096, n));
    if (!p) fail("out of memory (" + std::to_string(n) + " bytes)");
    std::memset(p, 0, n);
  }
  ~buffer() { std::free(p); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  std::span<std::byte> span() const { return {p, n}; }
};

constexpr std::uint64_t region_cap = 64ull << 20;  // slots wrap beyond this

std::uint64_t slots_for(std::uint64_t region, std::uint64_t size, std::uint64_t depth) {
  return std::max<std::uint64_t>(1, std::min<std::uint64_t>(depth, region / size));
}

inline std::byte pattern_byte(std::size_t k, std::size_t size) {
  return static_cast<std::byte>((k * 131 + size * 7 + 1) & 0xff);
}
void fill_pattern(std::byte* p, std::size_t size) {
  for (std::size_t k = 0; k < size; ++k) p[k] = pattern_byte(k, size);
}
bool has_pattern(const std::byte* p, std::size_t size) {
  for (std::size_t k = 0; k < size; ++k)
    if (p[k] != pattern_byte(k, size)) return false;
  return true;
}

// Waits until the byte at `p` reads `v`. The tcp provider places data from
// our own loop, so every miss yields to it; on verbs the NIC places it, so we
// spin on memory (as perftest) and yield to the loop every few hundred
// reads. Not longer: on Soft-RoCE the "NIC" is kernel softirq work that a
// process spinning in user space starves until the next scheduler tick
// (milliseconds); the loop's turn enters the kernel, where it can run.
// The loops call it inline (`while (!byte_arrived(...)) co_await yield();`):
// no coroutine of its own per iteration, as perftest's loop has none.
bool spin_on_memory = false;
bool byte_arrived(const std::byte* p, std::byte v) noexcept {
  auto* b = reinterpret_cast<const unsigned char*>(p);
  const auto want = static_cast<unsigned char>(v);
  for (int i = 0, n = spin_on_memory ? 256 : 1; i < n; ++i) {
    if (__atomic_load_n(b, __ATOMIC_ACQUIRE) == want) return true;
    __builtin_ia32_pause();
  }
  return false;
}
inline std::byte lat_marker(std::uint64_t i) { return static_cast<std::byte>(i % 255 + 1); }

// ---------------------------------------------------------------- options

struct options {
  std::optional<std::string> host;
  transport_kind kind = transport_kind::automatic;
  std::uint16_t port = 18515;
  std::string bind = "0.0.0.0";
  std::string device;
  int gid_index = -1;
  const test_info* test = &tests[0];
  std::uint64_t size = 0;  // 0: the test's default
  bool sweep = false;
  std::uint64_t iters = 0;  // 0: 5000 (bw) / 1000 (lat)
  std::optional<std::uint64_t> warmup;
  std::uint64_t depth = 0;  // 0: 128 (bw) / 1 (lat)
  std::uint64_t batch = 0;  // 0: depth/4, 1..64 (bw); 1 (lat, atomic)
  std::uint64_t slots = 0;  // 0: depth (bw: buffer slots cycled through, each side)
  bool unregistered = false;  // the client's local buffer left unregistered (memory the library does not own)
  bool json = false;
  bool loop = false;
  std::uint32_t rx_depth = 512;
  std::uint64_t rx_size = 65536;
  std::uint32_t max_inline = connection_options{}.max_inline_data;
  std::uint64_t spin_us = 5000;
  std::string lat_method = "auto";  // write_lat: poll | imm | auto (poll on verbs, imm on tcp)
  bool prepared = true;             // latency tests: --ops prepared | single
};

const char* const kSynopsis =
    "usage: shuttle-perf [--transport tcp|verbs|local|auto] [--port P] [--bind ADDR] [--loop]        (server)\n"
    "       shuttle-perf HOST [--transport tcp|verbs|local|auto] [--port P]\n"
    "                    --test write_bw|read_bw|send_bw|write_lat|send_lat|read_lat|atomic\n"
    "                    [--size S | --sweep] [--iters N] [--depth D] [--batch B] [--slots N] [--warmup N] [--json]\n"
    "                                                                                      (client)\n"
    "sizes take K/M/G suffixes (4K = 4096). Defaults: bw 64K x5000 depth 128, lat 2 B x1000, atomic 8 B.\n";

options parse_args(int argc, char** argv) {
  options o;
  CLI::App app{"perftest-style RDMA micro-benchmarks over the transport API (tcp or verbs provider).",
               "shuttle-perf"};
  cli::setup(app, kSynopsis);
  std::string host;
  auto* host_opt = app.add_option("HOST", host, "client: the server's address (none: run the server)")->type_name("");
  app.add_option_function<std::string>(
         "--transport", [&](const std::string& v) { o.kind = *parse_transport_kind(v); },
         "tcp, verbs, local or auto (default auto: the local provider to a server on this host, else verbs if an "
         "RDMA device is active, else tcp)")
      ->type_name("T")
      ->check(CLI::Validator([](std::string& v) -> std::string { return parse_transport_kind(v) ? "" : "bad value '" + v + "' (tcp, verbs, local, auto)"; }, "", "transport"));
  app.add_option("-p,--port", o.port, "port (default 18515; server: 0 picks a free one)")
      ->type_name("P")
      ->transform(cli::count(0, 65535));
  app.add_option("--bind", o.bind, "server: numeric address to listen on (default 0.0.0.0)")->type_name("ADDR");
  app.add_flag("--loop", o.loop, "server: serve clients one after another until SIGINT/SIGTERM");
  app.add_option("-d,--device", o.device, "verbs: the RDMA device (e.g. rxe0)")->type_name("NAME");
  app.add_option("-x,--gid-index", o.gid_index, "verbs: the GID index")->type_name("N")->transform(cli::count(0, 65535));
  std::string test = o.test->name;
  std::string names;
  for (auto& t : tests) names += (names.empty() ? "" : ", ") + std::string(t.name);
  app.add_option("-t,--test", test, "client: the test (" + names + "; default write_bw)")
      ->type_name("TEST")
      ->check(CLI::Validator(
          [names](std::string& v) -> std::string {
            return find_test(v) ? "" : "unknown test '" + v + "' (" + names + ")";
          },
          "", "test"));
  app.add_option("-s,--size", o.size, "bytes per operation (default: bw 64K, lat 2, atomic 8)")
                   ->type_name("S")
                   ->transform(cli::bytes(1, 1ull << 32));
  app.add_flag("-a,--sweep", o.sweep, "every power of two from 2 B to 8 MiB (perftest's -a)");
  app.add_option("-n,--iters", o.iters, "operations per point (default: bw 5000, lat 1000)")
      ->type_name("N")
      ->transform(cli::count(1, 1ull << 40));
  std::uint64_t warmup = 0;
  auto* warmup_opt = app.add_option("--warmup", warmup, "operations before the timed ones")
                         ->type_name("N")
                         ->transform(cli::count(0, 1ull << 40));
  app.add_option("-D,--depth", o.depth, "bw: operations in flight (default 128; lat: 1)")
      ->type_name("D")
      ->transform(cli::count(1, 65536));
  app.add_option("-l,--batch", o.batch,
                 "bw: operations per post_batch, one signaled completion each; default depth/4 in 1..64, i.e. 32 "
                 "at depth 128; 1: every operation signaled, no post list")
      ->type_name("B")
      ->transform(cli::count(1, 65536));
  app.add_option("--slots", o.slots,
                 "bw: the buffer slots of one message size that the operations cycle through, on each side; "
                 "default the depth, one per operation in flight; 1: every operation on the same buffer, as "
                 "perftest's ib_*_bw above 2 KiB")
      ->type_name("N")
      ->transform(cli::count(1, 65536));
  app.add_option("--rx-depth", o.rx_depth, "posted receives (default 512)")
      ->type_name("N")
      ->transform(cli::count(1, 65536));
  app.add_option("--rx-size", o.rx_size,
                 "bytes per receive buffer: the largest send the peer accepts (default 64K; control messages "
                 "travel by send)")
      ->type_name("S")
      ->transform(cli::bytes(sizeof(ctrl), 1u << 30));
  app.add_option("--inline", o.max_inline, "verbs: sends up to N bytes go inline (default 64; 0: none, as perftest on rxe)")
      ->type_name("N")
      ->transform(cli::bytes(0, 4096));
  app.add_flag("--unregistered", o.unregistered,
               "client: its local buffer is not registered; operations on memory the library does not own "
               "(docs/memory-registration.md)");
  std::string ops = "prepared";
  app.add_option("--ops", ops,
                 "latency tests: each iteration starts one operation prepared before the loop "
                 "(connection::prepare), as perftest posts one pre-built WR (prepared, the default); or calls "
                 "read()/write()/send() (single). The write_with_imm ping-pong always calls write_with_imm()")
      ->type_name("prepared|single")
      ->check(cli::one_of({"prepared", "single"}));
  app.add_option("--spin-us", o.spin_us,
                 "busy-poll the completion queue this long after the last completion (default 5000)")
      ->type_name("N")
      ->transform(cli::count(0, 60'000'000));
  app.add_option("--write-lat-method", o.lat_method,
                 "write_lat: poll memory, or a write_with_imm ping-pong; auto: poll on verbs, imm on tcp (default)")
      ->type_name("poll|imm|auto")
      ->check(cli::one_of({"poll", "imm", "auto"}));
  app.add_flag("--json", o.json, "client: also print each row as one JSON object on its own line");
  cli::parse(app, argc, argv);
  if (host_opt->count()) o.host = host;
  if (warmup_opt->count()) o.warmup = warmup;
  o.test = find_test(test);
  o.prepared = ops == "prepared";
  if (o.sweep && o.size) cli::fail(app, "--size and --sweep exclude each other");
  if (o.test->id == test_id::atomic && o.size && o.size != 8)
    cli::fail(app, "atomic: the size is 8 bytes (leave --size out)");
  return o;
}

domain open_domain(const options& o) {
  domain_options d;
  d.kind = o.kind;
  d.device = o.device;
  d.gid_index = o.gid_index;
  auto dom = check(domain::open(d), "opening the transport domain");
  spin_on_memory = dom.kind() == transport_kind::verbs;
  // Busy-poll the CQ as long as the loop spins (perftest spins on the CQ).
  if (dom.kind() == transport_kind::verbs)
    check(verbs::set_busy_poll_budget(dom, std::chrono::microseconds(o.spin_us)), "set_busy_poll_budget");
  return dom;
}

connection_options conn_opts(const options& o, std::uint64_t depth) {
  connection_options c;
  c.send_queue_depth = static_cast<std::uint32_t>(std::max<std::uint64_t>(depth, 128) + 8);
  c.receive_buffers = o.rx_depth;
  c.receive_buffer_size = o.rx_size;
  c.max_inline_data = o.max_inline;
  return c;
}

// Where the waiting went: completions reaped, completion-channel wake-ups
// (each one a sleep the busy-poll budget did not cover) and loop sleeps.
void print_poll_stats(const domain& d, const char* who) {
  if (auto st = verbs::stats(d)) {
    std::printf("# %s: %" PRIu64 " completions, %" PRIu64 " completion-channel wake-ups, %" PRIu64 " loop sleeps\n", who,
                st->completions, st->cq_events, io_context::current().loop_sleeps());
    if (st->staged || st->transient_registrations || st->cached_registrations)
      std::printf("# %s: memory not registered by the user: %" PRIu64 " operations staged, %" PRIu64
                  " registered for themselves; registration cache %s: %" PRIu64 " registered, %" PRIu64
                  " dropped (unmapped), %" PRIu64 " sources not cacheable\n",
                  who, std::uint64_t(st->staged), std::uint64_t(st->transient_registrations),
                  st->registration_cache ? "on" : "off", std::uint64_t(st->cached_registrations),
                  std::uint64_t(st->cache_invalidations), std::uint64_t(st->uncacheable_sources));
  }
  std::fflush(stdout);
}

// What the listener refused or dropped (hostile or broken peers), when any.
void print_listener_stats(const domain& d) {
  auto st = verbs::stats(d);
  if (!st || (st->handshakes_refused | st->handshakes_timed_out | st->idle_timeouts | st->protocol_errors) == 0) return;
  std::printf("# server: %" PRIu64 " connect requests refused, %" PRIu64 " handshakes timed out, %" PRIu64
              " idle timeouts, %" PRIu64 " protocol errors\n",
              st->handshakes_refused, st->handshakes_timed_out, st->idle_timeouts, st->protocol_errors);
  std::fflush(stdout);
}

double us(clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// ---------------------------------------------------------------- server

task<void> serve_one(connection c, domain& d) {
  ctrl h = co_await recv_ctrl(c, cmd::hello);
  if (h.region == 0 || h.region > (1ull << 30)) fail("protocol error: bad region size");
  buffer mem(h.region);
  auto mr = check(d.register_memory(mem.span(), access::all), "register_memory");
  remote_buffer peer = remote_buffer::deserialize(h.rb);
  ctrl r{};
  r.op = cmd::region;
  mr.remote().serialize(r.rb);
  co_await send_ctrl(c, r);
  std::vector<std::byte> src;  // write_lat: what we write back

  for (;;) {
    auto m = co_await c.recv();
    if (!m) co_return;  // the client went: done
    ctrl p{};
    if (m->size() != sizeof p) fail("protocol error: control message expected");
    std::memcpy(&p, m->data().data(), sizeof p);
    m->reset();
    if (p.tag != magic || p.op != cmd::point) fail("protocol error: POINT expected");
    const std::uint64_t size = p.size, total = p.iters + p.warmup;
    if (size == 0 || size > mem.n) fail("protocol error: bad size");
    const std::uint64_t slots = slots_for(mem.n, size, p.depth);
    // Prepare.
    switch (p.test) {
      case test_id::read_bw:
      case test_id::read_lat:
        for (std::uint64_t i = 0; i < slots; ++i) fill_pattern(mem.p + i * size, size);
        break;
      case test_id::write_bw: std::memset(mem.p, 0, slots * size); break;
      case test_id::atomic: std::memset(mem.p, 0, 8); break;
      case test_id::write_lat: std::memset(mem.p, 0, size); break;
      default: break;
    }
    ctrl ready{};
    ready.op = cmd::ready;
    co_await send_ctrl(c, ready);
    // Play our part.
    if (p.test == test_id::send_bw) {
      for (std::uint64_t i = 0; i < total; ++i) {
        auto msg = check(co_await c.recv(), "recv (send_bw)");
        if (msg.size() != size) fail("send_bw: got a message of " + std::to_string(msg.size()) + " bytes");
        if (i + 1 == total && !has_pattern(msg.data().data(), size)) fail("send_bw: data corrupted");
      }
      ctrl ack{};
      ack.op = cmd::ack;
      co_await send_ctrl(c, ack);
    } else if (p.test == test_id::send_lat) {
      std::vector<std::byte> pong(size);
      for (std::uint64_t i = 0; i < total; ++i) {
        auto msg = co_await c.recv();
        require(msg, "recv (send_lat)");
        if (msg->size() != size) fail("send_lat: got a message of " + std::to_string(msg->size()) + " bytes");
        msg->reset();
        require(co_await c.send(pong), "send (send_lat)");
      }
    } else if (p.test == test_id::write_lat) {
      if (size > peer.length) fail("protocol error: client's buffer too small");
      src.assign(size, std::byte{0});
      const std::byte* flag = mem.p + size - 1;
      for (std::uint64_t i = 0; i < total; ++i) {
        if (p.imm_pingpong) {
          auto msg = check(co_await c.recv(), "recv (write_lat)");
          if (msg.imm() != std::uint32_t(i) || *flag != lat_marker(i)) fail("write_lat: unexpected immediate/data");
          msg.reset();
        } else {
          while (!byte_arrived(flag, lat_marker(i))) co_await yield();
        }
        src[size - 1] = lat_marker(i);
        if (p.imm_pingpong)
          require(co_await c.write_with_imm(src, peer, std::uint32_t(i)), "write_with_imm (write_lat)");
        else
          require(co_await c.write(src, peer), "write (write_lat)");
      }
    }
    // Verify.
    (void)co_await recv_ctrl(c, cmd::end);
    ctrl out{};
    out.op = cmd::outcome;
    if (p.test == test_id::write_bw) {
      auto map = check(co_await c.recv(), "recv (slot map)");
      if (map.size() != slots) fail("protocol error: slot map of " + std::to_string(map.size()) + " bytes");
      std::uint64_t written = 0;
      for (std::uint64_t i = 0; i < slots; ++i) {
        if (map.data()[i] == std::byte{0}) continue;
        ++written;
        if (!has_pattern(mem.p + i * size, size)) out.status = 1;
      }
      if (written == 0 && total != 0) out.status = 1;
      map.reset();
    } else if (p.test == test_id::atomic) {
      std::uint64_t v;
      std::memcpy(&v, mem.p, 8);
      if (v != total) out.status = 1;
    }
    co_await send_ctrl(c, out);
  }
}

// Sessions the server ran, for its summary line.
struct server_stats {
  std::uint64_t sessions = 0, failed = 0;
};

// Until the client goes (or, with --loop, until stopped by a signal). A
// stop (SIGINT/SIGTERM) cancels the accept or the session under way.
task<int> server_main(const options& o, server_stats& stats) {
  tools::throttled_log session_log{"shuttle-perf"};
  domain d = open_domain(o);
  auto ep = check(endpoint::parse(o.bind.find(':') != std::string::npos && o.bind.front() != '['
                                      ? "[" + o.bind + "]:" + std::to_string(o.port)
                                      : o.bind + ":" + std::to_string(o.port)),
                  "bad --bind address");
  // The server's send queue carries pongs and write_lat writes only; its
  // receive pool takes send_bw's messages.
  // Peers refused or dropped before a session (caps, deadlines, bad hellos)
  // are logged with their address, rate-limited like failed sessions.
  listener_options limits;
  limits.on_refused = [&session_log](const endpoint& peer, std::string_view why) {
    session_log("peer " + peer.to_string() + ": " + std::string(why));
  };
  auto l = check(d.listen(ep, conn_opts(o, 128), limits), "listen");
  std::printf("shuttle-perf: %s, listening on %s\n", d.describe().c_str(), l.local_endpoint()->to_string().c_str());
  std::fflush(stdout);
  const std::stop_token stop = co_await get_stop_token();
  do {
    auto c = co_await l.accept();
    if (!c && stop.stop_requested()) break;
    if (!c) fail_with("accept", c.error());
    ++stats.sessions;
    const std::string peer = c->remote_endpoint().to_string();
    try {
      co_await serve_one(std::move(*c), d);
      print_poll_stats(d, "server");
      print_listener_stats(d);
    } catch (const std::exception& e) {
      if (stop.stop_requested()) break;  // cancelled mid-session: shutting down
      ++stats.failed;
      if (!o.loop) throw;
      session_log("session with " + peer + " failed: " + e.what());  // --loop: a client looping on errors must not flood
    }
  } while (o.loop && !stop.stop_requested());
  session_log.flush();
  l.close();
  co_return 0;
}

// The server, ended early by SIGINT/SIGTERM: then a clean exit (0), as at
// its normal end, with the summary line either way.
task<int> server_until_signal(const options& o, signal_set& signals) {
  server_stats stats;
  int rc = 1;
  try {
    auto r = co_await when_any(server_main(o, stats), tools::wait_for_signal(signals, "shuttle-perf"));
    if (r.index() == 0) {
      rc = std::get<0>(r);
    } else {
      rc = 0;
      if (int sig = std::get<1>(r); sig > 0) std::fprintf(stderr, "shuttle-perf: %s, shutting down\n", strsignal(sig));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shuttle-perf: %s\n", e.what());
  }
  std::printf("shuttle-perf: served %" PRIu64 " sessions (%" PRIu64 " failed)\n", stats.sessions, stats.failed);
  std::fflush(stdout);
  co_return rc;
}

// ---------------------------------------------------------------- client

struct bw_row {
  std::uint64_t size, iters;
  double peak, avg, mpps;
};
struct lat_row {
  std::uint64_t size, iters;
  double tmin, typical, avg, p99;
};

struct client_state {
  connection c;
  const options& o;
  remote_buffer server;
  std::unique_ptr<buffer> local;  // sources / destinations of one-sided ops
  std::unique_ptr<buffer> pong;   // write_lat: the server writes here
  memory_region local_mr, pong_mr;
};

// D workers, each issues its next operation when the previous completes; the
// completion times go to `done` (in completion order), and the slots used
// are marked in `used` (an operation that completes at once does not
// suspend: one worker may take every batch before the others start, so
// read_bw checks only the slots that were read).
task<void> bw_worker(client_state& s, test_id t, std::uint64_t size, std::uint64_t first_slot, std::uint64_t slots,
                     std::uint64_t batch, std::uint64_t& next, std::uint64_t total,
                     std::vector<clock::time_point>& done, std::vector<char>& used) {
  if (t == test_id::atomic || batch == 1) {
    if (next < total) used[first_slot] = 1;
    std::span<std::byte> local(s.local->p + first_slot * size, size);
    remote_buffer rb = check(s.server.slice(first_slot * size, size), "remote slice");
    if (t == test_id::atomic) rb = check(s.server.slice(0, 8), "remote slice");
    while (next < total) {
      ++next;
      switch (t) {
        case test_id::write_bw: check(co_await s.c.write(local, rb), "write"); break;
        case test_id::read_bw: check(co_await s.c.read(local, rb), "read"); break;
        case test_id::send_bw: check(co_await s.c.send(local), "send"); break;
        case test_id::atomic: (void)check(co_await s.c.fetch_and_add(rb, 1), "fetch_and_add"); break;
        default: fail("not a bandwidth test");
      }
      done.push_back(clock::now());
    }
    co_return;
  }
  // The worker's batch, built once: operation j uses slot first_slot + j (mod slots).
  std::vector<operation> ops;
  for (std::uint64_t j = 0; j < batch; ++j) {
    std::uint64_t slot = (first_slot + j) % slots;
    std::span<std::byte> local(s.local->p + slot * size, size);
    remote_buffer rb = check(s.server.slice(slot * size, size), "remote slice");
    switch (t) {
      case test_id::write_bw: ops.push_back(operation::write(local, rb)); break;
      case test_id::read_bw: ops.push_back(operation::read(local, rb)); break;
      case test_id::send_bw: ops.push_back(operation::send(local)); break;
      default: fail("not a bandwidth test");
    }
  }
  while (next < total) {
    std::uint64_t n = std::min(batch, total - next);
    next += n;
    for (std::uint64_t j = 0; j < n; ++j) used[(first_slot + j) % slots] = 1;
    check(co_await s.c.post_batch(std::span<const operation>(ops.data(), n)), "post_batch");
    auto now = clock::now();
    for (std::uint64_t j = 0; j < n; ++j) done.push_back(now);
  }
}

// `used` (out): one byte per slot, 1 where an operation used that slot.
task<bw_row> run_bw(client_state& s, test_id t, std::uint64_t size, std::uint64_t iters, std::uint64_t warmup,
                    std::uint64_t depth, std::uint64_t batch, std::vector<char>& used) {
  const std::uint64_t slots = slots_for(s.local->n, size, depth);
  if (t == test_id::write_bw || t == test_id::send_bw)
    for (std::uint64_t i = 0; i < slots; ++i) fill_pattern(s.local->p + i * size, size);
  else
    std::memset(s.local->p, 0, slots * size);
  used.assign(slots, 0);
  auto phase = [&](std::uint64_t n, std::vector<clock::time_point>& done) -> task<void> {
    std::uint64_t next = 0;
    std::vector<task<void>> workers;
    const std::uint64_t nworkers = std::max<std::uint64_t>(1, depth / batch);
    for (std::uint64_t w = 0; w < std::min(nworkers, n); ++w)
      workers.push_back(bw_worker(s, t, size, (w * batch) % slots, slots, batch, next, n, done, used));
    co_await when_all(std::move(workers));
  };
  std::vector<clock::time_point> done;
  done.reserve(std::max(iters, warmup));
  if (warmup) co_await phase(warmup, done);
  done.clear();
  auto t0 = clock::now();
  co_await phase(iters, done);
  if (t == test_id::send_bw) (void)co_await recv_ctrl(s.c, cmd::ack);  // the server got them all
  auto t1 = clock::now();
  double secs = std::chrono::duration<double>(t1 - t0).count();
  const double mb = 1048576.0;
  bw_row r{size, iters, 0, double(size) * iters / secs / mb, iters / secs / 1e6};
  // Peak: the best rate over windows of max(depth, iters/16) completions.
  std::uint64_t k = std::max<std::uint64_t>(std::min(4 * depth, iters), iters / 8);
  r.peak = r.avg;
  if (k < iters) {
    for (std::uint64_t j = 0; j + k <= done.size(); ++j) {
      auto from = j == 0 ? t0 : done[j - 1];
      double w = std::chrono::duration<double>(done[j + k - 1] - from).count();
      if (w > 0) r.peak = std::max(r.peak, double(size) * k / w / mb);
    }
  }
  if (t == test_id::read_bw)
    for (std::uint64_t i = 0; i < slots; ++i)
      if (used[i] && !has_pattern(s.local->p + i * size, size)) fail("read_bw: data read back does not match");
  co_return r;
}

lat_row lat_stats(std::vector<double> v, std::uint64_t size) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  lat_row r{size, v.size(), v.front(), v[v.size() / 2], sum / v.size(),
            v[std::min(v.size() - 1, static_cast<std::size_t>(v.size() * 0.99))]};
  return r;
}

// Latency timestamps: the TSC where there is one (as perftest's get_cycles),
// converted with the rate measured against steady_clock over the run. A
// clock_gettime is microseconds where the clocksource is HPET (a TCG guest):
// too much for a per-iteration stamp.
struct stamp_clock {
#if defined(__x86_64__) || defined(__i386__)
  static std::uint64_t now() noexcept { return __builtin_ia32_rdtsc(); }
#else
  static std::uint64_t now() noexcept {
    return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
#endif
};

task<lat_row> run_lat(client_state& s, test_id t, std::uint64_t size, std::uint64_t iters, std::uint64_t warmup,
                      bool imm, bool prepared) {
  const std::uint64_t total = iters + warmup;
  std::vector<std::uint64_t> ts(total + 1);  // stamped by index: nothing but a store per iteration
  const auto wall0 = clock::now();
  const auto tick0 = stamp_clock::now();
  remote_buffer rb = check(s.server.slice(0, size), "remote slice");
  std::span<std::byte> local(s.local->p, size);
  std::memset(local.data(), 0, size);
  if (t == test_id::write_lat) {
    const std::byte* flag = s.pong->p + size - 1;
    for (std::uint64_t i = 0; i < total && imm; ++i) {
      ts[i] = stamp_clock::now();
      local[size - 1] = lat_marker(i);
      auto [wr, rr] = co_await when_all(s.c.write_with_imm(local, rb, std::uint32_t(i)), s.c.recv());
      check(std::move(wr), "write_with_imm (write_lat)");
      auto m = check(std::move(rr), "recv (write_lat)");
      if (m.imm() != std::uint32_t(i) || *flag != lat_marker(i)) fail("write_lat: unexpected immediate/data");
    }
    // As perftest: post, then poll. The write's own completion comes
    // before the peer can answer it, so waiting for it first costs nothing.
    prepared_operation op;
    if (!imm && prepared) op = check(s.c.prepare(operation::write(local, rb)), "prepare (write_lat)");
    for (std::uint64_t i = 0; i < total && !imm; ++i) {
      ts[i] = stamp_clock::now();
      local[size - 1] = lat_marker(i);
      if (prepared)
        require(co_await op.start(), "write (write_lat)");
      else
        require(co_await s.c.write(local, rb), "write (write_lat)");
      while (!byte_arrived(flag, lat_marker(i))) co_await yield();
    }
  } else if (t == test_id::send_lat) {
    prepared_operation op;
    if (prepared) op = check(s.c.prepare(operation::send(local)), "prepare (send_lat)");
    for (std::uint64_t i = 0; i < total; ++i) {
      ts[i] = stamp_clock::now();
      // Send, then receive (the receive is posted all along: the pong can
      // arrive before the send's completion is seen and waits in the queue).
      if (prepared)
        require(co_await op.start(), "send (send_lat)");
      else
        require(co_await s.c.send(local), "send (send_lat)");
      auto m = co_await s.c.recv();
      require(m, "recv (send_lat)");
      if (m->size() != size) fail("send_lat: pong of the wrong size");
    }
  } else {  // read_lat
    prepared_operation op;
    if (prepared) op = check(s.c.prepare(operation::read(local, rb)), "prepare (read_lat)");
    for (std::uint64_t i = 0; i < total; ++i) {
      ts[i] = stamp_clock::now();
      if (prepared)
        require(co_await op.start(), "read (read_lat)");
      else
        require(co_await s.c.read(local, rb), "read (read_lat)");
    }
    if (!has_pattern(local.data(), size)) fail("read_lat: data read back does not match");
  }
  ts[total] = stamp_clock::now();
  const double wall_us = us(clock::now() - wall0);
  const double ticks = double(ts.back() - tick0);
  const double us_per_tick = ticks > 0 ? wall_us / ticks : 0;
  const double div = t == test_id::read_lat ? 1.0 : 2.0;  // ping-pongs: half the round trip
  std::vector<double> v;
  v.reserve(iters);
  for (std::uint64_t i = warmup; i < total; ++i) v.push_back(double(ts[i + 1] - ts[i]) * us_per_tick / div);
  co_return lat_stats(std::move(v), size);
}

void print_header(const options& o, const char* provider, std::uint64_t depth, std::uint64_t batch, bool imm) {
  std::printf("#---------------------------------------------------------------------------------------\n");
  std::printf("# shuttle-perf %s, provider %s, depth %" PRIu64 ", batch %" PRIu64 "\n", o.test->name, provider,
              depth, batch);
  if (o.test->id == test_id::write_lat && imm)
    std::printf("# write_lat: write_with_imm ping-pong; each side waits for the peer's immediate (recv)\n");
  else if (o.test->id == test_id::write_lat)
    std::printf("# write_lat: ping-pong RDMA writes; each side polls its own registered memory (last byte)\n");
  if (o.test->latency)
    std::printf("# %-10s %-12s %-14s %-14s %-14s %-14s\n", "#bytes", "#iterations", "t_min[usec]", "t_typical[usec]",
                "t_avg[usec]", "t_99[usec]");
  else
    std::printf("# %-10s %-12s %-18s %-20s %-14s\n", "#bytes", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]",
                "MsgRate[Mpps]");
  std::fflush(stdout);
}

task<int> client_main(const options& o) {
  domain d = open_domain(o);
  const auto& t = *o.test;
  const std::uint64_t depth = o.depth ? o.depth : (t.latency ? 1 : 128);
  const std::uint64_t batch = t.latency || t.id == test_id::atomic
                                  ? 1
                                  : std::min(depth, o.batch ? o.batch : std::clamp<std::uint64_t>(depth / 4, 1, 64));
  const std::uint64_t iters = o.iters ? o.iters : (t.latency ? 1000 : 5000);
  const std::uint64_t warmup = o.warmup ? *o.warmup : std::min<std::uint64_t>(iters / 10, 1000);
  auto ep = check(endpoint::resolve(*o.host, o.port), ("resolving " + *o.host).c_str());
  auto c = check(co_await d.connect(ep, conn_opts(o, depth)), ("connecting to " + ep.to_string()).c_str());

  std::vector<std::uint64_t> sizes;
  const bool send_test = t.id == test_id::send_bw || t.id == test_id::send_lat;
  const std::uint64_t max_msg = send_test ? c.max_message_size() : UINT64_MAX;
  if (t.id == test_id::atomic) {
    sizes = {8};
  } else if (o.sweep) {
    for (std::uint64_t s = 2; s <= (8u << 20) && s <= max_msg; s *= 2) sizes.push_back(s);
  } else {
    sizes = {o.size ? o.size : (t.latency ? 2 : 65536)};
    if (sizes[0] > max_msg)
      fail(std::string(t.name) + ": size " + std::to_string(sizes[0]) + " is above the largest message (" +
           std::to_string(max_msg) + "; give both sides a larger --rx-size)");
  }
  const std::uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  const std::uint64_t slots = o.slots ? std::min(o.slots, depth) : depth;
  std::uint64_t region = std::max<std::uint64_t>(max_size, std::min<std::uint64_t>(max_size * slots, region_cap));

  client_state s{std::move(c), o, {}, {}, {}, {}, {}};
  s.local = std::make_unique<buffer>(region);
  s.pong = std::make_unique<buffer>(max_size);
  if (!o.unregistered) s.local_mr = check(d.register_memory(s.local->span(), access::all), "register_memory");
  s.pong_mr = check(d.register_memory(s.pong->span(), access::all), "register_memory");

  ctrl h{};
  h.op = cmd::hello;
  h.test = t.id;
  h.region = region;
  h.depth = depth;
  s.pong_mr.remote().serialize(h.rb);
  co_await send_ctrl(s.c, h);
  ctrl r = co_await recv_ctrl(s.c, cmd::region);
  s.server = remote_buffer::deserialize(r.rb);
  if (s.server.length < region) fail("protocol error: the server's region is too small");

  const bool imm = t.id == test_id::write_lat &&
                   (o.lat_method == "imm" || (o.lat_method == "auto" && s.c.kind() != transport_kind::verbs));
  print_header(o, d.describe().c_str(), depth, batch, imm);
  for (std::uint64_t size : sizes) {
    ctrl p{};
    p.op = cmd::point;
    p.test = t.id;
    p.size = size;
    p.iters = iters;
    p.warmup = warmup;
    p.depth = depth;
    p.imm_pingpong = imm;
    std::memset(s.pong->p, 0, size);
    co_await send_ctrl(s.c, p);
    (void)co_await recv_ctrl(s.c, cmd::ready);
    std::optional<bw_row> bw;
    std::optional<lat_row> lat;
    std::vector<char> used;
    if (t.latency)
      lat = co_await run_lat(s, t.id, size, iters, warmup, imm, o.prepared);
    else
      bw = co_await run_bw(s, t.id, size, iters, warmup, depth, batch, used);
    ctrl e{};
    e.op = cmd::end;
    co_await send_ctrl(s.c, e);
    // write_bw: which slots were written. Operations that complete at once
    // let one worker take every batch, so the written slots need not be the
    // first ones; the server checks exactly these.
    if (t.id == test_id::write_bw) check(co_await s.c.send(std::as_bytes(std::span(used))), "send (slot map)");
    ctrl out = co_await recv_ctrl(s.c, cmd::outcome);
    if (out.status != 0) fail(std::string(t.name) + ": the server found wrong data in its memory");
    if (bw) {
      std::printf("  %-10" PRIu64 " %-12" PRIu64 " %-18.2f %-20.2f %-14.6f\n", bw->size, bw->iters, bw->peak, bw->avg,
                  bw->mpps);
      if (o.json)
        std::printf("{\"test\":\"%s\",\"transport\":\"%s\",\"bytes\":%" PRIu64 ",\"iterations\":%" PRIu64
                    ",\"depth\":%" PRIu64 ",\"batch\":%" PRIu64
                    ",\"bw_peak_mb_s\":%.3f,\"bw_avg_mb_s\":%.3f,\"msg_rate_mpps\":%.6f}\n",
                    t.name, to_string(s.c.kind()), bw->size, bw->iters, depth, batch, bw->peak, bw->avg, bw->mpps);
    } else {
      std::printf("  %-10" PRIu64 " %-12" PRIu64 " %-14.2f %-14.2f %-14.2f %-14.2f\n", lat->size, lat->iters,
                  lat->tmin, lat->typical, lat->avg, lat->p99);
      if (o.json)
        std::printf("{\"test\":\"%s\",\"transport\":\"%s\",\"bytes\":%" PRIu64 ",\"iterations\":%" PRIu64
                    ",\"method\":\"%s\",\"ops\":\"%s\",\"t_min_us\":%.3f,\"t_typical_us\":%.3f,\"t_avg_us\":%.3f,\"t_99_us\":%.3f}\n",
                    t.name, to_string(s.c.kind()), lat->size, lat->iters,
                    t.id == test_id::write_lat ? (imm ? "write-imm-pingpong" : "write-pingpong-poll") : t.id == test_id::send_lat ? "send-pingpong"
                                                                                                  : "serial-read",
                    o.prepared && !imm ? "prepared" : "single", lat->tmin, lat->typical, lat->avg, lat->p99);
    }
    std::fflush(stdout);
  }
  print_poll_stats(d, "client");
  std::printf("#---------------------------------------------------------------------------------------\n");
  (void)co_await s.c.close();
  co_return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    options o = parse_args(argc, argv);
    io_context::options io;
    io.spin_budget = std::chrono::microseconds(o.spin_us);
    io.ring_spin_budget = std::chrono::microseconds(o.spin_us);  // tcp: poll the ring too
    // The server reads SIGINT/SIGTERM through a signalfd: blocked before
    // the loop (and any provider thread) starts.
    std::optional<signal_set> signals;
    if (!o.host) {
      block_signals({SIGINT, SIGTERM, SIGPIPE});
      signals.emplace(std::initializer_list<int>{SIGINT, SIGTERM});
    }
    io_context ctx(io);
    return o.host ? ctx.run(client_main(o)) : ctx.run(server_until_signal(o, *signals));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shuttle-perf: %s\n", e.what());
    return 1;
  }
}
