// shuttle-echo-client: load generator and checker for an echo server.
//
//   shuttle-echo-client --host H --port P [--connections C] [--size S]
//                       [--duration T] [--threads N] [--connect-timeout T] [--json]
//                       [--transport tcp|rdma|tcp-provider|auto] [--recv-ring N]
//
// Opens C connections (spread round-robin over N threads, each with its own
// io_context), then for T seconds every connection loops: send S bytes (a
// pattern that changes with every request and connection), receive S bytes
// back, check them, record the round-trip latency. Requests still in flight
// at the deadline are cancelled and not counted.
//
// --transport tcp (the default) uses TCP sockets (write, then read S bytes).
// With --recv-ring N the replies arrive through one multishot recv per
// connection into a ring of N kernel-provided buffers per thread
// (receive_stream.hpp) instead of a recv submitted per reply: the client
// then spends less CPU per request, which matters when it shares a machine
// with the server it measures.
// --transport rdma (the verbs provider, rdma_cm) and tcp-provider (shuttle's
// RDMA semantics over TCP) use the transport API: each thread opens a domain,
// every request is one send and the echo one recv. S must then be at most the
// connection's max_message_size() (the server's receive buffers, see its
// --max-message); a larger S is refused with an error once connected.
//
// Prints requests/s, MB/s (echoed payload, one direction, 10^6 bytes), the
// client's own CPU time over the load (cpu_s),
// latency p50/p99/p99.9 in microseconds and the error counts; with --json a
// last line holds the same as one JSON object, for benchmark scripts.
//
// Exit status: 0 if every connection was made, every reply matched and at
// least one request completed, 1 if anything failed (connection failures,
// I/O errors, mismatched echoes, no request at all), 2 for bad usage (also:
// S larger than the connection's maximum message).

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "cli.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <sys/resource.h>

namespace {

using shuttle::task;

// User + system CPU seconds of the whole process (every thread).
double process_cpu_s() noexcept {
  rusage u{};
  if (::getrusage(RUSAGE_SELF, &u) != 0) return 0;
  auto s = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}
using steady = std::chrono::steady_clock;
constexpr const char* kProg = "shuttle-echo-client";

// Up to this size a request is written whole before its reply is read; above
// it the write and the read run concurrently, so a request larger than the
// socket buffers cannot deadlock client and server against each other.
constexpr std::size_t kSequentialLimit = 64 * 1024;

// ---------------------------------------------------------------- histogram

// Log-linear latency histogram in nanoseconds: exact below 128 ns, then 128
// sub-buckets per power of two (relative error under 0.8%).
class histogram {
 public:
  static constexpr std::size_t kSub = 128;
  static constexpr std::size_t kBuckets = kSub + 57 * kSub;

  void record(std::uint64_t ns) noexcept {
    ++counts_[index(ns)];
    ++total_;
  }
  void merge(const histogram& o) noexcept {
    for (std::size_t i = 0; i < kBuckets; ++i) counts_[i] += o.counts_[i];
    total_ += o.total_;
  }
  std::uint64_t total() const noexcept { return total_; }

  // The q-quantile (0 < q <= 1) in nanoseconds: the middle of its bucket.
  double quantile(double q) const noexcept {
    if (total_ == 0) return 0;
    auto rank = static_cast<std::uint64_t>(std::ceil(q * static_cast<double>(total_)));
    rank = std::clamp<std::uint64_t>(rank, 1, total_);
    std::uint64_t seen = 0;
    for (std::size_t i = 0; i < kBuckets; ++i) {
      seen += counts_[i];
      if (seen >= rank) return midpoint(i);
    }
    return midpoint(kBuckets - 1);
  }

 private:
  static std::size_t index(std::uint64_t v) noexcept {
    if (v < kSub) return static_cast<std::size_t>(v);
    unsigned shift = static_cast<unsigned>(std::bit_width(v)) - 8;  // keeps 8 significant bits
    return kSub + shift * kSub + static_cast<std::size_t>((v >> shift) - kSub);
  }
  static double midpoint(std::size_t i) noexcept {
    if (i < kSub) return static_cast<double>(i);
    std::size_t shift = (i - kSub) / kSub;
    double lower = std::ldexp(static_cast<double>(kSub + (i - kSub) % kSub), static_cast<int>(shift));
    double width = std::ldexp(1.0, static_cast<int>(shift));
    return lower + (width - 1) / 2;
  }

  std::array<std::uint64_t, kBuckets> counts_{};
  std::uint64_t total_ = 0;
};

// ---------------------------------------------------------------- per-thread state

struct connection {
  std::uint64_t id = 0;
  shuttle::tcp_socket socket;  // --transport tcp
  shuttle::connection conn;    // the transport API
  bool is_open() const noexcept { return socket.is_open() || conn.is_open(); }
};

// Touched only by its runtime thread while a phase runs; main reads it after
// the phase's future is ready.
struct thread_state {
  std::optional<shuttle::domain> domain;  // the transport API: this thread's
  std::vector<connection> connections;
  histogram latency;
  std::uint64_t requests = 0;
  std::uint64_t io_errors = 0;
  std::uint64_t mismatches = 0;
  std::uint64_t connect_failures = 0;
  std::uint64_t starved = 0;  // connected, but not one request completed
  std::size_t too_big = 0;    // the transport API: a connection whose max_message_size() < S
  std::optional<shuttle::buffer_ring> ring;  // --recv-ring
  std::vector<std::byte> pool;               // fill_pattern's bytes
  std::vector<std::string> messages;  // the first few error descriptions
  std::size_t live = 0;               // connections still looping
  shuttle::event all_done;

  void note(std::string msg) {
    if (messages.size() < 5) messages.push_back(std::move(msg));
  }
};

// ---------------------------------------------------------------- payload

std::uint64_t splitmix64(std::uint64_t& x) noexcept {
  std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Pseudo-random bytes, generated once per thread: requests are cut from it
// so that a large request costs a memcpy, not a generator call per word
// (the client must stay cheaper than the servers it measures).
constexpr std::size_t kPoolSlack = 4096;
std::vector<std::byte> make_pool(std::size_t size, std::uint64_t seed) {
  std::vector<std::byte> pool((size + kPoolSlack + 7) / 8 * 8);
  for (std::size_t i = 0; i < pool.size(); i += 8) {
    std::uint64_t v = splitmix64(seed);
    std::memcpy(pool.data() + i, &v, 8);
  }
  return pool;
}

// Different for every (connection, request): a stale, reordered or mixed-up
// echo does not match. The first 16 bytes are the connection and request
// numbers mixed with the pool, the rest a window of the pool that moves with
// every request.
void fill_pattern(std::vector<std::byte>& buf, const std::vector<std::byte>& pool, std::uint64_t conn,
                  std::uint64_t seq) noexcept {
  std::uint64_t state = (conn << 40) ^ seq ^ 0x5368757474006c65ull;
  const std::size_t offset = static_cast<std::size_t>(splitmix64(state) % kPoolSlack);
  std::memcpy(buf.data(), pool.data() + offset, buf.size());
  std::uint64_t head[2] = {conn ^ splitmix64(state), seq ^ splitmix64(state)};
  std::memcpy(buf.data(), head, std::min(buf.size(), sizeof head));
}

// ---------------------------------------------------------------- phases

bool is_cancel(const std::error_code& ec) { return ec == std::errc::operation_canceled; }

// What an operation threw (no free SQE, no memory), as an error code.
std::error_code current_exception_code() noexcept {
  try {
    throw;
  } catch (const std::system_error& e) {
    return e.code();
  } catch (const std::bad_alloc&) {
    return std::make_error_code(std::errc::not_enough_memory);
  } catch (...) {
    return std::make_error_code(std::errc::io_error);
  }
}

// What the phases need to know besides the thread's state.
struct load_params {
  cli::transport transport = cli::transport::socket;
  std::size_t size = 64;
  std::size_t recv_ring = 0;
  bool register_files = true;
  std::uint64_t requests = 0;  // per connection; 0: as many as the duration allows
};

task<void> connect_socket(thread_state& ts, std::size_t slot, shuttle::endpoint ep,
                          std::chrono::nanoseconds timeout, bool register_file) {
  shuttle::result<shuttle::tcp_socket> r;
  try {
    r = co_await shuttle::tcp_socket::connect(ep, timeout);
  } catch (...) {
    r = current_exception_code();
  }
  connection& c = ts.connections[slot];
  if (!r) {
    ++ts.connect_failures;
    ts.note("connection " + std::to_string(c.id) + " to " + ep.to_string() + " failed: " +
            (r.error() == std::errc::timed_out ? std::string("timed out") : r.error().message()));
    co_return;
  }
  c.socket = std::move(*r);
  (void)c.socket.set_nodelay(true);
  // This thread's ring names the socket by a registered-file slot (no file
  // lookup per operation); best effort, as the fd serves as well.
  if (register_file) (void)c.socket.register_file();
}

task<void> connect_transport(thread_state& ts, std::size_t slot, shuttle::endpoint ep,
                             std::chrono::nanoseconds timeout, load_params lp) {
  shuttle::connection_options opts;
  opts.connect_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  // One request in flight per connection: a few receives of the request size
  // (1 MiB of them, at least 4).
  opts.receive_buffers = static_cast<std::uint32_t>(std::clamp<std::size_t>((std::size_t(1) << 20) / lp.size, 4, 16));
  opts.receive_buffer_size = std::max<std::size_t>(lp.size, 64);
  shuttle::result<shuttle::connection> r;
  try {
    r = co_await ts.domain->connect(ep, opts);
  } catch (...) {
    r = current_exception_code();
  }
  connection& c = ts.connections[slot];
  if (!r) {
    ++ts.connect_failures;
    ts.note("connection " + std::to_string(c.id) + " to " + ep.to_string() + " failed: " +
            (r.error() == std::errc::timed_out ? std::string("timed out") : r.error().message()));
    co_return;
  }
  if (r->max_message_size() < lp.size) {
    // Refused here rather than by every send.
    if (ts.too_big == 0)
      ts.note("--size " + std::to_string(lp.size) + " is larger than the connection's max_message_size() of " +
              std::to_string(r->max_message_size()) +
              " bytes (the server's receive buffers: raise the server's --max-message, or lower --size)");
    ++ts.too_big;
    co_return;  // the connection is dropped here
  }
  c.conn = std::move(*r);
}

// Phase 1: open this thread's connections, all at once (over the transport
// API, from a domain of this thread's own).
task<void> connect_all(thread_state& ts, shuttle::endpoint ep, std::chrono::nanoseconds timeout, load_params lp) {
  if (lp.transport != cli::transport::socket) {
    shuttle::domain_options dopts;
    dopts.kind = cli::kind_of(lp.transport);
    auto d = shuttle::domain::open(dopts);
    if (!d) {
      ts.connect_failures += ts.connections.size();
      std::string why = d.error().message();
      if (d.error() == shuttle::errc::not_supported && lp.transport == cli::transport::rdma)
        why += " (no active RDMA device, or shuttle was built without rdma-core)";
      ts.note(std::string("cannot open a ") + cli::to_string(lp.transport) + " domain: " + why);
      co_return;
    }
    ts.domain.emplace(std::move(*d));
  }
  shuttle::async_scope scope;
  for (std::size_t i = 0; i < ts.connections.size(); ++i) {
    if (lp.transport == cli::transport::socket)
      scope.spawn(connect_socket(ts, i, ep, timeout, lp.register_files));
    else
      scope.spawn(connect_transport(ts, i, ep, timeout, lp));
  }
  co_await scope.join();
}

// Last phase: the transport API's connections and domain go on their own
// thread (what the provider still winds down ends on that loop).
task<void> teardown(thread_state& ts) {
  for (auto& c : ts.connections) c.conn = shuttle::connection{};
  ts.domain.reset();
  co_return;
}

// Writes then, on failure, shuts the socket down so that the concurrent read
// ends too.
task<shuttle::result<void>> write_request(shuttle::tcp_socket& sock, std::span<const std::byte> out) {
  auto w = co_await sock.write_all(out);
  if (!w && !is_cancel(w.error())) (void)sock.shutdown(SHUT_RDWR);
  co_return w;
}

// Reads exactly in.size() bytes of reply from a receive stream. The echo of
// one request is all a server may send: bytes beyond it are a protocol error.
task<shuttle::result<void>> read_exact(shuttle::receive_stream& rx, std::span<std::byte> in) {
  std::size_t got = 0;
  while (got < in.size()) {
    auto b = co_await rx.next();
    if (!b) co_return b.error();
    if (b->empty()) co_return shuttle::make_error_code(shuttle::errc::eof);
    if (b->size() > in.size() - got) co_return shuttle::make_error_code(shuttle::errc::protocol_error);
    std::memcpy(in.data() + got, b->data().data(), b->size());
    got += b->size();
  }
  co_return shuttle::result<void>{};
}

// One request over the transport API: a send, the echo by recv.
task<std::error_code> transport_request(connection& c, const std::vector<std::byte>& out, bool& match,
                                        std::size_t& differs_at) {
  auto w = co_await c.conn.send(out);
  if (!w) co_return w.error();
  auto m = co_await c.conn.recv();
  if (!m) co_return m.error();
  auto in = m->data();
  match = in.size() == out.size() && std::memcmp(out.data(), in.data(), out.size()) == 0;
  if (!match) {
    differs_at = 0;
    while (differs_at < in.size() && differs_at < out.size() && out[differs_at] == in[differs_at]) ++differs_at;
  }
  co_return std::error_code{};
}

task<void> connection_loop(thread_state& ts, connection& c, load_params lp, steady::time_point deadline) {
  const std::size_t size = lp.size;
  const bool over_socket = lp.transport == cli::transport::socket;
  std::vector<std::byte> out(size), in(over_socket ? size : 0);
  // Destroyed before the socket closes, and with no next() pending: every
  // read through it is awaited inside the loop.
  std::optional<shuttle::receive_stream> rx;
  if (over_socket && ts.ring) rx.emplace(c.socket, *ts.ring);
  auto read_reply = [&]() -> task<shuttle::result<void>> {
    if (rx) return read_exact(*rx, in);
    return c.socket.read_exact(in);
  };
  std::uint64_t seq = 0;
  for (; lp.requests ? seq < lp.requests : steady::now() < deadline; ++seq) {
    fill_pattern(out, ts.pool, c.id, seq);
    const auto t0 = steady::now();
    std::error_code ec;
    bool match = true;
    std::size_t differs_at = 0;
    try {
      if (!over_socket) {
        ec = co_await transport_request(c, out, match, differs_at);
      } else if (size <= kSequentialLimit) {
        auto w = co_await c.socket.write_all(out);
        if (!w) {
          ec = w.error();
        } else {
          auto r = co_await read_reply();
          if (!r) ec = r.error();
        }
      } else {
        auto both = co_await shuttle::when_all(write_request(c.socket, out), read_reply());
        auto& w = std::get<0>(both);
        auto& r = std::get<1>(both);
        if (!w)
          ec = w.error();
        else if (!r)
          ec = r.error();
      }
    } catch (...) {
      ec = current_exception_code();
    }
    const auto t1 = steady::now();
    if (ec) {
      // The deadline, not a failure: the request was cancelled, or (over the
      // transport API, where cancelling an in-flight operation takes the
      // connection down) it failed because its cancellation did.
      if (is_cancel(ec) || (co_await shuttle::get_stop_token()).stop_requested()) break;
      ++ts.io_errors;
      ts.note("connection " + std::to_string(c.id) + ": " +
              (ec == shuttle::errc::eof || ec == shuttle::errc::disconnected ? std::string("server closed the connection")
                                                                             : ec.message()) +
              " after " + std::to_string(seq) + " requests");
      break;
    }
    if (over_socket && std::memcmp(out.data(), in.data(), size) != 0) {
      match = false;
      while (differs_at < size && out[differs_at] == in[differs_at]) ++differs_at;
    }
    if (!match) {
      ++ts.mismatches;
      ts.note("connection " + std::to_string(c.id) + ": request " + std::to_string(seq) +
              ": echo differs from what was sent at byte " + std::to_string(differs_at) + " of " +
              std::to_string(size));
      break;  // the stream is out of step: stop using this connection
    }
    ++ts.requests;
    ts.latency.record(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()));
  }
  if (seq == 0) ++ts.starved;
  rx.reset();
  c.socket.close();
  if (!over_socket) {
    // Graceful when the loop ended between requests; a cancelled connection
    // (a request was in flight at the deadline) is aborted by teardown.
    std::stop_token stop = co_await shuttle::get_stop_token();
    if (!stop.stop_requested() && c.conn.is_open()) (void)co_await c.conn.close();
  }
  if (--ts.live == 0) ts.all_done.set();
}

task<void> wait_event(shuttle::event& e) { (void)co_await e.wait(); }
task<void> wait_until(steady::time_point t) { (void)co_await shuttle::sleep_until(t); }

// Phase 2: run every open connection until the deadline (or until they all
// failed), then cancel what is in flight.
task<void> run_load(thread_state& ts, load_params lp, steady::time_point deadline) {
  shuttle::async_scope scope;
  ts.live = 0;
  for (auto& c : ts.connections)
    if (c.is_open()) ++ts.live;
  if (ts.live == 0) co_return;
  ts.pool = make_pool(lp.size, reinterpret_cast<std::uintptr_t>(&ts));
  if (lp.recv_ring && lp.transport == cli::transport::socket)
    ts.ring.emplace(shuttle::io_context::current(), static_cast<unsigned>(lp.recv_ring),
                    std::max<std::size_t>(lp.size, 16384));
  for (auto& c : ts.connections)
    if (c.is_open()) scope.spawn(connection_loop(ts, c, lp, deadline));
  if (deadline == steady::time_point::max())
    co_await wait_event(ts.all_done);
  else
    (void)co_await shuttle::when_any(wait_event(ts.all_done), wait_until(deadline));
  scope.request_stop();
  co_await scope.join();
}

task<void> fulfil(task<void> t, std::promise<void> p) {
  try {
    co_await std::move(t);
    p.set_value();
  } catch (...) {
    p.set_exception(std::current_exception());
  }
}

// Runs a task on every runtime thread at once and waits for all of them.
template <class MakeTask>
void on_every_thread(shuttle::runtime& rt, MakeTask make) {
  std::vector<std::future<void>> done;
  for (std::size_t i = 0; i < rt.size(); ++i) {
    std::promise<void> p;
    done.push_back(p.get_future());
    rt.spawn(i, fulfil(make(i), std::move(p)));
  }
  for (auto& f : done) f.get();
}

// ---------------------------------------------------------------- options

struct options {
  std::string host = "127.0.0.1";
  unsigned port = 0;
  std::size_t connections = 1;
  std::size_t size = 64;
  double duration = 5;
  std::uint64_t requests = 0;
  std::size_t threads = 1;
  double connect_timeout = 5;
  bool json = false;
  cli::transport transport = cli::transport::socket;
  std::size_t recv_ring = 0;
  bool register_files = true;
};

const char* const kSynopsis =
    "usage: shuttle-echo-client --port P [--host H] [--connections C] [--size S] [--duration T]\n"
    "       [--requests N] [--threads N] [--connect-timeout T] [--json] [--transport T] [--recv-ring N]\n"
    "       [--no-registered-files]\n";

options parse_options(int argc, char** argv) {
  options o;
  CLI::App app{"Load generator and checker for an echo server.", kProg};
  cli::setup(app, kSynopsis);
  app.add_option("--host", o.host, "server address or name (default 127.0.0.1)")->type_name("H");
  // Required, but checked after parsing: an unknown option is the error to report first.
  auto* port = app.add_option("--port", o.port, "server port, required")->type_name("P")->transform(cli::count(1, 65535));
  app.add_option("--connections", o.connections, "concurrent connections (default 1)")
      ->type_name("C")
      ->transform(cli::count(1, 1'000'000));
  app.add_option("--size", o.size, "bytes per request (default 64)")->type_name("S")->transform(cli::count(1, 1ull << 30));
  app.add_option("--duration", o.duration, "seconds of load, fractions allowed (default 5)")
      ->type_name("T")
      ->check(cli::seconds());
  app.add_option("--requests", o.requests,
                 "instead of a duration: N requests per connection, however long they take (a check that must not "
                 "depend on the machine's speed)")
      ->type_name("N")
      ->transform(cli::count(1, 1ull << 40));
  app.add_option("--threads", o.threads, "client threads; connections are spread over them (default 1)")
      ->type_name("N")
      ->transform(cli::count(1, 1024));
  app.add_option("--connect-timeout", o.connect_timeout, "seconds allowed for each connect (default 5)")
      ->type_name("T")
      ->check(cli::seconds());
  app.add_flag("--json", o.json, "also print the results as one JSON line (the last line)");
  cli::add_transport(app, o.transport,
                     {cli::transport::socket, cli::transport::rdma, cli::transport::tcp_provider,
                      cli::transport::automatic},
                     "tcp (sockets, default), rdma (verbs provider, rdma_cm), tcp-provider (RDMA semantics over "
                     "TCP) or auto (the local provider to a server on this host): the last three send each "
                     "request as one message, at most the connection's max_message_size()");
  app.add_option("--recv-ring", o.recv_ring,
                 "tcp: receive replies through a ring of N kernel-provided buffers per thread (multishot recv; N a "
                 "power of two; default 0: a recv per reply)")
      ->type_name("N")
      ->transform(cli::count(1, 32768))
      ->check(cli::power_of_two());
  app.add_flag_function(
      "--no-registered-files", [&](std::int64_t) { o.register_files = false; },
      "tcp: name each socket by its fd, not by a slot in the ring's registered-file table (for comparisons)");
  cli::parse(app, argc, argv);
  if (!port->count()) cli::fail(app, "--port is required");
  return o;
}

std::chrono::nanoseconds to_ns(double seconds) {
  return std::chrono::nanoseconds(static_cast<std::int64_t>(seconds * 1e9));
}

int run_client(const options& o) {
  auto ep = shuttle::endpoint::resolve(o.host, static_cast<std::uint16_t>(o.port));
  if (!ep) {
    std::fprintf(stderr, "%s: cannot resolve '%s': %s\n", kProg, o.host.c_str(), ep.error().message().c_str());
    return 1;
  }
  const std::size_t threads = std::min(o.threads, o.connections);
  shuttle::runtime rt(threads);
  std::vector<std::unique_ptr<thread_state>> states;
  for (std::size_t i = 0; i < threads; ++i) states.push_back(std::make_unique<thread_state>());
  for (std::size_t id = 0; id < o.connections; ++id) states[id % threads]->connections.push_back({id, {}, {}});

  // Phase 1: connect.
  const auto timeout = to_ns(o.connect_timeout);
  const auto connect_start = steady::now();
  const load_params lp{o.transport, o.size, o.recv_ring, o.register_files, o.requests};
  on_every_thread(rt, [&](std::size_t i) { return connect_all(*states[i], *ep, timeout, lp); });
  const double connect_s = std::chrono::duration<double>(steady::now() - connect_start).count();

  std::uint64_t connect_failures = 0;
  for (auto& s : states) connect_failures += s->connect_failures;
  std::size_t too_big = 0;
  for (auto& s : states) too_big += s->too_big;
  if (too_big) {
    // A usage error, found once connected: that message alone, exit 2.
    bool said = false;
    for (auto& s : states)
      for (auto& m : s->messages)
        if (!said && m.starts_with("--size")) {
          std::fprintf(stderr, "%s: %s\n", kProg, m.c_str());
          said = true;
        }
    on_every_thread(rt, [&](std::size_t i) { return teardown(*states[i]); });
    rt.join();
    return 2;
  }
  const std::uint64_t connected = o.connections - connect_failures;
  if (connect_failures) {
    std::fprintf(stderr, "%s: %llu of %zu connections to %s failed\n", kProg,
                 static_cast<unsigned long long>(connect_failures), o.connections, ep->to_string().c_str());
    for (auto& s : states)
      for (auto& m : s->messages) std::fprintf(stderr, "  %s\n", m.c_str());
    for (auto& s : states) s->messages.clear();
  }

  // Phase 2: load. The process's CPU time over it is reported too: on a
  // machine the client shares with the server, it bounds what the server
  // can show.
  const double cpu0 = process_cpu_s();
  const auto start = steady::now();
  // With --requests the connections end by themselves (or fail): no deadline.
  const auto deadline = o.requests ? steady::time_point::max() : start + to_ns(o.duration);
  if (connected > 0)
    on_every_thread(rt, [&](std::size_t i) { return run_load(*states[i], lp, deadline); });
  const double elapsed = std::chrono::duration<double>(steady::now() - start).count();
  const double cpu_s = process_cpu_s() - cpu0;
  on_every_thread(rt, [&](std::size_t i) { return teardown(*states[i]); });
  rt.join();

  histogram latency;
  std::uint64_t requests = 0, io_errors = 0, mismatches = 0, starved = 0;
  for (auto& s : states) {
    starved += s->starved;
    latency.merge(s->latency);
    requests += s->requests;
    io_errors += s->io_errors;
    mismatches += s->mismatches;
  }
  const std::uint64_t errors = io_errors + mismatches + connect_failures;
  const double rps = elapsed > 0 ? static_cast<double>(requests) / elapsed : 0;
  const double mbps = rps * static_cast<double>(o.size) / 1e6;
  const double p50 = latency.quantile(0.50) / 1e3;
  const double p99 = latency.quantile(0.99) / 1e3;
  const double p999 = latency.quantile(0.999) / 1e3;

  for (auto& s : states)
    for (auto& m : s->messages) std::fprintf(stderr, "%s: %s\n", kProg, m.c_str());

  const std::string over =
      o.transport == cli::transport::socket ? std::string() : std::string(" over ") + cli::to_string(o.transport);
  std::printf("%s: %s%s, %llu/%zu connections (connected in %.3f s), %zu threads, %zu-byte requests, %.3f s\n",
              kProg, ep->to_string().c_str(), over.c_str(), static_cast<unsigned long long>(connected), o.connections,
              connect_s, threads, o.size, elapsed);
  std::printf("  requests:  %llu (%.0f requests/s)\n", static_cast<unsigned long long>(requests), rps);
  std::printf("  echoed:    %.2f MB/s\n", mbps);
  std::printf("  latency:   p50 %.1f us, p99 %.1f us, p99.9 %.1f us\n", p50, p99, p999);
  std::printf("  cpu:       %.3f s (user + system, all threads; %.2f us per request)\n", cpu_s,
              requests ? cpu_s * 1e6 / static_cast<double>(requests) : 0.0);
  if (starved)
    std::printf("  starved:   %llu connections completed no request (server busy or not accepting)\n",
                static_cast<unsigned long long>(starved));
  std::printf("  errors:    %llu (connect failures %llu, I/O errors %llu, mismatches %llu)\n",
              static_cast<unsigned long long>(errors), static_cast<unsigned long long>(connect_failures),
              static_cast<unsigned long long>(io_errors), static_cast<unsigned long long>(mismatches));
  if (o.json) {
    std::printf(
        "{\"host\":\"%s\",\"port\":%u,\"connections\":%zu,\"connected\":%llu,\"threads\":%zu,\"size\":%zu,"
        "\"duration_s\":%.6f,\"requests\":%llu,\"requests_per_s\":%.1f,\"mb_per_s\":%.3f,"
        "\"p50_us\":%.2f,\"p99_us\":%.2f,\"p999_us\":%.2f,\"errors\":%llu,\"connect_failures\":%llu,"
        "\"io_errors\":%llu,\"mismatches\":%llu,\"starved\":%llu,\"transport\":\"%s\",\"cpu_s\":%.6f}\n",
        o.host.c_str(), o.port, o.connections, static_cast<unsigned long long>(connected), threads, o.size, elapsed,
        static_cast<unsigned long long>(requests), rps, mbps, p50, p99, p999, static_cast<unsigned long long>(errors),
        static_cast<unsigned long long>(connect_failures), static_cast<unsigned long long>(io_errors),
        static_cast<unsigned long long>(mismatches), static_cast<unsigned long long>(starved),
        cli::to_string(o.transport), cpu_s);
  }
  std::fflush(stdout);
  if (requests == 0) {
    // A load test that measured nothing did not succeed, whatever the
    // reason (a server that accepts and closes, one that never answers).
    std::fprintf(stderr, "%s: no request completed\n", kProg);
    return 1;
  }
  return errors ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse_options(argc, argv);
  try {
    return run_client(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProg, e.what());
    return 1;
  }
}
