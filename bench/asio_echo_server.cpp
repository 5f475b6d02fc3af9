// asio_echo_server: baseline Boost.Asio C++20-coroutine TCP echo server, used to
// benchmark shuttle's echo server against idiomatic Boost.Asio.
//
//   asio_echo_server [--port P] [--threads N]      (defaults: port 7000, 1 thread)
//
// Layout (same as shuttle's server): N threads, each running its own
// io_context (concurrency hint 1) with its own acceptor bound with
// SO_REUSEPORT on 0.0.0.0:P, so the kernel spreads incoming connections
// across threads and a connection never leaves the thread that accepted it.
// One coroutine per connection: async_read_some into a 64 KiB buffer, then
// async_write of what was read. TCP_NODELAY is set on every connection.
//
// --port 0 binds an ephemeral port (shared by all threads); the port actually
// used is printed in the "listening" line.
//
// Prints "asio_echo_server listening on port P with N threads" (flushed) once
// all acceptors are listening. Exits 0 on SIGINT/SIGTERM.

// Boost 1.74 + clang 14 / g++ workarounds (co_await detection, <utility>,
// a false -Wmismatched-new-delete): the same ones shuttle's Asio interop uses.
#include <shuttle/asio/config.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string_view>
#include <sys/socket.h>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detail/socket_option.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#if !defined(BOOST_ASIO_HAS_CO_AWAIT)
#  error "Boost.Asio co_await support is not enabled for this compiler"
#endif

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

namespace {

constexpr std::size_t kBufferSize = 64 * 1024;
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(100);

// SO_REUSEPORT is not among asio's public socket options.
using reuse_port = asio::detail::socket_option::boolean<SOL_SOCKET, SO_REUSEPORT>;

// Completion handler for co_spawn: report an escaped exception (should not
// happen: all expected errors are handled via error_code) and carry on.
struct log_exception {
  const char* what_spawned;
  void operator()(const std::exception_ptr& e) const {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "asio_echo_server: %s: exception: %s\n", what_spawned, ex.what());
    } catch (...) {
      std::fprintf(stderr, "asio_echo_server: %s: unknown exception\n", what_spawned);
    }
  }
};

// One connection: read whatever is available, write it all back, until the
// peer closes (EOF), resets, or any other error; then close this socket only.
asio::awaitable<void> echo(tcp::socket socket) {
  error_code ec;
  socket.set_option(tcp::no_delay(true), ec);  // may fail if already reset; ignore

  char data[kBufferSize];  // lives in the (heap-allocated) coroutine frame
  for (;;) {
    const std::size_t n =
        co_await socket.async_read_some(asio::buffer(data), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;  // eof, connection_reset, operation_aborted, ...
    co_await asio::async_write(socket, asio::buffer(data, n), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;  // broken_pipe, connection_reset, ...
  }
  socket.close(ec);
}

bool is_resource_exhaustion(const error_code& ec) {
  return ec == asio::error::no_descriptors         // EMFILE
         || ec == asio::error::no_buffer_space     // ENOBUFS
         || ec == asio::error::no_memory           // ENOMEM
         || ec.value() == ENFILE;                  // system-wide fd limit
}

// Accept loop of one thread. The acceptor is owned by this coroutine's frame.
asio::awaitable<void> listener(tcp::acceptor acceptor) {
  const auto executor = co_await asio::this_coro::executor;
  asio::steady_timer retry_timer(executor);
  for (;;) {
    error_code ec;
    tcp::socket socket = co_await acceptor.async_accept(asio::redirect_error(asio::use_awaitable, ec));
    if (!ec) {
      asio::co_spawn(executor, echo(std::move(socket)), log_exception{"connection"});
      continue;
    }
    if (ec == asio::error::operation_aborted) co_return;  // acceptor closed
    if (ec == asio::error::connection_aborted || ec == asio::error::interrupted ||
        ec == asio::error::try_again) {
      continue;  // peer went away before accept, or transient: just retry
    }
    // EMFILE/ENFILE/ENOBUFS/ENOMEM or anything unexpected: log, back off, retry.
    std::fprintf(stderr, "asio_echo_server: accept failed: %s%s; retrying in %lld ms\n", ec.message().c_str(),
                 is_resource_exhaustion(ec) ? " (out of resources)" : "",
                 static_cast<long long>(kAcceptRetryDelay.count()));
    retry_timer.expires_after(kAcceptRetryDelay);
    co_await retry_timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
}

tcp::acceptor make_acceptor(asio::io_context& ctx, std::uint16_t port) {
  tcp::acceptor acceptor(ctx);
  const tcp::endpoint endpoint(tcp::v4(), port);  // 0.0.0.0:port
  acceptor.open(endpoint.protocol());
  acceptor.set_option(tcp::acceptor::reuse_address(true));
  acceptor.set_option(reuse_port(true));
  acceptor.bind(endpoint);
  acceptor.listen(asio::socket_base::max_listen_connections);
  return acceptor;
}

void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--port P] [--threads N]   (defaults: --port 7000 --threads 1)\n", argv0);
}

bool parse_uint(std::string_view text, unsigned long max, unsigned long& out) {
  if (text.empty()) return false;
  unsigned long value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<unsigned long>(c - '0');
    if (value > max) return false;
  }
  out = value;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  unsigned long port = 7000;
  unsigned long threads = 1;

  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(argv[0]);
      return 0;
    }
    std::string_view name = arg;
    std::string_view value;
    if (const auto eq = arg.find('='); eq != std::string_view::npos) {  // --port=P form
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else if (i + 1 < argc) {
      value = argv[i + 1];
    }
    bool ok = false;
    if (name == "--port") {
      ok = parse_uint(value, 65535, port);
    } else if (name == "--threads") {
      ok = parse_uint(value, 1024, threads) && threads >= 1;
    } else {
      std::fprintf(stderr, "asio_echo_server: unknown argument '%s'\n", argv[i]);
      usage(argv[0]);
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "asio_echo_server: bad or missing value for %.*s\n", static_cast<int>(name.size()),
                   name.data());
      usage(argv[0]);
      return 2;
    }
    if (name.size() == arg.size()) ++i;  // consumed the separate value
  }

  std::vector<std::unique_ptr<asio::io_context>> contexts;
  contexts.reserve(threads);
  for (unsigned long t = 0; t < threads; ++t) contexts.push_back(std::make_unique<asio::io_context>(1));

  // Bind and listen on every acceptor before running anything, so bind errors
  // are reported synchronously and the "listening" line is accurate.
  std::uint16_t bound_port = static_cast<std::uint16_t>(port);
  try {
    for (unsigned long t = 0; t < threads; ++t) {
      tcp::acceptor acceptor = make_acceptor(*contexts[t], bound_port);
      if (bound_port == 0) bound_port = acceptor.local_endpoint().port();  // --port 0: share the ephemeral port
      asio::co_spawn(*contexts[t], listener(std::move(acceptor)), log_exception{"listener"});
    }
  } catch (const boost::system::system_error& e) {
    std::fprintf(stderr, "asio_echo_server: cannot listen on 0.0.0.0:%lu: %s\n", port, e.what());
    return 1;
  }

  auto stop_all = [&contexts] {
    for (auto& ctx : contexts) ctx->stop();  // io_context::stop is thread-safe
  };

  asio::signal_set signals(*contexts[0], SIGINT, SIGTERM);
  signals.async_wait([&stop_all](const error_code& ec, int /*signo*/) {
    if (!ec) stop_all();
  });

  std::printf("asio_echo_server listening on port %u with %lu threads\n", static_cast<unsigned>(bound_port), threads);
  std::fflush(stdout);

  std::atomic<int> rc{0};
  auto run = [&stop_all, &rc](asio::io_context& ctx) {
    try {
      ctx.run();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "asio_echo_server: io_context::run: %s\n", e.what());
      rc.store(1);
      stop_all();
    }
  };

  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (unsigned long t = 1; t < threads; ++t) workers.emplace_back(run, std::ref(*contexts[t]));
  run(*contexts[0]);
  for (auto& w : workers) w.join();

  // contexts (and with them every connection/listener coroutine frame, socket
  // and acceptor) are destroyed here, after all threads have stopped.
  return rc.load();
}
