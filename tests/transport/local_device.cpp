// GPU memory on the local provider, without a GPU (issue 30, point 2): the
// provider's device hooks (lib/local_provider/device_hooks.hpp) replaced by
// fakes, so that CI runs its logic. "Device memory" here is a PROT_NONE
// mapping that only the fake copy opens (mprotect around its memcpy): a CPU
// access by the engine (the socket path) would fault, so a passing test
// shows GPU memory never went through the socket. The fake copy completes
// a little later on the loop, as a GPU copy would, so that RC order against
// what follows it is tested too. The real hooks, on a GPU, two processes:
// tests/gpu/test_local.cpp.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "local_common.hpp"
#include "device_hooks.hpp"
#include "local_wire.hpp"
#include "stats.hpp"

#include <shuttle/local.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>

using namespace shuttle;
using namespace transport_test;
using namespace std::chrono_literals;
namespace lp = shuttle::detail::local_provider;

namespace {

// Fake device memory: PROT_NONE pages, opened only by fake_copy and peek/poke.
struct fake_gpu {
  static inline std::map<std::uintptr_t, std::size_t> blocks;  // base -> size
  static inline int imports = 0, queues_open = 0, copies = 0, is_device_calls = 0;
  static inline bool refuse_import = false, refuse_export = false;
  static inline bool fd_mode = false;  // as cuMemCreate memory: no IPC handle, a POSIX fd
  static inline int fd_imports = 0;
  static inline std::vector<std::pair<std::uintptr_t, std::size_t>> enabled;  // ranges made RW for a copy

  static std::byte* alloc(std::size_t n) {
    void* p = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    blocks[reinterpret_cast<std::uintptr_t>(p)] = n;
    return static_cast<std::byte*>(p);
  }
  static void free(std::byte* p) {
    auto n = blocks.at(reinterpret_cast<std::uintptr_t>(p));
    ::munmap(p, n);
    blocks.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  static const std::pair<const std::uintptr_t, std::size_t>* find(const void* p) {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return nullptr;
    --it;
    return a - it->first < it->second ? &*it : nullptr;
  }
  static void open(const void* p, bool rw) {
    if (auto b = find(p)) ::mprotect(reinterpret_cast<void*>(b->first), b->second, rw ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
  static void poke(std::byte* dst, std::span<const std::byte> src) {
    open(dst, true);
    std::memcpy(dst, src.data(), src.size());
    open(dst, false);
  }
  static std::vector<std::byte> peek(const std::byte* p, std::size_t n) {
    open(p, true);
    std::vector<std::byte> v(p, p + n);
    open(p, false);
    return v;
  }

  static bool is_device(const void* p, std::size_t) noexcept {
    ++is_device_calls;
    return find(p) != nullptr;
  }
  static result<std::uint64_t> export_handle(const void* p, std::size_t, lp::gpu_handle& out) noexcept {
    auto b = find(p);
    if (!b || refuse_export || fd_mode) return make_error_code(errc::not_supported);
    out.fill(std::byte{0});
    std::memcpy(out.data(), "FAKEGPU", 7);
    std::memcpy(out.data() + 8, &b->first, 8);
    return reinterpret_cast<std::uintptr_t>(p) - b->first;
  }
  static result<lp::device_hooks::imported> import_handle(const lp::gpu_handle& h) noexcept {
    if (refuse_import || std::memcmp(h.data(), "FAKEGPU", 7) != 0) return make_error_code(errc::not_supported);
    std::uintptr_t base = 0;
    std::memcpy(&base, h.data() + 8, 8);
    auto it = blocks.find(base);
    if (it == blocks.end()) return make_error_code(errc::not_supported);
    ++imports;
    return lp::device_hooks::imported{reinterpret_cast<std::byte*>(base), it->second};
  }
  // The fd: a memfd holding the block's base (the same process maps it back).
  static result<std::uint64_t> export_fd(const void* p, std::size_t, int* fd, std::uint64_t* size) noexcept {
    auto b = find(p);
    if (!b || refuse_export || !fd_mode) return make_error_code(errc::not_supported);
    int f = ::memfd_create("fake-gpu-fd", MFD_CLOEXEC);
    if (f < 0 || ::pwrite(f, &b->first, 8, 0) != 8) return make_error_code(errc::not_supported);
    *fd = f;
    *size = b->second;
    return reinterpret_cast<std::uintptr_t>(p) - b->first;
  }
  static result<lp::device_hooks::imported> import_fd(int fd, std::uint64_t size) noexcept {
    std::uintptr_t base = 0;
    if (refuse_import || ::pread(fd, &base, 8, 0) != 8) return make_error_code(errc::remote_access_error);
    auto it = blocks.find(base);
    if (it == blocks.end() || it->second != size) return make_error_code(errc::remote_access_error);
    ++fd_imports;
    return lp::device_hooks::imported{reinterpret_cast<std::byte*>(base), it->second};
  }
  static void release_import(std::byte* b) noexcept {
    // (An fd import of a block, or a handle import: the fake tells them apart by mode.)
    (void)b;
    if (fd_imports > 0)
      --fd_imports;
    else
      --imports;
  }
  static void* open_queue() noexcept {
    ++queues_open;
    return &queues_open;
  }
  static void close_queue(void*) noexcept { --queues_open; }
  // Done on the loop after a short while, as a GPU copy completes later.
  static task<result<void>> copy_later(void* dst, const void* src, std::size_t n) {
    (void)co_await sleep_for(2ms);
    open(dst, true);
    open(src, true);
    std::memcpy(dst, src, n);
    open(dst, false);
    open(src, false);
    co_return result<void>{};
  }
  static task<result<void>> copy(void*, void* dst, const void* src, std::size_t n) {
    ++copies;
    return copy_later(dst, src, n);
  }
};

const lp::device_hooks fake_hooks{.is_device = &fake_gpu::is_device,
                                  .export_handle = &fake_gpu::export_handle,
                                  .import_handle = &fake_gpu::import_handle,
                                  .export_fd = &fake_gpu::export_fd,
                                  .import_fd = &fake_gpu::import_fd,
                                  .release_import = &fake_gpu::release_import,
                                  .open_queue = &fake_gpu::open_queue,
                                  .close_queue = &fake_gpu::close_queue,
                                  .copy = &fake_gpu::copy};
struct hooks_guard {
  const lp::device_hooks* before = lp::set_device_hooks(&fake_hooks);
  ~hooks_guard() { lp::set_device_hooks(before); }
};

}  // namespace

TEST_CASE("GPU memory (fake hooks): writes and reads in every direction, never through the socket") {
  hooks_guard g;
  constexpr std::size_t n = 1 << 20;
  std::byte* peer_gpu = fake_gpu::alloc(n);
  std::byte* my_gpu = fake_gpu::alloc(n);
  const int copies_before = fake_gpu::copies;
  {
    io_context ctx;
    ctx.run([](std::byte* peer_gpu, std::byte* my_gpu) -> task<void> {
      lpair p;
      co_await make_lpair(p);
      auto host_block = shared_memory::allocate(n).value();
      auto mr_gpu = p.sd->register_memory({peer_gpu, n}, access::all).value();
      auto mr_host = p.sd->register_memory(host_block.span(), access::all).value();
      const auto before = detail::local_gpu_copies();
      // host -> GPU, at several sizes and an offset; the bytes around untouched.
      for (std::size_t len : {std::size_t(1), std::size_t(8), std::size_t(4097), n}) {
        fake_gpu::poke(peer_gpu, std::vector<std::byte>(n, std::byte{0xEE}));
        auto data = pattern(len, static_cast<unsigned>(len));
        REQUIRE((co_await p.client.write(data, mr_gpu.remote(0, len))).has_value());
        auto got = fake_gpu::peek(peer_gpu, n);
        CHECK(std::memcmp(got.data(), data.data(), len) == 0);
        if (len < n) CHECK(got[len] == std::byte{0xEE});
      }
      auto mid = pattern(100, 3);
      REQUIRE((co_await p.client.write(mid, mr_gpu.remote(5000, 100))).has_value());
      auto got = fake_gpu::peek(peer_gpu, n);
      CHECK(std::memcmp(got.data() + 5000, mid.data(), 100) == 0);
      CHECK(got[4999] != mid[0]);
      // GPU -> GPU, and GPU -> host (the peer's shared block).
      auto src = pattern(n, 11);
      fake_gpu::poke(my_gpu, src);
      REQUIRE((co_await p.client.write({my_gpu, n}, mr_gpu.remote())).has_value());
      CHECK(fake_gpu::peek(peer_gpu, n) == src);
      REQUIRE((co_await p.client.write({my_gpu, n}, mr_host.remote())).has_value());
      CHECK(std::memcmp(host_block.data(), src.data(), n) == 0);
      // Reads: GPU -> host, GPU -> GPU, host (peer) -> GPU.
      auto peer_data = pattern(n, 12);
      fake_gpu::poke(peer_gpu, peer_data);
      std::vector<std::byte> back(n);
      REQUIRE((co_await p.client.read(back, mr_gpu.remote())).has_value());
      CHECK(back == peer_data);
      fake_gpu::poke(my_gpu, std::vector<std::byte>(n));
      REQUIRE((co_await p.client.read({my_gpu, n}, mr_gpu.remote())).has_value());
      CHECK(fake_gpu::peek(my_gpu, n) == peer_data);
      std::memcpy(host_block.data(), src.data(), n);
      REQUIRE((co_await p.client.read({my_gpu, 4096}, mr_host.remote(0, 4096))).has_value());
      CHECK(fake_gpu::peek(my_gpu, 4096) == std::vector<std::byte>(src.begin(), src.begin() + 4096));
      // Every one of them a copy (4 + 1 + 2 writes, 3 reads).
      CHECK(detail::local_gpu_copies() - before == 10);
      CHECK(fake_gpu::imports == 1);  // one handle, imported once
      co_await close_lpair(p);
    }(peer_gpu, my_gpu));
  }
  CHECK(fake_gpu::copies - copies_before == 10);
  // Everything imported released, every queue closed, at teardown.
  CHECK(fake_gpu::imports == 0);
  CHECK(fake_gpu::queues_open == 0);
  fake_gpu::free(peer_gpu);
  fake_gpu::free(my_gpu);
}

TEST_CASE("GPU memory (fake hooks): a send after a write without waiting is seen after the data (RC order)") {
  hooks_guard g;
  constexpr std::size_t n = 256 << 10;
  std::byte* peer_gpu = fake_gpu::alloc(n);
  {
    io_context ctx;
    ctx.run([](std::byte* peer_gpu) -> task<void> {
      lpair p;
      co_await make_lpair(p);
      auto mr = p.sd->register_memory({peer_gpu, n}, access::all).value();
      for (unsigned round = 0; round < 8; ++round) {
        auto data = pattern(n, round);
        std::array<std::byte, 4> note{std::byte(round)};
        // The write (a copy that completes later) and the send posted
        // together: the server sees the message only once the data is there.
        auto server_side = [](connection& s, std::byte* peer_gpu, std::vector<std::byte> want) -> task<bool> {
          auto m = co_await s.recv();
          co_return m.has_value() && fake_gpu::peek(peer_gpu, want.size()) == want;
        };
        auto [w, sn, ok] = co_await when_all(p.client.write(data, mr.remote()), p.client.send(note),
                                             server_side(p.server, peer_gpu, data));
        CHECK(w.has_value());
        CHECK(sn.has_value());
        CHECK(ok);
      }
      co_await close_lpair(p);
    }(peer_gpu));
  }
  fake_gpu::free(peer_gpu);
}

TEST_CASE("GPU memory (fake hooks): bad rkey, out of bounds, deregistered, atomics, batches, a failed import") {
  hooks_guard g;
  constexpr std::size_t n = 64 << 10;
  std::byte* peer_gpu = fake_gpu::alloc(n);
  std::byte* my_gpu = fake_gpu::alloc(n);
  {
    io_context ctx;
    ctx.run([](std::byte* peer_gpu, std::byte* my_gpu) -> task<void> {
      lpair p;
      co_await make_lpair(p);
      fake_gpu::poke(peer_gpu, std::vector<std::byte>(n, std::byte{0x5A}));
      fake_gpu::poke(my_gpu, pattern(n, 9));
      auto mr = p.sd->register_memory({peer_gpu, n}, access::all).value();
      // GPU memory has no engine region: no grant on it.
      CHECK((co_await p.server.grant(mr, 0, 64, access::remote_write)).error() == make_error_code(errc::not_supported));
      // A GPU source to a key the peer does not share: it cannot go through the socket.
      auto bad = mr.remote();
      bad.rkey ^= 0x5a5a5a5a;
      auto r = co_await p.client.write({my_gpu, 64}, bad);
      CHECK(r.error() == make_error_code(errc::unregistered_device_memory));
      // Out of bounds of the GPU region: refused here, the connection stays.
      r = co_await p.client.write({my_gpu, 128}, remote_buffer{mr.remote().address + n - 64, mr.rkey(), 128});
      CHECK(r.error() == make_error_code(errc::remote_access_error));
      r = co_await p.client.read({my_gpu, 8}, remote_buffer{mr.remote().address - 8, mr.rkey(), 8});
      CHECK(r.error() == make_error_code(errc::remote_access_error));
      CHECK(fake_gpu::peek(peer_gpu, n) == std::vector<std::byte>(n, std::byte{0x5A}));  // untouched
      CHECK(p.client.is_open());
      // Atomics on GPU memory: not supported (no CPU word, no engine region).
      auto f = co_await p.client.fetch_and_add(mr.remote(0, 8), 1);
      CHECK(f.error() == make_error_code(errc::not_supported));
      // GPU memory cannot be sent (a message goes through the socket), nor
      // be the target of write_with_imm (its notification does too).
      auto sn = co_await p.client.send({my_gpu, 64});
      CHECK(sn.error() == make_error_code(errc::unregistered_device_memory));
      auto wi = co_await p.client.write_with_imm({my_gpu, 64}, mr.remote(0, 64), 5);
      CHECK(wi.error() == make_error_code(errc::not_supported));
      CHECK(fake_gpu::peek(peer_gpu, n) == std::vector<std::byte>(n, std::byte{0x5A}));
      // Prepared operations are the engine's: not from GPU memory.
      auto prep = p.client.prepare(operation::write({my_gpu, 64}, mr.remote(0, 64)));
      CHECK(prep.error() == make_error_code(errc::unregistered_device_memory));
      // Still working.
      REQUIRE((co_await p.client.write({my_gpu, 64}, mr.remote(0, 64))).has_value());
      // A region the peer cannot import (a forged or stale handle): its accesses fail.
      fake_gpu::refuse_import = true;
      auto mr2 = p.sd->register_memory({peer_gpu + 4096, 4096}, access::all).value();
      r = co_await p.client.write({my_gpu, 64}, mr2.remote(0, 64));
      fake_gpu::refuse_import = false;
      CHECK(r.error() == make_error_code(errc::remote_access_error));
      // Deregistered: refused from then on.
      auto rb = mr.remote(0, 64);
      mr = memory_region{};
      r = co_await p.client.write({my_gpu, 64}, rb);
      CHECK(r.error() == make_error_code(errc::remote_access_error));
      CHECK(p.client.is_open());
      // A host source to a bad key goes through the socket and is refused
      // there, as on the tcp provider: the connection fails.
      std::vector<std::byte> h(64);
      r = co_await p.client.write(h, bad);
      CHECK(is_error(r.error(), errc::remote_access_error));
      co_await close_lpair(p);
    }(peer_gpu, my_gpu));
  }
  CHECK(fake_gpu::imports == 0);
  fake_gpu::free(peer_gpu);
  fake_gpu::free(my_gpu);
}

TEST_CASE("GPU memory (fake hooks): host memory registered with the domain is not asked about per operation") {
  // The real hooks ask the driver (cuPointerGetAttribute, ~0.6 us); a range
  // inside a live host registration is host memory without asking.
  hooks_guard g;
  io_context ctx;
  ctx.run([]() -> task<void> {
    lpair p;
    co_await make_lpair(p);
    auto block = shared_memory::allocate(1 << 16).value();
    auto mr_peer = p.sd->register_memory(block.span(), access::all).value();
    std::vector<std::byte> mine(8192, std::byte{7});
    auto asked = [n = fake_gpu::is_device_calls]() mutable {
      const int d = fake_gpu::is_device_calls - n;
      n = fake_gpu::is_device_calls;
      return d;
    };
    // Not registered: asked.
    REQUIRE((co_await p.client.write(std::span(mine).first(8), mr_peer.remote(0, 8))).has_value());
    CHECK(asked() > 0);
    {
      auto mr = p.cd->register_memory(std::span(mine).subspan(1024, 4096), access::all).value();
      (void)asked();
      // Inside it, at its edges too: not asked, and the bytes arrive.
      for (std::size_t off : {std::size_t(1024), std::size_t(2000), std::size_t(5120 - 8)}) {
        mine[off] = std::byte(off & 0xff);
        REQUIRE((co_await p.client.write(std::span(mine).subspan(off, 8), mr_peer.remote(64, 8))).has_value());
        CHECK(block.data()[64] == std::byte(off & 0xff));
        REQUIRE((co_await p.client.read(std::span(mine).subspan(off, 8), mr_peer.remote(0, 8))).has_value());
      }
      CHECK(asked() == 0);
      // Running past its end, or starting before it: asked.
      REQUIRE((co_await p.client.write(std::span(mine).subspan(5120 - 8, 16), mr_peer.remote(0, 16))).has_value());
      CHECK(asked() > 0);
      REQUIRE((co_await p.client.write(std::span(mine).subspan(1000, 100), mr_peer.remote(0, 100))).has_value());
      CHECK(asked() > 0);
    }
    // Deregistered: asked again.
    REQUIRE((co_await p.client.write(std::span(mine).subspan(2000, 8), mr_peer.remote(0, 8))).has_value());
    CHECK(asked() > 0);
    // Device memory at an address next to a registration is still found.
    std::byte* gpu = fake_gpu::alloc(4096);
    auto mr_again = p.cd->register_memory(std::span(mine), access::all).value();
    (void)asked();
    CHECK((co_await p.client.write({gpu, 8}, mr_peer.remote(0, 8))).has_value());
    CHECK(asked() > 0);
    fake_gpu::free(gpu);
    co_await close_lpair(p);
  }());
}

TEST_CASE("GPU memory (fake hooks): memory that cannot be exported is refused at registration") {
  hooks_guard g;
  io_context ctx;
  ctx.run([]() -> task<void> {
    auto d = domain::open(local_options()).value();
    std::byte* gpu = fake_gpu::alloc(4096);
    CHECK(d.register_memory({gpu, 4096}, access::all).has_value());
    // (cuMemCreate memory, say): refused with a reason, never registered as host memory.
    fake_gpu::refuse_export = true;
    auto r = d.register_memory({gpu, 2048}, access::all);
    fake_gpu::refuse_export = false;
    CHECK(r.error() == make_error_code(errc::not_supported));
    fake_gpu::free(gpu);
    co_return;
  }());
}

TEST_CASE("GPU memory (fake hooks): batches and block lists with GPU memory run one by one, in order") {
  hooks_guard g;
  constexpr std::size_t n = 256 << 10;
  std::byte* peer_gpu = fake_gpu::alloc(n);
  std::byte* my_gpu = fake_gpu::alloc(n);
  {
    io_context ctx;
    ctx.run([](std::byte* peer_gpu, std::byte* my_gpu) -> task<void> {
      lpair p;
      co_await make_lpair(p);
      auto host_block = shared_memory::allocate(n).value();
      auto mr_gpu = p.sd->register_memory({peer_gpu, n}, access::all).value();
      auto mr_host = p.sd->register_memory(host_block.span(), access::all).value();
      auto src = pattern(n, 21);
      fake_gpu::poke(my_gpu, src);
      fake_gpu::poke(peer_gpu, std::vector<std::byte>(n));
      // GPU -> GPU and GPU -> host in one batch, then a host write.
      std::vector<std::byte> tail = pattern(64, 22);
      std::vector<operation> ops{operation::write({my_gpu, 4096}, mr_gpu.remote(0, 4096)),
                                 operation::write({my_gpu + 4096, 4096}, mr_host.remote(100, 4096)),
                                 operation::write(tail, mr_gpu.remote(8192, 64))};
      REQUIRE((co_await p.client.post_batch(ops)).has_value());
      auto got = fake_gpu::peek(peer_gpu, n);
      CHECK(std::memcmp(got.data(), src.data(), 4096) == 0);
      CHECK(std::memcmp(got.data() + 8192, tail.data(), 64) == 0);
      CHECK(std::memcmp(host_block.data() + 100, src.data() + 4096, 4096) == 0);
      // A block list from GPU memory into the peer's host block, with its
      // notification (the last block's write_with_imm): the message comes
      // after every block is in.
      std::vector<block> blocks;
      for (std::uint64_t b = 0; b < 16; ++b) blocks.push_back({b * 8192, (15 - b) * 8192, 8192});
      std::memset(host_block.data(), 0, n);
      auto recv = [](connection& s) -> task<std::optional<std::uint32_t>> {
        auto m = co_await s.recv();
        if (!m || !m->imm()) co_return std::nullopt;
        co_return *m->imm();
      };
      auto [w, imm] = co_await when_all(
          p.client.write_blocks({my_gpu, n}, mr_host.remote(), blocks, {.notify = 7}), recv(p.server));
      CHECK(w.has_value());
      REQUIRE(imm.has_value());
      CHECK(*imm == 7);
      for (std::uint64_t b = 0; b < 16; ++b)
        CHECK(std::memcmp(host_block.data() + (15 - b) * 8192, src.data() + b * 8192, 8192) == 0);
      co_await close_lpair(p);
    }(peer_gpu, my_gpu));
  }
  CHECK(fake_gpu::imports == 0);
  fake_gpu::free(peer_gpu);
  fake_gpu::free(my_gpu);
}

TEST_CASE("local wire: a GPU answer carries its handle; sizes and kinds checked") {
  namespace lw = detail::local_wire;
  lw::answer a;
  a.rkey = 77;
  a.ok = true;
  a.kind = detail::shared_kind::cuda_ipc;
  a.addr = 1 << 20;
  a.length = 4096;
  a.offset = 512;
  a.access = access::all;
  a.slot = 3;
  for (std::size_t i = 0; i < a.handle.size(); ++i) a.handle[i] = std::byte(i * 3 + 1);
  std::array<std::byte, lw::max_message> b{};
  const std::size_t n = lw::encode_full_answer(a, b);
  CHECK(n == lw::gpu_answer_size);
  auto m = lw::decode_message(std::span(b).first(n));
  REQUIRE(m.has_value());
  CHECK(m->ans.ok);
  CHECK(m->ans.kind == detail::shared_kind::cuda_ipc);
  CHECK(m->ans.handle == a.handle);
  CHECK(m->ans.offset == 512);
  // Without its handle, or with bytes past it: refused.
  CHECK_FALSE(lw::decode_message(std::span(b).first(lw::answer_size)).has_value());
  std::array<std::byte, lw::max_message + 1> longer{};
  std::copy(b.begin(), b.end(), longer.begin());
  CHECK_FALSE(lw::decode_message(longer).has_value());
  // A host answer with a handle's bytes after it, or a refusal with them: refused.
  a.kind = detail::shared_kind::host_memfd;
  CHECK(lw::encode_full_answer(a, b) == lw::answer_size);
  CHECK(lw::decode_message(std::span(b).first(lw::answer_size)).has_value());
  CHECK_FALSE(lw::decode_message(std::span(b).first(lw::gpu_answer_size)).has_value());
  lw::answer refused;
  refused.rkey = 5;
  CHECK(lw::encode_full_answer(refused, b) == lw::answer_size);
  CHECK(lw::decode_message(std::span(b).first(lw::answer_size)).has_value());
  CHECK_FALSE(lw::decode_message(std::span(b).first(lw::gpu_answer_size)).has_value());
  // cuMemCreate memory: the allocation's size after the answer, the range within it.
  a.kind = detail::shared_kind::cuda_fd;
  a.alloc_size = 1 << 16;
  CHECK(lw::encode_full_answer(a, b) == lw::gpu_answer_size);
  m = lw::decode_message(std::span(b).first(lw::gpu_answer_size));
  REQUIRE(m.has_value());
  CHECK(m->ans.kind == detail::shared_kind::cuda_fd);
  CHECK(m->ans.alloc_size == (1u << 16));
  a.alloc_size = 4096;  // the range (512 + 4096) past the allocation: refused
  lw::encode_full_answer(a, b);
  CHECK_FALSE(lw::decode_message(std::span(b).first(lw::gpu_answer_size)).has_value());
  // An unknown kind: refused.
  a.kind = detail::shared_kind::cuda_ipc;
  lw::encode_full_answer(a, b);
  b[12] = std::byte{9};
  CHECK_FALSE(lw::decode_message(std::span(b).first(lw::gpu_answer_size)).has_value());
}

TEST_CASE("GPU memory (fake hooks): cuMemCreate-style memory goes as a POSIX fd") {
  hooks_guard g;
  constexpr std::size_t n = 64 << 10;
  std::byte* peer_gpu = fake_gpu::alloc(n);
  fake_gpu::fd_mode = true;
  {
    io_context ctx;
    ctx.run([](std::byte* peer_gpu) -> task<void> {
      lpair p;
      co_await make_lpair(p);
      fake_gpu::poke(peer_gpu, std::vector<std::byte>(n, std::byte{1}));
      auto mr = p.sd->register_memory({peer_gpu + 4096, 8192}, access::all).value();
      auto data = pattern(8192, 31);
      REQUIRE((co_await p.client.write(data, mr.remote())).has_value());
      auto got = fake_gpu::peek(peer_gpu, n);
      CHECK(std::memcmp(got.data() + 4096, data.data(), 8192) == 0);
      CHECK(got[4095] == std::byte{1});
      CHECK(got[4096 + 8192] == std::byte{1});
      CHECK(fake_gpu::fd_imports == 1);
      std::vector<std::byte> back(100);
      REQUIRE((co_await p.client.read(back, mr.remote(50, 100))).has_value());
      CHECK(std::memcmp(back.data(), data.data() + 50, 100) == 0);
      auto r = co_await p.client.write(data, remote_buffer{mr.remote().address + 1, mr.rkey(), 8192});
      CHECK(r.error() == make_error_code(errc::remote_access_error));
      co_await close_lpair(p);
    }(peer_gpu));
  }
  fake_gpu::fd_mode = false;
  CHECK(fake_gpu::fd_imports == 0);  // unmapped at teardown
  fake_gpu::free(peer_gpu);
}
