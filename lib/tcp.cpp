#include <shuttle/tcp.hpp>
#include <shuttle/timer.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <sys/un.h>
#include <unistd.h>

#include <charconv>
#include <cstddef>
#include <cstring>
#include <deque>

namespace shuttle {

// ---------------------------------------------------------------- endpoint

endpoint::endpoint(const sockaddr* sa, socklen_t len) noexcept {
  len_ = std::min<socklen_t>(len, sizeof addr_);
  std::memcpy(&addr_, sa, len_);
}

namespace {
endpoint ipv4(std::uint32_t host_order_addr, std::uint16_t port) noexcept {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(host_order_addr);
  return endpoint(reinterpret_cast<sockaddr*>(&a), sizeof a);
}
}  // namespace

endpoint endpoint::loopback(std::uint16_t port) noexcept { return ipv4(INADDR_LOOPBACK, port); }
endpoint endpoint::any(std::uint16_t port) noexcept { return ipv4(INADDR_ANY, port); }

result<endpoint> endpoint::parse(std::string_view s) {
  std::string_view host, port;
  if (!s.empty() && s.front() == '[') {
    auto close = s.find(']');
    if (close == s.npos || close + 1 >= s.size() || s[close + 1] != ':')
      return std::make_error_code(std::errc::invalid_argument);
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    auto colon = s.rfind(':');
    if (colon == s.npos) return std::make_error_code(std::errc::invalid_argument);
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  unsigned p = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc{} || end != port.data() + port.size() || p > 65535)
    return std::make_error_code(std::errc::invalid_argument);
  std::string h(host);
  sockaddr_in a4{};
  if (inet_pton(AF_INET, h.c_str(), &a4.sin_addr) == 1) {
    a4.sin_family = AF_INET;
    a4.sin_port = htons(static_cast<std::uint16_t>(p));
    return endpoint(reinterpret_cast<sockaddr*>(&a4), sizeof a4);
  }
  sockaddr_in6 a6{};
  if (inet_pton(AF_INET6, h.c_str(), &a6.sin6_addr) == 1) {
    a6.sin6_family = AF_INET6;
    a6.sin6_port = htons(static_cast<std::uint16_t>(p));
    return endpoint(reinterpret_cast<sockaddr*>(&a6), sizeof a6);
  }
  return std::make_error_code(std::errc::invalid_argument);
}

namespace {
// getaddrinfo's EAI_* codes, with gai_strerror's words.
class resolver_category_t final : public std::error_category {
 public:
  const char* name() const noexcept override { return "getaddrinfo"; }
  std::string message(int c) const override { return ::gai_strerror(c); }
};
const std::error_category& resolver_category() noexcept {
  static const resolver_category_t c;
  return c;
}
}  // namespace

result<endpoint> endpoint::resolve(const std::string& host, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) return std::error_code(rc, resolver_category());
  endpoint ep(res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  return ep;
}

std::uint16_t endpoint::port() const noexcept {
  if (addr_.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&addr_)->sin_port);
  if (addr_.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr_)->sin6_port);
  return 0;
}

result<endpoint> endpoint::unix_socket(std::string_view path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  bool abstract = !path.empty() && path[0] == '@';
  if (path.empty() || path.size() > sizeof a.sun_path - (abstract ? 0 : 1) || (abstract && path.size() == 1) ||
      path.find('\0') != std::string_view::npos)
    return std::make_error_code(std::errc::invalid_argument);
  std::memcpy(a.sun_path, path.data(), path.size());
  if (abstract) a.sun_path[0] = '\0';  // the abstract namespace: no file, gone with its last socket
  auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + (abstract ? 0 : 1));
  return endpoint(reinterpret_cast<sockaddr*>(&a), len);
}

std::string endpoint::to_string() const {
  // Appends rather than operator+ chains: g++ 12 -O3 warns falsely (-Wrestrict) on those.
  char buf[INET6_ADDRSTRLEN] = "?";
  std::string out;
  if (addr_.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr_)->sin_addr, buf, sizeof buf);
    out.append(buf);
  } else if (addr_.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr_)->sin6_addr, buf, sizeof buf);
    out.append("[").append(buf).append("]");
  } else if (addr_.ss_family == AF_UNIX) {
    // "unix:/path", "unix:@name" (abstract), "unix:" (unnamed)
    const auto* un = reinterpret_cast<const sockaddr_un*>(&addr_);
    std::size_t n = len_ > offsetof(sockaddr_un, sun_path) ? len_ - offsetof(sockaddr_un, sun_path) : 0;
    out.append("unix:");
    if (n > 0 && un->sun_path[0] == '\0') out.append("@").append(un->sun_path + 1, n - 1);
    else out.append(un->sun_path, strnlen(un->sun_path, n));
    return out;
  } else {
    return "<unspecified>";
  }
  out.append(":").append(std::to_string(port()));
  return out;
}

// ---------------------------------------------------------------- tcp_socket

tcp_socket& tcp_socket::operator=(tcp_socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::exchange(o.fd_, -1);
    file_ = std::exchange(o.file_, {});
  }
  return *this;
}

result<void> tcp_socket::register_file() {
  if (fd_ < 0) return errno_code(EBADF);
  io_context& ctx = io_context::current();
  if (file_.slot >= 0) {
    if (file_.table->owner == &ctx) return {};
    return errno_code(EBUSY);  // registered with another thread's context
  }
  auto r = ctx.register_file(fd_);
  if (!r) return r.error();
  file_ = std::move(*r);
  return {};
}

namespace {
struct fd_closer {
  int fd;
  ~fd_closer() {
    if (fd >= 0) ::close(fd);
  }
};
}  // namespace

void tcp_socket::unregister(bool close_fd) noexcept {
  int fd = std::exchange(fd_, -1);
  detail::registered_file f = std::exchange(file_, {});
  io_context* owner = f.slot >= 0 ? f.table->owner : nullptr;
  if (owner && owner->running_in_this_thread()) {
    owner->unregister_file(f);
  } else if (owner) {
    // Only the ring's own thread can empty its slot (a single-issuer ring,
    // registered ring fd): its loop does, then closes the fd. Dropped
    // unrun if the context ends first: the fd is closed then.
    try {
      auto closer = std::make_shared<fd_closer>(fd_closer{close_fd ? fd : -1});
      owner->dispatch([f, closer]() mutable {
        if (f.table->owner) f.table->owner->unregister_file(f);
      });
      return;
    } catch (...) {
      // Out of memory: the slot keeps the file open until its context ends.
    }
  }
  if (close_fd && fd >= 0) ::close(fd);
}

void tcp_socket::close() noexcept {
  if (fd_ >= 0) unregister(true);
}

int tcp_socket::release() noexcept {
  int fd = fd_;
  unregister(false);
  return fd;
}

task<result<tcp_socket>> tcp_socket::connect(endpoint ep) {
  // protocol 0 for AF_UNIX (the local provider sets its connections up over one)
  int fd = ::socket(ep.family(), SOCK_STREAM | SOCK_CLOEXEC, ep.family() == AF_UNIX ? 0 : IPPROTO_TCP);
  if (fd < 0) co_return errno_code(errno);
  tcp_socket s(fd);
  int res = co_await detail::make_uring_awaitable(
      io_context::current(),
      [&](io_uring_sqe* sqe) { io_uring_prep_connect(sqe, fd, ep.data(), ep.size()); },
      [](int r, std::uint32_t) { return r; });
  if (res < 0) co_return errno_code(-res);
  co_return std::move(s);
}

task<result<tcp_socket>> tcp_socket::connect(endpoint ep, std::chrono::nanoseconds timeout) {
  auto s = co_await with_timeout(connect(ep), timeout);
  // The TCP connect itself timed out: the kernel's own word for it.
  if (!s && s.error() == errc::operation_timeout) co_return std::make_error_code(std::errc::timed_out);
  co_return s;
}

task<result<void>> tcp_socket::read_exact(std::span<std::byte> buf) {
  while (!buf.empty()) {
    auto n = co_await read_some(buf);
    if (!n) co_return n.error();
    if (*n == 0) co_return make_error_code(errc::eof);
    buf = buf.subspan(*n);
  }
  co_return result<void>{};
}

task<result<void>> tcp_socket::write_all(std::span<const std::byte> buf) {
  while (!buf.empty()) {
    auto n = co_await write_some(buf);
    if (!n) co_return n.error();
    buf = buf.subspan(*n);
  }
  co_return result<void>{};
}

task<result<void>> tcp_socket::writev_all(std::span<const iovec> iov_in) {
  std::vector<iovec> iov(iov_in.begin(), iov_in.end());
  std::size_t first = 0;
  while (first < iov.size()) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    auto n = co_await writev(std::span<const iovec>(iov).subspan(first));
    if (!n) co_return n.error();
    std::size_t left = *n;
    while (left > 0 && first < iov.size()) {
      std::size_t take = std::min(left, iov[first].iov_len);
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      left -= take;
      if (iov[first].iov_len == 0) ++first;
    }
  }
  co_return result<void>{};
}

result<void> tcp_socket::shutdown(int how) noexcept {
  if (::shutdown(fd_, how) < 0) return errno_code(errno);
  return {};
}

result<void> tcp_socket::set_option(int level, int name, const void* value, socklen_t len) noexcept {
  if (::setsockopt(fd_, level, name, value, len) < 0) return errno_code(errno);
  return {};
}
result<void> tcp_socket::set_nodelay(bool on) noexcept {
  int v = on;
  return set_option(IPPROTO_TCP, TCP_NODELAY, &v, sizeof v);
}
result<void> tcp_socket::set_keepalive(bool on) noexcept {
  int v = on;
  return set_option(SOL_SOCKET, SO_KEEPALIVE, &v, sizeof v);
}
result<void> tcp_socket::set_linger(bool on, int seconds) noexcept {
  linger l{on ? 1 : 0, seconds};
  return set_option(SOL_SOCKET, SO_LINGER, &l, sizeof l);
}
result<void> tcp_socket::set_send_buffer(int bytes) noexcept {
  return set_option(SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}
result<void> tcp_socket::set_receive_buffer(int bytes) noexcept {
  return set_option(SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

namespace {
result<endpoint> name_of(int fd, bool peer) noexcept {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  int rc = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len)
                : ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  if (rc < 0) return errno_code(errno);
  return endpoint(reinterpret_cast<sockaddr*>(&ss), len);
}
}  // namespace

result<endpoint> tcp_socket::local_endpoint() const noexcept { return name_of(fd_, false); }
result<endpoint> tcp_socket::remote_endpoint() const noexcept { return name_of(fd_, true); }

// ---------------------------------------------------------------- tcp_listener

// Heap state: the armed multishot accept refers to it, so it lives until the
// kernel's last CQE for that request, even after the listener is closed.
struct tcp_listener::state : detail::orphan_op {
  io_context* ctx = nullptr;
  int fd = -1;
  bool armed = false;
  bool closed = false;
  std::deque<int> queued;  // accepted with nobody waiting
  std::error_code queued_error;
  detail::wait_list waiters;

  void arm() {
    io_uring_sqe* sqe = ctx->backend().get_sqe();
    io_uring_prep_multishot_accept(sqe, fd, nullptr, nullptr, SOCK_CLOEXEC);
    io_uring_sqe_set_data(sqe, static_cast<detail::io_op*>(this));
    complete = &on_accept;
    armed = true;
  }

  static void on_accept(detail::io_op* op, int res, std::uint32_t flags) noexcept {
    auto* s = static_cast<state*>(op);
    if (!(flags & IORING_CQE_F_MORE)) s->armed = false;
    if (s->closed) {
      if (res >= 0) ::close(res);
      if (!s->armed) {
        s->ctx->backend().forget_orphan(s);
        delete s;
      }
      return;
    }
    auto* w = static_cast<accept_awaiter::node*>(s->waiters.wake_one());
    if (res >= 0) {
      if (w) {
        w->fd = res;
        w->filled = true;
      } else {
        s->queued.push_back(res);
      }
    } else if (res != -ECANCELED) {
      if (w) {
        w->error = errno_code(-res);
        w->filled = true;
      } else {
        s->queued_error = errno_code(-res);
      }
    }
    // The multishot ended (error, or the kernel gave up): re-arm only while
    // somebody waits, so an EMFILE storm is paced by the callers' back-off.
    try {
      if (!s->armed && !s->waiters.empty() && !s->closed && res >= 0) s->arm();
    } catch (...) {
      // No SQE: the next accept() call arms again.
    }
  }
};

tcp_listener::tcp_listener(tcp_listener&& o) noexcept : state_(std::exchange(o.state_, nullptr)) {}

tcp_listener& tcp_listener::operator=(tcp_listener&& o) noexcept {
  if (this != &o) {
    close();
    state_ = std::exchange(o.state_, nullptr);
  }
  return *this;
}

tcp_listener::~tcp_listener() { close(); }

result<tcp_listener> tcp_listener::bind(const endpoint& ep, options opts) {
  io_context* ctx = io_context::current_or_null();
  if (!ctx) return make_error_code(errc::no_io_context);
  // protocol 0 for AF_UNIX (the local provider sets its connections up over one)
  int fd = ::socket(ep.family(), SOCK_STREAM | SOCK_CLOEXEC, ep.family() == AF_UNIX ? 0 : IPPROTO_TCP);
  if (fd < 0) return errno_code(errno);
  int one = 1;
  auto fail = [fd](int e) {
    ::close(fd);
    return errno_code(e);
  };
  if (opts.reuse_address && ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0) return fail(errno);
  if (opts.reuse_port && ::setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) < 0) return fail(errno);
  if (::bind(fd, ep.data(), ep.size()) < 0) return fail(errno);
  if (::listen(fd, opts.backlog) < 0) return fail(errno);
  auto* s = new state;
  s->fd = fd;
  s->ctx = ctx;
  return tcp_listener(s);
}

result<endpoint> tcp_listener::local_endpoint() const noexcept {
  if (!state_) return std::make_error_code(std::errc::bad_file_descriptor);
  return name_of(state_->fd, false);
}

void tcp_listener::close() noexcept {
  state* s = std::exchange(state_, nullptr);
  if (!s) return;
  s->closed = true;
  for (int fd : s->queued) ::close(fd);
  s->queued.clear();
  while (auto* w = static_cast<accept_awaiter::node*>(s->waiters.wake_one())) {
    w->error = std::make_error_code(std::errc::bad_file_descriptor);
    w->filled = true;
  }
  ::close(s->fd);
  if (s->armed) {
    s->ctx->backend().adopt_orphan(s);  // the final CQE, or the context's end, frees it
    try {
      s->ctx->backend().submit_cancel(s);
    } catch (...) {
      // Ring full: the accept ends when the fd's last reference goes.
    }
  } else {
    delete s;
  }
}

tcp_listener::accept_awaiter tcp_listener::accept() { return accept_awaiter{state_}; }

bool tcp_listener::accept_awaiter::await_ready() {
  if (!s_) return true;
  return !s_->queued.empty() || s_->queued_error;
}

bool tcp_listener::accept_awaiter::park(std::coroutine_handle<> h, std::stop_token token) {
  if (!s_->armed) s_->arm();
  return s_->waiters.park(node_, h, std::move(token));
}

result<tcp_socket> tcp_listener::accept_awaiter::await_resume() {
  if (!s_) return std::make_error_code(std::errc::bad_file_descriptor);
  if (node_.filled) {
    if (node_.error) return node_.error;
    return tcp_socket(node_.fd);
  }
  if (node_.cancelled) return std::make_error_code(std::errc::operation_canceled);
  if (!s_->queued.empty()) {
    int fd = s_->queued.front();
    s_->queued.pop_front();
    return tcp_socket(fd);
  }
  return std::exchange(s_->queued_error, {});
}

}  // namespace shuttle
