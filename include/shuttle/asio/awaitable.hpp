// Asio coroutines typed on shuttle's executor.
//
//   shuttle::asio::awaitable<std::size_t> echo_once(shuttle::tcp_socket& s) {
//     std::byte buf[64];
//     auto n = co_await shuttle::asio::async_read_some(s, buf, shuttle::asio::use_awaitable);
//     co_return co_await shuttle::asio::async_write_some(s, std::span(buf, n), shuttle::asio::use_awaitable);
//   }
//   asio::co_spawn(context.get_executor(), echo_once(sock), asio::detached);
//
// asio::awaitable<T> and asio::use_awaitable name Asio's type-erased
// any_io_executor: every operation awaited with them copies it (through
// function pointers) into the handler and queries it to find where the
// handler runs. These aliases are the same Asio templates with shuttle's
// executor as the executor type, so none of that happens: the interop
// reads the loop straight from the executor (bench/asio_interop prints
// both forms). They apply to coroutines spawned on a
// shuttle::asio::context; mixing them with asio::awaitable<T> (another
// executor type) in one coroutine chain is not possible, as with any two
// executor types in Asio.
#pragma once

#include <shuttle/asio/config.hpp>
#include <shuttle/asio/executor.hpp>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/use_awaitable.hpp>

// Boost 1.81's co_spawn keeps a work guard for the coroutine's executor; for
// shuttle's (untracked, trivially destructible) g++ 12 calls that variable
// unused. Included here, inside the push/pop, before anything else does.
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#endif
#include <boost/asio/co_spawn.hpp>
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic pop
#endif

namespace shuttle::asio {

template <class T = void>
using awaitable = net::awaitable<T, executor>;

using use_awaitable_t = net::use_awaitable_t<executor>;
inline constexpr use_awaitable_t use_awaitable{};

}  // namespace shuttle::asio
