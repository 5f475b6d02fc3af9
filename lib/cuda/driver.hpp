// Driver-API entry points, found through the runtime
// (cudaGetDriverEntryPointByVersion): nothing links libcuda, and a binary
// runs (and skips its GPU work) where no driver is installed.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace shuttle::cuda::detail {

struct driver_api {
  CUresult (*stream_write_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*stream_wait_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*mem_get_handle_for_address_range)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                               unsigned long long) = nullptr;
  CUresult (*flush_gpudirect_rdma_writes)(CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*pointer_get_attribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*mem_get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  // Virtual memory management (cuMemCreate memory shared through a POSIX fd).
  CUresult (*mem_retain_allocation_handle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*mem_export_to_shareable_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                             unsigned long long) = nullptr;
  CUresult (*mem_import_from_shareable_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*mem_address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*mem_address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
};

// Loaded once (thread-safe); entries the driver lacks stay null.
const driver_api& driver();

// Device memory the CPU must not touch: CU_MEMORYTYPE_DEVICE and not
// managed (managed memory migrates, the CPU may read it). False without a
// driver, and for host memory.
bool is_unmanaged_device_memory(const void* p) noexcept;

// The allocation holding [p, p + len): its base, its size and p's offset
// in it. False where the driver lacks the call, p is not device memory or
// the range runs past the allocation.
struct allocation_range {
  CUdeviceptr base = 0;
  size_t size = 0;
  size_t offset = 0;
};
bool allocation_of(const void* p, size_t len, allocation_range& out) noexcept;

}  // namespace shuttle::cuda::detail
