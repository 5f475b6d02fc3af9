// The local provider's own cases (issue 30): accesses done on the peer's
// mapping of a shared region (shuttle/local.hpp), their order against what
// is queued on the socket, refused accesses, a peer that deregisters and
// frees its memory, a peer killed mid-transfer, hostile peers on the Unix
// socket and on the service channel, and Unix-socket endpoints. The
// provider-neutral cases run in conformance-local.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "local_common.hpp"
#include "local_wire.hpp"
#include "stats.hpp"
#include "../tcp_provider/stats.hpp"  // tcp_list_frames
#include "wire.hpp"

#include <shuttle/local.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <random>
#include <thread>

using namespace shuttle;
using namespace transport_test;
using namespace std::chrono_literals;

namespace {

constexpr auto deadline = 30s;  // a wait of these tests; a hang fails here
using clock = std::chrono::steady_clock;

std::uint64_t direct_count() { return detail::local_direct_accesses(); }

// Writes `data` at `rb` until a write is done on the client's own mapping
// (the first ones go through the socket while the peer's answer is on its
// way). A bounded number of tries, each a loop turn or so apart.
task<bool> until_direct(connection& c, remote_buffer rb, std::span<const std::byte> data) {
  for (int i = 0; i < 5000; ++i) {
    auto before = direct_count();
    if (!(co_await c.write(data, rb))) co_return false;
    if (direct_count() > before) co_return true;
    (void)co_await sleep_for(1ms);
  }
  co_return false;
}

}  // namespace

TEST_CASE("shared region: write, read and atomics on the peer's mapping, data verified") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    CHECK(p.client.kind() == transport_kind::local);
    auto mem = shared_memory::allocate(1 << 20).value();
    REQUIRE(mem.size() == (1u << 20));
    auto mr = p.sd->register_memory(mem.span(), access::all).value();
    auto rb = mr.remote();
    REQUIRE(co_await until_direct(p.client, rb.slice(0, 64).value(), pattern(64, 1)));
    const auto before = direct_count();
    for (std::size_t n : {std::size_t(1), std::size_t(8), std::size_t(4097), mem.size()}) {
      auto data = pattern(n, static_cast<unsigned>(n));
      REQUIRE((co_await p.client.write(data, rb.slice(0, n).value())).has_value());
      CHECK(std::memcmp(mem.data(), data.data(), n) == 0);
      std::vector<std::byte> back(n);
      REQUIRE((co_await p.client.read(back, rb.slice(0, n).value())).has_value());
      CHECK(back == data);
    }
    // At an offset: the bytes around it untouched.
    std::fill_n(mem.data(), 3 * 4096, std::byte{0});
    auto data = pattern(100, 7);
    REQUIRE((co_await p.client.write(data, rb.slice(4000, 100).value())).has_value());
    CHECK(std::memcmp(mem.data() + 4000, data.data(), 100) == 0);
    CHECK(mem.data()[3999] == std::byte{0});
    CHECK(mem.data()[4100] == std::byte{0});
    // Atomics on the mapped word.
    auto word = rb.slice(8192, 8).value();
    std::uint64_t init = 40;
    std::memcpy(mem.data() + 8192, &init, 8);
    auto f = co_await p.client.fetch_and_add(word, 2);
    CHECK(f.value() == 40);
    auto c1 = co_await p.client.compare_and_swap(word, 42, 7);
    CHECK(c1.value() == 42);
    auto c2 = co_await p.client.compare_and_swap(word, 42, 9);  // not swapped
    CHECK(c2.value() == 7);
    std::uint64_t now = 0;
    std::memcpy(&now, mem.data() + 8192, 8);
    CHECK(now == 7);
    CHECK(direct_count() - before == 8 + 1 + 3);  // every one of them on the mapping
    // A misaligned word is refused before anything (as on the other providers).
    auto bad = co_await p.client.fetch_and_add(rb.slice(8193, 8).value(), 1);
    CHECK(bad.error() == std::errc::invalid_argument);
    CHECK(p.client.is_open());
    co_await close_lpair(p);
  }());
}

TEST_CASE("ordering: an access on the mapping never overtakes one queued on the socket") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    auto mem = shared_memory::allocate(4 << 20).value();
    auto mr = p.sd->register_memory(mem.span(), access::all).value();
    auto rb = mr.remote(0, 4 << 20);
    REQUIRE(co_await until_direct(p.client, rb.slice(0, 8).value(), pattern(8, 1)));
    for (unsigned i = 0; i < 4; ++i) {
      // A large write_with_imm goes through the socket; the write after it
      // to the same bytes must land after it, whatever path it takes.
      auto a = pattern(mem.size(), 10 + i), b = pattern(mem.size(), 20 + i);
      auto [wa, wb, m] = co_await when_all(p.client.write_with_imm(a, rb, i), p.client.write(b, rb), p.server.recv());
      REQUIRE(wa.has_value());
      REQUIRE(wb.has_value());
      REQUIRE(m.has_value());
      CHECK(std::memcmp(mem.data(), b.data(), b.size()) == 0);
      // And a read after a send sees the write before it.
      auto c = pattern(64, 30 + i);
      std::vector<std::byte> back(64);
      auto [s, w, r, m2] = co_await when_all(p.client.send(c), p.client.write(c, rb.slice(0, 64).value()),
                                             p.client.read(back, rb.slice(0, 64).value()), p.server.recv());
      REQUIRE(r.has_value());
      CHECK(back == c);
    }
    co_await close_lpair(p);
  }());
}

TEST_CASE("refused on a shared region: bad rkey, out of bounds, missing rights; memory around untouched") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto mem = shared_memory::allocate(4 * 4096).value();
    std::fill_n(mem.data(), mem.size(), std::byte{0x11});
    struct bad_case {
      const char* what;
      std::function<remote_buffer(remote_buffer)> target;
      unsigned rights;
    };
    std::vector<bad_case> cases = {
        {"bad rkey", [](remote_buffer r) { return remote_buffer{r.address, r.rkey ^ 0x5a5a5a5au, r.length}; },
         access::all},
        {"past the end", [](remote_buffer r) { return remote_buffer{r.address + r.length - 8, r.rkey, 16}; },
         access::all},
        {"before the start", [](remote_buffer r) { return remote_buffer{r.address - 8, r.rkey, 16}; }, access::all},
        {"no write right", [](remote_buffer r) { return r; }, access::local_write | access::remote_read},
    };
    for (auto& bc : cases) {
      CAPTURE(bc.what);
      lpair p;
      co_await make_lpair(p);
      // The middle two pages of the block: the pages around stay 0x11.
      auto mr = p.sd->register_memory(mem.span().subspan(4096, 2 * 4096), bc.rights).value();
      auto rb = mr.remote();
      if (bc.rights & access::remote_write) {
        REQUIRE(co_await until_direct(p.client, rb.slice(0, 8).value(), pattern(8, 3)));
      } else {  // mapped (read-only) once read
        std::vector<std::byte> tmp(8);
        for (int i = 0; i < 50; ++i) {
          REQUIRE((co_await p.client.read(tmp, rb.slice(0, 8).value())).has_value());
          (void)co_await sleep_for(1ms);
        }
      }
      auto t = bc.target(rb);
      auto data = pattern(t.length, 4);  // as long as the target (8 KiB for a bad rkey), not read past
      auto w = co_await p.client.write(data, t);
      REQUIRE_FALSE(w.has_value());
      CHECK(w.error() == make_error_code(errc::remote_access_error));
      CHECK_FALSE(p.client.is_open());
      for (std::size_t i : {std::size_t(0), std::size_t(4095), std::size_t(3 * 4096), mem.size() - 1})
        CHECK(mem.data()[i] == std::byte{0x11});
      (void)co_await p.server.close();
      p.l.close();
    }
  }());
}

TEST_CASE("a peer that deregisters and frees its memory: accesses refused, no fault") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    std::optional<shared_memory> mem(shared_memory::allocate(1 << 16).value());
    std::optional<memory_region> mr(p.sd->register_memory(mem->span(), access::all).value());
    auto rb = mr->remote();
    REQUIRE(co_await until_direct(p.client, rb.slice(0, 8).value(), pattern(8, 5)));
    mr.reset();   // deregistered: the key-table word is cleared
    mem.reset();  // and unmapped
    auto before = direct_count();
    auto w = co_await p.client.write(pattern(8, 6), rb.slice(0, 8).value());
    REQUIRE_FALSE(w.has_value());
    CHECK(w.error() == make_error_code(errc::remote_access_error));
    CHECK(direct_count() == before);
    (void)co_await p.server.close();
    p.l.close();
  }());
}

namespace {
// The killed peer: a shared region, its descriptor sent, then nothing.
[[noreturn]] void shared_peer(std::uint16_t port) {
  try {
    io_context cctx;
    cctx.run([](std::uint16_t port) -> task<void> {
      auto d = domain::open(local_options()).value();
      auto mem = shared_memory::allocate(16 << 20).value();
      auto mr = d.register_memory(mem.span(), access::all).value();
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

TEST_CASE("a peer killed mid-transfer on its shared region: the transfers fail, no hang") {
  // Forked before this thread has an io_context (the child makes its own).
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipefd[1]);
    std::uint16_t port = 0;
    if (::read(pipefd[0], &port, sizeof port) != sizeof port) ::_exit(0);
    shared_peer(port);
  }
  ::close(pipefd[0]);
  io_context ctx;
  auto d = domain::open(local_options()).value();
  auto l = d.listen(endpoint::loopback(0)).value();
  const auto port = l.local_endpoint()->port();
  REQUIRE(::write(pipefd[1], &port, sizeof port) == sizeof port);
  ::close(pipefd[1]);
  std::error_code ec;
  std::uint64_t direct = 0;
  ctx.run([](listener& l, pid_t child, std::error_code& ec, std::uint64_t& direct) -> task<void> {
    auto c = (co_await accept_within_limit(l)).value();
    auto m = (co_await c.recv()).value();
    REQUIRE(m.size() == remote_buffer::wire_size);
    auto rb = remote_buffer::deserialize(m.data().first<remote_buffer::wire_size>());
    m.reset();
    std::vector<std::byte> local(1 << 20);
    REQUIRE(co_await until_direct(c, rb.slice(0, 8).value(), pattern(8, 1)));
    // Killed from another thread: accesses on the mapping never give the loop a turn.
    std::thread killer([child] {
      std::this_thread::sleep_for(30ms);
      ::kill(child, SIGKILL);
    });
    const auto before = direct_count();
    auto transfers = [](connection& c, std::vector<std::byte>& local, remote_buffer rb,
                        std::error_code& out) -> task<void> {
      for (std::uint64_t i = 0;; ++i) {
        auto slice = rb.slice((i % 16) * local.size(), local.size()).value();
        auto w = (i & 1) ? co_await c.read(local, slice) : co_await c.write(local, slice);
        if (!w) {
          out = w.error();
          co_return;
        }
      }
    };
    auto t = co_await with_timeout(transfers(c, local, rb, ec), 60s);
    killer.join();
    direct = direct_count() - before;
    CHECK(t.has_value());  // ended by the failure, not the deadline
    CHECK_FALSE(c.is_open());
    l.close();
  }(l, child, ec, direct));
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  CHECK(ec == make_error_code(errc::disconnected));
  CHECK(direct > 0);
}

namespace {

// A raw client of the local provider on a blocking Unix socket, in a thread
// of its own (the loop under test never waits on it).
int raw_connect(std::uint16_t port) {
  auto name = endpoint::unix_socket("@shuttle-local:" + std::to_string(port)).value();
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, name.data(), name.size()) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Reads until the server closes: what a refused peer sees.
void drain(int fd) {
  std::byte b[256];
  while (::recv(fd, b, sizeof b, 0) > 0) {}
}

int key_table_memfd() {
  int fd = ::memfd_create("raw-keys", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  (void)::ftruncate(fd, detail::local_wire::key_table_bytes);
  (void)::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  return fd;
}

// The connector's side of both hellos; returns our end of the service
// channel (-1 if the server closed).
int raw_handshake(int fd) {
  namespace lw = detail::local_wire;
  int keys = key_table_memfd();
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
  std::array<std::byte, lw::hello_size> h{};
  lw::encode_hello(lw::hello{}, h);
  send_fds(fd, h, {keys, pair[1]});
  ::close(keys);
  ::close(pair[1]);
  std::array<std::byte, tcp_wire::hello_size> eh{};
  tcp_wire::hello th;
  th.receive_buffers = 4;
  th.receive_buffer_size = 1024;
  tcp_wire::encode_hello(th, eh);
  (void)::send(fd, eh.data(), eh.size(), MSG_NOSIGNAL);
  std::array<std::byte, lw::hello_size + tcp_wire::hello_size> theirs{};
  if (!read_exact(fd, theirs)) {
    ::close(pair[0]);
    return -1;
  }
  return pair[0];
}

struct refusals {
  std::vector<std::string> why;
};

// The server accepts while `attack` runs in its thread; then a good client
// still connects and exchanges a message.
task<void> good_client_still_served(domain& sd, listener& l) {
  auto cd = domain::open(local_options()).value();
  auto [s, c] = co_await when_all(accept_within_limit(l), cd.connect(endpoint::loopback(l.local_endpoint()->port())));
  REQUIRE(s.has_value());
  REQUIRE(c.has_value());
  auto msg = pattern(100, 1);
  auto [sr, rr] = co_await when_all(c->send(msg), s->recv());
  REQUIRE(rr.has_value());
  CHECK(same(rr->data(), msg));
  (void)sd;
}

}  // namespace

TEST_CASE("hostile peers on the Unix socket: garbage, bad descriptors; refused, others served") {
  io_context ctx;
  auto sd = domain::open(local_options()).value();
  auto log = std::make_shared<refusals>();
  listener_options lim;
  lim.on_refused = [log](const endpoint&, std::string_view why) { log->why.emplace_back(why); };
  auto l = sd.listen(endpoint::loopback(0), {}, lim).value();
  const auto port = l.local_endpoint()->port();
  using attack = std::function<void(int)>;
  namespace lw = detail::local_wire;
  std::vector<std::pair<const char*, attack>> attacks = {
      {"another protocol", [](int fd) {
         const char req[] = "GET / HTTP/1.0\r\n\r\n";
         (void)::send(fd, req, sizeof req - 1, MSG_NOSIGNAL);
       }},
      {"random bytes", [](int fd) {
         std::mt19937 rng(7);
         std::array<std::byte, 4096> junk;
         for (auto& b : junk) b = static_cast<std::byte>(rng());
         junk[0] = std::byte{'S'};
         junk[1] = std::byte{'H'};
         junk[2] = std::byte{'L'};
         junk[3] = std::byte{'O'};  // past the magic: the rest is garbage
         (void)::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
       }},
      {"a hello without descriptors", [](int fd) {
         std::array<std::byte, lw::hello_size> h{};
         lw::encode_hello(lw::hello{}, h);
         (void)::send(fd, h.data(), h.size(), MSG_NOSIGNAL);
       }},
      {"a pipe for a key table", [](int fd) {
         int p[2];
         REQUIRE(::pipe(p) == 0);
         int sp[2];
         REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp) == 0);
         std::array<std::byte, lw::hello_size> h{};
         lw::encode_hello(lw::hello{}, h);
         send_fds(fd, h, {p[0], sp[1]});
         for (int f : {p[0], p[1], sp[0], sp[1]}) ::close(f);
       }},
      {"an unsealed key table and a stream socket for the channel", [](int fd) {
         int m = ::memfd_create("x", MFD_CLOEXEC);
         (void)::ftruncate(m, lw::key_table_bytes);
         int sp[2];
         REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sp) == 0);
         std::array<std::byte, lw::hello_size> h{};
         lw::encode_hello(lw::hello{}, h);
         send_fds(fd, h, {m, sp[1]});
         for (int f : {m, sp[0], sp[1]}) ::close(f);
       }},
  };
  for (auto& entry : attacks) {
    // Not a structured binding: clang 14 cannot capture one (CAPTURE, lambdas).
    const char* what = entry.first;
    const attack& body = entry.second;
    CAPTURE(what);
    const auto refused_before = log->why.size();
    std::thread t([&, body = body] {
      int fd = raw_connect(port);
      REQUIRE(fd >= 0);
      body(fd);
      drain(fd);  // the server closes on us
      ::close(fd);
    });
    ctx.run([](domain& sd, listener& l, refusals& log, std::size_t before) -> task<void> {
      // accept() runs the handshakes; the bad one ends refused.
      while (log.why.size() == before) (void)co_await with_timeout(l.accept(), 10ms);
      co_await good_client_still_served(sd, l);
    }(sd, l, *log, refused_before));
    t.join();
    REQUIRE(log->why.size() == refused_before + 1);
    CHECK(log->why.back().find("handshake failed") == 0);
  }
}

TEST_CASE("hostile peer on the service channel: garbage or an unasked answer fails its connection only") {
  namespace lw = detail::local_wire;
  using attack = std::function<void(int)>;
  std::vector<std::pair<const char*, attack>> attacks = {
      {"garbage", [](int sfd) { (void)::send(sfd, "garbage!!", 9, 0); }},
      {"an answer nobody asked for", [](int sfd) {
         lw::answer a;
         a.rkey = 1234;
         std::array<std::byte, lw::answer_size> b{};
         lw::encode_answer(a, b);
         (void)::send(sfd, b.data(), b.size(), 0);
       }},
      {"a query with a descriptor", [](int sfd) {
         std::array<std::byte, lw::query_size> q{};
         lw::encode_query(99, q);
         send_fds(sfd, q, {0});
       }},
  };
  for (auto& entry : attacks) {
    // Not a structured binding: clang 14 cannot capture one (CAPTURE, lambdas).
    const char* what = entry.first;
    const attack& body = entry.second;
    CAPTURE(what);
    io_context ctx;
    auto sd = domain::open(local_options()).value();
    auto l = sd.listen(endpoint::loopback(0)).value();
    const auto port = l.local_endpoint()->port();
    std::atomic<bool> done{false};
    std::thread t([&, body = body] {
      int fd = raw_connect(port);
      REQUIRE(fd >= 0);
      int sfd = raw_handshake(fd);
      REQUIRE(sfd >= 0);
      body(sfd);
      drain(fd);  // until the server fails the connection
      ::close(sfd);
      ::close(fd);
      done = true;
    });
    ctx.run([](listener& l) -> task<void> {
      auto c = (co_await accept_within_limit(l)).value();
      auto r = co_await c.recv();  // the raw peer sends no message: the failure ends it
      REQUIRE_FALSE(r.has_value());
      CHECK(r.error() == make_error_code(errc::protocol_error));
      CHECK_FALSE(c.is_open());
    }(l));
    t.join();
    CHECK(done);
  }
}

TEST_CASE("local wire: what decodes is well-formed; garbage never does") {
  namespace lw = detail::local_wire;
  std::mt19937 rng(42);
  for (int i = 0; i < 200000; ++i) {
    std::vector<std::byte> b(rng() % 64);
    for (auto& x : b) x = static_cast<std::byte>(rng() % 4 == 0 ? 0 : rng());
    auto m = lw::decode_message(b);
    if (m && m->type == lw::msg_type::answer && m->ans.ok) {
      CHECK(m->ans.length > 0);
      CHECK(m->ans.slot < lw::key_slots);
      CHECK(m->ans.addr + m->ans.length >= m->ans.addr);
    }
  }
  lw::answer a;
  a.rkey = 5;
  a.ok = true;
  a.addr = 4096;
  a.length = 100;
  a.access = access::all;
  std::array<std::byte, lw::answer_size> b{};
  lw::encode_answer(a, b);
  auto m = lw::decode_message(b);
  REQUIRE(m.has_value());
  CHECK(m->ans.ok);
  CHECK(m->ans.length == 100);
  // One field at a time out of place: refused.
  a.addr = ~std::uint64_t(0) - 10;  // wraps
  lw::encode_answer(a, b);
  CHECK_FALSE(lw::decode_message(b).has_value());
  a.addr = 4096;
  a.slot = lw::key_slots;
  lw::encode_answer(a, b);
  CHECK_FALSE(lw::decode_message(b).has_value());
  a.slot = 0;
  a.access = access::local_write;  // no remote right
  lw::encode_answer(a, b);
  CHECK_FALSE(lw::decode_message(b).has_value());
  CHECK_FALSE(lw::decode_message(std::span(b).first(40)).has_value());
  std::array<std::byte, lw::hello_size> h{};
  lw::encode_hello(lw::hello{}, h);
  CHECK(lw::decode_hello(h).has_value());
  lw::hello both;
  both.rings = both.membarrier = both.carried = true;
  lw::encode_hello(both, h);
  auto back = lw::decode_hello(h);
  REQUIRE(back.has_value());
  CHECK(back->rings);
  CHECK(back->membarrier);
  CHECK(back->carried);
  h[7] = std::byte{8};  // no such flag
  CHECK(lw::decode_hello(h).error() == make_error_code(errc::protocol_error));
  lw::encode_hello(lw::hello{}, h);
  h[4] = std::byte{lw::protocol_version - 1};  // a peer whose SENDs carry no ACK (version 3)
  CHECK(lw::decode_hello(h).error() == make_error_code(errc::wire_version_mismatch));
  lw::encode_hello(lw::hello{}, h);
  h[6] = std::byte{3};  // no such role
  CHECK(lw::decode_hello(h).error() == make_error_code(errc::protocol_error));
  h[0] = std::byte{'X'};
  CHECK(lw::decode_hello(h).error() == make_error_code(errc::not_a_shuttle_peer));
}

TEST_CASE("endpoints: abstract names and socket files; local_endpoint; closed listeners") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto sd = domain::open(local_options()).value();
    auto cd = domain::open(local_options()).value();
    const std::string file = "/tmp/shuttle-local-test-" + std::to_string(::getpid()) + ".sock";
    ::unlink(file.c_str());
    for (const std::string& name : {"@shuttle-local-test-" + std::to_string(::getpid()), file}) {
      CAPTURE(name);
      auto ep = endpoint::unix_socket(name).value();
      auto l = sd.listen(ep).value();
      REQUIRE(l.local_endpoint().has_value());
      CHECK(l.local_endpoint()->to_string() == "unix:" + name);
      auto [s, c] = co_await when_all(accept_within_limit(l), cd.connect(ep));
      REQUIRE(s.has_value());
      REQUIRE(c.has_value());
      CHECK(c->remote_endpoint().to_string() == "unix:" + name);
      auto msg = pattern(10, 2);
      auto [sr, rr] = co_await when_all(c->send(msg), s->recv());
      REQUIRE(rr.has_value());
      CHECK(same(rr->data(), msg));
      l.close();
      CHECK(l.local_endpoint().error() == std::make_error_code(std::errc::bad_file_descriptor));
    }
    ::unlink(file.c_str());
    // Nobody there.
    auto none = co_await cd.connect(endpoint::unix_socket("@shuttle-local-test-nobody").value());
    CHECK_FALSE(none.has_value());
    CHECK_FALSE(endpoint::unix_socket("").has_value());
    CHECK_FALSE(endpoint::unix_socket(std::string(200, 'x')).has_value());
  }());
}

// A Unix socket has no TCP_INFO: the idle watch counts the frames the
// reader takes. A silent peer fails with errc::idle_timeout; a peer that
// keeps sending for longer than the timeout does not.
TEST_CASE("idle_timeout: a silent connection fails with errc::idle_timeout, a busy one does not") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    listener_options lim;
    lim.idle_timeout = 2s;
    lpair idle, busy;
    co_await make_lpair(idle, {}, lim);
    co_await make_lpair(busy, {}, lim);
    auto keep_busy = [&]() -> task<void> {
      std::array<std::byte, 8> b{};
      auto until = clock::now() + 3s;
      while (clock::now() < until) {
        REQUIRE((co_await busy.client.send(b)).has_value());
        auto m = co_await with_timeout(busy.server.recv(), deadline);
        REQUIRE(m.has_value());
        (void)co_await sleep_for(50ms);
      }
    };
    auto stay_silent = [&]() -> task<void> {
      auto r = co_await with_timeout(idle.server.recv(), deadline);
      REQUIRE_FALSE(r.has_value());
      CHECK(r.error() == make_error_code(errc::idle_timeout));
      CHECK_FALSE(idle.server.is_open());
    };
    co_await when_all(keep_busy(), stay_silent());
    CHECK(busy.server.is_open());
    co_await close_lpair(busy);
    co_await close_lpair(idle);
  }());
}

// Block lists on a shared region: every block a memcpy on the mapping (no
// frame through the engine), written then read back; a block the region's
// answer refuses (past the registration, inside what the remote_buffer
// claims: the list's own checks pass) stops the in-place run there and goes
// to the engine, which refuses it: the list fails naming that block, the
// blocks before it are in place, none after it (valid ones), nothing past
// the registration is touched, and the connection fails (RC).
TEST_CASE("shared region: block lists on the mapping; a refused block at the start, middle or end names its index") {
  std::size_t first_bad = 0;
  SUBCASE("first") { first_bad = 0; }
  SUBCASE("middle") { first_bad = 117; }
  SUBCASE("last") { first_bad = 299; }
  SUBCASE("none") { first_bad = 300; }
  io_context ctx;
  ctx.run([first_bad]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    constexpr std::size_t n = 300, size = 1000, stride = 2048, registered = n * stride;
    auto mem = shared_memory::allocate(registered + 8192).value();
    auto mr = p.sd->register_memory(mem.span().first(registered), access::all).value();
    auto rb = mr.remote();
    REQUIRE(co_await until_direct(p.client, rb.slice(0, 8).value(), pattern(8, 3)));
    std::fill_n(mem.data(), mem.size(), std::byte{0x5A});
    rb.length = registered + 8192;  // claims more than was registered
    auto src = pattern(registered, 11);
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < n; ++i) blocks.push_back({i * stride, i == first_bad ? registered + 4096 : i * stride, size});
    const auto direct_before = direct_count();
    const auto frames_before = detail::tcp_list_frames();
    auto r = co_await p.client.write_blocks(src, rb, blocks);
    std::size_t bad = 0;
    if (first_bad == n) {
      REQUIRE(r.has_value());
      CHECK(direct_count() - direct_before == n);  // one memcpy per block
      CHECK(detail::tcp_list_frames().sent == frames_before.sent);  // nothing through the engine
      for (std::size_t i = 0; i < n; ++i)
        bad += std::memcmp(mem.data() + i * stride, src.data() + i * stride, size) != 0;
      CHECK(bad == 0);
      std::vector<std::byte> back(registered, std::byte{0});
      auto rr = co_await p.client.read_blocks(back, rb, blocks);
      REQUIRE(rr.has_value());
      CHECK(direct_count() - direct_before == 2 * n);
      for (std::size_t i = 0; i < n; ++i)
        bad += std::memcmp(back.data() + i * stride, src.data() + i * stride, size) != 0;
      CHECK(bad == 0);
      CHECK(p.client.is_open());
      co_await close_lpair(p);
      co_return;
    }
    REQUIRE_FALSE(r.has_value());
    CHECK(matches(r.error(), errc::remote_access_error));
    CHECK(r.failed_block() == first_bad);
    CHECK(direct_count() - direct_before == first_bad);  // the ones before it, on the mapping
    for (std::size_t i = 0; i < n; ++i) {
      const std::byte* got = mem.data() + i * stride;
      if (i < first_bad)
        bad += std::memcmp(got, src.data() + i * stride, size) != 0;
      else
        bad += !std::all_of(got, got + size, [](std::byte b) { return b == std::byte{0x5A}; });
    }
    CHECK(bad == 0);
    const std::byte* past = mem.data() + registered;
    CHECK(std::all_of(past, past + 8192, [](std::byte b) { return b == std::byte{0x5A}; }));
    CHECK_FALSE(p.client.is_open());
    co_await close_lpair(p);
  }());
}

// A list whose remote_buffer the region's answer covers whole: checked as a
// whole before a byte moves (a bad last block: refused, nothing copied,
// the connection open), then a memcpy per run of adjacent blocks (counted
// as merged operations, as on every provider), nothing through the engine.
TEST_CASE("shared region: a list inside the answer: checked first, a memcpy per run of adjacent blocks") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    constexpr std::size_t size = 1 << 16;
    auto mem = shared_memory::allocate(size).value();
    auto mr = p.sd->register_memory(mem.span(), access::all).value();
    auto rb = mr.remote();
    REQUIRE(co_await until_direct(p.client, rb.slice(0, 8).value(), pattern(8, 3)));
    std::fill_n(mem.data(), mem.size(), std::byte{0x5A});
    auto src = pattern(size, 13);
    // 10 runs of 4 adjacent 256-byte blocks (runs 4 KiB apart, in reverse
    // order remotely), then 5 single blocks: 15 operations.
    std::vector<block> blocks;
    for (std::uint64_t r = 0; r < 10; ++r)
      for (std::uint64_t i = 0; i < 4; ++i) blocks.push_back({r * 4096 + i * 256, (9 - r) * 4096 + i * 256, 256});
    for (std::uint64_t i = 0; i < 5; ++i) blocks.push_back({45056 + i * 1024, 45056 + i * 2048, 100});
    auto bad_list = blocks;
    bad_list.back().remote_offset = size - 50;  // past the remote_buffer by 50 bytes
    const auto d0 = direct_count();
    const auto s0 = block_transfer_stats();
    const auto f0 = detail::tcp_list_frames();
    auto refused = co_await p.client.write_blocks(src, rb, bad_list);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error() == std::errc::result_out_of_range);
    CHECK(refused.failed_block() == bad_list.size() - 1);
    CHECK(direct_count() == d0);
    CHECK(std::all_of(mem.data(), mem.data() + size, [](std::byte b) { return b == std::byte{0x5A}; }));
    CHECK(p.client.is_open());
    REQUIRE((co_await p.client.write_blocks(src, rb, blocks)).has_value());
    CHECK(direct_count() - d0 == 15);
    CHECK(block_transfer_stats().operations - s0.operations == 15);
    std::size_t bad = 0;
    for (const block& b : blocks)
      bad += std::memcmp(mem.data() + b.remote_offset, src.data() + b.local_offset, b.length) != 0;
    CHECK(bad == 0);
    std::vector<std::byte> back(size, std::byte{0});
    REQUIRE((co_await p.client.read_blocks(back, rb, blocks)).has_value());
    CHECK(direct_count() - d0 == 30);
    for (const block& b : blocks)
      bad += std::memcmp(back.data() + b.local_offset, src.data() + b.local_offset, b.length) != 0;
    CHECK(bad == 0);
    CHECK(detail::tcp_list_frames().sent == f0.sent);  // nothing through the engine
    CHECK(p.client.is_open());
    co_await close_lpair(p);
  }());
}

// A list large enough to be copied with streaming stores (operations.cpp:
// past 8 MiB, runs of 16 KiB and more): unaligned offsets and lengths, runs
// mixed with small blocks, shuffled remotely; every byte of the blocks
// lands and nothing around them is touched, both ways.
TEST_CASE("shared region: a large list (streaming copies): unaligned blocks, bytes exact, nothing else touched") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    constexpr std::size_t n = 200, slot = (64 << 10) + 256, size = n * slot;
    auto mem = shared_memory::allocate(size).value();
    auto mr = p.sd->register_memory(mem.span(), access::all).value();
    auto rb = mr.remote();
    REQUIRE(co_await until_direct(p.client, rb.slice(0, 8).value(), pattern(8, 3)));
    std::fill_n(mem.data(), mem.size(), std::byte{0x5A});
    auto src = pattern(size, 17);
    std::vector<block> blocks;
    std::vector<std::uint64_t> where(n);
    for (std::size_t i = 0; i < n; ++i) where[i] = (i * 73) % n;  // a permutation (73 and 200 coprime)
    std::uint64_t local_at = 5;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t len = i % 10 == 9 ? 1000 + i : (64 << 10) + 37 + i % 7;  // small ones among the runs
      blocks.push_back({local_at, where[i] * slot + 3 + i % 5, len});
      local_at += len;
    }
    REQUIRE((co_await p.client.write_blocks(src, rb, blocks)).has_value());
    std::vector<std::byte> expect(size, std::byte{0x5A});
    for (const block& b : blocks) std::memcpy(expect.data() + b.remote_offset, src.data() + b.local_offset, b.length);
    CHECK(std::memcmp(mem.data(), expect.data(), size) == 0);
    std::vector<std::byte> back(size, std::byte{0x11});
    REQUIRE((co_await p.client.read_blocks(back, rb, blocks)).has_value());
    std::vector<std::byte> expect_back(size, std::byte{0x11});
    for (const block& b : blocks)
      std::memcpy(expect_back.data() + b.local_offset, expect.data() + b.remote_offset, b.length);
    CHECK(std::memcmp(back.data(), expect_back.data(), size) == 0);
    CHECK(p.client.is_open());
    co_await close_lpair(p);
  }());
}

// A list to a key not answered yet goes through the engine and asks for
// it (nothing else would: a batch does not wait for answers without GPU
// hooks); a later list is done in place. A batch that mixes: the writes
// before its send are done in place, the send and what follows it go
// through the engine, in order (the message arrives after every write).
TEST_CASE("shared region: a list asks for its key; a mixed batch is in place up to its first send") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    auto mem = shared_memory::allocate(1 << 16).value();
    auto mr = p.sd->register_memory(mem.span(), access::all).value();
    auto rb = mr.remote();
    auto src = pattern(1 << 16, 5);
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < 16; ++i) blocks.push_back({i * 4096, (15 - i) * 4096, 2048});
    const auto d0 = direct_count();
    REQUIRE((co_await p.client.write_blocks(src, rb, blocks)).has_value());
    CHECK(direct_count() == d0);  // through the engine, the key asked for
    bool in_place = false;
    for (int i = 0; i < 5000 && !in_place; ++i) {
      const auto d = direct_count();
      REQUIRE((co_await p.client.write_blocks(src, rb, blocks)).has_value());
      in_place = direct_count() - d == blocks.size();
      if (!in_place) (void)co_await sleep_for(1ms);
    }
    CHECK(in_place);
    std::size_t bad = 0;
    for (const block& b : blocks)
      bad += std::memcmp(mem.data() + b.remote_offset, src.data() + b.local_offset, b.length) != 0;
    CHECK(bad == 0);

    std::fill_n(mem.data(), mem.size(), std::byte{0});
    const char hello[] = "after the writes";
    std::array<operation, 4> ops{operation::write(std::span(src).subspan(0, 100), rb.slice(0, 100).value()),
                                 operation::write(std::span(src).subspan(100, 100), rb.slice(100, 100).value()),
                                 operation::send(std::as_bytes(std::span(hello))),
                                 operation::write(std::span(src).subspan(200, 100), rb.slice(200, 100).value())};
    const auto d1 = direct_count();
    REQUIRE((co_await p.client.post_batch(ops)).has_value());
    CHECK(direct_count() - d1 == 2);
    auto m = co_await with_timeout(p.server.recv(), deadline);
    REQUIRE(m.has_value());
    CHECK(m->size() == sizeof hello);
    CHECK(std::memcmp(mem.data(), src.data(), 300) == 0);
    CHECK(p.client.is_open());
    co_await close_lpair(p);
  }());
}
