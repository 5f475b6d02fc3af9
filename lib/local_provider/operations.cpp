// One-sided operations on the peer's shared regions, done here: a memcpy or
// an std::atomic_ref on our mapping (conn_state.hpp says when). Anything
// else, and anything that does not check out here (an unknown key, a range
// or right the region lacks, a misaligned atomic), goes to the engine,
// whose target-side checks and errors are the provider's: what is refused
// there is refused as on the tcp provider (remote_access_error, and the
// connection fails).
#include "connection.hpp"
#include "stats.hpp"

#include <poll.h>

#include <atomic>
#include <cstring>

namespace shuttle::detail {
namespace {
thread_local std::uint64_t direct_accesses = 0;  // a domain and its connections belong to one thread
}
std::uint64_t local_direct_accesses() noexcept { return direct_accesses; }
}  // namespace shuttle::detail

namespace shuttle::detail::local_provider {

local_connection::local_connection(std::shared_ptr<tp::conn_state> s) noexcept
    : connection_impl(launch_table_of<local_connection>), s_(s), x_(ext_of(*s)), inner_(std::move(s)) {}

bool local_connection::peer_hung_up() noexcept {
  if (x_.peer_gone) return true;
  if (++x_.since_check < hangup_check_every) return false;
  x_.since_check = 0;
  pollfd p{s_->sock.native_handle(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) x_.peer_gone = true;
  return x_.peer_gone;
}

std::byte* local_connection::direct(const remote_buffer& r, std::size_t len, unsigned right) noexcept {
  const tp::conn_state& s = *s_;
  // RC order: nothing of ours may be queued or in flight in the engine
  // (an access done here would overtake it).
  if (len == 0 || len > tp::max_rdma_length || s.state() != tp::conn_state::phase::open || !s.pending.empty() || s.slot_waiters ||
      s.credit_waiters || s.responder_waiters)
    return nullptr;
  auto it = x_.regions.find(r.rkey);
  if (it == x_.regions.end()) {
    x_.ask(r.rkey);  // this access goes through the socket; later ones may not
    return nullptr;
  }
  const peer_region& pr = it->second;
  if (!pr.ok || (pr.access & right) != right || r.address < pr.addr) return nullptr;
  const std::uint64_t off = r.address - pr.addr;
  if (off > pr.length || len > pr.length - off) return nullptr;
  // Still registered? (A word that no longer holds the key: the region, or
  // its block, is gone at the peer; the engine refuses the access.)
  if (x_.peer_key(pr.slot) != pr.rkey) {
    x_.regions.erase(it);
    return nullptr;
  }
  if (peer_hung_up()) return nullptr;  // the engine reads what the peer left, then fails
  ++direct_accesses;
  return pr.at + off;
}

void local_connection::write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) {
  if (std::byte* p = direct(remote, local.size(), access::remote_write)) {
    std::memcpy(p, local.data(), local.size());
    out.set_result({});
    return;
  }
  inner_.write(out, local, remote);
}

void local_connection::read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) {
  if (std::byte* p = direct(remote, local.size(), access::remote_read)) {
    std::memcpy(local.data(), p, local.size());
    out.set_result({});
    return;
  }
  inner_.read(out, local, remote);
}

void local_connection::compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                                        std::uint64_t desired) {
  if (remote.address % 8 == 0) {
    if (std::byte* p = direct(remote, 8, access::remote_atomic)) {
      std::atomic_ref<std::uint64_t> word(*reinterpret_cast<std::uint64_t*>(p));
      word.compare_exchange_strong(expected, desired);  // `expected`: the value found
      out.set_result(expected);
      return;
    }
  }
  inner_.compare_and_swap(out, remote, expected, desired);
}

void local_connection::fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
  if (remote.address % 8 == 0) {
    if (std::byte* p = direct(remote, 8, access::remote_atomic)) {
      std::atomic_ref<std::uint64_t> word(*reinterpret_cast<std::uint64_t*>(p));
      out.set_result(word.fetch_add(add));
      return;
    }
  }
  inner_.fetch_and_add(out, remote, add);
}

}  // namespace shuttle::detail::local_provider
