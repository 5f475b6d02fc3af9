// Asio-token forms of shuttle's loop-level operations: TCP, timers, channels.
// Each runs on the calling thread's shuttle loop: the single-submission ones
// (read_some, write_some, timers) as a direct io_uring operation
// (sqe_op.hpp), the others through async_run (async_run.hpp); both have the
// same contract (handler executor and allocator, slots, errors). Call them
// on the loop's thread (Asio handlers and awaitables running on the shuttle
// executor or on an asio::io_context driven by the loop are). The objects
// passed by reference and the buffers must outlive the operation.
//
//   std::size_t n = co_await shuttle::asio::async_read_some(sock, buf, asio::use_awaitable);
//   auto [ec, n] = co_await shuttle::asio::async_read_some(sock, buf, as_tuple(use_awaitable));  // Boost >= 1.80
#pragma once

#include <shuttle/asio/async_run.hpp>
#include <shuttle/asio/sqe_op.hpp>

#include <chrono>
#include <cstddef>
#include <span>

#include <shuttle/channel.hpp>
#include <shuttle/tcp.hpp>
#include <shuttle/timer.hpp>

namespace shuttle::asio {

namespace detail {
inline task<result<std::size_t>> read_exact_n(tcp_socket& s, std::span<std::byte> buf) {
  auto r = co_await s.read_exact(buf);
  if (!r) co_return r.error();
  co_return buf.size();
}
inline task<result<std::size_t>> write_all_n(tcp_socket& s, std::span<const std::byte> buf) {
  auto r = co_await s.write_all(buf);
  if (!r) co_return r.error();
  co_return buf.size();
}
}  // namespace detail

// ---------------------------------------------------------------- TCP

// One submission each: the CQE completes the handler directly (sqe_op.hpp).

// void(error_code, std::size_t): one recv; 0 bytes means the peer closed.
template <class Token>
auto async_read_some(tcp_socket& s, std::span<std::byte> buf, Token&& token) {
  return detail::async_sqe(detail::recv_sqe{&s, buf}, std::forward<Token>(token));
}
// void(error_code, std::size_t): one send.
template <class Token>
auto async_write_some(tcp_socket& s, std::span<const std::byte> buf, Token&& token) {
  return detail::async_sqe(detail::send_sqe{&s, buf}, std::forward<Token>(token));
}
// void(error_code, std::size_t): exactly buf.size() bytes (shuttle::errc::eof if the peer closes first).
template <class Token>
auto async_read(tcp_socket& s, std::span<std::byte> buf, Token&& token) {
  return async_run(io_context::current(), [&s, buf] { return detail::read_exact_n(s, buf); },
                   std::forward<Token>(token));
}
// void(error_code, std::size_t): all of buf.
template <class Token>
auto async_write(tcp_socket& s, std::span<const std::byte> buf, Token&& token) {
  return async_run(io_context::current(), [&s, buf] { return detail::write_all_n(s, buf); },
                   std::forward<Token>(token));
}
// void(error_code, tcp_socket)
template <class Token>
auto async_accept(tcp_listener& l, Token&& token) {
  return async_run(io_context::current(), [&l] { return l.accept(); }, std::forward<Token>(token));
}
// void(error_code, tcp_socket)
template <class Token>
auto async_connect(endpoint ep, Token&& token) {
  return async_run(io_context::current(), [ep] { return tcp_socket::connect(ep); }, std::forward<Token>(token));
}

// ---------------------------------------------------------------- timers

// void(error_code): success at the deadline, operation_aborted if cancelled.
// One submission (sqe_op.hpp).
template <class Token>
auto async_wait_until(clock::time_point deadline, Token&& token) {
  return detail::async_sqe(detail::timeout_sqe{deadline}, std::forward<Token>(token));
}
template <class Rep, class Period, class Token>
auto async_wait_for(std::chrono::duration<Rep, Period> d, Token&& token) {
  return async_wait_until(clock::now() + std::chrono::duration_cast<clock::duration>(d), std::forward<Token>(token));
}

// ---------------------------------------------------------------- channels

// void(error_code): broken_pipe once closed.
template <class T, class Token>
auto async_send(channel<T>& ch, T v, Token&& token) {
  return async_run(io_context::current(), [&ch, v = std::move(v)]() mutable { return ch.send(std::move(v)); },
                   std::forward<Token>(token));
}
// void(error_code, T)
template <class T, class Token>
auto async_receive(channel<T>& ch, Token&& token) {
  return async_run(io_context::current(), [&ch] { return ch.receive(); }, std::forward<Token>(token));
}

}  // namespace shuttle::asio
