// shuttle-echo-server: an echo server on shuttle, over TCP sockets or over
// the transport API.
//
//   shuttle-echo-server --port P [--threads N] [--transport tcp|rdma|tcp-provider|auto]
//                       [--bind ADDR] [--max-message BYTES]
//                       [--max-handshakes N] [--handshake-timeout MS]
//                       [--max-connections N] [--idle-timeout MS] [--accept-plain]
//
// --transport tcp (the default): plain TCP sockets. N runtime threads, each
// with its own io_context and its own listener bound with SO_REUSEPORT to the
// same port, so the kernel spreads connections over the threads and a
// connection never leaves the thread that accepted it. Each thread accepts
// into its own async_scope; every connection is one coroutine echoing with
// read_some / write_all over a 16 KiB buffer.
//
// --transport rdma | tcp-provider: the transport API (transport.hpp) with the
// verbs provider (rdma_cm; ADDR must then be an address of an RDMA interface
// or 0.0.0.0) or shuttle's tcp provider (RDMA semantics over TCP);
// --transport auto: transport_kind::automatic (clients on this host through
// the local provider, the others through rdma or tcp-provider). One
// thread: a domain, its listener and its connections belong to one loop.
// Every connection is one coroutine that echoes each received message with a
// send. Messages up to --max-message bytes (default 65536: the size of the
// server's receive buffers, and so the clients' max_message_size()); 4 to 16
// of them per connection (1 MiB, at least 4). The listener's limits on
// peers (listener_options: handshakes in progress and their deadline, a
// connection cap, an idle timeout) come from the flags of the same names.
// --accept-plain (rdma): a client that does not speak shuttle (a program
// written against librdmacm alone: no private data, or its own) is served
// as a plain RC peer (wire_protocol::detect): each of its sends is echoed
// with a plain send, into one of the server's posted receives; the client
// posts a receive for each reply, of at least the size it sent.
//
// --port 0 binds an ephemeral port (thread 0 binds first, the others join it);
// the listening line prints the real one:
//   shuttle-echo-server listening on port P with N threads
// (over the transport API followed by " over " and the provider).
//
// Shutdown: SIGINT/SIGTERM are blocked before the runtime starts and read by
// the main thread through a signal_set on its own io_context. On a signal the
// runtime is asked to stop: each thread's accept is cancelled, the thread
// closes its listener, cancels its connections (scope.request_stop()), joins
// them, and the process prints a one-line summary and exits 0.
//
// Out of file descriptors (EMFILE/ENFILE/ENOBUFS/ENOMEM on accept): log,
// back off 10-100 ms, retry. Pending connections wait
// in the kernel's backlog meanwhile and are served once descriptors free up.
// Over the transport API, a connection that ends by anything but a clean
// close (a protocol error, a NAK, an idle timeout) and a handshake that
// fails are logged with the peer and the error. Every error line goes
// through one rate-limited log (tool_support.hpp): a few lines a second,
// then a count of those held back.

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "cli.hpp"
#include "tool_support.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <new>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace {

using namespace std::chrono_literals;
using shuttle::task;

constexpr std::size_t kBufferSize = 16 * 1024;
constexpr auto kMinBackoff = 10ms;
constexpr auto kMaxBackoff = 100ms;
constexpr const char* kProg = "shuttle-echo-server";

// Posted receives per transport connection: its clients keep one request in
// flight, so a few do; fewer for large messages (each one is --max-message
// bytes of memory, per connection).
std::uint32_t receive_buffers_for(std::size_t max_message) {
  return static_cast<std::uint32_t>(std::clamp<std::size_t>((std::size_t(1) << 20) / max_message, 4, 16));
}

// Written only by the owning runtime thread; read by main after join().
struct alignas(64) thread_stats {
  std::uint64_t connections = 0;
  std::uint64_t bytes = 0;
};

// ---------------------------------------------------------------- logging

// Error lines from every thread: a few a second at most, the rest counted
// (a hostile peer must not flood the log).
tools::throttled_log g_log{kProg};

void log_throttled(const std::string& line) { g_log(line); }

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

bool is_resource_exhaustion(const std::error_code& ec) {
  return ec == std::errc::too_many_files_open || ec == std::errc::too_many_files_open_in_system ||
         ec == std::errc::no_buffer_space || ec == std::errc::not_enough_memory;
}

// Errors that concern one aborted connection, not the listener: try again now.
bool is_transient(const std::error_code& ec) {
  // A transport handshake that failed (a peer that spoke the wrong protocol,
  // went away, or was refused) concerns that peer alone.
  if (ec == shuttle::errc::protocol_error || ec == shuttle::errc::eof) return true;
  if (ec.category() != std::system_category()) return false;
  switch (ec.value()) {
    case ECONNABORTED:
    case EINTR:
    case EAGAIN:
    case EPROTO:
    case EPERM:  // firewall
    case ENETDOWN:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EOPNOTSUPP:
      return true;
    default:
      return false;
  }
}

// ---------------------------------------------------------------- serving

// Sends all of `data`: one send usually does, and needs no coroutine frame;
// write_all takes over after a short one.
task<shuttle::result<void>> write_rest(shuttle::tcp_socket& sock, std::span<const std::byte> data, std::size_t sent) {
  co_return co_await sock.write_all(data.subspan(sent));
}

task<void> echo(std::size_t index, shuttle::tcp_socket sock, thread_stats& stats, shuttle::buffer_ring* ring,
                bool register_file) {
  try {
    (void)sock.set_nodelay(true);  // best effort
    // A slot in this thread's ring file table: no file lookup per recv and
    // send. Best effort: with the table full, the fd serves as well.
    if (register_file) (void)sock.register_file();
    std::unique_ptr<std::byte[]> own;
    std::optional<shuttle::receive_stream> rx;
    if (ring)
      rx.emplace(sock, *ring);  // kernel-provided buffers: one multishot recv for the connection's life
    else
      own.reset(new std::byte[kBufferSize]);
    for (;;) {
      // EOF, reset, cancellation (shutdown), anything else: close this connection.
      shuttle::provided_buffer held;
      std::span<const std::byte> data;
      if (rx) {
        auto b = co_await rx->next();
        if (!b || b->empty()) break;
        held = std::move(*b);
        data = held.data();
      } else {
        auto n = co_await sock.read_some(std::span(own.get(), kBufferSize));
        if (!n || *n == 0) break;
        data = std::span<const std::byte>(own.get(), *n);
      }
      auto n = co_await sock.write_some(data);
      if (!n) break;
      const std::size_t size = data.size();
      if (*n < size) {
        if (rx) {
          // The peer is slow to take its echo: wait on a copy, so that a
          // client that never reads holds none of the ring shared by this
          // thread's connections.
          if (!own) own.reset(new std::byte[kBufferSize]);
          std::memcpy(own.get(), data.data() + *n, size - *n);
          data = std::span<const std::byte>(own.get(), size - *n);
          held.reset();
          if (!co_await write_rest(sock, data, 0)) break;
        } else if (!co_await write_rest(sock, data, *n)) {
          break;
        }
      }
      stats.bytes += size;
    }
  } catch (...) {
    // Out of memory or SQEs: drop this connection, keep the server.
    log_throttled("thread " + std::to_string(index) + ": connection dropped: " + current_exception_code().message());
  }
}

// A transport connection ended by anything but a clean close or shutdown (a
// protocol error, a refused one-sided access, an idle timeout, a reset):
// who and why, for the operator.
void log_connection_end(std::size_t index, const std::string& peer, const std::error_code& ec) {
  if (ec == shuttle::errc::disconnected || ec == std::errc::operation_canceled) return;
  log_throttled("thread " + std::to_string(index) + ": connection from " + peer + " failed: " + ec.message());
}

// Over the transport API: every received message goes back with a send. The
// message's buffer returns to the receive pool once the send completed.
task<void> echo(std::size_t index, shuttle::connection conn, thread_stats& stats) {
  const std::string peer = conn.remote_endpoint().to_string();
  try {
    for (;;) {
      auto m = co_await conn.recv();
      // The peer disconnected, cancellation (shutdown), any error: done.
      if (!m) {
        log_connection_end(index, peer, m.error());
        break;
      }
      if (m->imm()) continue;  // a write_with_imm notification: nothing to echo
      auto w = co_await conn.send(m->data());
      if (!w) {
        log_connection_end(index, peer, w.error());
        break;
      }
      stats.bytes += m->size();
    }
  } catch (...) {
    log_throttled("thread " + std::to_string(index) + ": connection dropped: " + current_exception_code().message());
  }
  // The connection's destructor aborts it: pending operations fail, the peer
  // sees a disconnect.
}

// Accepts on `listener` (a tcp_listener or a transport listener) until
// stopped; one echo coroutine per connection.
template <class Listener>
task<void> serve(std::size_t index, Listener listener, thread_stats& stats, std::size_t recv_ring = 0,
                 bool register_files = false) {
  // One buffer ring per thread, shared by its connections (--recv-ring).
  std::optional<shuttle::buffer_ring> ring;
  if (recv_ring) ring.emplace(shuttle::io_context::current(), static_cast<unsigned>(recv_ring), kBufferSize);
  shuttle::async_scope connections;
  auto backoff = std::chrono::duration_cast<std::chrono::milliseconds>(kMinBackoff);
  const std::stop_token stop = co_await shuttle::get_stop_token();
  while (!stop.stop_requested()) {
    std::error_code ec;
    try {
      auto r = co_await listener.accept();
      if (r) {
        backoff = kMinBackoff;
        ++stats.connections;
        if constexpr (std::is_same_v<Listener, shuttle::tcp_listener>)
          connections.spawn(echo(index, std::move(*r), stats, ring ? &*ring : nullptr, register_files));
        else
          connections.spawn(echo(index, std::move(*r), stats));
        continue;
      }
      ec = r.error();
    } catch (...) {
      ec = current_exception_code();
    }
    if (ec == std::errc::operation_canceled || ec == std::errc::bad_file_descriptor) break;
    std::chrono::milliseconds pause{0};
    std::string line = "thread " + std::to_string(index) + ": accept failed: " + ec.message();
    if (is_resource_exhaustion(ec)) {
      pause = backoff;
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, kMaxBackoff);
      log_throttled(line + "; backing off " + std::to_string(pause.count()) + " ms (" +
                    std::to_string(connections.active()) + " open connections on this thread)");
    } else if (!is_transient(ec)) {
      pause = kMaxBackoff;
      log_throttled(line + "; retrying in " + std::to_string(pause.count()) + " ms");
    } else if constexpr (!std::is_same_v<Listener, shuttle::tcp_listener>) {
      // A peer that failed its handshake (wrong protocol, refused hello):
      // that peer's problem, but the operator should see it.
      log_throttled(line);
    }
    if (pause.count() > 0) {
      bool stopped = false;
      try {
        stopped = !co_await shuttle::sleep_for(pause);  // cancelled: shutting down
      } catch (...) {
        // No SQE for the timer: go round again; accept will fail or succeed.
      }
      if (stopped) break;
    }
  }
  // Stop accepting, cancel every connection, wait for them all.
  listener.close();
  connections.request_stop();
  co_await connections.join();
}

// Runs `t` and reports its end (or its exception) to the main thread.
task<void> fulfil(task<void> t, std::promise<void> done) {
  try {
    co_await std::move(t);
    done.set_value();
  } catch (...) {
    done.set_exception(std::current_exception());
  }
}

task<shuttle::result<shuttle::tcp_listener>> bind_socket(shuttle::endpoint ep) {
  // Runs on the thread that will own the listener (it registers with that
  // thread's io_context).
  co_return shuttle::tcp_listener::bind(ep, {.backlog = 4096, .reuse_address = true, .reuse_port = true});
}

task<int> wait_for_signal(shuttle::signal_set& signals) {
  auto r = co_await signals.wait();
  if (!r) {
    std::fprintf(stderr, "%s: waiting for signals failed: %s\n", kProg, r.error().message().c_str());
    co_return 0;
  }
  co_return *r;
}

// ---------------------------------------------------------------- options

struct options {
  unsigned port = 0;
  std::size_t threads = 1;
  cli::transport transport = cli::transport::socket;
  std::string bind = "0.0.0.0";
  std::size_t max_message = 65536;
  std::size_t recv_ring = 0;
  bool register_files = true;
  shuttle::listener_options limits;  // rdma, tcp-provider
  bool limits_set = false;
  bool accept_plain = false;  // rdma: serve plain rdma_cm peers too
};

const char* const kSynopsis =
    "usage: shuttle-echo-server --port P [--threads N] [--transport T] [--bind ADDR]\n"
    "                           [--max-message BYTES] [--recv-ring N] [--no-registered-files]\n"
    "                           [--max-handshakes N] [--handshake-timeout MS] [--max-connections N]\n"
    "                           [--idle-timeout MS] [--accept-plain]\n";

options parse_options(int argc, char** argv) {
  options o;
  CLI::App app{"Echoes back what its clients send, over TCP sockets or the transport API.", kProg};
  cli::setup(app, kSynopsis);
  // Required, but checked after parsing: an unknown option is the error to report first.
  auto* port = app.add_option("--port", o.port, "port to listen on, required (0: pick a free one and print it)")
      ->type_name("P")
      ->transform(cli::count(0, 65535));
  app.add_option("--threads", o.threads, "event-loop threads, one listener each (default 1; tcp only)")
      ->type_name("N")
      ->transform(cli::count(1, 1024));
  cli::add_transport(app, o.transport,
                     {cli::transport::socket, cli::transport::rdma, cli::transport::tcp_provider,
                      cli::transport::automatic},
                     "tcp (sockets, default), rdma (verbs provider, rdma_cm), tcp-provider (RDMA semantics over "
                     "TCP) or auto (the local provider for clients on this host, rdma or tcp-provider for the "
                     "others): the last three use the transport API");
  app.add_option("--bind", o.bind, "numeric address to bind (default 0.0.0.0; '::' for IPv6)")->type_name("ADDR");
  auto* max_message = app.add_option("--max-message", o.max_message,
                                     "rdma, tcp-provider: largest message accepted (default 65536; suffixes k, m, g)")
                          ->type_name("BYTES")
                          ->transform(cli::bytes(1, 1ull << 30));
  app.add_option("--recv-ring", o.recv_ring,
                 "tcp: receive through a ring of N kernel-provided buffers per thread (multishot recv; N a power of "
                 "two; default 0: a buffer per connection)")
      ->type_name("N")
      ->transform(cli::count(0, 32768))
      ->check(cli::power_of_two());
  app.add_flag_function(
      "--no-registered-files", [&](std::int64_t) { o.register_files = false; },
      "tcp: operations name each socket by its fd, not by a slot in the ring's registered-file table (for "
      "comparisons)");
  std::uint32_t max_handshakes = o.limits.max_handshakes, max_connections = o.limits.max_connections;
  std::uint64_t handshake_ms = static_cast<std::uint64_t>(o.limits.handshake_timeout.count());
  std::uint64_t idle_ms = static_cast<std::uint64_t>(o.limits.idle_timeout.count());
  CLI::Option* limits[] = {
      app.add_option("--max-handshakes", max_handshakes,
                     "rdma, tcp-provider: handshakes in progress at once; past it a peer is refused (rdma) or waits "
                     "in the kernel's backlog (tcp-provider) (default " + std::to_string(max_handshakes) + ")")
          ->type_name("N")
          ->transform(cli::count(1, 1u << 20)),
      app.add_option("--handshake-timeout", handshake_ms,
                     "rdma, tcp-provider: how long a peer has to finish its handshake (default " +
                         std::to_string(handshake_ms) + ")")
          ->type_name("MS")
          ->transform(cli::count(1, 3'600'000)),
      app.add_option("--max-connections", max_connections,
                     "rdma, tcp-provider: connections alive at once; past it new peers are refused (default 0: no "
                     "cap)")
          ->type_name("N")
          ->transform(cli::count(0, 1u << 24)),
      app.add_option("--idle-timeout", idle_ms,
                     "rdma, tcp-provider: a connection on which nothing arrives for this long is closed (default 0: "
                     "never)")
          ->type_name("MS")
          ->transform(cli::count(0, 86'400'000)),
  };
  app.add_flag("--accept-plain", o.accept_plain,
               "rdma: also serve clients that do not speak shuttle (plain librdmacm programs), as plain RC peers "
               "whose sends are echoed");
  cli::parse(app, argc, argv);
  if (!port->count()) cli::fail(app, "--port is required");
  if (o.accept_plain && o.transport != cli::transport::rdma)
    cli::fail(app, "--accept-plain applies to --transport rdma (plain RC peers are rdma_cm programs)");
  o.limits.max_handshakes = max_handshakes;
  o.limits.max_connections = max_connections;
  o.limits.handshake_timeout = std::chrono::milliseconds(handshake_ms);
  o.limits.idle_timeout = std::chrono::milliseconds(idle_ms);
  for (auto* l : limits) o.limits_set = o.limits_set || l->count() > 0;
  if (o.transport != cli::transport::socket && o.threads > 1)
    cli::fail(app, "--threads " + std::to_string(o.threads) + " needs --transport tcp: over " +
                       cli::to_string(o.transport) + " a listener and its connections belong to one thread");
  if (o.transport == cli::transport::socket && max_message->count())
    cli::fail(app, "--max-message applies to --transport rdma and tcp-provider (a TCP stream has no messages)");
  if (o.transport == cli::transport::socket && o.limits_set)
    cli::fail(app,
              "--max-handshakes, --handshake-timeout, --max-connections and --idle-timeout apply to --transport "
              "rdma and tcp-provider");
  return o;
}

int run_socket_server(const options& opts) {
  const bool v6 = opts.bind.find(':') != std::string::npos;
  auto make_endpoint = [&](unsigned p) {
    return shuttle::endpoint::parse((v6 ? "[" + opts.bind + "]" : opts.bind) + ":" + std::to_string(p));
  };
  if (!make_endpoint(0)) {
    std::fprintf(stderr, "%s: bad --bind address '%s' (numeric IPv4 or IPv6)\n", kProg, opts.bind.c_str());
    return 2;
  }

  // Block the shutdown signals before any thread starts, so only the
  // signalfd below ever sees them.
  shuttle::block_signals({SIGINT, SIGTERM, SIGPIPE});
  shuttle::io_context main_ctx;
  shuttle::signal_set signals{SIGINT, SIGTERM};

  std::vector<thread_stats> stats(opts.threads);
  shuttle::runtime rt(opts.threads);

  // Bind one listener per thread, on that thread. Thread 0 goes first so that
  // --port 0 resolves to one real port that the others then share.
  unsigned port = opts.port;
  std::vector<std::future<void>> served;
  // Asks every thread to stop, waits for its serve task, then joins the
  // runtime. Waiting first matters: runtime::join() stops the loops without
  // running work still queued to them, and it should find them idle.
  auto stop_all = [&] {
    rt.request_stop();
    bool ok = true;
    for (auto& f : served) {
      try {
        f.get();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: a server thread failed: %s\n", kProg, e.what());
        ok = false;
      }
    }
    rt.join();
    return ok;
  };
  for (std::size_t i = 0; i < opts.threads; ++i) {
    auto ep = make_endpoint(port);
    auto listener = rt.block_on(i, bind_socket(*ep));
    if (!listener) {
      std::fprintf(stderr, "%s: cannot listen on %s (thread %zu): %s\n", kProg, ep->to_string().c_str(), i,
                   listener.error().message().c_str());
      stop_all();
      return 1;
    }
    if (port == 0) {
      auto local = listener->local_endpoint();
      if (!local) {
        std::fprintf(stderr, "%s: getsockname: %s\n", kProg, local.error().message().c_str());
        stop_all();
        return 1;
      }
      port = local->port();
    }
    std::promise<void> done;
    served.push_back(done.get_future());
    rt.spawn(i, fulfil(serve(i, std::move(*listener), stats[i], opts.recv_ring, opts.register_files), std::move(done)));
  }

  std::printf("%s listening on port %u with %zu threads\n", kProg, port, opts.threads);
  std::fflush(stdout);

  int sig = main_ctx.run(wait_for_signal(signals));
  if (sig > 0) std::fprintf(stderr, "%s: %s, shutting down\n", kProg, strsignal(sig));

  // request_stop() cancels every accept and, through the scopes, every
  // connection; each serve task then closes its listener and joins its
  // connections.
  const bool clean = stop_all();

  std::uint64_t connections = 0, bytes = 0;
  for (const auto& s : stats) {
    connections += s.connections;
    bytes += s.bytes;
  }
  g_log.flush();
  std::printf("%s: served %llu connections, echoed %llu bytes\n", kProg,
              static_cast<unsigned long long>(connections), static_cast<unsigned long long>(bytes));
  std::fflush(stdout);
  return clean ? 0 : 1;
}

// ---------------------------------------------------------------- transport API

// The domain and the listener, opened on the thread that will own them.
struct transport_server {
  std::optional<shuttle::domain> domain;
  shuttle::listener listener;
  std::string step;  // what failed, for the message
};

task<shuttle::result<void>> open_transport(transport_server& srv, const options& opts, shuttle::endpoint ep) {
  shuttle::domain_options dopts;
  dopts.kind = cli::kind_of(opts.transport);
  auto d = shuttle::domain::open(dopts);
  if (!d) {
    srv.step = std::string("cannot open a ") + cli::to_string(opts.transport) + " domain";
    if (d.error() == shuttle::errc::not_supported && opts.transport == cli::transport::rdma)
      srv.step += " (no active RDMA device, or shuttle was built without rdma-core)";
    co_return d.error();
  }
  srv.domain.emplace(std::move(*d));
  shuttle::connection_options copts;
  copts.receive_buffers = receive_buffers_for(opts.max_message);
  copts.receive_buffer_size = opts.max_message;
  // One reply per received message, each awaited before the next receive:
  // a send queue as deep as the receive pool is plenty, and each verbs
  // connection reserves its depth in the domain's one completion queue
  // (capped by the device: 32,767 entries on rxe), so a deep one would cap
  // the connections held (128: about 240).
  if (opts.transport == cli::transport::rdma) copts.send_queue_depth = copts.receive_buffers;
  if (opts.accept_plain) copts.protocol = shuttle::wire_protocol::detect;
  auto limits = opts.limits;
  limits.on_refused = [](const shuttle::endpoint& peer, std::string_view why) {
    log_throttled("peer " + peer.to_string() + ": " + std::string(why));
  };
  auto l = srv.domain->listen(ep, copts, limits);
  if (!l) {
    srv.step = "cannot listen on " + ep.to_string() + " over " + srv.domain->describe();
    srv.domain.reset();
    co_return l.error();
  }
  srv.listener = std::move(*l);
  co_return shuttle::result<void>{};
}

// serve(), then the domain goes on its own thread (what the provider still
// winds down ends on that loop: transport.hpp, "Lifetimes").
task<void> serve_transport(transport_server& srv, thread_stats& stats) {
  co_await serve(0, std::move(srv.listener), stats);
  srv.domain.reset();
}

task<void> close_transport(transport_server& srv) {
  srv.listener = shuttle::listener{};
  srv.domain.reset();
  co_return;
}

int run_transport_server(const options& opts) {
  const bool v6 = opts.bind.find(':') != std::string::npos;
  auto ep = shuttle::endpoint::parse((v6 ? "[" + opts.bind + "]" : opts.bind) + ":" + std::to_string(opts.port));
  if (!ep) {
    std::fprintf(stderr, "%s: bad --bind address '%s' (numeric IPv4 or IPv6)\n", kProg, opts.bind.c_str());
    return 2;
  }
  shuttle::block_signals({SIGINT, SIGTERM, SIGPIPE});
  shuttle::io_context main_ctx;
  shuttle::signal_set signals{SIGINT, SIGTERM};

  thread_stats stats;
  transport_server srv;
  shuttle::runtime rt(1);
  if (auto r = rt.block_on(0, open_transport(srv, opts, *ep)); !r) {
    std::fprintf(stderr, "%s: %s: %s\n", kProg, srv.step.c_str(), r.error().message().c_str());
    rt.block_on(0, close_transport(srv));
    rt.join();
    return 1;
  }
  const unsigned port = srv.listener.local_endpoint()->port();
  const std::string provider = srv.domain->describe();
  std::promise<void> done;
  auto served = done.get_future();
  rt.spawn(0, fulfil(serve_transport(srv, stats), std::move(done)));

  std::printf("%s listening on port %u with 1 threads over %s\n", kProg, port, provider.c_str());
  std::fflush(stdout);

  int sig = main_ctx.run(wait_for_signal(signals));
  if (sig > 0) std::fprintf(stderr, "%s: %s, shutting down\n", kProg, strsignal(sig));

  rt.request_stop();
  bool clean = true;
  try {
    served.get();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: the server thread failed: %s\n", kProg, e.what());
    clean = false;
  }
  rt.join();
  g_log.flush();
  std::printf("%s: served %llu connections, echoed %llu bytes\n", kProg,
              static_cast<unsigned long long>(stats.connections), static_cast<unsigned long long>(stats.bytes));
  std::fflush(stdout);
  return clean ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options opts = parse_options(argc, argv);
  try {
    return opts.transport == cli::transport::socket ? run_socket_server(opts) : run_transport_server(opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProg, e.what());
    return 1;
  }
}
