// GPU memory on the local provider, two processes on one GPU (issue 30,
// point 2) or on two (issue 33: SHUTTLE_GPUS=A,B, this process on GPU A, the
// peer on B): this program drives a peer process (itself, --peer) that holds
// a GPU region and a host block. Every byte is checked, on the peer for
// writes (with the bytes around the range) and here for reads. Exits 77
// without a GPU. The same logic without a GPU: tests/transport/local_device.cpp.
#include "local_peer.hpp"

#include "stats.hpp"  // lib/local_provider: local_gpu_copies

#include <shuttle/cuda/ordered.hpp>

#include <cstdio>

using namespace shuttle;
using namespace local_gpu;

namespace {

int failures = 0;
gpu_pair gpus;  // SHUTTLE_GPUS
#define EXPECT(cond, ...)                                                  \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ++failures;                                                          \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);          \
      std::printf(__VA_ARGS__);                                            \
      std::printf("\n");                                                   \
    }                                                                      \
  } while (0)

constexpr std::size_t gpu_bytes = 64 << 20;
constexpr std::size_t host_bytes = 4 << 20;

std::string errstr(const result<void>& r) { return r ? "ok" : r.error().message(); }

std::vector<std::byte> from_device(const void* p, std::size_t n) {
  std::vector<std::byte> v(n);
  cuda::check(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost), "copy back");
  return v;
}

task<void> data_cases(const char* self) {
  auto d = domain::open(local_options()).value();
  peer_process peer;
  EXPECT(peer.spawn(self, "shuttle-gpu-local-" + std::to_string(::getpid()), gpu_bytes, host_bytes, gpus.peer), "fork");
  if (!co_await peer.connect(d)) {
    EXPECT(false, "could not connect to the peer");
    co_return;
  }
  std::printf("peer %d: GPU region %llu bytes, host block %llu bytes\n", peer.pid,
              (unsigned long long)peer.r.gpu.length, (unsigned long long)peer.r.host.length);
  cuda::device_buffer src(gpu_bytes), dst(gpu_bytes);
  cuda::pinned_buffer pinned(gpu_bytes);
  const auto copies_before = detail::local_gpu_copies();
  unsigned seed = 1;
  struct range {
    std::size_t off, len;
  };
  const range ranges[] = {{0, 1}, {0, 8}, {100, 4097}, {(5 << 20) + 3, 1 << 20}, {0, gpu_bytes}};

  // Writes into the peer's GPU region: from GPU, pageable host and pinned host memory.
  for (int from = 0; from < 3; ++from) {
    const char* what = from == 0 ? "GPU->GPU" : from == 1 ? "host->GPU" : "pinned->GPU";
    for (auto rg : ranges) {
      ++seed;
      EXPECT(co_await peer.ask({'f', 0, 0, 0, 0xEE}) == "ok", "fill");
      auto data = pattern(rg.len, seed);
      std::span<const std::byte> local;
      if (from == 0) {
        cuda::check(cudaMemcpy(src.data(), data.data(), rg.len, cudaMemcpyHostToDevice), "stage");
        local = {src.data(), rg.len};
      } else if (from == 1) {
        local = data;
      } else {
        std::memcpy(pinned.data(), data.data(), rg.len);
        local = {pinned.data(), rg.len};
      }
      auto w = co_await peer.c.write(local, peer.r.gpu.slice(rg.off, rg.len).value());
      EXPECT(w.has_value(), "%s write %zu@%zu: %s", what, rg.len, rg.off, errstr(w).c_str());
      auto v = co_await peer.ask({'V', seed, rg.off, rg.len, 0xEE});
      EXPECT(v == "ok", "%s write %zu@%zu checked on the peer: %s", what, rg.len, rg.off, v.c_str());
    }
  }
  // GPU -> the peer's host block.
  for (auto rg : {range{0, 8}, range{333, 65536}, range{0, host_bytes}}) {
    ++seed;
    EXPECT(co_await peer.ask({'h', 0, 0, 0, 0x11}) == "ok", "fill host");
    auto data = pattern(rg.len, seed);
    cuda::check(cudaMemcpy(src.data(), data.data(), rg.len, cudaMemcpyHostToDevice), "stage");
    auto w = co_await peer.c.write({src.data(), rg.len}, peer.r.host.slice(rg.off, rg.len).value());
    EXPECT(w.has_value(), "GPU->host write %zu@%zu: %s", rg.len, rg.off, errstr(w).c_str());
    auto v = co_await peer.ask({'H', seed, rg.off, rg.len, 0x11});
    EXPECT(v == "ok", "GPU->host write %zu@%zu checked on the peer: %s", rg.len, rg.off, v.c_str());
  }
  // Reads from the peer's GPU region into GPU and host memory, and from its host block into GPU memory.
  for (auto rg : ranges) {
    ++seed;
    EXPECT(co_await peer.ask({'F', seed, rg.off, rg.len, 0}) == "ok", "fill pattern");
    auto want = pattern(rg.len, seed);
    auto r = co_await peer.c.read({dst.data(), rg.len}, peer.r.gpu.slice(rg.off, rg.len).value());
    EXPECT(r.has_value(), "GPU<-GPU read %zu@%zu: %s", rg.len, rg.off, errstr(r).c_str());
    EXPECT(from_device(dst.data(), rg.len) == want, "GPU<-GPU read %zu@%zu: bytes differ", rg.len, rg.off);
    std::vector<std::byte> host(rg.len);
    r = co_await peer.c.read(host, peer.r.gpu.slice(rg.off, rg.len).value());
    EXPECT(r.has_value(), "host<-GPU read %zu@%zu: %s", rg.len, rg.off, errstr(r).c_str());
    EXPECT(host == want, "host<-GPU read %zu@%zu: bytes differ", rg.len, rg.off);
  }
  {
    ++seed;
    auto data = pattern(host_bytes, seed);
    auto w = co_await peer.c.write(data, peer.r.host);  // host -> host, on the mapping
    EXPECT(w.has_value(), "host->host write: %s", errstr(w).c_str());
    auto r = co_await peer.c.read({dst.data(), host_bytes}, peer.r.host);
    EXPECT(r.has_value(), "GPU<-host read: %s", errstr(r).c_str());
    EXPECT(from_device(dst.data(), host_bytes) == data, "GPU<-host read: bytes differ");
  }
  const auto copies = detail::local_gpu_copies() - copies_before;
  std::printf("GPU copies done by the provider: %llu\n", (unsigned long long)copies);
  EXPECT(copies == 3 * 5 + 3 + 2 * 5 + 1, "every access involving GPU memory a GPU copy (got %llu)",
         (unsigned long long)copies);
  // A stream of writes posted together, then a message: the peer sees every byte.
  {
    ++seed;
    EXPECT(co_await peer.ask({'f', 0, 0, 0, 0}) == "ok", "fill");
    auto data = pattern(gpu_bytes, seed);
    cuda::check(cudaMemcpy(src.data(), data.data(), gpu_bytes, cudaMemcpyHostToDevice), "stage");
    std::vector<task<result<void>>> ws;
    constexpr std::size_t chunk = 4 << 20;
    for (std::size_t off = 0; off < gpu_bytes; off += chunk)
      ws.push_back(peer.c.write({src.data() + off, chunk}, peer.r.gpu.slice(off, chunk).value()));
    auto all = co_await when_all(std::move(ws));
    bool ok = true;
    for (auto& w : all) ok = ok && w.has_value();
    EXPECT(ok, "16 writes in flight together");
    auto v = co_await peer.ask({'V', seed, 0, gpu_bytes, 0});
    EXPECT(v == "ok", "16 writes in flight, checked on the peer: %s", v.c_str());
  }
  // Stream-ordered (cuda/ordered.hpp): the write posted when the stream has
  // produced the data (a copy enqueued on it just before), every byte there.
  {
    ++seed;
    EXPECT(co_await peer.ask({'f', 0, 0, 0, 0}) == "ok", "fill");
    auto data = pattern(gpu_bytes, seed);
    std::memcpy(pinned.data(), data.data(), gpu_bytes);
    cuda::stream st;
    cuda::check(cudaMemsetAsync(src.data(), 0, gpu_bytes, st), "clear");
    cuda::check(cudaMemcpyAsync(src.data(), pinned.data(), gpu_bytes, cudaMemcpyHostToDevice, st), "produce");
    auto w = co_await cuda::write_after(st, peer.c, {src.data(), gpu_bytes}, peer.r.gpu);
    EXPECT(w.has_value(), "write_after: %s", errstr(w).c_str());
    auto v = co_await peer.ask({'V', seed, 0, gpu_bytes, 0});
    EXPECT(v == "ok", "write_after, checked on the peer: %s", v.c_str());
  }
  // cuMemCreate memory on the peer (shared as a POSIX fd): written from GPU
  // and host memory, read back, its bounds checked.
  EXPECT(peer.r.vmm.length > 0, "the peer has no cuMemCreate region (see its stderr)");
  if (peer.r.vmm.length > 0) {
    std::printf("cuMemCreate region: %llu bytes\n", (unsigned long long)peer.r.vmm.length);
    for (auto rg : {range{0, 8}, range{4096 + 3, 1 << 20}, range{0, gpu_bytes}}) {
      ++seed;
      EXPECT(co_await peer.ask({'m', 0, 0, 0, 0x42}) == "ok", "fill vmm");
      auto data = pattern(rg.len, seed);
      cuda::check(cudaMemcpy(src.data(), data.data(), rg.len, cudaMemcpyHostToDevice), "stage");
      auto w = co_await peer.c.write({src.data(), rg.len}, peer.r.vmm.slice(rg.off, rg.len).value());
      EXPECT(w.has_value(), "GPU->cuMemCreate write %zu@%zu: %s", rg.len, rg.off, errstr(w).c_str());
      auto v = co_await peer.ask({'M', seed, rg.off, rg.len, 0x42});
      EXPECT(v == "ok", "GPU->cuMemCreate write %zu@%zu checked on the peer: %s", rg.len, rg.off, v.c_str());
      std::vector<std::byte> back(rg.len);
      auto r = co_await peer.c.read(back, peer.r.vmm.slice(rg.off, rg.len).value());
      EXPECT(r.has_value() && back == data, "host<-cuMemCreate read %zu@%zu: %s", rg.len, rg.off, errstr(r).c_str());
    }
    auto w = co_await peer.c.write({src.data(), 64},
                                   remote_buffer{peer.r.vmm.address + peer.r.vmm.length - 32, peer.r.vmm.rkey, 64});
    EXPECT(!w && w.error() == make_error_code(errc::remote_access_error),
           "cuMemCreate region, out of bounds: want remote_access_error, got %s", errstr(w).c_str());
  }
  // Refused accesses: the connection stays, the peer's bytes untouched.
  {
    EXPECT(co_await peer.ask({'f', 0, 0, 0, 0x77}) == "ok", "fill");
    auto bad = peer.r.gpu;
    bad.rkey ^= 0x13572468;
    auto w = co_await peer.c.write({src.data(), 64}, bad);
    EXPECT(!w && w.error() == make_error_code(errc::unregistered_device_memory),
           "GPU source, bad rkey: want unregistered_device_memory, got %s", errstr(w).c_str());
    w = co_await peer.c.write({src.data(), 128},
                              remote_buffer{peer.r.gpu.address + gpu_bytes - 64, peer.r.gpu.rkey, 128});
    EXPECT(!w && w.error() == make_error_code(errc::remote_access_error),
           "out of bounds (past the end): want remote_access_error, got %s", errstr(w).c_str());
    std::vector<std::byte> host(64);
    w = co_await peer.c.read(host, remote_buffer{peer.r.gpu.address - 32, peer.r.gpu.rkey, 64});
    EXPECT(!w && w.error() == make_error_code(errc::remote_access_error),
           "out of bounds (before the start): want remote_access_error, got %s", errstr(w).c_str());
    auto rd = peer.r.gpu;
    rd.rkey ^= 1;
    w = co_await peer.c.read({dst.data(), 64}, rd);
    EXPECT(!w, "GPU destination, bad rkey: must fail");
    auto v = co_await peer.ask({'E', 0, 0, 0, 0x77});
    EXPECT(v == "ok", "after refused accesses: %s", v.c_str());
    EXPECT(peer.c.is_open(), "the connection stays open");
    // A host source to a bad rkey goes through the socket, refused there (as tcp): the connection fails.
    w = co_await peer.c.write(host, bad);
    EXPECT(!w && w.error() == make_error_code(errc::remote_access_error), "host source, bad rkey: got %s",
           errstr(w).c_str());
  }
  (void)co_await peer.c.close();
  peer.c = connection{};
  EXPECT(peer.reap() == 0, "peer exit status");
}

// The peer killed while writes are in flight: every operation ends (none
// hangs), later ones fail, and this process's GPU context still works.
task<void> killed_peer_case(const char* self) {
  auto d = domain::open(local_options()).value();
  peer_process peer;
  EXPECT(peer.spawn(self, "shuttle-gpu-local-k-" + std::to_string(::getpid()), gpu_bytes, host_bytes, gpus.peer),
         "fork");
  if (!co_await peer.connect(d)) {
    EXPECT(false, "could not connect to the peer");
    co_return;
  }
  cuda::device_buffer src(gpu_bytes);
  auto data = pattern(gpu_bytes, 99);
  cuda::check(cudaMemcpy(src.data(), data.data(), gpu_bytes, cudaMemcpyHostToDevice), "stage");
  // One round completes first (the region is imported), then the kill lands among the next ones.
  auto first = co_await peer.c.write({src.data(), gpu_bytes}, peer.r.gpu);
  EXPECT(first.has_value(), "write before the kill: %s", errstr(first).c_str());
  std::vector<task<result<void>>> ws;
  for (int i = 0; i < 16; ++i) ws.push_back(peer.c.write({src.data(), gpu_bytes}, peer.r.gpu));
  auto killer = [](pid_t pid) -> task<result<void>> {
    ::kill(pid, SIGKILL);
    co_return result<void>{};
  };
  ws.insert(ws.begin() + 4, killer(peer.pid));
  auto all = co_await when_all(std::move(ws));
  int ok = 0, failed = 0;
  for (auto& w : all) (w ? ok : failed)++;
  std::printf("killed peer: %d operations succeeded, %d failed while it died\n", ok - 1, failed);
  EXPECT(peer.reap() == 128 + SIGKILL, "the peer was killed");
  // Later operations fail, within a bounded number of tries (the hang-up is
  // seen by the socket).
  bool saw_error = false;
  std::string why;
  for (int i = 0; i < 200 && !saw_error; ++i) {
    auto w = co_await peer.c.write({src.data(), 1 << 20}, peer.r.gpu);
    if (!w) {
      saw_error = true;
      why = w.error().message();
    } else {
      (void)co_await sleep_for(std::chrono::milliseconds(5));
    }
  }
  EXPECT(saw_error, "writes to a dead peer must fail");
  std::printf("after the kill: %s\n", why.c_str());
  EXPECT(!peer.c.is_open(), "the connection is closed");
  // Our own GPU work is unaffected.
  EXPECT(from_device(src.data(), gpu_bytes) == data, "local GPU memory intact and readable");
  peer.c = connection{};
}

}  // namespace

int main(int argc, char** argv) {
  if (int rc = peer_main(argc, argv); rc >= 0) return rc;
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  std::string why;
  gpus = gpus_from_env(cuda::device_count(), why);
  if (!why.empty()) {
    std::fprintf(stderr, "test_gpu_local: %s\n", why.c_str());
    return 2;
  }
  use_gpu(gpus.self);
  std::printf("this process: GPU %d: %s\n", gpus.self, cuda::describe_device(gpus.self).c_str());
  std::printf("the peer:     GPU %d: %s\n", gpus.peer, cuda::describe_device(gpus.peer).c_str());
  if (gpus.self != gpus.peer) {
    int ab = 0, ba = 0;
    (void)cudaDeviceCanAccessPeer(&ab, gpus.self, gpus.peer);
    (void)cudaDeviceCanAccessPeer(&ba, gpus.peer, gpus.self);
    std::printf("cudaDeviceCanAccessPeer %d->%d: %d, %d->%d: %d\n", gpus.self, gpus.peer, ab, gpus.peer, gpus.self, ba);
  }
  ::signal(SIGPIPE, SIG_IGN);
  io_context ctx;
  ctx.run([](const char* self) -> task<void> {
    std::puts("== data: every direction, every byte checked; refusals");
    co_await data_cases(self);
    std::puts("== a peer killed mid-transfer");
    co_await killed_peer_case(self);
  }("/proc/self/exe"));
  std::printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
