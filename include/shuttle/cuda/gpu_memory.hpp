// GPU memory for the network: one API, the registration path chosen per
// buffer at run time and reported, registered once and cached.
//
// Order tried for device memory on a domain:
//   1. dmabuf:  cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)
//               then ibv_reg_dmabuf_mr (verbs domain, rdma-core >= 34, kernel
//               dma-buf importer in the NIC driver);
//   2. peermem: ibv_reg_mr on the device pointer (verbs domain, the
//               nvidia_peermem module loaded);
//   3. staged:  nothing registered on the device memory; transfers go through
//               pinned host bounce buffers (shuttle/cuda/staged.hpp). Always
//               the path on a tcp domain: that provider reads and writes with
//               readv/writev and cannot touch device memory.
//
// Pitfalls this layer keeps (and its users must):
//  - no inline sends from GPU memory: an inline send makes the CPU copy the
//    payload (it would read device memory through a host pointer); the verbs
//    provider refuses inline for this registry's regions (dma-buf and peermem);
//    unregistered GPU memory passed to a verbs operation is told apart by the
//    hooks this layer installs (verbs::device_memory_hooks): registered for
//    that operation (dma-buf, else peermem) or refused, never read by the CPU;
//  - a GPU-side receiver learns of arrival from the write_with_imm completion
//    (the loop), never by polling GPU memory: a NIC's writes may be seen out
//    of order by a polling kernel;
//  - received data is made visible to the consumer stream before its kernel:
//    staged data is copied in by cudaMemcpyAsync on the consumer's stream
//    (stream order); for direct writes the loop, on the completion, calls
//    make_rdma_writes_visible() and then sets a cuda::stream_flag that the
//    consumer stream waits on (cuStreamWaitValue32, with
//    CU_STREAM_WAIT_VALUE_FLUSH where GPU_DIRECT_RDMA_WRITES_ORDERING is
//    below OWNER).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/transport.hpp>

namespace shuttle::cuda {

enum class gpu_path { dmabuf, peermem, staged };
const char* to_string(gpu_path p) noexcept;

struct gpu_registration {
  gpu_path path = gpu_path::staged;
  memory_region region;  // dmabuf / peermem: the registration of the device range; staged: empty
  std::string reason;    // why earlier paths were passed over ("dmabuf: ...; peermem: ...")
};

// What this host offers for GPUDirect RDMA, found at run time.
struct gdr_capabilities {
  int device = 0;
  bool dmabuf_supported = false;  // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and the entry point
  bool dmabuf_export_ok = false;  // a test export of a small buffer returned an fd
  bool gpudirect_rdma = false;    // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED
  int flush_options = 0;          // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
  int writes_ordering = 0;        // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING (0 none, 100 owner, 200 all)
  bool peermem_module = false;    // /sys/module/nvidia_peermem
  bool verbs_dmabuf_entry = false;  // shuttle was built with the verbs provider's dma-buf registration
  std::string describe() const;
};
gdr_capabilities probe_gdr(int device = -1);

// A dma-buf fd for [dev, dev+len) (cuMemGetHandleForAddressRange); `offset`
// receives the range's offset inside the exported buffer (page-aligned
// export). The caller closes the fd.
result<int> export_dmabuf(const void* dev, std::size_t len, std::uint64_t* offset);

// Makes RDMA writes that reached device memory visible to later work of the
// device's own context (cuFlushGPUDirectRDMAWrites); a no-op where the device
// orders such writes for its owner already.
result<void> make_rdma_writes_visible();

// The per-domain cache of device-memory registrations. Entries live until
// forget() or the registry's end (which deregisters them). Each entry keeps
// the allocation's CU_POINTER_ATTRIBUTE_BUFFER_ID (unique in the process,
// never reused): a hit whose allocation was freed and another one made at
// the same address (cudaFree, cudaMalloc) has another id, and is dropped
// and registered anew, as NCCL and UCX validate their caches. Memory whose
// id cannot be read is registered but not cached.
class gpu_registry {
 public:
  explicit gpu_registry(domain& d) : d_(&d) {}
  // The path for [dev, dev+len) with `access` (access::* flags), chosen on
  // first use and cached.
  result<gpu_registration> register_memory(const void* dev, std::size_t len, unsigned access_flags);
  // Drop the entries of ranges starting at `dev` (before freeing the memory).
  void forget(const void* dev);
  std::size_t size() const noexcept { return cache_.size(); }
  std::uint64_t hits() const noexcept { return hits_; }
  std::uint64_t stale_dropped() const noexcept { return stale_; }  // hits refused: another allocation now
  domain& dom() const noexcept { return *d_; }

 private:
  domain* d_;
  struct entry {
    gpu_registration reg;
    std::uint64_t buffer_id = 0;
  };
  result<gpu_registration> register_uncached(const void* dev, std::size_t len, unsigned access_flags);
  std::map<std::tuple<std::uintptr_t, std::size_t, unsigned>, entry> cache_;
  std::uint64_t hits_ = 0;
  std::uint64_t stale_ = 0;
};

}  // namespace shuttle::cuda
