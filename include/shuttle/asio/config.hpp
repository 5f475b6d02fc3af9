// Boost.Asio configuration for shuttle's interop headers. Include the interop
// headers (or this one) before any other Boost.Asio header in a translation
// unit: the macros below must be seen by Asio's own configuration.
//
// Supported Boost range: 1.74 (Debian 12, the tested floor) and later. The
// interop adapts to the Asio it is compiled against:
//   - Boost >= 1.77 (Asio 1.20): per-operation cancellation slots map onto
//     shuttle's stop tokens (SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS);
//   - Boost >= 1.80 (Asio 1.24): asio::deferred, experimental::as_tuple and
//     the awaitable operators || and && work with every shuttle operation
//     (they are Asio features; shuttle's initiations are ordinary
//     async_initiate ones, so nothing shuttle-specific is needed);
//   - Boost 1.74 - 1.76: use_awaitable, use_future, callbacks, redirect_error,
//     bind_executor, co_spawn; per-operation cancellation through an explicit
//     std::stop_token (async_run's overload) since Asio has no slots yet.
// The driven-io_context mode (asio_driver.hpp) reads the epoll reactor's fd,
// an Asio internal that has been stable from Boost 1.66 to 1.90; it requires
// the epoll reactor (Linux default; not BOOST_ASIO_HAS_IO_URING_AS_DEFAULT).
#pragma once

// Boost 1.74's awaitable.hpp uses std::exchange without including <utility>.
#include <utility>

// Boost 1.74's Asio enables co_await on clang only with
// <experimental/coroutine> (libc++ + -fcoroutines-ts). clang 14 in C++20 mode
// with libstdc++ has standard coroutines: tell Asio to use them.
#if defined(__clang__) && defined(__cpp_impl_coroutine) && !defined(BOOST_ASIO_HAS_CO_AWAIT)
#  if __has_include(<coroutine>)
#    define BOOST_ASIO_HAS_CO_AWAIT 1
#    define BOOST_ASIO_HAS_STD_COROUTINE 1
#  endif
#endif

// g++ 11+ reports a false -Wmismatched-new-delete for Asio's awaitable frame
// allocator at some optimisation levels (-O1, -O2 with sanitizers); it is
// attributed to the including file's coroutines, so it cannot be scoped with
// push/pop around the Asio includes. Including this header silences it for
// the rest of the translation unit.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#  pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <boost/asio/version.hpp>
#include <boost/version.hpp>

#if BOOST_VERSION < 107400
#  error "shuttle's Asio interop needs Boost >= 1.74"
#endif

#if BOOST_ASIO_VERSION >= 102000
#  define SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS 1
#else
#  define SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS 0
#endif

namespace boost::asio {}
namespace shuttle::asio {
namespace net = ::boost::asio;
}  // namespace shuttle::asio
