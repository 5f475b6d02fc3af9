// transport_kind::automatic (issue 30, point 3): a peer on this host takes
// the local provider, an override forces the remote provider, a port
// without an automatic listener's local socket (absent, silent, or closing
// at once) falls back to it, and one registration serves a local and a
// remote peer with one remote_buffer (lib/auto_provider/README.md). The
// remote provider is tcp on the host and verbs in the Soft-RoCE guest
// (auto-verbs: SHUTTLE_TEST_ADDR names rxe0's address). The
// provider-neutral cases run on automatic in conformance-auto.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "common.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstdlib>

using namespace shuttle;
using namespace transport_test;
using namespace std::chrono_literals;

namespace {

domain_options with_kind(transport_kind k) {
  domain_options o;
  o.kind = k;
  return o;
}

// The environment these cases set themselves.
void clear_env() {
  ::unsetenv("SHUTTLE_TRANSPORT");
  ::unsetenv("SHUTTLE_AUTO_LOCAL");
}

// Accepts one connection on `l` while `d` connects to `ep`: {server side, client side}.
task<std::pair<connection, connection>> connect_pair(listener& l, domain& d, endpoint ep,
                                                     connection_options opts = {}) {
  auto [s, c] = co_await when_all(accept_within_limit(l), d.connect(ep, opts));
  REQUIRE(s.has_value());
  REQUIRE(c.has_value());
  co_return std::pair{std::move(*s), std::move(*c)};
}

// An IPv4 address of one of this host's interfaces other than loopback, if any.
std::optional<std::string> interface_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    const auto a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr;
    if ((ntohl(a.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN];
    if (::inet_ntop(AF_INET, &a, text, sizeof text)) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

// A round trip on a pair: the client sends, the server echoes.
task<void> round_trip(connection& server, connection& client) {
  auto msg = pattern(100, 7);
  REQUIRE(co_await client.send(msg));
  auto got = co_await server.recv();
  REQUIRE(got.has_value());
  CHECK(same(got->data(), msg));
  REQUIRE(co_await server.send(got->data()));
  auto back = co_await client.recv();
  REQUIRE(back.has_value());
  CHECK(same(back->data(), msg));
}

}  // namespace

TEST_CASE("automatic: a peer on this host takes the local provider (loopback, 0.0.0.0, an interface address)") {
  clear_env();
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open().value();
    auto cd = domain::open().value();
    CHECK(sd.describe().find("auto") != std::string::npos);
    auto l = sd.listen(endpoint::any(0)).value();
    const auto port = l.local_endpoint()->port();
    auto [s, c] = co_await connect_pair(l, cd, endpoint::loopback(port));
    CHECK(c.kind() == transport_kind::local);
    CHECK(s.kind() == transport_kind::local);
    CHECK(c.remote_endpoint().to_string() == endpoint::loopback(port).to_string());
    co_await round_trip(s, c);
    // The unspecified address names this host too.
    auto [s2, c2] = co_await connect_pair(l, cd, endpoint::any(port));
    CHECK(c2.kind() == transport_kind::local);
    co_await round_trip(s2, c2);
    if (auto a = interface_address()) {
      CAPTURE(*a);
      auto [s3, c3] = co_await connect_pair(l, cd, endpoint::parse(*a + ":" + std::to_string(port)).value());
      CHECK(c3.kind() == transport_kind::local);
      co_await round_trip(s3, c3);
    } else {
      MESSAGE("no interface address besides loopback: that part is not run");
    }
  }());
}

TEST_CASE("automatic: an override forces the remote provider") {
  clear_env();
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open().value();
    auto l = sd.listen(test_endpoint(0)).value();
    const auto ep = test_endpoint(l.local_endpoint()->port());
    SUBCASE("transport_kind of the remote provider") {
      auto cd = domain::open(with_kind(sd.kind())).value();
      auto [s, c] = co_await connect_pair(l, cd, ep);
      CHECK(c.kind() == sd.kind());
      CHECK(s.kind() == sd.kind());
      co_await round_trip(s, c);
    }
    SUBCASE("domain_options::local_peers = false") {
      domain_options o;
      o.local_peers = false;
      auto cd = domain::open(o).value();
      auto [s, c] = co_await connect_pair(l, cd, ep);
      CHECK(c.kind() == sd.kind());  // the remote provider (tcp here, verbs with a device)
      CHECK(c.kind() != transport_kind::local);
      co_await round_trip(s, c);
    }
    SUBCASE("SHUTTLE_TRANSPORT=<the remote provider>") {
      ::setenv("SHUTTLE_TRANSPORT", to_string(sd.kind()), 1);
      auto cd = domain::open().value();
      clear_env();
      auto [s, c] = co_await connect_pair(l, cd, ep);
      CHECK(c.kind() == sd.kind());
      co_await round_trip(s, c);
    }
    SUBCASE("SHUTTLE_AUTO_LOCAL=0") {
      ::setenv("SHUTTLE_AUTO_LOCAL", "0", 1);
      auto cd = domain::open().value();
      clear_env();
      auto [s, c] = co_await connect_pair(l, cd, ep);
      CHECK(c.kind() != transport_kind::local);
      co_await round_trip(s, c);
    }
  }());
}

TEST_CASE("automatic: no automatic listener's local socket on the port falls back to the remote provider") {
  clear_env();
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto cd = domain::open().value();
    // A tcp-provider server: nothing listens on its port's local socket.
    auto td = domain::open(with_kind(cd.kind())).value();
    auto l = td.listen(test_endpoint(0)).value();
    const auto port = l.local_endpoint()->port();
    SUBCASE("absent") {
      auto [s, c] = co_await connect_pair(l, cd, test_endpoint(port));
      CHECK(c.kind() == cd.kind());
      co_await round_trip(s, c);
    }
    SUBCASE("a listener of the local provider's own on that port is not taken for it") {
      auto ld = domain::open(with_kind(transport_kind::local)).value();
      auto other = ld.listen(endpoint::loopback(port));
      REQUIRE(other.has_value());
      auto [s, c] = co_await connect_pair(l, cd, test_endpoint(port));
      CHECK(c.kind() == cd.kind());
      co_await round_trip(s, c);
    }
    SUBCASE("a socket that never accepts") {
      auto silent = tcp_listener::bind(endpoint::unix_socket("@shuttle-auto:" + std::to_string(port)).value());
      REQUIRE(silent.has_value());
      connection_options o;
      o.connect_timeout = 1000ms;  // half of it for the silent socket
      auto [s, c] = co_await connect_pair(l, cd, test_endpoint(port), o);
      CHECK(c.kind() == cd.kind());
      co_await round_trip(s, c);
    }
    SUBCASE("a socket that answers garbage and closes") {
      auto bad = tcp_listener::bind(endpoint::unix_socket("@shuttle-auto:" + std::to_string(port)).value());
      REQUIRE(bad.has_value());
      auto hostile = [](tcp_listener& b) -> task<void> {
        auto peer = co_await b.accept();
        if (!peer) co_return;
        std::array<std::byte, 64> junk{};
        junk.fill(std::byte{0x5a});
        (void)co_await peer->write_some(junk);
        peer->close();
      };
      // Bounded: a client that never tried the local socket leaves it waiting.
      auto [_, pair] = co_await when_all(with_timeout(hostile(*bad), accept_limit),
                                         connect_pair(l, cd, test_endpoint(port)));
      auto& [s, c] = pair;
      CHECK(c.kind() == cd.kind());
      co_await round_trip(s, c);
    }
  }());
}

TEST_CASE("automatic: one registration, one remote_buffer, for a local and a remote peer") {
  clear_env();
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open().value();
    auto l = sd.listen(test_endpoint(0)).value();
    const auto ep = test_endpoint(l.local_endpoint()->port());
    auto local_client = domain::open().value();
    auto remote_client = domain::open(with_kind(sd.kind())).value();
    auto [sl, cl] = co_await connect_pair(l, local_client, ep);
    auto [sr, cr] = co_await connect_pair(l, remote_client, ep);
    REQUIRE(cl.kind() == transport_kind::local);
    REQUIRE(cr.kind() == sd.kind());

    std::vector<std::byte> target(8192, std::byte{0});
    auto mr = sd.register_memory(target, access::all).value();
    const remote_buffer rb = mr.remote();
    auto a = pattern(4096, 1), b = pattern(4096, 2);
    // Sources registered for local access only (rxe issues no rkey for them:
    // the automatic domain then gives its local child a key of its own).
    auto a_mr = local_client.register_memory(a, access::local_write);
    auto b_mr = remote_client.register_memory(b, access::local_write);
    REQUIRE(a_mr.has_value());
    REQUIRE(b_mr.has_value());
    REQUIRE(co_await cl.write(a, rb.slice(0, 4096).value()));
    REQUIRE(co_await cr.write(b, rb.slice(4096, 4096).value()));
    CHECK(same(std::span(target).first(4096), a));
    CHECK(same(std::span(target).subspan(4096), b));
    std::vector<std::byte> back(4096);
    REQUIRE(co_await cl.read(back, rb.slice(4096, 4096).value()));
    CHECK(same(back, b));
    REQUIRE(co_await cr.read(back, rb.slice(0, 4096).value()));
    CHECK(same(back, a));
    auto word = rb.slice(0, 8).value();
    std::fill_n(target.begin(), 8, std::byte{0});
    auto f1 = co_await cl.fetch_and_add(word, 5);
    auto f2 = co_await cr.fetch_and_add(word, 5);
    REQUIRE(f1.has_value());
    REQUIRE(f2.has_value());
    CHECK(*f1 == 0u);
    CHECK(*f2 == 5u);

    // (A grant holds its registration: another one for grants.)
    std::vector<std::byte> gtarget(4096, std::byte{0});
    auto gmr = sd.register_memory(gtarget, access::all).value();
    // A grant on each server-side connection is the connection's provider's,
    // and opens the range to that peer only.
    auto gl = co_await sl.grant(gmr, 0, 64, access::remote_write);
    auto gr = co_await sr.grant(gmr, 64, 64, access::remote_write);
    REQUIRE(gl.has_value());
    REQUIRE(gr.has_value());
    auto c1 = pattern(64, 3), c2 = pattern(64, 4);
    REQUIRE(co_await cl.write(c1, gl->remote()));
    REQUIRE(co_await cr.write(c2, gr->remote()));
    CHECK(same(std::span(gtarget).first(64), c1));
    CHECK(same(std::span(gtarget).subspan(64, 64), c2));
    REQUIRE(co_await sl.revoke(*gl));
    REQUIRE(co_await sr.revoke(*gr));
    // Deregistered: refused on both paths (each connection then fails, RC rules).
    mr = {};
    auto refused_local = co_await cl.write(a, rb.slice(0, 64).value());
    auto refused_remote = co_await cr.write(b, rb.slice(0, 64).value());
    CHECK(refused_local.error() == make_error_code(errc::remote_access_error));
    CHECK(refused_remote.error() == make_error_code(errc::remote_access_error));
  }());
}

TEST_CASE("automatic: a closed listener closes both sockets") {
  clear_env();
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open().value();
    auto cd = domain::open().value();
    auto l = sd.listen(test_endpoint(0)).value();
    const auto port = l.local_endpoint()->port();
    l.close();
    CHECK_FALSE(l.local_endpoint().has_value());
    auto r = co_await l.accept();
    CHECK_FALSE(r.has_value());
    connection_options o;
    o.connect_timeout = 2000ms;
    auto c = co_await cd.connect(test_endpoint(port), o);
    CHECK_FALSE(c.has_value());
    // Both names are free again: a new automatic listener takes the port.
    auto again = sd.listen(test_endpoint(port));
    CHECK(again.has_value());
  }());
}
