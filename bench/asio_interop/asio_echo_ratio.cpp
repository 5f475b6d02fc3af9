// asio_echo_ratio: one Asio echo server, three ways, in the same run:
//   plain   the C++20-coroutine echo server on asio::io_context, actx.run();
//   driven  the same code on an asio::io_context driven by shuttle's loop
//           (asio_driver), drive.run();
//   own     the same server on shuttle::asio::context (shuttle's executor,
//           shuttle sockets through shuttle::asio operations with
//           use_awaitable), ctx.run().
// Each run serves `conns` connections of a client thread (blocking sockets,
// all connections' `msg`-byte messages written, then all read back: a
// closed-loop load of `conns` messages in flight) for `seconds`, then the
// client closes; the server's coroutines end on EOF and run() returns on its
// own (no stop(): Asio's out-of-work rule, on all three).
//
//   asio_echo_ratio [seconds=1] [rounds=5] [conns=16] [msg=64] [only=all]
//
// only = plain, driven or own runs that mode alone (for a profiler, e.g.
// valgrind --tool=callgrind: instructions per echo).
//
// Prints round trips per second for each run (modes interleaved, rounds
// times), then per mode the median and the spread (min-max), and the ratios
// of the medians to plain.
#include <shuttle/asio/asio.hpp>  // first: configures Asio

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <shuttle/shuttle.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace net = boost::asio;
namespace sa = shuttle::asio;
using net::ip::tcp;

namespace {

struct config {
  double seconds = 1.0;
  int rounds = 5;
  int conns = 16;
  std::size_t msg = 64;
  std::string only = "all";
};

// The client: blocking sockets on another thread. Returns round trips.
std::uint64_t client(std::uint16_t port, const config& c) {
  std::vector<int> fds;
  for (int i = 0; i < c.conns; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      throw std::runtime_error(std::string("client connect: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fds.push_back(fd);
  }
  std::vector<char> out(c.msg, 'x'), in(c.msg);
  std::uint64_t trips = 0;
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(c.seconds);
  while (std::chrono::steady_clock::now() < end) {
    for (int fd : fds)
      if (::send(fd, out.data(), out.size(), 0) != static_cast<ssize_t>(out.size()))
        throw std::runtime_error("client send");
    for (int fd : fds) {
      std::size_t got = 0;
      while (got < c.msg) {
        ssize_t n = ::recv(fd, in.data() + got, c.msg - got, 0);
        if (n <= 0) throw std::runtime_error("client recv");
        got += static_cast<std::size_t>(n);
      }
    }
    trips += fds.size();
  }
  for (int fd : fds) ::close(fd);
  return trips;
}

// The Asio server (plain and driven): accepts `conns`, echoes until EOF.
net::awaitable<void> asio_session(tcp::socket s) {
  char buf[4096];
  for (;;) {
    boost::system::error_code ec;
    std::size_t n = co_await s.async_read_some(net::buffer(buf), net::redirect_error(net::use_awaitable, ec));
    if (ec) co_return;
    co_await net::async_write(s, net::buffer(buf, n), net::redirect_error(net::use_awaitable, ec));
    if (ec) co_return;
  }
}
net::awaitable<void> asio_listener(tcp::acceptor acc, int conns) {
  for (int i = 0; i < conns; ++i) {
    tcp::socket s = co_await acc.async_accept(net::use_awaitable);
    s.set_option(tcp::no_delay(true));
    net::co_spawn(acc.get_executor(), asio_session(std::move(s)), net::detached);
  }
}

// The same on shuttle's executor, with shuttle sockets.
net::awaitable<void> own_session(shuttle::tcp_socket s) {
  std::byte buf[4096];
  for (;;) {
    boost::system::error_code ec;
    std::size_t n = co_await sa::async_read_some(s, buf, net::redirect_error(net::use_awaitable, ec));
    if (ec || n == 0) co_return;
    std::size_t done = 0;
    while (done < n) {
      done += co_await sa::async_write_some(s, std::span<const std::byte>(buf + done, n - done),
                                            net::redirect_error(net::use_awaitable, ec));
      if (ec) co_return;
    }
  }
}
net::awaitable<void> own_listener(shuttle::tcp_listener l, int conns) {
  for (int i = 0; i < conns; ++i) {
    shuttle::tcp_socket s = co_await sa::async_accept(l, net::use_awaitable);
    (void)s.set_nodelay(true);
    net::co_spawn(co_await net::this_coro::executor, own_session(std::move(s)), net::detached);
  }
}

enum class mode { plain, driven, own };
std::uint64_t last_trips = 0;  // of the last run_once
const char* name(mode m) { return m == mode::plain ? "plain io_context" : m == mode::driven ? "driven io_context" : "shuttle::asio::context"; }

double run_once(mode m, const config& c) {
  std::uint64_t trips = 0;
  std::thread cl;
  auto start_client = [&](std::uint16_t port) { cl = std::thread([&, port] { trips = client(port, c); }); };
  auto t0 = std::chrono::steady_clock::now();
  if (m == mode::own) {
    shuttle::io_context loop;
    sa::context ctx(loop);
    auto l = shuttle::tcp_listener::bind(shuttle::endpoint::loopback(0)).value();
    std::uint16_t port = l.local_endpoint().value().port();
    net::co_spawn(ctx.get_executor(), own_listener(std::move(l), c.conns), net::detached);
    start_client(port);
    ctx.run();
  } else {
    net::io_context actx(1);
    tcp::acceptor acc(actx, {net::ip::make_address("127.0.0.1"), 0});
    std::uint16_t port = acc.local_endpoint().port();
    net::co_spawn(actx, asio_listener(std::move(acc), c.conns), net::detached);
    start_client(port);
    if (m == mode::plain) {
      actx.run();
    } else {
      shuttle::io_context loop;
      sa::asio_driver drive(loop, actx);
      drive.run();
    }
  }
  cl.join();
  last_trips = trips;
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(trips) / secs;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  if (argc > 1) c.seconds = std::atof(argv[1]);
  if (argc > 2) c.rounds = std::atoi(argv[2]);
  if (argc > 3) c.conns = std::atoi(argv[3]);
  if (argc > 4) c.msg = static_cast<std::size_t>(std::atol(argv[4]));
  if (argc > 5) c.only = argv[5];
  if (c.seconds <= 0 || c.rounds <= 0 || c.conns <= 0 || c.msg == 0 || c.msg > 4096 ||
      (c.only != "all" && c.only != "plain" && c.only != "driven" && c.only != "own")) {
    std::fprintf(stderr, "usage: asio_echo_ratio [seconds>0] [rounds>0] [conns>0] [msg 1..4096] [all|plain|driven|own]\n");
    return 2;
  }
  std::printf("echo: %d connections, %zu-byte messages, %.1f s per run, %d rounds (modes interleaved)\n", c.conns,
              c.msg, c.seconds, c.rounds);
  const mode modes[] = {mode::plain, mode::driven, mode::own};
  const char* keys[] = {"plain", "driven", "own"};
  std::vector<double> rates[3];
  if (c.only != "all") {
    for (int i = 0; i < 3; ++i) {
      if (c.only != keys[i]) continue;
      for (int r = 0; r < c.rounds; ++r) {
        double rate = run_once(modes[i], c);
        std::printf("  round %d %-24s %10.0f round trips/s, %llu round trips\n", r + 1, name(modes[i]), rate,
                    static_cast<unsigned long long>(last_trips));
      }
    }
    return 0;
  }
  for (int r = 0; r < c.rounds; ++r) {
    for (int i = 0; i < 3; ++i) {
      double rate = run_once(modes[i], c);
      rates[i].push_back(rate);
      std::printf("  round %d %-24s %10.0f round trips/s\n", r + 1, name(modes[i]), rate);
      std::fflush(stdout);
    }
  }
  double base = median(rates[0]);
  for (int i = 0; i < 3; ++i) {
    auto [lo, hi] = std::minmax_element(rates[i].begin(), rates[i].end());
    std::printf("%-24s median %10.0f /s  spread %10.0f-%-10.0f  ratio %.3fx (min-max ratio %.3f-%.3f)\n",
                name(modes[i]), median(rates[i]), *lo, *hi, median(rates[i]) / base, *lo / base, *hi / base);
  }
  return 0;
}
