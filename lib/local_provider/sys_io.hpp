// Socket helpers of the local provider (internal): descriptors passed with
// SCM_RIGHTS, and a poll awaited on the loop.
#pragma once

#include <shuttle/detail/uring_op.hpp>
#include <shuttle/error.hpp>
#include <shuttle/result.hpp>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <span>
#include <vector>

namespace shuttle::detail::local_provider {

// Descriptors owned until taken (set to -1) or closed with it.
struct fd_list {
  std::vector<int> fds;
  fd_list() = default;
  fd_list(const fd_list&) = delete;
  fd_list& operator=(const fd_list&) = delete;
  ~fd_list() {
    for (int f : fds)
      if (f >= 0) ::close(f);
  }
};

// Most descriptors one message may bring; more (MSG_CTRUNC) is a protocol error.
inline constexpr std::size_t max_passed_fds = 4;

// One recvmsg of up to buf.size() bytes, without blocking; descriptors that
// came with them are appended to `fds`.
inline result<std::size_t> recv_with_fds(int fd, std::span<std::byte> buf, std::vector<int>& fds) {
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * max_passed_fds)];
  iovec iov{buf.data(), buf.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  ssize_t n = ::recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) return errno_code(errno);
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < k; ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
      fds.push_back(f);
    }
  }
  if (m.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) return make_error_code(errc::protocol_error);
  return static_cast<std::size_t>(n);
}

// One sendmsg of all of `buf` with `fds`, without blocking: the local
// provider's messages are small and each side reads them promptly, so a
// full socket means a peer that does not (an error).
inline result<void> send_with_fds(int fd, std::span<const std::byte> buf, std::span<const int> fds) {
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * max_passed_fds)];
  iovec iov{const_cast<std::byte*>(buf.data()), buf.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (!fds.empty()) {
    if (fds.size() > max_passed_fds) return std::make_error_code(std::errc::invalid_argument);
    std::memset(ctl, 0, sizeof ctl);
    m.msg_control = ctl;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n = ::sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n < 0) return errno_code(errno);
  if (static_cast<std::size_t>(n) != buf.size()) return make_error_code(errc::protocol_error);
  return {};
}

// co_await poll_in(fd): the poll's revents, or -errno (-ECANCELED when the
// awaiting task's stop was requested).
inline auto poll_in(int fd) {
  return make_uring_awaitable(
      io_context::current(), [fd](io_uring_sqe* sqe) { io_uring_prep_poll_add(sqe, fd, POLLIN); },
      [](int r, std::uint32_t) { return r; });
}

}  // namespace shuttle::detail::local_provider
