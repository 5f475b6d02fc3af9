// Block-list transfers (connection::write_blocks / read_blocks, issue 31),
// provider-neutral: run on tcp and local here and on verbs in the Soft-RoCE
// guest, as the conformance suite. Exits 77 when the provider selected by
// SHUTTLE_TRANSPORT is not available.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "common.hpp"
#include "stats.hpp"
#include "wire.hpp"

#include <algorithm>
#include <array>
#include <numeric>
#include <random>

using namespace shuttle;
using namespace transport_test;
using namespace std::chrono_literals;

namespace {
bool all_equal(std::span<const std::byte> m, std::byte v) {
  return std::all_of(m.begin(), m.end(), [v](std::byte b) { return b == v; });
}
// `n` blocks of `size` bytes: block i at local slot i, at a shuffled remote
// slot, with a gap of `size` after every slot on both sides (nothing merges).
std::vector<block> scattered(std::size_t n, std::size_t size, unsigned seed) {
  std::vector<std::size_t> slot(n);
  std::iota(slot.begin(), slot.end(), 0);
  std::shuffle(slot.begin(), slot.end(), std::mt19937(seed));
  std::vector<block> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = {2 * i * size, 2 * slot[i] * size, size};
  return b;
}
// The local memory registered by the user or not: on verbs a list inside
// one registration is built straight from its blocks, other memory goes the
// generic way (registered or staged per merged operation); the results are
// the same.
struct local_registration {
  std::vector<memory_region> regions;
  void add(domain& d, std::span<std::byte> m, bool on) {
    if (on) regions.push_back(d.register_memory(m, access::local_write).value());
  }
};
}  // namespace

TEST_CASE("blocks: 10,000 scattered blocks written then read back, every byte checked") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    constexpr std::size_t n = 10000, size = 200;  // odd sizes: no alignment luck
    auto src = pattern(2 * n * size, 11);
    std::vector<std::byte> target(2 * n * size, std::byte{0x5A});
    auto mr = p.server_domain->register_memory(target, access::all).value();
    auto src_mr = p.client_domain->register_memory(src, access::local_write).value();
    auto blocks = scattered(n, size, 3);
    const auto before = block_transfer_stats();
    auto [w, m] = co_await when_all(p.client.write_blocks(src, mr.remote(), blocks, {.notify = 77u}), p.server.recv());
    REQUIRE(w.has_value());
    CHECK(block_transfer_stats().operations - before.operations == n);  // none adjacent: none merged
    // The notification arrives after every block.
    REQUIRE(m.has_value());
    CHECK(m->imm() == std::optional<std::uint32_t>(77u));
    std::size_t bad = 0;
    for (const block& b : blocks) {
      bad += !std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                         target.begin() + b.remote_offset);
      bad += !all_equal(std::span(target).subspan(b.remote_offset + size, size), std::byte{0x5A});  // the gaps
    }
    CHECK(bad == 0);
    // Read them back into a fresh buffer, to other places.
    std::vector<std::byte> back(2 * n * size, std::byte{0});
    auto back_mr = p.client_domain->register_memory(back, access::local_write).value();
    auto rblocks = scattered(n, size, 4);
    for (std::size_t i = 0; i < n; ++i) rblocks[i].remote_offset = blocks[i].remote_offset;
    auto r = co_await p.client.read_blocks(back, mr.remote(), rblocks);
    REQUIRE(r.has_value());
    bad = 0;
    for (std::size_t i = 0; i < n; ++i)
      bad += !std::equal(src.begin() + blocks[i].local_offset, src.begin() + blocks[i].local_offset + size,
                         back.begin() + rblocks[i].local_offset);
    CHECK(bad == 0);
    CHECK(p.client.is_open());
    CHECK((co_await p.client.write_blocks(src, mr.remote(), {})).has_value());  // empty: done at once
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks: adjacent blocks are merged, others not") {
  bool reg = false;
  SUBCASE("local memory not registered") { reg = false; }
  SUBCASE("local memory registered") { reg = true; }
  io_context ctx;
  ctx.run([reg]() -> task<void> {
    local_registration lr;
    pair_t p;
    co_await make_pair(p);
    auto src = pattern(64 * 1024, 5);
    std::vector<std::byte> target(64 * 1024, std::byte{0x5A});
    auto mr = p.server_domain->register_memory(target, access::all).value();
    lr.add(*p.client_domain, src, reg);
    // 10 runs of 10 adjacent 64-byte blocks (runs 1 KiB apart on both
    // sides), then 10 blocks adjacent locally but not remotely, then 10
    // adjacent remotely but not locally: 10 + 10 + 10 operations.
    std::vector<block> blocks;
    for (std::uint64_t r = 0; r < 10; ++r)
      for (std::uint64_t i = 0; i < 10; ++i) blocks.push_back({r * 1024 + i * 64, r * 1024 + i * 64, 64});
    for (std::uint64_t i = 0; i < 10; ++i) blocks.push_back({16384 + i * 64, 16384 + i * 128, 64});
    for (std::uint64_t i = 0; i < 10; ++i) blocks.push_back({32768 + i * 128, 32768 + i * 64, 64});
    const auto before = block_transfer_stats();
    auto w = co_await p.client.write_blocks(src, mr.remote(), blocks);
    REQUIRE(w.has_value());
    const auto after = block_transfer_stats();
    CHECK(after.lists - before.lists == 1);
    CHECK(after.blocks - before.blocks == blocks.size());
    CHECK(after.operations - before.operations == 30);
    for (const block& b : blocks)
      CHECK(std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                       target.begin() + b.remote_offset));
    // Read back the same way: merged likewise, same bytes.
    std::vector<std::byte> back(src.size());
    lr.add(*p.client_domain, back, reg);
    auto r = co_await p.client.read_blocks(back, mr.remote(), blocks);
    REQUIRE(r.has_value());
    CHECK(block_transfer_stats().operations - after.operations == 30);
    for (const block& b : blocks)
      CHECK(std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                       back.begin() + b.local_offset));
    co_await close_pair(p);
  }());
}

// A send queue much shorter than the lists, two lists at once on one
// connection: each list is cut where the free slots end (the tcp engine's
// list frames: of 1 to a few descriptors, interleaved with the other
// list's), every byte lands, and the slots all come back (a list of the
// queue's depth, and then more, still go).
TEST_CASE("blocks: two lists at once through a send queue of 5, every byte checked") {
  bool reg = false;
  SUBCASE("local memory not registered") { reg = false; }
  SUBCASE("local memory registered") { reg = true; }
  io_context ctx;
  ctx.run([reg]() -> task<void> {
    local_registration lr;
    pair_t p;
    connection_options shallow;
    shallow.send_queue_depth = 5;
    co_await make_pair(p, shallow);
    constexpr std::size_t n = 300, size = 96;
    auto src = pattern(4 * n * size, 31);
    std::vector<std::byte> target(4 * n * size, std::byte{0x5A});
    auto mr = p.server_domain->register_memory(target, access::all).value();
    lr.add(*p.client_domain, src, reg);
    // List a: slots 0..2n-1 of both sides; list b: slots 2n..4n-1.
    auto a = scattered(n, size, 5), b = scattered(n, size, 6);
    for (block& x : b) {
      x.local_offset += 2 * n * size;
      x.remote_offset += 2 * n * size;
    }
    auto [wa, wb] = co_await when_all(p.client.write_blocks(src, mr.remote(), a), p.client.write_blocks(src, mr.remote(), b));
    REQUIRE(wa.has_value());
    REQUIRE(wb.has_value());
    std::size_t bad = 0;
    for (const auto* l : {&a, &b})
      for (const block& x : *l)
        bad += !std::equal(src.begin() + x.local_offset, src.begin() + x.local_offset + x.length,
                           target.begin() + x.remote_offset);
    CHECK(bad == 0);
    std::vector<std::byte> back(src.size(), std::byte{0});
    lr.add(*p.client_domain, back, reg);
    auto [ra, rb] = co_await when_all(p.client.read_blocks(back, mr.remote(), a), p.client.read_blocks(back, mr.remote(), b));
    REQUIRE(ra.has_value());
    REQUIRE(rb.has_value());
    bad = 0;
    for (const auto* l : {&a, &b})
      for (const block& x : *l)
        bad += !std::equal(src.begin() + x.local_offset, src.begin() + x.local_offset + x.length,
                           back.begin() + x.local_offset);
    CHECK(bad == 0);
    for (std::size_t len : {std::size_t{5}, std::size_t{40}}) {
      auto r = co_await with_timeout(p.client.read_blocks(back, mr.remote(), std::span(a).first(len)), 10s);
      REQUIRE(r.has_value());
      CHECK(r->has_value());
    }
    CHECK(p.client.is_open());
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks: a bad block is refused with its index before anything is posted") {
  bool reg = false;
  SUBCASE("local memory not registered") { reg = false; }
  SUBCASE("local memory registered") { reg = true; }
  io_context ctx;
  ctx.run([reg]() -> task<void> {
    local_registration lr;
    pair_t p;
    co_await make_pair(p);
    auto src = pattern(8192, 6);
    std::vector<std::byte> target(4096, std::byte{0x5A});
    auto mr = p.server_domain->register_memory(target, access::all).value();
    lr.add(*p.client_domain, src, reg);
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < 50; ++i) blocks.push_back({i * 64, i * 64, 32});
    const auto stats = block_transfer_stats();
    auto with = [&](std::size_t i, block b) {
      auto v = blocks;
      v[i] = b;
      return v;
    };
    auto past_remote = with(37, {0, 4096 - 16, 32});
    auto r = co_await p.client.write_blocks(src, mr.remote(), past_remote);
    CHECK(r.error() == std::errc::result_out_of_range);
    CHECK(r.failed_block() == 37);
    auto past_local = with(12, {8192 - 8, 0, 32});
    r = co_await p.client.write_blocks(src, mr.remote(), past_local);
    CHECK(r.error() == std::errc::result_out_of_range);
    CHECK(r.failed_block() == 12);
    auto wrapping = with(49, {0, UINT64_MAX - 8, 32});
    std::vector<std::byte> back(8192);
    lr.add(*p.client_domain, back, reg);
    r = co_await p.client.read_blocks(back, mr.remote(), wrapping);
    CHECK(r.error() == std::errc::result_out_of_range);
    CHECK(r.failed_block() == 49);
    auto empty = with(3, {0, 0, 0});
    r = co_await p.client.write_blocks(src, mr.remote(), empty);
    CHECK(r.error() == std::errc::invalid_argument);
    CHECK(r.failed_block() == 3);
    // Nothing was posted, nothing touched, the connection is fine.
    CHECK(block_transfer_stats().operations == stats.operations);
    CHECK(all_equal(target, std::byte{0x5A}));
    CHECK(all_equal(back, std::byte{0}));
    CHECK(p.client.is_open());
    CHECK((co_await p.client.write_blocks(src, mr.remote(), blocks)).has_value());
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks: a block the target refuses fails the list; earlier blocks done, later not") {
  bool bad_key = false, reg = false;
  SUBCASE("past the registration") { bad_key = false; }
  SUBCASE("another key") { bad_key = true; }
  SUBCASE("past the registration, local memory registered") { reg = true; }
  SUBCASE("another key, local memory registered") { bad_key = reg = true; }
  io_context ctx;
  ctx.run([bad_key, reg]() -> task<void> {
    local_registration lr;
    pair_t p;
    co_await make_pair(p);
    std::vector<std::byte> mem(3 * 4096, std::byte{0x5A});
    std::span<std::byte> region(mem.data() + 4096, 4096);
    auto mr = p.server_domain->register_memory(region, access::all).value();
    auto src = pattern(16 * 4096, 7);
    lr.add(*p.client_domain, src, reg);
    // A descriptor that claims more than was registered (or another key):
    // the local checks pass, the target refuses. 40 blocks of 128 bytes,
    // 256 apart: blocks 16.. lie past the registration's 4 KiB.
    remote_buffer lying = mr.remote();
    lying.length = 16 * 4096;
    if (bad_key) lying.rkey ^= 0x8000u;
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < 40; ++i) blocks.push_back({i * 256, i * 256, 128});
    auto r = co_await p.client.write_blocks(src, lying, blocks);
    REQUIRE_FALSE(r.has_value());  // never a partial success
    CHECK(matches(r.error(), errc::remote_access_error));
    const std::size_t first_bad = bad_key ? 0 : 16;
    CHECK(r.failed_block() == first_bad);  // verbs: the failed WR's own completion (each WR has its wr_id)
    // Blocks before the bad one are there; nothing after it, nothing
    // around the region.
    for (std::size_t i = 0; i < 16; ++i) {
      auto got = std::span(region).subspan(i * 256, 128);
      if (i < first_bad)
        CHECK(std::equal(got.begin(), got.end(), src.begin() + i * 256));
      else
        CHECK(all_equal(got, std::byte{0x5A}));
    }
    CHECK(all_equal(std::span(mem).first(4096), std::byte{0x5A}));
    CHECK(all_equal(std::span(mem).last(4096), std::byte{0x5A}));
    // RC: the connection failed; a later list fails at its first block.
    CHECK_FALSE(p.client.is_open());
    auto again = co_await p.client.write_blocks(src, mr.remote(), std::span(blocks).first(2));
    CHECK(is_error(again.error(), errc::disconnected));
    CHECK(again.failed_block() == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks: cancelled in flight, the list resumes only when its buffers are safe") {
  bool reg = false;
  SUBCASE("local memory not registered") { reg = false; }
  SUBCASE("local memory registered") { reg = true; }
  io_context ctx;
  ctx.run([reg]() -> task<void> {
    local_registration lr;
    pair_t p;
    co_await make_pair(p);
    constexpr std::size_t n = 8192, size = 4096;
    std::vector<std::byte> target(2 * n * size);
    auto mr = p.server_domain->register_memory(target, access::all).value();
    auto local = std::make_unique<std::vector<std::byte>>(2 * n * size);
    lr.add(*p.client_domain, *local, reg);
    auto blocks = scattered(n, size, 9);
    async_scope scope;
    std::optional<block_result> out;
    auto reader = [](connection& c, std::span<std::byte> local, remote_buffer rb, std::span<const block> blocks,
                     std::optional<block_result>& out) -> task<void> {
      out.emplace(co_await c.read_blocks(local, rb, blocks));
    };
    scope.spawn(reader(p.client, *local, mr.remote(), blocks, out));
    scope.request_stop();
    co_await scope.join();
    REQUIRE(out.has_value());
    CHECK((out->has_value() || out->error() == std::errc::operation_canceled));
    MESSAGE("cancelled: " << !out->has_value());
    if (!out->has_value()) {
      lr.regions.clear();
      local.reset();  // nothing writes it any more
      (void)co_await sleep_for(20ms);
      CHECK_FALSE(p.client.is_open());  // part of it was posted: RC has no partial undo
      std::vector<std::byte> b(8);
      auto r = co_await p.client.read(b, mr.remote(0, 8));
      CHECK(is_error(r.error(), errc::disconnected));
    }
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks: a connection without a provider fails at block 0") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection none;
    std::vector<std::byte> buf(64);
    std::vector<block> blocks{{0, 0, 64}};
    auto r = co_await none.write_blocks(buf, remote_buffer{1, 1, 64}, blocks);
    CHECK(is_error(r.error(), errc::disconnected));
    CHECK(r.failed_block() == 0);
  }());
}

// ------------------------------------------- the tcp engine's WRITE_LIST

namespace {
bool tcp_engine(const connection& c) {
  return c.kind() == transport_kind::tcp || c.kind() == transport_kind::local;
}
// A single write, done: the peer's announcement (its first frame) has been
// read by then, so the next list may use WRITE_LIST.
task<void> round_trip(pair_t& p, const memory_region& mr) {
  std::array<std::byte, 8> b{};
  REQUIRE((co_await p.client.write(b, mr.remote(0, 8))).has_value());
}
}  // namespace

TEST_CASE("blocks (tcp engine): lists travel as WRITE_LIST/READ_LIST frames; a peer that did not announce them gets single ones") {
  bool old_peer = false;
  SUBCASE("both announce") { old_peer = false; }
  SUBCASE("a peer without WRITE_LIST") { old_peer = true; }
  io_context ctx;
  ctx.run([old_peer]() -> task<void> {
    // Connections set up now behave as peers from before the frame.
    detail::tcp_announce_write_list(!old_peer);
    pair_t p;
    connection_options deep;
    deep.send_queue_depth = 1024;  // the whole list in one chunk: frames of max_list_entries
    co_await make_pair(p, deep);
    detail::tcp_announce_write_list(true);
    if (!tcp_engine(p.client)) {
      MESSAGE("not the tcp engine: nothing to check");
      co_await close_pair(p);
      co_return;
    }
    constexpr std::size_t n = 1000, size = 4096;
    auto src = pattern(2 * n * size, 21);
    std::vector<std::byte> target(2 * n * size, std::byte{0x5A});
    auto mr = p.server_domain->register_memory(target, access::all).value();
    co_await round_trip(p, mr);
    auto blocks = scattered(n, size, 22);
    const auto before = detail::tcp_list_frames();
    auto [w, m] = co_await when_all(p.client.write_blocks(src, mr.remote(), blocks, {.notify = 5u}), p.server.recv());
    REQUIRE(w.has_value());
    REQUIRE(m.has_value());
    CHECK(m->imm() == std::optional<std::uint32_t>(5u));
    const auto after = detail::tcp_list_frames();
    // 999 WRITEs (the last block is the WRITE_WITH_IMM): ceil(999 / 256) frames.
    const std::uint64_t frames = old_peer ? 0 : (n - 1 + tcp_wire::max_list_entries - 1) / tcp_wire::max_list_entries;
    CHECK(after.sent - before.sent == frames);
    CHECK(after.received - before.received == frames);  // both ends are in this process
    std::size_t bad = 0;
    for (const block& b : blocks) {
      bad += !std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                         target.begin() + b.remote_offset);
      bad += !all_equal(std::span(target).subspan(b.remote_offset + size, size), std::byte{0x5A});
    }
    CHECK(bad == 0);
    // Read back: READ_LIST frames (as many as the peer's responder units
    // let a chunk hold: at least ceil(1000 / 256), far fewer than 1000).
    std::vector<std::byte> back(2 * n * size, std::byte{0});
    const auto rbefore = detail::tcp_list_frames();
    auto r = co_await p.client.read_blocks(back, mr.remote(), blocks);
    REQUIRE(r.has_value());
    const auto rframes = detail::tcp_list_frames().received - rbefore.received;
    if (old_peer) {
      CHECK(rframes == 0);
    } else {
      CHECK(rframes >= (n + tcp_wire::max_list_entries - 1) / tcp_wire::max_list_entries);
      CHECK(rframes <= n / 8);
    }
    bad = 0;
    for (const block& b : blocks)
      bad += !std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                         back.begin() + b.local_offset);
    CHECK(bad == 0);
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks (tcp engine): a WRITE_LIST refused at one descriptor names its block; earlier ones done") {
  // 600 blocks of 64 bytes, 128 apart, in three frames; the registration
  // ends inside block 300 (the second frame's 45th descriptor), which the
  // initiator's local checks pass (the remote_buffer claims more).
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    if (!tcp_engine(p.client)) {
      co_await close_pair(p);
      co_return;
    }
    constexpr std::size_t n = 600, first_bad = 300;
    std::vector<std::byte> mem(n * 128 + 4096, std::byte{0x5A});
    std::span<std::byte> region(mem.data(), first_bad * 128 + 32);
    auto mr = p.server_domain->register_memory(region, access::all).value();
    co_await round_trip(p, mr);
    std::fill(mem.begin(), mem.begin() + 8, std::byte{0x5A});
    auto src = pattern(n * 128, 23);
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < n; ++i) blocks.push_back({i * 128, i * 128, 64});
    remote_buffer lying = mr.remote();
    lying.length = n * 128;
    const auto before = detail::tcp_list_frames();
    auto r = co_await p.client.write_blocks(src, lying, blocks);
    REQUIRE_FALSE(r.has_value());
    CHECK(matches(r.error(), errc::remote_access_error));
    CHECK(r.failed_block() == first_bad);
    CHECK(detail::tcp_list_frames().received - before.received >= 2);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      auto got = std::span(mem).subspan(i * 128, 64);
      bad += i < first_bad ? !std::equal(got.begin(), got.end(), src.begin() + i * 128) : !all_equal(got, std::byte{0x5A});
      bad += !all_equal(std::span(mem).subspan(i * 128 + 64, 64), std::byte{0x5A});
    }
    CHECK(bad == 0);
    CHECK_FALSE(p.client.is_open());
    co_await close_pair(p);
  }());
}

TEST_CASE("blocks (tcp engine): a READ_LIST refused at one descriptor names its block; earlier ones read") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    pair_t p;
    co_await make_pair(p);
    if (!tcp_engine(p.client)) {
      co_await close_pair(p);
      co_return;
    }
    constexpr std::size_t n = 200, first_bad = 150;
    auto mem = pattern(n * 128, 24);
    std::span<std::byte> region(mem.data(), first_bad * 128 + 32);
    auto mr = p.server_domain->register_memory(region, access::all).value();
    co_await round_trip(p, mr);
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < n; ++i) blocks.push_back({i * 128, i * 128, 64});
    remote_buffer lying = mr.remote();
    lying.length = n * 128;
    std::vector<std::byte> back(n * 128, std::byte{0x5A});
    const auto before = detail::tcp_list_frames();
    auto r = co_await p.client.read_blocks(back, lying, blocks);
    REQUIRE_FALSE(r.has_value());
    CHECK(matches(r.error(), errc::remote_access_error));
    CHECK(r.failed_block() == first_bad);
    CHECK(detail::tcp_list_frames().received - before.received >= 1);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      auto got = std::span(back).subspan(i * 128, 64);
      // Blocks before the refused one are read; later ones may not be (the
      // error fails the connection), but none is written with wrong bytes.
      if (i < first_bad) bad += !std::equal(got.begin(), got.end(), mem.begin() + i * 128);
      else bad += !all_equal(got, std::byte{0x5A});
    }
    CHECK(bad == 0);
    CHECK_FALSE(p.client.is_open());
    co_await close_pair(p);
  }());
}

// A READ_LIST takes one of the peer's responder units, as one READ does:
// a read list of 1,000 blocks, far more than the peer's 128 units, goes as
// frames of a quarter of the send queue (256 descriptors here), all in
// flight at once; refused at its first, a middle or its last block, it
// names that block, the blocks before it are read, none after it is
// written; and the units come back (a second list and 300 atomics, each
// holding a unit, complete after it).
TEST_CASE("blocks (tcp engine): a read list past the peer's responder units; refused first, middle, last") {
  std::size_t first_bad = 0;
  SUBCASE("none") { first_bad = 1000; }
  SUBCASE("first") { first_bad = 0; }
  SUBCASE("middle") { first_bad = 600; }
  SUBCASE("last") { first_bad = 999; }
  io_context ctx;
  ctx.run([first_bad]() -> task<void> {
    pair_t p;
    connection_options o;
    o.send_queue_depth = 1024;
    co_await make_pair(p, o);
    if (!tcp_engine(p.client)) {
      co_await close_pair(p);
      co_return;
    }
    constexpr std::size_t n = 1000, size = 256, stride = 512;
    auto mem = pattern(n * stride + 4096, 31);
    auto mr = p.server_domain->register_memory(std::span(mem).first(n * stride), access::all).value();
    co_await round_trip(p, mr);
    std::vector<block> blocks = scattered(n, size, 5);
    if (first_bad < n) blocks[first_bad].remote_offset = n * stride + 1024;  // past the registration
    remote_buffer lying = mr.remote();
    lying.length = n * stride + 4096;
    std::vector<std::byte> back(n * stride, std::byte{0x5A});
    const auto before = detail::tcp_list_frames();
    auto r = co_await with_timeout(p.client.read_blocks(back, lying, blocks), 20s);
    REQUIRE(r.has_value());  // (the timeout's result)
    std::size_t bad = 0;
    const std::size_t good = std::min(first_bad, n);
    for (std::size_t i = 0; i < n; ++i) {
      auto got = std::span(back).subspan(blocks[i].local_offset, size);
      if (i < good)
        bad += !std::equal(got.begin(), got.end(), mem.begin() + static_cast<std::ptrdiff_t>(blocks[i].remote_offset));
      else
        bad += !all_equal(got, std::byte{0x5A});
    }
    CHECK(bad == 0);
    if (first_bad < n) {
      REQUIRE_FALSE(r->has_value());
      CHECK(matches(r->error(), errc::remote_access_error));
      CHECK(r->failed_block() == first_bad);
      CHECK_FALSE(p.client.is_open());
      co_await close_pair(p);
      co_return;
    }
    REQUIRE(r->has_value());
    CHECK(detail::tcp_list_frames().sent - before.sent == 4);  // 1000 = 256 + 256 + 256 + 232
    auto again = co_await with_timeout(p.client.read_blocks(back, mr.remote(), blocks), 20s);
    REQUIRE(again.has_value());
    CHECK(again->has_value());
    auto word = mr.remote(0, 8);
    for (int i = 0; i < 300; ++i) {
      auto f = co_await with_timeout(p.client.fetch_and_add(word, 1), 20s);
      REQUIRE(f.has_value());
    }
    CHECK(p.client.is_open());
    co_await close_pair(p);
  }());
}

// ---------------------------------------------------------------- striping

namespace {
// Two rails from one client domain to one server: group (client side) and
// the server's connections.
struct rails_t {
  std::optional<domain> sd, cd;
  listener l;
  std::vector<connection> server;
  connection_group group;
};
task<void> make_rails(rails_t& r, std::size_t n) {
  r.sd.emplace(domain::open().value());
  r.cd.emplace(domain::open().value());
  r.l = r.sd->listen(test_endpoint(0)).value();
  auto ep = test_endpoint(r.l.local_endpoint()->port());
  std::vector<connection> client;
  for (std::size_t i = 0; i < n; ++i) {
    auto [s, c] = co_await when_all(accept_within_limit(r.l), r.cd->connect(ep));
    r.server.push_back(std::move(s).value());
    client.push_back(std::move(c).value());
  }
  r.group = connection_group(std::move(client));
}
task<void> close_rails(rails_t& r) {
  (void)co_await r.group.close();
  for (auto& c : r.server) (void)co_await c.close();
  r.l.close();
}
}  // namespace

TEST_CASE("striping: a list and a contiguous transfer split over two rails, every byte checked") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    rails_t r;
    co_await make_rails(r, 2);
    constexpr std::size_t n = 10000, size = 200;
    auto src = pattern(2 * n * size, 21);
    std::vector<std::byte> target(2 * n * size, std::byte{0x5A});
    auto mr = r.sd->register_memory(target, access::all).value();
    auto blocks = scattered(n, size, 5);
    const auto before = block_transfer_stats();
    auto [w, m] = co_await when_all(r.group.write_blocks(src, mr.remote(), blocks, {.notify = 9u}), r.server[0].recv());
    REQUIRE(w.has_value());
    CHECK(block_transfer_stats().lists - before.lists == 2);  // both rails took a part
    CHECK(block_transfer_stats().blocks - before.blocks == n);
    REQUIRE(m.has_value());
    CHECK(m->imm() == std::optional<std::uint32_t>(9u));
    std::size_t bad = 0;
    for (const block& b : blocks)
      bad += !std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                         target.begin() + b.remote_offset);
    CHECK(bad == 0);
    CHECK(r.group.in_flight(0) == 0);
    CHECK(r.group.in_flight(1) == 0);
    // One contiguous transfer, both ways.
    auto big = pattern(3 << 20, 22);
    REQUIRE((co_await r.group.write(big, mr.remote())).has_value());
    CHECK(std::equal(big.begin(), big.end(), target.begin()));
    std::vector<std::byte> back(big.size());
    REQUIRE((co_await r.group.read(back, mr.remote())).has_value());
    CHECK(back == big);
    CHECK((co_await r.group.write(big, mr.remote(0, 100))).error() == std::errc::result_out_of_range);
    co_await close_rails(r);
  }());
}

TEST_CASE("striping: a failed rail fails the transfer; the other rail's part is done") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    rails_t r;
    co_await make_rails(r, 2);
    constexpr std::size_t n = 1000, size = 256;
    auto src = pattern(2 * n * size, 23);
    std::vector<std::byte> target(2 * n * size, std::byte{0x5A});
    auto mr = r.sd->register_memory(target, access::all).value();
    std::vector<block> blocks;
    for (std::uint64_t i = 0; i < n; ++i) blocks.push_back({i * 2 * size, i * 2 * size, size});
    // Rail 1 fails: its peer goes away.
    r.server[1] = connection{};
    auto w = co_await r.group.write_blocks(src, mr.remote(), blocks);
    REQUIRE_FALSE(w.has_value());
    CHECK(matches(w.error(), errc::disconnected));
    // Equal blocks: rail 1 had the second half.
    if (r.group.rail(1).kind() != transport_kind::verbs || w.failed_block() != block_result::unknown)
      CHECK(w.failed_block() == n / 2);
    for (std::size_t i = 0; i < n / 2; ++i)
      CHECK(std::equal(src.begin() + blocks[i].local_offset, src.begin() + blocks[i].local_offset + size,
                       target.begin() + blocks[i].remote_offset));
    CHECK_FALSE(r.group.rail(1).is_open());
    CHECK(r.group.rail(0).is_open());
    co_await close_rails(r);
  }());
}

TEST_CASE("striping: an empty group fails at block 0") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    connection_group g;
    std::vector<std::byte> buf(64);
    std::vector<block> blocks{{0, 0, 64}};
    auto r = co_await g.write_blocks(buf, remote_buffer{1, 1, 64}, blocks);
    CHECK(is_error(r.error(), errc::disconnected));
    CHECK(r.failed_block() == 0);
  }());
}

namespace {
// One rail's objects on one side, made, used and destroyed on that side's
// loop thread (a runtime's), as the threading rules ask.
struct rail_side {
  std::optional<domain> d;
  std::optional<memory_region> mr;
  listener l;
  connection c;
};
// Runs `t` on `loop`'s thread, then comes back.
template <class T>
task<T> on_loop(io_context& loop, task<T> t) {
  io_context& home = io_context::current();
  co_await loop.schedule();
  T v = co_await std::move(t);
  co_await home.schedule();
  co_return v;
}
task<std::uint16_t> serve_rail(rail_side& s, std::span<std::byte> target) {
  s.d.emplace(domain::open().value());
  s.mr.emplace(s.d->register_memory(target, access::all).value());
  s.l = s.d->listen(test_endpoint(0)).value();
  co_return s.l.local_endpoint()->port();
}
task<bool> accept_rail(rail_side& s) {
  auto c = co_await accept_within_limit(s.l);
  if (c) s.c = std::move(*c);
  co_return c.has_value();
}
task<bool> connect_rail(rail_side& s, std::uint16_t port) {
  s.d.emplace(domain::open().value());
  auto c = co_await s.d->connect(test_endpoint(port));
  if (c) s.c = std::move(*c);
  co_return c.has_value();
}
task<std::uint32_t> recv_imm(rail_side& s) {  // the message stays on its thread
  auto m = co_await s.c.recv();
  co_return m && m->imm() ? *m->imm() : 0;
}
task<bool> drop_rail(rail_side& s) {  // an abort, as a peer that goes away
  s.c = connection{};
  s.l.close();
  s.mr.reset();
  s.d.reset();
  co_return true;
}
}  // namespace

TEST_CASE("striping: rails on loops of their own, a remote per rail, every byte checked; a failed rail fails it") {
  runtime rt(4);  // the group's rails on threads 0 and 1, their peers on 2 and 3
  io_context ctx;
  ctx.run([&]() -> task<void> {
    constexpr std::size_t rails = 2, n = 4000, size = 200;
    auto src = pattern(2 * n * size, 31);
    std::vector<std::byte> target(2 * n * size, std::byte{0x5A});
    std::array<rail_side, rails> srv, cli;
    std::vector<remote_buffer> remotes;
    std::vector<connection> conns;
    std::vector<io_context*> loops;
    for (std::size_t r = 0; r < rails; ++r) {
      io_context &sl = rt.context(2 + r), &cl = rt.context(r);
      const std::uint16_t port = co_await on_loop(sl, serve_rail(srv[r], target));
      auto [a, c] = co_await when_all(on_loop(sl, accept_rail(srv[r])), on_loop(cl, connect_rail(cli[r], port)));
      REQUIRE(a);
      REQUIRE(c);
      remotes.push_back(srv[r].mr->remote());
      conns.push_back(std::move(cli[r].c));
      loops.push_back(&cl);
    }
    connection_group g(std::move(conns), loops);
    CHECK(g.loop(1) == &rt.context(1));
    auto blocks = scattered(n, size, 7);
    const auto before = block_transfer_stats();
    auto [w, imm] = co_await when_all(g.write_blocks(src, remotes, blocks, {.notify = 5u}),
                                      on_loop(rt.context(2), recv_imm(srv[0])));
    REQUIRE(w.has_value());
    CHECK(imm == 5u);  // after every block of both rails
    // The parts ran on the rails' threads: none on this one.
    CHECK(block_transfer_stats().lists == before.lists);
    std::size_t bad = 0;
    for (const block& b : blocks)
      bad += !std::equal(src.begin() + b.local_offset, src.begin() + b.local_offset + b.length,
                         target.begin() + b.remote_offset);
    CHECK(bad == 0);
    auto big = pattern(1 << 20, 32);
    REQUIRE((co_await g.write(big, remotes)).has_value());
    CHECK(std::equal(big.begin(), big.end(), target.begin()));
    std::vector<std::byte> back(big.size());
    REQUIRE((co_await g.read(back, remotes)).has_value());
    CHECK(back == big);
    // One remote per rail or one for all: another count is refused.
    auto three = std::vector<remote_buffer>{remotes[0], remotes[1], remotes[1]};
    auto wrong = co_await g.write_blocks(src, three, blocks);
    CHECK(wrong.error() == std::errc::invalid_argument);
    CHECK(wrong.failed_block() == 0);
    // Rail 1's peer goes away (on its own thread): the transfer fails at
    // rail 1's first block; rail 0's part is done.
    co_await on_loop(rt.context(3), drop_rail(srv[1]));
    std::vector<block> even;
    for (std::uint64_t i = 0; i < 1000; ++i) even.push_back({i * 2 * size, i * 2 * size, size});
    std::fill(target.begin(), target.end(), std::byte{0});
    auto f = co_await g.write_blocks(src, remotes, even);
    REQUIRE_FALSE(f.has_value());
    CHECK(matches(f.error(), errc::disconnected));
    if (g.rail(1).kind() != transport_kind::verbs || f.failed_block() != block_result::unknown)
      CHECK(f.failed_block() == 500);
    bad = 0;
    for (std::size_t i = 0; i < 500; ++i)
      bad += !std::equal(src.begin() + even[i].local_offset, src.begin() + even[i].local_offset + size,
                         target.begin() + even[i].remote_offset);
    CHECK(bad == 0);
    (void)co_await g.close();
    g = connection_group{};  // the rails go back to their loops, destroyed there
    for (std::size_t r = 0; r < rails; ++r) {
      co_await on_loop(rt.context(2 + r), drop_rail(srv[r]));
      co_await on_loop(rt.context(r), drop_rail(cli[r]));
    }
  }());
}

int main(int argc, char** argv) {
  const char* sel = std::getenv("SHUTTLE_TRANSPORT");
  {
    io_context ctx;
    auto d = domain::open();
    if (!d) {
      std::printf("SKIP: transport provider '%s' is not available: %s\n", sel ? sel : "auto",
                  d.error().message().c_str());
      return d.error() == make_error_code(errc::not_supported) ? 77 : 1;
    }
    std::printf("block transfers: provider %s (%s)\n", to_string(d->kind()), d->describe().c_str());
  }
  doctest::Context context(argc, argv);
  return context.run();
}
