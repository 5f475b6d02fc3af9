// A local-provider connection's own state (internal), next to the tcp
// engine's conn_state (lib/tcp_provider/conn_state.hpp), which runs the
// connection over the Unix socket: two-sided operations, one-sided ones on
// memory that is not shared, batches, prepared operations, grants, errors,
// close and teardown, all with the tcp provider's semantics.
//
// What is local: the peer's shared regions, mapped here. The first write
// or read to an rkey asks the peer, on the service channel, whether it may
// be mapped (service.cpp), and waits for the answer (device.cpp); once it
// is in, accesses to it are done here (operations.cpp): a memcpy or an
// std::atomic_ref on the mapping, or a copy on the GPU for GPU memory
// (device.cpp), checked against the region's bounds and rights and against
// the peer's key-table word (still registered?), and only while nothing of
// ours is in flight in the engine (RC order: an access done here must not
// overtake one still queued there).
#pragma once

#include "domain_state.hpp"
#include "local_wire.hpp"

#include "../tcp_provider/conn_state.hpp"

#include <shuttle/sync.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>

namespace shuttle::detail::local_provider {

// A mapping of a peer's memory (munmap'd when the last region using it goes).
struct mapping {
  void* base = nullptr;
  std::size_t len = 0;
  mapping(void* b, std::size_t l) noexcept : base(b), len(l) {}
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  ~mapping();
};

// One of the peer's regions as its answer described it.
struct peer_region {
  bool ok = false;  // refused: accessed through the socket
  bool gpu = false;  // GPU memory (imported through device_hooks): copies on the GPU, never the socket
  std::error_code unusable;  // a GPU region we could not import: its accesses fail with this
  std::uint32_t rkey = 0;
  std::uint32_t slot = 0;
  std::uint32_t access = 0;
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  std::byte* at = nullptr;  // `addr` in our mapping
  std::shared_ptr<void> map;  // the mapping (a mapping, or an import), held by accesses in flight too
};

// A connection's copy queue (device_hooks: a stream), opened on its first
// GPU copy, closed with the connection.
struct gpu_queue {
  const device_hooks* hooks = nullptr;
  void* q = nullptr;
  gpu_queue() = default;
  gpu_queue(const gpu_queue&) = delete;
  gpu_queue& operator=(const gpu_queue&) = delete;
  ~gpu_queue() {
    if (q) hooks->close_queue(q);
  }
};

// Regions remembered per connection, and queries outstanding at once: a
// peer's answers are bounded, and so is what they cost us.
inline constexpr std::size_t max_peer_regions = 1024;
inline constexpr std::size_t max_queries = 32;
// Direct accesses between two looks at the socket for the peer's hang-up:
// a loop of accesses that never suspends still learns of the peer's death.
inline constexpr unsigned hangup_check_every = 64;

struct conn_ext {
  std::shared_ptr<domain_state> dom;
  int service_fd = -1;                     // our end of the service channel
  const std::uint64_t* peer_keys = nullptr;  // the peer's key table, mapped read-only
  std::unordered_map<std::uint32_t, peer_region> regions;
  std::size_t queries = 0;  // outstanding
  std::unordered_map<std::uint32_t, bool> asked;
  bool peer_gone = false;  // the socket reported the peer's hang-up: the engine reads what is left
  unsigned since_check = 0;
  endpoint named;  // what the application connected to (empty: accepted)

  // The ordered lane (device.cpp). Operations that cannot be done at once
  // (a GPU copy, an access waiting for the peer's answer, anything posted
  // while either is pending) queue here in order, so that none overtakes
  // an earlier one (RC order), and leave it once started.
  std::deque<std::uint64_t> lane;  // tickets, first: the one that may start
  std::uint64_t next_ticket = 0;
  std::size_t gpu_inflight = 0;  // copies enqueued, not yet complete
  bool service_over = false;     // the service loop ended: no more answers
  // The local_connection is gone (dropped with operations in the lane):
  // a lane coroutine resumed after that must not touch it, and ends.
  bool dropped = false;
  event changed;                 // pulsed when any of the above moves, or an answer comes
  void pulse() noexcept {
    changed.set();
    changed.reset();
  }
  bool ordered_busy() const noexcept { return !lane.empty() || gpu_inflight != 0; }
  gpu_queue copies;

  conn_ext() = default;
  conn_ext(const conn_ext&) = delete;
  conn_ext& operator=(const conn_ext&) = delete;
  ~conn_ext();

  std::uint64_t peer_key(std::uint32_t slot) const noexcept {
    return std::atomic_ref<const std::uint64_t>(peer_keys[slot]).load(std::memory_order_acquire);
  }
  // Asks the peer about `rkey` (once; bounded). Failures are silent: the
  // access goes through the socket anyway.
  void ask(std::uint32_t rkey) noexcept;
};

// Our ticket's place in the lane, given up once the operation has started
// (or given up on).
struct lane_place {  // (device.cpp)
  conn_ext& x;
  std::uint64_t ticket;
  bool in = true;
  void leave() noexcept {
    if (!in) return;
    in = false;
    if (auto it = std::find(x.lane.begin(), x.lane.end(), ticket); it != x.lane.end()) x.lane.erase(it);
    x.pulse();
  }
  ~lane_place() { leave(); }
};

inline conn_ext& ext_of(tp::conn_state& s) noexcept { return *static_cast<conn_ext*>(s.ext.get()); }

// The local hello (local_wire.hpp), then the engine's, on `sock`: the
// engine's state with our conn_ext in it (not started).
task<result<std::shared_ptr<tp::conn_state>>> handshake(tcp_socket& sock, std::shared_ptr<domain_state> dom,
                                                        connection_options opts, local_wire::role me);

// Serves the peer's queries and takes its answers (service.cpp): one of the
// engine's tasks, stopped with it.
task<void> service_loop(std::shared_ptr<tp::conn_state> s);

// The connection object for a started conn_state (connection.cpp).
connection make_local_connection(std::shared_ptr<tp::conn_state> s);

}  // namespace shuttle::detail::local_provider
