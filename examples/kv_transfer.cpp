// shuttle-kv-transfer: a KV-cache hand-off between a "prefill" and a
// "decode" process, with block-list transfers (connection::write_blocks).
//
//   shuttle-kv-transfer [--layers L] [--blocks N] [--block-size BYTES]
//                       [--transport auto|rdma|tcp-provider|local] [--addr ADDR] [--corrupt K] [--gpu]
//
// The decode process (forked first) holds a paged KV cache: per layer, a
// pool of pages of BYTES each. For the request it takes N free pages per
// layer, in an order of its own (its block table), registers the cache and
// sends the prefill process the descriptor and the table. The prefill
// process has computed (here: a pattern of layer, block and byte) the same
// N logical blocks per layer in its own paged cache, laid out differently,
// and writes each layer as one block list, notifying the decode side with
// write_with_imm (imm = layer) once the layer's blocks are in: decode checks
// every byte of that layer's blocks as soon as it is told, while later
// layers are still on the wire. Finally decode answers OK or the first bad
// block. Host memory; with --gpu (local transport), prefill's cache is in
// GPU memory (cudaMalloc), each block a GPU copy into decode's cache, which
// is then a shared block (shared_memory) the provider maps; exit 77 without
// a GPU. SHUTTLE_GPUS=A puts prefill's cache on GPU A; SHUTTLE_GPUS=A,B
// puts decode's cache in GPU memory too, on GPU B (issue 33: two GPUs of
// one host, or A = B: GPU to GPU on one): each layer is then notified by a
// message after its block list (a write_with_imm cannot land in GPU memory
// on the local provider) and checked from a copy to host memory.
//
// Exit status: 0 if every block arrived intact, 1 on a mismatch or a
// transport error, 2 for bad usage.
#include <shuttle/local.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>
#ifdef SHUTTLE_HAVE_CUDA
#include <shuttle/cuda/cuda.hpp>
#endif

#include "cli.hpp"
#include "gpus_env.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;

namespace {

constexpr const char* kProg = "shuttle-kv-transfer";
constexpr const char* kSynopsis =
    "usage: shuttle-kv-transfer [--layers L] [--blocks N] [--block-size BYTES]\n"
    "                           [--transport auto|rdma|tcp-provider|local] [--addr ADDR] [--corrupt K] [--gpu]\n";

struct options {
  std::uint64_t layers = 8, blocks = 256, block_size = 16384;
  transport_kind kind = transport_kind::automatic;
  std::string addr = "127.0.0.1";
  std::int64_t corrupt = -1;  // a logical block of the last layer damaged before it is sent (the test's check)
  bool gpu = false;           // prefill's cache in GPU memory (local transport)
  int prefill_gpu = 0;        // SHUTTLE_GPUS=A[,B]
  int decode_gpu = -1;        // >= 0: decode's cache in GPU memory there
};

// The content of byte-word w of logical block b of layer l: what prefill
// computed, what decode expects.
std::uint64_t word_of(std::uint64_t l, std::uint64_t b, std::uint64_t w) noexcept {
  std::uint64_t x = (l << 48) ^ (b << 24) ^ w ^ 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A paged cache: `pages` pages of `page` bytes per layer, layers one after
// the other; `table[l*n + b]`: the page of logical block b of layer l.
struct paged_cache {
  std::vector<std::byte> owned;
  shared_memory shared;       // --gpu: decode's cache, mapped by the peer's provider
  std::span<std::byte> mem;   // the one of them in use
  std::vector<std::uint32_t> table;
  std::uint64_t pages = 0, page = 0;
  std::uint64_t offset(std::uint64_t l, std::uint32_t p) const noexcept { return (l * pages + p) * page; }
};

// Pages 2*N per layer (the pool holds other requests' pages too), N of
// them taken in a shuffled order.
paged_cache make_cache(const options& o, unsigned seed, bool shared = false) {
  paged_cache c;
  c.pages = 2 * o.blocks;
  c.page = o.block_size;
  const std::size_t bytes = o.layers * c.pages * c.page;
  if (shared) {
    c.shared = shared_memory::allocate(bytes).value();
    c.mem = c.shared.span().first(bytes);
  } else {
    c.owned.resize(bytes);
    c.mem = c.owned;
  }
  std::mt19937 rng(seed);
  for (std::uint64_t l = 0; l < o.layers; ++l) {
    std::vector<std::uint32_t> p(c.pages);
    std::iota(p.begin(), p.end(), 0u);
    std::shuffle(p.begin(), p.end(), rng);
    c.table.insert(c.table.end(), p.begin(), p.begin() + static_cast<std::ptrdiff_t>(o.blocks));
  }
  return c;
}

domain open_domain(const options& o) {
  domain_options d;
  d.kind = o.kind;
  auto r = domain::open(d);
  if (!r) {
    std::fprintf(stderr, "%s: cannot open a %s domain: %s\n", kProg, to_string(o.kind), r.error().message().c_str());
    std::exit(r.error() == make_error_code(errc::not_supported) ? 77 : 1);
  }
  return std::move(*r);
}

// ---------------------------------------------------------------- decode

int decode(const options& o, int port_pipe) {
#ifdef SHUTTLE_HAVE_CUDA
  // (Forked before the parent touched CUDA: this process may use it.)
  if (o.decode_gpu >= 0 && cudaSetDevice(o.decode_gpu) != cudaSuccess) {
    std::fprintf(stderr, "%s: decode: cannot use GPU %d\n", kProg, o.decode_gpu);
    return 1;
  }
#endif
  io_context ctx;
  return ctx.run([&]() -> task<int> {
    domain d = open_domain(o);
    const bool on_gpu = o.decode_gpu >= 0;
    paged_cache c = make_cache(o, 2, o.gpu && !on_gpu);
    std::span<std::byte> cache = c.mem;  // what the peer writes into
#ifdef SHUTTLE_HAVE_CUDA
    cuda::device_buffer dev;
    if (on_gpu) {
      dev = cuda::device_buffer(c.mem.size());
      cuda::check(cudaMemset(dev.data(), 0, dev.size()), "clear the cache");
      cache = {dev.data(), dev.size()};
    }
#endif
    auto mr = d.register_memory(cache, access::local_write | access::remote_write);
    if (!mr) {
      std::fprintf(stderr, "%s: decode: register: %s\n", kProg, mr.error().message().c_str());
      co_return 1;
    }
    auto l = d.listen(endpoint::parse(o.addr + ":0").value());
    if (!l) {
      std::fprintf(stderr, "%s: decode: listen: %s\n", kProg, l.error().message().c_str());
      co_return 1;
    }
    std::uint16_t port = l->local_endpoint()->port();
    if (::write(port_pipe, &port, sizeof port) != sizeof port) co_return 1;
    ::close(port_pipe);
    auto conn = co_await with_timeout(l->accept(), 30s);
    if (!conn) co_return 1;
    // The descriptor, then the block table (the page of each block).
    std::vector<std::byte> hello(remote_buffer::wire_size + c.table.size() * 4);
    mr->remote().serialize(std::span(hello).first<remote_buffer::wire_size>());
    std::memcpy(hello.data() + remote_buffer::wire_size, c.table.data(), c.table.size() * 4);
    if (hello.size() > conn->max_message_size()) {
      std::fprintf(stderr, "%s: decode: block table too large for one message\n", kProg);
      co_return 1;
    }
    if (auto s = co_await conn->send(hello); !s) co_return 1;
    std::uint64_t bad = 0, checked = 0;
    std::string first_bad;
    for (std::uint64_t k = 0; k < o.layers; ++k) {
      auto m = co_await with_timeout(conn->recv(), 60s);
      std::uint64_t layer = o.layers;
      if (m && m->imm())
        layer = *m->imm();
      else if (m && on_gpu && m->size() == sizeof layer)  // the layer's message (GPU cache)
        std::memcpy(&layer, m->data().data(), sizeof layer);
      if (!m || layer >= o.layers) {
        std::fprintf(stderr, "%s: decode: waiting for layer %llu: %s\n", kProg, static_cast<unsigned long long>(k),
                     m ? "not a layer notification" : m.error().message().c_str());
        co_return 1;
      }
#ifdef SHUTTLE_HAVE_CUDA
      if (on_gpu) {  // the layer's pages, to host memory to be checked
        const std::uint64_t at = c.offset(layer, 0), n = c.pages * c.page;
        cuda::check(cudaMemcpy(c.mem.data() + at, dev.data() + at, n, cudaMemcpyDeviceToHost), "layer to host");
      }
#endif
      for (std::uint64_t b = 0; b < o.blocks; ++b) {
        const std::byte* p = c.mem.data() + c.offset(layer, c.table[layer * o.blocks + b]);
        for (std::uint64_t w = 0; w < o.block_size / 8; ++w) {
          std::uint64_t v;
          std::memcpy(&v, p + w * 8, 8);
          if (v != word_of(layer, b, w)) {
            if (bad++ == 0) first_bad = "layer " + std::to_string(layer) + " block " + std::to_string(b);
            break;
          }
        }
        ++checked;
      }
    }
    std::string verdict = bad ? "BAD " + std::to_string(bad) + " blocks, first " + first_bad : "OK";
    std::printf("decode: %llu layers x %llu blocks of %llu bytes checked: %s\n",
                static_cast<unsigned long long>(o.layers), static_cast<unsigned long long>(o.blocks),
                static_cast<unsigned long long>(o.block_size), verdict.c_str());
    std::fflush(stdout);
    (void)checked;
    (void)co_await conn->send(std::as_bytes(std::span(verdict.data(), verdict.size())));
    (void)co_await with_timeout(conn->recv(), 30s);  // prefill closes after reading it
    co_return bad ? 1 : 0;
  }());
}

// ---------------------------------------------------------------- prefill

int prefill(const options& o, std::uint16_t port) {
  io_context ctx;
  return ctx.run([&]() -> task<int> {
    domain d = open_domain(o);
    paged_cache c = make_cache(o, 1);
    for (std::uint64_t l = 0; l < o.layers; ++l)  // the "forward pass"
      for (std::uint64_t b = 0; b < o.blocks; ++b) {
        std::byte* p = c.mem.data() + c.offset(l, c.table[l * o.blocks + b]);
        for (std::uint64_t w = 0; w < o.block_size / 8; ++w) {
          std::uint64_t v = word_of(l, b, w);
          std::memcpy(p + w * 8, &v, 8);
        }
      }
    if (o.corrupt >= 0)  // one word of one block, as a bug in the sender's layout would
      c.mem[c.offset(o.layers - 1, c.table[(o.layers - 1) * o.blocks + std::uint64_t(o.corrupt)]) + 8] ^= std::byte{1};
    std::span<std::byte> from = c.mem;  // what the blocks are written from
#ifdef SHUTTLE_HAVE_CUDA
    cuda::device_buffer dev;
    if (o.gpu) {  // the cache in GPU memory, as a model's would be
      dev = cuda::device_buffer(c.mem.size());
      cuda::check(cudaMemcpy(dev.data(), c.mem.data(), c.mem.size(), cudaMemcpyHostToDevice), "cache to GPU");
      from = {dev.data(), dev.size()};
    }
#endif
    auto mr = d.register_memory(from, access::local_write);
    if (!mr) {
      std::fprintf(stderr, "%s: prefill: register: %s\n", kProg, mr.error().message().c_str());
      co_return 1;
    }
    auto conn = co_await with_timeout(d.connect(endpoint::parse(o.addr + ":" + std::to_string(port)).value()), 30s);
    if (!conn) {
      std::fprintf(stderr, "%s: prefill: connect: %s\n", kProg, conn.error().message().c_str());
      co_return 1;
    }
    auto hello = co_await with_timeout(conn->recv(), 30s);
    if (!hello || hello->size() != remote_buffer::wire_size + o.layers * o.blocks * 4) {
      std::fprintf(stderr, "%s: prefill: bad descriptor from decode\n", kProg);
      co_return 1;
    }
    remote_buffer remote = remote_buffer::deserialize(hello->data().first<remote_buffer::wire_size>());
    std::vector<std::uint32_t> remote_table(o.layers * o.blocks);
    std::memcpy(remote_table.data(), hello->data().data() + remote_buffer::wire_size, remote_table.size() * 4);
    hello->reset();
    const std::uint64_t remote_pages = 2 * o.blocks;
    auto t0 = std::chrono::steady_clock::now();
    // One block list per layer, its notification after its last block.
    std::vector<block> blocks(o.blocks);
    for (std::uint64_t l = 0; l < o.layers; ++l) {
      for (std::uint64_t b = 0; b < o.blocks; ++b)
        blocks[b] = {c.offset(l, c.table[l * o.blocks + b]), (l * remote_pages + remote_table[l * o.blocks + b]) * o.block_size,
                     o.block_size};
      const bool by_message = o.decode_gpu >= 0;  // decode's cache in GPU memory: no write_with_imm into it
      block_options bo;
      if (!by_message) bo.notify = static_cast<std::uint32_t>(l);
      auto r = co_await conn->write_blocks(from, remote, blocks, bo);
      if (!r) {
        std::fprintf(stderr, "%s: prefill: layer %llu, block %zu: %s\n", kProg, static_cast<unsigned long long>(l),
                     r.failed_block(), r.error().message().c_str());
        co_return 1;
      }
      if (by_message) {  // after the list's writes (RC order)
        const std::uint64_t layer = l;
        if (auto sent = co_await conn->send(std::as_bytes(std::span(&layer, 1))); !sent) {
          std::fprintf(stderr, "%s: prefill: layer %llu's message: %s\n", kProg, static_cast<unsigned long long>(l),
                       sent.error().message().c_str());
          co_return 1;
        }
      }
    }
    auto verdict = co_await with_timeout(conn->recv(), 60s);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!verdict) co_return 1;
    std::string v(reinterpret_cast<const char*>(verdict->data().data()), verdict->size());
    const double bytes = double(o.layers * o.blocks * o.block_size);
    std::string where;
    if (o.gpu) where = " (cache on GPU " + std::to_string(o.prefill_gpu) + ")";
    if (o.decode_gpu >= 0) where += " to decode's cache on GPU " + std::to_string(o.decode_gpu);
    std::printf("prefill: %s%s, %llu layers x %llu blocks, %.1f MB in %.3f s (%.3f GB/s); decode says %s\n",
                to_string(d.kind()), where.c_str(), static_cast<unsigned long long>(o.layers),
                static_cast<unsigned long long>(o.blocks), bytes / 1e6, s, bytes / s / 1e9, v.c_str());
    (void)co_await conn->close();
    co_return v == "OK" ? 0 : 1;
  }());
}

#ifdef SHUTTLE_HAVE_CUDA
// CUDA's device count, from a child process (CUDA in a parent breaks its
// forked children's use of it); 0 where there is none or the child failed.
int device_count_in_child() {
  int fds[2];
  if (::pipe(fds) != 0) return 0;
  std::fflush(stdout);
  pid_t p = ::fork();
  if (p == 0) {
    ::close(fds[0]);
    const int n = cuda::device_count();
    [[maybe_unused]] auto w = ::write(fds[1], &n, sizeof n);
    std::_Exit(0);
  }
  ::close(fds[1]);
  int n = 0;
  if (p < 0 || ::read(fds[0], &n, sizeof n) != sizeof n) n = 0;
  ::close(fds[0]);
  if (p > 0) ::waitpid(p, nullptr, 0);
  return n;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  options o;
  cli::transport transport = cli::transport::automatic;
  bool local = false;
  CLI::App app{"Hands a synthetic paged KV cache from a prefill process to a decode process, layer by layer, with "
               "block-list writes; decode checks every block.",
               kProg};
  cli::setup(app, kSynopsis);
  app.add_option("--layers", o.layers, "layers (default 8)")->type_name("L")->transform(cli::count(1, 1024));
  app.add_option("--blocks", o.blocks, "blocks per layer (default 256)")->type_name("N")->transform(cli::count(1, 65536));
  app.add_option("--block-size", o.block_size, "bytes per block, a multiple of 8, suffixes k/m (default 16k)")
      ->type_name("BYTES")
      ->transform(cli::bytes(8, 1ull << 24));
  app.add_option_function<std::string>(
         "--transport",
         [&](const std::string& s) {
           local = s == "local";
           if (!local) transport = *cli::parse_transport(s, true);
         },
         "auto (verbs if an RDMA device is active, else the tcp provider), rdma (verbs), tcp-provider ('tcp' too), "
         "local (same host) (default auto)")
      ->type_name("T")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            return s == "local" || cli::parse_transport(s, true) ? std::string() : "bad value '" + s + "'";
          },
          "", "transport"));
  app.add_option("--addr", o.addr, "numeric address decode listens on (default 127.0.0.1)")->type_name("ADDR");
  app.add_option("--corrupt", o.corrupt, "damage this block of the last layer before sending it (decode must say BAD)")
      ->type_name("K")
      ->transform(cli::count(0, 65535));
  app.add_flag("--gpu", o.gpu,
               "prefill's cache in GPU memory (with --transport local; exit 77 without a GPU); SHUTTLE_GPUS=A[,B]: "
               "prefill's on GPU A, decode's cache in GPU memory on GPU B");
  cli::parse(app, argc, argv);
  if (o.gpu && !local) cli::fail(app, "--gpu: with --transport local only");
#ifndef SHUTTLE_HAVE_CUDA
  if (o.gpu) {
    std::fprintf(stderr, "%s: --gpu: built without CUDA\n", kProg);
    return 77;
  }
#endif
  if (o.corrupt >= std::int64_t(o.blocks)) cli::fail(app, "--corrupt: not a block (0 to --blocks - 1)");
  if (o.block_size % 8) cli::fail(app, "--block-size: bad value '" + std::to_string(o.block_size) + "' (a multiple of 8)");
  if (o.layers * 2 * o.blocks * o.block_size > (std::uint64_t(1) << 32))
    cli::fail(app, "the cache (--layers x 2 x --blocks x --block-size) is over 4 GiB");
  o.kind = local ? transport_kind::local : cli::kind_of(transport);
#ifdef SHUTTLE_HAVE_CUDA
  if (o.gpu) {
    // Decode's cache on a GPU: the device count is asked in a child, so that
    // this process (which forks decode below) has not touched CUDA yet.
    const char* env = std::getenv("SHUTTLE_GPUS");
    if (env && *env) {
      const int count = device_count_in_child();
      if (count == 0) {
        std::fprintf(stderr, "%s: --gpu: no CUDA device: skipped\n", kProg);
        return 77;
      }
      std::string why;
      const auto g = shuttle_gpus::parse(env, count, why);
      if (!why.empty()) cli::fail(app, why);
      o.prefill_gpu = g.self;
      if (g.peer_named) o.decode_gpu = g.peer;
    }
  }
#endif

  int fds[2];
  if (::pipe(fds) != 0) return 1;
  std::fflush(stdout);
  pid_t child = ::fork();  // first: before any provider state exists
  if (child < 0) return 1;
  if (child == 0) {
    ::close(fds[0]);
    int rc = decode(o, fds[1]);
    std::fflush(stdout);
    std::_Exit(rc);
  }
  ::close(fds[1]);
#ifdef SHUTTLE_HAVE_CUDA
  if (o.gpu && o.decode_gpu < 0 && cuda::device_count() == 0) {  // (after the fork: decode never touches CUDA)
    std::fprintf(stderr, "%s: --gpu: no CUDA device: skipped\n", kProg);
    ::kill(child, SIGTERM);
    ::waitpid(child, nullptr, 0);
    return 77;
  }
  if (o.gpu && cudaSetDevice(o.prefill_gpu) != cudaSuccess) {
    std::fprintf(stderr, "%s: cannot use GPU %d\n", kProg, o.prefill_gpu);
    ::kill(child, SIGTERM);
    ::waitpid(child, nullptr, 0);
    return 1;
  }
#endif
  std::uint16_t port = 0;
  int rc = 1;
  if (::read(fds[0], &port, sizeof port) == sizeof port)
    rc = prefill(o, port);
  else
    std::fprintf(stderr, "%s: the decode process did not start\n", kProg);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status)) return 1;
  if (WEXITSTATUS(status) == 77 && rc == 77) return 77;
  return rc == 0 && WEXITSTATUS(status) == 0 ? 0 : 1;
}
