// The local provider's shared-memory rings (lib/local_provider/ring.hpp):
// messages and one-sided transfers larger than a ring (split across its
// wrap-around), many messages in flight both ways, a peer killed with
// operations pending, the sleep/wake boundary hammered, and hostile peers that corrupt the ring marks and indices or
// fill a ring with garbage (their connection fails with protocol_error, a
// good connection on the same listener carries on; likewise SENDs carrying
// forged ACKs and credits, or carrying them unannounced), a ping-pong whose
// SENDs carry the ACK and the credit (one record a message), both sides
// only sending through a window of one, and SENDs written into the ring
// from the application's call (never ahead of what the engine holds, falling
// back when the ring is full, cancelled in flight). The provider-neutral
// cases run over the rings in conformance-local.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "local_common.hpp"
#include "local_wire.hpp"
#include "ring.hpp"
#include "stats.hpp"
#include "wire.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

using namespace shuttle;
using namespace transport_test;
using namespace std::chrono_literals;
namespace lp = shuttle::detail::local_provider;

namespace {

task<bool> exchange(connection& from, connection& to, std::span<const std::byte> msg) {
  auto [s, r] = co_await when_all(from.send(msg), to.recv());
  co_return s.has_value() && r.has_value() && same(r->data(), msg);
}

}  // namespace

TEST_CASE("rings: messages and transfers larger than a ring, across its wrap-around") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    const auto pipes = detail::local_ring_pipes();
    connection_options o;
    o.receive_buffer_size = 4 << 20;
    o.receive_buffers = 2;
    lpair p;
    co_await make_lpair(p, o);
    CHECK(detail::local_ring_pipes() - pipes == 2);  // both ends of this one connection
    const auto bytes = detail::local_ring_bytes();
    // Sizes that leave the ring's indices at odd places, then wrap it.
    for (std::size_t n : {std::size_t(1), std::size_t(3 * lp::ring_capacity + 12345), std::size_t(777),
                          std::size_t(4 << 20)}) {
      CAPTURE(n);
      auto a = pattern(n, static_cast<unsigned>(n));
      CHECK(co_await exchange(p.client, p.server, a));
      auto b = pattern(n, static_cast<unsigned>(n + 1));
      CHECK(co_await exchange(p.server, p.client, b));
    }
    // One-sided, on memory that is not shared: through the rings too.
    std::vector<std::byte> target(5 << 20);
    auto mr = p.sd->register_memory(target, access::all).value();
    const std::size_t n = target.size() - 7;
    auto data = pattern(n, 9);
    REQUIRE((co_await p.client.write(data, mr.remote().slice(3, n).value())).has_value());
    CHECK(std::memcmp(target.data() + 3, data.data(), n) == 0);
    std::vector<std::byte> back(n);
    REQUIRE((co_await p.client.read(back, mr.remote().slice(3, n).value())).has_value());
    CHECK(back == data);
    CHECK(detail::local_ring_bytes() - bytes > 2 * (4 << 20) + 2 * n);  // the frames went there, not the socket
    co_await close_lpair(p);
  }());
}

namespace {

// Message i: its index, then pattern(size - 8, i); sizes vary from 8 bytes to 64 KiB.
std::size_t size_of(std::uint64_t i) { return 8 + (i * 7919) % (64 << 10); }
std::vector<std::byte> message_for(std::uint64_t i) {
  auto v = pattern(size_of(i), static_cast<unsigned>(i));
  std::memcpy(v.data(), &i, 8);
  return v;
}

constexpr std::uint64_t per_sender = 400, senders = 4;

// Sender k sends k, k + senders, ...: its messages arrive in its order.
task<bool> send_all(connection& c, std::uint64_t k) {
  for (std::uint64_t i = k; i < per_sender * senders; i += senders)
    if (!(co_await c.send(message_for(i)))) co_return false;
  co_return true;
}

task<bool> recv_all(connection& c) {
  std::vector<std::uint64_t> next(senders);
  for (std::uint64_t k = 0; k < senders; ++k) next[k] = k;
  for (std::uint64_t got = 0; got < per_sender * senders; ++got) {
    auto m = co_await c.recv();
    if (!m || m->size() < 8) co_return false;
    std::uint64_t i = 0;
    std::memcpy(&i, m->data().data(), 8);
    if (i >= per_sender * senders || i != next[i % senders] || !same(m->data(), message_for(i))) co_return false;
    next[i % senders] += senders;
  }
  co_return true;
}

}  // namespace

TEST_CASE("rings: many messages in flight both ways, every byte and the order verified") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options o;
    o.receive_buffers = 64;
    o.receive_buffer_size = 64 << 10;
    lpair p;
    co_await make_lpair(p, o);
    std::vector<task<bool>> all;
    for (std::uint64_t k = 0; k < senders; ++k) {
      all.push_back(send_all(p.client, k));
      all.push_back(send_all(p.server, k));
    }
    all.push_back(recv_all(p.server));
    all.push_back(recv_all(p.client));
    auto ok = co_await when_all(std::move(all));
    for (bool b : ok) CHECK(b);
    CHECK(p.client.is_open());
    co_await close_lpair(p);
  }());
}

namespace {

// The sleep/wake hammer's message i: its index, then pattern bytes; small
// ones (a ping-pong) and, every `stream_every`-th block, larger than a ring
// (the producer then waits for room).
constexpr std::uint64_t hammer_messages = 40000, stream_every = 16, block = 64;
bool streaming(std::uint64_t i) { return (i / block) % stream_every == stream_every - 1; }
std::size_t hammer_size(std::uint64_t i) {
  return streaming(i) ? lp::ring_capacity + 4096 + (i * 131) % 4096 : 8 + (i * 7) % 56;
}
std::vector<std::byte> hammer_message(std::uint64_t i) {
  auto v = pattern(hammer_size(i), static_cast<unsigned>(i));
  std::memcpy(v.data(), &i, 8);
  return v;
}

// Whether this loop spins (a few microseconds' budget, so it also goes to
// sleep in the middle of a burst) or sleeps as soon as it waits: flips every
// `period` messages, on each side out of step with the other.
void alternate(std::uint64_t i, std::uint64_t period, std::minstd_rand& rng) {
  if (i % period == 0) {
    const bool spin = (i / period) % 2 == 0;
    io_context::current().set_ring_spin_budget(spin ? std::chrono::nanoseconds(rng() % 20000) : 0ns);
  }
}

// A few hundred nanoseconds to a few microseconds of busy work: the other
// side's loop is caught at every point of its way to sleep.
void jitter(std::minstd_rand& rng) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(rng() % 4000);
  while (std::chrono::steady_clock::now() < until) {
  }
}

}  // namespace

// No lost wake-up at the boundary between a loop that polls the rings and
// one that sleeps (pipe.hpp: a sleeping loop's flag, a fence, a look; the
// peer's publish, a fence, a look at the flag): two loops on two threads
// exchange many small messages with a reply each, and blocks of messages
// larger than a ring (space wake-ups), each side flipping between spinning
// and sleeping. A wake-up lost on either side stalls the exchange: every
// wait is bounded (60 s, a hang guard, not a timing check) so that it fails
// here rather than hanging. Without the fences it fails (x86 reorders the
// flag's store after the index's load: docs/measurements.md, 2026-12-07).
TEST_CASE("rings: the sleep/wake boundary, hammered (data and room): no lost wake-up") {
  std::atomic<std::uint16_t> port{0};
  std::atomic<bool> server_ok{false};
  std::uint64_t server_sleeps = 0;
  connection_options o;
  o.receive_buffers = 8;
  o.receive_buffer_size = 2 * lp::ring_capacity;
  std::thread server([&] {
    io_context sctx;
    sctx.run([&]() -> task<void> {
      auto d = domain::open(local_options()).value();
      auto l = d.listen(endpoint::loopback(0), o).value();
      port = l.local_endpoint()->port();
      auto c = co_await with_timeout(accept_within_limit(l), 60s);
      if (!c) co_return;
      std::minstd_rand rng(7);
      bool ok = true;
      for (std::uint64_t i = 0; i < hammer_messages && ok; ++i) {
        alternate(i, 48, rng);
        auto m = co_await with_timeout(c->recv(), 60s);
        ok = m && same(m->data(), hammer_message(i));
        if (!ok) break;
        m->reset();
        if (!streaming(i) || i % 4 == 3) {  // a reply to each small one, one per four large ones
          jitter(rng);
          ok = (co_await c->send(std::as_bytes(std::span(&i, 1)))).has_value();
        }
      }
      server_ok = ok;
      server_sleeps = sctx.loop_sleeps();
      (void)co_await with_timeout(c->close(), 60s);
    }());
  });
  while (port.load() == 0) std::this_thread::yield();
  io_context ctx;
  std::uint64_t done = 0;
  ctx.run([&]() -> task<void> {
    auto d = domain::open(local_options()).value();
    auto c = (co_await with_timeout(d.connect(endpoint::loopback(port.load()), o), 60s)).value();
    std::minstd_rand rng(11);
    auto reply = [&](std::uint64_t i) -> task<bool> {
      auto r = co_await with_timeout(c.recv(), 60s);
      std::uint64_t got = ~std::uint64_t{0};
      if (r && r->size() == 8) std::memcpy(&got, r->data().data(), 8);
      co_return got == i;
    };
    for (std::uint64_t i = 0; i < hammer_messages; ++i) {
      alternate(i, 80, rng);
      if (!streaming(i)) jitter(rng);
      if (!(co_await with_timeout(c.send(hammer_message(i)), 60s))) break;
      if ((!streaming(i) || i % 4 == 3) && !co_await reply(i)) break;
      done = i + 1;
    }
    (void)co_await with_timeout(c.close(), 60s);
  }());
  server.join();
  CHECK(done == hammer_messages);
  CHECK(server_ok.load());
  // Both sides slept (the boundary was crossed), many times.
  CHECK(server_sleeps > 100);
  CHECK(ctx.loop_sleeps() > 100);
}

namespace {
// The killed peer: memory that is not shared (so every access goes through
// the rings), its descriptor sent, then it reads nothing and sleeps.
[[noreturn]] void ring_peer(std::uint16_t port) {
  try {
    io_context cctx;
    cctx.run([](std::uint16_t port) -> task<void> {
      auto d = domain::open(local_options()).value();
      std::vector<std::byte> mem(16 << 20);
      auto mr = d.register_memory(mem, access::all).value();
      auto c = (co_await d.connect(endpoint::loopback(port))).value();
      std::array<std::byte, remote_buffer::wire_size> wire{};
      mr.remote().serialize(wire);
      (void)co_await c.send(wire);
      (void)co_await sleep_for(std::chrono::hours(1));
    }(port));
  } catch (...) {
  }
  ::_exit(0);
}
}  // namespace

TEST_CASE("rings: a peer killed with operations pending; every one fails with disconnected") {
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  pid_t child = ::fork();  // before this thread has an io_context
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipefd[1]);
    std::uint16_t port = 0;
    if (::read(pipefd[0], &port, sizeof port) != sizeof port) ::_exit(0);
    ring_peer(port);
  }
  ::close(pipefd[0]);
  io_context ctx;
  auto d = domain::open(local_options()).value();
  auto l = d.listen(endpoint::loopback(0)).value();
  const auto port = l.local_endpoint()->port();
  REQUIRE(::write(pipefd[1], &port, sizeof port) == sizeof port);
  ::close(pipefd[1]);
  std::vector<std::error_code> errors;
  ctx.run([](listener& l, pid_t child, std::vector<std::error_code>& errors) -> task<void> {
    auto c = (co_await accept_within_limit(l)).value();
    auto m = (co_await c.recv()).value();
    REQUIRE(m.size() == remote_buffer::wire_size);
    auto rb = remote_buffer::deserialize(m.data().first<remote_buffer::wire_size>());
    m.reset();
    // Transfers of 1 MiB (four rings' worth) and sends the peer never takes
    // (past its receive buffers they wait for credits), until each fails.
    auto loop = [](connection& c, remote_buffer rb, int kind, std::error_code& out) -> task<void> {
      std::vector<std::byte> local(1 << 20);
      for (std::uint64_t i = 0;; ++i) {
        auto slice = rb.slice((i % 16) * local.size(), local.size()).value();
        auto r = kind == 0 ? co_await c.write(local, slice)
                 : kind == 1 ? co_await c.read(local, slice)
                             : co_await c.send(std::span(local).first(1000));
        if (!r) {
          out = r.error();
          co_return;
        }
      }
    };
    auto receive = [](connection& c, std::error_code& out) -> task<void> {
      auto r = co_await c.recv();  // the peer sends nothing more
      out = r ? std::error_code{} : r.error();
    };
    errors.resize(9);
    std::vector<task<void>> all;
    for (int i = 0; i < 8; ++i) all.push_back(loop(c, rb, i % 3, errors[static_cast<std::size_t>(i)]));
    all.push_back(receive(c, errors[8]));
    std::thread killer([child] {
      std::this_thread::sleep_for(50ms);
      ::kill(child, SIGKILL);
    });
    auto t = co_await with_timeout(when_all(std::move(all)), 60s);
    killer.join();
    CHECK(t.has_value());  // ended by the failures, not the deadline
    CHECK_FALSE(c.is_open());
    l.close();
  }(l, child, errors));
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  REQUIRE(errors.size() == 9);
  for (auto& ec : errors) CHECK(ec == make_error_code(errc::disconnected));
}

namespace {

int sealed_memfd(std::size_t size) {
  int fd = ::memfd_create("raw", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  (void)::ftruncate(fd, static_cast<off_t>(size));
  (void)::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  return fd;
}

// A raw connector that asks for rings: both hellos, then the rings mapped
// here (ring 0 is ours to produce into, ring 1 the server's).
struct raw_peer {
  int fd = -1, service = -1;
  std::byte* rings = nullptr;
  bool connect(std::uint16_t port, bool carried) {
    namespace lw = detail::local_wire;
    auto name = endpoint::unix_socket("@shuttle-local:" + std::to_string(port)).value();
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || ::connect(fd, name.data(), name.size()) != 0) return false;
    int keys = sealed_memfd(lw::key_table_bytes), ring = sealed_memfd(lp::ring_bytes);
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) return false;
    service = pair[0];
    lw::hello h;
    h.rings = true;
    h.carried = carried;
    std::array<std::byte, lw::hello_size> hb{};
    lw::encode_hello(h, hb);
    send_fds(fd, hb, {keys, pair[1], ring});
    std::array<std::byte, tcp_wire::hello_size> eh{};
    tcp_wire::hello th;
    th.receive_buffers = 8;  // credits for more than a ring: the server's writer then needs our head
    th.receive_buffer_size = 64 << 10;
    tcp_wire::encode_hello(th, eh);
    (void)::send(fd, eh.data(), eh.size(), MSG_NOSIGNAL);
    void* p = ::mmap(nullptr, lp::ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ring, 0);
    for (int f : {keys, pair[1], ring}) ::close(f);
    std::array<std::byte, lw::hello_size + tcp_wire::hello_size> theirs{};
    if (p == MAP_FAILED || !read_exact(fd, theirs)) return false;
    rings = static_cast<std::byte*>(p);
    return true;
  }
  std::atomic_ref<std::uint64_t> word(int ring, std::size_t off) const {
    return std::atomic_ref<std::uint64_t>(
        *reinterpret_cast<std::uint64_t*>(rings + static_cast<std::size_t>(ring) * (lp::ring_ctl + lp::ring_capacity) + off));
  }
  void bell() const { (void)::send(fd, "\1", 1, MSG_NOSIGNAL); }
  ~raw_peer() {
    if (rings) ::munmap(rings, lp::ring_bytes);
    if (service >= 0) ::close(service);
    if (fd >= 0) ::close(fd);
  }
};

// One frame, `h` and `payload` zero bytes, as ring 0's first record.
void put_frame(raw_peer& r, const tcp_wire::header& h, std::size_t payload) {
  std::array<std::byte, tcp_wire::header_size> hb{};
  tcp_wire::encode_header(h, hb);
  std::memcpy(r.rings + lp::ring_ctl + 8, hb.data(), hb.size());
  std::memset(r.rings + lp::ring_ctl + 8 + hb.size(), 0, payload);
  const std::size_t len = hb.size() + payload;
  r.word(0, lp::ring_ctl + (8 + len + 63) / 64 * 64).store(0);
  r.word(0, lp::ring_ctl).store(lp::ring_mark(0, len));
}

// An 8-byte SEND carrying `flags` (flag_ack: arg0, flag_credit: arg1).
tcp_wire::header carrying(std::uint8_t flags, std::uint64_t arg0, std::uint64_t arg1) {
  tcp_wire::header h;
  h.op = tcp_wire::opcode::send;
  h.seq = 1;
  h.length = 8;
  h.flags = flags;
  h.arg0 = arg0;
  h.arg1 = arg1;
  return h;
}

// Waits (bounded) until the server has taken `n` bytes of ring 0.
bool taken(const raw_peer& r, std::uint64_t n) {
  for (int i = 0; i < 10000 && r.word(0, lp::ring_head).load() != n; ++i) std::this_thread::sleep_for(1ms);
  return r.word(0, lp::ring_head).load() == n;
}

}  // namespace

TEST_CASE("rings: a hostile peer's bad marks, indices or garbage fail its connection only (protocol_error)") {
  using attack = std::function<void(raw_peer&)>;
  struct entry {
    const char* what;
    bool server_sends;  // the bad index is the one the server's writer reads
    attack body;
    bool carried = false;  // the raw peer's hello says its SENDs carry ACKs and credits
  };
  // Ring 0's record marks (ring.hpp): at 64-byte aligned positions.
  std::vector<entry> attacks = {
      {"a record longer than a ring allows", false,
       [](raw_peer& r) { r.word(0, lp::ring_ctl).store(lp::ring_mark(0, lp::ring_max_record + 1)); }},
      {"a record that is not where it says", false,
       [](raw_peer& r) {
         r.word(0, lp::ring_ctl + 64).store(0);
         r.word(0, lp::ring_ctl).store(lp::ring_mark(0, 8));  // part of a header: the server takes it and waits
         r.bell();
         REQUIRE(taken(r, 64));
         r.word(0, lp::ring_ctl + 64).store(lp::ring_mark(64 + lp::ring_capacity, 8));  // an older lap's
       }},
      {"garbage frames", false,
       [](raw_peer& r) {
         auto junk = pattern(4096, 3);
         std::memcpy(r.rings + lp::ring_ctl + 8, junk.data(), junk.size());
         r.word(0, lp::ring_ctl + 4096 + 64).store(0);
         r.word(0, lp::ring_ctl).store(lp::ring_mark(0, junk.size()));
       }},
      {"a head past what the server published", true,
       [](raw_peer& r) { r.word(1, lp::ring_head).store(std::uint64_t(1) << 40); }},
      // SENDs that carry an ACK or a CREDIT (tcp_wire: flag_ack, flag_credit):
      {"a carried ACK where the hellos did not agree on it", false,
       [](raw_peer& r) { put_frame(r, carrying(tcp_wire::flag_ack, 1, 0), 8); }},
      {"a carried ACK of a request the server never sent", false,
       [](raw_peer& r) { put_frame(r, carrying(tcp_wire::flag_ack, 1, 0), 8); }, true},
      {"a carried CREDIT the server never consumed", false,
       [](raw_peer& r) { put_frame(r, carrying(tcp_wire::flag_credit, 0, 1), 8); }, true},
  };
  for (auto& e : attacks) {
    const std::string what = e.what;
    CAPTURE(what);
    io_context ctx;
    auto sd = domain::open(local_options()).value();
    auto cd = domain::open(local_options()).value();
    auto l = sd.listen(endpoint::loopback(0)).value();
    const auto port = l.local_endpoint()->port();
    std::atomic<bool> attacked{false};
    ctx.run([](domain& cd, listener& l, std::uint16_t port, std::atomic<bool>& attacked, const entry& e) -> task<void> {
      // A good connection first, on the same listener.
      auto [gs, gc] = co_await when_all(accept_within_limit(l), cd.connect(endpoint::loopback(port)));
      REQUIRE(gs.has_value());
      REQUIRE(gc.has_value());
      std::thread t([&, port] {
        raw_peer r;
        REQUIRE(r.connect(port, e.carried));
        e.body(r);
        r.bell();
        attacked = true;
        std::byte b[64];
        while (::recv(r.fd, b, sizeof b, 0) > 0) {}  // until the server fails the connection
      });
      auto bad = (co_await accept_within_limit(l)).value();
      for (int i = 0; i < 10000 && !attacked; ++i) (void)co_await sleep_for(1ms);
      // The server's writer loads the peer's head when the room it knows
      // of is short: sends of more than a ring (the peer takes nothing)
      // get there, and fail, with protocol_error or, if the connection
      // failed before them, disconnected.
      if (e.server_sends) {
        const auto msg = pattern(60000, 1);
        std::vector<task<result<void>>> sends;
        for (int i = 0; i < 8; ++i) sends.push_back(bad.send(msg));
        auto all = co_await with_timeout(when_all(std::move(sends)), 30s);
        REQUIRE(all.has_value());
        bool failed = false;
        for (auto& r : *all) failed |= !r.has_value();
        CHECK(failed);
      }
      auto m = co_await with_timeout(bad.recv(), 30s);  // the first error: why the connection failed
      REQUIRE_FALSE(m.has_value());
      CHECK(m.error() == make_error_code(errc::protocol_error));
      CHECK_FALSE(bad.is_open());
      bad = connection();  // closes our end: the raw peer's drain ends
      t.join();
      CHECK(co_await exchange(*gc, *gs, pattern(60000, 2)));
      CHECK(co_await exchange(*gs, *gc, pattern(65536, 3)));
      (void)co_await gc->close();
      (void)co_await gs->close();
    }(cd, l, port, attacked, e));
  }
}

namespace {

// Bytes the rings carried per message over `n` 8-byte round trips (the
// server echoing each) on a fresh pair; both ends in this loop.
task<double> ring_bytes_per_message(int n) {
  lpair p;
  co_await make_lpair(p);
  auto echo = [](connection& c, int n) -> task<bool> {
    for (int i = 0; i < n; ++i) {
      auto m = co_await c.recv();
      if (!m) co_return false;
      std::vector<std::byte> copy(m->data().begin(), m->data().end());
      m->reset();
      if (!co_await c.send(copy)) co_return false;
    }
    co_return true;
  };
  auto ping = [](connection& c, int n) -> task<bool> {
    const auto msg = pattern(8, 5);
    for (int i = 0; i < n; ++i) {
      if (!co_await c.send(msg)) co_return false;
      auto r = co_await c.recv();
      if (!r || !same(r->data(), msg)) co_return false;
    }
    co_return true;
  };
  REQUIRE(co_await exchange(p.client, p.server, pattern(8, 1)));  // the announcements are out
  const auto before = detail::local_ring_bytes();
  auto both = co_await with_timeout(when_all(echo(p.server, n), ping(p.client, n)), 60s);
  REQUIRE(both.has_value());
  auto [a, b] = *both;
  const auto after = detail::local_ring_bytes();
  CHECK(a);
  CHECK(b);
  co_await close_lpair(p);
  co_return double(after - before) / (2.0 * n);
}

struct env_var {
  const char* name;
  env_var(const char* n, const char* v) : name(n) { ::setenv(n, v, 1); }
  ~env_var() { ::unsetenv(name); }
};

}  // namespace

// A ping-pong's message, the ACK of the peer's and the credit it returns
// are one frame (tcp_wire: flag_ack, flag_credit): an 8-byte message is a
// 56-byte record; with SHUTTLE_LOCAL_CARRY=0, the ACK and the CREDIT
// follow as frames of their own (152 bytes).
TEST_CASE("rings: a ping-pong's SEND carries the ACK and the credit back") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    const double carried = co_await ring_bytes_per_message(2000);
    double separate = 0;
    {
      env_var off("SHUTTLE_LOCAL_CARRY", "0");
      separate = co_await ring_bytes_per_message(2000);
    }
    MESSAGE("ring bytes per message: " << carried << " carried, " << separate << " separate");
    CHECK(carried < 60);
    CHECK(separate > 150);
  }());
}

// Credits that wait for a SEND to carry them are not held back when none
// comes: both sides only send (nobody replies), with one receive buffer
// each, so every message waits for the credit of the one before. A
// credit withheld stalls it; every wait is bounded (a hang guard).
TEST_CASE("rings: both sides only send, a window of one: every credit comes back") {
  for (const char* spin : {"0", "20000"}) {
    const std::string spin_ns = spin;
    CAPTURE(spin_ns);
    io_context ctx;
    ctx.run([](const char* spin) -> task<void> {
      io_context::current().set_ring_spin_budget(std::chrono::nanoseconds(std::atoi(spin)));
      connection_options o;
      o.receive_buffers = 1;
      lpair p;
      co_await make_lpair(p, o);
      constexpr int n = 3000;
      auto sender = [](connection& c, unsigned seed) -> task<bool> {
        for (int i = 0; i < n; ++i)
          if (!co_await c.send(pattern(8 + i % 64, seed + static_cast<unsigned>(i)))) co_return false;
        co_return true;
      };
      auto receiver = [](connection& c, unsigned seed) -> task<bool> {
        for (int i = 0; i < n; ++i) {
          auto m = co_await c.recv();
          if (!m || !same(m->data(), pattern(8 + i % 64, seed + static_cast<unsigned>(i)))) co_return false;
        }
        co_return true;
      };
      auto all = co_await with_timeout(
          when_all(sender(p.client, 1), sender(p.server, 2), receiver(p.server, 1), receiver(p.client, 2)), 60s);
      REQUIRE(all.has_value());
      auto [a, b, c, d] = *all;
      CHECK(a);
      CHECK(b);
      CHECK(c);
      CHECK(d);
      co_await close_lpair(p);
    }(spin));
  }
}

namespace {

// Message i of an ordered run: its index, then pattern(size - 8, i).
std::vector<std::byte> indexed(std::uint64_t i, std::size_t size) {
  auto v = pattern(size, static_cast<unsigned>(i) + 77);
  std::memcpy(v.data(), &i, 8);
  return v;
}

// Receives `sizes.size()` messages and checks that message i is indexed(i, sizes[i]).
task<bool> recv_in_order(connection& c, std::vector<std::size_t> sizes) {
  for (std::uint64_t i = 0; i < sizes.size(); ++i) {
    auto m = co_await c.recv();
    if (!m || !same(m->data(), indexed(i, sizes[i]))) co_return false;
  }
  co_return true;
}

// Sends of the given sizes, all posted in one go (each starts before the
// one after it: when_all starts them in order), and received in order.
task<void> posted_in_one_go(lpair& p, const std::vector<std::size_t>& sizes) {
  std::vector<std::vector<std::byte>> msgs;
  for (std::uint64_t i = 0; i < sizes.size(); ++i) msgs.push_back(indexed(i, sizes[i]));
  std::vector<task<result<void>>> sends;
  for (auto& m : msgs) sends.push_back(p.client.send(m));
  auto [rs, got] = co_await when_all(when_all(std::move(sends)), recv_in_order(p.server, sizes));
  for (auto& r : rs) CHECK(r.has_value());
  CHECK(got);
}

}  // namespace

// A SEND goes into the ring from the application's call only when nothing
// of ours is ahead of it in the engine: behind a send too large for a
// record (the engine's writer takes it), the small ones after it wait
// their turn there; with nothing ahead, they go from the call.
TEST_CASE("rings: a SEND from the application's call never overtakes what the engine holds") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options o;
    o.receive_buffer_size = 1 << 20;
    o.receive_buffers = 16;
    lpair p;
    co_await make_lpair(p, o);
    const auto fast0 = detail::local_ring_sends();
    // (Named: GCC 12 miscompiles a braced list in a co_await's arguments.)
    const std::vector<std::size_t> small{8, 16, 24}, behind{1 << 20, 8, 8, 100, 8};
    co_await posted_in_one_go(p, small);  // nothing ahead: from the call
    CHECK(detail::local_ring_sends() - fast0 == 3);
    const auto fast1 = detail::local_ring_sends();
    co_await posted_in_one_go(p, behind);  // the first is the writer's: the rest behind it
    CHECK(detail::local_ring_sends() == fast1);
    co_await close_lpair(p);
  }());
}

// The writer streams a send larger than the ring, waiting for room for its
// rest (outq is empty meanwhile): a small send posted while it waits goes
// behind it, not into the middle of its payload. The send is posted after
// a varying number of loop turns, so that some land in that wait.
TEST_CASE("rings: a SEND posted while the writer waits for room goes behind what it writes") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options o;
    o.receive_buffer_size = 4 << 20;
    o.receive_buffers = 4;
    lpair p;
    co_await make_lpair(p, o);
    const std::vector<std::size_t> sizes{3 * lp::ring_capacity + 100, 8};
    for (int turns = 0; turns < 40; ++turns) {
      CAPTURE(turns);
      const auto big = indexed(0, sizes[0]), small = indexed(1, sizes[1]);
      auto later = [](connection& c, std::span<const std::byte> m, int turns) -> task<result<void>> {
        for (int i = 0; i < turns; ++i) co_await yield();
        co_return co_await c.send(m);
      };
      auto [a, b, got] = co_await when_all(p.client.send(big), later(p.client, small, turns),
                                           recv_in_order(p.server, sizes));
      CHECK(a.has_value());
      CHECK(b.has_value());
      CHECK(got);
    }
    CHECK(p.client.is_open());
    co_await close_lpair(p);
  }());
}

// Sends posted in one go until the ring is full: the ones that fit go from
// the call, the rest fall back to the engine (which waits for room), in
// order, every byte intact.
TEST_CASE("rings: SENDs that find the ring full fall back to the engine, in order") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_options o;
    o.receive_buffer_size = 32 << 10;
    o.receive_buffers = 64;
    lpair p;
    co_await make_lpair(p, o);
    std::vector<std::size_t> sizes;
    for (int i = 0; i < 48; ++i) sizes.push_back(i % 5 == 4 ? 8 : (32 << 10) - 3 * i);  // 1.2 MiB in all
    const auto fast = detail::local_ring_sends();
    co_await posted_in_one_go(p, sizes);
    const auto went = detail::local_ring_sends() - fast;
    MESSAGE(went << " of " << sizes.size() << " from the call");
    CHECK(went > 0);
    CHECK(went < sizes.size() / 2);  // the ring (256 KiB) holds about 8 of them
    const std::vector<std::size_t> two{8, 8};
    co_await posted_in_one_go(p, two);  // the engine's queue is empty again: from the call
    CHECK(detail::local_ring_sends() - fast == went + 2);
    co_await close_lpair(p);
  }());
}

// A SEND that went from the call and waits for its ACK, cancelled: as the
// engine's, the connection fails and the send ends canceled (or done, if
// the ACK came first), never before its buffer is safe.
TEST_CASE("rings: a SEND from the call, cancelled in flight, fails the connection as the engine's does") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    const auto fast = detail::local_ring_sends();
    auto msg = std::make_unique<std::vector<std::byte>>(pattern(8, 3));
    async_scope scope;
    std::optional<result<void>> out;
    auto sender = [](connection& c, std::span<const std::byte> m, std::optional<result<void>>& out) -> task<void> {
      out.emplace(co_await c.send(m));
    };
    scope.spawn(sender(p.client, *msg, out));
    CHECK(detail::local_ring_sends() - fast == 1);
    scope.request_stop();
    co_await scope.join();
    REQUIRE(out.has_value());
    CHECK((out->has_value() || out->error() == std::errc::operation_canceled));
    if (!out->has_value()) {
      msg.reset();
      (void)co_await sleep_for(20ms);
      CHECK_FALSE(p.client.is_open());
      auto r = co_await p.client.send(pattern(8, 4));
      REQUIRE_FALSE(r.has_value());
      CHECK(r.error() == errc::disconnected);
    }
    co_await close_lpair(p);
  }());
}
