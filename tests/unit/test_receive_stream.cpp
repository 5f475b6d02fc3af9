#include <doctest/doctest.h>

#include <shuttle/shuttle.hpp>

#include <numeric>

using namespace shuttle;
using namespace std::chrono_literals;

namespace {
struct socket_pair {
  tcp_socket client, server;
};

task<socket_pair> connected_pair(tcp_listener& l) {
  auto ep = l.local_endpoint().value();
  auto [c, s] = co_await when_all(tcp_socket::connect(ep), as_task(l.accept()));
  co_return socket_pair{std::move(c).value(), std::move(s).value()};
}
}  // namespace

TEST_CASE("buffer_ring rejects a count that is not a power of two") {
  io_context ctx;
  CHECK_THROWS_AS(buffer_ring(ctx, 3, 4096), std::invalid_argument);
}

TEST_CASE("receive_stream: data in order, then EOF") {
  bool registered = false;
  SUBCASE("socket named by its fd") {}
  SUBCASE("socket named by a registered-file slot") { registered = true; }
  io_context ctx;
  buffer_ring ring(ctx, 8, 1024);
  auto l = tcp_listener::bind(endpoint::loopback(0)).value();
  ctx.run([&]() -> task<void> {
    auto p = co_await connected_pair(l);
    if (registered) {
      REQUIRE(p.server.register_file().has_value());
      REQUIRE(p.server.is_registered());
    }
    std::vector<std::uint8_t> src(100000);
    std::iota(src.begin(), src.end(), 0);
    auto writer = [&]() -> task<void> {
      REQUIRE((co_await p.client.write_all(std::as_bytes(std::span(src)))).has_value());
      REQUIRE(p.client.shutdown(SHUT_WR).has_value());
    };
    auto reader = [&]() -> task<std::vector<std::uint8_t>> {
      receive_stream rx(p.server, ring);
      std::vector<std::uint8_t> got;
      for (;;) {
        auto b = co_await rx.next();
        REQUIRE(b.has_value());
        if (b->empty()) break;
        CHECK(b->size() <= 1024);
        auto d = b->data();
        for (auto x : d) got.push_back(std::to_integer<std::uint8_t>(x));
      }
      // At EOF it stays at EOF.
      auto again = co_await rx.next();
      CHECK((again.has_value() && again->empty()));
      co_return got;
    };
    auto [_, got] = co_await when_all(writer(), reader());
    CHECK(got == src);
  }());
}

TEST_CASE("receive_stream: a dry ring restarts when buffers come back") {
  io_context ctx;
  buffer_ring ring(ctx, 2, 512);  // far fewer buffers than the data needs
  auto l = tcp_listener::bind(endpoint::loopback(0)).value();
  ctx.run([&]() -> task<void> {
    auto p = co_await connected_pair(l);
    std::vector<std::byte> src(64 * 1024, std::byte{7});
    auto writer = [&]() -> task<void> {
      REQUIRE((co_await p.client.write_all(src)).has_value());
      p.client.close();
    };
    auto reader = [&]() -> task<std::size_t> {
      receive_stream rx(p.server, ring);
      std::size_t total = 0;
      for (;;) {
        auto b = co_await rx.next();
        REQUIRE(b.has_value());
        if (b->empty()) break;
        total += b->size();
        (void)co_await sleep_for(100us);  // hold the buffer a while: the ring runs dry
      }
      co_return total;
    };
    auto [_, total] = co_await when_all(writer(), reader());
    CHECK(total == src.size());
  }());
}

TEST_CASE("receive_stream: a cancelled next() leaves the stream usable") {
  io_context ctx;
  buffer_ring ring(ctx, 4, 256);
  auto l = tcp_listener::bind(endpoint::loopback(0)).value();
  ctx.run([&]() -> task<void> {
    auto p = co_await connected_pair(l);
    receive_stream rx(p.server, ring);
    auto r = co_await with_timeout(as_task(rx.next()), 5ms);
    CHECK(r.error() == std::errc::timed_out);
    std::byte one[1] = {std::byte{42}};
    REQUIRE((co_await p.client.write_all(one)).has_value());
    auto b = co_await rx.next();
    REQUIRE(b.has_value());
    REQUIRE(b->size() == 1);
    CHECK(b->data()[0] == std::byte{42});
  }());
}

TEST_CASE("receive_stream: destroyed while armed, freed when the loop ends") {
  io_context ctx;
  buffer_ring ring(ctx, 4, 256);
  auto l = tcp_listener::bind(endpoint::loopback(0)).value();
  ctx.run([&]() -> task<void> {
    auto p = co_await connected_pair(l);
    {
      receive_stream rx(p.server, ring);
      auto r = co_await with_timeout(as_task(rx.next()), 1ms);
      CHECK(r.error() == std::errc::timed_out);
    }  // armed request cancelled; its state goes with its last CQE or the context
  }());
}
