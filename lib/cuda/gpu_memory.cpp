// Registration paths for device memory (see shuttle/cuda/gpu_memory.hpp).
#include <shuttle/cuda/gpu_memory.hpp>

#include "driver.hpp"

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include <shuttle/verbs/verbs.hpp>

namespace shuttle::cuda {

const char* to_string(gpu_path p) noexcept {
  switch (p) {
    case gpu_path::dmabuf: return "dmabuf";
    case gpu_path::peermem: return "peermem";
    case gpu_path::staged: return "staged";
  }
  return "?";
}

namespace {
std::error_code drv_error(CUresult r) { return {static_cast<int>(r), driver_category()}; }
bool peermem_loaded() {
  std::error_code ec;
  return std::filesystem::exists("/sys/module/nvidia_peermem", ec) || std::filesystem::exists("/sys/module/nv_peer_mem", ec);
}
}  // namespace

result<int> export_dmabuf(const void* dev, std::size_t len, std::uint64_t* offset) {
  auto& d = detail::driver();
  if (!d.mem_get_handle_for_address_range || !d.mem_get_address_range) return make_error_code(errc::not_supported);
  // Export whole pages: the allocation's pages that cover the range.
  auto ptr = reinterpret_cast<CUdeviceptr>(dev);
  CUdeviceptr base = 0;
  std::size_t alloc = 0;
  if (CUresult r = d.mem_get_address_range(&base, &alloc, ptr); r != CUDA_SUCCESS) return drv_error(r);
  const std::uint64_t page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  CUdeviceptr start = ptr & ~(page - 1);
  if (start < base) start = base;
  std::uint64_t end = (ptr + len + page - 1) & ~(page - 1);
  if (end > base + alloc) end = base + alloc;
  int fd = -1;
  if (CUresult r = d.mem_get_handle_for_address_range(&fd, start, end - start, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
      r != CUDA_SUCCESS)
    return drv_error(r);
  if (offset) *offset = ptr - start;
  return fd;
}

result<void> make_rdma_writes_visible() {
  auto& d = detail::driver();
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return make_error_code(cudaGetLastError());
  int ordering = 0;
  if (d.device_get_attribute)
    (void)d.device_get_attribute(&ordering, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, dev);
  if (ordering >= CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER) return {};
  if (!d.flush_gpudirect_rdma_writes) return make_error_code(errc::not_supported);
  CUresult r = d.flush_gpudirect_rdma_writes(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                             CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
  if (r != CUDA_SUCCESS) return drv_error(r);
  return {};
}

gdr_capabilities probe_gdr(int device) {
  gdr_capabilities c;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return c;
  }
  c.device = device;
  auto& d = detail::driver();
  auto attr = [&](CUdevice_attribute a) {
    int v = 0;
    if (!d.device_get_attribute || d.device_get_attribute(&v, a, device) != CUDA_SUCCESS) return 0;
    return v;
  };
  c.dmabuf_supported = d.mem_get_handle_for_address_range && attr(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED);
  c.gpudirect_rdma = attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED) != 0;
  c.flush_options = attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS);
  c.writes_ordering = attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING);
  c.peermem_module = peermem_loaded();
#if defined(SHUTTLE_HAVE_VERBS) && defined(SHUTTLE_HAVE_VERBS_DMABUF)
  c.verbs_dmabuf_entry = true;
#endif
  if (c.dmabuf_supported) {
    int prev = -1;
    (void)cudaGetDevice(&prev);
    if (prev != device) (void)cudaSetDevice(device);
    void* p = nullptr;
    if (cudaMalloc(&p, 2 << 20) == cudaSuccess) {
      auto fd = export_dmabuf(p, 2 << 20, nullptr);
      if (fd) {
        c.dmabuf_export_ok = true;
        ::close(*fd);
      }
      (void)cudaFree(p);
    } else {
      (void)cudaGetLastError();
    }
    if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
  }
  return c;
}

std::string gdr_capabilities::describe() const {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "dma-buf: %s (export %s); GPUDirect RDMA attribute: %d; flush options: 0x%x; writes ordering: %d%s; "
                "nvidia_peermem: %s; verbs dma-buf registration: %s",
                dmabuf_supported ? "supported" : "no", dmabuf_export_ok ? "ok" : "failed or untried",
                gpudirect_rdma ? 1 : 0, flush_options, writes_ordering,
                writes_ordering >= 100 ? " (owner: no flush needed)" : " (flush before consumers)",
                peermem_module ? "loaded" : "not loaded", verbs_dmabuf_entry ? "built" : "not built");
  return buf;
}

namespace {
// The allocation's process-unique id (0: none readable, not device memory).
std::uint64_t buffer_id_of(const void* dev) {
  auto& d = detail::driver();
  unsigned long long id = 0;
  if (!d.pointer_get_attribute ||
      d.pointer_get_attribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, reinterpret_cast<CUdeviceptr>(dev)) != CUDA_SUCCESS)
    return 0;
  return id;
}

// The verbs provider's view of device memory (verbs::device_memory_hooks),
// installed when this layer is loaded: GPU memory that no registration
// covers, passed to send/write/read, is registered through dma-buf or
// peermem for that operation, or refused; never read by the CPU (inline,
// staging) nor registered as host memory. Called only on the provider's
// slow path and inline decision, never for registered memory.
bool hook_is_device(const void* p, std::size_t) noexcept { return detail::is_unmanaged_device_memory(p); }
int hook_export_dmabuf(const void* p, std::size_t len, std::uint64_t* offset) noexcept {
  auto fd = export_dmabuf(p, len, offset);
  return fd ? *fd : -1;
}
bool hook_peermem() noexcept {
  try {
    return peermem_loaded();
  } catch (...) {
    return false;
  }
}
const verbs::device_memory_hooks verbs_hooks{&hook_is_device, &hook_export_dmabuf, &hook_peermem};
struct hooks_installer {
  hooks_installer() noexcept { verbs::set_device_memory_hooks(&verbs_hooks); }
} install_verbs_hooks;
}  // namespace

result<gpu_registration> gpu_registry::register_memory(const void* dev, std::size_t len, unsigned access_flags) {
  auto key = std::make_tuple(reinterpret_cast<std::uintptr_t>(dev), len, access_flags);
  const std::uint64_t id = buffer_id_of(dev);
  if (auto it = cache_.find(key); it != cache_.end()) {
    if (id != 0 && it->second.buffer_id == id) {
      ++hits_;
      return it->second.reg;
    }
    // The allocation the entry describes is gone (freed, and maybe another
    // at its address): its registration must not be used again.
    ++stale_;
    cache_.erase(it);
  }
  auto reg = register_uncached(dev, len, access_flags);
  if (!reg || id == 0) return reg;
  return cache_.emplace(key, entry{std::move(*reg), id}).first->second.reg;
}

result<gpu_registration> gpu_registry::register_uncached(const void* dev, std::size_t len, unsigned access_flags) {
  gpu_registration reg;
  if (d_->kind() != transport_kind::verbs) {
    reg.reason = std::string(to_string(d_->kind())) + " provider: reads and writes host memory only";
    return reg;
  }
  // 1. dma-buf
#if defined(SHUTTLE_HAVE_VERBS) && defined(SHUTTLE_HAVE_VERBS_DMABUF)
  {
    std::uint64_t off = 0;
    auto fd = export_dmabuf(dev, len, &off);
    if (!fd) {
      reg.reason += "dmabuf: export failed (" + fd.error().message() + "); ";
    } else {
      auto mr = verbs::register_dmabuf(*d_, *fd, off, len, reinterpret_cast<std::uint64_t>(dev), access_flags);
      ::close(*fd);  // the registration holds its own reference to the buffer
      if (mr) {
        reg.path = gpu_path::dmabuf;
        reg.region = std::move(*mr);
        return reg;
      }
      reg.reason += "dmabuf: ibv_reg_dmabuf_mr failed (" + mr.error().message() + "); ";
    }
  }
#else
  reg.reason += "dmabuf: shuttle built without the verbs dma-buf entry point; ";
#endif
  // 2. nvidia-peermem
  if (peermem_loaded()) {
    // Flagged device memory: never sent inline (the CPU must not read it).
    auto mr = verbs::register_device_memory(
        *d_, std::span<std::byte>(static_cast<std::byte*>(const_cast<void*>(dev)), len), access_flags);
    if (mr) {
      reg.path = gpu_path::peermem;
      reg.region = std::move(*mr);
      return reg;
    }
    reg.reason += "peermem: ibv_reg_mr on the device pointer failed (" + mr.error().message() + "); ";
  } else {
    reg.reason += "peermem: nvidia_peermem not loaded; ";
  }
  // 3. staged
  return reg;
}

void gpu_registry::forget(const void* dev) {
  auto a = reinterpret_cast<std::uintptr_t>(dev);
  for (auto it = cache_.lower_bound({a, 0, 0}); it != cache_.end() && std::get<0>(it->first) == a;)
    it = cache_.erase(it);
}

}  // namespace shuttle::cuda
