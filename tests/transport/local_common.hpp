// What the local provider's tests share: a connected pair of local domains
// on loopback, and the raw socket calls a hand-written peer makes (passing
// descriptors, exact reads).
#pragma once

#include "common.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstring>
#include <optional>
#include <span>
#include <vector>

namespace transport_test {

inline shuttle::domain_options local_options() {
  shuttle::domain_options o;
  o.kind = shuttle::transport_kind::local;
  return o;
}

struct lpair {
  std::optional<shuttle::domain> sd, cd;
  shuttle::listener l;
  shuttle::connection server, client;
};

// `o` for both ends, `limits` for the listener.
inline shuttle::task<void> make_lpair(lpair& p, shuttle::connection_options o = {},
                                      shuttle::listener_options limits = {}) {
  using shuttle::endpoint;
  p.sd.emplace(shuttle::domain::open(local_options()).value());
  p.cd.emplace(shuttle::domain::open(local_options()).value());
  p.l = p.sd->listen(endpoint::loopback(0), o, std::move(limits)).value();
  auto [s, c] = co_await shuttle::when_all(accept_within_limit(p.l),
                                           p.cd->connect(endpoint::loopback(p.l.local_endpoint()->port()), o));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
}

inline shuttle::task<void> close_lpair(lpair& p) {
  (void)co_await p.client.close();
  (void)co_await p.server.close();
  p.l.close();
}

// `bytes`, with up to four descriptors (SCM_RIGHTS) when `fds` has any.
inline void send_fds(int fd, std::span<const std::byte> bytes, std::vector<int> fds) {
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * 4)]{};
  iovec iov{const_cast<std::byte*>(bytes.data()), bytes.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (!fds.empty() && fds.size() <= 4) {
    m.msg_control = ctl;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  (void)::sendmsg(fd, &m, MSG_NOSIGNAL);
}

// False if the peer closed (or failed) before `b` was filled.
inline bool read_exact(int fd, std::span<std::byte> b) {
  for (std::size_t got = 0; got < b.size();) {
    ssize_t n = ::recv(fd, b.data() + got, b.size() - got, 0);
    if (n <= 0) return false;
    got += static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace transport_test
