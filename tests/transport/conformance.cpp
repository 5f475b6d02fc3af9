// Transport conformance: the same assertions against whichever provider
// SHUTTLE_TRANSPORT selects (tcp on the host, verbs in a Soft-RoCE guest).
// Every assertion is provider-neutral: only the API's documented semantics.
// Exits 77 (meson: skipped) when the selected provider is not available.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "common.hpp"

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <thread>
#include <type_traits>

using namespace shuttle;
using namespace transport_test;
using namespace std::chrono_literals;

namespace {
const std::error_code canceled = std::make_error_code(std::errc::operation_canceled);
}

TEST_CASE("send/recv: data verified, sizes up to the maximum") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    REQUIRE(p.client.is_open());
    REQUIRE(p.server.is_open());
    CHECK(p.client.kind() == p.server.kind());
    const std::size_t max = p.client.max_message_size();
    CHECK(max >= 65536);
    for (std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(100), std::size_t(4096), std::size_t(65535),
                          max}) {
      auto data = pattern(n, static_cast<unsigned>(n));
      auto [sr, rr] = co_await when_all(p.client.send(data), p.server.recv());
      REQUIRE(sr.has_value());
      REQUIRE(rr.has_value());
      CHECK(rr->size() == n);
      CHECK(std::memcmp(rr->data().data(), data.data(), n) == 0);
      CHECK_FALSE(rr->imm().has_value());
    }
    // And the other way, many messages in a row (more than the receive pool:
    // released messages return their buffers).
    for (unsigned i = 0; i < 200; ++i) {
      auto data = pattern(64 + i, i);
      auto [sr, rr] = co_await when_all(p.server.send(data), p.client.recv());
      REQUIRE(sr.has_value());
      REQUIRE(rr.has_value());
      REQUIRE(rr->size() == data.size());
      CHECK(std::memcmp(rr->data().data(), data.data(), data.size()) == 0);
    }
    co_await close_pair(p);
  }());
}

TEST_CASE("send/recv: messages arrive in order, pipelined") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    constexpr int n = 50;
    std::vector<std::array<std::uint32_t, 4>> msgs(n);
    auto sender = [](pair_t& p, std::vector<std::array<std::uint32_t, 4>>& msgs) -> task<void> {
      std::vector<task<result<void>>> sends;
      for (int i = 0; i < n; ++i) {
        msgs[i] = {std::uint32_t(i), 1, 2, 3};
        sends.push_back(p.client.send(std::as_bytes(std::span(msgs[i]))));
      }
      auto rs = co_await when_all(std::move(sends));
      for (auto& r : rs) CHECK(r.has_value());
    };
    auto receiver = [](pair_t& p) -> task<void> {
      for (int i = 0; i < n; ++i) {
        auto m = co_await p.server.recv();
        REQUIRE(m.has_value());
        std::uint32_t v;
        std::memcpy(&v, m->data().data(), 4);
        CHECK(v == std::uint32_t(i));
      }
    };
    co_await when_all(sender(p, msgs), receiver(p));
    co_await close_pair(p);
  }());
}

TEST_CASE("write, read, write_with_imm: data verified") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(1 << 20);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    CHECK(mr.size() == target.size());
    CHECK(mr.data() == target.data());
    auto rb = mr.remote();

    for (std::size_t n : {std::size_t(1), std::size_t(100), std::size_t(65536), target.size()}) {
      auto data = pattern(n, static_cast<unsigned>(n) + 1);
      auto w = co_await p.client.write(data, rb);
      REQUIRE(w.has_value());
      CHECK(std::memcmp(target.data(), data.data(), n) == 0);  // placed when the write completes
      std::vector<std::byte> back(n);
      auto r = co_await p.client.read(back, rb);
      REQUIRE(r.has_value());
      CHECK(back == data);
    }
    // At an offset, through slice().
    auto data = pattern(1000, 9);
    auto sub = rb.slice(4096, 1000).value();
    REQUIRE((co_await p.client.write(data, sub)).has_value());
    CHECK(std::memcmp(target.data() + 4096, data.data(), 1000) == 0);
    CHECK_FALSE(rb.slice(target.size() - 10, 11).has_value());

    // Remote buffer descriptors survive serialisation.
    std::array<std::byte, remote_buffer::wire_size> wire{};
    rb.serialize(wire);
    auto rb2 = remote_buffer::deserialize(wire);
    CHECK(rb2.address == rb.address);
    CHECK(rb2.rkey == rb.rkey);
    CHECK(rb2.length == rb.length);

    // write_with_imm: data placed, immediate delivered to a posted receive.
    auto imm_data = pattern(5000, 11);
    auto [w, m] = co_await when_all(p.client.write_with_imm(imm_data, rb, 0xC0FFEEu), p.server.recv());
    REQUIRE(w.has_value());
    REQUIRE(m.has_value());
    REQUIRE(m->imm().has_value());
    CHECK(*m->imm() == 0xC0FFEEu);
    CHECK(std::memcmp(target.data(), imm_data.data(), imm_data.size()) == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("prepared operations: started again and again, data verified each time") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(1 << 16);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    auto rb = mr.remote(4096, 3000);
    std::vector<std::byte> local(3000), back(3000);
    auto w = p.client.prepare(operation::write(local, rb));
    auto r = p.client.prepare(operation::read(back, rb));
    auto wi = p.client.prepare(operation::write_with_imm(local, rb, 77));
    auto s = p.client.prepare(operation::send(local));
    auto small = p.client.prepare(operation::send(std::span(local).first(16)));  // inline on verbs
    REQUIRE(small.has_value());
    REQUIRE(w.has_value());
    REQUIRE(r.has_value());
    REQUIRE(wi.has_value());
    REQUIRE(s.has_value());
    for (unsigned i = 0; i < 3; ++i) {
      // The memory is read at each start: new contents, same operation.
      auto data = pattern(local.size(), i + 1);
      std::copy(data.begin(), data.end(), local.begin());
      REQUIRE((co_await w->start()).has_value());
      CHECK(std::memcmp(target.data() + 4096, data.data(), data.size()) == 0);
      std::fill(target.begin() + 4096, target.begin() + 4096 + 3000, std::byte{0});
      auto [a, m] = co_await when_all(wi->start(), p.server.recv());
      REQUIRE(a.has_value());
      REQUIRE(m.has_value());
      CHECK(m->imm() == std::optional<std::uint32_t>(77));
      CHECK(std::memcmp(target.data() + 4096, data.data(), data.size()) == 0);
      std::fill(back.begin(), back.end(), std::byte{0});
      REQUIRE((co_await r->start()).has_value());
      CHECK(back == data);
      auto [b, m2] = co_await when_all(s->start(), p.server.recv());
      REQUIRE(b.has_value());
      REQUIRE(m2.has_value());
      CHECK(std::equal(m2->data().begin(), m2->data().end(), data.begin(), data.end()));
      auto [c, m3] = co_await when_all(small->start(), p.server.recv());
      REQUIRE(c.has_value());
      REQUIRE(m3.has_value());
      CHECK(std::equal(m3->data().begin(), m3->data().end(), data.begin(), data.begin() + 16));
      CHECK_FALSE(w->busy());
    }
    // As a task (with_timeout takes it).
    auto t = co_await with_timeout(as_task(r->start()), 5s);
    CHECK(t.has_value());
    // A refused access fails that start and, as any operation, the connection.
    auto bad = p.client.prepare(operation::read(back, mr.remote(target.size() - 10, 3000 + 10)));
    REQUIRE(bad.has_value());
    auto e = co_await bad->start();
    CHECK(is_error(e.error(), errc::remote_access_error));
    auto after = co_await r->start();
    CHECK(is_error(after.error(), errc::disconnected));
    co_await close_pair(p);
  }());
}

TEST_CASE("prepared operations: started while other completions arrive, nothing lost") {
  // Each start's own completion may not be the next one its side sees: the
  // peer's messages arrive in between (on verbs: receive completions in the
  // client's CQ ahead of the read's). Every read returns the data of its
  // round, every write lands, and every message is received.
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(8192);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    std::vector<std::byte> back(64), out(64);
    auto r = p.client.prepare(operation::read(back, mr.remote(1024, back.size())));
    auto w = p.client.prepare(operation::write(out, mr.remote(4096, out.size())));
    REQUIRE(r.has_value());
    REQUIRE(w.has_value());
    constexpr unsigned rounds = 100;  // more than a loop turn's inline looks at the CQ
    for (unsigned i = 0; i < rounds; ++i) {
      auto data = pattern(back.size(), i);
      std::copy(data.begin(), data.end(), target.begin() + 1024);
      auto next = pattern(out.size(), i + 1000);
      std::copy(next.begin(), next.end(), out.begin());
      auto msg = pattern(8 + i % 32, i + 2000);
      auto [sent, got, put] = co_await when_all(p.server.send(msg), r->start(), w->start());
      REQUIRE(sent.has_value());
      REQUIRE(got.has_value());
      REQUIRE(put.has_value());
      CHECK(back == data);
      CHECK(std::equal(next.begin(), next.end(), target.begin() + 4096));
      // Taken after the starts (the receive credits bound how many can wait).
      auto m = co_await p.client.recv();
      REQUIRE(m.has_value());
      CHECK(std::equal(m->data().begin(), m->data().end(), msg.begin(), msg.end()));
    }
    co_await close_pair(p);
  }());
}

TEST_CASE("prepared operations: bad arguments, one start at a time, cancellation, destroyed while started") {
  std::size_t size = 100;  // above max_inline_data: signaled
  SUBCASE("a signaled send") { size = 100; }
  SUBCASE("an inline send (verbs)") { size = 16; }
  io_context ctx;
  // ctx.run returns when the task is done: the capture outlives it.
  ctx.run([size]() -> task<void> {
    connection_options opts;
    opts.receive_buffers = 1;
    opts.receive_buffer_size = 1024;
    pair_t p;
    co_await make_pair(p, opts);
    auto msg = pattern(size, 3);
    auto big = pattern(2000, 4);
    auto over = p.client.prepare(operation::send(big));
    CHECK(is_error(over.error(), errc::message_too_long));
    prepared_operation empty;
    CHECK_FALSE(empty);
    CHECK((co_await empty.start()).error() == std::make_error_code(std::errc::invalid_argument));
    connection none;
    CHECK(is_error(none.prepare(operation::send(msg)).error(), errc::disconnected));

    auto s = p.client.prepare(operation::send(msg));
    REQUIRE(s.has_value());
    REQUIRE((co_await s->start()).has_value());  // takes the peer's only credit
    // The next start waits for a credit; a second one meanwhile is refused.
    async_scope scope;
    std::optional<result<void>> first;
    auto starter = [](prepared_operation& op, std::optional<result<void>>& out) -> task<void> {
      out.emplace(co_await op.start());
    };
    scope.spawn(starter(*s, first));
    (void)co_await sleep_for(50ms);
    CHECK_FALSE(first.has_value());
    CHECK(s->busy());
    CHECK((co_await s->start()).error() == std::make_error_code(std::errc::operation_in_progress));
    // Cancelled while it waits for the credit: cancelled alone.
    scope.request_stop();
    co_await scope.join();
    REQUIRE(first.has_value());
    CHECK(first->error() == canceled);
    CHECK_FALSE(s->busy());
    CHECK(p.client.is_open());
    {
      auto m = co_await p.server.recv();  // the credit comes back
      REQUIRE(m.has_value());
    }
    // Started again: it works on. Then one that waits, its prepared_operation
    // destroyed meanwhile: the start still ends normally.
    REQUIRE((co_await s->start()).has_value());
    async_scope scope2;
    std::optional<result<void>> second;
    scope2.spawn(starter(*s, second));
    (void)co_await sleep_for(20ms);
    CHECK_FALSE(second.has_value());
    *s = prepared_operation{};  // destroyed while its start waits
    for (int i = 0; i < 2; ++i) {
      auto m = co_await p.server.recv();
      REQUIRE(m.has_value());
      CHECK(m->size() == msg.size());
    }
    co_await scope2.join();
    REQUIRE(second.has_value());
    CHECK(second->has_value());
    // After close, a start fails.
    auto w = p.client.prepare(operation::send(msg));
    REQUIRE(w.has_value());
    co_await close_pair(p);
    CHECK(is_error((co_await w->start()).error(), errc::disconnected));
  }());
}

TEST_CASE("registration cache and deregistration") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> buf(8192);
    auto a = p.server_domain->register_memory(buf, access::all).value();
    auto b = p.server_domain->register_memory(buf, access::all).value();
    // A second registration of the range: tcp may serve it from its cache;
    // verbs registers anew (docs/memory-registration.md). Either is valid
    // until both handles are gone.
    CHECK(b.remote().address == a.remote().address);
    auto rb = a.remote();
    a = memory_region{};
    b = memory_region{};
    // Deregistered: the old rkey is refused.
    auto data = pattern(16, 1);
    auto w = co_await p.client.write(data, rb);
    REQUIRE_FALSE(w.has_value());
    CHECK(is_error(w.error(), errc::remote_access_error));
    co_await close_pair(p);
  }());
}

TEST_CASE("atomics: compare_and_swap and fetch_and_add") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    alignas(8) std::array<std::uint64_t, 4> words{10, 20, 30, 40};
    auto mr = p.server_domain->register_memory(std::as_writable_bytes(std::span(words)), access::all).value();
    auto w1 = mr.remote(8, 8);

    auto c = co_await p.client.compare_and_swap(w1, 20, 21);  // matches
    REQUIRE(c.has_value());
    CHECK(*c == 20);
    CHECK(words[1] == 21);
    c = co_await p.client.compare_and_swap(w1, 20, 99);  // does not match
    REQUIRE(c.has_value());
    CHECK(*c == 21);
    CHECK(words[1] == 21);

    auto f = co_await p.client.fetch_and_add(mr.remote(16, 8), 5);
    REQUIRE(f.has_value());
    CHECK(*f == 30);
    CHECK(words[2] == 35);
    CHECK(words[0] == 10);
    CHECK(words[3] == 40);

    // Concurrent fetch_and_add from many ops: exact total, distinct old values.
    constexpr int per_side = 100;
    std::vector<task<result<std::uint64_t>>> ops;
    for (int i = 0; i < per_side; ++i) ops.push_back(p.client.fetch_and_add(mr.remote(24, 8), 3));
    auto rs = co_await when_all(std::move(ops));
    std::vector<std::uint64_t> olds;
    for (auto& r : rs) {
      REQUIRE(r.has_value());
      olds.push_back(*r);
    }
    CHECK(words[3] == 40 + 3 * per_side);
    std::sort(olds.begin(), olds.end());
    for (int i = 0; i < per_side; ++i) CHECK(olds[i] == 40 + 3 * std::uint64_t(i));  // each saw a distinct value
    co_await close_pair(p);
  }());
}

// Both providers refuse a misaligned atomic locally (verbs requires 8-byte
// alignment), and the connection stays usable.
TEST_CASE("atomics: a misaligned word fails with invalid_argument; the connection stays usable") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    alignas(8) std::array<std::uint64_t, 3> words{10, 20, 30};
    auto mr = p.server_domain->register_memory(std::as_writable_bytes(std::span(words)), access::all).value();
    auto c = co_await p.client.compare_and_swap(mr.remote(4, 8), 0, 1);
    REQUIRE_FALSE(c.has_value());
    CHECK(c.error() == std::errc::invalid_argument);
    auto f = co_await p.client.fetch_and_add(mr.remote(12, 8), 1);
    REQUIRE_FALSE(f.has_value());
    CHECK(f.error() == std::errc::invalid_argument);
    CHECK(words[0] == 10);
    CHECK(words[1] == 20);
    f = co_await p.client.fetch_and_add(mr.remote(8, 8), 5);  // still usable
    REQUIRE(f.has_value());
    CHECK(*f == 20);
    CHECK(words[1] == 25);
    co_await close_pair(p);
  }());
}

TEST_CASE("atomics: several connections add to one word") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    std::optional<domain> sd(domain::open().value());
    alignas(8) std::uint64_t counter = 0;
    auto mr = sd->register_memory(std::as_writable_bytes(std::span(&counter, 1)), access::all).value();
    auto l = sd->listen(test_endpoint(0)).value();
    auto ep = test_endpoint(l.local_endpoint()->port());
    constexpr int conns = 4, per = 50;
    std::vector<pair_t> ps(conns);
    for (auto& p : ps) {
      p.client_domain.emplace(domain::open().value());
      auto [s, c] = co_await when_all(accept_within_limit(l), p.client_domain->connect(ep));
      p.server = std::move(s).value();
      p.client = std::move(c).value();
    }
    std::vector<task<result<std::uint64_t>>> ops;
    for (int i = 0; i < per; ++i)
      for (auto& p : ps) ops.push_back(p.client.fetch_and_add(mr.remote(), 1));
    auto rs = co_await when_all(std::move(ops));
    for (auto& r : rs) CHECK(r.has_value());
    CHECK(counter == std::uint64_t(conns * per));
    for (auto& p : ps) co_await close_pair(p);
    l.close();
  }());
}

TEST_CASE("ordering: a write followed by a send is visible when the send arrives") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(256 * 1024);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    for (unsigned round = 0; round < 20; ++round) {
      auto data = pattern(target.size(), round + 100);
      std::array<std::byte, 4> note{std::byte(round)};
      auto checker = [](pair_t& p, std::vector<std::byte>& target, std::vector<std::byte>& data,
                        unsigned round) -> task<void> {
        auto m = co_await p.server.recv();
        REQUIRE(m.has_value());
        CHECK(m->data()[0] == std::byte(round));
        CHECK(std::memcmp(target.data(), data.data(), target.size()) == 0);
      };
      auto writer = [](pair_t& p, std::vector<std::byte>& data, remote_buffer rb,
                       std::span<const std::byte> note) -> task<void> {
        // Both posted back to back; the send is not awaited before the write.
        auto [w, s] = co_await when_all(p.client.write(data, rb), p.client.send(note));
        CHECK(w.has_value());
        CHECK(s.has_value());
      };
      co_await when_all(checker(p, target, data, round), writer(p, data, mr.remote(), note));
    }
    co_await close_pair(p);
  }());
}

TEST_CASE("remote access errors: bad rkey, out of bounds, missing rights; memory around untouched") {
  struct variant_t {
    const char* name;
    unsigned access;
    int op;  // 0 write, 1 read, 2 faa, 3 cas, 4 write_with_imm
    std::int64_t offset;  // relative to the region start
    std::size_t len;
    bool bad_rkey;
  };
  const variant_t variants[] = {
      {"write, bad rkey", access::all, 0, 0, 64, true},
      {"read, bad rkey", access::all, 1, 0, 64, true},
      {"write past the end", access::all, 0, 4096 - 32, 64, false},
      {"write before the start", access::all, 0, -16, 64, false},
      {"read past the end", access::all, 1, 4000, 200, false},
      {"write without remote_write", access::local_write | access::remote_read, 0, 0, 64, false},
      {"write_with_imm without remote_write", access::local_write | access::remote_read, 4, 0, 64, false},
      {"read without remote_read", access::local_write | access::remote_write, 1, 0, 64, false},
      {"fetch_and_add without remote_atomic", access::local_write | access::remote_write | access::remote_read, 2,
       0, 8, false},
      {"compare_and_swap without remote_atomic", access::local_write | access::remote_read, 3, 0, 8, false},
      {"fetch_and_add past the end", access::all, 2, 4096, 8, false},
  };
  for (const auto& v : variants) {
    SUBCASE(v.name) {
      io_context ctx;
      ctx.run([&]() -> task<void> {
        pair_t p;
        co_await make_pair(p);
        // A region in the middle of guard pages.
        std::vector<std::byte> mem(3 * 4096, std::byte{0x5A});
        std::span<std::byte> region(mem.data() + 4096, 4096);
        auto mr = p.server_domain->register_memory(region, v.access).value();
        remote_buffer rb{mr.remote().address + v.offset, mr.rkey() + (v.bad_rkey ? 0x1234567u : 0u), v.len};
        auto data = pattern(v.len, 3);
        std::vector<std::byte> local(v.len);
        std::error_code ec;
        switch (v.op) {
          case 0: ec = (co_await p.client.write(data, rb)).error(); break;
          case 1: ec = (co_await p.client.read(local, rb)).error(); break;
          case 2: ec = (co_await p.client.fetch_and_add(rb, 1)).error(); break;
          case 3: ec = (co_await p.client.compare_and_swap(rb, 0x5A5A5A5A5A5A5A5Aull, 1)).error(); break;
          case 4: ec = (co_await p.client.write_with_imm(data, rb, 7)).error(); break;
        }
        CHECK(ec == make_error_code(errc::remote_access_error));
        // Nothing was touched, inside or around the region.
        CHECK(std::all_of(mem.begin(), mem.end(), [](std::byte b) { return b == std::byte{0x5A}; }));
        if (v.op == 1) CHECK(std::all_of(local.begin(), local.end(), [](std::byte b) { return b == std::byte{0}; }));
        // The connection is in the error state: later operations fail.
        CHECK_FALSE(p.client.is_open());
        auto again = co_await p.client.send(data);
        CHECK(is_error(again.error(), errc::disconnected));
        auto r2 = co_await p.client.read(local, mr.remote(0, v.len));
        CHECK(is_error(r2.error(), errc::disconnected));
        co_await close_pair(p);
      }());
    }
  }
}

TEST_CASE("a refused access reaches the initiator even when the target drops its connection at once") {
  // The target application (an echo server) drops its connection the moment
  // an operation fails: the refusal must still reach the
  // initiator as remote_access_error, every time. On tcp the target learns
  // why (peer_access_refused), and so do its later operations.
  io_context ctx;
  const bool tcp = domain::open().value().kind() == transport_kind::tcp;
  const int rounds = tcp ? 50 : 3;  // the Soft-RoCE guest is slow
  ctx.run([&]() -> task<void> {
    for (int i = 0; i < rounds; ++i) {
      CAPTURE(i);
      pair_t p;
      co_await make_pair(p);
      std::vector<std::byte> region(4096);
      auto mr = p.server_domain->register_memory(region, access::local_write | access::remote_read).value();
      auto data = pattern(64, static_cast<unsigned>(i));
      // An echo server: what it receives it sends back, until an error.
      std::error_code tec;  // what the target's operation failed with
      auto target = [&]() -> task<void> {
        std::error_code ec;
        for (;;) {
          auto m = co_await p.server.recv();  // no with_timeout here: it would delay the drop by a turn
          if (!m) {
            ec = m.error();
            break;
          }
          std::vector<std::byte> copy(m->data().begin(), m->data().end());
          m->reset();
          auto e = co_await p.server.send(copy);
          if (!e) {
            ec = e.error();
            break;
          }
        }
        if (tcp && ec) {
          auto later = co_await p.server.send(data);
          CHECK(is_error(later.error(), errc::peer_access_refused));
        }
        p.server = connection{};  // dropped at once
        tec = ec;
      };
      // A few echoes (round i: i % 4 of them), then the refused write.
      auto initiator = [&]() -> task<result<void>> {
        for (int k = 0; k < i % 4; ++k) {
          auto [s, m] = co_await when_all(with_timeout(p.client.send(data), 30s), with_timeout(p.client.recv(), 30s));
          if (!s || !m) co_return make_error_code(errc::protocol_error);  // not what this test is about
        }
        co_return co_await with_timeout(p.client.write(data, mr.remote(0, 64)), 30s);
      };
      auto [w, t] = co_await when_all(initiator(), with_timeout(target(), 60s));
      REQUIRE_FALSE(w.has_value());
      CHECK(is_error(w.error(), errc::remote_access_error));
      REQUIRE(t.has_value());
      REQUIRE(tec);
      if (tcp) CHECK(is_error(tec, errc::peer_access_refused));
      CHECK(std::all_of(region.begin(), region.end(), [](std::byte b) { return b == std::byte{0}; }));
      co_await close_pair(p);
    }
  }());
}

TEST_CASE("operations queued behind a failing one fail with disconnected") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> region(4096);
    auto mr = p.server_domain->register_memory(region, access::all).value();
    auto good = pattern(64, 1);
    remote_buffer bad{mr.remote().address, mr.rkey() ^ 0x8000u, 64};
    auto [a, b, c] = co_await when_all(p.client.write(good, mr.remote(0, 64)), p.client.write(good, bad),
                                       p.client.write(good, mr.remote(64, 64)));
    CHECK(a.has_value());
    CHECK(is_error(b.error(), errc::remote_access_error));
    CHECK(is_error(c.error(), errc::disconnected));
    CHECK(std::memcmp(region.data(), good.data(), 64) == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("post_batch: in order, data verified, chunked beyond the send queue and the credits") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options opts;
    opts.send_queue_depth = 8;  // batches below are larger: posted in chunks
    opts.receive_buffers = 4;
    pair_t p;
    co_await make_pair(p, opts);
    CHECK((co_await p.client.post_batch({})).has_value());  // empty: done at once
    std::vector<std::byte> target(1 << 20);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    // 100 writes: 1..99 to their own 4 KiB slot (a small one inline, the
    // rest registered), all of them also to slot 0 in order: the last wins.
    constexpr int n = 100;
    std::vector<std::vector<std::byte>> data;
    std::vector<operation> ops;
    for (int i = 0; i < n; ++i) data.push_back(pattern(i % 3 == 0 ? 16 : 4096, static_cast<unsigned>(i) + 1));
    for (int i = 0; i < n; ++i) {
      ops.push_back(operation::write(data[i], mr.remote(0, data[i].size())));
      if (i > 0) ops.push_back(operation::write(data[i], mr.remote(std::size_t(i) * 4096, data[i].size())));
    }
    // Then a read of slot 0 (RC: after the writes) and a send that tells the
    // server everything landed.
    std::vector<std::byte> back(data[n - 1].size());
    ops.push_back(operation::read(back, mr.remote(0, back.size())));
    std::array<std::byte, 4> done_msg{std::byte{'d'}, std::byte{'o'}, std::byte{'n'}, std::byte{'e'}};
    ops.push_back(operation::send(done_msg));
    auto [br, m] = co_await when_all(p.client.post_batch(ops), p.server.recv());
    REQUIRE(br.has_value());
    REQUIRE(m.has_value());
    CHECK(m->size() == 4);
    CHECK(back == data[n - 1]);
    CHECK(std::memcmp(target.data(), data[n - 1].data(), data[n - 1].size()) == 0);
    for (int i = 1; i < n; ++i) CHECK(std::memcmp(target.data() + i * 4096, data[i].data(), data[i].size()) == 0);

    // Sends and write_with_imm, ten times the peer's credits, in one batch;
    // the receiver sees them in order.
    constexpr int k = 40;
    std::vector<std::array<std::uint32_t, 8>> msgs(k);
    std::vector<operation> sends;
    for (int i = 0; i < k; ++i) {
      msgs[i].fill(std::uint32_t(i));
      if (i % 4 == 3)
        sends.push_back(operation::write_with_imm(std::as_bytes(std::span(msgs[i])), mr.remote(4096 * 200, 32),
                                                  std::uint32_t(i)));
      else
        sends.push_back(operation::send(std::as_bytes(std::span(msgs[i]))));
    }
    auto receiver = [](connection& c) -> task<int> {
      int good = 0;
      for (int i = 0; i < k; ++i) {
        auto r = co_await c.recv();
        if (!r) co_return good;
        if (i % 4 == 3) {
          good += r->imm() == std::optional<std::uint32_t>(std::uint32_t(i));
        } else {
          std::uint32_t v = 0;
          if (r->size() == 32) std::memcpy(&v, r->data().data(), 4);
          good += r->size() == 32 && v == std::uint32_t(i) && !r->imm();
        }
        (void)co_await sleep_for(std::chrono::microseconds(200));  // slow consumer: credits run out
      }
      co_return good;
    };
    auto [sr, good] = co_await when_all(p.client.post_batch(sends), receiver(p.server));
    CHECK(sr.has_value());
    CHECK(good == k);
    CHECK(p.client.is_open());

    // Batches and single operations interleave safely.
    auto one = pattern(512, 77);
    auto [b1, w1, b2] = co_await when_all(p.client.post_batch(std::span(ops).first(20)),
                                          p.client.write(one, mr.remote(4096 * 250, one.size())),
                                          p.client.post_batch(std::span(ops).subspan(20, 20)));
    CHECK(b1.has_value());
    CHECK(w1.has_value());
    CHECK(b2.has_value());
    CHECK(std::memcmp(target.data() + 4096 * 250, one.data(), one.size()) == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("post_batch: an error in the middle fails the batch with that error; later ones not done") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> region(16 * 4096, std::byte{0x5A});
    auto mr = p.server_domain->register_memory(region, access::all).value();
    remote_buffer bad{mr.remote().address, mr.rkey() ^ 0x8000u, 64};
    std::vector<std::vector<std::byte>> data;
    for (int i = 0; i < 10; ++i) data.push_back(pattern(1024, static_cast<unsigned>(i) + 5));
    std::vector<operation> ops;
    for (int i = 0; i < 10; ++i) {
      if (i == 4)
        ops.push_back(operation::write(data[i], bad));
      else
        ops.push_back(operation::write(data[i], mr.remote(std::size_t(i) * 4096, 1024)));
    }
    auto r = co_await p.client.post_batch(ops);
    REQUIRE_FALSE(r.has_value());
    CHECK(matches(r.error(), errc::remote_access_error));
    for (int i = 0; i < 4; ++i) CHECK(std::memcmp(region.data() + i * 4096, data[i].data(), 1024) == 0);
    // Nothing after the failing one was performed.
    CHECK(std::all_of(region.begin() + 4 * 4096, region.end(), [](std::byte b) { return b == std::byte{0x5A}; }));
    CHECK_FALSE(p.client.is_open());
    auto again = co_await p.client.post_batch(std::span(ops).first(1));
    CHECK(is_error(again.error(), errc::disconnected));
    co_await close_pair(p);
  }());
}

TEST_CASE("post_batch: an oversize send is refused before anything is posted") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> region(4096);
    auto mr = p.server_domain->register_memory(region, access::all).value();
    auto small = pattern(100, 1);
    std::vector<std::byte> huge(p.client.max_message_size() + 1);
    std::vector<operation> ops{operation::write(small, mr.remote(0, 100)), operation::send(huge)};
    auto r = co_await p.client.post_batch(ops);
    CHECK(is_error(r.error(), errc::message_too_long));
    CHECK(std::all_of(region.begin(), region.end(), [](std::byte b) { return b == std::byte{0}; }));
    CHECK(p.client.is_open());
    CHECK((co_await p.client.post_batch(std::span(ops).first(1))).has_value());
    CHECK(std::memcmp(region.data(), small.data(), 100) == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("write/read over 2^31 bytes fail with message_too_long; the connection stays usable") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> region(4096);
    auto mr = p.server_domain->register_memory(region, access::all).value();
    // Address space only (PROT_NONE, no reserve): the length must be
    // refused before any byte is touched, registered or posted.
    const std::size_t too_long = (std::size_t(1) << 31) + 1;
    const std::size_t map_len = (std::size_t(1) << 31) + 4096;
    void* va = ::mmap(nullptr, map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(va != MAP_FAILED);
    std::span<std::byte> huge(static_cast<std::byte*>(va), too_long);
    remote_buffer far = mr.remote(0, 4096);
    far.length = too_long;
    auto w = co_await p.client.write(huge, far);
    REQUIRE_FALSE(w.has_value());
    CHECK(is_error(w.error(), errc::message_too_long));
    auto r = co_await p.client.read(huge, far);
    REQUIRE_FALSE(r.has_value());
    CHECK(is_error(r.error(), errc::message_too_long));
    ::munmap(va, map_len);
    CHECK(std::all_of(region.begin(), region.end(), [](std::byte b) { return b == std::byte{0}; }));
    CHECK(p.client.is_open());
    auto small = pattern(100, 3);
    CHECK((co_await p.client.write(small, mr.remote(0, 100))).has_value());
    CHECK(std::memcmp(region.data(), small.data(), 100) == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("shared receive queue: many connections on one SRQ, data verified, no RNR (or not_supported)") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options opts;
    opts.shared_receive_queue = true;
    opts.receive_buffers = 4;
    opts.receive_buffer_size = 4096;
    auto sd = domain::open().value();
    auto cd = domain::open().value();
    auto l = sd.listen(test_endpoint(0), opts);
    if (!l) {
      // A provider without SRQs says so, on both ends; it never ignores the option.
      CHECK(is_error(l.error(), errc::not_supported));
      auto c = co_await cd.connect(test_endpoint(1), opts);
      CHECK(is_error(c.error(), errc::not_supported));
      co_return;
    }
    auto ep = test_endpoint(l->local_endpoint()->port());
    constexpr int nconn = 8, per = 60;
    connection_options copts;  // the clients: own receive queues
    copts.receive_buffers = 4;
    copts.receive_buffer_size = 4096;
    std::vector<connection> server_side, client_side;
    for (int i = 0; i < nconn; ++i) {
      auto [s, c] = co_await when_all(accept_within_limit(*l), cd.connect(ep, copts));
      REQUIRE(s.has_value());
      REQUIRE(c.has_value());
      server_side.push_back(std::move(*s));
      client_side.push_back(std::move(*c));
    }
    // Every client sends `per` messages (15x the credits) in batches; one
    // server connection consumes slowly, the others fast: the SRQ is shared
    // unevenly and still nothing is lost.
    auto sender = [](connection& c, int id) -> task<bool> {
      for (int b = 0; b < per / 10; ++b) {
        std::vector<std::array<std::uint32_t, 64>> m(10);
        std::vector<operation> ops;
        for (int j = 0; j < 10; ++j) {
          m[j].fill(std::uint32_t(id * 1000 + b * 10 + j));
          ops.push_back(operation::send(std::as_bytes(std::span(m[j]))));
        }
        if (!(co_await c.post_batch(ops))) co_return false;
      }
      co_return true;
    };
    auto receiver = [](connection& c, int id) -> task<int> {
      int good = 0;
      std::vector<message> held;
      for (int i = 0; i < per; ++i) {
        auto m = co_await c.recv();
        if (!m) co_return good;
        std::uint32_t v = 0;
        if (m->size() == 256) std::memcpy(&v, m->data().data() + 4 * (i % 64), 4);
        good += m->size() == 256 && v == std::uint32_t(id * 1000 + i);
        if (id == 0) {
          (void)co_await sleep_for(std::chrono::microseconds(500));
          if (held.size() < 3) held.push_back(std::move(*m));  // hold a few buffers a while
        }
      }
      co_return good;
    };
    std::vector<task<bool>> sends;
    std::vector<task<int>> recvs;
    for (int i = 0; i < nconn; ++i) {
      sends.push_back(sender(client_side[i], i));
      recvs.push_back(receiver(server_side[i], i));
    }
    auto [oks, goods] = co_await when_all(when_all(std::move(sends)), when_all(std::move(recvs)));
    for (int i = 0; i < nconn; ++i) {
      CHECK(oks[i]);
      CHECK(goods[i] == per);
      CHECK(server_side[i].is_open());
      CHECK(client_side[i].is_open());
    }
    // A later connection reuses the SRQ (and its buffers); a larger buffer size than the SRQ's is refused.
    server_side.clear();
    client_side.clear();
    auto [s2, c2] = co_await when_all(accept_within_limit(*l), cd.connect(ep, copts));
    REQUIRE(s2.has_value());
    REQUIRE(c2.has_value());
    auto d = pattern(1000, 3);
    auto [sr, rr] = co_await when_all(c2->send(d), s2->recv());
    CHECK(sr.has_value());
    REQUIRE(rr.has_value());
    CHECK(std::equal(rr->data().begin(), rr->data().end(), d.begin(), d.end()));
    rr->reset();
    connection_options bigger = opts;
    bigger.receive_buffer_size = 8192;
    auto l2 = sd.listen(test_endpoint(0), bigger).value();
    auto [s3, c3] = co_await when_all(with_timeout(l2.accept(), std::chrono::seconds(2)),
                                      cd.connect(test_endpoint(l2.local_endpoint()->port()), copts));
    CHECK_FALSE(c3.has_value());  // the server refuses: its SRQ's buffers are smaller
    (void)s3;
    (void)co_await c2->close();
    (void)co_await s2->close();
    l->close();
    l2.close();
  }());
}

TEST_CASE("oversize send fails with message_too_long; the connection stays usable") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> big(p.client.max_message_size() + 1);
    auto r = co_await p.client.send(big);
    CHECK(is_error(r.error(), errc::message_too_long));
    CHECK(p.client.is_open());
    auto small = pattern(10, 1);
    auto [s, m] = co_await when_all(p.client.send(small), p.server.recv());
    CHECK(s.has_value());
    REQUIRE(m.has_value());
    CHECK(m->size() == 10);
    co_await close_pair(p);
  }());
}

TEST_CASE("peer disconnect fails pending operations") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    auto pending_recv = [](pair_t& p, std::error_code& out) -> task<void> {
      auto m = co_await p.client.recv();
      out = m.error();
    };
    auto drop_server = [](pair_t& p) -> task<void> {
      (void)co_await sleep_for(20ms);
      p.server = connection{};  // aborts
    };
    std::error_code recv_error;
    co_await when_all(pending_recv(p, recv_error), drop_server(p));
    CHECK(recv_error);
    // Later operations fail too, without hanging.
    std::vector<std::byte> buf(64);
    auto w = co_await with_timeout(p.client.send(buf), 5s);
    CHECK_FALSE(w.has_value());
    CHECK(w.error() != std::make_error_code(std::errc::timed_out));
    CHECK_FALSE(p.client.is_open());
    co_await close_pair(p);
  }());
}

TEST_CASE("graceful close: in-flight operations finish first, then the peer sees the disconnect") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(1 << 20);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    auto data = pattern(target.size(), 5);
    auto [w, c] = co_await when_all(p.client.write(data, mr.remote()), p.client.close());
    CHECK(w.has_value());
    CHECK(c.has_value());
    CHECK(target == data);
    CHECK_FALSE(p.client.is_open());
    auto m = co_await with_timeout(p.server.recv(), 5s);
    CHECK(is_error(m.error(), errc::disconnected));
    co_await close_pair(p);
  }());
}

TEST_CASE("cancellation: an operation waiting for a credit is cancelled alone") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options opts;
    opts.receive_buffers = 2;
    opts.receive_buffer_size = 1024;
    pair_t p;
    co_await make_pair(p, opts);
    auto msg = pattern(100, 1);
    // Fill the peer's receive buffers; nobody receives yet.
    REQUIRE((co_await p.client.send(msg)).has_value());
    REQUIRE((co_await p.client.send(msg)).has_value());
    async_scope scope;
    std::optional<result<void>> third;
    auto sender = [](pair_t& p, std::span<const std::byte> msg, std::optional<result<void>>& out) -> task<void> {
      out.emplace(co_await p.client.send(msg));
    };
    scope.spawn(sender(p, msg, third));
    (void)co_await sleep_for(50ms);
    CHECK_FALSE(third.has_value());  // waiting for a credit
    scope.request_stop();
    co_await scope.join();
    REQUIRE(third.has_value());
    CHECK(third->error() == canceled);
    CHECK(p.client.is_open());
    // Receiving frees the buffers; the connection works on.
    for (int i = 0; i < 2; ++i) {
      auto m = co_await p.server.recv();
      REQUIRE(m.has_value());
    }
    auto [s, m] = co_await when_all(p.client.send(msg), p.server.recv());
    CHECK(s.has_value());
    REQUIRE(m.has_value());
    CHECK(m->size() == msg.size());
    co_await close_pair(p);
  }());
}

TEST_CASE("cancellation: a pending recv is cancelled alone") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    auto r = co_await with_timeout(p.server.recv(), 30ms);
    CHECK(r.error() == make_error_code(errc::operation_timeout));
    CHECK(p.server.is_open());
    auto msg = pattern(10, 2);
    auto [s, m] = co_await when_all(p.client.send(msg), p.server.recv());
    CHECK(s.has_value());
    CHECK(m.has_value());
    co_await close_pair(p);
  }());
}

TEST_CASE("recv: concurrent receivers are served oldest first; a cancelled one takes nothing") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::array<std::optional<result<message>>, 3> got;
    auto receiver = [](connection& c, std::optional<result<message>>& out, bool give_up) -> task<void> {
      if (give_up)
        out.emplace(co_await with_timeout(c.recv(), 20ms));
      else
        out.emplace(co_await c.recv());
    };
    async_scope scope;
    for (std::size_t i = 0; i < got.size(); ++i) scope.spawn(receiver(p.server, got[i], i == 1));
    (void)co_await sleep_for(60ms);  // the middle one has timed out, the others still wait
    REQUIRE(got[1].has_value());
    CHECK(got[1]->error() == make_error_code(errc::operation_timeout));
    CHECK_FALSE(got[0].has_value());
    CHECK_FALSE(got[2].has_value());
    std::array<std::vector<std::byte>, 3> msgs{pattern(5, 10), pattern(6, 11), pattern(7, 12)};
    for (auto& m : msgs) REQUIRE(co_await p.client.send(m));
    co_await scope.join();
    REQUIRE(got[0].has_value());
    REQUIRE(got[2].has_value());
    REQUIRE(got[0]->has_value());
    REQUIRE(got[2]->has_value());
    CHECK(same((*got[0])->data(), msgs[0]));
    CHECK(same((*got[2])->data(), msgs[1]));
    auto last = co_await with_timeout(p.server.recv(), 5s);  // the third message was kept for a later recv
    REQUIRE(last.has_value());
    CHECK(same(last->data(), msgs[2]));
    got = {};
    co_await close_pair(p);
  }());
}

TEST_CASE("connection_op: awaited directly, as a task, or through when_all / with_timeout") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(64);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    auto data = pattern(64, 3);
    // Converted to a task and awaited later: nothing runs before the await.
    task<result<void>> w = p.client.write(data, mr.remote());
    CHECK(std::all_of(target.begin(), target.end(), [](std::byte b) { return b == std::byte{0}; }));
    CHECK((co_await std::move(w)).has_value());
    CHECK(same(target, data));
    // Moved before it is awaited.
    auto op = p.client.fetch_and_add(mr.remote(0, 8), 1);
    auto moved = std::move(op);
    auto before = co_await std::move(moved);
    REQUIRE(before.has_value());
    auto again = co_await with_timeout(p.client.fetch_and_add(mr.remote(0, 8), 1), 5s);
    REQUIRE(again.has_value());
    CHECK(*again == *before + 1);
    // A default-constructed connection: its operations fail, nothing crashes.
    connection none;
    auto r = co_await none.send(data);
    CHECK(is_error(r.error(), errc::disconnected));
    auto m = co_await none.recv();
    CHECK(is_error(m.error(), errc::disconnected));
    std::vector<std::byte> back(64);
    CHECK(is_error((co_await none.write(data, mr.remote())).error(), errc::disconnected));
    CHECK(is_error((co_await none.write_with_imm(data, mr.remote(), 7)).error(), errc::disconnected));
    CHECK(is_error((co_await none.read(back, mr.remote())).error(), errc::disconnected));
    CHECK(is_error((co_await none.compare_and_swap(mr.remote(0, 8), 0, 1)).error(), errc::disconnected));
    CHECK(is_error((co_await none.fetch_and_add(mr.remote(0, 8), 1)).error(), errc::disconnected));
    // Moved from: the same; the connection it moved to works.
    connection moved_to = std::move(p.client);
    CHECK(is_error((co_await p.client.read(back, mr.remote())).error(), errc::disconnected));
    REQUIRE((co_await moved_to.read(back, mr.remote())).has_value());
    CHECK(same(back, target));
    p.client = std::move(moved_to);
    CHECK((co_await p.client.read(back, mr.remote())).has_value());
    co_await close_pair(p);
  }());
}

TEST_CASE("cancellation: an in-flight operation resumes only when its buffer is safe") {
  bool prepared = false;  // the read: connection::read, or a prepared operation's start
  SUBCASE("read") { prepared = false; }
  SUBCASE("prepared read") { prepared = true; }
  io_context ctx;
  // ctx.run returns when the task is done: the capture outlives it.
  ctx.run([prepared]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> target(32 << 20);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    auto local = std::make_unique<std::vector<std::byte>>(target.size());
    prepared_operation op;
    if (prepared) op = p.client.prepare(operation::read(*local, mr.remote())).value();
    async_scope scope;
    std::optional<result<void>> out;
    auto reader = [](pair_t& p, prepared_operation& op, std::span<std::byte> local, remote_buffer rb,
                     std::optional<result<void>>& out) -> task<void> {
      if (op)
        out.emplace(co_await op.start());
      else
        out.emplace(co_await p.client.read(local, rb));
    };
    scope.spawn(reader(p, op, *local, mr.remote(), out));
    scope.request_stop();
    co_await scope.join();
    REQUIRE(out.has_value());
    CHECK((out->has_value() || out->error() == canceled));
    CHECK_FALSE(op.busy());
    if (!out->has_value()) {
      op = prepared_operation{};
      // The buffer may be freed right now: nothing writes it any more.
      local.reset();
      (void)co_await sleep_for(20ms);
      CHECK_FALSE(p.client.is_open());
      std::vector<std::byte> b(8);
      auto r = co_await p.client.read(b, mr.remote(0, 8));
      CHECK(is_error(r.error(), errc::disconnected));
    }
    co_await close_pair(p);
  }());
}

// ---------------------------------------------------------------- grants

namespace {
// A server domain with a listener, and connections to it from client
// domains of their own (each a different peer).
struct grant_server {
  std::optional<domain> sd;
  listener l;
  endpoint ep;
  std::vector<domain> client_domains;
};
void open_server(grant_server& g) {
  g.sd.emplace(domain::open().value());
  g.l = g.sd->listen(test_endpoint(0)).value();
  g.ep = test_endpoint(g.l.local_endpoint()->port());
}
// One peer: its connection and the server's side of it.
task<void> connect_peer(grant_server& g, connection& server_side, connection& client_side) {
  g.client_domains.push_back(domain::open().value());
  auto [s, c] = co_await when_all(accept_within_limit(g.l), g.client_domains.back().connect(g.ep));
  server_side = std::move(s).value();
  client_side = std::move(c).value();
}
// A grant, or a skip where the device has no type 2 memory windows (the
// tcp provider always has grants).
bool grants_unsupported(const result<memory_grant>& r, const connection& c) {
  if (r || !matches(r.error(), errc::not_supported)) return false;
  CHECK(c.kind() == transport_kind::verbs);
  MESSAGE("SKIP: this device has no type 2 memory windows");
  return true;
}
// Closes connections (failed ones too): close() returns once the
// provider is done with each, so nothing is left running when the loop ends.
template <class... C>
task<void> close_all(C&... cs) {
  std::array<connection*, sizeof...(C)> all{&cs...};
  for (connection* c : all) (void)co_await c->close();
}
constexpr unsigned remote_rights = access::remote_write | access::remote_read | access::remote_atomic;
bool all_equal(std::span<const std::byte> m, std::byte v) {
  return std::all_of(m.begin(), m.end(), [v](std::byte b) { return b == v; });
}
}  // namespace

TEST_CASE("grants: a range exposed to one connection only; a second peer with its key is refused; revocable") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    grant_server gs;
    open_server(gs);
    connection sa, ca;  // the peer the range is granted to
    co_await connect_peer(gs, sa, ca);
    // A page in the middle of guard pages; the grant is a range inside it.
    std::vector<std::byte> mem(3 * 4096, std::byte{0x5A});
    std::span<std::byte> region(mem.data() + 4096, 4096);
    auto mr = gs.sd->register_memory(region, access::all).value();
    auto gr = co_await sa.grant(mr, 512, 1024, remote_rights);
    if (grants_unsupported(gr, sa)) co_return;
    REQUIRE(gr.has_value());
    memory_grant g = std::move(*gr);
    REQUIRE(static_cast<bool>(g));
    const remote_buffer rb = g.remote();
    CHECK(rb.address == reinterpret_cast<std::uint64_t>(region.data()) + 512);
    CHECK(rb.length == 1024);
    CHECK(rb.rkey != mr.rkey());  // the grant's own key, not the registration's

    // The peer it was granted to: write, read, atomics through it.
    auto a_works = [](connection& ca, remote_buffer rb, std::span<std::byte> region, unsigned seed) -> task<void> {
      auto data = pattern(100, seed);
      REQUIRE((co_await ca.write(data, rb.slice(0, 100).value())).has_value());
      CHECK(std::memcmp(region.data() + 512, data.data(), 100) == 0);
      std::vector<std::byte> back(100);
      REQUIRE((co_await ca.read(back, rb.slice(0, 100).value())).has_value());
      CHECK(back == data);
      alignas(8) std::uint64_t word;
      std::memcpy(&word, region.data() + 512 + 200, 8);
      auto old = co_await ca.fetch_and_add(rb.slice(200, 8).value(), 5);
      REQUIRE(old.has_value());
      CHECK(*old == word);
      auto cas = co_await ca.compare_and_swap(rb.slice(200, 8).value(), word + 5, 42);
      REQUIRE(cas.has_value());
      CHECK(*cas == word + 5);
      std::memcpy(&word, region.data() + 512 + 200, 8);
      CHECK(word == 42u);
    };
    co_await a_works(ca, rb, region, 1);

    // A hostile second peer handed A's descriptor: each of write, read and
    // atomic is refused (each on a connection of its own: RC rules end a
    // connection at its failed access), nothing is touched, and the server
    // and A carry on.
    for (int op = 0; op < 3; ++op) {
      CAPTURE(op);
      connection sb, cb;
      co_await connect_peer(gs, sb, cb);
      const std::vector<std::byte> before = mem;
      std::vector<std::byte> local(64);
      std::error_code ec;
      switch (op) {
        case 0: ec = (co_await cb.write(pattern(64, 9), rb.slice(0, 64).value())).error(); break;
        case 1: ec = (co_await cb.read(local, rb.slice(0, 64).value())).error(); break;
        case 2: ec = (co_await cb.fetch_and_add(rb.slice(200, 8).value(), 1)).error(); break;
      }
      CHECK(matches(ec, errc::remote_access_error));
      CHECK(mem == before);
      CHECK(all_equal(local, std::byte{0}));
      CHECK(sa.is_open());
      CHECK(ca.is_open());
      co_await a_works(ca, rb, region, 2 + static_cast<unsigned>(op));
      CHECK(static_cast<bool>(g));
      co_await close_all(cb, sb);
    }

    // Revoked: A is refused too, and nothing is touched.
    auto rv = co_await sa.revoke(g);
    REQUIRE(rv.has_value());
    CHECK_FALSE(static_cast<bool>(g));
    CHECK(g.remote().rkey == 0u);
    CHECK((co_await sa.revoke(g)).has_value());  // once more: nothing to do
    const std::vector<std::byte> before = mem;
    auto w = co_await ca.write(pattern(64, 11), rb.slice(0, 64).value());
    CHECK(matches(w.error(), errc::remote_access_error));
    CHECK(mem == before);
    CHECK(all_equal(std::span(mem).first(4096), std::byte{0x5A}));
    CHECK(all_equal(std::span(mem).last(4096), std::byte{0x5A}));
    // The server still serves a new peer through a new grant.
    connection sc, cc;
    co_await connect_peer(gs, sc, cc);
    auto g2 = (co_await sc.grant(mr, 0, 64, access::remote_write)).value();
    REQUIRE((co_await cc.write(pattern(64, 12), g2.remote())).has_value());
    CHECK(std::memcmp(region.data(), pattern(64, 12).data(), 64) == 0);
    co_await close_all(ca, sa, cc, sc);
    gs.l.close();
  }());
}

TEST_CASE("grants: bad arguments; bounds and rights are the grant's, not the registration's") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    grant_server gs;
    open_server(gs);
    connection sa, ca, sb, cb;
    co_await connect_peer(gs, sa, ca);
    co_await connect_peer(gs, sb, cb);
    std::vector<std::byte> mem(3 * 4096, std::byte{0x5A});
    std::span<std::byte> region(mem.data() + 4096, 4096);
    auto mr = gs.sd->register_memory(region, access::all).value();
    auto probe = co_await sa.grant(mr, 0, 8, access::remote_read);
    if (grants_unsupported(probe, sa)) co_return;
    REQUIRE(probe.has_value());

    auto einval = std::make_error_code(std::errc::invalid_argument);
    CHECK((co_await sa.grant(memory_region{}, 0, 8, access::remote_read)).error() == einval);
    CHECK((co_await sa.grant(mr, 0, 0, access::remote_read)).error() == einval);
    CHECK((co_await sa.grant(mr, 0, 8, 0)).error() == einval);
    CHECK((co_await sa.grant(mr, 0, 8, access::local_write)).error() == einval);
    CHECK((co_await sa.grant(mr, 4000, 97, access::remote_read)).error() ==
          std::make_error_code(std::errc::result_out_of_range));
    CHECK((co_await sa.grant(mr, 5000, 1, access::remote_read)).error() ==
          std::make_error_code(std::errc::result_out_of_range));
    auto ro = gs.sd->register_memory(region, access::local_write | access::remote_read).value();
    CHECK((co_await sa.grant(ro, 0, 8, access::remote_write)).error() ==
          std::make_error_code(std::errc::permission_denied));
    // A registration of another domain.
    auto foreign = gs.client_domains.front().register_memory(region, access::all).value();
    CHECK((co_await sa.grant(foreign, 0, 8, access::remote_read)).error() == einval);
    // Revoke: an empty grant, or one of another connection.
    memory_grant empty;
    CHECK((co_await sa.revoke(empty)).error() == einval);
    CHECK((co_await sb.revoke(*probe)).error() == einval);
    CHECK(static_cast<bool>(*probe));
    CHECK((co_await connection{}.grant(mr, 0, 8, access::remote_read)).error() ==
          make_error_code(errc::disconnected));
    CHECK(sa.is_open());

    // Rights: a read-only grant of a registration with all rights.
    auto rog = (co_await sa.grant(mr, 0, 64, access::remote_read)).value();
    std::vector<std::byte> back(64);
    REQUIRE((co_await ca.read(back, rog.remote())).has_value());
    CHECK(all_equal(back, std::byte{0x5A}));
    CHECK(matches((co_await ca.write(pattern(64, 1), rog.remote())).error(), errc::remote_access_error));
    CHECK(all_equal(mem, std::byte{0x5A}));
    // Bounds: past the grant's end, inside the registration (B's grant).
    auto bg = (co_await sb.grant(mr, 1024, 64, remote_rights)).value();
    remote_buffer past = bg.remote();
    past.length = 128;
    CHECK(matches((co_await cb.write(pattern(128, 2), past)).error(), errc::remote_access_error));
    CHECK(all_equal(mem, std::byte{0x5A}));
    co_await close_all(ca, sa, cb, sb);
    gs.l.close();
  }());
}

TEST_CASE("grants: revoke completes only once the accesses in progress through the grant are done") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    grant_server gs;
    open_server(gs);
    connection sa, ca;
    co_await connect_peer(gs, sa, ca);
    // tcp: large writes, whose payload the target reads in over many loop
    // turns; verbs: many single-packet writes in flight.
    const bool tcp = sa.kind() == transport_kind::tcp;
    const std::size_t n = tcp ? 4 : 64, size = tcp ? (std::size_t(8) << 20) : 512;
    std::vector<std::byte> target(n * size, std::byte{0});
    auto mr = gs.sd->register_memory(target, access::all).value();
    auto gr = co_await sa.grant(mr, 0, target.size(), access::remote_write);
    if (grants_unsupported(gr, sa)) co_return;
    memory_grant g = std::move(gr).value();
    const remote_buffer rb = g.remote();
    std::vector<std::vector<std::byte>> data;
    for (std::size_t i = 0; i < n; ++i) data.push_back(pattern(size, 100 + static_cast<unsigned>(i)));
    std::vector<task<result<void>>> writes;
    for (std::size_t i = 0; i < n; ++i) writes.push_back(ca.write(data[i], rb.slice(i * size, size).value()));

    // Revokes once the first write has started landing; then the memory
    // must not change any more, and no write is found half done.
    auto revoker = [](connection& sa, memory_grant& g, std::span<const std::byte> target,
                      std::vector<std::byte>& snapshot) -> task<void> {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (target[0] == std::byte{0} && std::chrono::steady_clock::now() < deadline) co_await yield();
      REQUIRE(target[0] != std::byte{0});
      auto r = co_await with_timeout(sa.revoke(g), std::chrono::seconds(60));
      REQUIRE(r.has_value());
      snapshot.assign(target.begin(), target.end());
    };
    std::vector<std::byte> snapshot;
    auto [results, rv] = co_await when_all(when_all(std::move(writes)), revoker(sa, g, target, snapshot));
    (void)rv;
    REQUIRE(snapshot.size() == target.size());
    CHECK(snapshot == target);  // nothing landed after revoke completed
    std::size_t done = 0;
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      std::span<const std::byte> chunk(snapshot.data() + i * size, size);
      const bool whole = same(chunk, data[i]);
      CHECK((whole || all_equal(chunk, std::byte{0})));  // all of it or none
      if (results[i]) {
        CHECK(whole);
        ++done;
      } else {
        CHECK((matches(results[i].error(), errc::remote_access_error) ||
               matches(results[i].error(), errc::disconnected)));
      }
    }
    CHECK(done >= 1);
    co_await close_all(ca, sa);
    gs.l.close();
  }());
}

TEST_CASE("grants: destroying the grant or its connection revokes it") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    grant_server gs;
    open_server(gs);
    connection sa, ca, sb, cb;
    co_await connect_peer(gs, sa, ca);
    co_await connect_peer(gs, sb, cb);
    std::vector<std::byte> region(4096, std::byte{0x5A});
    auto mr = gs.sd->register_memory(region, access::all).value();
    auto gr = co_await sa.grant(mr, 0, 64, remote_rights);
    if (grants_unsupported(gr, sa)) co_return;
    // The grant destroyed: its key opens nothing any more.
    remote_buffer rb;
    {
      memory_grant g = std::move(gr).value();
      rb = g.remote();
      REQUIRE((co_await ca.write(pattern(64, 1), rb)).has_value());
    }
    std::fill(region.begin(), region.end(), std::byte{0x5A});
    CHECK(matches((co_await ca.write(pattern(64, 2), rb)).error(), errc::remote_access_error));
    CHECK(all_equal(region, std::byte{0x5A}));

    // The connection destroyed: its grant is revoked with it, and the grant
    // outlives it harmlessly.
    auto g2 = (co_await sb.grant(mr, 0, 64, remote_rights)).value();
    REQUIRE((co_await cb.write(pattern(64, 3), g2.remote())).has_value());
    sb = connection{};
    CHECK_FALSE(static_cast<bool>(g2));
    CHECK(g2.remote().rkey == 0u);
    CHECK((co_await sb.revoke(g2)).error() == std::make_error_code(std::errc::invalid_argument));
    // Many grants of one connection, revoked and not: none is leaked (ASan).
    connection sc, cc;
    co_await connect_peer(gs, sc, cc);
    std::vector<memory_grant> kept;
    for (int i = 0; i < 20; ++i) {
      auto gi = (co_await sc.grant(mr, 64 * static_cast<std::size_t>(i), 64, remote_rights)).value();
      if (i % 2) REQUIRE((co_await sc.revoke(gi)).has_value());
      kept.push_back(std::move(gi));
    }
    sc = connection{};
    for (auto& k : kept) CHECK_FALSE(static_cast<bool>(k));
    co_await close_all(ca, sa, cb, cc);
    gs.l.close();
  }());
}

TEST_CASE("64 connections at once") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options opts;
    opts.receive_buffers = 8;
    opts.receive_buffer_size = 4096;
    opts.send_queue_depth = 16;
    std::optional<domain> sd(domain::open().value()), cd(domain::open().value());
    auto l = sd->listen(test_endpoint(0), opts).value();
    auto ep = test_endpoint(l.local_endpoint()->port());
    constexpr int n = 64;
    std::vector<std::byte> target(n * 4096);
    auto mr = sd->register_memory(target, access::all).value();

    auto serve = [](listener& l, std::vector<connection>& out) -> task<void> {
      for (int i = 0; i < n; ++i) {
        auto c = co_await accept_within_limit(l);
        REQUIRE(c.has_value());
        out.push_back(std::move(*c));
      }
    };
    auto client = [](domain& d, endpoint ep, connection_options opts, remote_buffer rb, int i,
                     connection& keep) -> task<int> {
      auto c = co_await d.connect(ep, opts);
      if (!c) co_return 0;
      auto data = pattern(4096, i);
      auto w = co_await c->write(data, rb);
      std::vector<std::byte> back(4096);
      auto r = co_await c->read(back, rb);
      auto s = co_await c->send(std::span(data).first(100));
      keep = std::move(*c);  // closed once the server has received
      co_return (w && r && s && back == data) ? 1 : 0;
    };
    std::vector<connection> server_side;
    std::vector<connection> client_side(n);
    std::vector<task<int>> clients;
    for (int i = 0; i < n; ++i)
      clients.push_back(client(*cd, ep, opts, mr.remote(i * 4096, 4096), i, client_side[i]));
    auto [ok, _] = co_await when_all(when_all(std::move(clients)), serve(l, server_side));
    int good = 0;
    for (int v : ok) good += v;
    CHECK(good == n);
    for (int i = 0; i < n; ++i) {
      auto m = co_await with_timeout(server_side[i].recv(), 5s);
      REQUIRE(m.has_value());
      CHECK(m->size() == 100);
    }
    for (int i = 0; i < n; ++i) CHECK(std::memcmp(target.data() + i * 4096, pattern(4096, i).data(), 4096) == 0);
    for (auto& c : client_side) (void)co_await c.close();
    for (auto& c : server_side) (void)co_await c.close();
    l.close();
  }());
}

namespace {
// Descriptors this process has open: sockets, rdma_cm event channels and
// the rest of what a provider's connections and listeners hold.
int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++n;
    ::closedir(d);
  }
  return n;
}

// Drops everything of `p`, the domains first, listener and connections after.
void drop_all(pair_t& p) {
  p.server_domain.reset();
  p.client_domain.reset();
  p.l = listener{};
  p.client = connection{};
  p.server = connection{};
}
}  // namespace

// transport.hpp, "Lifetimes": anything may be destroyed at any time on the
// loop, in any order, with no wait; what winds down afterwards ends with
// the io_context at the latest. Each case returns as soon as it dropped
// everything (no close, no sleep) and then destroys the io_context: every
// descriptor the providers opened must be closed by then (and, under ASan,
// nothing leaked).
TEST_CASE("lifetimes: domains, listener and connections dropped at once, never closed") {
  const int before = open_fds();
  {
    io_context ctx;
    ctx.run([]() -> task<void> {
      pair_t p;
      co_await make_pair(p);
      std::vector<std::byte> mem(4096, std::byte{7});
      auto mr = p.server_domain->register_memory(mem, access::all).value();
      auto msg = pattern(100, 1);
      auto [s, m] = co_await when_all(p.client.send(msg), p.server.recv());
      REQUIRE(s.has_value());
      REQUIRE(m.has_value());
      drop_all(p);
      // A message and a registration outlive their connection and domain.
      CHECK(same(m->data(), msg));
      CHECK(mr.size() == mem.size());
    }());
  }
  CHECK(open_fds() == before);
}

TEST_CASE("lifetimes: dropped with operations in flight; they fail with disconnected") {
  const int before = open_fds();
  {
    io_context ctx;
    ctx.run([]() -> task<void> {
      pair_t p;
      co_await make_pair(p);
      std::vector<std::byte> mem(1 << 20, std::byte{1}), local(1 << 20);
      auto mr = p.server_domain->register_memory(mem, access::all).value();
      auto dropper = [](pair_t& p) -> task<void> {
        co_await yield();  // every operation below has started
        drop_all(p);
      };
      auto [r, cm, sm, a, _] = co_await when_all(p.client.read(local, mr.remote()), p.client.recv(), p.server.recv(),
                                                p.l.accept(), dropper(p));
      // The read may have completed before the drop; the receives cannot.
      if (!r) CHECK(matches(r.error(), errc::disconnected));
      REQUIRE_FALSE(cm.has_value());
      CHECK(matches(cm.error(), errc::disconnected));
      REQUIRE_FALSE(sm.has_value());
      CHECK(matches(sm.error(), errc::disconnected));
      CHECK_FALSE(a.has_value());  // the listener went
    }());
  }
  CHECK(open_fds() == before);
}

TEST_CASE("lifetimes: dropped at once after one side closed") {
  const int before = open_fds();
  {
    io_context ctx;
    ctx.run([]() -> task<void> {
      pair_t p;
      co_await make_pair(p);
      REQUIRE(co_await p.client.close());
      drop_all(p);  // the server side never closed: its peer's disconnect may not even have arrived
    }());
  }
  CHECK(open_fds() == before);
}

TEST_CASE("lifetimes: a listener dropped while connects are in progress") {
  const int before = open_fds();
  {
    io_context ctx;
    ctx.run([]() -> task<void> {
      pair_t p;
      p.server_domain.emplace(domain::open().value());
      p.client_domain.emplace(domain::open().value());
      p.l = p.server_domain->listen(test_endpoint(0)).value();
      auto ep = test_endpoint(p.l.local_endpoint()->port());
      auto dropper = [](pair_t& p) -> task<void> {
        co_await yield();
        p.l = listener{};
        p.server_domain.reset();
      };
      // Connects that the listener was handshaking, or had established but
      // not handed out, or never saw: each fails, or succeeds and then
      // finds its peer gone; none hangs.
      auto connect = [](domain& d, endpoint ep) -> task<void> {
        connection_options o;
        o.connect_timeout = 10s;
        auto c = co_await d.connect(ep, o);
        if (c) (void)co_await with_timeout(c->recv(), 10s);
      };
      auto [a, c1, c2, _] = co_await when_all(p.l.accept(), connect(*p.client_domain, ep),
                                              connect(*p.client_domain, ep), dropper(p));
      (void)a;
      drop_all(p);
    }());
  }
  CHECK(open_fds() == before);
}

TEST_CASE("errors: a connect cancelled before it started is operation_canceled, generic category") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open().value();
    auto l = d.listen(test_endpoint(0)).value();
    std::error_code ec;
    async_scope scope;
    scope.request_stop();
    auto connect = [](domain& d, endpoint ep, std::error_code& out) -> task<void> {
      auto c = co_await d.connect(ep);
      out = c ? std::error_code{} : c.error();
    };
    scope.spawn(connect(d, test_endpoint(l.local_endpoint()->port()), ec));
    co_await scope.join();
    CHECK(ec == std::make_error_code(std::errc::operation_canceled));  // strictly: generic:125
    CHECK(ec.category() == std::generic_category());
  }());
}

TEST_CASE("errors: with_timeout around an operation is operation_timeout, still == std::errc::timed_out") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    auto r = co_await with_timeout(p.client.recv(), 10ms);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error() == make_error_code(errc::operation_timeout));
    CHECK(r.error() == std::errc::timed_out);
    CHECK(r.error().message() != std::make_error_code(std::errc::timed_out).message());
    co_await close_pair(p);
  }());
}

TEST_CASE("errors: domain::open and listen on a thread without an io_context return no_io_context") {
  result<domain> outside = std::make_error_code(std::errc::io_error);
  std::thread([&] { outside = domain::open(); }).join();
  REQUIRE_FALSE(outside.has_value());
  CHECK(outside.error() == make_error_code(errc::no_io_context));

  io_context ctx;
  auto d = domain::open().value();
  result<listener> l = std::make_error_code(std::errc::io_error);
  std::thread([&] { l = d.listen(test_endpoint(0)); }).join();
  REQUIRE_FALSE(l.has_value());
  CHECK(l.error() == make_error_code(errc::no_io_context));
}

TEST_CASE("errors: listener::local_endpoint and tcp_listener::local_endpoint agree") {
  static_assert(std::is_same_v<decltype(std::declval<const listener&>().local_endpoint()),
                               decltype(std::declval<const tcp_listener&>().local_endpoint())>);
  io_context ctx;
  auto d = domain::open().value();
  auto l = d.listen(test_endpoint(0)).value();
  auto t = tcp_listener::bind(test_endpoint(0)).value();
  REQUIRE(l.local_endpoint().has_value());
  REQUIRE(t.local_endpoint().has_value());
  CHECK(l.local_endpoint()->port() != 0);
  CHECK(t.local_endpoint()->port() != 0);
  CHECK(l.local_endpoint()->to_string().rfind(test_endpoint(0).to_string().substr(0, 4), 0) == 0);
  // Closed, and never opened: the same error from both.
  l.close();
  t.close();
  CHECK(l.local_endpoint().error() == std::make_error_code(std::errc::bad_file_descriptor));
  CHECK(t.local_endpoint().error() == l.local_endpoint().error());
  CHECK(listener{}.local_endpoint().error() == tcp_listener{}.local_endpoint().error());
}

TEST_CASE("connect payload: each side reads the other's; a remote_buffer in it needs no message") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open().value();
    auto cd = domain::open().value();
    std::vector<std::byte> target(4096);
    auto mr = sd.register_memory(target, access::all).value();
    // The listener answers every peer with the descriptor and 12 bytes more (the bound, 32, in all).
    connection_options lopts;
    lopts.payload.resize(max_connect_payload);
    REQUIRE(mr.remote(1024, 2048).serialize(lopts.payload).has_value());
    for (std::size_t i = remote_buffer::wire_size; i < max_connect_payload; ++i) lopts.payload[i] = std::byte(i);
    std::vector<std::string> refused;
    listener_options limits;
    limits.on_refused = [&](const endpoint&, std::string_view why) { refused.emplace_back(why); };
    auto l = sd.listen(test_endpoint(0), lopts, limits).value();
    auto ep = test_endpoint(l.local_endpoint()->port());

    // Payloads of 1 byte, the bound, and none.
    const auto full = pattern(max_connect_payload, 7);
    for (std::size_t n : {std::size_t(1), max_connect_payload, std::size_t(0)}) {
      auto mine = std::span(full).first(n);
      auto [s, c] = co_await when_all(accept_within_limit(l), cd.connect(ep, mine));
      REQUIRE(s.has_value());
      REQUIRE(c.has_value());
      CHECK(std::ranges::equal(s->peer_payload(), mine));
      CHECK(std::ranges::equal(c->peer_payload(), lopts.payload));
      // The client writes where the payload says, with no message exchanged first.
      auto rb = remote_buffer::deserialize(c->peer_payload());
      REQUIRE(rb.has_value());
      CHECK(rb->length == 2048);
      auto data = pattern(2048, static_cast<unsigned>(n));
      REQUIRE((co_await c->write(data, *rb)).has_value());
      CHECK(std::memcmp(target.data() + 1024, data.data(), data.size()) == 0);
      (void)co_await c->close();
      (void)co_await s->close();
    }
    CHECK(refused.empty());

    // No payload on either side (a listener without one): empty.
    pair_t p;
    co_await make_pair(p);
    CHECK(p.client.peer_payload().empty());
    CHECK(p.server.peer_payload().empty());
    co_await close_pair(p);
    CHECK(connection{}.peer_payload().empty());
  }());
}

TEST_CASE("connect payload: over the bound is message_too_long, nothing sent; remote_buffer on short spans") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open().value();
    connection_options big;
    big.payload.resize(max_connect_payload + 1);
    auto bad_listener = d.listen(test_endpoint(0), big);
    REQUIRE_FALSE(bad_listener.has_value());
    CHECK(bad_listener.error() == make_error_code(errc::message_too_long));

    std::size_t refusals = 0;
    listener_options limits;
    limits.on_refused = [&](const endpoint&, std::string_view) { ++refusals; };
    auto l = d.listen(test_endpoint(0), {}, limits).value();
    auto ep = test_endpoint(l.local_endpoint()->port());
    auto c = co_await d.connect(ep, big);
    REQUIRE_FALSE(c.has_value());
    CHECK(c.error() == make_error_code(errc::message_too_long));
    // The listener saw nothing of it: the next connection it returns is the good one.
    const std::array<std::byte, 3> good{std::byte{1}, std::byte{2}, std::byte{3}};
    auto [s, c2] = co_await when_all(accept_within_limit(l), d.connect(ep, good));
    REQUIRE(s.has_value());
    REQUIRE(c2.has_value());
    CHECK(std::ranges::equal(s->peer_payload(), good));
    CHECK(refusals == 0);
    (void)co_await c2->close();
    (void)co_await s->close();

    remote_buffer rb{0x1122334455667788u, 0xabcdef01u, 4096};
    std::array<std::byte, remote_buffer::wire_size + 5> wide{};
    REQUIRE(rb.serialize(std::span<std::byte>(wide)).has_value());
    auto back = remote_buffer::deserialize(std::span<const std::byte>(wide));
    REQUIRE(back.has_value());
    CHECK((back->address == rb.address && back->rkey == rb.rkey && back->length == rb.length));
    auto shorter = std::span<std::byte>(wide).first(remote_buffer::wire_size - 1);
    CHECK(rb.serialize(shorter).error() == std::errc::invalid_argument);
    CHECK(remote_buffer::deserialize(std::span<const std::byte>(shorter)).error() == std::errc::invalid_argument);
    std::byte raw[remote_buffer::wire_size];  // a C array: the exact-size overloads, not ambiguous
    rb.serialize(raw);
    CHECK(remote_buffer::deserialize(raw).rkey == rb.rkey);
  }());
}

TEST_CASE("interop: wire_protocol::plain is plain RC on verbs (detected by a listener), not_supported elsewhere") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open().value();
    auto cd = domain::open().value();
    connection_options plain;
    plain.protocol = wire_protocol::plain;
    connection_options detect;
    detect.protocol = wire_protocol::detect;
    if (sd.kind() != transport_kind::verbs) {
      for (auto* o : {&plain, &detect}) {
        auto l = sd.listen(test_endpoint(0), *o);
        REQUIRE_FALSE(l.has_value());
        CHECK(l.error() == make_error_code(errc::not_supported));
      }
      auto l = sd.listen(test_endpoint(0)).value();
      auto c = co_await cd.connect(test_endpoint(l.local_endpoint()->port()), plain);
      REQUIRE_FALSE(c.has_value());
      CHECK(c.error() == make_error_code(errc::not_supported));
      co_return;
    }
    const std::string srv_hi = "server", cli_hi = "client";
    detect.payload.assign(reinterpret_cast<const std::byte*>(srv_hi.data()),
                          reinterpret_cast<const std::byte*>(srv_hi.data()) + srv_hi.size());
    detect.receive_buffers = plain.receive_buffers = 8;
    plain.payload.assign(reinterpret_cast<const std::byte*>(cli_hi.data()),
                         reinterpret_cast<const std::byte*>(cli_hi.data()) + cli_hi.size());
    auto l = sd.listen(test_endpoint(0), detect).value();
    auto ep = test_endpoint(l.local_endpoint()->port());
    auto starts_with = [](std::span<const std::byte> got, const std::string& want) {
      return got.size() >= want.size() && std::memcmp(got.data(), want.data(), want.size()) == 0;
    };
    {
      auto [s, c] = co_await when_all(accept_within_limit(l), cd.connect(ep, plain));
      REQUIRE(s.has_value());
      REQUIRE(c.has_value());
      CHECK(s->protocol() == wire_protocol::plain);
      CHECK(c->protocol() == wire_protocol::plain);
      CHECK(starts_with(s->peer_payload(), cli_hi));  // the bare private data (the CM pads it)
      CHECK(starts_with(c->peer_payload(), srv_hi));
      // More messages than posted receives, each way: every buffer goes back once its message is gone.
      for (unsigned i = 0; i < 40; ++i) {
        auto data = pattern(1 + i * 100, i);
        auto [sr, rr] = co_await when_all(c->send(data), s->recv());
        REQUIRE(sr.has_value());
        REQUIRE(rr.has_value());
        CHECK(same(rr->data(), data));
        CHECK_FALSE(rr->imm().has_value());
        auto [sr2, rr2] = co_await when_all(s->send(rr->data()), c->recv());
        REQUIRE(sr2.has_value());
        REQUIRE(rr2.has_value());
        CHECK(same(rr2->data(), data));
      }
      // One-sided and write_with_imm: its immediate is the message's.
      std::vector<std::byte> target(4096);
      auto mr = sd.register_memory(target, access::all).value();
      auto data = pattern(4096, 99);
      auto [w, m] = co_await when_all(c->write_with_imm(data, mr.remote(), 0xfeedu), s->recv());
      REQUIRE(w.has_value());
      REQUIRE(m.has_value());
      CHECK(m->imm() == std::optional<std::uint32_t>(0xfeedu));
      CHECK(target == data);
      const std::array<operation, 2> batch{operation::send(std::span(data).first(10)),
                                           operation::send(std::span(data).first(20))};
      auto [b, m1, m2] = co_await when_all(c->post_batch(batch), s->recv(), s->recv());
      REQUIRE(b.has_value());
      REQUIRE(m1.has_value());
      REQUIRE(m2.has_value());
      CHECK(m1->size() + m2->size() == 30);
      (void)co_await c->close();
      (void)co_await s->close();
    }
    // The same listener still takes shuttle peers (and their payloads).
    auto [s, c] = co_await when_all(accept_within_limit(l), cd.connect(ep));
    REQUIRE(s.has_value());
    REQUIRE(c.has_value());
    CHECK(s->protocol() == wire_protocol::shuttle);
    CHECK(std::ranges::equal(c->peer_payload(), detect.payload));
    auto data = pattern(100, 5);
    auto [sr, rr] = co_await when_all(c->send(data), s->recv());
    REQUIRE(sr.has_value());
    REQUIRE(rr.has_value());
    (void)co_await c->close();
    (void)co_await s->close();
    // A shuttle listener refuses a plain connect as before.
    auto strict = sd.listen(test_endpoint(0)).value();
    auto refused = co_await cd.connect(test_endpoint(strict.local_endpoint()->port()), plain);
    CHECK_FALSE(refused.has_value());
  }());
}

TEST_CASE("connect: refused and timeout") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    std::optional<domain> d(domain::open().value());
    // A port nobody listens on.
    std::uint16_t port;
    {
      auto l = d->listen(test_endpoint(0)).value();
      port = l.local_endpoint()->port();
    }
    auto c = co_await d->connect(test_endpoint(port));
    CHECK_FALSE(c.has_value());
  }());
}

// The peer of the kill test is forked at the start of main, before any
// provider state exists (libibverbs state must not be inherited by a child).
namespace {
int peer_pipe = -1;
pid_t peer_pid = -1;

[[noreturn]] void peer_child(int fd) {
  std::uint16_t port = 0;
  if (::read(fd, &port, sizeof port) != sizeof port) ::_exit(0);  // not needed this run
  try {
    io_context cctx;
    cctx.run([](std::uint16_t port) -> task<void> {
      auto d = domain::open().value();
      std::vector<std::byte> mem(64 << 20, std::byte{1});
      auto mr = d.register_memory(mem, access::all).value();
      auto c = (co_await d.connect(test_endpoint(port))).value();
      std::array<std::byte, remote_buffer::wire_size> wire{};
      mr.remote().serialize(wire);
      (void)co_await c.send(wire);
      (void)co_await sleep_for(std::chrono::hours(1));
    }(port));
  } catch (...) {
  }
  ::_exit(0);
}

void fork_peer() {
  int fds[2];
  if (::pipe(fds) != 0) return;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[1]);
    peer_child(fds[0]);
  }
  ::close(fds[0]);
  if (pid < 0) {
    ::close(fds[1]);
    return;
  }
  peer_pipe = fds[1];
  peer_pid = pid;
}

void reap_peer() {
  if (peer_pipe >= 0) ::close(std::exchange(peer_pipe, -1));
  if (peer_pid > 0) {
    int status = 0;
    ::waitpid(std::exchange(peer_pid, -1), &status, 0);
  }
}
}  // namespace

TEST_CASE("peer process killed mid-transfer: pending operations fail, no hang") {
  REQUIRE(peer_pid > 0);
  pid_t child = peer_pid;
  int pipefd[2] = {-1, peer_pipe};
  peer_pipe = -1;
  io_context ctx;
  ctx.run([&]() -> task<void> {
    std::optional<domain> d(domain::open().value());
    auto l = d->listen(test_endpoint(0)).value();
    std::uint16_t port = l.local_endpoint()->port();
    REQUIRE(::write(pipefd[1], &port, sizeof port) == sizeof port);
    ::close(pipefd[1]);
    auto c = (co_await accept_within_limit(l)).value();
    auto m = (co_await c.recv()).value();
    REQUIRE(m.size() == remote_buffer::wire_size);
    auto rb = remote_buffer::deserialize(m.data().first<remote_buffer::wire_size>());
    m.reset();
    std::vector<std::byte> local(rb.length);
    auto killer = [](pid_t child) -> task<void> {
      (void)co_await sleep_for(30ms);
      ::kill(child, SIGKILL);
    };
    auto transfers = [](connection& c, std::vector<std::byte>& local, remote_buffer rb,
                        std::error_code& out) -> task<void> {
      // Large reads and writes back to back until one fails.
      for (int i = 0; i < 100000; ++i) {
        auto [r, w] = co_await when_all(c.read(local, rb), c.write(local, rb));
        if (!r) {
          out = r.error();
          co_return;
        }
        if (!w) {
          out = w.error();
          co_return;
        }
      }
    };
    std::error_code ec;
    auto [t, _] = co_await when_all(with_timeout(transfers(c, local, rb, ec), 20s), killer(child));
    REQUIRE(t.has_value());  // no hang
    CHECK(ec);               // failed
    CHECK_FALSE(c.is_open());
    (void)co_await c.close();
    l.close();
  }());
  int status = 0;
  ::waitpid(child, &status, 0);
  peer_pid = -1;
  CHECK(WIFSIGNALED(status));
}

int main(int argc, char** argv) {
  fork_peer();  // first: before any provider state exists
  const char* sel = std::getenv("SHUTTLE_TRANSPORT");
  {
    io_context ctx;  // a domain belongs to a loop
    auto d = domain::open();
    if (!d) {
      std::printf("SKIP: transport provider '%s' is not available: %s\n", sel ? sel : "auto",
                  d.error().message().c_str());
      reap_peer();
      return d.error() == make_error_code(errc::not_supported) ? 77 : 1;
    }
    std::printf("transport conformance: provider %s (%s)\n", to_string(d->kind()), d->describe().c_str());
  }
  doctest::Context context(argc, argv);
  int rc = context.run();
  reap_peer();
  return rc;
}
