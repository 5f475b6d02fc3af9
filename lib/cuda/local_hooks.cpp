// The local provider's view of GPU memory (lib/local_provider/
// device_hooks.hpp), installed when this layer is linked in: device memory
// told from host memory, registrations exported as CUDA IPC handles, a
// peer's handles imported once per process, and one-sided accesses done as
// cudaMemcpyAsync on the connection's stream, awaited on the loop.
#include "../local_provider/device_hooks.hpp"

#include "driver.hpp"

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/error.hpp>

#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace shuttle::cuda {
namespace {

namespace lp = shuttle::detail::local_provider;

bool is_device(const void* p, std::size_t) noexcept { return detail::is_unmanaged_device_memory(p); }

result<std::uint64_t> export_handle(const void* p, std::size_t len, lp::gpu_handle& out) noexcept {
  detail::allocation_range a;
  if (!detail::allocation_of(p, len, a)) return make_error_code(shuttle::errc::not_supported);
  cudaIpcMemHandle_t h{};
  static_assert(sizeof h == lp::gpu_handle_size);
  // Fails for memory from cuMemCreate (no IPC handle; a POSIX-fd export
  // would be its path) and for another process's imported memory.
  if (cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(a.base)) != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error_code(shuttle::errc::not_supported);
  }
  std::memcpy(out.data(), &h, sizeof h);
  return static_cast<std::uint64_t>(a.offset);
}

// Imports, by handle: a process may open a handle once, and several
// connections (and regions) may use it.
struct import_entry {
  std::byte* base = nullptr;
  std::size_t size = 0;
  std::size_t refs = 0;
};
std::mutex imports_mutex;
std::map<lp::gpu_handle, import_entry>& imports() {
  static auto* m = new std::map<lp::gpu_handle, import_entry>;  // never destroyed: static dtors
  return *m;
}

result<lp::device_hooks::imported> import_handle(const lp::gpu_handle& h) noexcept {
  try {
    std::lock_guard lock(imports_mutex);
    auto& m = imports();
    if (auto it = m.find(h); it != m.end()) {
      ++it->second.refs;
      return lp::device_hooks::imported{it->second.base, it->second.size};
    }
    cudaIpcMemHandle_t ch{};
    std::memcpy(&ch, h.data(), sizeof ch);
    void* p = nullptr;
    // Mapped for this thread's current GPU; an allocation on another GPU
    // (the peer's process on GPU B, this one on A) needs peer access
    // between them, enabled here: it fails where A cannot access B.
    cudaError_t e = cudaIpcOpenMemHandle(&p, ch, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return make_error_code(e);
    }
    // What is mapped from p on: the bounds the peer's answer is checked against.
    CUdeviceptr base = 0;
    size_t size = 0;
    const auto at = reinterpret_cast<CUdeviceptr>(p);
    auto& d = detail::driver();
    if (!d.mem_get_address_range || d.mem_get_address_range(&base, &size, at) != CUDA_SUCCESS || at < base ||
        at - base >= size) {
      (void)cudaIpcCloseMemHandle(p);
      return make_error_code(shuttle::errc::not_supported);
    }
    size -= at - base;
    m.emplace(h, import_entry{static_cast<std::byte*>(p), size, 1});
    return lp::device_hooks::imported{static_cast<std::byte*>(p), size};
  } catch (const std::bad_alloc&) {
    return std::make_error_code(std::errc::not_enough_memory);
  }
}

// cuMemCreate memory: exported as a POSIX fd, mapped here at an address of
// our own (each import its own mapping: fds have no identity to share by).
result<std::uint64_t> export_fd(const void* p, std::size_t len, int* fd, std::uint64_t* size) noexcept {
  auto& d = detail::driver();
  detail::allocation_range a;
  if (!d.mem_retain_allocation_handle || !d.mem_export_to_shareable_handle || !d.mem_release ||
      !detail::allocation_of(p, len, a))
    return make_error_code(shuttle::errc::not_supported);
  CUmemGenericAllocationHandle h{};
  if (d.mem_retain_allocation_handle(&h, reinterpret_cast<void*>(a.base)) != CUDA_SUCCESS)
    return make_error_code(shuttle::errc::not_supported);
  int out = -1;
  CUresult e = d.mem_export_to_shareable_handle(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  (void)d.mem_release(h);  // the retained reference; the mapping keeps its own
  if (e != CUDA_SUCCESS || out < 0) return make_error_code(shuttle::errc::not_supported);
  *fd = out;
  *size = a.size;
  return static_cast<std::uint64_t>(a.offset);
}

std::map<std::byte*, std::size_t>& fd_imports() {  // base -> size (under imports_mutex)
  static auto* m = new std::map<std::byte*, std::size_t>;
  return *m;
}

result<lp::device_hooks::imported> import_fd(int fd, std::uint64_t size) noexcept {
  auto& d = detail::driver();
  if (!d.mem_import_from_shareable_handle || !d.mem_address_reserve || !d.mem_map || !d.mem_set_access ||
      !d.mem_unmap || !d.mem_address_free || !d.mem_release || size == 0)
    return make_error_code(shuttle::errc::not_supported);
  CUmemGenericAllocationHandle h{};
  if (d.mem_import_from_shareable_handle(&h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != CUDA_SUCCESS)
    return make_error_code(shuttle::errc::remote_access_error);
  CUdeviceptr va = 0;
  // Access for this process's GPU (the thread's current one, where the
  // copies run), which need not be the GPU the allocation lives on: across
  // two GPUs, cuMemSetAccess fails unless this GPU can access the other.
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)d.mem_release(h);
    return make_error_code(shuttle::errc::not_supported);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  bool reserved = false, mapped = false;
  CUresult e = d.mem_address_reserve(&va, size, 0, 0, 0);
  if (e == CUDA_SUCCESS) {
    reserved = true;
    e = d.mem_map(va, size, 0, h, 0);  // a size other than the allocation's fails here
  }
  if (e == CUDA_SUCCESS) {
    mapped = true;
    e = d.mem_set_access(va, size, &access, 1);
  }
  (void)d.mem_release(h);  // the mapping holds the allocation
  if (e != CUDA_SUCCESS) {
    if (mapped) (void)d.mem_unmap(va, size);
    if (reserved) (void)d.mem_address_free(va, size);
    return make_error_code(shuttle::errc::remote_access_error);
  }
  auto* base = reinterpret_cast<std::byte*>(va);
  try {
    std::lock_guard lock(imports_mutex);
    fd_imports()[base] = size;
  } catch (const std::bad_alloc&) {
    (void)d.mem_unmap(va, size);
    (void)d.mem_address_free(va, size);
    return std::make_error_code(std::errc::not_enough_memory);
  }
  return lp::device_hooks::imported{base, size};
}

void release_import(std::byte* base) noexcept {
  std::lock_guard lock(imports_mutex);
  auto& m = imports();
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (it->second.base != base) continue;
    if (--it->second.refs == 0) {
      (void)cudaIpcCloseMemHandle(base);
      m.erase(it);
    }
    return;
  }
  if (auto it = fd_imports().find(base); it != fd_imports().end()) {
    auto& d = detail::driver();
    (void)d.mem_unmap(reinterpret_cast<CUdeviceptr>(base), it->second);
    (void)d.mem_address_free(reinterpret_cast<CUdeviceptr>(base), it->second);
    fd_imports().erase(it);
  }
}

// A connection's queue: a stream on the GPU that was current when its first
// copy came (the loop thread's device; SHUTTLE_GPUS in the tests). Its
// events must be that GPU's too (cudaEventRecord fails on another's stream).
struct queue {
  cudaStream_t s = nullptr;
  int device = 0;
};

void* open_queue() noexcept {
  auto* q = new (std::nothrow) queue;
  if (!q) return nullptr;
  if (cudaGetDevice(&q->device) != cudaSuccess ||
      cudaStreamCreateWithFlags(&q->s, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    delete q;
    return nullptr;
  }
  return q;
}
void close_queue(void* q) noexcept {
  if (!q) return;
  auto* x = static_cast<queue*>(q);
  (void)cudaStreamDestroy(x->s);
  delete x;
}

// Makes `dev` the calling thread's device for a scope (only where it is not).
class device_scope {
 public:
  explicit device_scope(int dev) noexcept {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != dev) {
      if (cudaSetDevice(dev) == cudaSuccess)
        switched_ = true;
      else
        (void)cudaGetLastError();
    }
  }
  ~device_scope() {
    if (switched_) (void)cudaSetDevice(prev_);
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

// The copies' events, by device (an event is recorded on its own device's
// streams only; the loop's pool, detail::pooled_event, does not say whose).
thread_local std::vector<std::pair<int, std::vector<cudaEvent_t>>> tl_copy_events;

std::vector<cudaEvent_t>& events_of(int dev) {
  for (auto& [d, v] : tl_copy_events)
    if (d == dev) return v;
  return tl_copy_events.emplace_back(dev, std::vector<cudaEvent_t>{}).second;
}

// Called with `dev` current. Throws std::system_error, std::bad_alloc.
cudaEvent_t copy_event(int dev) {
  auto& v = events_of(dev);
  if (!v.empty()) {
    cudaEvent_t e = v.back();
    v.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}
void return_copy_event(cudaEvent_t e, int dev) noexcept {
  try {
    auto& v = events_of(dev);
    if (v.size() < 256) return v.push_back(e);
  } catch (const std::bad_alloc&) {
  }
  (void)cudaEventDestroy(e);
}

// An event awaited without the awaiter's stop token: the copy goes on
// touching the operation's buffers, so the operation ends when it does.
class uncancelled_wait : public event_awaiter {
 public:
  using event_awaiter::event_awaiter;
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return detail::park(node_, h, std::stop_token{});
  }
};

task<result<void>> await_copy(cudaEvent_t ev, int dev) {
  auto r = co_await uncancelled_wait(ev);  // (an event is queried from any device)
  return_copy_event(ev, dev);
  co_return r;
}
task<result<void>> failed(std::error_code ec) { co_return ec; }

// Between two GPUs (a peer's region on another GPU than this process's), the
// copy goes over the link: the import enabled peer access where the GPUs
// have it (cudaIpcMemLazyEnablePeerAccess; a cuMemCreate import is mapped
// for this process's GPU, which needs it too).
task<result<void>> copy(void* q, void* dst, const void* src, std::size_t n) {
  auto* x = static_cast<queue*>(q);
  // The thread's device may have changed since the queue was opened: the
  // stream's device is made current for the enqueue and the event.
  device_scope on(x->device);
  cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, x->s);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return failed(make_error_code(e));
  }
  cudaEvent_t ev = nullptr;
  try {
    ev = copy_event(x->device);
  } catch (const std::system_error& err) {
    return failed(err.code());
  } catch (const std::bad_alloc&) {
    return failed(std::make_error_code(std::errc::not_enough_memory));
  }
  if ((e = cudaEventRecord(ev, x->s)) != cudaSuccess) {
    (void)cudaGetLastError();
    return_copy_event(ev, x->device);
    return failed(make_error_code(e));
  }
  return await_copy(ev, x->device);
}

const lp::device_hooks local_hooks{.is_device = &is_device,
                                   .export_handle = &export_handle,
                                   .import_handle = &import_handle,
                                   .export_fd = &export_fd,
                                   .import_fd = &import_fd,
                                   .release_import = &release_import,
                                   .open_queue = &open_queue,
                                   .close_queue = &close_queue,
                                   .copy = &copy};
struct hooks_installer {
  hooks_installer() noexcept { lp::set_device_hooks(&local_hooks); }
} install_local_hooks;

}  // namespace

// Referenced from cuda.cpp, so that a static link that uses the CUDA layer
// keeps this file (and its installer).
namespace detail {
extern const int local_hooks_anchor;
const int local_hooks_anchor = 1;
}  // namespace detail
}  // namespace shuttle::cuda
