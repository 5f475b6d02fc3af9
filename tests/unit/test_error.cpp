// shuttle's error codes: distinct messages, the equivalences that keep
// std::errc comparisons working, cancellation in one category.
#include <doctest/doctest.h>

#include <shuttle/shuttle.hpp>

#include <cerrno>
#include <set>
#include <string>
#include <thread>

using namespace shuttle;
using namespace std::chrono_literals;

TEST_CASE("errors: each code has its own message; the timeouts differ from ETIMEDOUT's") {
  std::set<std::string> seen;
  for (int c = static_cast<int>(errc::eof); c <= static_cast<int>(errc::unregistered_device_memory); ++c) {
    auto m = make_error_code(static_cast<errc>(c)).message();
    CHECK(m.find("unknown") == std::string::npos);
    CHECK(seen.insert(m).second);  // distinct
  }
  const auto etimedout = std::make_error_code(std::errc::timed_out).message();
  CHECK(make_error_code(errc::handshake_timeout).message() != etimedout);
  CHECK(make_error_code(errc::operation_timeout).message() != etimedout);
  CHECK(make_error_code(errc::not_a_shuttle_peer).message() != make_error_code(errc::protocol_error).message());
}

TEST_CASE("errors: the finer codes compare equal to the conditions they refine, and to nothing else") {
  const auto handshake = make_error_code(errc::handshake_timeout);
  const auto operation = make_error_code(errc::operation_timeout);
  CHECK(handshake == std::errc::timed_out);
  CHECK(operation == std::errc::timed_out);
  CHECK(handshake != operation);
  CHECK(handshake != std::make_error_code(std::errc::timed_out));  // codes compare strictly
  CHECK(matches(handshake, errc::handshake_timeout));
  CHECK_FALSE(matches(handshake, errc::operation_timeout));
  CHECK_FALSE(handshake == std::errc::operation_canceled);

  for (errc e : {errc::not_a_shuttle_peer, errc::wire_version_mismatch}) {
    const auto ec = make_error_code(e);
    CHECK(matches(ec, errc::protocol_error));
    CHECK(matches(ec, e));
    CHECK(ec != make_error_code(errc::protocol_error));
    CHECK_FALSE(ec == std::errc::timed_out);
  }
  CHECK_FALSE(matches(make_error_code(errc::protocol_error), errc::not_a_shuttle_peer));
  CHECK_FALSE(matches(make_error_code(errc::disconnected), errc::protocol_error));
  CHECK_FALSE(make_error_code(errc::idle_timeout) == std::errc::timed_out);  // unchanged
}

TEST_CASE("errors: cancellation is std::errc::operation_canceled in the generic category, wherever it is noticed") {
  io_context ctx;
  // The kernel's ECANCELED (an armed timeout cancelled), the library's own
  // (a wait never submitted), and what errno_code makes of ECANCELED.
  std::error_code armed, unsubmitted;
  {
    async_scope scope;
    auto child = [&]() -> task<void> { armed = (co_await sleep_for(10s)).error(); };
    scope.spawn(child());
    ctx.run([&]() -> task<void> {
      (void)co_await sleep_for(1ms);  // the child's timeout is armed in the ring by now
      scope.request_stop();
      co_await scope.join();
    }());
  }
  {
    async_scope scope;
    scope.request_stop();
    auto child = [&]() -> task<void> { unsubmitted = (co_await sleep_for(10s)).error(); };
    scope.spawn(child());
    ctx.run(scope.join());
  }
  for (const auto& ec : {armed, unsubmitted, errno_code(ECANCELED)}) {
    CHECK(ec == std::errc::operation_canceled);
    CHECK(ec.category() == std::generic_category());
    CHECK(ec == std::make_error_code(std::errc::operation_canceled));  // strictly the same code
  }
  CHECK(errno_code(ECONNRESET).category() == std::system_category());  // other errnos unchanged
}

TEST_CASE("errors: with_timeout says operation_timeout") {
  io_context ctx;
  auto r = ctx.run(with_timeout([]() -> task<void> { (void)co_await sleep_for(10s); }(), 1ms));
  CHECK(r.error() == make_error_code(errc::operation_timeout));
  CHECK(r.error() == std::errc::timed_out);
}

TEST_CASE("errors: a tcp_listener outside an io_context is an error, not an exception") {
  result<tcp_listener> l = std::make_error_code(std::errc::io_error);
  std::thread([&] { l = tcp_listener::bind(endpoint::loopback(0)); }).join();
  REQUIRE_FALSE(l.has_value());
  CHECK(l.error() == make_error_code(errc::no_io_context));
}
