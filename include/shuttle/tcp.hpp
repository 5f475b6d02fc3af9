// TCP over the ring: listener (multishot accept), connect (cancellable, with
// an optional timeout), read/write in every usual shape, socket options.
// Each I/O call returns an awaitable yielding result<...>; errors are
// std::error_code (system category, or shuttle::errc::eof for a short read).
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>
#include <netinet/in.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <shuttle/detail/uring_op.hpp>
#include <shuttle/detail/wait_list.hpp>
#include <shuttle/endpoint.hpp>
#include <shuttle/error.hpp>
#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

namespace detail {
inline result<std::size_t> to_size(int res, std::uint32_t) noexcept {
  if (res < 0) return errno_code(-res);
  return static_cast<std::size_t>(res);
}
struct size_convert {
  result<std::size_t> operator()(int res, std::uint32_t f) const noexcept { return to_size(res, f); }
};
template <class Prep>
using io_awaitable = uring_awaitable<Prep, size_convert>;
}  // namespace detail

class tcp_socket {
 public:
  tcp_socket() noexcept = default;
  explicit tcp_socket(int fd) noexcept : fd_(fd) {}
  tcp_socket(tcp_socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)), file_(std::exchange(o.file_, {})) {}
  tcp_socket& operator=(tcp_socket&& o) noexcept;
  tcp_socket(const tcp_socket&) = delete;
  tcp_socket& operator=(const tcp_socket&) = delete;
  ~tcp_socket() { close(); }

  // co_await tcp_socket::connect(ep): cancellable through the task's stop token.
  static task<result<tcp_socket>> connect(endpoint ep);
  // Fails with std::errc::timed_out ("Connection timed out") after `timeout`.
  static task<result<tcp_socket>> connect(endpoint ep, std::chrono::nanoseconds timeout);

  // Registers the socket in the calling thread's io_context (its ring's
  // file table, io_context::options::registered_files slots). Operations
  // that thread starts then name the slot (IOSQE_FIXED_FILE): the kernel
  // skips a file lookup and a reference count per operation (what that
  // saves: docs/measurements.md). Operations started on other
  // threads use the fd, as before. Worth it for long-lived connections: it
  // costs a system call here and another in close(). Fails (and changes
  // nothing) when the table is full: ENFILE.
  result<void> register_file();
  bool is_registered() const noexcept { return file_.slot >= 0; }

  // One recv; 0 bytes means the peer closed its side.
  auto read_some(std::span<std::byte> buf) {
    io_context& ctx = io_context::current();
    detail::sqe_file f = file_for(ctx);
    return detail::make_uring_awaitable(
        ctx,
        [f, buf](io_uring_sqe* sqe) {
          io_uring_prep_recv(sqe, f.fd, buf.data(), buf.size(), 0);
          f.mark(sqe);
        },
        detail::size_convert{});
  }
  // One send (MSG_NOSIGNAL: a dead peer is EPIPE, never SIGPIPE).
  auto write_some(std::span<const std::byte> buf) {
    io_context& ctx = io_context::current();
    detail::sqe_file f = file_for(ctx);
    return detail::make_uring_awaitable(
        ctx,
        [f, buf](io_uring_sqe* sqe) {
          io_uring_prep_send(sqe, f.fd, buf.data(), buf.size(), MSG_NOSIGNAL);
          f.mark(sqe);
        },
        detail::size_convert{});
  }
  // Scatter/gather; `iov` must stay valid until the operation completes.
  auto readv(std::span<const iovec> iov) { return msg_op(IORING_OP_RECVMSG, iov, 0); }
  auto writev(std::span<const iovec> iov) { return msg_op(IORING_OP_SENDMSG, iov, MSG_NOSIGNAL); }

  // Reads exactly buf.size() bytes; errc::eof if the peer closes first.
  task<result<void>> read_exact(std::span<std::byte> buf);
  // Writes all of buf, however many sends it takes.
  task<result<void>> write_all(std::span<const std::byte> buf);
  // Writes every byte of every buffer (the iovec array is copied).
  task<result<void>> writev_all(std::span<const iovec> iov);

  result<void> shutdown(int how = SHUT_WR) noexcept;
  // Closes the fd; a registered socket leaves its slot first (the slot holds
  // the file open). Off the registering thread, that thread's loop does both
  // (handed over with io_context::dispatch); after that context ended, the
  // fd is simply closed.
  void close() noexcept;
  bool is_open() const noexcept { return fd_ >= 0; }
  int native_handle() const noexcept { return fd_; }
  // Gives up the fd (unregistered, as close() does) without closing it.
  int release() noexcept;
  // What an SQE prepared on `ctx` names: the slot there, else the fd.
  detail::sqe_file file_for(const io_context& ctx) const noexcept { return file_.for_ring(ctx, fd_); }

  result<void> set_nodelay(bool on) noexcept;
  result<void> set_keepalive(bool on) noexcept;
  result<void> set_linger(bool on, int seconds) noexcept;  // on with 0: close sends RST
  result<void> set_send_buffer(int bytes) noexcept;
  result<void> set_receive_buffer(int bytes) noexcept;
  result<void> set_option(int level, int name, const void* value, socklen_t len) noexcept;
  result<endpoint> local_endpoint() const noexcept;
  result<endpoint> remote_endpoint() const noexcept;

 private:
  struct msg_prep {
    detail::sqe_file file;
    std::uint8_t op;
    unsigned flags;
    msghdr msg;
    void operator()(io_uring_sqe* sqe) {
      io_uring_prep_rw(op, sqe, file.fd, &msg, 1, 0);
      sqe->msg_flags = flags;
      file.mark(sqe);
    }
  };
  detail::io_awaitable<msg_prep> msg_op(std::uint8_t op, std::span<const iovec> iov, unsigned flags) {
    msghdr m{};
    m.msg_iov = const_cast<iovec*>(iov.data());
    m.msg_iovlen = iov.size();
    io_context& ctx = io_context::current();
    return {ctx, msg_prep{file_for(ctx), op, flags, m}, {}};
  }
  // Leaves the slot (on its own loop, or through it); then closes the fd if `close_fd`.
  void unregister(bool close_fd) noexcept;
  int fd_ = -1;
  detail::registered_file file_;
};

class tcp_listener {
 public:
  struct options {
    int backlog = 4096;
    bool reuse_address = true;
    bool reuse_port = false;  // one listener per thread on the same port
  };

  tcp_listener() noexcept = default;
  tcp_listener(tcp_listener&& o) noexcept;
  tcp_listener& operator=(tcp_listener&& o) noexcept;
  ~tcp_listener();

  // Binds and listens (synchronously: set-up may block and may throw nothing; errors come back).
  // The listener belongs to the calling thread's io_context: errc::no_io_context without one.
  static result<tcp_listener> bind(const endpoint& ep, options opts);
  static result<tcp_listener> bind(const endpoint& ep) { return bind(ep, options{}); }

  // co_await listener.accept(): result<tcp_socket>. Accepts are multishot
  // underneath: one armed request serves every caller; connections that
  // arrive with nobody waiting are queued. EMFILE and friends come back as
  // errors (the caller backs off and calls again).
  class accept_awaiter;
  accept_awaiter accept();

  result<endpoint> local_endpoint() const noexcept;
  void close() noexcept;
  bool is_open() const noexcept { return state_ != nullptr; }

  struct state;

 private:
  explicit tcp_listener(state* s) noexcept : state_(s) {}
  state* state_ = nullptr;
};

class tcp_listener::accept_awaiter {
 public:
  explicit accept_awaiter(state* s) noexcept : s_(s) {}
  bool await_ready();
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return park(h, detail::stop_token_of(h));
  }
  result<tcp_socket> await_resume();

  struct node : detail::wait_node {
    int fd = -1;
    std::error_code error;
    bool filled = false;
  };

 private:
  bool park(std::coroutine_handle<> h, std::stop_token token);
  state* s_;
  node node_;
};

}  // namespace shuttle
