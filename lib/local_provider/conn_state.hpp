// A local-provider connection's own state (internal), next to the tcp
// engine's conn_state (lib/tcp_provider/conn_state.hpp), which runs the
// connection over the Unix socket: two-sided operations, one-sided ones on
// memory that is not shared, batches, prepared operations, grants, errors,
// close and teardown, all with the tcp provider's semantics.
//
// What is local: the peer's shared regions, mapped here. The first access
// to an rkey goes through the socket and asks the peer, on the service
// channel, whether it may be mapped (service.cpp); once the answer is in,
// accesses to it are done here (operations.cpp): a memcpy or an
// std::atomic_ref on the mapping, checked against the region's bounds and
// rights and against the peer's key-table word (still registered?), and
// only while nothing of ours is in flight in the engine (RC order: an
// access done here must not overtake one still queued there).
#pragma once

#include "domain_state.hpp"
#include "local_wire.hpp"

#include "../tcp_provider/conn_state.hpp"

#include <cstdint>
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
  std::uint32_t rkey = 0;
  std::uint32_t slot = 0;
  std::uint32_t access = 0;
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  std::byte* at = nullptr;  // `addr` in our mapping
  std::shared_ptr<mapping> map;
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
