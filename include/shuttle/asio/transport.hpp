// Asio-token forms of the transport API (either provider: tcp or verbs).
//
// Cancellation through an Asio slot is NIC-safe, as shuttle's: the handler
// runs only once the provider guarantees that the operation's buffers are no
// longer touched. Only terminal cancellation is honoured: on verbs a work
// request already handed to the NIC cannot be withdrawn alone, so cancelling
// it moves the connection to the error state (errc::disconnected afterwards);
// partial/total requests, which promise the object stays usable, are ignored.
#pragma once

#include <shuttle/asio/async_run.hpp>
#include <shuttle/transport.hpp>

namespace shuttle::asio {

inline constexpr cancel_on transport_cancel = cancel_on::terminal;

// void(error_code)
template <class Token>
auto async_send(connection& c, std::span<const std::byte> msg, Token&& token) {
  return async_run(io_context::current(), [&c, msg] { return c.send(msg); }, std::forward<Token>(token),
                   transport_cancel);
}
// void(error_code, message)
template <class Token>
auto async_recv(connection& c, Token&& token) {
  return async_run(io_context::current(), [&c] { return c.recv(); }, std::forward<Token>(token), transport_cancel);
}
// void(error_code)
template <class Token>
auto async_write(connection& c, std::span<const std::byte> local, remote_buffer remote, Token&& token) {
  return async_run(io_context::current(), [&c, local, remote] { return c.write(local, remote); },
                   std::forward<Token>(token), transport_cancel);
}
// void(error_code)
template <class Token>
auto async_write_with_imm(connection& c, std::span<const std::byte> local, remote_buffer remote, std::uint32_t imm,
                          Token&& token) {
  return async_run(io_context::current(), [&c, local, remote, imm] { return c.write_with_imm(local, remote, imm); },
                   std::forward<Token>(token), transport_cancel);
}
// void(error_code)
template <class Token>
auto async_read(connection& c, std::span<std::byte> local, remote_buffer remote, Token&& token) {
  return async_run(io_context::current(), [&c, local, remote] { return c.read(local, remote); },
                   std::forward<Token>(token), transport_cancel);
}
// void(error_code, std::uint64_t): the value found before.
template <class Token>
auto async_compare_and_swap(connection& c, remote_buffer remote, std::uint64_t expected, std::uint64_t desired,
                            Token&& token) {
  return async_run(io_context::current(),
                   [&c, remote, expected, desired] { return c.compare_and_swap(remote, expected, desired); },
                   std::forward<Token>(token), transport_cancel);
}
template <class Token>
auto async_fetch_and_add(connection& c, remote_buffer remote, std::uint64_t add, Token&& token) {
  return async_run(io_context::current(), [&c, remote, add] { return c.fetch_and_add(remote, add); },
                   std::forward<Token>(token), transport_cancel);
}
// void(error_code, connection)
template <class Token>
auto async_connect(domain& d, endpoint remote, connection_options opts, Token&& token) {
  return async_run(io_context::current(), [&d, remote, opts] { return d.connect(remote, opts); },
                   std::forward<Token>(token));
}
template <class Token>
auto async_accept(listener& l, Token&& token) {
  return async_run(io_context::current(), [&l] { return l.accept(); }, std::forward<Token>(token));
}
// void(error_code): graceful close.
template <class Token>
auto async_close(connection& c, Token&& token) {
  return async_run(io_context::current(), [&c] { return c.close(); }, std::forward<Token>(token));
}

}  // namespace shuttle::asio
