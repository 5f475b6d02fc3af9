// One-sided operations on the peer's shared regions, done here: a memcpy or
// an std::atomic_ref on our mapping (conn_state.hpp says when; GPU memory
// and the lane: device.cpp). Anything
// else, and anything that does not check out here (an unknown key, a range
// or right the region lacks, a misaligned atomic), goes to the engine,
// whose target-side checks and errors are the provider's: what is refused
// there is refused as on the tcp provider (remote_access_error, and the
// connection fails).
#include "connection.hpp"
#include "stats.hpp"

#include <poll.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
  if (!pr.ok || pr.gpu || (pr.access & right) != right || r.address < pr.addr) return nullptr;
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

// Writes and reads. Host memory on both sides: a memcpy on our mapping, as
// direct() allows. GPU memory on either side (device_hooks.hpp): a copy on
// the GPU, from the lane (device.cpp), never through the socket (the
// engine's CPU copies would fault on it): what the socket would have done
// fails with a reason instead. An rkey not answered yet waits for the
// answer (a GPU region cannot be reached through the socket meanwhile).
local_connection::route local_connection::plan(const remote_buffer& r, const std::byte* local, std::size_t len,
                                               unsigned right) noexcept {
  const device_hooks* h = installed_device_hooks();
  const bool local_dev = is_device_memory(h, *x_.dom, local, len);
  const auto fail = [](std::error_code ec) { return route{route::how::fail, nullptr, ec}; };
  const route engine = local_dev ? fail(make_error_code(errc::unregistered_device_memory)) : route{};
  const tp::conn_state& s = *s_;
  if (len == 0 || len > tp::max_rdma_length) return route{};  // the engine refuses it without touching it
  if (s.state() != tp::conn_state::phase::open) return local_dev ? fail(s.later_error()) : route{};
  auto it = x_.regions.find(r.rkey);
  if (it == x_.regions.end()) return x_.service_over ? engine : route{route::how::ask};
  const peer_region& pr = it->second;
  if (pr.unusable) return fail(pr.unusable);
  if (!pr.ok) return engine;
  const bool gpu = pr.gpu;
  const auto refused = gpu ? fail(make_error_code(errc::remote_access_error)) : engine;
  if ((pr.access & right) != right || r.address < pr.addr) return refused;
  const std::uint64_t off = r.address - pr.addr;
  if (off > pr.length || len > pr.length - off) return refused;
  if (x_.peer_key(pr.slot) != pr.rkey) {  // deregistered at the peer
    x_.regions.erase(it);
    return refused;
  }
  if (gpu || local_dev) return route{route::how::gpu, pr.at + off};
  // RC order: nothing of ours may be queued or in flight in the engine.
  if (!s.pending.empty() || s.slot_waiters || s.credit_waiters || s.responder_waiters) return route{};
  if (peer_hung_up()) return route{};  // the engine reads what the peer left, then fails
  ++direct_accesses;
  return route{route::how::host, pr.at + off};
}

void local_connection::write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) {
  if (!x_.ordered_busy()) {
    auto rt = plan(remote, local.data(), local.size(), access::remote_write);
    if (rt.how == route::how::host) {
      std::memcpy(rt.at, local.data(), local.size());
      out.set_result({});
      return;
    }
    if (rt.how == route::how::engine) return inner_.write(out, local, remote);
    if (rt.how == route::how::fail) return out.set_result(rt.ec);
  }
  // A GPU copy, an access waiting for the peer's answer, or one behind them.
  out.set_task(in_lane_void({lane_op::kind::write, const_cast<std::byte*>(local.data()), local.size(), remote}));
}

void local_connection::read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) {
  if (!x_.ordered_busy()) {
    auto rt = plan(remote, local.data(), local.size(), access::remote_read);
    if (rt.how == route::how::host) {
      std::memcpy(local.data(), rt.at, local.size());
      out.set_result({});
      return;
    }
    if (rt.how == route::how::engine) return inner_.read(out, local, remote);
    if (rt.how == route::how::fail) return out.set_result(rt.ec);
  }
  out.set_task(in_lane_void({lane_op::kind::read, local.data(), local.size(), remote}));
}

// A batch (a block list) on the peer's shared host regions: each write or
// read from the first on is a memcpy here, as a single one would be, until
// one is not (another kind, memory not shared, a key not answered yet: it
// is asked for now, a refused range or right: the engine refuses it), from
// which one on the engine takes the rest, in order (what was done here is
// done before anything of the rest is sent). plan() checks the first
// operation on a region; the ones after it on the same region are checked
// against the same answer (bounds, rights) without looking it up again, as
// the key word and the connection's state cannot have changed meanwhile in
// a way that matters to this loop, which does not suspend (an access begun
// before a deregistration may complete, README.md).
std::size_t local_connection::direct_run(std::span<const operation> ops) noexcept {
  const peer_region* pr = nullptr;  // the region of the operation before, checked by plan()
  std::size_t i = 0;
  for (; i < ops.size(); ++i) {
    const operation& o = ops[i];
    const bool w = o.op == operation::type::write;
    if (!w && o.op != operation::type::read) break;
    const unsigned right = w ? access::remote_write : access::remote_read;
    const std::size_t len = o.local.size();
    std::byte* at = nullptr;
    if (pr && pr->rkey == o.remote.rkey) {
      if (len == 0 || len > tp::max_rdma_length || (pr->access & right) != right || o.remote.address < pr->addr)
        break;
      const std::uint64_t off = o.remote.address - pr->addr;
      if (off > pr->length || len > pr->length - off) break;
      at = pr->at + off;
      ++direct_accesses;
    } else {
      auto rt = plan(o.remote, o.local.data(), len, right);
      if (rt.how != route::how::host) {
        if (rt.how == route::how::ask) x_.ask(o.remote.rkey);  // later lists may be done here
        break;
      }
      at = rt.at;
      pr = &x_.regions.find(o.remote.rkey)->second;  // plan() found it (node addresses are stable)
    }
    if (w)
      std::memcpy(at, o.local.data(), len);
    else
      std::memcpy(const_cast<std::byte*>(o.local.data()), at, len);
  }
  return i;
}

namespace {

// A list of some MiB is copied with streaming stores, past the caches: a
// memcpy per block cannot know the list is large, and such a list's copies,
// a memcpy each, fall behind one memcpy of its bytes; streamed, they keep up
// (a list larger than the L2 loses little by not leaving its bytes there).
// Measured (docs/measurements.md, 2026-12-07): 1,000 shuffled
// 64 KiB blocks at 0.77 of one 64 MiB memcpy with a memcpy each, 1.08 with
// streaming stores; 1,000 x 4 KiB at 0.87 (read) and 0.95 (write) of one
// 4 MiB memcpy, 0.98 and 1.19 streamed (H100 machine).
constexpr std::uint64_t stream_list_bytes = 2 << 20, stream_run_bytes = 4 << 10;

#if defined(__SSE2__)
void stream_copy(std::byte* dst, const std::byte* src, std::size_t n) noexcept {
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
  std::memcpy(dst, src, head);  // (n > head: runs are at least stream_run_bytes)
  dst += head;
  src += head;
  n -= head;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
}
#endif

// Whether the list moves at least stream_list_bytes (the sum taken only
// where its first block says it may).
bool large_list(const block* blocks, std::size_t n) noexcept {
  if (n * blocks[0].length < stream_list_bytes / 2) return false;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) total += blocks[i].length;
  return total >= stream_list_bytes;
}

// The copies of a checked, non-empty list on our mapping of the remote
// region (at `remote`), a memcpy per run of adjacent blocks (merged as the
// generic path merges them); returns how many. Not in the coroutine: its
// counters stay in registers across the memcpy calls.
std::size_t copy_blocks(const block_list& l, std::byte* remote) noexcept {
  const block* blocks = l.blocks.data();
  const std::size_t n = l.blocks.size();
  std::byte* const local = l.base;
  const bool write = l.write;
  std::size_t ops = 0;
  std::uint64_t local_at = blocks[0].local_offset, remote_at = blocks[0].remote_offset, length = blocks[0].length;
#if defined(__SSE2__)
  const bool stream = large_list(blocks, n);
#else
  const bool stream = false;
#endif
  const auto copy = [&] {
    std::byte* to = write ? remote + remote_at : local + local_at;
    const std::byte* from = write ? local + local_at : remote + remote_at;
#if defined(__SSE2__)
    if (stream && length >= stream_run_bytes)
      stream_copy(to, from, length);
    else
#endif
      std::memcpy(to, from, length);
    ++ops;
  };
  for (std::size_t i = 1; i < n; ++i) {
    const block b = blocks[i];
    if (extends(b, local_at + length, remote_at + length, length)) {
      length += b.length;
      continue;
    }
    copy();
    local_at = b.local_offset;
    remote_at = b.remote_offset;
    length = b.length;
  }
  copy();
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // the streamed stores before whatever says the list is done
#endif
  return ops;
}
}  // namespace

// A block list. On a peer's shared host region whose answer covers the
// whole remote_buffer, with nothing of ours in the engine or the lane (as
// direct_run's conditions, checked once for the list: it has one region):
// the list checked, then a memcpy per run of adjacent blocks, no operation
// built. To a region that is not shared: the engine's list frames (the key
// asked for first where it is not known, as direct_run does). Anything else
// (GPU memory, a lane to wait in, a notification on a shared region: its
// message goes through the engine after the copies, a remote_buffer that
// claims more than the answer covers, a block the engine would refuse) as
// the generic path, through batch(), whose results it keeps.
task<block_result> local_connection::transfer_blocks(block_list l) {
  const device_hooks* h = installed_device_hooks();
  const tp::conn_state& s = *s_;
  // (A named task around co_await, not a temporary: see batch().)
  enum class via { here, generic, engine } how = via::here;
  auto it = x_.regions.find(l.remote.rkey);
  if (x_.ordered_busy() || is_device_memory(h, *x_.dom, l.base, l.size)) {
    how = via::generic;
  } else if (it == x_.regions.end()) {
    if (h && !x_.service_over) {
      how = via::generic;  // batch() waits for the answer (GPU memory?)
    } else {
      if (!x_.service_over) x_.ask(l.remote.rkey);  // later lists may be done here
      how = via::engine;
    }
  } else if (!it->second.ok && !it->second.gpu && !it->second.unusable) {
    how = via::engine;
  }
  if (how == via::generic) {
    auto t = connection_impl::transfer_blocks(l);
    co_return co_await std::move(t);
  }
  if (how == via::engine) {
    auto t = inner_.transfer_blocks(l);
    co_return co_await std::move(t);
  }
  const peer_region& pr = it->second;
  const unsigned right = l.write ? access::remote_write : access::remote_read;
  const remote_buffer& r = l.remote;
  if (l.notify || !pr.ok || pr.gpu || (pr.access & right) != right || r.address < pr.addr || r.address - pr.addr > pr.length ||
      r.length > pr.length - (r.address - pr.addr) || s.state() != tp::conn_state::phase::open ||
      !s.pending.empty() || s.slot_waiters || s.credit_waiters || s.responder_waiters ||
      x_.peer_key(pr.slot) != pr.rkey || peer_hung_up())
    how = via::generic;
  std::uint64_t longest = 0;
  if (how == via::here) {
    if (auto bad = check_blocks(l, longest); !bad) co_return bad;
    if (longest > tp::max_rdma_length) how = via::generic;  // the engine refuses it
  }
  if (how == via::generic) {
    auto t = connection_impl::transfer_blocks(l);
    co_return co_await std::move(t);
  }
  const std::size_t ops = copy_blocks(l, pr.at + (r.address - pr.addr));
  direct_accesses += ops;
  count_block_list(l.blocks.size(), ops);
  co_return block_result{};
}

void local_connection::compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                                        std::uint64_t desired) {
  if (x_.ordered_busy())
    return out.set_task(in_lane({lane_op::kind::cas, nullptr, 8, remote, 0, expected, desired}));
  cas_now(out, remote, expected, desired);
}

void local_connection::fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
  if (x_.ordered_busy()) return out.set_task(in_lane({lane_op::kind::faa, nullptr, 8, remote, 0, add}));
  faa_now(out, remote, add);
}

namespace {
// Atomics on a peer's GPU memory: no CPU word to take, and the engine
// cannot reach it either.
bool on_gpu(const conn_ext& x, std::uint32_t rkey) {
  auto it = x.regions.find(rkey);
  return it != x.regions.end() && it->second.gpu;
}
}  // namespace

void local_connection::cas_now(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                               std::uint64_t desired) {
  if (on_gpu(x_, remote.rkey)) return out.set_result(make_error_code(errc::not_supported));
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

void local_connection::faa_now(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
  if (on_gpu(x_, remote.rkey)) return out.set_result(make_error_code(errc::not_supported));
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
