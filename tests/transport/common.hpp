// Shared helpers of the transport tests: a connected pair of connections on
// the calling thread's io_context, over the provider SHUTTLE_TRANSPORT picks.
#pragma once

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace transport_test {

using namespace shuttle;

// Where the tests listen: loopback by default; a Soft-RoCE guest sets the
// address of its rxe interface.
inline endpoint test_endpoint(std::uint16_t port) {
  const char* a = std::getenv("SHUTTLE_TEST_ADDR");
  std::string host = a && *a ? a : "127.0.0.1";
  return endpoint::parse(host + ":" + std::to_string(port)).value();
}

struct pair_t {
  std::optional<domain> server_domain, client_domain;
  listener l;
  connection server, client;
};

// accept() has no deadline of its own: a connect that failed would leave it
// waiting for ever (a silent hang instead of a failure with the connect's
// error), so every accept in these tests goes through this one.
inline constexpr auto accept_limit = std::chrono::seconds(30);
inline task<result<connection>> accept_within_limit(listener& l) { return with_timeout(l.accept(), accept_limit); }

inline task<void> make_pair(pair_t& p, connection_options opts = {}) {
  p.server_domain.emplace(domain::open().value());
  p.client_domain.emplace(domain::open().value());
  p.l = p.server_domain->listen(test_endpoint(0), opts).value();
  auto ep = test_endpoint(p.l.local_endpoint()->port());
  auto [s, c] = co_await when_all(accept_within_limit(p.l), p.client_domain->connect(ep, opts));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
}

// Closes both sides and the listener. No wait after: what the provider
// still winds down ends on the loop (transport.hpp, "Lifetimes").
inline task<void> close_pair(pair_t& p) {
  (void)co_await p.client.close();
  (void)co_await p.server.close();
  p.l.close();
}

inline std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 16);
  }
  return v;
}

inline bool is_error(const std::error_code& ec, errc e) { return ec == make_error_code(e); }

inline bool same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace transport_test
