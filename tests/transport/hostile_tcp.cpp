// Hostile raw TCP peers against the tcp provider (issue 27): a SEND split
// across two writes while a message is released, a flood of valid no-op
// frames, and READ/atomic requests whose responses are never read. The
// floods come from a blocking POSIX client in its own thread, so the loop
// under test never waits on the attacker.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "common.hpp"
#include "wire.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
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

void append(std::vector<std::byte>& v, const header& h, std::size_t payload = 0, std::byte fill = std::byte{0}) {
  std::array<std::byte, header_size> b{};
  encode_header(h, b);
  v.insert(v.end(), b.begin(), b.end());
  v.insert(v.end(), payload, fill);
}

std::vector<std::byte> hello_bytes() {
  std::array<std::byte, hello_size> b{};
  hello h;
  h.receive_buffers = 4;
  h.receive_buffer_size = 1024;
  encode_hello(h, b);
  return {b.begin(), b.end()};
}

// A blocking client socket in a thread of its own. The destructor shuts the
// socket down (a send or recv blocked in the thread returns) and joins.
class raw_thread {
 public:
  raw_thread(std::uint16_t port, int rcvbuf, std::function<void(int)> body) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd_ >= 0);
    if (rcvbuf > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    int big = 8 << 20;
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    thread_ = std::thread([this, body = std::move(body)] { body(fd_); });
  }
  ~raw_thread() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }

 private:
  int fd_ = -1;
  std::thread thread_;
};

// Writes all of `v` from `*at` on; false once the socket fails. In
// non-blocking mode it stops early, at EAGAIN.
bool send_from(int fd, const std::vector<std::byte>& v, std::size_t* at) {
  while (*at < v.size()) {
    ssize_t n = ::send(fd, v.data() + *at, v.size() - *at, MSG_NOSIGNAL);
    if (n > 0) {
      *at += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
  return true;
}

void drain_until_closed(int fd) {
  std::array<char, 4096> sink{};
  while (::recv(fd, sink.data(), sink.size(), 0) > 0) {
  }
}

// Waits (on the loop) until `flag` is set by another thread; false after 60 s.
task<bool> wait_flag(const std::atomic<bool>& flag) {
  auto deadline = clock::now() + 60s;
  while (!flag.load()) {
    if (clock::now() > deadline) co_return false;
    (void)co_await sleep_for(1ms);
  }
  co_return true;
}

struct good_pair {
  domain client_domain = domain::open(tcp_options()).value();
  connection server, client;
};

task<void> connect_good(listener& l, good_pair& g) {
  auto ep = endpoint::loopback(l.local_endpoint()->port());
  auto [s, c] = co_await when_all(accept_within_limit(l), g.client_domain.connect(ep));
  g.server = std::move(s).value();
  g.client = std::move(c).value();
}

// One round trip on the good pair: a send and its receipt.
task<bool> good_round(good_pair& g, unsigned i) {
  auto msg = pattern(32, i);
  auto [s, m] = co_await when_all(with_timeout(g.client.send(msg), 30s), with_timeout(g.server.recv(), 30s));
  co_return s.has_value() && m.has_value() && same(m->data(), msg);
}

}  // namespace

TEST_CASE("raw peer: a SEND split across two writes while a message is released; held messages stay intact") {
  // The first write carries SEND 1 whole and SEND 2's header with half its
  // payload: the reader hands message 1 over and waits for the rest of
  // payload 2. The application releases message 1 meanwhile, then the rest
  // of payload 2 and SEND 3 arrive. Message 2 is held while message 3 is
  // received: it must still hold payload 2.
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    auto l = d.listen(endpoint::loopback(0)).value();
    auto ep = endpoint::loopback(l.local_endpoint()->port());
    const auto p1 = pattern(100, 1), p2 = pattern(100, 2), p3 = pattern(100, 3);
    event released;
    auto raw = [&]() -> task<void> {
      auto s = (co_await tcp_socket::connect(ep)).value();
      auto hb = hello_bytes();
      (void)co_await s.write_all(hb);
      std::array<std::byte, hello_size> theirs{};
      (void)co_await s.read_exact(theirs);
      std::vector<std::byte> first, second;
      header h;
      h.op = opcode::send;
      h.length = 100;
      h.seq = 1;
      append(first, h);
      first.insert(first.end(), p1.begin(), p1.end());
      h.seq = 2;
      append(first, h);
      first.insert(first.end(), p2.begin(), p2.begin() + 50);
      (void)co_await s.write_all(first);
      (void)co_await with_timeout(released.wait(), 30s);
      second.insert(second.end(), p2.begin() + 50, p2.end());
      h.seq = 3;
      append(second, h);
      second.insert(second.end(), p3.begin(), p3.end());
      (void)co_await s.write_all(second);
      (void)s.shutdown(SHUT_WR);
      std::array<std::byte, 256> sink{};
      for (;;) {
        auto n = co_await with_timeout(s.read_some(sink), 30s);
        if (!n || *n == 0) break;
      }
    };
    auto server = [&]() -> task<void> {
      auto c = (co_await accept_within_limit(l)).value();
      {
        auto m1 = co_await with_timeout(c.recv(), 30s);
        REQUIRE(m1.has_value());
        CHECK(same(m1->data(), p1));
      }  // message 1 released while payload 2 is half read
      released.set();
      auto m2 = co_await with_timeout(c.recv(), 30s);
      REQUIRE(m2.has_value());
      auto m3 = co_await with_timeout(c.recv(), 30s);
      REQUIRE(m3.has_value());
      CHECK(same(m3->data(), p3));
      CHECK(same(m2->data(), p2));  // not overwritten by message 3
      CHECK(m2->data().data() != m3->data().data());
      m2->reset();
      m3->reset();
      (void)co_await c.close();
    };
    co_await when_all(raw(), server());
    l.close();
  }());
}

TEST_CASE("raw peer: a flood of valid no-op frames does not starve another connection") {
  // 200,000 ACK frames (valid no-ops: nothing pending) with a 1-byte SEND
  // marker every 5,000, most of them already queued in the sockets when the
  // connection is accepted. While each 5,000 are handled, the good pair on
  // the same loop must complete a round trip. At -O0 the stack must not
  // grow with the frames (the old reader died after about 6,000).
  static constexpr int markers = 41, acks_between = 5000;
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    auto l = d.listen(endpoint::loopback(0)).value();
    good_pair g;
    co_await connect_good(l, g);

    std::vector<std::byte> stream = hello_bytes();
    stream.reserve(stream.size() + std::size_t(markers) * (header_size + 1) +
                   std::size_t(markers - 1) * acks_between * header_size);
    header ack;
    ack.op = opcode::ack;  // seq 0: acknowledges nothing, valid at any time
    for (int i = 0; i < markers; ++i) {
      header m;
      m.op = opcode::send;
      m.seq = static_cast<std::uint64_t>(i) + 1;
      m.length = 1;
      append(stream, m, 1, static_cast<std::byte>(i));
      if (i + 1 < markers)
        for (int k = 0; k < acks_between; ++k) append(stream, ack);
    }
    std::atomic<bool> prefilled{false};
    raw_thread flood(l.local_endpoint()->port(), 0, [&](int fd) {
      // As much as the socket buffers take before the provider reads a byte.
      std::size_t at = 0;
      int fl = ::fcntl(fd, F_GETFL);
      ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
      bool ok = send_from(fd, stream, &at);
      ::fcntl(fd, F_SETFL, fl);
      prefilled = true;
      if (ok && send_from(fd, stream, &at)) drain_until_closed(fd);
    });
    REQUIRE(co_await wait_flag(prefilled));
    auto fc = (co_await accept_within_limit(l)).value();

    std::vector<unsigned> rounds_at(markers);
    unsigned rounds = 0;
    bool flood_done = false, good_ok = true;
    auto pinger = [&]() -> task<void> {
      while (!flood_done && good_ok) {
        good_ok = co_await good_round(g, rounds);
        ++rounds;
      }
    };
    auto flood_app = [&]() -> task<void> {
      for (int i = 0; i < markers; ++i) {
        auto m = co_await with_timeout(fc.recv(), 60s);
        if (!m) {
          FAIL_CHECK("marker " << i << ": " << m.error().message());
          break;
        }
        CHECK(m->data().size() == 1);
        CHECK(m->data()[0] == static_cast<std::byte>(i));
        rounds_at[i] = rounds;
      }
      flood_done = true;
    };
    co_await when_all(pinger(), flood_app());
    CHECK(good_ok);
    int starved = 0;  // stretches of 5,000 frames during which the good pair did nothing
    for (int i = 1; i < markers; ++i) starved += rounds_at[i] == rounds_at[i - 1];
    CHECK(starved == 0);
    INFO("good round trips during the flood: " << rounds_at[markers - 1] - rounds_at[0]);
    CHECK(fc.is_open());
    (void)co_await fc.close();
    (void)co_await g.client.close();
    (void)co_await g.server.close();
    l.close();
  }());
}

TEST_CASE("raw peer: READ and atomic requests whose responses are never read stay bounded") {
  // The peer sends READs of 1 MiB and fetch-and-adds, and never reads. The
  // target answers at most its responder units at once, then stops reading
  // that peer: the requests it executed (the fetch-and-adds counted in its
  // memory) stay bounded while the peer has sent far more, and another
  // connection on the same loop keeps working.
  static constexpr std::size_t pairs = 150000, read_len = 1 << 20;
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    std::vector<std::uint64_t> mem(read_len / 8, 0);
    auto mr = d.register_memory(std::as_writable_bytes(std::span(mem)), access::all).value();
    auto l = d.listen(endpoint::loopback(0)).value();
    good_pair g;
    co_await connect_good(l, g);

    std::vector<std::byte> stream = hello_bytes();
    stream.reserve(stream.size() + pairs * 2 * header_size);
    for (std::size_t i = 0; i < pairs; ++i) {
      header r;
      r.op = opcode::read_req;
      r.seq = 2 * i + 1;
      r.addr = mr.remote().address;
      r.rkey = mr.rkey();
      r.length = static_cast<std::uint32_t>(read_len);
      append(stream, r);
      header f;
      f.op = opcode::faa;
      f.seq = 2 * i + 2;
      f.addr = mr.remote().address;
      f.rkey = mr.rkey();
      f.length = 8;
      f.arg0 = 1;
      append(stream, f);
    }
    std::atomic<bool> sent_all{false};
    // A small receive buffer: the responses stop flowing almost at once.
    std::optional<raw_thread> flood;
    flood.emplace(l.local_endpoint()->port(), 4096, [&](int fd) {
      std::size_t at = 0;
      if (send_from(fd, stream, &at)) sent_all = true;  // never reads
    });
    auto fc = (co_await accept_within_limit(l)).value();
    std::atomic_ref<std::uint64_t> executed(mem[0]);
    // The flood is under way (half the responder units are fetch-and-adds:
    // the target runs at least that many before it may stop reading)...
    auto deadline = clock::now() + 60s;
    while (executed.load() < default_responder_ops / 2 && clock::now() < deadline) (void)co_await sleep_for(1ms);
    REQUIRE(executed.load() >= default_responder_ops / 2);
    // ...while the good pair does its round trips...
    for (unsigned i = 0; i < 300; ++i) REQUIRE(co_await good_round(g, i));
    // ...and what the target took on stays bounded: at most its responder
    // units queued, one writer batch (256 frames) and what the socket
    // buffers hold (a few MiB: a few READ responses).
    const std::uint64_t done = executed.load();
    INFO("fetch-and-adds executed: " << done << " of " << pairs);
    CHECK(done <= 2048);
    CHECK_FALSE(sent_all.load());
    CHECK(g.client.is_open());
    (void)co_await fc.close();
    flood.reset();  // the peer's thread is unblocked and joined
    (void)co_await g.client.close();
    (void)co_await g.server.close();
    l.close();
  }());
}

TEST_CASE("raw peer: a hello announcing a payload over the bound, or cut short, is refused with a reason") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    std::vector<std::string> refused;
    listener_options limits;
    limits.on_refused = [&](const endpoint&, std::string_view why) { refused.emplace_back(why); };
    auto l = d.listen(endpoint::loopback(0), {}, limits).value();
    auto ep = endpoint::loopback(l.local_endpoint()->port());
    // announced -> sent: over the bound; then fewer bytes than announced, and the peer closes.
    const std::pair<std::uint16_t, std::size_t> cases[] = {{max_connect_payload + 1, max_connect_payload + 1},
                                                            {0xffff, 16},
                                                            {10, 4}};
    for (auto [announced, sent] : cases) {
      auto s = (co_await tcp_socket::connect(ep)).value();
      std::array<std::byte, hello_size> hb{};
      hello h;
      h.receive_buffers = 4;
      h.receive_buffer_size = 1024;
      h.payload_size = announced;
      encode_hello(h, hb);
      std::vector<std::byte> bytes(hb.begin(), hb.end());
      bytes.resize(bytes.size() + sent, std::byte{0x5a});
      (void)co_await s.write_all(bytes);
      (void)s.shutdown(SHUT_WR);
      // The listener runs the handshake while an accept() waits; a good
      // client then gets in, and the raw peer's socket was closed.
      good_pair g;
      co_await connect_good(l, g);
      CHECK(co_await good_round(g, announced));
      std::array<std::byte, 64> sink{};
      std::size_t total = 0;
      for (;;) {
        auto n = co_await with_timeout(s.read_some(sink), 30s);
        REQUIRE((n || n.error() != errc::operation_timeout));  // closed (a reset: our bytes were left unread)
        if (!n || *n == 0) break;
        total += *n;
      }
      CHECK(total <= hello_size);  // at most the server's hello (it sends no payload), then the end
      (void)co_await g.client.close();
      (void)co_await g.server.close();
    }
    REQUIRE(refused.size() == 3);
    CHECK(refused[0] == "handshake failed: " + make_error_code(errc::message_too_long).message());
    CHECK(refused[1] == refused[0]);
    CHECK(refused[2] == "handshake failed: " + make_error_code(errc::eof).message());

    // A raw server answering a connect with a payload over the bound: the connect fails, message_too_long.
    auto raw_l = tcp_listener::bind(endpoint::loopback(0)).value();
    auto raw_server = [&]() -> task<void> {
      auto s = (co_await raw_l.accept()).value();
      std::array<std::byte, hello_size> hb{};
      hello h;
      h.receive_buffers = 4;
      h.receive_buffer_size = 1024;
      h.payload_size = max_connect_payload + 1;
      encode_hello(h, hb);
      (void)co_await s.write_all(hb);
      std::array<std::byte, 64> sink{};
      while (true) {
        auto n = co_await with_timeout(s.read_some(sink), 30s);
        if (!n || *n == 0) break;
      }
    };
    auto client = [&]() -> task<void> {
      auto c = co_await d.connect(endpoint::loopback(raw_l.local_endpoint()->port()));
      REQUIRE_FALSE(c.has_value());
      CHECK(c.error() == make_error_code(errc::message_too_long));
    };
    co_await when_all(raw_server(), client());
    l.close();
  }());
}

// ------------------------------------------------------------- WRITE_LIST

namespace {

// The target's memory: 3 KiB of 0x77; [1024, 2048) registered with every
// right, [2560, 2624) with remote read only.
struct list_target {
  std::vector<std::byte> mem = std::vector<std::byte>(3 * 1024, std::byte{0x77});
  std::span<std::byte> rw() { return std::span(mem).subspan(1024, 1024); }
  std::span<std::byte> ro() { return std::span(mem).subspan(2560, 64); }
  // Bytes of [from, to) of rw() all `v`.
  bool rw_is(std::size_t from, std::size_t to, std::byte v) {
    auto s = rw().subspan(from, to - from);
    return std::all_of(s.begin(), s.end(), [v](std::byte b) { return b == v; });
  }
  bool untouched_outside_rw() {
    auto same77 = [](std::span<const std::byte> s) {
      return std::all_of(s.begin(), s.end(), [](std::byte b) { return b == std::byte{0x77}; });
    };
    return same77(std::span(mem).first(1024)) && same77(std::span(mem).subspan(2048));
  }
};

// A WRITE_LIST of `es` (seq `seq` on): header, table, then descriptor i's
// payload filled with 0x10 + i. `length` and `count` override the header's.
std::vector<std::byte> list_frame(std::uint64_t seq, std::uint32_t rkey, const std::vector<list_entry>& es,
                                  std::optional<std::uint32_t> length = {}, std::optional<std::uint64_t> count = {}) {
  header h;
  h.op = opcode::write_list;
  h.seq = seq;
  h.rkey = rkey;
  h.arg0 = count.value_or(es.size());
  std::uint64_t sum = 0;
  for (const auto& e : es) sum += e.length;
  h.length = length.value_or(static_cast<std::uint32_t>(sum));
  std::vector<std::byte> v;
  append(v, h);
  for (const auto& e : es) {
    std::array<std::byte, list_entry_size> b{};
    encode_list_entry(e, b);
    v.insert(v.end(), b.begin(), b.end());
  }
  // At most 64 KiB of each (the lying cases claim GiBs, and are refused at the table).
  for (std::size_t i = 0; i < es.size(); ++i)
    v.insert(v.end(), std::min<std::size_t>(es[i].length, 65536), static_cast<std::byte>(0x10 + i));
  return v;
}

struct list_outcome {
  std::vector<header> got;       // the target's frames after its hello, until it closed
  std::vector<std::vector<std::byte>> payloads;  // each one's payload
  std::error_code app_error;     // what the accepted connection's recv failed with
};

// A raw peer completes the hello, sends `parts` with a pause between each
// (a frame split across writes), half-closes, and reads the target's frames
// until it closes.
using list_maker = std::function<std::vector<std::vector<std::byte>>(remote_buffer rw, remote_buffer ro)>;
task<list_outcome> run_list(list_target& t, list_maker make, std::uint64_t await_ack = 0) {
  auto d = domain::open(tcp_options()).value();
  auto rw = d.register_memory(t.rw(), access::all).value();
  auto ro = d.register_memory(t.ro(), access::local_write | access::remote_read).value();
  auto l = d.listen(endpoint::loopback(0)).value();
  auto ep = endpoint::loopback(l.local_endpoint()->port());
  auto parts = make(rw.remote(), ro.remote());
  list_outcome out;
  auto raw = [&]() -> task<void> {
    auto s = (co_await tcp_socket::connect(ep)).value();
    (void)co_await s.write_all(hello_bytes());
    std::array<std::byte, hello_size> theirs{};
    REQUIRE((co_await with_timeout(s.read_exact(theirs), 30s)).has_value());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (i) (void)co_await sleep_for(10ms);
      (void)co_await s.write_all(parts[i]);
    }
    // Half-closed at once, or once the ACK of `await_ack` came (the
    // target's end of stream would otherwise race its ACK).
    bool shut = false;
    if (await_ack == 0) shut = s.shutdown(SHUT_WR).has_value();
    for (;;) {
      std::array<std::byte, header_size> hb{};
      auto r = co_await with_timeout(s.read_exact(hb), 30s);
      if (!r) break;
      auto h = decode_header(hb, limits{});
      REQUIRE(h.has_value());
      out.got.push_back(*h);
      std::vector<std::byte> payload(h->payload_length());
      if (!payload.empty() && !co_await with_timeout(s.read_exact(payload), 30s)) break;
      out.payloads.push_back(std::move(payload));
      if (!shut && h->op == opcode::ack && h->seq >= await_ack) shut = s.shutdown(SHUT_WR).has_value();
    }
  };
  auto server = [&]() -> task<void> {
    auto c = (co_await accept_within_limit(l)).value();
    auto m = co_await with_timeout(c.recv(), 30s);
    REQUIRE_FALSE(m.has_value());  // the raw peer sends no message
    out.app_error = m.error();
    (void)co_await c.close();
  };
  co_await when_all(raw(), server());
  l.close();
  co_return out;
}

bool all_equal_to(std::span<const std::byte> s, std::byte v) {
  return std::all_of(s.begin(), s.end(), [v](std::byte b) { return b == v; });
}

// The NAKs among `got`.
std::vector<header> naks(const list_outcome& o) {
  std::vector<header> v;
  for (const auto& h : o.got)
    if (h.op == opcode::nak) v.push_back(h);
  return v;
}
std::uint64_t last_ack(const list_outcome& o) {
  std::uint64_t a = 0;
  for (const auto& h : o.got)
    if (h.op == opcode::ack) a = std::max(a, h.seq);
  return a;
}

}  // namespace

TEST_CASE("raw peer: a WRITE_LIST split across writes lands whole, every descriptor acknowledged") {
  io_context ctx;
  list_target t;
  list_outcome o;
  ctx.run([&]() -> task<void> {
    o = co_await run_list(t, [](remote_buffer rw, remote_buffer) {
      auto f = list_frame(1, rw.rkey, {{rw.address, 100}, {rw.address + 500, 200}, {rw.address + 1000, 24}});
      auto g = list_frame(4, rw.rkey, {{rw.address + 200, 10}, {rw.address + 300, 10}});
      // Cut inside the header, inside the table, inside the second payload.
      const std::size_t cuts[] = {20, header_size + 18, header_size + 3 * list_entry_size + 150, f.size()};
      std::vector<std::vector<std::byte>> parts;
      std::size_t at = 0;
      for (std::size_t c : cuts) {
        parts.emplace_back(f.begin() + static_cast<std::ptrdiff_t>(at), f.begin() + static_cast<std::ptrdiff_t>(c));
        at = c;
      }
      parts.push_back(g);
      return parts;
    }, 5);
  }());
  CHECK(naks(o).empty());
  CHECK(last_ack(o) == 5);
  CHECK(o.app_error != make_error_code(errc::protocol_error));
  CHECK(t.rw_is(0, 100, std::byte{0x10}));
  CHECK(t.rw_is(100, 200, std::byte{0x77}));
  CHECK(t.rw_is(200, 210, std::byte{0x10}));
  CHECK(t.rw_is(300, 310, std::byte{0x11}));
  CHECK(t.rw_is(500, 700, std::byte{0x11}));
  CHECK(t.rw_is(700, 1000, std::byte{0x77}));
  CHECK(t.rw_is(1000, 1024, std::byte{0x12}));
  CHECK(t.untouched_outside_rw());
}

TEST_CASE("raw peer: a WRITE_LIST descriptor the region refuses is NAKed with its seq; earlier ones done, none after") {
  struct refusal {
    const char* what;
    std::function<std::vector<list_entry>(remote_buffer rw, remote_buffer ro)> entries;
    bool use_ro_key = false, forge_key = false;
    std::size_t refused;  // the index of the refused descriptor
  };
  const refusal cases[] = {
      {"past the region's end",
       [](remote_buffer rw, remote_buffer) {
         return std::vector<list_entry>{
             {rw.address, 16}, {rw.address + 100, 16}, {rw.address + 1020, 8}, {rw.address + 200, 16}};
       },
       false, false, 2},
      {"before the region",
       [](remote_buffer rw, remote_buffer) {
         return std::vector<list_entry>{{rw.address, 16}, {rw.address - 8, 16}};
       },
       false, false, 1},
      {"an address that wraps",
       [](remote_buffer rw, remote_buffer) {
         return std::vector<list_entry>{{rw.address, 16}, {rw.address + 100, 16}, {~std::uint64_t(0) - 7, 16}};
       },
       false, false, 2},
      {"a forged key",
       [](remote_buffer rw, remote_buffer) {
         return std::vector<list_entry>{{rw.address, 16}, {rw.address + 100, 16}};
       },
       false, true, 0},
      {"a region without remote write",
       [](remote_buffer, remote_buffer ro) {
         return std::vector<list_entry>{{ro.address, 16}};
       },
       true, false, 0},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    io_context ctx;
    list_target t;
    list_outcome o;
    ctx.run([&]() -> task<void> {
      o = co_await run_list(t, [&](remote_buffer rw, remote_buffer ro) {
        std::uint32_t key = c.use_ro_key ? ro.rkey : rw.rkey;
        if (c.forge_key) key ^= 0x5555;
        return std::vector<std::vector<std::byte>>{list_frame(7, key, c.entries(rw, ro))};
      });
    }());
    auto n = naks(o);
    REQUIRE(n.size() == 1);
    CHECK(n[0].seq == 7 + c.refused);
    CHECK(n[0].st == status::remote_access_error);
    CHECK(o.app_error == make_error_code(errc::peer_access_refused));
    // The descriptors before the refused one (16 bytes at 0 and at 100) are done.
    CHECK(t.rw_is(0, 16, c.refused > 0 ? std::byte{0x10} : std::byte{0x77}));
    CHECK(t.rw_is(100, 116, c.refused > 1 ? std::byte{0x11} : std::byte{0x77}));
    CHECK(t.rw_is(16, 100, std::byte{0x77}));
    CHECK(t.rw_is(116, 1024, std::byte{0x77}));
    CHECK(t.untouched_outside_rw());
  }
}

TEST_CASE("raw peer: a WRITE_LIST whose framing lies is a protocol error, nothing written") {
  struct lie {
    const char* what;
    std::function<std::vector<std::byte>(remote_buffer rw)> frame;
  };
  const lie cases[] = {
      {"lengths that do not add up to the frame's",
       [](remote_buffer rw) { return list_frame(1, rw.rkey, {{rw.address, 10}, {rw.address + 20, 10}}, 30); }},
      {"a count over the descriptors sent (payload read as table)",
       [](remote_buffer rw) { return list_frame(1, rw.rkey, {{rw.address, 16}, {rw.address + 20, 16}}, 32, 4); }},
      {"an empty descriptor",
       [](remote_buffer rw) { return list_frame(1, rw.rkey, {{rw.address, 10}, {rw.address + 20, 0}, {rw.address + 40, 10}}); }},
      {"lengths whose 32-bit sum wraps to the frame's",
       [](remote_buffer rw) {
         return list_frame(1, rw.rkey, {{rw.address, 0x80000000u}, {rw.address, 0x80000000u}, {rw.address, 3}}, 3);
       }},
      {"a descriptor over max_rdma_length",
       [](remote_buffer rw) { return list_frame(1, rw.rkey, {{rw.address, 0xFFFFFFFFu}, {rw.address, 3}}, 2); }},
      {"no descriptor",
       [](remote_buffer rw) { return list_frame(1, rw.rkey, {{rw.address, 8}}, 8, 0); }},
      {"more descriptors than a frame may carry",
       [](remote_buffer rw) { return list_frame(1, rw.rkey, {{rw.address, 8}}, 300, max_list_entries + 1); }},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    io_context ctx;
    list_target t;
    list_outcome o;
    ctx.run([&]() -> task<void> {
      o = co_await run_list(t, [&](remote_buffer rw, remote_buffer) {
        return std::vector<std::vector<std::byte>>{c.frame(rw)};
      });
    }());
    CHECK(naks(o).empty());
    CHECK(last_ack(o) == 0);
    CHECK(o.app_error == make_error_code(errc::protocol_error));
    CHECK(t.rw_is(0, 1024, std::byte{0x77}));
    CHECK(t.untouched_outside_rw());
  }
}

TEST_CASE("raw peer: a WRITE_LIST cut short by EOF mid-payload fails the connection; nothing outside its descriptors") {
  io_context ctx;
  list_target t;
  list_outcome o;
  ctx.run([&]() -> task<void> {
    o = co_await run_list(t, [](remote_buffer rw, remote_buffer) {
      auto f = list_frame(1, rw.rkey, {{rw.address, 100}, {rw.address + 500, 200}});
      f.resize(header_size + 2 * list_entry_size + 150);
      return std::vector<std::vector<std::byte>>{f};
    });
  }());
  CHECK(naks(o).empty());
  CHECK(last_ack(o) == 0);  // neither descriptor is acknowledged
  CHECK(o.app_error != make_error_code(errc::protocol_error));
  CHECK(t.rw_is(0, 100, std::byte{0x10}));
  CHECK(t.rw_is(100, 500, std::byte{0x77}));
  CHECK(t.rw_is(550, 1024, std::byte{0x77}));
  CHECK(t.untouched_outside_rw());
}

TEST_CASE("raw peer: a READ_LIST is answered for the descriptors before a refused one, which is NAKed") {
  io_context ctx;
  list_target t;
  list_outcome o;
  ctx.run([&]() -> task<void> {
    o = co_await run_list(t, [](remote_buffer rw, remote_buffer) {
      header r;
      r.op = opcode::read_list;
      r.seq = 2;
      r.rkey = rw.rkey;
      const std::vector<list_entry> es{{rw.address, 16}, {rw.address + 40, 4}, {rw.address + 1020, 8}, {rw.address, 4}};
      r.arg0 = es.size();
      r.length = 32;
      std::vector<std::byte> f;
      append(f, r);
      for (const auto& e : es) {
        std::array<std::byte, list_entry_size> b{};
        encode_list_entry(e, b);
        f.insert(f.end(), b.begin(), b.end());
      }
      // A WRITE_LIST first puts 0x10 at [0, 16) and 0x11 at [40, 44).
      return std::vector<std::vector<std::byte>>{list_frame(1, rw.rkey, {{rw.address, 16}, {rw.address + 40, 4}}), f};
    });
  }());
  std::size_t resp = o.got.size();
  for (std::size_t i = 0; i < o.got.size(); ++i)
    if (o.got[i].op == opcode::read_list_resp) resp = i;
  REQUIRE(resp < o.got.size());
  CHECK(o.got[resp].seq == 2);
  CHECK(o.got[resp].arg0 == 2);
  CHECK(o.got[resp].length == 20);
  std::vector<std::byte> want(16, std::byte{0x10});
  want.insert(want.end(), 4, std::byte{0x11});
  CHECK(o.payloads[resp] == want);
  auto n = naks(o);
  REQUIRE(n.size() == 1);
  CHECK(n[0].seq == 4);  // descriptor 2
  CHECK(o.app_error == make_error_code(errc::peer_access_refused));
  CHECK(t.untouched_outside_rw());
}

TEST_CASE("raw server: a READ_LIST_RESP that does not match the READs pending is a protocol error") {
  // The raw server announces list frames, answers one single READ (so the
  // client has read the announcement), then answers the client's READ_LIST
  // with a lie: one byte more, one read more, or the wrong seq.
  struct lie {
    const char* what;
    std::uint64_t seq_delta, count_delta;
    std::uint32_t length_delta;
  };
  const lie cases[] = {{"one byte more", 0, 0, 1}, {"one read more", 0, 1, 0}, {"a later seq", 1, 0, 0}};
  for (const auto& c : cases) {
    INFO(c.what);
    io_context ctx;
    ctx.run([&c]() -> task<void> {
      auto d = domain::open(tcp_options()).value();
      auto raw_l = tcp_listener::bind(endpoint::loopback(0)).value();
      auto raw_server = [&]() -> task<void> {
        auto s = (co_await raw_l.accept()).value();
        std::vector<std::byte> out = hello_bytes();
        header announce;
        announce.op = opcode::ack;
        append(out, announce);
        (void)co_await s.write_all(out);
        std::array<std::byte, hello_size> theirs{};
        if (!co_await with_timeout(s.read_exact(theirs), 30s)) co_return;
        for (;;) {
          std::array<std::byte, header_size> hb{};
          if (!co_await with_timeout(s.read_exact(hb), 30s)) co_return;
          auto h = decode_header(hb, limits{});
          if (!h) co_return;
          std::vector<std::byte> body(h->payload_length());
          if (!body.empty() && !co_await with_timeout(s.read_exact(body), 30s)) co_return;
          std::vector<std::byte> reply;
          if (h->op == opcode::read_req) {
            header r;
            r.op = opcode::read_resp;
            r.seq = h->seq;
            r.length = h->length;
            append(reply, r, h->length, std::byte{0x42});
          } else if (h->op == opcode::read_list) {
            header r;
            r.op = opcode::read_list_resp;
            r.seq = h->seq + c.seq_delta;
            r.arg0 = h->arg0 + c.count_delta;
            r.length = h->length + c.length_delta;
            append(reply, r, r.length, std::byte{0x43});
          } else {
            continue;
          }
          if (!co_await s.write_all(reply)) co_return;
        }
      };
      auto client = [&]() -> task<void> {
        auto conn = co_await d.connect(endpoint::loopback(raw_l.local_endpoint()->port()));
        REQUIRE(conn.has_value());
        std::vector<std::byte> local(4096, std::byte{0x5A});
        auto one = co_await conn->read(std::span(local).first(8), remote_buffer{0x1000, 7, 1 << 20});
        REQUIRE(one.has_value());
        CHECK(all_equal_to(std::span(local).first(8), std::byte{0x42}));
        std::vector<block> blocks;
        for (std::uint64_t i = 0; i < 4; ++i) blocks.push_back({1024 + i * 512, i * 512, 100});
        auto r = co_await conn->read_blocks(local, remote_buffer{0x1000, 7, 1 << 20}, blocks);
        REQUIRE_FALSE(r.has_value());
        CHECK(r.error() == make_error_code(errc::protocol_error));
        CHECK(all_equal_to(std::span(local).subspan(8), std::byte{0x5A}));  // no byte of the lie placed
        CHECK_FALSE(conn->is_open());
      };
      co_await when_all(raw_server(), client());
    }());
  }
}

TEST_CASE("raw peer: a flood of WRITE_LIST frames does not starve another connection") {
  // As the no-op flood above, with valid WRITE_LIST frames (64 descriptors
  // of 32 bytes each) between the markers: the reader takes a bounded share
  // of each loop turn however many descriptors a frame carries, and holds
  // one table at a time.
  static constexpr int markers = 21, lists_between = 600;
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    std::vector<std::byte> mem(4096, std::byte{0});
    auto mr = d.register_memory(mem, access::all).value();
    auto l = d.listen(endpoint::loopback(0)).value();
    good_pair g;
    co_await connect_good(l, g);

    std::vector<list_entry> es;
    for (std::uint64_t i = 0; i < 64; ++i) es.push_back({mr.remote().address + i * 64, 32});
    std::vector<std::byte> stream = hello_bytes();
    std::uint64_t seq = 1;
    for (int i = 0; i < markers; ++i) {
      header m;
      m.op = opcode::send;
      m.seq = seq++;
      m.length = 1;
      append(stream, m, 1, static_cast<std::byte>(i));
      if (i + 1 < markers)
        for (int k = 0; k < lists_between; ++k) {
          auto f = list_frame(seq, mr.rkey(), es);
          seq += es.size();
          stream.insert(stream.end(), f.begin(), f.end());
        }
    }
    std::atomic<bool> prefilled{false};
    raw_thread flood(l.local_endpoint()->port(), 0, [&](int fd) {
      std::size_t at = 0;
      int fl = ::fcntl(fd, F_GETFL);
      ::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
      bool ok = send_from(fd, stream, &at);
      ::fcntl(fd, F_SETFL, fl);
      prefilled = true;
      if (ok && send_from(fd, stream, &at)) drain_until_closed(fd);
    });
    REQUIRE(co_await wait_flag(prefilled));
    auto fc = (co_await accept_within_limit(l)).value();

    std::vector<unsigned> rounds_at(markers);
    unsigned rounds = 0;
    bool flood_done = false, good_ok = true;
    auto pinger = [&]() -> task<void> {
      while (!flood_done && good_ok) {
        good_ok = co_await good_round(g, rounds);
        ++rounds;
      }
    };
    auto flood_app = [&]() -> task<void> {
      for (int i = 0; i < markers; ++i) {
        auto m = co_await with_timeout(fc.recv(), 60s);
        if (!m) {
          FAIL_CHECK("marker " << i << ": " << m.error().message());
          break;
        }
        CHECK(m->data().size() == 1);
        CHECK(m->data()[0] == static_cast<std::byte>(i));
        rounds_at[i] = rounds;
      }
      flood_done = true;
    };
    co_await when_all(pinger(), flood_app());
    CHECK(good_ok);
    int starved = 0;
    for (int i = 1; i < markers; ++i) starved += rounds_at[i] == rounds_at[i - 1];
    CHECK(starved == 0);
    INFO("good round trips during the flood: " << rounds_at[markers - 1] - rounds_at[0]);
    CHECK(fc.is_open());
    // Every descriptor's payload landed: 32 bytes of 0x10 + i at i * 64, nothing between.
    std::size_t bad = 0;
    for (std::size_t i = 0; i < 64; ++i) {
      bad += !std::all_of(mem.begin() + i * 64, mem.begin() + i * 64 + 32,
                          [i](std::byte b) { return b == static_cast<std::byte>(0x10 + i); });
      bad += !std::all_of(mem.begin() + i * 64 + 32, mem.begin() + i * 64 + 64, [](std::byte b) { return b == std::byte{0}; });
    }
    CHECK(bad == 0);
    (void)co_await fc.close();
    (void)co_await g.client.close();
    (void)co_await g.server.close();
    l.close();
  }());
}
