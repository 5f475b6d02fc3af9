// The tcp provider's connection state (conn_state::phase) as an application
// and a raw peer see it: close() while the connection refuses its peer.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "common.hpp"
#include "wire.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

using namespace shuttle;
using namespace shuttle::tcp_wire;
using namespace transport_test;
using namespace std::chrono_literals;

namespace {

domain_options tcp_options() {
  domain_options o;
  o.kind = transport_kind::tcp;
  return o;
}

// Runs `body` on an io_context in a thread of its own. A loop that never
// returns (a coroutine spinning without giving the loop a turn) cannot be
// stopped from outside: after `limit` the process exits with a message.
void run_bounded(std::function<task<void>()> body, std::chrono::seconds limit, const char* what) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread t([&] {
    io_context ctx;
    ctx.run(body());
    std::lock_guard g(m);
    done = true;
    cv.notify_all();
  });
  std::unique_lock lk(m);
  if (!cv.wait_for(lk, limit, [&] { return done; })) {
    std::fprintf(stderr, "FAILED: %s: the loop did not return within %lld s\n", what,
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(EXIT_FAILURE);
  }
  lk.unlock();
  t.join();
}

}  // namespace

TEST_CASE("close() while refusing the peer, with an operation pending, returns once the loops end") {
  // The raw peer reads our SEND and never acknowledges it (the send stays
  // pending), then WRITEs through an rkey nobody registered: we NAK it and
  // refuse the peer. close() is called then, while the peer still holds the
  // connection open: it must wait for the loops (the NAK goes out, the
  // peer's close ends the reader), not spin on the pending operation.
  run_bounded(
      []() -> task<void> {
        auto d = domain::open(tcp_options()).value();
        auto l = d.listen(endpoint::loopback(0)).value();
        auto ep = endpoint::loopback(l.local_endpoint()->port());
        event closing;
        auto raw = [&]() -> task<void> {
          auto s = (co_await tcp_socket::connect(ep)).value();
          std::array<std::byte, hello_size> mine{}, theirs{};
          hello hh;
          hh.receive_buffers = 4;
          hh.receive_buffer_size = 1024;
          encode_hello(hh, mine);
          REQUIRE((co_await s.write_all(mine)).has_value());
          REQUIRE((co_await with_timeout(s.read_exact(theirs), 30s)).has_value());
          // The server's first frame says it reads WRITE_LIST (an ACK of seq 0, wire.hpp).
          std::array<std::byte, header_size> hb{};
          REQUIRE((co_await with_timeout(s.read_exact(hb), 30s)).has_value());
          auto announce = decode_header(hb, limits{});
          REQUIRE(announce.has_value());
          CHECK((announce->op == opcode::ack && announce->seq == 0));
          // The server's SEND, read and never acknowledged.
          REQUIRE((co_await with_timeout(s.read_exact(hb), 30s)).has_value());
          auto sent = decode_header(hb, limits{});
          REQUIRE(sent.has_value());
          CHECK(sent->op == opcode::send);
          std::vector<std::byte> payload(sent->length);
          REQUIRE((co_await with_timeout(s.read_exact(payload), 30s)).has_value());
          // A WRITE through an unknown rkey.
          header w;
          w.op = opcode::write;
          w.seq = 1;
          w.addr = 0x1000;
          w.rkey = 0x1234;
          w.length = 8;
          std::array<std::byte, header_size + 8> bad{};
          encode_header(w, std::span(bad).first<header_size>());
          REQUIRE((co_await s.write_all(bad)).has_value());
          REQUIRE((co_await with_timeout(s.read_exact(hb), 30s)).has_value());
          auto nak = decode_header(hb, limits{});
          REQUIRE(nak.has_value());
          CHECK(nak->op == opcode::nak);
          CHECK(nak->st == status::remote_access_error);
          CHECK(nak->seq == 1);
          // Held open until the application closes, then closed.
          REQUIRE((co_await with_timeout(closing.wait(), 30s)).has_value());
          s.close();
        };
        auto server = [&]() -> task<void> {
          auto c = (co_await accept_within_limit(l)).value();
          const auto msg = pattern(32, 1);
          result<void> sent = make_error_code(errc::disconnected);
          bool send_done = false;
          auto send = [&]() -> task<void> {
            sent = co_await c.send(msg);
            send_done = true;
          };
          auto close_when_refused = [&]() -> task<void> {
            const auto deadline = clock::now() + 30s;
            while (c.is_open() && clock::now() < deadline) (void)co_await sleep_for(1ms);
            REQUIRE_FALSE(c.is_open());
            CHECK_FALSE(send_done);  // pending: the peer never acknowledged it
            closing.set();
            auto r = co_await with_timeout(c.close(), 30s);
            CHECK(r.has_value());
          };
          co_await when_all(send(), close_when_refused());
          CHECK(send_done);
          REQUIRE_FALSE(sent.has_value());
          CHECK(sent.error() == make_error_code(errc::peer_access_refused));
        };
        co_await when_all(raw(), server());
        l.close();
      },
      60s, "close() while refusing the peer");
}
