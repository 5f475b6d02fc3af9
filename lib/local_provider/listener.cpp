// The local provider's names and listener. An endpoint names a Unix-domain
// socket: an AF_UNIX endpoint (endpoint::unix_socket: a path, or "@name"
// in the abstract namespace) as it is; an IP endpoint by its port alone,
// as the abstract name "@shuttle-local:<port>" (the address is not used:
// the peers are on this host), so that code written for IP endpoints, the
// conformance suite's included, runs unchanged. Port 0 picks a free port
// of the local provider's own (49152-65535, not TCP's).
//
// The listener is the tcp engine's (lib/tcp_provider/listener.cpp: its
// limits, concurrent handshakes, refusals) with our handshake and
// connection object (engine_hooks).
#include "listener.hpp"

#include "connection.hpp"

#include "../tcp_provider/listener.hpp"

#include <netinet/in.h>
#include <sys/random.h>
#include <sys/un.h>

#include <unistd.h>

#include <cstring>
#include <string>

namespace shuttle::detail::local_provider {

result<endpoint> socket_name(const endpoint& e) {
  if (e.family() == AF_UNIX) return e;
  if (e.family() != AF_INET && e.family() != AF_INET6) return std::make_error_code(std::errc::invalid_argument);
  return endpoint::unix_socket("@shuttle-local:" + std::to_string(e.port()));
}

namespace {

// The engine's listener, which reports the name the application used.
class local_listener final : public listener_impl {
 public:
  local_listener(std::unique_ptr<listener_impl> inner, endpoint name) noexcept
      : inner_(std::move(inner)), name_(name) {}
  task<result<connection>> accept() override { return inner_->accept(); }
  endpoint local_endpoint() const override { return closed_ ? endpoint{} : name_; }
  void close() noexcept override {
    closed_ = true;
    inner_->close();
  }

 private:
  std::unique_ptr<listener_impl> inner_;
  endpoint name_;
  bool closed_ = false;
};

// `e` with port `port`.
endpoint with_port(const endpoint& e, std::uint16_t port) {
  sockaddr_storage ss{};
  std::memcpy(&ss, e.data(), e.size());
  if (e.family() == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(port);
  else reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(port);
  return endpoint(reinterpret_cast<sockaddr*>(&ss), e.size());
}

// Binds `local`'s socket; for IP port 0, the first free port from a random one.
result<std::pair<tcp_listener, endpoint>> bind_name(const endpoint& local) {
  if (local.family() == AF_UNIX || local.port() != 0) {
    auto name = socket_name(local);
    if (!name) return name.error();
    auto l = tcp_listener::bind(*name);
    if (!l) return l.error();
    return std::pair{std::move(*l), local};
  }
  if (local.family() != AF_INET && local.family() != AF_INET6)
    return std::make_error_code(std::errc::invalid_argument);
  constexpr std::uint32_t first = 49152, count = 65536 - first;
  std::uint32_t start = 0;
  if (::getrandom(&start, sizeof start, 0) != sizeof start) start = static_cast<std::uint32_t>(::getpid());
  for (std::uint32_t i = 0; i < count; ++i) {
    auto port = static_cast<std::uint16_t>(first + (start + i) % count);
    auto ep = with_port(local, port);
    auto l = tcp_listener::bind(*socket_name(ep));
    if (l) return std::pair{std::move(*l), ep};
    if (l.error() != std::errc::address_in_use) return l.error();
  }
  return std::make_error_code(std::errc::address_in_use);
}

}  // namespace

result<listener> listen(std::shared_ptr<domain_state> dom, const endpoint& local, connection_options opts,
                        listener_options limits) {
  auto bound = bind_name(local);
  if (!bound) return bound.error();
  tp::engine_hooks hooks;
  hooks.handshake = [dom](tcp_socket& sock, std::shared_ptr<tp::domain_state>, connection_options o) {
    return handshake(sock, dom, o, local_wire::role::acceptor);
  };
  hooks.make = [](std::shared_ptr<tp::conn_state> s) { return make_local_connection(std::move(s)); };
  auto inner = tp::make_listener(std::move(bound->first), dom->engine, opts, limits, std::move(hooks));
  return listener(std::make_unique<local_listener>(std::move(inner), bound->second));
}

}  // namespace shuttle::detail::local_provider
