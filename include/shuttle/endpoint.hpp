// An IPv4 or IPv6 address and port: what tcp sockets and the transport API
// connect to and listen on; or a Unix-domain socket address (the local
// transport provider).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <string_view>

#include <shuttle/result.hpp>

namespace shuttle {

// An IPv4 or IPv6 address and port.
class endpoint {
 public:
  endpoint() noexcept = default;
  endpoint(const sockaddr* sa, socklen_t len) noexcept;
  // "127.0.0.1:7000", "[::1]:7000", "0.0.0.0:0". No name lookup.
  static result<endpoint> parse(std::string_view host_port);
  // Numeric host or name (getaddrinfo: blocks; call at set-up, not on hot paths).
  static result<endpoint> resolve(const std::string& host, std::uint16_t port);
  static endpoint loopback(std::uint16_t port) noexcept;
  static endpoint any(std::uint16_t port) noexcept;
  // A Unix-domain socket: a filesystem path, or "@name" for a name in the
  // abstract namespace. std::errc::invalid_argument if it does not fit.
  static result<endpoint> unix_socket(std::string_view path);

  const sockaddr* data() const noexcept { return reinterpret_cast<const sockaddr*>(&addr_); }
  socklen_t size() const noexcept { return len_; }
  int family() const noexcept { return addr_.ss_family; }
  std::uint16_t port() const noexcept;
  std::string to_string() const;

 private:
  sockaddr_storage addr_{};
  socklen_t len_ = 0;
};

}  // namespace shuttle
