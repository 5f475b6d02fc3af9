#include <doctest/doctest.h>

#include <shuttle/shuttle.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <numeric>

using namespace shuttle;
using namespace std::chrono_literals;

namespace {
std::span<const std::byte> bytes(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

struct pair_of_sockets {
  tcp_socket client, server;
};

task<pair_of_sockets> connected_pair() {
  auto l = tcp_listener::bind(endpoint::loopback(0)).value();
  auto ep = l.local_endpoint().value();
  auto [c, s] = co_await when_all(tcp_socket::connect(ep), [&]() -> task<result<tcp_socket>> {
    co_return co_await l.accept();
  }());
  co_return pair_of_sockets{std::move(c).value(), std::move(s).value()};
}

// Reads exactly want.size() bytes from `s` and checks they are `want`.
task<void> expect_bytes(tcp_socket& s, std::string want) {
  std::string got(want.size(), '\0');
  REQUIRE((co_await s.read_exact(std::as_writable_bytes(std::span(got.data(), got.size())))).has_value());
  CHECK(got == want);
}
}  // namespace

TEST_CASE("endpoint parsing") {
  CHECK(endpoint::parse("127.0.0.1:80").value().to_string() == "127.0.0.1:80");
  CHECK(endpoint::parse("[::1]:8080").value().to_string() == "[::1]:8080");
  CHECK(endpoint::parse("[::1]:8080").value().port() == 8080);
  CHECK_FALSE(endpoint::parse("127.0.0.1"));
  CHECK_FALSE(endpoint::parse("127.0.0.1:99999"));
  CHECK_FALSE(endpoint::parse("nonsense:1"));
  CHECK_FALSE(endpoint::parse("[::1:80"));
  CHECK(endpoint::resolve("localhost", 5).value().port() == 5);
}

TEST_CASE("tcp: connect, echo both ways, read_exact, writev") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    REQUIRE((co_await p.client.write_all(bytes("hello shuttle"))).has_value());
    co_await expect_bytes(p.server, "hello shuttle");

    std::string a = "abc", b = "defgh";
    iovec iov[2] = {{a.data(), a.size()}, {b.data(), b.size()}};
    REQUIRE((co_await p.server.writev_all(iov)).has_value());
    char out1[4] = {}, out2[4] = {};
    iovec riov[2] = {{out1, 4}, {out2, 4}};
    std::size_t total = 0;
    while (total < 8) {
      auto n = co_await p.client.readv(std::span<const iovec>(riov, 2));
      REQUIRE(n.has_value());
      REQUIRE(*n > 0);
      total += *n;
      // Only one readv is expected on loopback; advance if it was split.
      if (total < 8) {
        std::size_t off = total;
        if (off < 4) {
          riov[0] = {out1 + off, 4 - off};
        } else {
          riov[0] = {out2 + (off - 4), 8 - off};
          riov[1] = {nullptr, 0};
        }
      }
    }
    CHECK(std::string(out1, 4) + std::string(out2, 4) == "abcdefgh");
  }());
}

TEST_CASE("tcp: large transfer with data verified") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    std::vector<std::uint32_t> src(4 << 20);
    std::iota(src.begin(), src.end(), 7u);
    std::vector<std::uint32_t> dst(src.size());
    auto [w, r] = co_await when_all(p.client.write_all(std::as_bytes(std::span(src))),
                                    p.server.read_exact(std::as_writable_bytes(std::span(dst))));
    CHECK(w.has_value());
    CHECK(r.has_value());
    CHECK(src == dst);
  }());
}

TEST_CASE("tcp: half-close delivers EOF after the data; the other direction still works") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    REQUIRE((co_await p.client.write_all(bytes("last"))).has_value());
    REQUIRE(p.client.shutdown(SHUT_WR).has_value());
    std::byte buf[16];
    auto r = co_await p.server.read_exact(std::span(buf, 4));
    CHECK(r.has_value());
    auto n = co_await p.server.read_some(buf);
    REQUIRE(n.has_value());
    CHECK(*n == 0);
    auto e = co_await p.server.read_exact(std::span(buf, 1));
    CHECK(e.error() == errc::eof);
    REQUIRE((co_await p.server.write_all(bytes("back"))).has_value());
    CHECK((co_await p.client.read_exact(std::span(buf, 4))).has_value());
  }());
}

TEST_CASE("tcp: peer reset fails pending reads and later writes") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    std::byte buf[16];
    auto reader = [&]() -> task<result<std::size_t>> { co_return co_await p.server.read_some(buf); };
    auto killer = [&]() -> task<void> {
      (void)co_await sleep_for(2ms);
      REQUIRE(p.client.set_linger(true, 0).has_value());
      p.client.close();  // RST
    };
    auto [r, _] = co_await when_all(reader(), killer());
    CHECK(r.error() == std::errc::connection_reset);
    std::vector<std::byte> big(1 << 20);
    auto w = co_await p.server.write_all(big);
    CHECK_FALSE(w.has_value());
  }());
}

TEST_CASE("tcp: refused connect") {
  io_context ctx;
  // Bind then close to get a port nobody listens on.
  std::uint16_t port;
  {
    auto l = tcp_listener::bind(endpoint::loopback(0)).value();
    port = l.local_endpoint().value().port();
  }
  auto r = ctx.run(tcp_socket::connect(endpoint::loopback(port)));
  CHECK(r.error() == std::errc::connection_refused);
}

TEST_CASE("tcp: connect timeout") {
  io_context ctx;
  // A listener whose backlog is full never answers the SYN of the next one.
  auto l = tcp_listener::bind(endpoint::loopback(0), {.backlog = 0}).value();
  auto ep = l.local_endpoint().value();
  auto r = ctx.run([&]() -> task<result<void>> {
    std::vector<tcp_socket> held;
    for (int i = 0; i < 8; ++i) {
      auto c = co_await tcp_socket::connect(ep, 200ms);
      if (!c) co_return c.error();
      held.push_back(std::move(*c));
    }
    co_return std::make_error_code(std::errc::io_error);
  }());
  CHECK(r.error() == std::errc::timed_out);
  // The TCP connect's own timeout, not with_timeout's (nor a handshake's).
  CHECK(r.error() == std::make_error_code(std::errc::timed_out));
}

TEST_CASE("tcp: a cancelled read resumes only after the kernel let go of the buffer") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    std::byte buf[64];
    auto r = co_await with_timeout([&]() -> task<result<std::size_t>> { co_return co_await p.server.read_some(buf); }(),
                                   5ms);
    CHECK(r.error() == std::errc::timed_out);
    // The connection is still usable: the cancelled recv consumed nothing.
    REQUIRE((co_await p.client.write_all(bytes("x"))).has_value());
    auto n = co_await p.server.read_some(buf);
    CHECK(n.value() == 1);
  }());
}

namespace {
// What a blocking recv on `fd` sees within 2 s: bytes, 0 at EOF, -errno
// (EAGAIN: nothing came, the peer's socket is still open).
ssize_t blocking_recv(int fd) {
  timeval tv{2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char b[16];
  ssize_t n;
  // EINTR: ring teardown interrupts this thread's blocking calls (task work, no signal).
  do n = ::recv(fd, b, sizeof b, 0);
  while (n < 0 && errno == EINTR);
  return n < 0 ? -errno : n;
}
bool fd_is_open(int fd) { return fcntl(fd, F_GETFD) >= 0; }
}  // namespace

TEST_CASE("tcp: registered sockets carry data both ways; close leaves the slot, so the peer sees EOF") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    REQUIRE(p.client.register_file().has_value());
    REQUIRE(p.server.register_file().has_value());
    CHECK(p.server.register_file().has_value());  // again on the same context: nothing changes
    CHECK(p.client.is_registered());
    CHECK(p.client.file_for(io_context::current()).fixed);

    REQUIRE((co_await p.client.write_all(bytes("registered hello"))).has_value());
    co_await expect_bytes(p.server, "registered hello");
    std::string a = "abc", b = "defgh";
    iovec iov[2] = {{a.data(), a.size()}, {b.data(), b.size()}};
    REQUIRE((co_await p.server.writev_all(iov)).has_value());
    co_await expect_bytes(p.client, "abcdefgh");

    // The slot holds a reference to the file: without leaving it, close()
    // would not close the connection and this read would time out.
    p.client.close();
    CHECK_FALSE(p.client.is_registered());
    std::byte buf[8];
    auto n = co_await with_timeout(
        [&]() -> task<result<std::size_t>> { co_return co_await p.server.read_some(buf); }(), 2s);
    REQUIRE(n.has_value());
    CHECK(*n == 0);

    // release() leaves the slot too and hands over a working fd.
    int fd = p.server.release();
    CHECK_FALSE(p.server.is_registered());
    CHECK(fd_is_open(fd));
    CHECK(::write(fd, "x", 1) == 1);
    ::close(fd);
  }());
}

TEST_CASE("tcp: a full registered-file table leaves sockets on their fds; a freed slot is reused") {
  io_context::options opts;
  opts.registered_files = 1;
  io_context ctx(opts);
  ctx.run([]() -> task<void> {
    auto p = co_await connected_pair();
    REQUIRE(p.client.register_file().has_value());
    auto full = p.server.register_file();
    REQUIRE_FALSE(full.has_value());
    CHECK(full.error() == std::errc::too_many_files_open_in_system);  // ENFILE
    CHECK_FALSE(p.server.is_registered());
    CHECK_FALSE(p.server.file_for(io_context::current()).fixed);
    REQUIRE((co_await p.server.write_all(bytes("ok"))).has_value());  // by fd
    std::byte two[2];
    REQUIRE((co_await p.client.read_exact(two)).has_value());  // by slot

    p.client.close();
    REQUIRE(p.server.register_file().has_value());  // the slot came back
    std::byte buf[8];
    auto n = co_await with_timeout(
        [&]() -> task<result<std::size_t>> { co_return co_await p.server.read_some(buf); }(), 2s);
    CHECK(n.value() == 0);
  }());
}

TEST_CASE("tcp: a registered socket that outlives its context closes its fd") {
  pair_of_sockets p;
  {
    io_context ctx;
    p = ctx.run([]() -> task<pair_of_sockets> {
      auto q = co_await connected_pair();
      REQUIRE(q.server.register_file().has_value());
      co_return std::move(q);
    }());
  }
  CHECK(p.server.is_registered());  // its table is gone with the ring
  int fd = p.server.native_handle();
  p.server.close();
  CHECK_FALSE(fd_is_open(fd));
  CHECK(blocking_recv(p.client.native_handle()) == 0);
}

TEST_CASE("tcp: closing a registered socket on another thread hands the close to its loop") {
  runtime rt(1);
  pair_of_sockets p = rt.block_on(0, []() -> task<pair_of_sockets> {
    auto q = co_await connected_pair();
    REQUIRE(q.server.register_file().has_value());
    co_return std::move(q);
  }());
  REQUIRE(p.server.is_registered());
  p.server.close();  // on this thread: thread 0's loop empties the slot, then closes the fd
  CHECK_FALSE(p.server.is_registered());
  CHECK(blocking_recv(p.client.native_handle()) == 0);
}

TEST_CASE("tcp: 10,000-connection churn without fd growth") {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  io_context ctx;
  auto count_fds = [] {
    int n = 0;
    for (int fd = 0; fd < 65536; ++fd)
      if (fcntl(fd, F_GETFD) >= 0) ++n;
    return n;
  };
  int before = count_fds();
  ctx.run([]() -> task<void> {
    auto l = tcp_listener::bind(endpoint::loopback(0)).value();
    auto ep = l.local_endpoint().value();
    async_scope server;
    int served = 0;
    auto acceptor = [&]() -> task<void> {
      for (;;) {
        auto s = co_await l.accept();
        if (!s) co_return;
        server.spawn([](tcp_socket s, int& served) -> task<void> {
          std::byte b[8];
          if ((co_await s.read_exact(b)).has_value() && (co_await s.write_all(b)).has_value()) ++served;
        }(std::move(*s), served));
      }
    };
    server.spawn(acceptor());
    int ok = 0;
    for (int batch = 0; batch < 100; ++batch) {
      std::vector<task<bool>> clients;
      for (int i = 0; i < 100; ++i)
        clients.push_back([](endpoint ep) -> task<bool> {
          auto c = co_await tcp_socket::connect(ep, 5s);
          if (!c) co_return false;
          std::byte b[8] = {};
          if (!(co_await c->write_all(b))) co_return false;
          co_return (co_await c->read_exact(b)).has_value();
        }(ep));
      for (bool b : co_await when_all(std::move(clients))) ok += b;
    }
    CHECK(ok == 10000);
    server.request_stop();
    co_await server.join();
    CHECK(served == 10000);
  }());
  CHECK(count_fds() == before);
}
