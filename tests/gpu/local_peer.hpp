// Two processes over the local provider (issue 30, point 2), on one GPU or
// on two GPUs of the host (issue 33): the peer process (this program run
// again with --peer NAME) and the helpers of the side that drives it. Used
// by tests/gpu/test_local.cpp and bench/gpu/local_gpu_bench.cpp.
//
// Which GPUs: SHUTTLE_GPUS=A[,B] puts the driving process on GPU A and the
// peer on GPU B (B defaults to A; unset: both on GPU 0, as before).
//
// The peer listens on the abstract Unix socket @NAME, holds a GPU region
// (cudaMalloc), a shared host block and a GPU region from cuMemCreate
// (exportable as a POSIX fd; length 0 where it could not be made), all
// registered with access::all, sends their remote_buffers in its first
// message, then serves commands:
//   'F' seed off len   fill the GPU region's range with pattern(seed)
//   'f' byte           fill all of the GPU region with `byte`
//   'V' seed off len g verify the GPU range is pattern(seed), the bytes
//                      just around it `g`; answers "ok" or what differs
//   'E' 0 0 0 g        verify every byte of the GPU region is `g`
//   'h' byte / 'H' ... the same on the host block
//   'm' byte / 'M' ... the same on the cuMemCreate region
//   'K'                kill itself (SIGKILL): a peer that dies
//   'Q'                close and exit 0
#pragma once

#include "../../examples/gpus_env.hpp"

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/local.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <cuda.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace local_gpu {

using namespace shuttle;

inline std::byte pattern_byte(std::size_t i, unsigned seed) {
  return static_cast<std::byte>((i * 131 + seed * 7 + (i >> 8) + (i >> 16)) & 0xff);
}
inline std::vector<std::byte> pattern(std::size_t n, unsigned seed, std::size_t from = 0) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = pattern_byte(from + i, seed);
  return v;
}

// The GPUs of the two processes (SHUTTLE_GPUS=A[,B]).
using shuttle_gpus::gpu_pair;
inline gpu_pair gpus_from_env(int count, std::string& why) { return shuttle_gpus::from_env(count, why); }
// Makes `dev` this thread's device (before any other CUDA work here).
inline void use_gpu(int dev) { cuda::check(cudaSetDevice(dev), "cudaSetDevice"); }

inline domain_options local_options() {
  domain_options o;
  o.kind = transport_kind::local;
  return o;
}

// GPU memory from cuMemCreate, exportable as a POSIX fd (the driver API
// through the runtime's entry points: nothing links libcuda).
struct vmm_buffer {
  std::byte* p = nullptr;
  std::size_t size = 0;
  std::string why;  // empty: made
  template <class F>
  static bool get(const char* name, F& f) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return false;
    f = reinterpret_cast<F>(fn);
    return true;
  }
  explicit vmm_buffer(std::size_t bytes) {
    CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
    CUresult (*gran)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
    CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
    CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
    if (!get("cuMemCreate", create) || !get("cuMemGetAllocationGranularity", gran) ||
        !get("cuMemAddressReserve", reserve) || !get("cuMemMap", map) || !get("cuMemSetAccess", set_access) ||
        !get("cuMemRelease", release)) {
      why = "driver entry points missing";
      return;
    }
    (void)cudaFree(nullptr);  // the primary context, current
    int dev = 0;
    (void)cudaGetDevice(&dev);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;  // this process's GPU (SHUTTLE_GPUS)
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t g = 0;
    if (gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g == 0) {
      why = "cuMemGetAllocationGranularity failed";
      return;
    }
    const std::size_t n = (bytes + g - 1) / g * g;
    CUmemGenericAllocationHandle h{};
    CUdeviceptr va = 0;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (create(&h, n, &prop, 0) != CUDA_SUCCESS) {
      why = "cuMemCreate failed";
      return;
    }
    if (reserve(&va, n, 0, 0, 0) != CUDA_SUCCESS || map(va, n, 0, h, 0) != CUDA_SUCCESS ||
        set_access(va, n, &access, 1) != CUDA_SUCCESS) {
      why = "reserve/map/set access failed";
      return;  // (a test process: left to its exit)
    }
    (void)release(h);  // the mapping holds it
    p = reinterpret_cast<std::byte*>(va);
    size = n;
  }
};

struct command {
  char op = 0;
  std::uint32_t seed = 0;
  std::uint64_t off = 0, len = 0;
  std::uint8_t guard = 0;
};

// The peer's two regions, as its first message names them.
struct peer_regions {
  remote_buffer gpu, host, vmm;  // vmm.length == 0: no cuMemCreate region
};

inline std::string check_range(const std::vector<std::byte>& all, const command& c) {
  if (c.off > all.size() || c.len > all.size() - c.off) return "range out of the region";
  for (std::size_t i = 0; i < c.len; ++i) {
    if (all[c.off + i] != pattern_byte(i, c.seed)) {
      char b[96];
      std::snprintf(b, sizeof b, "byte %zu: %02x, want %02x", i, unsigned(all[c.off + i]),
                    unsigned(pattern_byte(i, c.seed)));
      return b;
    }
  }
  if (c.off > 0 && all[c.off - 1] != std::byte{c.guard}) return "the byte before the range changed";
  if (c.off + c.len < all.size() && all[c.off + c.len] != std::byte{c.guard}) return "the byte after the range changed";
  return "ok";
}

// The peer, on GPU `gpu`: runs until 'Q' (exit 0), 'K' (killed) or a failure (exit 1).
inline int run_peer(const std::string& name, std::size_t gpu_bytes, std::size_t host_bytes, int gpu = 0) {
  if (cudaSetDevice(gpu) != cudaSuccess) {
    std::fprintf(stderr, "peer: cudaSetDevice(%d) failed\n", gpu);
    return 1;
  }
  io_context ctx;
  return ctx.run([](std::string name, std::size_t gpu_bytes, std::size_t host_bytes) -> task<int> {
    auto d = domain::open(local_options());
    if (!d) co_return 1;
    cuda::device_buffer g(gpu_bytes);
    auto h = shared_memory::allocate(host_bytes).value();
    auto gmr = d->register_memory({g.data(), gpu_bytes}, access::all);
    if (!gmr) {
      std::fprintf(stderr, "peer: registering GPU memory: %s\n", gmr.error().message().c_str());
      co_return 1;
    }
    auto hmr = d->register_memory(h.span().first(host_bytes), access::all).value();
    vmm_buffer v(gpu_bytes);
    std::optional<memory_region> vmr;
    if (v.p) {
      auto r = d->register_memory({v.p, v.size}, access::all);
      if (r)
        vmr = std::move(*r);
      else
        std::fprintf(stderr, "peer: registering cuMemCreate memory: %s\n", r.error().message().c_str());
    } else {
      std::fprintf(stderr, "peer: no cuMemCreate memory: %s\n", v.why.c_str());
    }
    auto l = d->listen(endpoint::unix_socket("@" + name).value());
    if (!l) co_return 1;
    auto c = co_await l->accept();
    if (!c) co_return 1;
    std::array<std::byte, 3 * remote_buffer::wire_size> hello{};
    gmr->remote().serialize(std::span(hello).first<remote_buffer::wire_size>());
    hmr.remote().serialize(std::span(hello).subspan<remote_buffer::wire_size, remote_buffer::wire_size>());
    (vmr ? vmr->remote() : remote_buffer{}).serialize(std::span(hello).last<remote_buffer::wire_size>());
    if (!co_await c->send(hello)) co_return 1;
    std::vector<std::byte> staging;
    for (;;) {
      auto m = co_await c->recv();
      if (!m) co_return 0;  // the driver went away
      command cmd{};
      if (m->size() != sizeof cmd) co_return 1;
      std::memcpy(&cmd, m->data().data(), sizeof cmd);
      std::string answer = "ok";
      switch (cmd.op) {
        case 'F': {
          auto p = pattern(cmd.len, cmd.seed);
          if (cmd.off + cmd.len > gpu_bytes) co_return 1;
          cuda::check(cudaMemcpy(g.data() + cmd.off, p.data(), p.size(), cudaMemcpyHostToDevice), "fill");
          break;
        }
        case 'f': cuda::check(cudaMemset(g.data(), cmd.guard, gpu_bytes), "memset"); break;
        case 'h': std::memset(h.data(), cmd.guard, host_bytes); break;
        case 'V':
          staging.resize(gpu_bytes);
          cuda::check(cudaMemcpy(staging.data(), g.data(), gpu_bytes, cudaMemcpyDeviceToHost), "verify");
          answer = check_range(staging, cmd);
          break;
        case 'E':
          staging.resize(gpu_bytes);
          cuda::check(cudaMemcpy(staging.data(), g.data(), gpu_bytes, cudaMemcpyDeviceToHost), "verify");
          for (std::size_t i = 0; i < gpu_bytes && answer == "ok"; ++i)
            if (staging[i] != std::byte{cmd.guard}) answer = "byte " + std::to_string(i) + " changed";
          break;
        case 'm':
          if (!v.p) co_return 1;
          cuda::check(cudaMemset(v.p, cmd.guard, v.size), "memset");
          break;
        case 'M':
          if (!v.p) co_return 1;
          staging.resize(v.size);
          cuda::check(cudaMemcpy(staging.data(), v.p, v.size, cudaMemcpyDeviceToHost), "verify");
          answer = check_range(staging, cmd);
          break;
        case 'H':
          staging.assign(h.data(), h.data() + host_bytes);
          answer = check_range(staging, cmd);
          break;
        case 'K': ::raise(SIGKILL); break;
        case 'Q': (void)co_await c->close(); co_return 0;
        default: co_return 1;
      }
      if (!co_await c->send(std::as_bytes(std::span(answer)))) co_return 0;
    }
  }(name, gpu_bytes, host_bytes));
}

// The driving side.
struct peer_process {
  pid_t pid = -1;
  std::string name;
  connection c;
  peer_regions r;

  // Starts `self --peer name gpu_bytes host_bytes gpu` (exec: a fresh CUDA context on GPU `gpu`).
  bool spawn(const char* self, const std::string& n, std::size_t gpu_bytes, std::size_t host_bytes, int gpu = 0) {
    name = n;
    std::string g = std::to_string(gpu_bytes), h = std::to_string(host_bytes), dev = std::to_string(gpu);
    pid = ::fork();
    if (pid == 0) {
      ::execl(self, self, "--peer", n.c_str(), g.c_str(), h.c_str(), dev.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return pid > 0;
  }
  // Connects (the peer may not listen yet: bounded retries) and reads its regions.
  task<bool> connect(domain& d) {
    auto ep = endpoint::unix_socket("@" + name).value();
    for (int i = 0; i < 400; ++i) {
      auto cc = co_await d.connect(ep);
      if (cc) {
        c = std::move(*cc);
        auto m = co_await c.recv();
        if (!m || m->size() != 3 * remote_buffer::wire_size) co_return false;
        r.gpu = remote_buffer::deserialize(m->data().first<remote_buffer::wire_size>());
        r.host = remote_buffer::deserialize(m->data().subspan<remote_buffer::wire_size, remote_buffer::wire_size>());
        r.vmm = remote_buffer::deserialize(m->data().last<remote_buffer::wire_size>());
        co_return true;
      }
      (void)co_await sleep_for(std::chrono::milliseconds(25));
    }
    co_return false;
  }
  // A command and its answer ("ok", or what went wrong).
  task<std::string> ask(command cmd) {
    if (!co_await c.send(std::as_bytes(std::span(&cmd, 1)))) co_return "send failed";
    auto m = co_await c.recv();
    if (!m) co_return "no answer: " + m.error().message();
    auto d = m->data();
    co_return std::string(reinterpret_cast<const char*>(d.data()), d.size());
  }
  peer_process() = default;
  peer_process(const peer_process&) = delete;
  peer_process& operator=(const peer_process&) = delete;
  ~peer_process() {  // a case that gave up early leaves no peer behind
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      (void)reap();
    }
  }
  // Waits for the process; its exit status (or 128 + signal).
  int reap() {
    int st = 0;
    if (pid <= 0 || ::waitpid(pid, &st, 0) != pid) return -1;
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
};

}  // namespace local_gpu

namespace local_gpu {
// `main`'s peer mode: `--peer NAME GPU_BYTES HOST_BYTES [GPU]`; -1 when not it.
inline int peer_main(int argc, char** argv) {
  if ((argc != 5 && argc != 6) || std::string(argv[1]) != "--peer") return -1;
  return run_peer(argv[2], std::stoull(argv[3]), std::stoull(argv[4]), argc == 6 ? std::atoi(argv[5]) : 0);
}
}  // namespace local_gpu
