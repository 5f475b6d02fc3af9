// Boost.Asio configuration for shuttle's interop headers. Include the interop
// headers (or this one) before any other Boost.Asio header in a translation
// unit: the macros below must be seen by Asio's own configuration. Every
// shuttle/asio header includes this one first, and this one refuses to
// compile after an Asio header (#error below), so the rule cannot be broken
// silently within a translation unit. Across translation units of one
// program, each that uses Asio's coroutines on clang with Boost 1.74 must
// include a shuttle/asio header first (or define BOOST_ASIO_HAS_CO_AWAIT and
// BOOST_ASIO_HAS_STD_COROUTINE itself, e.g. on the command line); g++, and
// clang with Boost >= 1.81, configure Asio the same way without it.
//
// Supported Boost range: 1.74 (Debian 12's libboost-dev, the floor) to 1.81
// (Debian 12's libboost1.81-dev), both built and tested in CI (the asio
// suites; tools/boost-alt.sh unpacks 1.81 beside the system 1.74). Later
// Boost versions are expected to work (nothing below relies on anything
// removed since) but are not tested; earlier ones are refused.
//
// Which completion-token forms exist depends on the Asio in that Boost;
// shuttle's initiations are ordinary async_initiate ones, so every form Asio
// has works with every shuttle operation, and a form Asio lacks is compiled
// out (the test suites report it as skipped, with the reason):
//
//   form                                      Boost   macro
//   use_awaitable, use_future, callbacks,     1.74+   (always)
//   redirect_error, bind_executor, co_spawn,
//   detached; cancellation through an
//   explicit std::stop_token (async_run's
//   overload)
//   per-operation cancellation slots           1.77+   SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS
//   (bind_cancellation_slot, co_spawn's and
//   the awaitable operators' cancellation)
//   deferred, as_tuple, bind_allocator,        1.80+   SHUTTLE_ASIO_HAS_DEFERRED
//   awaitable operators || and && (tested
//   with 1.80 and 1.81; 1.77-1.79 have
//   experimental:: forms, not tested)
//
// Boost 1.74's Asio predates all of the 1.77+/1.80+ rows: no cancellation
// slots (cancel through a std::stop_token instead), no deferred, as_tuple or
// awaitable operators (not even as experimental::).
//
// The driven-io_context mode (asio_driver.hpp) reads the epoll reactor's fd,
// an Asio internal that has been stable from Boost 1.66 to 1.90; it requires
// the epoll reactor (Linux default; not BOOST_ASIO_HAS_IO_URING_AS_DEFAULT).
// recycling.hpp uses Asio's per-thread memory cache (detail::call_stack,
// thread_info_base), the same in 1.74 and 1.81.
#pragma once

// Asio's configuration is fixed by its first header: one seen before this
// point was configured without the macros below (on clang with Boost 1.74,
// without co_await: a different awaitable, an ODR violation once linked with
// code that saw them).
#if defined(BOOST_ASIO_DETAIL_CONFIG_HPP)
#  error "a Boost.Asio header was included before <shuttle/asio/...>: include shuttle's Asio headers (or <shuttle/asio/config.hpp>) first in this file"
#endif

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

#if BOOST_ASIO_VERSION >= 102000  // Boost 1.77
#  define SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS 1
#else
#  define SHUTTLE_ASIO_HAS_CANCELLATION_SLOTS 0
#endif
#if BOOST_ASIO_VERSION >= 102400  // Boost 1.80
#  define SHUTTLE_ASIO_HAS_DEFERRED 1
#else
#  define SHUTTLE_ASIO_HAS_DEFERRED 0
#endif

namespace boost::asio {}
namespace shuttle::asio {
namespace net = ::boost::asio;
}  // namespace shuttle::asio
