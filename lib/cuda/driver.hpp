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
};

// Loaded once (thread-safe); entries the driver lacks stay null.
const driver_api& driver();

}  // namespace shuttle::cuda::detail
