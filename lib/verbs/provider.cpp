// The verbs provider: rdma-core (libibverbs + librdmacm) on the io_uring loop.
//
// Beside this file: device.hpp (device, port and GID selection, shared with
// the device listing), cm_events.hpp (rdma_cm events, the hello, reject
// reasons), fd_watch.hpp (fds the loop watches), registration.hpp (regions,
// staging slots, the search for a covering registration).
//
// Pieces:
//  - core: one device context, its protection domain, one completion channel
//    and one CQ shared by every QP of the domain. The CQ is a poller of the
//    loop (hybrid policy: busy-polled while work is in flight, for up to the
//    domain's budget after the last completion; then ibv_req_notify_cq, poll
//    once more to close the re-arm race, and sleep with the channel fd
//    watched by an IORING_OP_POLL_ADD; CQ events are acked in batches).
//  - conn_state: one RC QP set up through rdma_cm, with its own event channel
//    whose fd the loop watches; receive pool kept posted; send-queue slots and
//    receive credits as loop-local semaphores; a dying state stays in the
//    core's graveyard until every posted WR came back (flushed), so no work
//    completion ever names freed memory.
//  - operations: one signaled WR each, whose wr_id is a wr_ctx kept in the
//    awaiting frame (connection_op.hpp); the awaiter resumes (through
//    io_context::post) when its completion is reaped. Inline sends instead
//    complete once posted, unsignaled but for one settling WR per quarter of
//    the send queue (conn_state::settle). Cancellation moves the QP to error
//    and waits for the flushed completion (NIC-safe).
//  - credits: each side starts with the peer's posted receive count. Freed
//    receive buffers are reposted and returned to the peer piggybacked on
//    sends (SEND_WITH_IMM, imm = credits) or, in batches, by a zero-length
//    control message to a few reserved extra receives.
//  - shared receive queue (connection_options::shared_receive_queue): one
//    ibv_srq per core, created by the first such connection; its pool of
//    buffers grows so that it always holds the sum of the live connections'
//    grants (receive_buffers + the control reserve), which is what their
//    peers may consume: credits keep RNR impossible. A receive completion
//    names its QP (wc.qp_num -> connection); the freed buffer goes back to
//    the SRQ and the credit to that connection.
//  - batches (post_batch): chunks of chained WRs, one ibv_post_send each,
//    only the last WR signaled; the chunk holds its send-queue slots until
//    that completion. Unsignaled WRs name the chunk's `early` context, which
//    only ever sees error/flush completions (they come before the chunk's
//    signaled one, RC completes in order).
#include "../spin_clock.hpp"
#include "../transport/provider.hpp"
#include "cm_events.hpp"
#include "fd_watch.hpp"
#include "registration.hpp"
#include "device.hpp"
#include <shuttle/detail/loop_cancel.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/timer.hpp>
#include <shuttle/verbs/verbs.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <vector>

namespace shuttle::detail {
namespace {

using namespace verbs_impl;


constexpr std::uint32_t ctrl_reserve = 2;            // extra receives (and send slots) for credit messages
constexpr std::uint32_t ctrl_flag = 0x80000000u;     // imm of a control message
// A connection posts this many user receives at first (the peer's initial
// credits, announced in the hello) and doubles them as messages arrive, up
// to receive_buffers; each receive added is a credit for the peer once it
// is posted. A peer that connects and sends nothing holds this one and the
// control receives, not the pool. Operations post in call order however
// short credits run (post_order).
constexpr std::uint32_t initial_receives = 1;
// RNR retries of this side's QPs (and what it asks of the peer's): credits
// keep receives posted ahead of sends, so an RNR NAK means a peer that does
// not post what it announced; 7 would retry forever.
constexpr std::uint8_t rnr_retries = 3;
constexpr unsigned ack_batch = 64;

std::error_code last_errno() noexcept { return errno_code(errno ? errno : EIO); }
std::error_code disconnected() noexcept { return make_error_code(errc::disconnected); }

// The failing operation's error. The neutral API promises
// errc::remote_access_error for a refused one-sided access, and callers (the
// conformance suite) compare error_codes strictly, so that status is returned
// in shuttle's category; every other status keeps its verbs code (message:
// ibv_wc_status_str), equivalent to the neutral conditions.
std::error_code wc_error(ibv_wc_status s) noexcept {
  if (s == IBV_WC_REM_ACCESS_ERR) return make_error_code(errc::remote_access_error);
  return verbs::make_wc_error(s);
}

bool set_nonblock(int fd) noexcept {
  int fl = fcntl(fd, F_GETFL);
  return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

// The target of a WR: work completions carry its address as wr_id.
struct wr_ctx {
  void (*on_wc)(wr_ctx* self, const ibv_wc& wc) noexcept = nullptr;
};

struct conn_state;
struct core;
struct verbs_grant;

// ------------------------------------------------------------------ receive pool

struct recv_pool;
struct recv_slot : wr_ctx {
  recv_pool* pool = nullptr;
  std::byte* addr = nullptr;
  std::uint32_t lkey = 0;
  std::uint32_t qp_num = 0;  // SRQ: the QP that consumed it (its connection gets the credit back)
};

// Receive buffers: a connection's own (conn set) or the SRQ's of a core
// (srq_core set). Refcounted: the owner + one per message handed out.
struct recv_pool {
  std::shared_ptr<pd_holder> pd;
  conn_state* conn = nullptr;  // own pool: null once the connection is gone
  core* srq_core = nullptr;    // SRQ pool: null once the core is gone
  std::size_t slot_size = 0;
  std::vector<std::pair<std::byte*, ibv_mr*>> slabs;
  std::deque<recv_slot> slots;  // stable addresses: a posted receive's wr_id names its slot
  std::size_t refs = 1;

  ~recv_pool() {
    for (auto& [b, mr] : slabs) {
      if (mr) ibv_dereg_mr(mr);
      std::free(b);
    }
  }
  void unref() noexcept {
    if (--refs == 0) delete this;
  }
  // Adds n slots in one registered slab; returns the index of the first.
  result<std::uint32_t> grow(std::uint32_t n, void (*on_wc)(wr_ctx*, const ibv_wc&) noexcept) {
    std::size_t bytes = (n * slot_size + 4095) & ~std::size_t(4095);
    auto* buf = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
    if (!buf) return make_error_code(std::errc::not_enough_memory);
    slabs.emplace_back(buf, nullptr);
    ibv_mr* mr = ibv_reg_mr(pd->pd, buf, bytes, static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
    if (!mr) return last_errno();
    slabs.back().second = mr;
    auto first = static_cast<std::uint32_t>(slots.size());
    for (std::uint32_t i = 0; i < n; ++i) {
      recv_slot& sl = slots.emplace_back();
      sl.pool = this;
      sl.addr = buf + std::size_t(i) * slot_size;
      sl.lkey = mr->lkey;
      sl.on_wc = on_wc;
    }
    return first;
  }
  static void release(void* owner, std::uint64_t slot) noexcept;
};

// The receive work request of a slot: its whole buffer, wr_id naming the slot.
void fill_recv_wr(recv_slot& s, ibv_recv_wr& wr, ibv_sge& sge) noexcept {
  sge = {reinterpret_cast<std::uintptr_t>(s.addr), static_cast<std::uint32_t>(s.pool->slot_size), s.lkey};
  wr = {};
  wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&s));
  wr.sg_list = &sge;
  wr.num_sge = 1;
}

// ------------------------------------------------------------------ core

struct core final : poller, std::enable_shared_from_this<core> {
  std::shared_ptr<pd_holder> pdh;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  int cq_size = 0;
  int cq_reserved = 0;
  ibv_device_attr dattr{};
  std::uint32_t max_msg = 0;  // the port's max_msg_sz: the largest buffer size a peer may announce
  std::uint8_t port = 1;
  int gid_index = -1;
  std::string name, gid_text;

  io_context* loop = nullptr;
  fd_watch* cq_watch = nullptr;
  bool notify_armed = false;
  unsigned unacked = 0;
  std::chrono::nanoseconds budget = std::chrono::microseconds(200);
  // When the last completion was seen, stamped lazily: poll() only counts
  // (a clock read per poll is microseconds where the clock is HPET, as in
  // a TCG guest); the stamp is taken when the loop next wants to sleep.
  std::int64_t last_wc = 0;  // spin_clock ns
  std::uint64_t wc_seen = 0, wc_stamped = 0;
  std::size_t inflight = 0;
  std::vector<std::shared_ptr<conn_state>> graveyard;
  verbs::domain_stats st{};

  // The user's registrations (weak: alive while the user holds one),
  // found by address for operations on memory they cover. Nothing else is
  // cached: other memory is staged or registered per operation (transient).
  std::multimap<std::uintptr_t, std::weak_ptr<verbs_region>> user_regs;
  std::uint64_t reg_seq = 0;
  std::size_t device_registrations = 0;  // dma-buf registrations ever made
  std::shared_ptr<staging_pool> staging;  // made on first use
  // The staging lease or transient registration that find_region made for
  // the operation being built: the operation takes it (take_hold) and holds
  // it until it completes.
  std::shared_ptr<verbs_region> op_owned;

  // Shared receive queue (created on first use), its buffers, and who uses it.
  ibv_srq* srq = nullptr;
  recv_pool* srq_pool = nullptr;
  std::uint32_t srq_cap = 0;      // the SRQ's max_wr
  std::uint64_t srq_granted = 0;  // sum of the live connections' grants
  // qp_num -> connection, for every QP of this core: an SRQ's receive
  // completion and an unsignaled send's error completion name only their QP.
  std::map<std::uint32_t, conn_state*> qp_conns;
  conn_state* conn_of(std::uint32_t qp_num) const noexcept {
    auto it = qp_conns.find(qp_num);
    return it == qp_conns.end() ? nullptr : it->second;
  }
  std::size_t rx_waiters = 0;  // recv() calls waiting: a reason to keep busy-polling

  // Receive buffers whose messages were released, posted again at the next
  // poll (one ibv_post_recv per connection for all of them): a released
  // message costs no post on the latency path between a receive and the
  // send that answers it. Credits go back only for posted buffers.
  std::vector<conn_state*> repost_conns;  // connections with released buffers
  std::vector<recv_slot*> srq_released;   // SRQ buffers released
  void flush_reposts() noexcept;

  ~core() override {
    if (loop) loop->backend().remove_poller(*this);
    if (cq_watch) cq_watch->destroy();
    op_owned.reset();
    // Every QP is gone (each held a reference to this core): the SRQ can go.
    if (srq) ibv_destroy_srq(srq);
    if (srq_pool) {
      srq_pool->srq_core = nullptr;
      srq_pool->unref();
    }
    if (cq) {
      if (unacked) ibv_ack_cq_events(cq, unacked);
      ibv_destroy_cq(cq);
    }
    if (channel) ibv_destroy_comp_channel(channel);
  }

  void attach() {
    if (loop) return;
    loop = &io_context::current();
    loop->backend().add_poller(*this);
    cq_watch = new fd_watch(channel->fd, &on_cq_event, this);
    cq_watch->arm(*loop);
  }

  static void on_cq_event(void* arg) noexcept {
    auto* self = static_cast<core*>(arg);
    ibv_cq* ev_cq;
    void* ev_ctx;
    while (ibv_get_cq_event(self->channel, &ev_cq, &ev_ctx) == 0) {
      ++self->unacked;
      ++self->st.cq_events;
      self->notify_armed = false;
    }
    if (self->unacked >= ack_batch) {
      ibv_ack_cq_events(self->cq, self->unacked);
      self->unacked = 0;
    }
    self->cq_watch->arm(*self->loop);
  }

  // An empty CQ is looked at again a few times before the loop goes on: a
  // turn of the loop costs several times an empty ibv_poll_cq, so a loop
  // that spins for completions notices one sooner (and, in an emulated
  // guest, runs far less code per look).
  bool poll() override {
    inline_wrs = 0;
    if (!repost_conns.empty() || !srq_released.empty()) flush_reposts();
    for (int i = 0; i < empty_polls_per_turn; ++i)
      if (poll_cq()) return true;
    return false;
  }
  static constexpr int empty_polls_per_turn = 8;
  // A look at the CQ from an operation of `wrs` work requests just posted
  // (see finish_setup). For at most 32 work requests between two turns of
  // the loop: an operation that completes at once does not suspend, so a
  // coroutine issuing them in a row would otherwise never let the loop (its
  // timers, the other coroutines) run. 32 small operations are ~100 us on a
  // NIC; a suspension costs the latency path two reference counts and a turn
  // of the loop (at 8: 30 user-space instructions more per read_lat round
  // trip). A batch counts its work requests.
  [[gnu::always_inline]] void poll_inline(unsigned wrs = 1) {
    if (take_inline_look(wrs)) poll_cq_inlined();
  }
  // One of the loop turn's inline looks, if any is left (poll_inline; a
  // prepared start's latency path decides on it before it posts).
  [[gnu::always_inline]] bool take_inline_look(unsigned wrs = 1) noexcept {
    if (inline_wrs >= max_inline_wrs) return false;
    inline_wrs += wrs;
    return true;
  }
  static constexpr unsigned max_inline_wrs = 32;
  unsigned inline_wrs = 0;
  bool poll_cq();
  // poll_cq's body, inlined into each operation's launch (poll_inline) as
  // well: a call and an indirect call less on the latency path.
  [[gnu::always_inline]] inline bool poll_cq_inlined();
  // One completion to whatever waits for it (poll_cq's body).
  [[gnu::always_inline]] inline void dispatch(const ibv_wc& wc) noexcept;
  // `n` completions taken from the CQ: the statistics, and the busy-poll
  // budget's "last completion seen" (try_enter_interrupt_mode).
  void count_seen(int n) noexcept {
    st.completions += static_cast<std::uint64_t>(n);
    ++wc_seen;
  }
  bool try_enter_interrupt_mode() override {
    if (!repost_conns.empty() || !srq_released.empty()) flush_reposts();  // never sleep on unposted buffers
    if (inflight > 0 || rx_waiters > 0) {
      const std::int64_t now = detail::spin_clock::now_ns();
      if (wc_seen != wc_stamped || now < last_wc) {
        wc_stamped = wc_seen;
        last_wc = now;
      }
      if (now - last_wc < budget.count()) return false;  // keep busy-polling
    }
    if (!notify_armed) {
      if (ibv_req_notify_cq(cq, 0) != 0) return false;
      notify_armed = true;
    }
    return !poll_cq();  // a completion that arrived before arming raises no event
  }
  void exit_interrupt_mode() override {}
  void reap_graveyard();
  void on_unsignaled_error(const ibv_wc& wc) noexcept;

  // Reserves `n` entries of the shared CQ for one connection, growing the CQ
  // if it can; false when they do not fit (that connection is refused or
  // stops growing, the others keep theirs).
  bool reserve_cq(int n) noexcept {
    if (cq_reserved + n > cq_size) {
      int want = std::min(dattr.max_cqe, std::max(cq_size * 2, cq_reserved + n));
      if (want < cq_reserved + n || ibv_resize_cq(cq, want) != 0) return false;
      cq_size = cq->cqe;
    }
    cq_reserved += n;
    return true;
  }

  result<void> srq_join(std::uint32_t grant, std::size_t slot_size);
  void srq_leave(std::uint32_t grant) noexcept { srq_granted -= grant; }
  result<void> post_srq(recv_slot& s) noexcept {
    ibv_sge sge;
    ibv_recv_wr wr;
    fill_recv_wr(s, wr, sge);
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_srq_recv(srq, &wr, &bad)) return errno_code(e);
    return {};
  }
  void on_srq_release(recv_slot& slot) noexcept { srq_released.push_back(&slot); }

  result<std::shared_ptr<verbs_region>> reg(std::span<std::byte> mem, unsigned flags) {
    unsigned a = normalize_access(flags);
    ibv_mr* mr = ibv_reg_mr(pd, mem.data(), mem.size(), static_cast<int>(a));
    if (!mr) return last_errno();
    ++st.registrations;
    auto r = std::make_shared<verbs_region>();
    r->mr = mr;
    r->pd = pdh;
    r->addr = mem.data();
    r->length = mem.size();
    r->access = a;
    r->lkey = mr->lkey;
    r->rkey = mr->rkey;
    return r;
  }

  // Memory windows (connection::grant): type 2 ones bound on a QP.
  bool has_type2_windows() const noexcept {
    return (dattr.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
  }

#ifdef SHUTTLE_HAVE_VERBS_DMABUF
  // Device memory exported as a dma-buf; the region's addresses are `iova`
  // (the device pointer), as operations and remote descriptors use them.
  result<memory_region> register_dmabuf(int fd, std::uint64_t offset, std::size_t length, std::uint64_t iova,
                                        unsigned flags) {
    unsigned a = normalize_access(flags);
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, static_cast<int>(a));
    if (!mr) return last_errno();
    ++st.registrations;
    auto r = std::make_shared<verbs_region>();
    r->mr = mr;
    r->pd = pdh;
    r->addr = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(iova));
    r->length = length;
    r->access = a;
    r->lkey = mr->lkey;
    r->rkey = mr->rkey;
    r->device_memory = true;
    ++device_registrations;
    add_user_region(r);
    return memory_region(r);
  }
#endif

  // True when `mem` lies in a registration of device memory.
  bool in_device_memory(std::span<const std::byte> mem) {
    if (device_registrations == 0) return false;  // host-only domains skip the lookup
    auto sp = find_cover(user_regs, reinterpret_cast<std::uintptr_t>(mem.data()), mem.size(), false);
    return sp && sp->device_memory;
  }

  // Every call registers anew, as ibv_reg_mr does: an earlier region of the
  // same range may describe pages that are no longer mapped there (its
  // memory freed while the user still held it), and nothing can tell.
  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) {
    auto r = reg(mem, flags);
    if (!r) return r.error();
    add_user_region(*r);
    return memory_region(*r);
  }
  void add_user_region(const std::shared_ptr<verbs_region>& r) {
    auto key = reinterpret_cast<std::uintptr_t>(r->addr);
    auto [b, e] = user_regs.equal_range(key);  // drop the expired ones of this address
    for (auto it = b; it != e;) it = it->second.expired() ? user_regs.erase(it) : std::next(it);
    r->seq = ++reg_seq;
    user_regs.emplace(key, r);
    // Operations find the newest registration covering their memory, not
    // the one they used last.
    last_region.reset();
    last_ptr = nullptr;
    last_base = last_end = 0;
  }

  void remember(const std::shared_ptr<verbs_region>& r) noexcept {
    last_region = r;
    last_ptr = r.get();
    last_base = reinterpret_cast<std::uintptr_t>(r->addr);
    last_end = last_base + r->length;
  }

  // The registration local_region found last: operations on one buffer in
  // a row skip the map walk. Weak, as the maps' user entries: it keeps no
  // registration alive, and one deregistered since has expired.
  std::weak_ptr<verbs_region> last_region;
  verbs_region* last_ptr = nullptr;  // last_region's object, while it has not expired
  std::uintptr_t last_base = 0, last_end = 0;

  // A registration covering `mem` for a local sge. For the user's memory,
  // not a reference: the registration is alive until user code runs again
  // (the user's handle holds it), which is all an operation that completes
  // while it is launched needs; one that waits takes a reference (hold).
  // No reference counting on the latency path of an operation on
  // registered memory. Other memory: see find_region.
  result<verbs_region*> local_region(std::span<const std::byte> mem, bool need_write, bool may_stage, ibv_sge& sge) {
    auto a = reinterpret_cast<std::uintptr_t>(mem.data());
    if (a >= last_base && a <= last_end && mem.size() <= last_end - a && !last_region.expired() &&
        (!need_write || (last_ptr->access & access::local_write))) {
      ++st.cache_hits;
      return last_ptr;
    }
    return find_region(mem, need_write, may_stage, sge);
  }
  // local_region past the last registration: a user registration covering
  // `mem`, else (memory the library cannot watch) a staging slot that the
  // bytes are copied into now (sge then points at it; `may_stage`: a send
  // or write source whose bytes may be taken now), else a registration for
  // this operation alone. Either is left in op_owned for the operation to
  // hold until it completes; neither is ever found by another operation.
  [[gnu::noinline]] result<verbs_region*> find_region(std::span<const std::byte> mem, bool need_write, bool may_stage,
                                                      ibv_sge& sge) {
    auto a = reinterpret_cast<std::uintptr_t>(mem.data());
    if (auto sp = find_cover(user_regs, a, mem.size(), need_write)) {
      ++st.cache_hits;
      remember(sp);
      return sp.get();
    }
    if (may_stage && !need_write && mem.size() <= staging_slot_size) {
      if (auto lease = stage(mem)) {
        sge.addr = reinterpret_cast<std::uintptr_t>(staging->mem) + std::uintptr_t(lease->slot) * staging_slot_size;
        op_owned = std::move(lease->hold);
        return staging->region.get();
      }
    }
    std::span<std::byte> m(const_cast<std::byte*>(mem.data()), mem.size());
    auto r = reg(m, access::local_write);
    if (!r && !need_write) r = reg(m, 0);  // read-only memory (a send source)
    if (!r) return r.error();
    ++st.transient_registrations;
    op_owned = std::move(*r);
    return op_owned.get();
  }
  struct staging_lease {
    std::uint32_t slot;
    std::shared_ptr<verbs_region> hold;
  };
  // `mem` copied into a free staging slot, if one is (the pool is made and
  // registered on first use).
  std::optional<staging_lease> stage(std::span<const std::byte> mem) {
    if (!staging) {
      const std::size_t bytes = std::size_t(staging_slots) * staging_slot_size;
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return std::nullopt;
      auto pool = std::make_shared<staging_pool>();
      pool->mem = static_cast<std::byte*>(p);
      auto r = reg({pool->mem, bytes}, 0);
      if (!r) return std::nullopt;  // the pool unmaps its pages
      pool->region = std::move(*r);
      pool->free_slots.reserve(staging_slots);
      for (std::uint32_t i = staging_slots; i > 0; --i) pool->free_slots.push_back(i - 1);
      staging = std::move(pool);
    }
    if (staging->free_slots.empty()) return std::nullopt;
    const std::uint32_t slot = staging->free_slots.back();
    staging->free_slots.pop_back();
    std::memcpy(staging->mem + std::size_t(slot) * staging_slot_size, mem.data(), mem.size());
    ++st.staged;
    // The slab's region, held as a lease: its deleter returns the slot.
    return staging_lease{slot, std::shared_ptr<verbs_region>(staging->region.get(), staging_return{staging, slot})};
  }
  // A reference to what local_region returned, for an operation that waits.
  static std::shared_ptr<verbs_region> hold(verbs_region* r) { return r ? r->shared_from_this() : nullptr; }
  // What an operation holds while it waits: the staging lease or transient
  // registration find_region just made, else a reference to `r`.
  std::shared_ptr<verbs_region> take_hold(verbs_region* r) {
    if (op_owned) return std::move(op_owned);
    return hold(r);
  }
};

// ------------------------------------------------------------------ connection state

struct conn_state final : std::enable_shared_from_this<conn_state> {
  std::shared_ptr<core> dom;
  connection_options opts;
  rdma_event_channel* ech = nullptr;
  rdma_cm_id* id = nullptr;
  ibv_qp* qp = nullptr;
  fd_watch* cm_watch = nullptr;
  int cq_reserve = 0;

  bool established = false, closed = false, error = false, qp_err = false, dying = false, reaped = false;
  bool usable_ = false;  // usable()
  bool disconnect_sent = false, woken = false;
  std::deque<cm_evt> events;
  event cm_event;

  recv_pool* pool = nullptr;
  struct rx_item {
    recv_slot* slot;
    std::uint32_t len;
    std::optional<std::uint32_t> imm;
  };
  std::deque<rx_item> rx;  // arrived, not yet taken (no recv() was waiting)
  // recv() calls waiting, oldest first: an arriving message goes straight to
  // the oldest (it then owns it, whatever else calls recv() before it runs).
  struct recv_waiter : wait_node {
    rx_item item{};  // handed over, not yet a message (built where the recv() resumes)
    bool has_msg = false;
  };
  wait_list receivers;
  // The message owns its buffer (and a reference to the buffer's pool) from
  // here on; built in the result, not moved there.
  static result<message> take_message(const rx_item& it) noexcept {
    ++it.slot->pool->refs;
    return adopt_message(it);
  }
  // The same, for a buffer whose pool reference is held already (a message
  // handed to a waiting recv(): the connection may be gone when it resumes).
  static result<message> adopt_message(const rx_item& it) noexcept {
    // The message's slot word is the buffer's recv_slot (see recv_pool::release).
    return result<message>(std::in_place, std::span<const std::byte>(it.slot->addr, it.len), it.imm,
                           &recv_pool::release, it.slot->pool, reinterpret_cast<std::uintptr_t>(it.slot));
  }

  semaphore sq{0};
  semaphore credits{0};
  std::uint32_t srq_grant = 0;  // SRQ: the receives this connection accounts for in the SRQ
  std::uint32_t qp_num = 0;
  std::size_t outstanding = 0;  // posted WRs (sends and receives) not completed yet
  std::size_t inflight_ops = 0;
  event drained;

  // Inline sends complete once posted: their bytes are in the work request,
  // so nothing waits for the NIC. They go unsignaled (wr_id 0), except every
  // settle_every-th, which is signaled and names `settle`: its completion
  // gives back the send-queue slots of the unsignaled ones before it (RC
  // completes a send queue in order). An unsignaled WR comes back only with
  // an error or a flush; poll_cq finds its connection by QP number.
  std::uint32_t unsignaled = 0;        // inline sends posted since the last settling WR
  std::uint32_t settle_every = 1;
  std::deque<std::uint32_t> settling;  // slots each posted settling WR gives back, oldest first
  struct settle_ctx : wr_ctx {
    conn_state* c = nullptr;
  } settle;
  ibv_send_wr inline_wr{};  // post_inline_send's work request (opcode and sge set once)
  ibv_sge inline_sge{};

  std::uint32_t peer_slots = 0, peer_buffer = 0, max_inline = 0;
  std::uint32_t peer_max_slots = 0;  // the peer's announced cap: credits held never exceed it
  std::uint32_t to_return = 0, ctrl_inflight = 0;
  // Own receive queue: user receives posted so far (the rest of the pool
  // comes as messages arrive, grow_receives); grow_pending: one is due.
  std::uint32_t user_slots = 0;
  bool grow_pending = false, grow_stopped = false;
  bool own_qp = false;        // created here (passive side), not by rdma_create_qp: its transitions are ours
  std::uint64_t rx_count = 0;  // receive completions: the listener's idle check
  std::error_code fail_reason;  // why it failed, when the connection's own fault (recv returns it)
  std::vector<recv_slot*> released;  // own receive queue: buffers to post again (core::flush_reposts)
  bool in_repost_list = false;
  struct ctrl_ctx : wr_ctx {
    conn_state* c = nullptr;
  } ctrl;

  std::vector<verbs_grant*> grants;  // memory windows bound on this QP (connection::grant)

  ibv_mr* scratch_mr = nullptr;
  std::uint64_t* scratch = nullptr;
  std::vector<std::uint32_t> scratch_free;

  conn_state(std::shared_ptr<core> d, connection_options o) : dom(std::move(d)), opts(o) {
    if (opts.send_queue_depth == 0) opts.send_queue_depth = 1;
    if (opts.receive_buffers == 0) opts.receive_buffers = 1;
    if (opts.receive_buffer_size == 0) opts.receive_buffer_size = 1;
    ctrl.c = this;
    ctrl.on_wc = &on_ctrl_wc;
    settle.c = this;
    settle.on_wc = &on_settle_wc;
    inline_wr.opcode = IBV_WR_SEND_WITH_IMM;
    inline_wr.sg_list = &inline_sge;
    // A quarter of the queue: at most that many slots wait to be given back.
    settle_every = std::max<std::uint32_t>(1, opts.send_queue_depth / 4);
    ++dom->st.live_connections;
  }
  ~conn_state() { reap(); }

  result<void> init_channel() {
    ech = rdma_create_event_channel();
    if (!ech) return last_errno();
    if (!set_nonblock(ech->fd)) return last_errno();
    cm_watch = new fd_watch(ech->fd, &on_cm, this);
    cm_watch->arm(*dom->loop);
    return {};
  }

  static void on_cm(void* arg) noexcept {
    auto* self = static_cast<conn_state*>(arg);
    auto keep = self->shared_from_this();  // a handler may drop the last other reference
    rdma_cm_event* e;
    while (self->ech && rdma_get_cm_event(self->ech, &e) == 0) {
      cm_evt c = copy_event(e);
      rdma_ack_cm_event(e);
      self->on_event(c);
    }
    if (self->cm_watch) self->cm_watch->arm(*self->dom->loop);
  }

  // Passive side: told when the handshake ends (true: established).
  // (an error: the handshake failed, and why).
  void (*on_accept_done)(void* listener, conn_state* st, std::error_code failed) noexcept = nullptr;
  void* acceptor = nullptr;

  void on_event(const cm_evt& e) {
    if (dying) return;
    if (acceptor && !established) {
      bool ok = e.type == RDMA_CM_EVENT_ESTABLISHED;
      if (ok) on_established();
      auto* l = std::exchange(acceptor, nullptr);
      on_accept_done(l, this, ok ? std::error_code{} : cm_error(e));
      return;
    }
    if (established && (e.type == RDMA_CM_EVENT_DISCONNECTED || e.type == RDMA_CM_EVENT_DEVICE_REMOVAL)) {
      // What the peer sent before it disconnected completed on its side,
      // so its receives' completions are in this side's CQ already; the
      // loop may reap this event before it polls them: take them first,
      // or a recv() fails "disconnected" with its message in the CQ.
      if (e.type == RDMA_CM_EVENT_DISCONNECTED) dom->poll_cq();
      fail(disconnected());
      return;
    }
    if (established) return;  // TIMEWAIT_EXIT and the like
    events.push_back(e);
    cm_event.set();
  }

  task<result<cm_evt>> next_event() {
    while (events.empty()) {
      if (dying) co_return make_error_code(std::errc::operation_canceled);
      cm_event.reset();
      if (auto r = co_await cm_event.wait(); !r) co_return r.error();
    }
    cm_evt e = events.front();
    events.pop_front();
    co_return e;
  }

  // The QP is created with ibv_create_qp and moved to INIT here, to RTR and
  // RTS by ready_qp, on both sides, so that its RNR retry count is this
  // side's: rdma_accept and rdma_connect would take the one the peer asked
  // for in its REQ or REP, maybe 7 (retry forever).
  result<void> create_qp() {
    if (id->verbs != dom->ctx) return make_error_code(errc::not_supported);  // another device
    const std::uint32_t n = opts.receive_buffers + ctrl_reserve;  // the QP's receive queue
    if (opts.shared_receive_queue) {
      if (auto r = dom->srq_join(n, opts.receive_buffer_size); !r) return r;
      srq_grant = n;
    }
    // Own receive queue: only the first few receives now (grow_receives).
    user_slots = srq_grant ? opts.receive_buffers : std::min(opts.receive_buffers, initial_receives);
    const std::uint32_t posted_now = srq_grant ? n : user_slots + ctrl_reserve;
    const int want_cq = static_cast<int>(opts.send_queue_depth + ctrl_reserve + 1 + posted_now);
    if (!dom->reserve_cq(want_cq)) return make_error_code(std::errc::no_buffer_space);
    cq_reserve = want_cq;

    ibv_qp_init_attr a{};
    a.send_cq = dom->cq;
    a.recv_cq = dom->cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = opts.send_queue_depth + ctrl_reserve + 1;  // + close()'s settling marker
    a.cap.max_recv_wr = srq_grant ? 0 : n;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = srq_grant ? 0 : 1;
    a.srq = srq_grant ? dom->srq : nullptr;
    a.cap.max_inline_data = opts.max_inline_data;
    a.sq_sig_all = 0;
    {
      qp = ibv_create_qp(dom->pd, &a);
      if (!qp) {  // some devices cap inline data: retry without it
        a.cap.max_inline_data = 0;
        qp = ibv_create_qp(dom->pd, &a);
      }
      if (!qp) return last_errno();
      own_qp = true;
      ibv_qp_attr qa{};
      int mask = 0;
      qa.qp_state = IBV_QPS_INIT;
      if (rdma_init_qp_attr(id, &qa, &mask) != 0) return last_errno();
      // The connecting side is here before the CM has a connection, and
      // rdma_init_qp_attr then gives no remote access (librdmacm's own
      // rdma_connect asks again before RTR): the peer's writes would end in
      // "remote invalid request". Both sides take every remote access; what
      // a peer may touch is the registrations' and windows' rights.
      qa.qp_access_flags |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                            IBV_ACCESS_REMOTE_ATOMIC;
      mask |= IBV_QP_ACCESS_FLAGS;
      if (int e = ibv_modify_qp(qp, &qa, mask)) return errno_code(e);
    }
    qp_num = qp->qp_num;
    refresh_usable();
    max_inline = std::min(a.cap.max_inline_data, opts.max_inline_data);
    sq.release(opts.send_queue_depth);
    dom->qp_conns[qp_num] = this;

    if (srq_grant) {  // the SRQ's buffers, already posted (srq_join)
      pool = dom->srq_pool;
      ++pool->refs;
    } else {
      // Receive pool, all posted now (before the peer may send).
      pool = new recv_pool;
      pool->pd = dom->pdh;
      pool->conn = this;
      pool->slot_size = opts.receive_buffer_size;
      if (auto r = pool->grow(posted_now, &on_recv_wc); !r) return r.error();
      for (std::uint32_t i = 0; i < posted_now; ++i)
        if (auto r = post_recv(pool->slots[i]); !r) return r;
    }
    // Results of atomics.
    std::size_t sbytes = (opts.send_queue_depth * 8 + 63) & ~std::size_t(63);
    scratch = static_cast<std::uint64_t*>(std::aligned_alloc(64, sbytes));
    if (!scratch) return make_error_code(std::errc::not_enough_memory);
    scratch_mr = ibv_reg_mr(dom->pd, scratch, sbytes, static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
    if (!scratch_mr) return last_errno();
    for (std::uint32_t i = opts.send_queue_depth; i > 0; --i) scratch_free.push_back(i - 1);
    return {};
  }

  // The QP to RTR and RTS, as rdma_accept (`accepted`: this side's answer)
  // or rdma_connect's handling of the REP would (its attributes from the
  // CM), but with this side's RNR retry count.
  result<void> ready_qp(const rdma_conn_param* accepted) {
    ibv_qp_attr qa{};
    int mask = 0;
    qa.qp_state = IBV_QPS_RTR;
    if (rdma_init_qp_attr(id, &qa, &mask) != 0) return last_errno();
    if (accepted) qa.max_dest_rd_atomic = accepted->responder_resources;
    if (int e = ibv_modify_qp(qp, &qa, mask)) return errno_code(e);
    qa = {};
    mask = 0;
    qa.qp_state = IBV_QPS_RTS;
    if (rdma_init_qp_attr(id, &qa, &mask) != 0) return last_errno();
    if (accepted) qa.max_rd_atomic = accepted->initiator_depth;
    qa.rnr_retry = std::min<std::uint8_t>(qa.rnr_retry, rnr_retries);
    if (int e = ibv_modify_qp(qp, &qa, mask)) return errno_code(e);
    return {};
  }

  // Own receive queue: the user receives double (up to receive_buffers)
  // once the peer uses them; each new one is a credit for it. Growth stops
  // where memory or the shared CQ runs out (the connection keeps working
  // with what it has).
  void grow_receives() noexcept {
    const std::uint32_t add = std::min(user_slots, opts.receive_buffers - user_slots);
    if (add == 0 || grow_stopped || !usable()) return;
    if (!dom->reserve_cq(static_cast<int>(add))) {
      grow_stopped = true;
      return;
    }
    cq_reserve += static_cast<int>(add);
    auto first = pool->grow(add, &on_recv_wc);
    if (!first) {
      grow_stopped = true;
      return;
    }
    for (std::size_t i = *first; i < pool->slots.size(); ++i) {
      if (!post_recv(pool->slots[i])) {
        grow_stopped = true;
        break;
      }
      ++user_slots;
      ++to_return;
    }
  }

  // Credits the peer returns: never more outstanding than it announced it
  // could have posted; past that it broke the protocol (false: failed).
  bool take_credits(std::uint32_t n) noexcept {
    if (error) return true;  // failed already: every waiter was woken
    if (credits.available() + n > peer_max_slots) {
      ++dom->st.protocol_errors;
      fail_with(make_error_code(errc::protocol_error));
      return false;
    }
    credits.release(n);
    return true;
  }

  // Puts a receive buffer back: on the QP's own receive queue or the SRQ.
  result<void> repost(recv_slot& s) { return s.pool->srq_core ? s.pool->srq_core->post_srq(s) : post_recv(s); }

  result<void> post_recv(recv_slot& s) {
    ibv_sge sge;
    ibv_recv_wr wr;
    fill_recv_wr(s, wr, sge);
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_recv(qp, &wr, &bad)) return errno_code(e);
    ++outstanding;
    return {};
  }

  rdma_conn_param conn_param(wire_hello& hello, const cm_evt* req) const {
    hello.magic = htonl(wire_magic);
    hello.max_slots = htonl(opts.receive_buffers);
    hello.initial_slots = htonl(user_slots);
    hello.buffer_size = htonl(static_cast<std::uint32_t>(std::min<std::size_t>(opts.receive_buffer_size, UINT32_MAX)));
    rdma_conn_param p{};
    p.private_data = &hello;
    p.private_data_len = sizeof hello;
    auto rd = static_cast<std::uint8_t>(std::min({dom->dattr.max_qp_rd_atom, dom->dattr.max_qp_init_rd_atom, 16}));
    p.responder_resources = rd;
    p.initiator_depth = rd;
    if (req) {
      p.responder_resources = std::min(rd, req->initiator_depth);
      p.initiator_depth = std::min(rd, req->responder_resources);
    }
    p.retry_count = 7;
    p.rnr_retry_count = rnr_retries;  // the peer's QP: what it may retry on this side's RNR NAKs
    return p;
  }

  // The peer's hello, checked against what this side can honour: credits
  // (its receives) at most what a QP of this device can have posted, the
  // initial ones within its cap, a buffer size in [1, the port's max
  // message size].
  bool take_hello(const cm_evt& e) {
    if (e.priv_len < sizeof(wire_hello)) return false;
    wire_hello h;
    std::memcpy(&h, e.priv.data(), sizeof h);
    if (ntohl(h.magic) != wire_magic) return false;
    const std::uint32_t max_slots = ntohl(h.max_slots), initial = ntohl(h.initial_slots);
    const std::uint32_t buffer = ntohl(h.buffer_size);
    const auto device_cap = static_cast<std::uint32_t>(std::max({dom->dattr.max_qp_wr, dom->dattr.max_srq_wr, 1}));
    if (max_slots == 0 || max_slots > device_cap || initial == 0 || initial > max_slots) return false;
    if (buffer == 0 || buffer > dom->max_msg) return false;
    peer_max_slots = max_slots;
    peer_slots = initial;
    peer_buffer = buffer;
    return true;
  }

  void on_established() {
    established = true;
    refresh_usable();
    credits.release(peer_slots);
  }

  // fail, remembering why (recv() returns it): the connection's own fault.
  void fail_with(std::error_code ec) {
    if (!fail_reason) fail_reason = ec;
    fail(ec);
  }

  // Terminal: pending and later operations fail; the QP is flushed.
  void fail(std::error_code) {
    error = true;
    refresh_usable();
    if (established && !disconnect_sent && id) {
      disconnect_sent = true;
      rdma_disconnect(id);  // tells the peer; moves the QP to error
    }
    abort_qp();
    if (!woken) {
      woken = true;
      credits.release(1u << 20);
      sq.release(1u << 20);
    }
    receivers.wake_all();
    cm_event.set();
    drained.set();
  }

  void abort_qp() {
    if (qp && !qp_err) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(qp, &a, IBV_QP_STATE);
      qp_err = true;
    }
  }

  // The connection object is gone: flush, then free once nothing is posted.
  void shutdown() {
    if (dying) return;
    fail(disconnected());
    dying = true;
    if (outstanding == 0)
      reap();
    else {
      dom->graveyard.push_back(shared_from_this());
      dom->loop->hold();  // until reaped: the loop's end lets the flush finish (io_context::hold)
    }
  }

  void reap() noexcept {
    if (reaped) return;
    reaped = true;
    if (in_repost_list) {  // freed before the next poll (a graveyard reap dropped on the next turn)
      auto& l = dom->repost_conns;
      l.erase(std::remove(l.begin(), l.end(), this), l.end());
      in_repost_list = false;
    }
    if (cm_watch) std::exchange(cm_watch, nullptr)->destroy();
    if (qp) {
      auto it = dom->qp_conns.find(qp_num);
      if (it != dom->qp_conns.end() && it->second == this) dom->qp_conns.erase(it);
      if (own_qp)
        ibv_destroy_qp(qp);
      else
        rdma_destroy_qp(id);
    }
    qp = nullptr;
    refresh_usable();
    if (id) rdma_destroy_id(id);
    if (ech) rdma_destroy_event_channel(ech);
    id = nullptr;
    ech = nullptr;
    if (srq_grant) {
      // Messages never taken by recv() hold SRQ buffers: back to the SRQ.
      if (dom->srq)
        for (auto& it : rx) (void)dom->post_srq(*it.slot);
      rx.clear();
      dom->srq_leave(std::exchange(srq_grant, 0));
    }
    if (pool) {
      if (pool->conn == this) pool->conn = nullptr;
      std::exchange(pool, nullptr)->unref();
    }
    if (scratch_mr) ibv_dereg_mr(scratch_mr);
    std::free(scratch);
    scratch = nullptr;
    dom->cq_reserved -= cq_reserve;
    --dom->st.live_connections;
  }

  // Operations may be posted: kept as one flag (refresh_usable after each
  // of its four inputs changes), tested once per operation.
  bool usable() const noexcept { return usable_; }
  void refresh_usable() noexcept { usable_ = established && !error && !closed && qp; }

  // Credits: freed receive buffers go back to the peer.
  void maybe_send_credits() {
    std::uint32_t threshold = std::max<std::uint32_t>(1, user_slots / 4);
    while (usable() && to_return >= threshold && ctrl_inflight < ctrl_reserve) {
      std::uint32_t n = std::min<std::uint32_t>(to_return, 0xffff);
      ibv_send_wr wr{};
      wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&ctrl));
      wr.opcode = IBV_WR_SEND_WITH_IMM;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.imm_data = htonl(ctrl_flag | n);
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qp, &wr, &bad) != 0) return;
      to_return -= n;
      ++ctrl_inflight;
      ++outstanding;
    }
  }

  static void on_ctrl_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
    conn_state* c = static_cast<ctrl_ctx*>(w)->c;
    --c->outstanding;
    --c->ctrl_inflight;
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      return;
    }
    c->maybe_send_credits();
  }

  // An inline send whose slot and credit the caller holds (try_reserve):
  // done once posted (see `settle`). It fills in only what changes of the
  // work request built once (inline_wr).
  result<void> post_inline_send(std::span<const std::byte> msg) noexcept {
    ibv_send_wr& wr = inline_wr;
    inline_sge.addr = reinterpret_cast<std::uintptr_t>(msg.data());
    inline_sge.length = static_cast<std::uint32_t>(msg.size());
    wr.num_sge = msg.empty() ? 0 : 1;
    const std::uint32_t credits_back = std::min<std::uint32_t>(to_return, 0xffff);  // piggybacked
    wr.imm_data = htonl(credits_back);
    const bool settles = unsignaled + 1 >= settle_every;
    wr.send_flags = settles ? IBV_SEND_INLINE | IBV_SEND_SIGNALED : IBV_SEND_INLINE;
    wr.wr_id = settles ? reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&settle)) : 0;
    ibv_send_wr* bad = nullptr;
    if (int e = ibv_post_send(qp, &wr, &bad)) {
      unreserve(true);
      return errno_code(e);
    }
    to_return -= credits_back;
    if (settles)
      track_settling(unsignaled + 1);
    else
      ++unsignaled;
    return {};
  }
  // close(): the unsignaled sends are settled before the disconnect, which
  // would flush any the NIC has not sent yet. The marker is a zero-length
  // RDMA write (IB C9-88: it names no memory and needs no rkey) on the send
  // queue entry kept for it; it holds no slot of its own.
  void settle_unsignaled() noexcept {
    if (unsignaled == 0 || !usable()) return;
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(&settle));
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp, &wr, &bad) != 0) return;  // the disconnect flushes what is left
    track_settling(unsignaled);
  }
  void track_settling(std::uint32_t slots) {
    settling.push_back(slots);
    unsignaled = 0;
    ++outstanding;
    ++inflight_ops;
    ++dom->inflight;
  }
  static void on_settle_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
    conn_state* c = static_cast<settle_ctx*>(w)->c;
    --c->outstanding;
    --c->dom->inflight;
    c->sq.release(c->settling.front());
    c->settling.pop_front();
    c->end_op();
    if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
  }

  static void on_recv_wc(wr_ctx* w, const ibv_wc& wc) noexcept {
    auto* s = static_cast<recv_slot*>(w);
    conn_state* c = s->pool->conn;
    if (core* k = s->pool->srq_core) {
      // SRQ: the completion names the QP; a buffer nobody can take goes back.
      c = k->conn_of(wc.qp_num);
      s->qp_num = wc.qp_num;
      if (!c || c->dying || !c->usable() || wc.status != IBV_WC_SUCCESS) {
        if (c && wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR)
          c->fail(verbs::make_wc_error(wc.status));
        if (wc.status == IBV_WC_SUCCESS || wc.status == IBV_WC_WR_FLUSH_ERR) (void)k->post_srq(*s);
        return;
      }
    } else {
      --c->outstanding;
      if (wc.status != IBV_WC_SUCCESS) {
        if (wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
        return;
      }
    }
    ++c->rx_count;
    if (wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM)) {
      std::uint32_t imm = ntohl(wc.imm_data);
      if ((imm & 0xffff) && !c->take_credits(imm & 0xffff)) {
        if (core* k = s->pool->srq_core) (void)k->post_srq(*s);
        return;
      }
      if (imm & ctrl_flag) {  // control message: its receive goes straight back
        if (c->usable() || s->pool->srq_core) (void)c->repost(*s);
        return;
      }
    }
    if (c->user_slots < c->opts.receive_buffers && !c->grow_pending && !c->grow_stopped && !s->pool->srq_core) {
      c->grow_pending = true;  // the peer uses its credits: more receives at the next poll (post_released)
      if (!c->in_repost_list) {
        c->in_repost_list = true;
        c->dom->repost_conns.push_back(c);
      }
    }
    rx_item it{s, 0, std::nullopt};
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM)
      it.imm = ntohl(wc.imm_data);
    else
      it.len = wc.byte_len;
    if (wait_node* n = c->receivers.wake_one()) {
      auto* w = static_cast<recv_waiter*>(n);
      ++s->pool->refs;  // the waiter's until it builds the message (adopt_message)
      w->item = it;
      w->has_msg = true;
    } else {
      c->rx.push_back(it);
    }
  }

  void on_message_released(recv_slot& slot) {
    if (!usable()) return;
    released.push_back(&slot);
    if (!in_repost_list) {
      in_repost_list = true;
      dom->repost_conns.push_back(this);
    }
  }
  // Posts the released buffers as one chain; each posted one is a credit.
  void post_released() noexcept {
    std::size_t done = 0;
    while (usable() && done < released.size()) {
      constexpr std::size_t chunk = 32;
      ibv_sge sge[chunk];
      ibv_recv_wr wr[chunk];
      const std::size_t n = std::min(chunk, released.size() - done);
      for (std::size_t i = 0; i < n; ++i) {
        fill_recv_wr(*released[done + i], wr[i], sge[i]);
        wr[i].next = i + 1 < n ? &wr[i + 1] : nullptr;
      }
      ibv_recv_wr* bad = nullptr;
      const int e = ibv_post_recv(qp, wr, &bad);
      const std::size_t posted = e == 0 ? n : static_cast<std::size_t>(bad - wr);
      outstanding += posted;
      to_return += static_cast<std::uint32_t>(posted);
      done += n;
      if (e != 0) break;  // as a failed single post: that buffer is not posted, its credit not returned
    }
    released.clear();
    if (std::exchange(grow_pending, false)) grow_receives();
    maybe_send_credits();
  }
  // SRQ: the buffer went back to the SRQ; the credit goes to this connection.
  void on_srq_credit() {
    if (!usable()) return;
    ++to_return;
    maybe_send_credits();
  }

  // An operation is over (its slot given back or about to be): close() waits
  // for the last one. Inlined: it ends every operation's latency path.
  [[gnu::always_inline]] void end_op() noexcept {
    if (--inflight_ops == 0 && closed) drained.set();
  }

  // The stop callback of an operation whose work requests the NIC may hold:
  // they cannot be withdrawn alone, so the connection goes to the error state
  // (from the loop's thread) and the operation resumes on the flushed
  // completion.
  template <class Wait>
  struct cancel_in_flight {
    Wait* self;
    void operator()() const noexcept {
      self->cancelled.store(true);
      cancel_on_loop(*self->ctx, [wp = self->c->weak_from_this()] {
        if (auto s = wp.lock()) s->fail(disconnected());
      });
    }
  };

  // Posts one signaled WR and waits for its completion. `credit`: it consumes
  // a receive on the peer. `atomic_result`: local sge is a scratch word whose
  // value is returned.
  struct op_wait : wr_ctx {
    conn_state* c = nullptr;
    io_context* ctx = nullptr;
    std::coroutine_handle<> h{};
    ibv_wc_status status = IBV_WC_SUCCESS;
    std::uint32_t byte_len = 0;
    bool done = false;
    std::atomic<bool> cancelled{false};
    using cancel_cb = cancel_in_flight<op_wait>;
    std::optional<std::stop_callback<cancel_cb>> scb;

    bool await_ready() const noexcept { return done; }
    // Callers hold no reference of their own to the connection state while
    // nothing waits: the wait takes one (the state may be dying by the time
    // the completion resumes it).
    std::shared_ptr<conn_state> keep;
    template <class P>
    void await_suspend(std::coroutine_handle<P> hh) {
      suspend(hh, stop_token_of(hh));
    }
    void suspend(std::coroutine_handle<> hh, std::stop_token t) {
      h = hh;
      keep = c->shared_from_this();
      if (t.stop_possible()) scb.emplace(std::move(t), cancel_cb{this});
    }
    void await_resume() const noexcept {}

    static void on_complete(wr_ctx* w, const ibv_wc& wc) noexcept { static_cast<op_wait*>(w)->complete(wc); }
    [[gnu::always_inline]] void complete(const ibv_wc& wc) noexcept {  // also inlined into core::poll_cq
      status = wc.status;
      byte_len = wc.byte_len;
      done = true;
      --c->outstanding;
      --c->dom->inflight;
      if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      scb.reset();
      if (h) ctx->post(h);
    }
  };

  // A send-queue slot and, for `credit`, a peer receive, if both can be had
  // now (the semaphores are FIFO: this never overtakes a waiter).
  bool try_reserve(bool credit) noexcept {
    if (ordered_waiting > 0) return false;  // an operation that waited posts first
    if (!sq.try_acquire()) return false;
    if (credit && !credits.try_acquire()) {
      sq.release();
      return false;
    }
    return true;
  }
  void unreserve(bool credit) noexcept {
    sq.release();
    if (credit) credits.release();
  }

  // One signaled WR whose slot (and credit) the caller holds: posted when
  // awaited, its completion awaited in the caller's frame (no frame of its
  // own: the latency path of every operation goes through here).
  // `atomic_result`: the local sge becomes a scratch word whose value is
  // returned.
  struct posted_op : op_wait {
    ibv_send_wr wr;
    ibv_sge sge;
    bool credit, atomic_result;
    std::uint32_t slot = 0;
    int post_error = 0;

    posted_op(conn_state* conn, const ibv_send_wr& w, const ibv_sge& g, bool cr, bool atomic) noexcept
        : wr(w), sge(g), credit(cr), atomic_result(atomic) {
      c = conn;
    }
    // Filled in place by the caller: no copy of the WR. Not zeroed (128
    // bytes on every operation's path): the caller sets the fields its
    // opcode uses (remote address, rkey, imm_data, atomic operands) and
    // local_sge the sge; a provider reads nothing else of an RC WR.
    posted_op(conn_state* conn, ibv_wr_opcode opcode, bool cr, bool atomic) noexcept
        : credit(cr), atomic_result(atomic) {  // NOLINT(cppcoreguidelines-pro-type-member-init)
      c = conn;
      wr.next = nullptr;
      wr.opcode = opcode;
      wr.send_flags = 0;
    }
    // Inlined into the launch (finish_setup): a call's prologue and
    // epilogue cost a tenth of this path in an emulated guest.
    [[gnu::always_inline]] bool await_ready() noexcept {
      set_post_fields();
      return post();
    }
    // The fields that tie the WR to this op: the same for every post of
    // it, so a prepared operation sets them once.
    [[gnu::always_inline]] void set_post_fields() noexcept {
      ctx = c->dom->loop;
      on_wc = &op_wait::on_complete;
      wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(this));
      wr.send_flags |= IBV_SEND_SIGNALED;
      wr.sg_list = &sge;
      wr.num_sge = sge.length > 0 || atomic_result ? 1 : 0;
    }
    // Posts the WR (set_post_fields done); true: over already (failed, or
    // completed by the inline look at the CQ).
    [[gnu::always_inline]] bool post() noexcept {
      if (!c->usable()) {
        post_error = -1;
        c->unreserve(credit);
        return true;
      }
      if (atomic_result) {
        slot = c->scratch_free.back();
        c->scratch_free.pop_back();
        sge.addr = reinterpret_cast<std::uintptr_t>(c->scratch + slot);
        sge.length = 8;
        sge.lkey = c->scratch_mr->lkey;
      }
      if (wr.opcode == IBV_WR_SEND_WITH_IMM) {  // piggybacked credits
        std::uint32_t n = std::min<std::uint32_t>(c->to_return, 0xffff);
        c->to_return -= n;
        wr.imm_data = htonl(n);
      }
      ibv_send_wr* bad = nullptr;
      if (int e = ibv_post_send(c->qp, &wr, &bad)) {
        post_error = e;
        if (atomic_result) c->scratch_free.push_back(slot);
        c->unreserve(credit);
        return true;
      }
      count_posted();
      // Soft-RoCE (and a fast NIC) may have completed it already: one look
      // at the CQ here saves a turn of the loop (a suspension, a wake-up) on
      // the latency path. Coroutines are never resumed from inside the
      // poller (wake-ups are posted), so this cannot re-enter core::poll.
      c->dom->poll_inline();
      return done;
    }
    // The WR is in the send queue: complete() and end_op() count it out.
    [[gnu::always_inline]] void count_posted() noexcept {
      ++c->outstanding;
      ++c->inflight_ops;
      ++c->dom->inflight;
    }
    [[gnu::always_inline]] result<std::uint64_t> await_resume() noexcept {
      if (post_error < 0) return disconnected();
      if (post_error > 0) return errno_code(post_error);
      if (atomic_result) c->scratch_free.push_back(slot);
      c->end_op();
      c->sq.release();
      if (status == IBV_WC_SUCCESS) return atomic_result ? c->scratch[slot] : byte_len;
      if (cancelled.load()) return std::make_error_code(std::errc::operation_canceled);
      if (status == IBV_WC_WR_FLUSH_ERR) return disconnected();
      return wc_error(status);
    }
  };
  posted_op post_reserved(const ibv_send_wr& wr, const ibv_sge& sge, bool credit, bool atomic_result) noexcept {
    return posted_op(this, wr, sge, credit, atomic_result);
  }

  // Operations post in the order they were called. One that must wait for
  // a send-queue slot or a credit queues on `post_order` (FIFO) and holds it
  // from its first wait to its post; while any is in there, try_reserve
  // fails, so no later operation overtakes it. Without this a waiter handed
  // a unit by release() resumed only after a newer operation had taken
  // another unit of the same release and posted (transfer-rdma saw chunk 8
  // before chunk 5 once credits ran short).
  mutex post_order;
  std::uint32_t ordered_waiting = 0;  // operations from their first wait to their post
  struct ordered_turn {  // counts one operation in ordered_waiting, until done()
    conn_state* c;
    bool in = true;
    explicit ordered_turn(conn_state* s) noexcept : c(s) { ++c->ordered_waiting; }
    void done() noexcept {
      if (std::exchange(in, false)) --c->ordered_waiting;
    }
    ~ordered_turn() { done(); }
  };
  // Resumes when a posted_op posted by hand completes.
  struct posted_wait {
    posted_op& op;
    bool await_ready() const noexcept { return op.done; }
    template <class P>
    void await_suspend(std::coroutine_handle<P> h) {
      op.await_suspend(h);
    }
    void await_resume() const noexcept {}
  };

  // Waits for a send-queue slot (and a credit), then posts. Callers try
  // try_reserve + post_reserved first, in their own frame.
  task<result<std::uint64_t>> execute(ibv_send_wr wr, ibv_sge sge, bool credit, bool atomic_result,
                                      std::shared_ptr<verbs_region> keep) {
    // The caller's frame holds the registration; this frame the state.
    (void)keep;
    auto self = shared_from_this();
    if (!usable()) co_return disconnected();
    ordered_turn turn(this);
    auto order = co_await post_order.lock();
    if (!order) co_return order.error();
    if (auto r = co_await sq.acquire(); !r) co_return r.error();
    if (credit) {
      if (auto r = co_await credits.acquire(); !r) {
        sq.release();
        co_return r.error();
      }
    }
    posted_op op = post_reserved(wr, sge, credit, atomic_result);
    const bool over = op.await_ready();  // posts
    turn.done();
    order->unlock();
    if (!over) co_await posted_wait{op};
    co_return op.await_resume();
  }

  // ---------------------------------------------------------------- batches

  struct batch_wait;
  struct batch_chunk {
    struct ctx : wr_ctx {
      batch_chunk* ch = nullptr;
    } early, last;  // early: the unsignaled WRs (errors and flushes only); last: the signaled one
    batch_wait* b = nullptr;
    std::uint32_t slots = 0;
    std::size_t partial = 0;  // ibv_post_send took only a prefix: its WRs, each to be flushed
    ibv_wc_status early_status = IBV_WC_SUCCESS, status = IBV_WC_SUCCESS;

    static void on_early(wr_ctx* w, const ibv_wc& wc) noexcept {
      batch_chunk* ch = static_cast<ctx*>(w)->ch;
      conn_state* c = ch->b->c;
      if (wc.status != IBV_WC_SUCCESS && ch->early_status == IBV_WC_SUCCESS) ch->early_status = wc.status;
      if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      if (ch->partial > 0) {
        --c->outstanding;
        if (--ch->partial == 0) ch->b->chunk_done();
      }
    }
    static void on_last(wr_ctx* w, const ibv_wc& wc) noexcept {
      batch_chunk* ch = static_cast<ctx*>(w)->ch;
      conn_state* c = ch->b->c;
      ch->status = wc.status;
      --c->outstanding;
      --c->dom->inflight;
      c->sq.release(ch->slots);  // the unsignaled WRs before it are complete too
      if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
      ch->b->chunk_done();
    }
  };

  struct batch_wait {
    conn_state* c = nullptr;
    io_context* ctx = nullptr;
    std::coroutine_handle<> h{};
    std::size_t pending = 0;  // chunks posted, not completed
    std::atomic<bool> cancelled{false};
    using cancel_cb = cancel_in_flight<batch_wait>;
    std::optional<std::stop_callback<cancel_cb>> scb;

    void chunk_done() noexcept {
      if (--pending == 0 && h) {
        scb.reset();
        ctx->post(std::exchange(h, {}));
      }
    }
    bool await_ready() const noexcept { return pending == 0; }
    template <class P>
    void await_suspend(std::coroutine_handle<P> hh) {
      h = hh;
      std::stop_token t = stop_token_of(hh);
      if (t.stop_possible()) scb.emplace(std::move(t), cancel_cb{this});
    }
    void await_resume() const noexcept {}
  };

  // `wrs[i]` and `sges[i]` describe operation i (opcode, remote side, flags,
  // local sge); `credit[i]`: it consumes a receive on the peer.
  task<result<void>> execute_batch(std::vector<ibv_send_wr> wrs, std::vector<ibv_sge> sges, std::vector<char> credit,
                                   std::vector<std::shared_ptr<verbs_region>> keep) {
    auto self = shared_from_this();
    (void)keep;
    if (!usable()) co_return disconnected();
    // In call order with the other operations (post_order), all of it.
    ordered_turn turn(this);
    auto order = co_await post_order.lock();
    if (!order) co_return order.error();
    // Chunks of at most send_queue_depth WRs (at most one per WR).
    std::vector<batch_chunk> chunks(wrs.size());
    batch_wait b;
    b.c = this;
    b.ctx = dom->loop;
    std::size_t posted = 0, first = 0;
    std::error_code early{};
    while (first < wrs.size() && !early) {
      // The chunk [first, end): as many WRs as slots and credits allow now;
      // only an empty chunk waits, so a batch never holds units while it
      // waits for more (no deadlock between batches, none with a peer that
      // holds some of its receive buffers).
      std::size_t end = first;
      std::uint32_t credits_taken = 0;
      while (end < wrs.size() && end - first < opts.send_queue_depth) {
        if (!sq.try_acquire()) {
          if (end > first) break;
          if (auto r = co_await sq.acquire(); !r) {
            early = r.error();
            break;
          }
        }
        if (credit[end] && !credits.try_acquire()) {
          if (end > first) {
            sq.release();
            break;
          }
          if (auto r = co_await credits.acquire(); !r) {
            sq.release();
            early = r.error();
            break;
          }
        }
        credits_taken += credit[end] ? 1 : 0;
        ++end;
      }
      const auto need = static_cast<std::uint32_t>(end - first);
      if (!early && !usable()) early = disconnected();
      if (early) {
        sq.release(need);
        credits.release(credits_taken);
        break;
      }
      batch_chunk& ch = chunks[posted];
      ch.b = &b;
      ch.slots = need;
      ch.early.ch = ch.last.ch = &ch;
      ch.early.on_wc = &batch_chunk::on_early;
      ch.last.on_wc = &batch_chunk::on_last;
      bool piggybacked = false;
      for (std::size_t i = first; i < end; ++i) {
        ibv_send_wr& wr = wrs[i];
        wr.sg_list = &sges[i];
        wr.num_sge = sges[i].length > 0 ? 1 : 0;
        wr.next = i + 1 < end ? &wrs[i + 1] : nullptr;
        wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(i + 1 < end ? &ch.early : &ch.last));
        if (i + 1 == end) wr.send_flags |= IBV_SEND_SIGNALED;
        if (wr.opcode == IBV_WR_SEND_WITH_IMM) {  // piggybacked credits, on the chunk's first send
          std::uint32_t n = piggybacked ? 0 : std::min<std::uint32_t>(to_return, 0xffff);
          piggybacked = true;
          to_return -= n;
          wr.imm_data = htonl(n);
        }
      }
      ibv_send_wr* bad = nullptr;
      if (int e = ibv_post_send(qp, &wrs[first], &bad)) {
        std::size_t taken = bad ? static_cast<std::size_t>(bad - &wrs[first]) : 0;
        sq.release(need);
        credits.release(credits_taken);
        early = errno_code(e);
        if (taken > 0) {
          // A prefix is on the send queue, unsignaled: the connection goes
          // to error and each of those WRs comes back flushed.
          ch.partial = taken;
          outstanding += taken;
          ++b.pending;
          if (posted++ == 0) ++inflight_ops;
          fail(disconnected());
        }
        break;
      }
      ++outstanding;
      ++dom->inflight;
      ++b.pending;
      if (posted++ == 0) ++inflight_ops;
      first = end;
    }
    turn.done();
    order->unlock();
    if (posted > 0 && !early) dom->poll_inline(static_cast<unsigned>(wrs.size()));  // it may be done already
    if (posted > 0) {
      co_await b;
      end_op();
    }
    for (std::size_t k = 0; k < posted; ++k) {
      ibv_wc_status st = chunks[k].early_status != IBV_WC_SUCCESS ? chunks[k].early_status : chunks[k].status;
      if (st == IBV_WC_SUCCESS) continue;
      if (b.cancelled.load()) co_return std::make_error_code(std::errc::operation_canceled);
      if (st == IBV_WC_WR_FLUSH_ERR) co_return early ? early : disconnected();
      co_return wc_error(st);
    }
    if (early) {
      if (posted > 0) fail(disconnected());  // part of the batch is done: RC has no partial undo
      co_return early;
    }
    co_return result<void>{};
  }

  // Local sge for user memory: inline when small (no registration). The
  // registration, if any, is core::local_region's (no reference).
  // `may_stage`: the bytes of memory the library does not own may be copied
  // into a staging slot now (not for a prepared operation: each start sends
  // the memory's bytes of then).
  [[gnu::always_inline]] result<verbs_region*> local_sge(std::span<const std::byte> mem, bool need_write,
                                                         bool may_inline, ibv_send_wr& wr, ibv_sge& sge,
                                                         bool may_stage = true) {
    sge.addr = reinterpret_cast<std::uintptr_t>(mem.data());
    sge.length = static_cast<std::uint32_t>(mem.size());
    if (mem.empty()) return nullptr;
    // Inline means the CPU copies the bytes into the WQE: never from GPU memory.
    if (may_inline && mem.size() <= max_inline && !dom->in_device_memory(mem)) {
      wr.send_flags |= IBV_SEND_INLINE;
      return nullptr;
    }
    auto r = dom->local_region(mem, need_write, may_stage, sge);
    if (!r) return r.error();
    sge.lkey = (*r)->lkey;
    return r;
  }
};

void recv_pool::release(void* owner, std::uint64_t slot) noexcept {
  auto* p = static_cast<recv_pool*>(owner);
  if (p->srq_core)
    p->srq_core->on_srq_release(*reinterpret_cast<recv_slot*>(slot));
  else if (p->conn)
    p->conn->on_message_released(*reinterpret_cast<recv_slot*>(slot));
  p->unref();
}

void core::flush_reposts() noexcept {
  // Swapped out first: maybe_send_credits may complete work that releases more.
  std::vector<conn_state*> conns;
  conns.swap(repost_conns);
  for (conn_state* c : conns) {
    c->in_repost_list = false;
    c->post_released();
  }
  conns.clear();
  if (repost_conns.empty()) repost_conns.swap(conns);  // keep the capacity
  if (srq_released.empty()) return;
  std::vector<recv_slot*> slots;
  slots.swap(srq_released);
  for (recv_slot* s : slots) {
    if (!post_srq(*s)) continue;
    if (conn_state* c = conn_of(s->qp_num)) c->on_srq_credit();
  }
  slots.clear();
  if (srq_released.empty()) srq_released.swap(slots);
}

result<void> core::srq_join(std::uint32_t grant, std::size_t slot_size) {
  if (!srq) {
    if (dattr.max_srq <= 0 || dattr.max_srq_wr <= 0) return make_error_code(errc::not_supported);
    ibv_srq_init_attr a{};
    a.attr.max_wr = static_cast<std::uint32_t>(std::min(dattr.max_srq_wr, 16384));
    a.attr.max_sge = 1;
    srq = ibv_create_srq(pd, &a);
    if (!srq) return last_errno();
    srq_cap = a.attr.max_wr;
    srq_pool = new recv_pool;
    srq_pool->pd = pdh;
    srq_pool->srq_core = this;
    srq_pool->slot_size = slot_size;
  }
  if (slot_size > srq_pool->slot_size) return std::make_error_code(std::errc::invalid_argument);
  std::uint64_t need = srq_granted + grant;
  if (need > srq_cap) return std::make_error_code(std::errc::no_buffer_space);
  if (need > srq_pool->slots.size()) {
    auto first = srq_pool->grow(static_cast<std::uint32_t>(need - srq_pool->slots.size()), &conn_state::on_recv_wc);
    if (!first) return first.error();
    for (std::size_t i = *first; i < srq_pool->slots.size(); ++i)
      if (auto r = post_srq(srq_pool->slots[i]); !r) return r;
  }
  srq_granted = need;
  return {};
}

bool core::poll_cq_inlined() {
  ibv_wc wc[32];
  int n = ibv_poll_cq(cq, 32, wc);
  for (int i = 0; i < n; ++i) dispatch(wc[i]);
  if (n > 0) count_seen(n);
  if (!graveyard.empty()) reap_graveyard();
  return n > 0;
}
void core::dispatch(const ibv_wc& wc) noexcept {
  auto* w = reinterpret_cast<wr_ctx*>(static_cast<std::uintptr_t>(wc.wr_id));
  if (w && w->on_wc == &conn_state::op_wait::on_complete)  // a single operation's: the common case
    static_cast<conn_state::op_wait*>(w)->complete(wc);
  else if (w)
    w->on_wc(w, wc);
  else if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR)
    on_unsignaled_error(wc);  // an unsignaled send failed: its connection fails
}
bool core::poll_cq() { return poll_cq_inlined(); }

void core::on_unsignaled_error(const ibv_wc& wc) noexcept {
  if (conn_state* c = conn_of(wc.qp_num)) c->fail(wc_error(wc.status));
}

void core::reap_graveyard() {
  std::vector<std::shared_ptr<conn_state>> done;
  for (auto it = graveyard.begin(); it != graveyard.end();) {
    if ((*it)->outstanding == 0) {
      (*it)->reap();
      done.push_back(std::move(*it));
      it = graveyard.erase(it);
      loop->release();
    } else {
      ++it;
    }
  }
  if (!done.empty()) {
    // The last reference to this core may be among them: drop them on a
    // later turn, outside the loop's iteration over its pollers.
    loop->dispatch([d = std::move(done)]() mutable { d.clear(); });
  }
}

// ------------------------------------------------------------------ connection

// A memory_grant: a type 2 memory window bound on its connection's QP, to
// a registration of exactly the granted range (window_mr). That
// registration has no remote rights of its own (its rkey opens nothing) and
// its bounds are the grant's: Soft-RoCE checks a window's key, QP and
// rights, but an access's bounds only against the registration under it.
struct verbs_grant final : grant_impl {
  std::shared_ptr<conn_state> conn;
  std::shared_ptr<verbs_region> region;  // the user's registration (the grant keeps it, as documented)
  ibv_mr* window_mr = nullptr;
  ibv_mw* mw = nullptr;
  remote_buffer granted{};
  bool bound = false;
  remote_buffer remote() const noexcept override { return bound ? granted : remote_buffer{}; }
  // Deallocating a bound window invalidates it; its registration goes after it.
  static void free_window(ibv_mw* mw, ibv_mr* mr) noexcept {
    if (mw) ibv_dealloc_mw(mw);
    if (mr) ibv_dereg_mr(mr);
  }
  void release() noexcept {
    bound = false;
    free_window(std::exchange(mw, nullptr), std::exchange(window_mr, nullptr));
  }
  ~verbs_grant() override {
    release();
    std::erase(conn->grants, this);
  }
};

class verbs_connection final : public connection_impl {
 public:
  explicit verbs_connection(std::shared_ptr<conn_state> s)
      : connection_impl(launch_table_of<verbs_connection>), s_(std::move(s)) {}
  ~verbs_connection() override {
    for (verbs_grant* g : s_->grants) g->release();  // the connection's windows go before its QP
    s_->shutdown();
  }

  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                   unsigned rights) override {
    conn_state* s = s_.get();
    if (auto c = check_grant(r, offset, len, rights); !c) return ready(c.error());
    auto vr = std::dynamic_pointer_cast<verbs_region>(r.impl());
    if (!vr || vr->pd != s->dom->pdh) return ready(std::make_error_code(std::errc::invalid_argument));
    if (!s->dom->has_type2_windows() || vr->device_memory) return ready(make_error_code(errc::not_supported));
    if (!s->usable()) return ready(disconnected());
    auto g = std::make_unique<verbs_grant>();
    g->owner = this;
    g->conn = s_;
    g->region = std::move(vr);
    std::byte* base = g->region->addr + offset;
    // Local write only where the user's registration has it (read-only memory cannot be pinned for writing).
    const int mr_access = IBV_ACCESS_MW_BIND | ((g->region->access & access::local_write) ? IBV_ACCESS_LOCAL_WRITE : 0);
    g->window_mr = ibv_reg_mr(s->dom->pd, base, len, mr_access);
    if (!g->window_mr) return ready(last_errno());
    g->mw = ibv_alloc_mw(s->dom->pd, IBV_MW_TYPE_2);
    if (!g->mw)
      return ready(errno == EOPNOTSUPP || errno == ENOSYS ? make_error_code(errc::not_supported) : last_errno());
    s->grants.push_back(g.get());
    const auto addr = reinterpret_cast<std::uint64_t>(base);
    return bind(std::move(g), addr, len, rights);
  }
  task<result<void>> revoke(grant_impl& gi) override {
    auto& g = static_cast<verbs_grant&>(gi);
    if (!g.bound) {  // revoked already, or its connection gone
      g.release();
      return ready_void({});
    }
    g.bound = false;
    return invalidate(s_, std::exchange(g.mw, nullptr), std::exchange(g.window_mr, nullptr), g.granted.rkey);
  }

  // The single operations (launch_table_of): each is inlined into its
  // table entry, so that co_await reaches ibv_post_send through one call.
  // They use the state through a plain pointer: the caller keeps the
  // connection alive for the call, and whatever waits (posted_op, execute,
  // a receive) holds a reference for as long as it waits.
  [[gnu::always_inline]] void send(op_slot<void>& out, std::span<const std::byte> msg) {
    conn_state* s = s_.get();
    if (msg.size() > s->peer_buffer) return out.set_result(make_error_code(errc::message_too_long));
    // Inline (never from device memory: the CPU copies the bytes): done once
    // posted, if a slot and a credit are free now.
    if (msg.size() <= s->max_inline && s->usable() && !s->dom->in_device_memory(msg) && s->try_reserve(true))
      return out.set_result(s->post_inline_send(msg));
    auto& st = out.emplace<posted_state<void>>(s, IBV_WR_SEND_WITH_IMM, true, false);
    finish_setup(out, st, s->local_sge(msg, false, true, st.op.wr, st.op.sge));
  }

  void recv(op_slot<message>& out) { out.emplace<recv_state>(s_.get()); }

  [[gnu::always_inline]] void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) {
    rdma(out, local, remote, IBV_WR_RDMA_WRITE, 0, false);
  }
  [[gnu::always_inline]] void write_with_imm(op_slot<void>& out, std::span<const std::byte> local,
                                             remote_buffer remote, std::uint32_t imm) {
    rdma(out, local, remote, IBV_WR_RDMA_WRITE_WITH_IMM, imm, true);
  }
  [[gnu::always_inline]] void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) {
    rdma(out, local, remote, IBV_WR_RDMA_READ, 0, false);
  }
  void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                        std::uint64_t desired) {
    atomic(out, remote, IBV_WR_ATOMIC_CMP_AND_SWP, expected, desired);
  }
  void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
    atomic(out, remote, IBV_WR_ATOMIC_FETCH_AND_ADD, add, 0);
  }

  // One operation's WR and local sge, as post_batch and prepare build them:
  // the opcode, the remote side, the immediate. `credit`: it consumes a
  // receive on the peer. The registration, if any, is local_sge's.
  static result<verbs_region*> build_wr(conn_state* s, const operation& o, ibv_send_wr& wr, ibv_sge& sge,
                                        bool& credit, bool may_stage = true) {
    bool need_write = false, may_inline = true;
    credit = false;
    switch (o.op) {
      case operation::type::send:
        if (o.local.size() > s->peer_buffer) return make_error_code(errc::message_too_long);
        wr.opcode = IBV_WR_SEND_WITH_IMM;  // the immediate carries returned credits
        credit = true;
        break;
      case operation::type::write:
      case operation::type::write_with_imm:
        wr.opcode = o.op == operation::type::write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_WRITE_WITH_IMM;
        if (o.op == operation::type::write_with_imm) {
          wr.imm_data = htonl(o.imm);
          credit = true;
        }
        wr.wr.rdma.remote_addr = o.remote.address;
        wr.wr.rdma.rkey = o.remote.rkey;
        break;
      case operation::type::read:
        wr.opcode = IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = o.remote.address;
        wr.wr.rdma.rkey = o.remote.rkey;
        need_write = true;
        may_inline = false;
        break;
      default: return std::make_error_code(std::errc::invalid_argument);
    }
    if (o.local.size() > (std::size_t(1) << 31)) return make_error_code(errc::message_too_long);
    return s->local_sge(o.local, need_write, may_inline, wr, sge, may_stage);
  }

  task<result<void>> post_batch(std::span<const operation> ops) override {
    auto s = s_;
    if (ops.empty()) co_return result<void>{};
    std::vector<ibv_send_wr> wrs(ops.size());
    std::vector<ibv_sge> sges(ops.size());
    std::vector<char> credit(ops.size(), 0);
    std::vector<std::shared_ptr<verbs_region>> keep;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      bool cr = false;
      auto r = build_wr(s.get(), ops[i], wrs[i], sges[i], cr);
      if (!r) co_return r.error();
      credit[i] = cr;
      if (s->dom->op_owned)
        keep.push_back(std::move(s->dom->op_owned));  // this operation's own staging slot or registration
      else if (*r && (keep.empty() || keep.back().get() != *r))
        keep.push_back(core::hold(*r));
    }
    co_return co_await s->execute_batch(std::move(wrs), std::move(sges), std::move(credit), std::move(keep));
  }

  task<result<void>> close() override {
    auto s = s_;
    if (!s->usable()) co_return s->closed ? result<void>{} : result<void>{disconnected()};
    s->settle_unsignaled();  // the inline sends reach the peer before the disconnect
    s->closed = true;         // no new operations
    s->refresh_usable();
    while (s->inflight_ops > 0 && !s->error) {
      s->drained.reset();
      if (auto r = co_await s->drained.wait(); !r) co_return r.error();
    }
    if (s->id && !s->disconnect_sent) {
      s->disconnect_sent = true;
      rdma_disconnect(s->id);
    }
    s->receivers.wake_all();
    // Failed while draining: an operation or an inline send may not have
    // reached the peer.
    if (s->error) co_return disconnected();
    co_return result<void>{};
  }

  result<std::unique_ptr<prepared_impl>> prepare(const operation& o) override {
    auto p = std::make_unique<prepared_state>(s_);
    auto r = build_wr(s_.get(), o, p->op.wr, p->op.sge, p->op.credit, false);
    if (!r) return r.error();
    p->region = s_->dom->take_hold(*r);  // memory not the user's registered: for the prepared operation's life
    p->op.set_post_fields();
    p->inline_send = p->op.wr.opcode == IBV_WR_SEND_WITH_IMM && (p->op.wr.send_flags & IBV_SEND_INLINE) != 0;
    p->read_or_write = p->op.wr.opcode == IBV_WR_RDMA_READ || p->op.wr.opcode == IBV_WR_RDMA_WRITE;
    return std::unique_ptr<prepared_impl>(std::move(p));
  }

  bool is_open() const noexcept override { return s_->usable(); }
  transport_kind kind() const noexcept override { return transport_kind::verbs; }
  std::size_t max_message_size() const noexcept override { return s_->peer_buffer; }
  endpoint remote_endpoint() const noexcept override {
    if (!s_->id) return {};
    sockaddr* sa = rdma_get_peer_addr(s_->id);
    return endpoint(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }

 private:
  // A posted work request kept in the awaiter's frame (connection_op.hpp):
  // the latency path of every single operation allocates nothing. Posted
  // as it is launched (finish_setup); one that completed then is settled
  // into a plain result at once, so what is left here is in flight.
  template <class T>
  struct posted_state {
    conn_state::posted_op op;
    verbs_region* region = nullptr;      // the local registration (local_region)...
    std::shared_ptr<verbs_region> keep;  // ...held while the operation waits: the NIC may use it
    posted_state(conn_state* c, ibv_wr_opcode opcode, bool credit, bool atomic_result) noexcept
        : op(c, opcode, credit, atomic_result) {}
    bool start() noexcept { return op.done; }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) {
      if (!keep) keep = core::hold(region);  // else the operation's own, from finish_setup
      op.suspend(h, std::move(t));
      return std::noop_coroutine();
    }
    [[gnu::always_inline]] result<T> take() noexcept { return as_result<T>(op.await_resume()); }
  };
  // A prepared operation (connection::prepare): one posted_op whose WR is
  // built (build_wr, set_post_fields) once and posted again by each start.
  // The connection's state and the local registration are held for its
  // life, so a start takes no reference of its own either. A read or a
  // write that completes at once (start's latency path) is over before it
  // needs a slot, a count or a wake-up.
  struct prepared_state final : prepared_impl {
    std::shared_ptr<conn_state> conn;
    std::shared_ptr<verbs_region> region;  // null: inline or empty
    conn_state::posted_op op;  // opcode, credit, WR and sge: build_wr's
    op_slot<std::uint64_t> waiting;  // a start that waits for a slot or a credit (execute)

    explicit prepared_state(std::shared_ptr<conn_state> c) noexcept
        : conn(std::move(c)), op(conn.get(), IBV_WR_SEND, false, false) {
      op.sge = {};
    }
    start_result start() noexcept override {
      conn_state* s = op.c;
      core* d = s->dom.get();
      if (read_or_write && s->usable() && s->sq.can_acquire() && d->take_inline_look()) {
        // The latency path (perftest's: post, then poll). Its own completion
        // found at once, successful, as the next completion in the CQ: the
        // operation began and ended with nothing run in between, so it takes
        // no slot, no count and no state, and there is nothing to take.
        ibv_send_wr* bad = nullptr;
        if (int e = ibv_post_send(s->qp, &op.wr, &bad)) {
          op.post_error = e;
          posted = true;
          return start_result::over;
        }
        ibv_wc wc;
        const int n = ibv_poll_cq(d->cq, 1, &wc);
        if (n == 1 && wc.wr_id == op.wr.wr_id && wc.status == IBV_WC_SUCCESS) [[likely]] {
          d->count_seen(1);
          return start_result::succeeded;
        }
        return posted_unfinished(n, wc);
      }
      return start_general();
    }
    // Every other start: a send (inline or with a credit), a write with an
    // immediate, an atomic, one that waits for a slot, a failed connection.
    [[gnu::noinline]] start_result start_general() noexcept {
      conn_state* s = op.c;
      if (inline_send && s->usable() && s->try_reserve(true)) {
        // As a single small send: inline, unsignaled, done once posted.
        sent_inline = true;
        inline_result = s->post_inline_send({reinterpret_cast<const std::byte*>(op.sge.addr), op.sge.length});
        return start_result::over;
      }
      posted = s->try_reserve(op.credit);
      if (!posted) return start_result::pending;  // suspend() waits for them
      rearm();
      return op.post() ? start_result::over : start_result::pending;
    }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) override {
      if (posted) {
        op.h = h;
        if (t.stop_possible()) op.scb.emplace(std::move(t), conn_state::op_wait::cancel_cb{&op});
        return std::noop_coroutine();
      }
      // A task waits for the slot and the credit, as for a single operation.
      waiting.set_task(op.c->execute(op.wr, op.sge, op.credit, false, region));
      if (waiting.start()) return h;
      return waiting.suspend(h, std::move(t));
    }
    result<void> take() override {
      if (sent_inline) {
        sent_inline = false;
        return inline_result;
      }
      return as_result<void>(posted ? op.await_resume() : waiting.take());
    }

    bool inline_send = false;    // a send that goes inline (connection::send's small ones)
    bool read_or_write = false;  // no credit, no field to fill per post: start's latency path

   private:
    bool posted = false;  // this start posted its WR and holds its slot (and credit): take() ends it as a posted_op
    bool sent_inline = false;
    result<void> inline_result;
    // The latency path's WR is in the send queue, and its completion was
    // not the CQ's next (`n` and `wc`: what the look found): it becomes a
    // posted start as op.post() leaves one, and the completion found goes
    // where it belongs.
    [[gnu::noinline]] start_result posted_unfinished(int n, const ibv_wc& wc) noexcept {
      conn_state* s = op.c;
      core* d = s->dom.get();
      (void)s->sq.try_acquire();  // can_acquire() held, and nothing has run since
      posted = true;
      rearm();
      op.count_posted();
      if (n == 1) {
        d->dispatch(wc);
        d->count_seen(1);
        if (!op.done) d->poll_cq();  // its own may be next
      }
      return op.done ? start_result::over : start_result::pending;
    }
    void rearm() noexcept {
      op.h = {};  // complete() must not wake an earlier start's awaiter
      op.done = false;
      op.status = IBV_WC_SUCCESS;
      op.post_error = 0;
      op.cancelled.store(false, std::memory_order_relaxed);
    }
  };

  // posted_op yields the atomic's word (or byte_len); void operations drop it.
  template <class T>
  static result<T> as_result(result<std::uint64_t> r) noexcept {
    if (!r) return r.error();
    if constexpr (std::is_void_v<T>)
      return result<void>{};
    else
      return *r;
  }

  // A recv() in the awaiter's frame: takes an arrived message, or queues on
  // the connection's receivers until one is handed to it.
  struct recv_state {
    conn_state* s;
    std::shared_ptr<conn_state> keep;  // while it waits
    conn_state::recv_waiter node;
    bool parked = false;
    explicit recv_state(conn_state* c) noexcept : s(c) {}
    recv_state(const recv_state&) = delete;
    // Taken (the common case), nothing is left. A frame destroyed while the
    // recv waits, or after a message was handed to it, gives both back.
    ~recv_state() {
      if (node.list) node.list->unlink(node);
      if (parked) --s->dom->rx_waiters;
      if (node.has_msg) (void)conn_state::adopt_message(node.item);  // the buffer goes straight back
    }
    bool start() noexcept {
      if (s->rx.empty()) s->dom->poll_inline();  // it may be in the CQ already (as posted_op)
      return !s->rx.empty() || s->error || s->closed || !s->established;
    }
    std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token t) {
      if (!s->receivers.park(node, h, std::move(t))) return h;  // stopped already: canceled
      keep = s->shared_from_this();
      parked = true;
      ++s->dom->rx_waiters;
      return std::noop_coroutine();
    }
    result<message> take() noexcept {
      if (parked) {
        parked = false;
        --s->dom->rx_waiters;
      }
      if (node.has_msg) {
        node.has_msg = false;
        return conn_state::adopt_message(node.item);
      }
      if (node.cancelled) return canceled();
      if (!s->rx.empty() && s->pool) {
        auto it = s->rx.front();
        s->rx.pop_front();
        return conn_state::take_message(it);
      }
      return s->fail_reason ? s->fail_reason : disconnected();
    }
  };

  // After local_sge: posts now if a send-queue slot (and a credit) is free,
  // else a task waits for them. Launching is followed at once by the await
  // (connection_op::await_ready), so posting here is posting when awaited;
  // an operation that completed already (Soft-RoCE runs a read inside
  // ibv_post_send) ends as a plain result, with no call through the slot's
  // table to start, take or destroy it.
  template <class T>
  [[gnu::always_inline]] static void finish_setup(op_slot<T>& out, posted_state<T>& st,
                                                 result<verbs_region*> region) {
    if (!region) return out.set_result(region.error());
    conn_state* s = st.op.c;
    if (s->dom->op_owned) [[unlikely]]
      st.keep = std::move(s->dom->op_owned);  // a staging slot or transient registration: until it completes
    if (s->try_reserve(st.op.credit)) {
      st.region = *region;
      if (st.op.await_ready()) out.settle(st, st.take());
      return;
    }
    auto t = s->execute(st.op.wr, st.op.sge, st.op.credit, st.op.atomic_result,
                        st.keep ? std::move(st.keep) : core::hold(*region));
    if constexpr (std::is_void_v<T>)
      out.set_task(drop_value(std::move(t)));
    else
      out.set_task(std::move(t));
  }
  static task<result<void>> drop_value(task<result<std::uint64_t>> t) {
    co_return as_result<void>(co_await std::move(t));
  }

  // Inlined (as finish_setup, local_sge and posted_op's steps): the launch
  // of a one-sided operation is one function, one prologue.
  [[gnu::always_inline]] void rdma(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                                   ibv_wr_opcode opcode, std::uint32_t imm, bool credit) {
    conn_state* s = s_.get();
    auto& st = out.emplace<posted_state<void>>(s, opcode, credit, false);
    ibv_send_wr& wr = st.op.wr;
    wr.wr.rdma.remote_addr = remote.address;
    wr.wr.rdma.rkey = remote.rkey;
    if (opcode == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = htonl(imm);
    finish_setup(out, st,
                 s->local_sge(local, opcode == IBV_WR_RDMA_READ, opcode != IBV_WR_RDMA_READ, wr, st.op.sge));
  }

  void atomic(op_slot<std::uint64_t>& out, remote_buffer remote, ibv_wr_opcode opcode, std::uint64_t a,
              std::uint64_t b) {
    conn_state* s = s_.get();
    if (remote.address % 8 != 0) return out.set_result(std::make_error_code(std::errc::invalid_argument));
    auto& st = out.emplace<posted_state<std::uint64_t>>(s, opcode, false, true);
    ibv_send_wr& wr = st.op.wr;
    wr.wr.atomic.remote_addr = remote.address;
    wr.wr.atomic.rkey = remote.rkey;
    wr.wr.atomic.compare_add = a;
    wr.wr.atomic.swap = b;
    finish_setup(out, st, nullptr);
  }

  static task<result<memory_grant>> ready(std::error_code ec) { co_return ec; }
  static task<result<void>> ready_void(std::error_code ec) {
    if (ec) co_return ec;
    co_return result<void>{};
  }
  // An IBV_WR_BIND_MW on the QP, awaited: the window answers to the new
  // key, from this QP's peer only (type 2).
  static task<result<memory_grant>> bind(std::unique_ptr<verbs_grant> g, std::uint64_t addr, std::size_t len,
                                         unsigned rights) {
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = g->mw;
    wr.bind_mw.rkey = ibv_inc_rkey(g->mw->rkey);
    wr.bind_mw.bind_info.mr = g->window_mr;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = len;
    wr.bind_mw.bind_info.mw_access_flags = static_cast<int>(rights);  // ibv_access_flags values
    auto r = co_await g->conn->execute(wr, ibv_sge{}, false, false, nullptr);
    if (!r) co_return r.error();  // g goes: the window is deallocated
    g->granted = {addr, wr.bind_mw.rkey, len};
    g->bound = true;
    co_return memory_grant(std::move(g));
  }
  // An IBV_WR_LOCAL_INV of the window on the QP, awaited; then the window
  // is deallocated. A QP in the error state takes no access any more: the
  // flushed invalidation is as good.
  static task<result<void>> invalidate(std::shared_ptr<conn_state> s, ibv_mw* mw, ibv_mr* mr, std::uint32_t rkey) {
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = rkey;
    auto r = co_await s->execute(wr, ibv_sge{}, false, false, nullptr);
    verbs_grant::free_window(mw, mr);
    if (!r && r.error() != disconnected()) co_return r.error();
    co_return result<void>{};
  }
  std::shared_ptr<conn_state> s_;
};

// ------------------------------------------------------------------ connect / accept

task<result<void>> connect_steps(std::shared_ptr<conn_state> st, endpoint ep) {
  int ms = static_cast<int>(std::max<std::int64_t>(100, st->opts.connect_timeout.count()));
  if (rdma_resolve_addr(st->id, nullptr, const_cast<sockaddr*>(ep.data()), ms) != 0) co_return last_errno();
  auto e = co_await st->next_event();
  if (!e) co_return e.error();
  if (e->type != RDMA_CM_EVENT_ADDR_RESOLVED) co_return cm_error(*e);
  if (rdma_resolve_route(st->id, ms) != 0) co_return last_errno();
  e = co_await st->next_event();
  if (!e) co_return e.error();
  if (e->type != RDMA_CM_EVENT_ROUTE_RESOLVED) co_return cm_error(*e);
  if (auto r = st->create_qp(); !r) co_return r.error();
  wire_hello hello;
  rdma_conn_param p = st->conn_param(hello, nullptr);
  p.qp_num = st->qp_num;  // the QP is not the id's: librdmacm leaves its transitions to us
  p.srq = st->srq_grant ? 1 : 0;
  if (rdma_connect(st->id, &p) != 0) co_return last_errno();
  e = co_await st->next_event();
  if (!e) co_return e.error();
  if (e->type != RDMA_CM_EVENT_CONNECT_RESPONSE) co_return cm_error(*e);
  // The REP: the peer's hello checked, the QP readied with this side's RNR
  // retry count (not the REP's), then the RTU. A failure here destroys the
  // id, which rejects the REP.
  if (!st->take_hello(*e)) co_return hello_error(*e);
  if (auto r = st->ready_qp(nullptr); !r) co_return r.error();
  if (rdma_establish(st->id) != 0) co_return last_errno();
  st->on_established();
  co_return result<void>{};
}

// Connection requests are handled as listener_options says: a request past
// a cap is rejected at once, with a reject_reason in its private data; an
// accepted handshake has until its deadline to reach ESTABLISHED; accepted
// connections on which nothing arrives for idle_timeout fail with
// errc::idle_timeout. A timerfd on the loop drives the deadlines.
class verbs_listener final : public listener_impl {
 public:
  verbs_listener(std::shared_ptr<core> d, connection_options o, listener_options lim)
      : dom_(std::move(d)), opts_(o), limits_(lim) {}
  ~verbs_listener() override {
    *alive_ = false;
    close();
  }

  result<void> start(endpoint ep) {
    ech_ = rdma_create_event_channel();
    if (!ech_ || !set_nonblock(ech_->fd)) return last_errno();
    if (rdma_create_id(ech_, &id_, this, RDMA_PS_TCP) != 0) return last_errno();
    if (rdma_bind_addr(id_, const_cast<sockaddr*>(ep.data())) != 0) return last_errno();
    // The kernel's backlog: requests the listener has not read yet. Large,
    // so that every request is read at once and answered (accepted or
    // rejected with a reason) rather than left to the peer's CM retries.
    if (rdma_listen(id_, 1024) != 0) return last_errno();
    watch_ = new fd_watch(ech_->fd, &on_cm, this);
    watch_->arm(*dom_->loop);
    if (auto r = start_ticks(); !r) return r;
    return {};
  }

  task<result<connection>> accept() override {
    auto alive = alive_;  // the listener may be destroyed while this waits
    while (ready_.empty()) {
      if (closed_) co_return disconnected();
      ev_.reset();
      if (auto r = co_await ev_.wait(); !r) co_return r.error();
      if (!*alive) co_return disconnected();
    }
    auto st = std::move(ready_.front());
    ready_.pop_front();
    if (limits_.max_connections != 0 || limits_.idle_timeout.count() > 0)
      accepted_.push_back({st, st->rx_count, clock::now()});
    co_return connection(std::make_unique<verbs_connection>(std::move(st)));
  }

  endpoint local_endpoint() const override {
    if (!id_) return {};
    sockaddr* sa = rdma_get_local_addr(id_);
    return endpoint(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }

  void close() noexcept override {
    if (closed_) return;
    closed_ = true;
    if (watch_) std::exchange(watch_, nullptr)->destroy();
    if (tick_) std::exchange(tick_, nullptr)->destroy();
    if (tfd_ >= 0) ::close(std::exchange(tfd_, -1));
    for (auto& h : pending_) {
      h.st->acceptor = nullptr;
      h.st->shutdown();
    }
    pending_.clear();
    for (auto& st : ready_) st->shutdown();
    ready_.clear();
    accepted_.clear();
    if (id_) rdma_destroy_id(std::exchange(id_, nullptr));
    if (ech_) rdma_destroy_event_channel(std::exchange(ech_, nullptr));
    ev_.set();
  }

 private:
  static void on_cm(void* arg) noexcept {
    auto* self = static_cast<verbs_listener*>(arg);
    rdma_cm_event* e;
    while (rdma_get_cm_event(self->ech_, &e) == 0) {
      cm_evt c = copy_event(e);
      rdma_ack_cm_event(e);
      if (c.type == RDMA_CM_EVENT_CONNECT_REQUEST) self->on_request(c);
    }
    if (!self->closed_) self->watch_->arm(*self->dom_->loop);
    self->tell_refused();
  }

  // The peer of a request, as far as the CM knows it.
  static endpoint peer_of(rdma_cm_id* id) noexcept {
    sockaddr* sa = id ? rdma_get_peer_addr(id) : nullptr;
    if (!sa || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6)) return {};
    return endpoint(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }

  // listener_options::on_refused, told once the listener's own state is
  // consistent (at the end of each handler: the application may close the
  // listener from it).
  void refused(rdma_cm_id* id, std::string why) {
    if (limits_.on_refused) refusals_.emplace_back(peer_of(id), std::move(why));
  }
  void tell_refused() noexcept {
    if (refusals_.empty()) return;
    auto told = std::move(refusals_);
    refusals_.clear();
    auto tell = limits_.on_refused;  // the application may even destroy the listener from it
    for (auto& [peer, why] : told) {
      try {
        tell(peer, why);
      } catch (...) {  // the application's logger: its failure is not the listener's
      }
    }
  }

  static const char* describe(reject_reason why) noexcept {
    switch (why) {
      case reject_reason::too_many_handshakes: return "refused: too many handshakes in progress";
      case reject_reason::backlog_full: return "refused: accept backlog full";
      case reject_reason::too_many_connections: return "refused: connection cap reached";
      case reject_reason::bad_hello: return "refused: a hello this side cannot honour (credits or buffer size)";
      case reject_reason::no_resources: return "refused: no resources (QP, CQ entries or receive buffers)";
    }
    return "refused";
  }

  static void reject(rdma_cm_id* id, reject_reason why) noexcept {
    const std::uint32_t data[2] = {htonl(reject_magic), htonl(static_cast<std::uint32_t>(why))};
    rdma_reject(id, data, sizeof data);
  }

  // Connections of this listener holding resources: handshakes, the
  // backlog, and accepted ones not dropped yet.
  std::size_t live_connections() noexcept {
    std::erase_if(accepted_, [](const accepted_conn& a) {
      auto sp = a.st.lock();
      return !sp || sp->dying;
    });
    return pending_.size() + ready_.size() + accepted_.size();
  }

  void on_request(const cm_evt& req) noexcept {
    std::optional<reject_reason> refuse;
    if (pending_.size() >= limits_.max_handshakes)
      refuse = reject_reason::too_many_handshakes;
    else if (ready_.size() >= limits_.accept_backlog)
      refuse = reject_reason::backlog_full;
    else if (limits_.max_connections != 0 && live_connections() >= limits_.max_connections)
      refuse = reject_reason::too_many_connections;
    auto st = std::make_shared<conn_state>(dom_, opts_);
    if (!st->init_channel() || rdma_migrate_id(req.id, st->ech) != 0) {
      ++dom_->st.handshakes_refused;
      refused(req.id, describe(reject_reason::no_resources));
      reject(req.id, reject_reason::no_resources);
      rdma_destroy_id(req.id);
      st->shutdown();
      return;
    }
    // The request's id moves to a channel of its own before it is rejected
    // or destroyed: on the listener's channel that stops the listener.
    st->id = req.id;
    req.id->context = st.get();
    // The hello is checked before anything is allocated for the peer.
    if (!refuse && !st->take_hello(req)) refuse = reject_reason::bad_hello;
    wire_hello hello;
    if (!refuse) {
      bool ok = static_cast<bool>(st->create_qp());
      rdma_conn_param p = st->conn_param(hello, &req);
      ok = ok && static_cast<bool>(st->ready_qp(&p));
      p.qp_num = st->qp_num;
      p.srq = st->srq_grant ? 1 : 0;
      if (ok && rdma_accept(st->id, &p) != 0) ok = false;
      if (!ok) refuse = reject_reason::no_resources;
    }
    if (refuse) {
      ++dom_->st.handshakes_refused;
      refused(st->id, describe(*refuse));
      reject(st->id, *refuse);
      st->shutdown();
      return;
    }
    st->acceptor = this;
    st->on_accept_done = &accept_done;
    pending_.push_back({std::move(st), clock::now() + limits_.handshake_timeout});
  }

  static void accept_done(void* arg, conn_state* st, std::error_code failed) noexcept {
    auto* self = static_cast<verbs_listener*>(arg);
    auto it = std::find_if(self->pending_.begin(), self->pending_.end(), [&](auto& h) { return h.st.get() == st; });
    if (it == self->pending_.end()) return;
    auto sp = std::move(it->st);
    self->pending_.erase(it);
    if (!failed && self->ready_.size() < self->limits_.accept_backlog) {
      self->ready_.push_back(std::move(sp));
      self->ev_.set();
    } else {
      if (!failed) {
        ++self->dom_->st.handshakes_refused;  // the backlog filled up meanwhile
        self->refused(sp->id, describe(reject_reason::backlog_full));
      } else {
        self->refused(sp->id, "handshake failed: " + failed.message());
      }
      sp->shutdown();
    }
    self->tell_refused();
  }

  // The deadlines are looked at a few times per the shortest of them.
  result<void> start_ticks() {
    auto period = limits_.handshake_timeout;
    if (limits_.idle_timeout.count() > 0) period = std::min(period, limits_.idle_timeout);
    period = std::clamp(period / 4, std::chrono::milliseconds(20), std::chrono::milliseconds(1000));
    tfd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (tfd_ < 0) return last_errno();
    itimerspec its{};
    its.it_interval.tv_sec = period.count() / 1000;
    its.it_interval.tv_nsec = (period.count() % 1000) * 1000000;
    its.it_value = its.it_interval;
    if (timerfd_settime(tfd_, 0, &its, nullptr) != 0) return last_errno();
    tick_ = new fd_watch(tfd_, &on_tick, this);
    tick_->arm(*dom_->loop);
    return {};
  }

  static void on_tick(void* arg) noexcept {
    auto* self = static_cast<verbs_listener*>(arg);
    std::uint64_t expirations;
    while (::read(self->tfd_, &expirations, sizeof expirations) > 0) {
    }
    self->check_deadlines(clock::now());
    self->tick_->arm(*self->dom_->loop);
    self->tell_refused();
  }

  void check_deadlines(clock::time_point now) noexcept {
    // Handshakes past their deadline: dropped (the peer sees a reject).
    for (std::size_t i = 0; i < pending_.size();) {
      if (now < pending_[i].deadline) {
        ++i;
        continue;
      }
      auto st = std::move(pending_[i].st);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      ++dom_->st.handshakes_timed_out;
      st->acceptor = nullptr;
      refused(st->id, "handshake failed: not established within " + std::to_string(limits_.handshake_timeout.count()) +
                          " ms");
      // Destroyed, not rejected: the REP is still out, and the kernel's CM
      // cancels it only when the id is destroyed in REP_SENT (it then sends
      // a REJ of its own, with no private data). rdma_reject would move the
      // id to timewait with the REP still retried, and its destroy would
      // wait until the REP's retries ran out: (max_cm_retries + 1) x the
      // CM response timeout, both taken from the peer's REQ (65 s with
      // librdmacm's defaults, up to days from a hostile peer).
      st->shutdown();
    }
    if (limits_.idle_timeout.count() <= 0) return;
    for (auto& a : accepted_) {
      auto st = a.st.lock();
      if (!st || st->error || st->dying) continue;
      if (st->rx_count != a.rx_seen) {
        a.rx_seen = st->rx_count;
        a.since = now;
      } else if (now - a.since >= limits_.idle_timeout) {
        ++dom_->st.idle_timeouts;
        st->fail_with(make_error_code(errc::idle_timeout));
      }
    }
  }

  struct handshake {
    std::shared_ptr<conn_state> st;
    clock::time_point deadline;
  };
  struct accepted_conn {
    std::weak_ptr<conn_state> st;
    std::uint64_t rx_seen = 0;  // the connection's rx_count when last looked at
    clock::time_point since;    // when it last changed
  };

  std::shared_ptr<core> dom_;
  connection_options opts_;
  listener_options limits_;
  rdma_event_channel* ech_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  fd_watch* watch_ = nullptr;
  int tfd_ = -1;
  fd_watch* tick_ = nullptr;
  std::vector<handshake> pending_;
  std::deque<std::shared_ptr<conn_state>> ready_;
  std::vector<accepted_conn> accepted_;
  std::vector<std::pair<endpoint, std::string>> refusals_;  // for on_refused, at the end of a handler
  event ev_;
  bool closed_ = false;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // false once destroyed: for accept()s waiting
};

// ------------------------------------------------------------------ domain

class verbs_domain final : public domain_impl {
 public:
  explicit verbs_domain(std::shared_ptr<core> c) : c_(std::move(c)) {}
  transport_kind kind() const noexcept override { return transport_kind::verbs; }
  std::string describe() const override {
    return "verbs " + c_->name + " port " + std::to_string(c_->port) + " gid[" + std::to_string(c_->gid_index) +
           "] " + c_->gid_text;
  }
  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) override {
    return c_->register_memory(mem, flags);
  }
  task<result<connection>> connect(endpoint remote, connection_options opts) override {
    return do_connect(c_, remote, opts);
  }
  result<listener> listen(endpoint local, connection_options opts, listener_options limits) override {
    c_->attach();
    auto l = std::make_unique<verbs_listener>(c_, opts, limits);
    if (auto r = l->start(local); !r) return r.error();
    return listener(std::move(l));
  }
  core& get() noexcept { return *c_; }

 private:
  static task<result<connection>> do_connect(std::shared_ptr<core> c, endpoint remote, connection_options opts) {
    c->attach();
    auto st = std::make_shared<conn_state>(c, opts);
    if (auto r = st->init_channel(); !r) co_return r.error();
    if (rdma_create_id(st->ech, &st->id, st.get(), RDMA_PS_TCP) != 0) co_return last_errno();
    auto r = co_await with_timeout(connect_steps(st, remote), opts.connect_timeout);
    if (!r) {
      // Late once the request (our hello) was out: the peer did not finish the handshake.
      const bool requested = st->qp != nullptr;
      st->shutdown();
      if (r.error() == errc::operation_timeout)
        co_return requested ? make_error_code(errc::handshake_timeout) : std::make_error_code(std::errc::timed_out);
      co_return r.error();
    }
    co_return connection(std::make_unique<verbs_connection>(std::move(st)));
  }
  std::shared_ptr<core> c_;
};

}  // namespace

result<std::shared_ptr<domain_impl>> make_verbs_domain(const domain_options& opts) {
  auto pdh = std::make_shared<pd_holder>();
  int n = 0;
  pdh->devices = rdma_get_devices(&n);
  if (!pdh->devices || n == 0) return make_error_code(errc::not_supported);
  auto chosen = verbs_impl::choose_device(pdh->devices, n, opts.device, opts.gid_index);
  if (!chosen) return make_error_code(errc::not_supported);
  auto c = std::make_shared<core>();
  c->ctx = chosen->ctx;
  c->max_msg = chosen->max_msg;
  c->dattr = chosen->dattr;
  c->port = chosen->port;
  c->name = std::move(chosen->name);
  c->gid_index = chosen->gid_index;
  c->gid_text = std::move(chosen->gid);
  pdh->ctx = c->ctx;
  pdh->pd = ibv_alloc_pd(c->ctx);
  if (!pdh->pd) return last_errno();
  c->pdh = pdh;
  c->pd = pdh->pd;
  c->channel = ibv_create_comp_channel(c->ctx);
  if (!c->channel || !set_nonblock(c->channel->fd)) return last_errno();
  c->cq_size = std::min(c->dattr.max_cqe, 4096);
  c->cq = ibv_create_cq(c->ctx, c->cq_size, nullptr, c->channel, 0);
  if (!c->cq) return last_errno();
  c->cq_size = c->cq->cqe;
  if (auto* loop = io_context::current_or_null()) {
    (void)loop;
    c->attach();
  }
  return std::shared_ptr<domain_impl>(std::make_shared<verbs_domain>(std::move(c)));
}

}  // namespace shuttle::detail

namespace shuttle::verbs {

result<void> set_busy_poll_budget(domain& d, std::chrono::nanoseconds budget) {
  auto* v = dynamic_cast<detail::verbs_domain*>(d.impl());
  if (!v) return make_error_code(errc::not_supported);
  v->get().budget = budget;
  return {};
}

result<domain_stats> stats(const domain& d) {
  auto* v = dynamic_cast<detail::verbs_domain*>(d.impl());
  if (!v) return make_error_code(errc::not_supported);
  return v->get().st;
}

result<memory_region> register_dmabuf(domain& d, int fd, std::uint64_t offset, std::size_t length,
                                      std::uint64_t iova, unsigned access_flags) {
  auto* v = dynamic_cast<detail::verbs_domain*>(d.impl());
  if (!v) return make_error_code(errc::not_supported);
#ifdef SHUTTLE_HAVE_VERBS_DMABUF
  return v->get().register_dmabuf(fd, offset, length, iova, access_flags);
#else
  (void)fd, (void)offset, (void)length, (void)iova, (void)access_flags;
  return make_error_code(errc::not_supported);
#endif
}

}  // namespace shuttle::verbs
