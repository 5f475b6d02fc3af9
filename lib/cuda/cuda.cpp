// CUDA layer: errors, memory, streams, events, stream flags, driver entry points.
#include <shuttle/cuda/cuda.hpp>

#include "driver.hpp"

#include <shuttle/error.hpp>

#include <cstdio>
#include <mutex>

namespace shuttle::cuda {

namespace {
class runtime_category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cuda"; }
  std::string message(int c) const override { return cudaGetErrorString(static_cast<cudaError_t>(c)); }
};
class drv_category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cuda-driver"; }
  std::string message(int c) const override { return "CUresult " + std::to_string(c); }
};
}  // namespace

const std::error_category& category() noexcept {
  static const runtime_category c;
  return c;
}
const std::error_category& driver_category() noexcept {
  static const drv_category c;
  return c;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::system_error(make_error_code(e), what);
}

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string describe_device(int dev) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return "device " + std::to_string(dev) + ": unavailable";
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.200s, sm_%d%d, %.1f GiB, %d SMs, PCI %04x:%02x:%02x.0", p.name, p.major, p.minor,
                static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024 * 1024), p.multiProcessorCount,
                p.pciDomainID, p.pciBusID, p.pciDeviceID);
  return buf;
}

namespace detail {
// local_hooks.cpp: its installer gives the local provider GPU memory; this
// reference keeps it in a static link of any program using this layer.
extern const int local_hooks_anchor;
[[gnu::used]] const int* const keep_local_hooks = &local_hooks_anchor;

const driver_api& driver() {
  static driver_api api;
  static std::once_flag once;
  std::call_once(once, [] {
    auto get = [](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess)
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      else
        (void)cudaGetLastError();
    };
    get("cuStreamWriteValue32", api.stream_write_value32);
    get("cuStreamWaitValue32", api.stream_wait_value32);
    get("cuMemGetHandleForAddressRange", api.mem_get_handle_for_address_range);
    get("cuFlushGPUDirectRDMAWrites", api.flush_gpudirect_rdma_writes);
    get("cuDeviceGetAttribute", api.device_get_attribute);
    get("cuPointerGetAttribute", api.pointer_get_attribute);
    get("cuMemGetAddressRange", api.mem_get_address_range);
    get("cuMemRetainAllocationHandle", api.mem_retain_allocation_handle);
    get("cuMemExportToShareableHandle", api.mem_export_to_shareable_handle);
    get("cuMemImportFromShareableHandle", api.mem_import_from_shareable_handle);
    get("cuMemAddressReserve", api.mem_address_reserve);
    get("cuMemAddressFree", api.mem_address_free);
    get("cuMemMap", api.mem_map);
    get("cuMemUnmap", api.mem_unmap);
    get("cuMemSetAccess", api.mem_set_access);
    get("cuMemRelease", api.mem_release);
  });
  return api;
}

bool is_unmanaged_device_memory(const void* p) noexcept {
  auto& d = driver();
  if (!d.pointer_get_attribute) return false;  // no driver: no device memory
  const auto ptr = reinterpret_cast<CUdeviceptr>(p);
  unsigned int type = 0;
  if (d.pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) != CUDA_SUCCESS) return false;
  if (type != CU_MEMORYTYPE_DEVICE) return false;
  unsigned int managed = 0;
  return d.pointer_get_attribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr) != CUDA_SUCCESS || !managed;
}

bool allocation_of(const void* p, size_t len, allocation_range& out) noexcept {
  auto& d = driver();
  if (!d.mem_get_address_range) return false;
  const auto ptr = reinterpret_cast<CUdeviceptr>(p);
  if (d.mem_get_address_range(&out.base, &out.size, ptr) != CUDA_SUCCESS || ptr < out.base ||
      ptr - out.base > out.size || len > out.size - (ptr - out.base))
    return false;
  out.offset = ptr - out.base;
  return true;
}
}  // namespace detail

// ------------------------------------------------------------------ memory

device_buffer::device_buffer(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  p_ = static_cast<std::byte*>(p);
  n_ = bytes;
}
void device_buffer::reset() noexcept {
  if (p_) (void)cudaFree(p_);
  p_ = nullptr;
  n_ = 0;
}

pinned_buffer::pinned_buffer(std::size_t bytes) {
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc");
  p_ = static_cast<std::byte*>(p);
  n_ = bytes;
}
void pinned_buffer::reset() noexcept {
  if (p_) (void)cudaFreeHost(p_);
  p_ = nullptr;
  n_ = 0;
}
void* pinned_buffer::device_pointer() const {
  void* d = nullptr;
  check(cudaHostGetDevicePointer(&d, p_, 0), "cudaHostGetDevicePointer");
  return d;
}

// ------------------------------------------------------------------ streams and events

stream::stream() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
stream::stream(int priority) {
  check(cudaStreamCreateWithPriority(&s_, cudaStreamNonBlocking, priority), "cudaStreamCreateWithPriority");
}
void stream::synchronize() const { check(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }
void stream::reset() noexcept {
  if (s_) (void)cudaStreamDestroy(s_);
  s_ = nullptr;
}

event::event(bool timing) {
  check(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
}
void event::record(cudaStream_t s) const { check(cudaEventRecord(e_, s), "cudaEventRecord"); }
bool event::query() const {
  cudaError_t e = cudaEventQuery(e_);
  if (e == cudaErrorNotReady) return false;
  check(e, "cudaEventQuery");
  return true;
}
void event::reset() noexcept {
  if (e_) (void)cudaEventDestroy(e_);
  e_ = nullptr;
}

// ------------------------------------------------------------------ stream flags

stream_flag::stream_flag() {
  void* p = nullptr;
  check(cudaHostAlloc(&p, 64, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc(flag)");
  word_ = static_cast<std::uint32_t*>(p);
  *word_ = 0;
  void* d = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&d, p, 0);
  if (e != cudaSuccess) {
    (void)cudaFreeHost(p);
    check(e, "cudaHostGetDevicePointer(flag)");
  }
  dev_ = reinterpret_cast<unsigned long long>(d);
}
stream_flag::~stream_flag() {
  if (word_) (void)cudaFreeHost(word_);
}

result<void> stream_flag::enqueue_wait(cudaStream_t s, std::uint32_t value, bool flush) const {
  auto& d = detail::driver();
  if (!d.stream_wait_value32) return make_error_code(errc::not_supported);
  unsigned flags = CU_STREAM_WAIT_VALUE_GEQ;
  if (flush && features().flush_remote_writes) flags |= CU_STREAM_WAIT_VALUE_FLUSH;
  CUresult r = d.stream_wait_value32(reinterpret_cast<CUstream>(s), dev_, value, flags);
  if (r != CUDA_SUCCESS) return std::error_code(static_cast<int>(r), driver_category());
  return {};
}

result<void> stream_flag::write_from(cudaStream_t s, std::uint32_t value) const {
  auto& d = detail::driver();
  if (!d.stream_write_value32) return make_error_code(errc::not_supported);
  CUresult r = d.stream_write_value32(reinterpret_cast<CUstream>(s), dev_, value, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) return std::error_code(static_cast<int>(r), driver_category());
  return {};
}

driver_features features(int device) {
  driver_features f;
  (void)cudaDriverGetVersion(&f.driver_version);
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return f;
  }
  auto& d = detail::driver();
  auto attr = [&](CUdevice_attribute a) {
    int v = 0;
    if (!d.device_get_attribute || d.device_get_attribute(&v, a, device) != CUDA_SUCCESS) return 0;
    return v;
  };
  // Stream memory operations are always enabled since CUDA 12 (the V1
  // attribute is deprecated): the entry points decide.
  f.stream_mem_ops = d.stream_wait_value32 && d.stream_write_value32;
  f.flush_remote_writes = attr(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES) != 0;
  f.dmabuf_export = d.mem_get_handle_for_address_range && attr(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) != 0;
  return f;
}

}  // namespace shuttle::cuda
