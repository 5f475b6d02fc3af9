// Verbs-specific public API: device listing, the 'verbs' error category for
// work-completion status (ibv_wc_status), and CQ polling policy. The
// transport-neutral API is shuttle/transport.hpp; this header adds what only
// the verbs provider has. It compiles and works without rdma-core (no device).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <shuttle/error.hpp>
#include <shuttle/result.hpp>

namespace shuttle {
class domain;
class memory_region;
}

namespace shuttle::verbs {

struct gid_info {
  int index = 0;
  std::string gid;        // "::ffff:192.168.77.1", "fe80::..."
  std::string type;       // "IB/RoCE v1", "RoCE v2"
  bool ipv4_mapped = false;
};

struct port_info {
  int port = 1;
  bool active = false;
  std::string state;       // ibv_port_state_str
  std::string link_layer;  // "Ethernet", "InfiniBand"
  int active_mtu = 0;      // bytes
  std::vector<gid_info> gids;  // non-zero entries only
  int ipv4_gid_index = -1;     // the RoCE v2 IPv4-mapped GID, -1 if none
};

struct device_info {
  std::string name;
  std::string node_guid;
  int max_qp = 0, max_qp_wr = 0, max_cq = 0, max_cqe = 0, max_mr = 0, max_qp_rd_atom = 0, max_srq = 0;
  std::uint64_t max_mr_size = 0;
  bool atomics = false;
  std::vector<port_info> ports;
};

// Every RDMA device of this host (empty when there is none, or when shuttle
// was built without rdma-core). Opens each device briefly.
result<std::vector<device_info>> list_devices();
// Human-readable summary; "no RDMA device" when the list is empty.
std::string describe_devices();

// The 'verbs' category: values are ibv_wc_status, messages ibv_wc_status_str.
// Equivalences (error_condition in shuttle's category): REM_ACCESS_ERR ->
// errc::remote_access_error, REM_OP_ERR -> errc::remote_operation_error,
// WR_FLUSH_ERR / RETRY_EXC_ERR / RNR_RETRY_EXC_ERR -> errc::disconnected.
const std::error_category& category() noexcept;
std::error_code make_wc_error(int ibv_wc_status) noexcept;

// Compare verbs codes with shuttle::matches(ec, errc) (see shuttle/error.hpp).

// CQ policy of a verbs domain: after its last completion, the domain's CQ
// poller keeps the loop busy-polling for `budget` while operations are in
// flight or a recv() waits (a ping-pong's receiver spins as perftest's does),
// then arms ibv_req_notify_cq and lets the loop sleep. The loop keeps its
// own io_context::options::spin_budget too: while the domain refuses to
// sleep the loop spins on, so the longer of the two budgets wins (one cannot
// shorten the other).
// errc::not_supported for a non-verbs domain.
result<void> set_busy_poll_budget(domain& d, std::chrono::nanoseconds budget);

// Memory the user did not register is registered on its second use and the
// registration cached, where the process's memory monitor watches it
// (private anonymous memory: the heap, the stack, anonymous mmaps); the
// monitor drops an entry before the munmap, mremap or madvise that took its
// pages returns, so a cached registration never outlives its memory
// (docs/memory-registration.md). Other memory is staged or registered per
// operation. On by default; SHUTTLE_REGISTRATION_CACHE=0 in the environment
// turns the monitor off for the process. `on` = false turns this domain's
// cache off (its entries go once no operation holds them); true: the
// monitor's reason when it cannot run (no userfaultfd, not permitted).
// errc::not_supported for a non-verbs domain.
result<void> set_registration_cache(domain& d, bool on);
// Whether this process has the memory monitor the cache needs: an empty
// code when it runs (started by this call if not yet), else why not
// (no userfaultfd, not permitted, turned off, or no verbs provider).
std::error_code memory_monitor_status() noexcept;

// The domain's connections share one CQ; each reserves entries in it for
// what it may have outstanding: at connect a few send-queue slots and the
// receives it posts, then more as it uses them (send slots and receives
// double up to the connection's options). A connection that does not fit
// is refused (connect/accept: std::errc::no_buffer_space) or stops growing
// and waits for its own completions; the others keep theirs. The CQ grows
// with ibv_resize_cq up to the device's max_cqe, or up to `max_entries`
// (a bound on the CQ's memory; reservations made already stay).
// errc::not_supported for a non-verbs domain.
result<void> limit_cq_entries(domain& d, int max_entries);

struct domain_stats {
  std::uint64_t completions = 0;     // work completions reaped
  std::uint64_t cq_events = 0;       // completion-channel wake-ups
  std::uint64_t registrations = 0;   // ibv_reg_mr calls
  std::uint64_t cache_hits = 0;      // operations served by a user registration or the cache
  // The cache of registrations of memory the user did not register
  // (docs/memory-registration.md): on where the process's memory monitor
  // runs (set_registration_cache). Registrations made for it, entries dropped
  // because their memory was unmapped, moved or dropped (madvise), entries
  // dropped for room, and sources it cannot watch (shared or file-backed
  // memory: staged or registered per operation).
  bool registration_cache = false;
  std::uint64_t cached_registrations = 0;
  std::uint64_t cache_invalidations = 0;
  std::uint64_t cache_evictions = 0;
  std::uint64_t uncacheable_sources = 0;
  // Operations on memory neither a user registration nor the cache covers
  // (memory used once, or that the monitor cannot watch): copied into a
  // registered staging slot, or registered for that operation alone.
  std::uint64_t staged = 0;
  std::uint64_t transient_registrations = 0;
  // Bytes the staging pool holds registered: it grows with the staged
  // operations in flight, up to 16 MiB per domain.
  std::size_t staging_bytes = 0;
  // Sends and writes from the bytes of a received message the application
  // holds (an echo): posted from the receive buffer's own registration.
  std::uint64_t receive_buffer_sends = 0;
  std::size_t live_connections = 0;  // QPs not destroyed yet (incl. draining)
  // Listeners of the domain (listener_options): requests refused at once (a
  // cap, a bad hello, no resources), handshakes dropped at their deadline,
  // connections ended by idle_timeout, and peers that broke the protocol
  // (credits past what they announced).
  std::uint64_t handshakes_refused = 0;
  std::uint64_t handshakes_timed_out = 0;
  std::uint64_t idle_timeouts = 0;
  std::uint64_t protocol_errors = 0;
};
result<domain_stats> stats(const domain& d);

// Registers device (GPU) memory exported as a dma-buf (for CUDA:
// cuMemGetHandleForAddressRange) with ibv_reg_dmabuf_mr. The region's
// addresses are `iova` (pass the device pointer), so operations and
// remote_buffer descriptors name device addresses; the provider never sends
// inline from it. errc::not_supported on a non-verbs domain or an rdma-core
// without dma-buf support; the device's errno (EOPNOTSUPP, EINVAL) when the
// NIC or kernel cannot.
result<memory_region> register_dmabuf(domain& d, int fd, std::uint64_t offset, std::size_t length,
                                      std::uint64_t iova, unsigned access_flags);

// Registers device (GPU) memory that the NIC reaches through a peer-memory
// module (nvidia_peermem: ibv_reg_mr on the device pointer). As for
// register_dmabuf, the provider never sends inline from it (the CPU must not
// read it), so connection_options::max_inline_data need not be 0.
// errc::not_supported on a non-verbs domain. cuda::gpu_registry uses it.
result<memory_region> register_device_memory(domain& d, std::span<std::byte> mem, unsigned access_flags);

// How the verbs provider tells device (GPU) memory from host memory without
// a CUDA call of its own: a GPU layer installs these (lib/cuda does, when
// CUDA is present). They are consulted only for memory that no registration
// covers (an operation's slow path) and for the inline-send decision, never
// for registered memory. Device memory found there is registered for that
// operation alone through a dma-buf (export_dmabuf), else through a
// peer-memory module (peermem), and flagged so the CPU never reads it
// (no inline, no staging copy); with neither, the operation fails with
// errc::unregistered_device_memory. Every member may be null.
struct device_memory_hooks {
  // True when [p, p+len) is device memory the CPU cannot read.
  bool (*is_device_memory)(const void* p, std::size_t len) noexcept = nullptr;
  // A dma-buf fd covering [p, p+len) and p's offset in it (the caller closes
  // the fd), or -1.
  int (*export_dmabuf)(const void* p, std::size_t len, std::uint64_t* offset) noexcept = nullptr;
  // True when ibv_reg_mr on a device pointer reaches device memory
  // (nvidia_peermem loaded).
  bool (*peermem)() noexcept = nullptr;
};
// Installs `h` for every verbs domain (kept by pointer: a static object;
// null removes it). Returns the one installed before.
const device_memory_hooks* set_device_memory_hooks(const device_memory_hooks* h) noexcept;
const device_memory_hooks* installed_device_memory_hooks() noexcept;

}  // namespace shuttle::verbs
