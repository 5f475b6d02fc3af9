// The tcp provider's listener against hostile peers (issue 27: points 4, 6,
// 8): handshakes run concurrently with their own deadline and a cap, idle
// connections hold no receive buffer, the connection cap and idle timeout
// hold, and rkeys are not predictable. The hostile peers are raw sockets.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "stats.hpp"
#include "wire.hpp"

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;
namespace wire = shuttle::tcp_wire;

namespace {

constexpr auto deadline = 30s;  // every wait of these tests; a hang fails here

domain tcp_domain() {
  domain_options o;
  o.kind = transport_kind::tcp;
  return domain::open(o).value();
}

// A raw TCP peer: a plain blocking connect on loopback (the kernel completes
// it without the server's loop), then only non-blocking reads.
struct raw_peer {
  int fd = -1;
  explicit raw_peer(std::uint16_t port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  raw_peer(raw_peer&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  ~raw_peer() { close(); }
  void close() {
    if (fd >= 0) ::close(std::exchange(fd, -1));
  }
  void send_bytes(std::span<const std::byte> b) const {
    REQUIRE(::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size()));
  }
  void send_hello() const {
    std::array<std::byte, wire::hello_size> h{};
    wire::hello mine;
    mine.receive_buffers = 16;
    mine.receive_buffer_size = 65536;
    wire::encode_hello(mine, h);
    send_bytes(h);
  }
};

// What a raw peer reads until it has `want` bytes or the connection ends:
// the bytes, and whether it saw EOF (or a reset). Polls the socket between
// loop turns, so the server keeps running.
struct read_outcome {
  std::size_t bytes = 0;
  bool ended = false;
};
task<read_outcome> read_until(const raw_peer& p, std::size_t want, bool until_end) {
  read_outcome o;
  auto stop = clock::now() + deadline;
  std::array<std::byte, 4096> buf{};
  while (clock::now() < stop) {
    ssize_t n = ::recv(p.fd, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n > 0) {
      o.bytes += static_cast<std::size_t>(n);
      if (!until_end && o.bytes >= want) co_return o;
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      o.ended = true;
      co_return o;
    }
    (void)co_await sleep_for(2ms);
  }
  FAIL("a raw peer waited " << deadline.count() << " s for " << std::string(until_end ? "the end" : "bytes"));
  co_return o;
}

// True when nothing more is there to read and the connection has not ended.
bool still_pending(const raw_peer& p) {
  std::byte b{};
  ssize_t n = ::recv(p.fd, &b, 1, MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

task<void> nothing() { co_return; }

// A client connects (retrying while the server refuses it), sends a message
// the server echoes, and checks the echo. The server's accept() waits from
// the start, so the listener takes peers from the kernel meanwhile; `before`
// runs first on the client's side (hostile peers come and go there).
task<void> good_client_round_trip(listener& l, std::uint16_t port, bool retry, task<void> before = nothing()) {
  domain cd = tcp_domain();
  connection_options co;
  co.connect_timeout = 120s;  // the old, serialized accept served it late rather than never
  auto server_side = [&]() -> task<result<connection>> {
    auto c = co_await with_timeout(l.accept(), deadline);
    if (!c) co_return c.error();
    auto m = co_await with_timeout(c->recv(), deadline);
    if (!m) co_return m.error();
    std::vector<std::byte> copy(m->data().begin(), m->data().end());
    m->reset();
    if (auto r = co_await with_timeout(c->send(copy), deadline); !r) co_return r.error();
    co_return std::move(*c);
  };
  auto client_side = [&]() -> task<result<void>> {
    co_await std::move(before);
    auto stop = clock::now() + deadline;
    result<connection> c = std::make_error_code(std::errc::timed_out);
    do {
      c = co_await cd.connect(endpoint::loopback(port), co);
      if (c || !retry) break;
      (void)co_await sleep_for(10ms);
    } while (clock::now() < stop);
    if (!c) co_return c.error();
    std::array<std::byte, 100> msg{};
    for (std::size_t i = 0; i < msg.size(); ++i) msg[i] = std::byte(i * 7);
    if (auto r = co_await c->send(msg); !r) co_return r.error();
    auto m = co_await with_timeout(c->recv(), deadline);
    if (!m) co_return m.error();
    if (!std::equal(msg.begin(), msg.end(), m->data().begin(), m->data().end()))
      co_return std::make_error_code(std::errc::bad_message);
    m->reset();
    (void)co_await c->close();
    co_return result<void>{};
  };
  // Not a structured binding: clang 14 cannot capture one in doctest's lambdas.
  auto both = co_await when_all(server_side(), client_side());
  auto& s = std::get<0>(both);
  auto& c = std::get<1>(both);
  REQUIRE_MESSAGE(c.has_value(), "client: " << c.error().message());
  REQUIRE_MESSAGE(s.has_value(), "server: " << s.error().message());
  (void)co_await s->close();
}

// Until what dropped connections and listeners wind down has ended (it
// holds the loop: io_context::hold), so that their buffers are counted out.
task<void> wound_down() {
  while (io_context::current().holds() > 0) co_await yield();
}

long rss_kib() {
  std::ifstream f("/proc/self/statm");
  long size = 0, resident = 0;
  f >> size >> resident;
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

}  // namespace

TEST_CASE("silent peers do not delay a good client: handshakes run concurrently") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    listener_options lim;
    lim.handshake_timeout = 60s;  // far longer than the test: the silent peers stay pending
    listener l = d.listen(endpoint::loopback(0), {}, lim).value();
    const std::uint16_t port = l.local_endpoint()->port();
    std::vector<raw_peer> silent;
    for (int i = 0; i < 5; ++i) silent.emplace_back(port);
    co_await good_client_round_trip(l, port, false);
    // Ordering, not timing: the good client was served while every silent
    // peer is still in its handshake (it has the server's hello, no EOF).
    for (auto& p : silent) {
      auto o = co_await read_until(p, wire::hello_size, false);
      CHECK(o.bytes == wire::hello_size);
      CHECK_FALSE(o.ended);
      CHECK(still_pending(p));
    }
    l.close();
    // Closing the listener ends the handshakes in progress.
    for (auto& p : silent) CHECK((co_await read_until(p, 0, true)).ended);
  }());
}

TEST_CASE("max_handshakes: a peer past the cap waits in the kernel's backlog; a good client gets in when one frees") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    listener_options lim;
    lim.max_handshakes = 2;
    lim.handshake_timeout = 60s;
    listener l = d.listen(endpoint::loopback(0), {}, lim).value();
    const std::uint16_t port = l.local_endpoint()->port();
    raw_peer a(port), b(port);
    auto hostile = [](raw_peer& a, raw_peer& b, std::uint16_t port) -> task<void> {
      CHECK((co_await read_until(a, wire::hello_size, false)).bytes == wire::hello_size);
      CHECK((co_await read_until(b, wire::hello_size, false)).bytes == wire::hello_size);
      // Both handshake slots are taken: the next peer is neither closed nor
      // answered; it waits in the kernel's backlog.
      raw_peer waiting(port);
      for (int turn = 0; turn < 50; ++turn) (void)co_await sleep_for(4ms);
      CHECK(still_pending(waiting));
      waiting.close();  // it gives up; the listener later takes and drops it
      // One silent peer leaves: its slot frees, and the good client gets through.
      a.close();
    };
    co_await good_client_round_trip(l, port, true, hostile(a, b, port));
    CHECK(still_pending(b));
    l.close();
    CHECK((co_await read_until(b, 0, true)).ended);
  }());
}

TEST_CASE("a burst past max_handshakes and accept_backlog is served in turn, none refused or dropped") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    std::vector<std::string> told;
    listener_options lim;
    lim.max_handshakes = 4;
    lim.accept_backlog = 2;
    lim.on_refused = [&told](const endpoint&, std::string_view why) { told.emplace_back(why); };
    listener l = d.listen(endpoint::loopback(0), {}, lim).value();
    const std::uint16_t port = l.local_endpoint()->port();
    constexpr std::size_t n = 40;
    std::vector<raw_peer> peers;
    for (std::size_t i = 0; i < n; ++i) {
      peers.emplace_back(port);
      peers.back().send_hello();
    }
    std::vector<connection> accepted;
    for (std::size_t i = 0; i < n; ++i) {
      auto c = co_await with_timeout(l.accept(), deadline);
      REQUIRE_MESSAGE(c.has_value(), "accept " << i << ": " << c.error().message());
      accepted.push_back(std::move(*c));
      // A slow application: the next accept() comes a few loop turns later,
      // while the handshakes in progress finish into the backlog.
      for (int turn = 0; turn < 3; ++turn) (void)co_await sleep_for(1ms);
    }
    for (auto& p : peers) {
      // The server's hello, and its first frame: it reads WRITE_LIST (an ACK of seq 0, wire.hpp).
      CHECK((co_await read_until(p, wire::hello_size + wire::header_size, false)).bytes ==
            wire::hello_size + wire::header_size);
      CHECK(still_pending(p));  // answered and kept, not closed after its handshake
    }
    CHECK(told.empty());
    accepted.clear();
    l.close();
  }());
}

TEST_CASE("on_refused tells the application of each peer refused or dropped before accept, and why") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    std::vector<std::pair<std::uint16_t, std::string>> told;
    listener_options lim;
    lim.max_connections = 1;  // a handshake in progress counts
    lim.handshake_timeout = 60s;
    lim.on_refused = [&told](const endpoint& peer, std::string_view why) {
      told.emplace_back(peer.port(), std::string(why));
    };
    listener l = d.listen(endpoint::loopback(0), {}, lim).value();
    const std::uint16_t port = l.local_endpoint()->port();
    raw_peer bad(port);
    auto hostile = [&told](raw_peer& bad, std::uint16_t port) -> task<void> {
      CHECK((co_await read_until(bad, wire::hello_size, false)).bytes == wire::hello_size);
      raw_peer capped(port);  // the only connection allowed is in its handshake
      CHECK((co_await read_until(capped, 0, true)).ended);
      REQUIRE(told.size() == 1);
      CHECK(told[0].second.find("connection cap") != std::string::npos);
      std::array<std::byte, wire::hello_size> junk{};
      junk.fill(std::byte{0x47});
      bad.send_bytes(junk);  // not a hello: the handshake fails, and the slot frees
      CHECK((co_await read_until(bad, 0, true)).ended);
      REQUIRE(told.size() == 2);
      CHECK(told[1].second.find("handshake failed") != std::string::npos);
      CHECK(told[1].first != 0);  // the peer's address is known
    };
    co_await good_client_round_trip(l, port, true, hostile(bad, port));
    CHECK(told.size() == 2);  // the good client is not reported
    l.close();
  }());
}

TEST_CASE("idle connections hold no receive buffer (under 100 KiB each)") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    listener_options lim;
    lim.max_handshakes = 1024;  // the peers below arrive in one burst
    lim.accept_backlog = 1024;
    connection_options opts;
    opts.receive_buffers = 16;
    opts.receive_buffer_size = 65536;
    listener l = d.listen(endpoint::loopback(0), opts, lim).value();
    const std::uint16_t port = l.local_endpoint()->port();
    constexpr std::size_t n = 300;
    // A first connection warms up the loop's and the allocator's own state.
    co_await good_client_round_trip(l, port, false);
    co_await wound_down();
    const std::size_t buffers_before = detail::tcp_receive_buffer_bytes();
    const long rss_before = rss_kib();
    std::vector<raw_peer> peers;
    std::vector<connection> accepted;
    for (std::size_t i = 0; i < n; ++i) {
      peers.emplace_back(port);
      peers.back().send_hello();
    }
    for (std::size_t i = 0; i < n; ++i) {
      auto c = co_await with_timeout(l.accept(), deadline);
      REQUIRE_MESSAGE(c.has_value(), "accept " << i << ": " << c.error().message());
      accepted.push_back(std::move(*c));
    }
    for (auto& p : peers)  // the hello and the WRITE_LIST announcement (wire.hpp)
      CHECK((co_await read_until(p, wire::hello_size + wire::header_size, false)).bytes ==
            wire::hello_size + wire::header_size);
    const std::size_t buffer_bytes = detail::tcp_receive_buffer_bytes() - buffers_before;
    const long rss_growth = rss_kib() - rss_before;
    std::printf("%zu idle tcp-provider connections: %zu bytes of receive buffers (%zu per connection); "
                "server RSS grew %ld KiB (%.1f KiB per connection)\n",
                n, buffer_bytes, buffer_bytes / n, rss_growth, double(rss_growth) / n);
    CHECK(buffer_bytes / n < 100 * 1024);
    CHECK(buffer_bytes == 0);
    // A message allocates its slot's buffer, and only that one.
    wire::header h;
    h.op = wire::opcode::send;
    h.seq = 1;
    h.length = 10;
    std::array<std::byte, wire::header_size + 10> frame{};
    wire::encode_header(h, std::span<std::byte, wire::header_size>(frame.data(), wire::header_size));
    peers[7].send_bytes(frame);
    auto m = co_await with_timeout(accepted[7].recv(), deadline);
    REQUIRE(m.has_value());
    CHECK(m->size() == 10);
    CHECK(detail::tcp_receive_buffer_bytes() - buffers_before == opts.receive_buffer_size);
    m->reset();
    accepted.clear();
    l.close();
    co_await wound_down();
    CHECK(detail::tcp_receive_buffer_bytes() == buffers_before);
  }());
}

TEST_CASE("max_connections: a peer past the cap is closed at once; one more gets in when one ends") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    listener_options lim;
    lim.max_connections = 2;
    listener l = d.listen(endpoint::loopback(0), {}, lim).value();
    const std::uint16_t port = l.local_endpoint()->port();
    raw_peer p1(port), p2(port);
    p1.send_hello();
    p2.send_hello();
    auto c1 = co_await with_timeout(l.accept(), deadline);
    auto c2 = co_await with_timeout(l.accept(), deadline);
    REQUIRE(c1.has_value());
    REQUIRE(c2.has_value());
    auto hostile = [](raw_peer& p1, std::uint16_t port) -> task<void> {
      raw_peer refused(port);
      auto o = co_await read_until(refused, 0, true);
      CHECK(o.ended);
      CHECK(o.bytes == 0);
      // A connection ends (its peer goes): the good client gets in.
      p1.close();
    };
    co_await good_client_round_trip(l, port, true, hostile(p1, port));
    (void)co_await c1->close();
    (void)co_await c2->close();
    l.close();
  }());
}

TEST_CASE("idle_timeout: a silent connection fails with errc::idle_timeout, a busy one and an unlimited one do not") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    listener_options lim;
    lim.idle_timeout = 3s;
    listener l = d.listen(endpoint::loopback(0), {}, lim).value();
    listener unlimited = d.listen(endpoint::loopback(0), {}, {}).value();
    domain cd = tcp_domain();
    auto idle_pair = co_await when_all(with_timeout(l.accept(), deadline),
                                       cd.connect(endpoint::loopback(l.local_endpoint()->port())));
    auto busy_pair = co_await when_all(with_timeout(l.accept(), deadline),
                                       cd.connect(endpoint::loopback(l.local_endpoint()->port())));
    auto free_pair = co_await when_all(with_timeout(unlimited.accept(), deadline),
                                       cd.connect(endpoint::loopback(unlimited.local_endpoint()->port())));
    // References, not structured bindings: clang 14 cannot capture those.
    auto& s_idle = std::get<0>(idle_pair);
    auto& c_idle = std::get<1>(idle_pair);
    auto& s_busy = std::get<0>(busy_pair);
    auto& c_busy = std::get<1>(busy_pair);
    auto& s_free = std::get<0>(free_pair);
    auto& c_free = std::get<1>(free_pair);
    REQUIRE(s_idle.has_value());
    REQUIRE(c_idle.has_value());
    REQUIRE(s_busy.has_value());
    REQUIRE(c_busy.has_value());
    REQUIRE(s_free.has_value());
    REQUIRE(c_free.has_value());
    // The busy peer sends every 50 ms for longer than the timeout.
    auto busy = [&]() -> task<void> {
      std::array<std::byte, 8> b{};
      auto until = clock::now() + 4s;
      while (clock::now() < until) {
        REQUIRE((co_await c_busy->send(b)).has_value());
        auto m = co_await with_timeout(s_busy->recv(), deadline);
        REQUIRE(m.has_value());
        (void)co_await sleep_for(50ms);
      }
    };
    auto idle = [&]() -> task<void> {
      auto r = co_await with_timeout(s_idle->recv(), deadline);
      REQUIRE_FALSE(r.has_value());
      CHECK(r.error() == make_error_code(errc::idle_timeout));
      CHECK_FALSE(s_idle->is_open());
    };
    co_await when_all(busy(), idle());
    CHECK(s_busy->is_open());
    CHECK(s_free->is_open());
    (void)co_await c_busy->close();
    (void)co_await c_free->close();
    l.close();
    unlimited.close();
  }());
}

TEST_CASE("rkeys are not predictable from the ones seen") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    domain d = tcp_domain();
    constexpr std::size_t n = 1000;
    std::vector<std::byte> mem(n + 1);
    std::vector<memory_region> regions;
    std::vector<std::uint32_t> keys;
    for (std::size_t i = 0; i < n; ++i) {
      regions.push_back(d.register_memory(std::span(mem).subspan(i, 1), access::remote_read).value());
      keys.push_back(regions.back().rkey());
    }
    CHECK(std::set<std::uint32_t>(keys.begin(), keys.end()).size() == n);
    std::size_t equal_steps = 0, old_formula = 0, affine = 0;
    for (std::size_t i = 0; i + 2 < n; ++i) {
      equal_steps += keys[i + 1] - keys[i] == keys[i + 2] - keys[i + 1];
      old_formula += keys[i + 1] == keys[i] * 2654435761u + 0x9E3779B9u;
    }
    // Any generator k' = a k + c (mod 2^32): a and c from three keys (when
    // the first step is odd, hence invertible) would predict the fourth.
    for (std::size_t i = 0; i + 3 < n; ++i) {
      std::uint32_t d0 = keys[i + 1] - keys[i], d1 = keys[i + 2] - keys[i + 1];
      if (!(d0 & 1)) continue;
      std::uint32_t inv = d0;  // Newton: inverse of an odd number mod 2^32
      for (int k = 0; k < 5; ++k) inv *= 2 - d0 * inv;
      std::uint32_t a = d1 * inv, c = keys[i + 1] - a * keys[i];
      affine += keys[i + 3] == a * keys[i + 2] + c;
    }
    CHECK(equal_steps == 0);
    CHECK(old_formula == 0);
    CHECK(affine == 0);
    co_return;
  }());
}
