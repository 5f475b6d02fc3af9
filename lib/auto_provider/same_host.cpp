// Which endpoints name this host (auto_provider.hpp).
#include "auto_provider.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstring>
#include <string>

namespace shuttle::detail::auto_provider {

namespace {

// An IPv4 address from `sa` (AF_INET, or IPv4-mapped AF_INET6), in network order.
bool ipv4_of(const sockaddr* sa, in_addr& out) noexcept {
  if (sa->sa_family == AF_INET) {
    out = reinterpret_cast<const sockaddr_in*>(sa)->sin_addr;
    return true;
  }
  if (sa->sa_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      std::memcpy(&out, a.s6_addr + 12, 4);
      return true;
    }
  }
  return false;
}

}  // namespace

bool same_host(const endpoint& e) {
  const sockaddr* sa = e.data();
  in_addr v4{};
  const bool is_v4 = ipv4_of(sa, v4);
  if (is_v4) {
    const std::uint32_t h = ntohl(v4.s_addr);
    if ((h >> 24) == 127 || h == 0) return true;  // loopback, or 0.0.0.0 (this host)
  } else if (sa->sa_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a) || IN6_IS_ADDR_UNSPECIFIED(&a)) return true;
  } else {
    return false;
  }
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;  // unknown: the remote provider reaches it anyway
  bool found = false;
  for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    in_addr a{};
    if (is_v4) {
      found = ipv4_of(i->ifa_addr, a) && a.s_addr == v4.s_addr;
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      found = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                          &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, sizeof(in6_addr)) == 0;
    }
  }
  ::freeifaddrs(list);
  return found;
}

endpoint local_name(std::uint16_t port) {
  return endpoint::unix_socket("@shuttle-auto:" + std::to_string(port)).value();
}

}  // namespace shuttle::detail::auto_provider
