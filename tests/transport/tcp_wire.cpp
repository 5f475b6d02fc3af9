// tcp provider specifics: the frame decoder (pure), the fuzz entry point on
// random and mutated inputs (so gcc builds exercise it too), and corrupt,
// truncated and oversize frames sent by a raw TCP peer.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "common.hpp"
#include "wire.hpp"

#include <random>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

using namespace shuttle;
using namespace shuttle::tcp_wire;
using namespace transport_test;
using namespace std::chrono_literals;

namespace {
std::array<std::byte, header_size> enc(const header& h) {
  std::array<std::byte, header_size> b{};
  encode_header(h, b);
  return b;
}
domain_options tcp_options() {
  domain_options o;
  o.kind = transport_kind::tcp;
  return o;
}
bool proto(const std::error_code& ec) { return matches(ec, errc::protocol_error); }  // its refinements too
}  // namespace

TEST_CASE("wire: hello round trip and refusal") {
  std::array<std::byte, hello_size> b{};
  hello h;
  h.receive_buffers = 64;
  h.receive_buffer_size = 65536;
  encode_hello(h, b);
  auto d = decode_hello(b);
  REQUIRE(d.has_value());
  CHECK(d->receive_buffers == 64);
  CHECK(d->receive_buffer_size == 65536);
  auto bad = b;
  bad[0] = std::byte{'X'};
  CHECK(proto(decode_hello(bad).error()));
  CHECK(d->max_responder_ops == default_responder_ops);
  bad = b;
  bad[4] = std::byte{1};  // version 1: no responder limit
  CHECK(proto(decode_hello(bad).error()));
  bad = b;
  bad[4] = std::byte{3};
  CHECK(proto(decode_hello(bad).error()));
  for (std::uint32_t ops : {0u, max_responder_ops_limit + 1}) {
    hello z = h;
    z.max_responder_ops = ops;
    encode_hello(z, bad);
    CHECK(proto(decode_hello(bad).error()));
  }
  // The connect payload's length, in what was a reserved zero field: up to the bound.
  for (std::uint16_t n : {std::uint16_t(1), static_cast<std::uint16_t>(max_connect_payload)}) {
    hello z = h;
    z.payload_size = n;
    encode_hello(z, bad);
    auto dz = decode_hello(bad);
    REQUIRE(dz.has_value());
    CHECK(dz->payload_size == n);
  }
  CHECK(d->payload_size == 0);
  for (std::uint16_t n : {static_cast<std::uint16_t>(max_connect_payload + 1), std::uint16_t(0xffff)}) {
    hello z = h;
    z.payload_size = n;
    encode_hello(z, bad);
    CHECK(decode_hello(bad).error() == make_error_code(errc::message_too_long));
  }
  h.receive_buffer_size = max_receive_buffer_size + 1;
  encode_hello(h, b);
  CHECK(proto(decode_hello(b).error()));
  h.receive_buffer_size = 1;
  h.receive_buffers = 0;
  encode_hello(h, b);
  CHECK(proto(decode_hello(b).error()));
}

TEST_CASE("wire: header round trip and validation") {
  limits lim;
  lim.max_send = 1000;
  header w;
  w.op = opcode::write_imm;
  w.flags = flag_imm;
  w.imm = 42;
  w.seq = 7;
  w.addr = 0x1122334455667788ull;
  w.rkey = 99;
  w.length = 12345;
  auto d = decode_header(enc(w), lim);
  REQUIRE(d.has_value());
  CHECK(d->op == opcode::write_imm);
  CHECK(d->imm == 42);
  CHECK(d->seq == 7);
  CHECK(d->addr == w.addr);
  CHECK(d->rkey == 99);
  CHECK(d->payload_length() == 12345);

  header s;
  s.op = opcode::send;
  s.length = 1000;
  CHECK(decode_header(enc(s), lim).has_value());
  s.length = 1001;  // larger than our receive buffers
  CHECK(proto(decode_header(enc(s), lim).error()));

  header r;
  r.op = opcode::read_req;
  r.length = static_cast<std::uint32_t>(max_rdma_length - 1);
  CHECK(decode_header(enc(r), lim).has_value());
  CHECK(decode_header(enc(r), lim)->payload_length() == 0);

  auto raw = enc(w);
  raw[0] = std::byte{99};  // unknown opcode
  CHECK(proto(decode_header(raw, lim).error()));
  raw = enc(w);
  raw[1] = std::byte{0x80};  // unknown flag
  CHECK(proto(decode_header(raw, lim).error()));
  raw = enc(w);
  raw[3] = std::byte{1};  // reserved
  CHECK(proto(decode_header(raw, lim).error()));
  raw = enc(w);
  raw[2] = std::byte{1};  // status on a request
  CHECK(proto(decode_header(raw, lim).error()));

  header a;
  a.op = opcode::faa;
  a.length = 4;  // atomics are 8 bytes
  CHECK(proto(decode_header(enc(a), lim).error()));
  header n;
  n.op = opcode::nak;  // a NAK needs a failure status
  CHECK(proto(decode_header(enc(n), lim).error()));
  n.st = status::remote_access_error;
  CHECK(decode_header(enc(n), lim).has_value());
  header c;
  c.op = opcode::credit;  // zero credits
  CHECK(proto(decode_header(enc(c), lim).error()));
  c.arg0 = 3;
  CHECK(decode_header(enc(c), lim).has_value());
}

TEST_CASE("wire: a SEND carries an ACK and a CREDIT only where both peers agreed") {
  limits lim;
  header s;
  s.op = opcode::send;
  s.length = 8;
  s.flags = flag_ack | flag_credit;
  s.seq = 9;
  s.arg0 = 7;  // ACK of seq 7
  s.arg1 = 2;  // 2 credits
  CHECK(proto(decode_header(enc(s), lim).error()));  // not agreed: as before, an unknown flag
  header bare = s;
  bare.flags = 0;
  CHECK(proto(decode_header(enc(bare), lim).error()));  // nor the fields without the flags
  lim.carried = true;
  auto d = decode_header(enc(s), lim);
  REQUIRE(d.has_value());
  CHECK(d->flags == (flag_ack | flag_credit));
  CHECK(d->arg0 == 7);
  CHECK(d->arg1 == 2);
  CHECK(d->payload_length() == 8);
  CHECK(proto(decode_header(enc(bare), lim).error()));  // arg0/arg1 without their flag
  header one = s;
  one.flags = flag_ack | flag_imm;
  one.imm = 5;
  one.arg1 = 0;
  CHECK(decode_header(enc(one), lim).has_value());
  one.arg0 = 0;  // an ACK of seq 0 acknowledges nothing
  CHECK(proto(decode_header(enc(one), lim).error()));
  header c = s;
  c.flags = flag_credit;
  c.arg0 = 0;
  c.arg1 = 0;  // zero credits
  CHECK(proto(decode_header(enc(c), lim).error()));
  c.arg1 = max_receive_buffers + 1;
  CHECK(proto(decode_header(enc(c), lim).error()));
  c.arg1 = max_receive_buffers;
  CHECK(decode_header(enc(c), lim).has_value());
  header w;  // only a SEND carries them
  w.op = opcode::write;
  w.flags = flag_ack;
  w.arg0 = 1;
  w.length = 8;
  CHECK(proto(decode_header(enc(w), lim).error()));
}

TEST_CASE("wire: access checks are exact and overflow-safe") {
  alignas(8) std::byte mem[64];
  region_view v{mem, 64, access::all};
  auto base = reinterpret_cast<std::uint64_t>(mem);
  CHECK(check_access(v, base, 64, access::remote_write, false).has_value());
  CHECK(check_access(v, base + 64, 0, access::remote_write, false).has_value());
  CHECK_FALSE(check_access(v, base + 1, 64, access::remote_write, false).has_value());
  CHECK_FALSE(check_access(v, base - 1, 2, access::remote_write, false).has_value());
  CHECK_FALSE(check_access(v, base + 8, ~std::uint64_t(0) - 4, access::remote_write, false).has_value());
  CHECK_FALSE(check_access(v, ~std::uint64_t(0), 2, access::remote_write, false).has_value());
  CHECK(check_access(v, base + 56, 8, access::remote_atomic, true).has_value());
  CHECK_FALSE(check_access(v, base + 60, 4, access::remote_atomic, true).has_value());
  CHECK_FALSE(check_access(v, base + 4, 8, access::remote_atomic, true).has_value());
  region_view ro{mem, 64, access::remote_read};
  CHECK_FALSE(check_access(ro, base, 8, access::remote_write, false).has_value());
  CHECK(check_access(ro, base, 8, access::remote_read, false).has_value());
  CHECK_FALSE(check_access(region_view{}, base, 8, access::remote_read, false).has_value());
}

TEST_CASE("wire: WRITE_LIST header and descriptor table are checked whole") {
  limits lim;
  header l;
  l.op = opcode::write_list;
  l.seq = 9;
  l.rkey = 5;
  l.arg0 = 3;
  l.length = 30;
  auto d = decode_header(enc(l), lim);
  REQUIRE(d.has_value());
  CHECK(d->is_request());
  CHECK(d->table_length() == 3 * list_entry_size);
  CHECK(d->payload_length() == 3 * list_entry_size + 30);
  CHECK(required_access(opcode::write_list) == access::remote_write);
  header rl = l;  // READ_LIST: the table only
  rl.op = opcode::read_list;
  REQUIRE(decode_header(enc(rl), lim).has_value());
  CHECK(decode_header(enc(rl), lim)->payload_length() == 3 * list_entry_size);
  CHECK(required_access(opcode::read_list) == access::remote_read);
  header rr;  // READ_LIST_RESP: the payloads only, no target
  rr.op = opcode::read_list_resp;
  rr.seq = 9;
  rr.arg0 = 3;
  rr.length = 30;
  REQUIRE(decode_header(enc(rr), lim).has_value());
  CHECK_FALSE(decode_header(enc(rr), lim)->is_request());
  CHECK(decode_header(enc(rr), lim)->payload_length() == 30);
  rr.rkey = 5;
  CHECK(proto(decode_header(enc(rr), lim).error()));
  rr.rkey = 0;
  rr.arg0 = 0;
  CHECK(proto(decode_header(enc(rr), lim).error()));
  rr.arg0 = 31;  // more reads than bytes
  CHECK(proto(decode_header(enc(rr), lim).error()));
  auto bad = [&](auto&& change) {
    header b = l;
    change(b);
    return proto(decode_header(enc(b), lim).error());
  };
  CHECK(bad([](header& b) { b.arg0 = 0; }));                     // no descriptor
  CHECK(bad([](header& b) { b.arg0 = max_list_entries + 1; }));  // over the cap
  CHECK(bad([](header& b) { b.arg0 = std::uint64_t(1) << 40; }));
  CHECK(bad([](header& b) { b.length = 2; }));                   // fewer bytes than descriptors
  CHECK(bad([](header& b) { b.length = std::uint32_t(max_rdma_length) + 1; }));
  CHECK(bad([](header& b) { b.addr = 0x1000; }));                // addresses are the descriptors'
  CHECK(bad([](header& b) { b.arg1 = 1; }));
  CHECK(bad([](header& b) {
    b.flags = flag_imm;
    b.imm = 1;
  }));
  CHECK(decode_header(enc([&] {
                        header m = l;
                        m.arg0 = max_list_entries;
                        m.length = max_list_entries;
                        return m;
                      }()),
                      lim)
            .has_value());

  auto table = [](std::initializer_list<list_entry> es) {
    std::vector<std::byte> t(es.size() * list_entry_size);
    std::size_t i = 0;
    for (const auto& e : es) encode_list_entry(e, std::span(t).subspan(i++ * list_entry_size).first<list_entry_size>());
    return t;
  };
  std::array<list_entry, max_list_entries> out{};
  auto t = table({{0x1000, 10}, {0x2000, 5}, {0xFFFFFFFFFFFFFFF0, 15}});
  REQUIRE(decode_list_table(l, t, out).has_value());
  CHECK(out[0].addr == 0x1000);
  CHECK(out[1].length == 5);
  CHECK(out[2].addr == 0xFFFFFFFFFFFFFFF0);  // the address is the target's to check (check_access)
  CHECK(out[2].length == 15);
  auto refused = [&](const header& h, std::span<const std::byte> tb) {
    auto r = decode_list_table(h, tb, out);
    return !r && proto(r.error());
  };
  CHECK(refused(l, table({{0x1000, 10}, {0x2000, 5}, {0x3000, 14}})));   // lengths sum to 29, not 30
  CHECK(refused(l, table({{0x1000, 10}, {0x2000, 0}, {0x3000, 20}})));   // an empty descriptor
  CHECK(refused(l, std::span(t).first(2 * list_entry_size)));             // the table is cut short
  header wrap = l;  // lengths whose 32-bit sum wraps to the header's
  wrap.length = 3;
  CHECK(refused(wrap, table({{0x1000, 0x80000000u}, {0x2000, 0x80000000u}, {0x3000, 3}})));
  CHECK(refused(wrap, table({{0x1000, 0xFFFFFFFFu}, {0x2000, 2}, {0x3000, 2}})));  // over max_rdma_length
  header w;  // not a WRITE_LIST
  w.op = opcode::write;
  w.length = 30;
  CHECK(refused(w, t));
}

TEST_CASE("wire: fuzz entry point on random and mutated inputs") {
  std::mt19937_64 rng(12345);
  // Valid streams, then mutated.
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<std::uint8_t> in;
    in.push_back(static_cast<std::uint8_t>(rng()));
    std::array<std::byte, hello_size> hb{};
    hello h;
    h.receive_buffers = 4;
    h.receive_buffer_size = 1024;
    encode_hello(h, hb);
    for (auto b : hb) in.push_back(std::to_integer<std::uint8_t>(b));
    int frames = 1 + static_cast<int>(rng() % 6);
    for (int f = 0; f < frames; ++f) {
      header fr;
      fr.op = static_cast<opcode>(std::array{1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 18, 19, 20, 21}[rng() % 14]);
      fr.seq = rng() % 10;
      fr.addr = 0x10000 + (rng() % 300) - 20;
      fr.rkey = rng() % 4 ? 0x1234 : static_cast<std::uint32_t>(rng());
      fr.length = static_cast<std::uint32_t>(rng() % 300);
      if (fr.op == opcode::cas || fr.op == opcode::faa) fr.length = 8;
      std::vector<std::uint8_t> table;
      if (fr.op == opcode::read_list_resp) fr.arg0 = 1 + rng() % 4;
      if (fr.op == opcode::write_list || fr.op == opcode::read_list) {  // 1-4 descriptors around the region; lengths that (mostly) add up
        fr.addr = 0;
        fr.arg0 = 1 + rng() % 4;
        fr.length = 0;
        for (std::uint64_t e = 0; e < fr.arg0; ++e) {
          list_entry le{0x10000 + (rng() % 300) - 20, static_cast<std::uint32_t>(1 + rng() % 100)};
          std::array<std::byte, list_entry_size> eb{};
          encode_list_entry(le, eb);
          for (auto b : eb) table.push_back(std::to_integer<std::uint8_t>(b));
          fr.length += le.length;
        }
        if (rng() % 8 == 0) fr.length += static_cast<std::uint32_t>(rng() % 3) - 1;
      }
      for (auto b : enc(fr)) in.push_back(std::to_integer<std::uint8_t>(b));
      in.insert(in.end(), table.begin(), table.end());
      for (std::size_t i = table.size(); i < fr.payload_length(); ++i) in.push_back(static_cast<std::uint8_t>(rng()));
    }
    int mutations = static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations && !in.empty(); ++m) in[rng() % in.size()] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
    if (rng() % 4 == 0) in.resize(rng() % (in.size() + 1));
    LLVMFuzzerTestOneInput(in.data(), in.size());
  }
  // Pure noise.
  for (int iter = 0; iter < 5000; ++iter) {
    std::vector<std::uint8_t> in(rng() % 512);
    for (auto& b : in) b = static_cast<std::uint8_t>(rng());
    LLVMFuzzerTestOneInput(in.data(), in.size());
  }
}

namespace {
// A raw TCP client that completes the hello, then sends `frames` bytes; the
// accepted connection must fail with `expect` and leave `region` untouched.
task<void> raw_peer_case(std::vector<std::byte> (*make)(std::uint64_t addr, std::uint32_t rkey), errc expect) {
  auto d = domain::open(tcp_options()).value();
  std::vector<std::byte> mem(3 * 1024, std::byte{0x77});
  std::span<std::byte> region(mem.data() + 1024, 1024);
  auto mr = d.register_memory(region, access::all).value();
  auto l = d.listen(endpoint::loopback(0)).value();
  auto ep = endpoint::loopback(l.local_endpoint()->port());
  auto raw = [](endpoint ep, std::vector<std::byte> bytes) -> task<void> {
    auto s = (co_await tcp_socket::connect(ep)).value();
    std::array<std::byte, hello_size> hb{};
    hello h;
    h.receive_buffers = 4;
    h.receive_buffer_size = 1024;
    encode_hello(h, hb);
    (void)co_await s.write_all(hb);
    (void)co_await s.read_exact(hb);
    (void)co_await s.write_all(bytes);
    (void)s.shutdown(SHUT_WR);
    // Read until the provider closes on us.
    std::array<std::byte, 256> sink{};
    for (;;) {
      auto n = co_await s.read_some(sink);
      if (!n || *n == 0) break;
    }
  };
  auto server = [](listener& l, errc expect) -> task<void> {
    auto c = (co_await l.accept()).value();
    // Messages are held (their buffers stay taken) until the error comes.
    std::vector<message> held;
    std::error_code ec;
    for (;;) {
      auto m = co_await with_timeout(c.recv(), 5s);
      if (!m) {
        ec = m.error();
        break;
      }
      held.push_back(std::move(*m));
    }
    CHECK(ec == make_error_code(expect));
    CHECK_FALSE(c.is_open());
    (void)co_await c.close();
  };
  co_await when_all(raw(ep, make(mr.remote().address, mr.rkey())), server(l, expect));
  CHECK(std::all_of(mem.begin(), mem.end(), [](std::byte b) { return b == std::byte{0x77}; }));
  l.close();
}

std::vector<std::byte> bytes_of(std::initializer_list<header> hs, std::size_t extra = 0) {
  std::vector<std::byte> v;
  for (const auto& h : hs) {
    auto b = enc(h);
    v.insert(v.end(), b.begin(), b.end());
  }
  v.resize(v.size() + extra, std::byte{0x11});
  return v;
}
}  // namespace

TEST_CASE("raw peer: corrupt header closes with protocol_error") {
  io_context ctx;
  ctx.run(raw_peer_case(
      [](std::uint64_t, std::uint32_t) {
        std::vector<std::byte> v(header_size, std::byte{0xEE});
        return v;
      },
      errc::protocol_error));
}

TEST_CASE("raw peer: oversize SEND closes with protocol_error") {
  io_context ctx;
  ctx.run(raw_peer_case(
      [](std::uint64_t, std::uint32_t) {
        header h;
        h.op = opcode::send;
        h.length = 1 << 20;  // the provider's buffers are 64 KiB
        return bytes_of({h}, 100);
      },
      errc::protocol_error));
}

TEST_CASE("raw peer: SENDs beyond the credits close with protocol_error") {
  io_context ctx;
  ctx.run(raw_peer_case(
      [](std::uint64_t, std::uint32_t) {
        std::vector<std::byte> v;
        for (int i = 0; i < 65; ++i) {  // 64 receive buffers by default
          header h;
          h.op = opcode::send;
          h.seq = i + 1;
          h.length = 1;
          auto b = bytes_of({h}, 1);
          v.insert(v.end(), b.begin(), b.end());
        }
        return v;
      },
      errc::protocol_error));
}

TEST_CASE("raw peer: refused WRITE (then EOF mid-payload) fails with peer_access_refused, region untouched") {
  io_context ctx;
  ctx.run(raw_peer_case(
      [](std::uint64_t addr, std::uint32_t rkey) {
        header h;
        h.op = opcode::write;
        h.seq = 1;
        h.addr = addr + 1024 - 8;  // out of bounds: refused before any byte
        h.rkey = rkey;
        h.length = 64;
        return bytes_of({h}, 10);
      },
      errc::peer_access_refused));
}

TEST_CASE("raw peer: unsolicited response closes with protocol_error") {
  io_context ctx;
  ctx.run(raw_peer_case(
      [](std::uint64_t, std::uint32_t) {
        header h;
        h.op = opcode::atomic_resp;
        h.seq = 5;
        return bytes_of({h});
      },
      errc::protocol_error));
}

TEST_CASE("raw peer: a bad hello is dropped, the listener serves the next client") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    auto d2 = domain::open(tcp_options()).value();
    auto l = d.listen(endpoint::loopback(0)).value();
    auto ep = endpoint::loopback(l.local_endpoint()->port());
    auto bad = [](endpoint ep) -> task<void> {
      auto s = (co_await tcp_socket::connect(ep)).value();
      std::vector<std::byte> junk(hello_size, std::byte{0x42});
      (void)co_await s.write_all(junk);
      std::array<std::byte, 64> sink{};
      for (;;) {
        auto n = co_await s.read_some(sink);
        if (!n || *n == 0) break;
      }
    };
    auto good = [](domain& d2, endpoint ep) -> task<result<connection>> {
      (void)co_await sleep_for(20ms);
      co_return co_await d2.connect(ep);
    };
    auto [a, b, c] = co_await when_all(l.accept(), bad(ep), good(d2, ep));
    REQUIRE(a.has_value());
    REQUIRE(c.has_value());
    auto msg = pattern(10, 1);
    auto [s, m] = co_await when_all(c->send(msg), a->recv());
    CHECK(s.has_value());
    CHECK(m.has_value());
    (void)co_await c->close();
    (void)co_await a->close();
    l.close();
  }());
}

namespace {
// A raw TCP server on loopback that accepts one client, says `answer` (if
// anything) and keeps the socket open until told to stop.
task<void> raw_server(tcp_listener& l, std::vector<std::byte> answer, event& stop) {
  auto s = (co_await l.accept()).value();
  if (!answer.empty()) (void)co_await s.write_all(answer);
  (void)co_await with_timeout(stop.wait(), 30s);
}

// A shuttle connect to a raw server answering `answer`; its error.
task<std::error_code> connect_to_raw(std::vector<std::byte> answer, std::chrono::milliseconds timeout = 10s) {
  auto d = domain::open(tcp_options()).value();
  auto l = tcp_listener::bind(endpoint::loopback(0)).value();
  auto ep = l.local_endpoint().value();
  event stop;
  std::error_code ec;
  auto client = [&]() -> task<void> {
    connection_options o;
    o.connect_timeout = timeout;
    auto c = co_await d.connect(ep, o);
    ec = c ? std::error_code{} : c.error();
    stop.set();
  };
  co_await when_all(raw_server(l, std::move(answer), stop), client());
  co_return ec;
}

std::vector<std::byte> text(std::string_view s) {
  std::vector<std::byte> v(s.size());
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}
}  // namespace

TEST_CASE("wire: a bad magic is not_a_shuttle_peer, another version wire_version_mismatch, bad sizes protocol_error") {
  std::array<std::byte, hello_size> b{};
  hello h;
  h.receive_buffers = 64;
  h.receive_buffer_size = 65536;
  encode_hello(h, b);
  auto bad = b;
  bad[0] = std::byte{'X'};
  CHECK(decode_hello(bad).error() == make_error_code(errc::not_a_shuttle_peer));
  bad = b;
  bad[4] = std::byte{1};
  CHECK(decode_hello(bad).error() == make_error_code(errc::wire_version_mismatch));
  h.receive_buffers = 0;
  encode_hello(h, bad);
  CHECK(decode_hello(bad).error() == make_error_code(errc::protocol_error));
  CHECK(starts_like_hello(std::span(b).first(3)));
  CHECK_FALSE(starts_like_hello(text("SSH")));
}

TEST_CASE("connect errors: a silent peer is handshake_timeout, distinct from the TCP connect's timeout") {
  io_context ctx;
  auto ec = ctx.run(connect_to_raw({}, 50ms));
  CHECK(ec == make_error_code(errc::handshake_timeout));
  CHECK(ec == std::errc::timed_out);
  CHECK(ec.message() != std::make_error_code(std::errc::timed_out).message());
  CHECK(ec.message() != make_error_code(errc::operation_timeout).message());
}

TEST_CASE("connect errors: another protocol's peer is not_a_shuttle_peer, at its first bytes") {
  io_context ctx;
  // A banner shorter than a hello: told apart without waiting for more.
  auto ec = ctx.run(connect_to_raw(text("SSH-2.0-x\r\n")));
  CHECK(ec == make_error_code(errc::not_a_shuttle_peer));
  CHECK(matches(ec, errc::protocol_error));
  ec = ctx.run(connect_to_raw(text("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")));
  CHECK(ec == make_error_code(errc::not_a_shuttle_peer));
}

TEST_CASE("connect errors: a shuttle peer of another wire version is wire_version_mismatch") {
  io_context ctx;
  std::vector<std::byte> other(hello_size);
  hello h;
  h.version = protocol_version + 1;
  h.receive_buffers = 64;
  h.receive_buffer_size = 65536;
  encode_hello(h, std::span<std::byte, hello_size>(other.data(), hello_size));
  auto ec = ctx.run(connect_to_raw(other));
  CHECK(ec == make_error_code(errc::wire_version_mismatch));
  CHECK(matches(ec, errc::protocol_error));
}

TEST_CASE("listener: a refused peer's reason names what happened") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(tcp_options()).value();
    std::vector<std::string> why;
    listener_options lim;
    lim.handshake_timeout = 50ms;
    lim.on_refused = [&](const endpoint&, std::string_view w) { why.emplace_back(w); };
    auto l = d.listen(endpoint::loopback(0), {}, lim).value();
    auto ep = l.local_endpoint().value();
    // One peer speaks another protocol, one says nothing; then a good one.
    auto peer = [](endpoint ep, std::vector<std::byte> say) -> task<void> {
      auto s = (co_await tcp_socket::connect(ep)).value();
      if (!say.empty()) (void)co_await s.write_all(say);
      std::array<std::byte, 64> sink{};
      for (;;) {
        auto n = co_await s.read_some(sink);
        if (!n || *n == 0) break;
      }
    };
    auto good = [](domain& d, endpoint ep, std::vector<std::string>& why) -> task<result<connection>> {
      while (why.size() < 2) (void)co_await sleep_for(5ms);  // both refused first
      co_return co_await d.connect(ep);
    };
    auto [a, x, y, c] = co_await when_all(l.accept(), peer(ep, text("GET / HTTP/1.0\r\n\r\n")), peer(ep, {}),
                                          good(d, ep, why));
    REQUIRE(a.has_value());
    REQUIRE(c.has_value());
    REQUIRE(why.size() == 2);
    std::sort(why.begin(), why.end());
    CHECK(why[0] == "handshake failed: " + make_error_code(errc::handshake_timeout).message());
    CHECK(why[1] == "handshake failed: " + make_error_code(errc::not_a_shuttle_peer).message());
    (void)co_await c->close();
    (void)co_await a->close();
  }());
}
