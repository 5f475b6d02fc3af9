// shuttle-transfer: an RDMA-style transfer pipeline over the transport API.
//
//   shuttle-transfer [--chunks N] [--chunk-size BYTES] [--slots S]
//                    [--transport auto|rdma|tcp-provider] [--addr ADDR] [--port P]
//
// One process, two runtime threads, each with its own domain (the provider
// domain::open picks: verbs when an RDMA device is active, else the tcp
// provider; --transport forces one):
//
//  - the receiver (thread 0) registers a ring of S chunk slots with
//    remote_write and listens with the ring's descriptor (remote_buffer,
//    slot count, chunk size: 32 bytes) as its connect payload, so that the
//    sender has it once connected (connection::peer_payload), with no
//    message round trip;
//  - the sender (thread 1) produces chunk i into local slot i % S (a pattern
//    that depends on i, the chunk index in its first word and a checksum of
//    the rest in its last) while the earlier chunks are on the wire, and
//    writes it with write_with_imm (imm = i) into remote slot i % S;
//  - the receiver is notified of each chunk by recv() (message::imm()),
//    checks its index and checksum, and returns the slot with a small send
//    (a credit carrying i). The sender writes chunk i only after the credit
//    for chunk i - S came back, so no unconsumed slot is ever overwritten.
//    Finally the sender sends the chunk count and the combined checksum.
//
// Prints chunks, bytes, GB/s (10^9 bytes/s, from the first chunk produced to
// the last credit back) and checksum OK/FAIL. Exit status: 0 if every chunk
// arrived intact, 1 on a mismatch or a transport error, 2 for bad usage.
// SIGINT/SIGTERM stop both sides: the same summary (chunks so far, checked),
// "interrupted by SIGTERM" on the checksum line, and exit 0 if every chunk
// that arrived was intact. A line "receiver listening on ADDR" comes first,
// once the signals are handled.

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "cli.hpp"
#include "tool_support.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <functional>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

namespace {

using shuttle::task;
using steady = std::chrono::steady_clock;
constexpr const char* kProg = "shuttle-transfer";

// ---------------------------------------------------------------- options

struct options {
  std::uint64_t chunks = 256;
  std::uint64_t chunk_size = 1 << 20;
  std::uint64_t slots = 8;
  cli::transport transport = cli::transport::automatic;
  std::string addr = "127.0.0.1";
  unsigned port = 0;
  std::optional<std::uint64_t> corrupt;  // testing: damage this chunk after its checksum
};

const char* const kSynopsis =
    "usage: shuttle-transfer [--chunks N] [--chunk-size BYTES] [--slots S]\n"
    "                        [--transport auto|rdma|tcp-provider] [--addr ADDR] [--port P] [--corrupt I]\n";

options parse_options(int argc, char** argv) {
  options o;
  CLI::App app{"A transfer pipeline over the transport API: checksummed chunks into a receiver's ring, in one "
               "process, every chunk verified.",
               kProg};
  cli::setup(app, kSynopsis);
  app.add_option("--chunks", o.chunks, "chunks to transfer (default 256)")
      ->type_name("N")
      ->transform(cli::count(1, UINT32_MAX));
  app.add_option("--chunk-size", o.chunk_size, "bytes per chunk, a multiple of 8, suffixes k/m/g (default 1m)")
      ->type_name("BYTES")
      ->transform(cli::bytes(64, 1ull << 30));
  app.add_option("--slots", o.slots, "slots in the receiver's ring (default 8)")
      ->type_name("S")
      ->transform(cli::count(1, 4096));
  cli::add_transport(app, o.transport, {cli::transport::automatic, cli::transport::rdma, cli::transport::tcp_provider},
                     "auto (verbs if an RDMA device is active, else the tcp provider), rdma (verbs), tcp-provider "
                     "('tcp' is taken for it too) (default auto)",
                     /*tcp_means_provider=*/true);
  app.add_option("--addr", o.addr,
                 "numeric address the receiver listens on and the sender connects to (default 127.0.0.1; rdma "
                 "needs the address of an RDMA interface)")
      ->type_name("ADDR");
  app.add_option("--port", o.port, "port (default 0: a free one)")->type_name("P")->transform(cli::count(0, 65535));
  std::uint64_t corrupt = 0;
  auto* corrupt_opt = app.add_option("--corrupt", corrupt,
                                     "testing: flip a byte of chunk I after its checksum is taken (the receiver "
                                     "must report it, and the exit status be 1)")
                          ->type_name("I")
                          ->transform(cli::count(0, UINT32_MAX));
  cli::parse(app, argc, argv);
  if (corrupt_opt->count()) o.corrupt = corrupt;
  if (o.chunk_size % 8 != 0)
    cli::fail(app, "--chunk-size: bad value '" + std::to_string(o.chunk_size) + "' (a multiple of 8 bytes)");
  if (o.slots * o.chunk_size > (std::uint64_t(4) << 30))
    cli::fail(app, "the ring (--slots x --chunk-size = " + std::to_string(o.slots * o.chunk_size) +
                       " bytes) is larger than 4 GiB");
  return o;
}

// ---------------------------------------------------------------- chunks

// A chunk is chunk_size / 8 little-endian words: word 0 is the chunk index,
// the middle words a pattern of (index, position), the last word the
// checksum of all the others.
std::uint64_t load(const std::byte* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
void store(std::byte* p, std::uint64_t v) noexcept { std::memcpy(p, &v, 8); }
std::string hex(std::uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

constexpr std::uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull;
std::uint64_t round64(std::uint64_t acc, std::uint64_t w) noexcept {
  return std::rotl(acc + w * P2, 31) * P1;
}

// An xxHash64-style checksum of `words` words: four independent lanes, so it
// runs at memory speed, and position-sensitive.
std::uint64_t checksum(const std::byte* p, std::size_t words) noexcept {
  std::uint64_t a = P1 + P2, b = P2, c = 0, d = 0 - P1;
  std::size_t k = 0;
  for (; k + 4 <= words; k += 4) {
    a = round64(a, load(p + 8 * k));
    b = round64(b, load(p + 8 * k + 8));
    c = round64(c, load(p + 8 * k + 16));
    d = round64(d, load(p + 8 * k + 24));
  }
  std::uint64_t h = std::rotl(a, 1) + std::rotl(b, 7) + std::rotl(c, 12) + std::rotl(d, 18);
  for (; k < words; ++k) h = std::rotl(h ^ round64(0, load(p + 8 * k)), 27) * P1 + P3;
  h ^= words;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  return h ^ (h >> 32);
}

// Produces chunk `index` into `out` and returns its checksum.
std::uint64_t produce(std::span<std::byte> out, std::uint64_t index) noexcept {
  const std::size_t words = out.size() / 8;
  const std::uint64_t base = (index + 1) * 0xD6E8FEB86659FD93ull;
  std::byte* p = out.data();
  store(p, index);
  for (std::size_t k = 1; k + 1 < words; ++k) {
    std::uint64_t x = k * 0x9E3779B97F4A7C15ull + base;
    store(p + 8 * k, x ^ (x >> 29));
  }
  const std::uint64_t sum = checksum(p, words - 1);
  store(p + 8 * (words - 1), sum);
  return sum;
}

// ---------------------------------------------------------------- wire

// Receiver -> sender, once: the ring, as the listener's connect payload.
struct descriptor {
  static constexpr std::size_t kSize = 4 + 8 + shuttle::remote_buffer::wire_size;
  static_assert(kSize <= shuttle::max_connect_payload);
  std::uint32_t slots = 0;
  std::uint64_t chunk_size = 0;
  shuttle::remote_buffer ring;

  std::vector<std::byte> encode() const {
    std::vector<std::byte> out(kSize);
    std::memcpy(out.data(), &slots, 4);
    std::memcpy(out.data() + 4, &chunk_size, 8);
    (void)ring.serialize(std::span(out).subspan(12));  // room checked above
    return out;
  }
  static std::optional<descriptor> decode(std::span<const std::byte> in) noexcept {
    if (in.size() != kSize) return std::nullopt;
    descriptor d;
    std::memcpy(&d.slots, in.data(), 4);
    std::memcpy(&d.chunk_size, in.data() + 4, 8);
    auto ring = shuttle::remote_buffer::deserialize(in.subspan(12));
    if (!ring) return std::nullopt;
    d.ring = *ring;
    return d;
  }
};

// Receiver -> sender per chunk: the credit, the index of the chunk consumed
// (8 bytes). Sender -> receiver at the end: chunk count and combined
// checksum (16 bytes).

// ---------------------------------------------------------------- shared state

struct aligned_buffer {
  struct del {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t(4096)); }
  };
  std::unique_ptr<std::byte[], del> p;
  std::size_t n = 0;
  explicit aligned_buffer(std::size_t size)
      : p(static_cast<std::byte*>(::operator new[](size, std::align_val_t(4096)))), n(size) {
    std::memset(p.get(), 0, n);  // fault the pages in before registration and timing
  }
  std::span<std::byte> span() const noexcept { return {p.get(), n}; }
};


// Written by one thread each; main reads them after both tasks are done.
struct shared {
  shared(const options& opts, shuttle::runtime& runtime) : o(opts), rt(runtime) {}
  const options& o;
  shuttle::runtime& rt;
  std::mutex mutex;  // for errors (either thread)
  std::vector<std::string> errors;
  // Set on SIGINT/SIGTERM before both sides are stopped: what fails after
  // it (a cancelled recv, the peer's connection closing) is the stop, not
  // an error.
  std::atomic<bool> interrupted{false};

  // Receiver (thread 0).
  std::string setup_step;  // what failed in listen()
  // The provider the sender's connection took (automatic: local for a
  // receiver on this host); written by the sender before it reports its end.
  shuttle::transport_kind path = shuttle::transport_kind::automatic;
  std::optional<shuttle::domain> rx_domain;
  std::optional<aligned_buffer> ring;          // registered before listen(): its descriptor is the listener's payload
  std::optional<shuttle::memory_region> ring_mr;
  std::optional<shuttle::listener> listener;
  std::uint64_t received = 0, verified = 0, mismatches = 0;
  std::uint64_t rx_combined = 0;
  bool end_ok = false;

  // Sender (thread 1).
  std::uint64_t sent = 0, credits = 0;
  std::uint64_t tx_combined = 0;
  steady::time_point t0{}, t1{};

  void error(std::string msg) {
    if (interrupted.load()) return;
    {
      std::lock_guard lock(mutex);
      if (errors.size() < 10) errors.push_back(std::move(msg));
    }
  }
  // A transport failure: stop the other side too (it may be waiting).
  void abort(std::string msg) {
    error(std::move(msg));
    rt.request_stop();
  }
};

bool is_cancel(const std::error_code& ec) { return ec == std::errc::operation_canceled; }

shuttle::connection_options conn_options(const options& o) {
  shuttle::connection_options c;
  // Each chunk notification and each credit takes one posted receive.
  c.receive_buffers = static_cast<std::uint32_t>(std::max<std::uint64_t>(64, o.slots + 8));
  c.receive_buffer_size = 4096;
  c.send_queue_depth = static_cast<std::uint32_t>(std::max<std::uint64_t>(128, o.slots + 8));
  return c;
}


// ---------------------------------------------------------------- receiver

// On thread 0: the domain and the listener. Returns the port.
task<shuttle::result<unsigned>> listen(shared& s, shuttle::endpoint ep) {
  shuttle::domain_options dopts;
  dopts.kind = cli::kind_of(s.o.transport);
  auto d = shuttle::domain::open(dopts);
  if (!d) {
    s.setup_step = std::string("cannot open a ") + cli::to_string(s.o.transport) + " domain";
    if (s.o.transport == cli::transport::rdma && d.error() == shuttle::errc::not_supported)
      s.setup_step += " (no active RDMA device, or built without rdma-core)";
    co_return d.error();
  }
  s.rx_domain.emplace(std::move(*d));
  s.ring.emplace(s.o.slots * s.o.chunk_size);
  auto mr = s.rx_domain->register_memory(s.ring->span(), shuttle::access::local_write | shuttle::access::remote_write);
  if (!mr) {
    s.setup_step = "registering the ring failed";
    s.ring.reset();
    s.rx_domain.reset();
    co_return mr.error();
  }
  s.ring_mr.emplace(std::move(*mr));
  auto copts = conn_options(s.o);
  copts.payload = descriptor{static_cast<std::uint32_t>(s.o.slots), s.o.chunk_size, s.ring_mr->remote()}.encode();
  auto l = s.rx_domain->listen(ep, copts);
  if (!l) {
    s.setup_step = "cannot listen on " + ep.to_string() + " over " + s.rx_domain->describe();
    if (s.rx_domain->kind() == shuttle::transport_kind::verbs)
      s.setup_step += " (rdma needs the address of an RDMA interface: --addr, or --transport tcp-provider)";
    s.ring_mr.reset();
    s.ring.reset();
    s.rx_domain.reset();
    co_return l.error();
  }
  s.listener.emplace(std::move(*l));
  co_return static_cast<unsigned>(s.listener->local_endpoint()->port());
}

task<void> receive(shared& s) {
  const options& o = s.o;
  const aligned_buffer& ring = *s.ring;
  {
    auto c = co_await s.listener->accept();
    s.listener->close();
    if (!c) {
      if (!is_cancel(c.error())) s.abort("receiver: accept failed: " + c.error().message());
      s.listener.reset();
      s.ring_mr.reset();
      s.rx_domain.reset();
      co_return;
    }
    shuttle::connection conn = std::move(*c);
    const std::size_t words = o.chunk_size / 8;
    co_await [&]() -> task<void> {  // the transfer proper; every exit below closes and tears down
      for (;;) {  // the sender has the ring's descriptor already (the listener's payload)
        auto m = co_await conn.recv();
        if (!m) {
          if (!is_cancel(m.error()))
            s.abort("receiver: recv failed after " + std::to_string(s.received) + " chunks: " + m.error().message());
          co_return;
        }
        if (!m->imm()) {  // the end message
          if (m->size() != 16) {
            s.abort("receiver: unexpected " + std::to_string(m->size()) + "-byte message");
            co_return;
          }
          std::uint64_t count = load(m->data().data()), combined = load(m->data().data() + 8);
          s.end_ok = count == s.received && combined == s.rx_combined;
          if (!s.end_ok && s.mismatches == 0)
            s.error("receiver: the sender reports " + std::to_string(count) + " chunks, combined checksum " + hex(combined) +
                    "; received " + std::to_string(s.received) + ", combined " + hex(s.rx_combined));
          co_return;
        }
        const std::uint64_t index = *m->imm();
        m->reset();  // post the receive again before the credit goes
        if (index != s.received % (std::uint64_t(1) << 32)) {
          s.abort("receiver: chunk " + std::to_string(index) + " arrived where chunk " +
                  std::to_string(s.received) + " was due");
          co_return;
        }
        const std::byte* chunk = ring.p.get() + (index % o.slots) * o.chunk_size;
        const std::uint64_t sum = checksum(chunk, words - 1);
        const bool ok = load(chunk) == index && load(chunk + 8 * (words - 1)) == sum;
        if (ok) {
          ++s.verified;
        } else {
          ++s.mismatches;
          s.error("receiver: chunk " + std::to_string(index) + " in slot " + std::to_string(index % o.slots) +
                  " is corrupt (index word " + std::to_string(load(chunk)) + ", checksum " + hex(sum) + ", the chunk says " +
                  hex(load(chunk + 8 * (words - 1))) + ")");
        }
        s.rx_combined ^= sum + index;
        ++s.received;
        std::array<std::byte, 8> credit;
        store(credit.data(), index);
        if (auto r = co_await conn.send(credit); !r) {
          if (!is_cancel(r.error())) s.abort("receiver: sending a credit failed: " + r.error().message());
          co_return;
        }
      }
    }();
    (void)co_await conn.close();
  }
  // No wait: what the provider still winds down ends on the loop
  // (transport.hpp, "Lifetimes").
  s.listener.reset();
  s.ring_mr.reset();
  s.rx_domain.reset();
}

// ---------------------------------------------------------------- sender

struct local_slot {
  shuttle::event free{true};  // no write reads it
};

task<void> write_chunk(shared& s, shuttle::connection& conn, std::span<const std::byte> data,
                       shuttle::remote_buffer dst, std::uint32_t imm, local_slot& slot) {
  auto r = co_await conn.write_with_imm(data, dst, imm);
  slot.free.set();
  if (!r && !is_cancel(r.error()))
    s.abort("sender: write_with_imm of chunk " + std::to_string(imm) + " failed: " + r.error().message());
}

// Waits for the next credit; false if the connection failed.
task<bool> take_credit(shared& s, shuttle::connection& conn) {
  auto m = co_await conn.recv();
  if (!m) {
    if (!is_cancel(m.error())) s.abort("sender: waiting for a credit failed: " + m.error().message());
    co_return false;
  }
  if (m->size() != 8 || load(m->data().data()) != s.credits) {
    s.abort("sender: bad credit (" + std::to_string(m->size()) + " bytes) where the credit for chunk " +
            std::to_string(s.credits) + " was due");
    co_return false;
  }
  ++s.credits;
  co_return true;
}

task<void> send_all(shared& s, shuttle::connection& conn, shuttle::domain& dom) {
  const options& o = s.o;
  auto d = descriptor::decode(conn.peer_payload());  // sent with the listener's answer
  if (!d || d->slots == 0 || d->chunk_size != o.chunk_size || d->ring.length < d->slots * d->chunk_size) {
    s.abort("sender: bad ring descriptor");
    co_return;
  }
  const std::uint64_t slots = d->slots;

  aligned_buffer local(slots * o.chunk_size);
  auto lmr = dom.register_memory(local.span(), shuttle::access::local_write);
  if (!lmr) {
    s.abort("sender: registering the source buffers failed: " + lmr.error().message());
    co_return;
  }
  std::vector<local_slot> local_slots(slots);
  shuttle::async_scope writes;
  bool failed = false;
  s.t0 = steady::now();
  for (std::uint64_t i = 0; i < o.chunks && !failed; ++i) {
    const std::uint64_t slot = i % slots;
    // The remote slot is free once the credit for chunk i - slots is back.
    while (i >= slots + s.credits && !failed) failed = !co_await take_credit(s, conn);
    // The local slot is free once the write that read it has completed.
    if (!failed && !(co_await local_slots[slot].free.wait())) failed = true;
    if (failed) break;
    local_slots[slot].free.reset();
    // Produce chunk i while chunks i-1, i-2, ... are on the wire.
    std::span<std::byte> buf = local.span().subspan(slot * o.chunk_size, o.chunk_size);
    const std::uint64_t sum = produce(buf, i);
    s.tx_combined ^= sum + i;
    if (o.corrupt == i) buf[o.chunk_size / 2] ^= std::byte{1};
    writes.spawn(write_chunk(s, conn, buf, *d->ring.slice(slot * o.chunk_size, o.chunk_size),
                             static_cast<std::uint32_t>(i), local_slots[slot]));
    ++s.sent;
  }
  // Every credit back: every chunk consumed.
  while (!failed && s.credits < s.sent) failed = !co_await take_credit(s, conn);
  s.t1 = steady::now();
  if (failed) writes.request_stop();
  co_await writes.join();
  if (!failed) {
    std::array<std::byte, 16> end;
    store(end.data(), s.sent);
    store(end.data() + 8, s.tx_combined);
    if (auto r = co_await conn.send(end); !r && !is_cancel(r.error()))
      s.abort("sender: sending the end message failed: " + r.error().message());
  }
}

task<void> send(shared& s, shuttle::endpoint ep, shuttle::transport_kind kind) {
  shuttle::domain_options dopts;
  dopts.kind = kind;
  auto dom = shuttle::domain::open(dopts);
  if (!dom) {
    s.abort(std::string("sender: cannot open a ") + cli::name_of(kind) + " domain: " + dom.error().message());
    co_return;
  }
  {
    auto c = co_await dom->connect(ep, conn_options(s.o));
    if (!c) {
      if (!is_cancel(c.error()))
        s.abort("sender: connecting to " + ep.to_string() + " failed: " + c.error().message() +
                (kind == shuttle::transport_kind::verbs
                     ? " (rdma needs the address of an RDMA interface: --addr, or --transport tcp-provider)"
                     : ""));
    } else {
      s.path = c->kind();
      co_await send_all(s, *c, *dom);
      (void)co_await c->close();
    }
  }
}

// Runs `t`, reports its end (or its exception) through `done`, then runs
// `then` (which tells the main thread).
task<void> fulfil(task<void> t, std::promise<void> done, std::function<void()> then) {
  try {
    co_await std::move(t);
    done.set_value();
  } catch (...) {
    done.set_exception(std::current_exception());
  }
  then();
}

// On the main thread: the first SIGINT/SIGTERM (its number), or 0 once both
// sides finished.
shuttle::task<int> signal_or_finished(shuttle::signal_set& signals, shuttle::event& finished) {
  auto r = co_await shuttle::when_any(tools::wait_for_signal(signals, kProg), finished.wait());
  co_return r.index() == 0 ? std::get<0>(r) : 0;
}

int run(const options& o) {
  const bool v6 = o.addr.find(':') != std::string::npos;
  auto ep = shuttle::endpoint::parse((v6 ? "[" + o.addr + "]" : o.addr) + ":" + std::to_string(o.port));
  if (!ep) {
    std::fprintf(stderr, "%s: bad --addr '%s' (a numeric IPv4 or IPv6 address)\n", kProg, o.addr.c_str());
    return 2;
  }
  // SIGINT/SIGTERM are read on this thread through a signalfd: blocked
  // before the runtime's threads start (they inherit the mask).
  shuttle::block_signals({SIGINT, SIGTERM, SIGPIPE});
  shuttle::io_context main_ctx;
  shuttle::signal_set signals{SIGINT, SIGTERM};
  shuttle::runtime rt(2);
  shared s(o, rt);

  auto port = rt.block_on(0, listen(s, *ep));
  if (!port) {
    std::fprintf(stderr, "%s: receiver: %s: %s\n", kProg, s.setup_step.c_str(), port.error().message().c_str());
    rt.join();
    return 1;
  }
  const shuttle::transport_kind kind = s.rx_domain->kind();
  const std::string described = s.rx_domain->describe();
  auto peer = shuttle::endpoint::parse((v6 ? "[" + o.addr + "]" : o.addr) + ":" + std::to_string(*port)).value();

  std::printf("%s: receiver listening on %s\n", kProg, peer.to_string().c_str());
  std::fflush(stdout);

  std::promise<void> rx_done, tx_done;
  auto rx = rx_done.get_future(), tx = tx_done.get_future();
  shuttle::event finished;
  int sides_left = 2;  // main thread only
  auto tell_main = [&] {
    main_ctx.dispatch([&] {
      if (--sides_left == 0) finished.set();
    });
  };
  rt.spawn(0, fulfil(receive(s), std::move(rx_done), tell_main));
  // The sender asks for what the receiver asked for (automatic on both: a
  // receiver on this host is reached through the local provider).
  rt.spawn(1, fulfil(send(s, peer, cli::kind_of(o.transport)), std::move(tx_done), tell_main));
  const int sig = main_ctx.run(signal_or_finished(signals, finished));
  if (sig > 0) {
    std::fprintf(stderr, "%s: %s, stopping\n", kProg, strsignal(sig));
    s.interrupted.store(true);
    rt.request_stop();
  }
  bool crashed = false;
  for (auto* f : {&rx, &tx}) {
    try {
      f->get();
    } catch (const std::exception& e) {
      s.error(std::string("a task failed: ") + e.what());
      rt.request_stop();
      crashed = true;
    }
  }
  rt.join();

  for (auto& e : s.errors) std::fprintf(stderr, "%s: %s\n", kProg, e.c_str());
  const std::uint64_t bytes = s.received * o.chunk_size;
  const double secs = s.t1 > s.t0 ? std::chrono::duration<double>(s.t1 - s.t0).count() : 0;
  // Interrupted: what arrived so far must be intact, and the run says it
  // stopped early; a clean stop exits 0, as the servers do.
  const bool intact = !crashed && s.errors.empty() && s.mismatches == 0;
  const bool ok = intact && (sig > 0 || (s.verified == o.chunks && s.end_ok));
  std::printf("%s: %s over %s, %s\n", kProg, cli::name_of(s.path != shuttle::transport_kind::automatic ? s.path : kind),
              described.c_str(), peer.to_string().c_str());
  std::printf("  chunks:   %llu of %llu x %llu bytes through %llu slots\n",
              static_cast<unsigned long long>(s.received), static_cast<unsigned long long>(o.chunks),
              static_cast<unsigned long long>(o.chunk_size), static_cast<unsigned long long>(o.slots));
  std::printf("  bytes:    %llu in %.3f s\n", static_cast<unsigned long long>(bytes), secs);
  std::printf("  rate:     %.3f GB/s\n", secs > 0 ? static_cast<double>(bytes) / secs / 1e9 : 0.0);
  std::printf("  checksum: %s (%llu verified, %llu corrupt)%s\n", ok ? "OK" : "FAIL",
              static_cast<unsigned long long>(s.verified), static_cast<unsigned long long>(s.mismatches),
              sig > 0 ? (std::string(", interrupted by SIG") + sigabbrev_np(sig)).c_str() : "");
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse_options(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProg, e.what());
    return 1;
  }
}
