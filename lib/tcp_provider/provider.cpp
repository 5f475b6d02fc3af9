// The tcp provider: RDMA semantics (RC queue pair rules) over a TCP stream,
// driven by the io_uring loop. Think of it as soft-iWARP in user space.
//
// Per connection (conn_state, shared by the connection object, its two loop
// coroutines, the operations in flight and the messages handed out):
//  - a reader coroutine: reads a header, validates it (tcp_wire), and for a
//    request checks rkey/bounds/rights against the domain's registration
//    table before reading the payload straight into the target region (or
//    the receive buffer); for a response completes the pending operations in
//    order (READ payload straight into the initiator's buffer);
//  - a writer coroutine: gathers queued frames into one writev (header and
//    payload iovecs: the payload is never copied in user space), plus the
//    cumulative ACK and the CREDIT frame;
//  - operations: take a send-queue slot (and a credit for SEND/WRITE_IMM),
//    get a sequence number, queue their frame and wait for their response.
//
// Errors: the first error moves the connection to the error state
// (`stopping`): the socket is shut down, both loops are stopped, and only
// once both have exited (nothing touches an operation's buffers any more) are
// the pending operations completed. A cancelled in-flight operation takes the
// same path (NIC-safe cancellation, as verbs).
#include "stats.hpp"
#include "wire.hpp"

#include <shuttle/channel.hpp>
#include <shuttle/detail/driver.hpp>
#include <shuttle/detail/transport_impl.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/tcp.hpp>
#include <shuttle/timer.hpp>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace shuttle::detail {
namespace {

using namespace tcp_wire;

std::error_code err(errc e) noexcept { return make_error_code(e); }

// ---------------------------------------------------------------- domain

struct domain_state;

struct tcp_region final : region_impl {
  std::shared_ptr<domain_state> dom;
  ~tcp_region() override;
};

// A range of a registration granted to one connection (memory_grant).
struct grant_entry {
  const void* conn = nullptr;  // the conn_state it was granted on: the only one that may use it
  std::shared_ptr<tcp_region> region;
  std::byte* addr = nullptr;
  std::size_t length = 0;
  unsigned access = 0;
  std::uint32_t rkey = 0;
  bool revoked = false;
  std::size_t in_use = 0;  // accesses through it in progress (a payload being read in, a READ response out)
  event idle{true};        // in_use == 0
};

// One access through a grant in progress: revoke waits until the last ends.
class grant_use {
 public:
  grant_use() noexcept = default;
  explicit grant_use(std::shared_ptr<grant_entry> e) noexcept : e_(std::move(e)) {
    if (e_->in_use++ == 0) e_->idle.reset();
  }
  grant_use(grant_use&& o) noexcept : e_(std::move(o.e_)) {}
  grant_use& operator=(grant_use&& o) noexcept {
    if (this != &o) {
      release();
      e_ = std::move(o.e_);
    }
    return *this;
  }
  ~grant_use() { release(); }

 private:
  void release() noexcept {
    if (e_ && --e_->in_use == 0) e_->idle.set();
    e_.reset();
  }
  std::shared_ptr<grant_entry> e_;
};

struct domain_state {
  using cache_key = std::tuple<std::uintptr_t, std::size_t, unsigned>;
  std::unordered_map<std::uint32_t, std::weak_ptr<tcp_region>> table;
  std::map<cache_key, std::uint32_t> cache;
  // Unused random keys, drawn from the kernel's CSPRNG a batch at a time.
  std::array<std::uint32_t, 32> random_keys{};
  std::size_t random_left = 0;

  std::shared_ptr<tcp_region> find(std::uint32_t rkey) const {
    auto it = table.find(rkey);
    return it == table.end() ? nullptr : it->second.lock();
  }

  // An rkey a peer cannot predict from the ones it has seen: each is drawn
  // from getrandom (a key is all a peer needs to access a region).
  result<std::uint32_t> new_key() {
    for (;;) {
      if (random_left == 0) {
        auto* p = reinterpret_cast<char*>(random_keys.data());
        std::size_t got = 0;
        while (got < sizeof random_keys) {
          ssize_t n = ::getrandom(p + got, sizeof random_keys - got, 0);
          if (n < 0) {
            if (errno == EINTR) continue;
            return errno_code(errno);
          }
          got += static_cast<std::size_t>(n);
        }
        random_left = random_keys.size();
      }
      std::uint32_t k = random_keys[--random_left];
      if (k != 0 && !table.contains(k) && !grants.contains(k)) return k;
    }
  }

  // Grants, by key (new_key's, as regions'): a peer cannot guess
  // another's, and it is honoured only on its own connection.
  std::unordered_map<std::uint32_t, std::shared_ptr<grant_entry>> grants;

  std::shared_ptr<grant_entry> find_grant(std::uint32_t rkey, const void* conn) const {
    auto it = grants.find(rkey);
    return it == grants.end() || it->second->conn != conn ? nullptr : it->second;
  }

  // No access through `e` starts from now on.
  void drop_grant(grant_entry& e) noexcept {
    if (auto it = grants.find(e.rkey); it != grants.end() && it->second.get() == &e) grants.erase(it);
    e.revoked = true;
  }
};

tcp_region::~tcp_region() {
  dom->table.erase(rkey);
  auto it = dom->cache.find({reinterpret_cast<std::uintptr_t>(addr), length, access});
  if (it != dom->cache.end() && it->second == rkey) dom->cache.erase(it);
}

// ---------------------------------------------------------------- connection state

struct op_rec {
  opcode op{};
  std::uint64_t seq = 0;
  std::span<std::byte> read_dst{};
  std::coroutine_handle<> waiter{};
  bool done = false;
  bool cancelled = false;
  bool owns_slot = false;  // a batch's: its send-queue slot is returned when it completes
  bool holds_responder = false;  // READ/atomic: one of the peer's responder units, returned on completion
  std::error_code ec{};
  std::uint64_t value = 0;
};

bool is_ack_type(opcode op) noexcept { return op == opcode::send || op == opcode::write || op == opcode::write_imm; }
// Requests that take one of the responder's units (its response is queued).
bool needs_responder(opcode op) noexcept { return op == opcode::read_req || op == opcode::cas || op == opcode::faa; }

// Frames the reader handles in one go before it gives the loop turn back:
// a peer that keeps the socket full must not starve the other connections.
inline constexpr unsigned reader_frame_budget = 64;
// How long what we owe a peer (a NAK and the peer's close after it, or on
// close() the last ACK and credits) may take to go out: a peer that does not
// read holds the connection no longer than this.
inline constexpr std::chrono::milliseconds linger{2000};

struct out_frame {
  std::array<std::byte, header_size> hdr{};
  const std::byte* payload = nullptr;
  std::size_t len = 0;
  std::shared_ptr<tcp_region> hold;  // READ_RESP: the region stays registered while we send from it
  grant_use use;                     // READ_RESP through a grant: its revoke waits until this is sent
  bool response = false;             // READ_RESP/ATOMIC_RESP: counts against our responder units
};

std::atomic<std::size_t> receive_buffer_bytes{0};

// Connections established through one listener and not finished yet
// (listener_options::max_connections); shared, as connections outlive it.
struct live_count {
  std::uint32_t n = 0;
};

struct inbound {
  std::uint32_t slot = 0;
  std::uint32_t len = 0;
  std::optional<std::uint32_t> imm;
};

struct conn_state : std::enable_shared_from_this<conn_state> {
  conn_state(tcp_socket s, std::shared_ptr<domain_state> d, const connection_options& o, const hello& peer_h,
             endpoint ep)
      : ctx(&io_context::current()),
        sock(std::move(s)),
        dom(std::move(d)),
        opts(o),
        peer(peer_h),
        remote(ep),
        slots(o.send_queue_depth),
        credits(peer_h.receive_buffers),
        responder_units(peer_h.max_responder_ops),
        slot_buffers(o.receive_buffers),
        inbox(o.receive_buffers) {
    lim.max_send = o.receive_buffer_size;
    free_slots.reserve(o.receive_buffers);
    for (std::uint32_t i = o.receive_buffers; i > 0; --i) free_slots.push_back(i - 1);
  }

  io_context* ctx;
  tcp_socket sock;
  std::shared_ptr<domain_state> dom;
  connection_options opts;
  hello peer;
  endpoint remote;
  limits lim;

  // Initiator side.
  semaphore slots;
  std::size_t slot_waiters = 0;
  semaphore credits;
  std::size_t credit_waiters = 0;
  std::uint32_t credits_out = 0;  // consumed, not yet returned by the peer
  semaphore responder_units;      // the peer's READ/atomic requests we may have outstanding
  std::size_t responder_waiters = 0;
  std::uint64_t next_seq = 1;
  std::deque<op_rec*> pending;
  event idle{true};

  // Target side. A slot's receive buffer is allocated when a message first
  // arrives for it and kept for the slot's later messages: an idle
  // connection holds none, a busy one as many as the peer keeps in flight.
  std::vector<std::unique_ptr<std::byte[]>> slot_buffers;
  std::vector<std::uint32_t> free_slots;
  channel<inbound> inbox;
  std::uint64_t ack_seq = 0, ack_sent = 0;
  std::uint32_t credits_to_return = 0;
  std::size_t messages_out = 0;
  std::shared_ptr<conn_state> keepalive;  // while messages are out
  std::uint32_t responses_queued = 0;     // READ/atomic responses in outq (bounded: hello's max_responder_ops)
  event responder_room{true};             // set while responses_queued is below it
  // The frame being read: its receive slot, or the operation its payload completes.
  std::uint32_t cur_slot = 0;
  op_rec* cur_op = nullptr;
  grant_use cur_use;  // a WRITE through a grant whose payload is being read in: revoke waits for it

  // Writer.
  std::deque<out_frame> outq;
  std::coroutine_handle<> writer_waiter{};
  bool nak_then_drain = false;
  clock::time_point nak_deadline{};  // nak_then_drain: when the loops give up on the NAK and the peer

  // State.
  std::error_code error{};  // what pending/later operations fail with
  bool stopping = false;    // loops are being stopped
  int loops = 2;
  bool finished = false;
  event finished_ev;
  std::stop_source stop;
  std::shared_ptr<live_count> origin;  // the listener's count, for a connection it accepted

  ~conn_state() {
    std::size_t held = 0;
    for (auto& b : slot_buffers) held += b ? opts.receive_buffer_size : 0;
    receive_buffer_bytes.fetch_sub(held, std::memory_order_relaxed);
  }

  // The slot's receive buffer, allocated on first use, uninitialized (the
  // payload is read into it); throws std::bad_alloc when memory is out.
  std::byte* slot_data(std::uint32_t slot) {
    auto& b = slot_buffers[slot];
    if (!b) {
      b = std::make_unique_for_overwrite<std::byte[]>(opts.receive_buffer_size);
      receive_buffer_bytes.fetch_add(opts.receive_buffer_size, std::memory_order_relaxed);
    }
    return b.get();
  }

  void wake_writer() {
    if (writer_waiter) ctx->post(std::exchange(writer_waiter, {}));
  }

  void complete(op_rec* r, std::error_code ec, std::uint64_t v) {
    if (r->owns_slot) slots.release();
    if (r->holds_responder) responder_units.release();
    r->done = true;
    r->ec = ec;
    r->value = v;
    if (r->waiter) ctx->post(r->waiter);
  }

  void set_error(std::error_code ec) {
    if (!error) error = ec;
    // Operations waiting for a slot or a credit wake and see the error.
    slots.release(slot_waiters);
    credits.release(credit_waiters);
    responder_units.release(responder_waiters);
    inbox.close();
    idle.set();
  }

  // The connection goes to the error state: stop both loops; `finish` runs
  // once both have exited. After a NAK the loops end by themselves (the
  // writer once the NAK is out, the reader once the peer closed, both by
  // nak_deadline): whoever drops the connection meanwhile (its application,
  // on its peer_access_refused) must not cut the NAK off.
  void enter_error(std::error_code ec) {
    set_error(ec);
    if (stopping) return;
    stopping = true;
    if (!nak_then_drain) abort_io();
  }

  void abort_io() {
    if (sock.is_open()) (void)sock.shutdown(SHUT_RDWR);
    stop.request_stop();
    wake_writer();
  }

  // What an operation started after the error fails with: why this side
  // failed where it knows (it refused the peer's access), else disconnected.
  std::error_code later_error() const {
    return error == errc::peer_access_refused ? error : err(errc::disconnected);
  }

  void loop_exited() {
    if (--loops == 0) finish();
  }

  void finish() {
    // Neither loop runs: no byte of any pending operation's buffers is
    // touched any more. Complete them all, in order.
    auto ps = std::move(pending);
    pending.clear();
    std::error_code ec = error ? error : err(errc::disconnected);
    for (op_rec* r : ps) {
      if (r->ec) complete(r, r->ec, 0);
      else if (r->cancelled) complete(r, std::make_error_code(std::errc::operation_canceled), 0);
      else complete(r, ec, 0);
    }
    outq.clear();
    sock.close();
    if (origin) --std::exchange(origin, nullptr)->n;
    finished = true;
    finished_ev.set();
  }

  void cancel_op(std::uint64_t seq) {
    for (op_rec* r : pending) {
      if (r->seq == seq && !r->done) {
        r->cancelled = true;
        enter_error(err(errc::disconnected));
        return;
      }
    }
  }

  // Completes ACK-type operations up to `seq`; false on a protocol violation.
  bool ack_upto(std::uint64_t seq) {
    if (seq >= next_seq) return false;
    while (!pending.empty() && pending.front()->seq <= seq) {
      op_rec* r = pending.front();
      if (!is_ack_type(r->op)) return false;
      pending.pop_front();
      complete(r, {}, 0);
    }
    if (pending.empty()) idle.set();
    return true;
  }

  // The front operation, which response `seq` answers (earlier ones acked).
  op_rec* answered(std::uint64_t seq) {
    if (seq == 0 || !ack_upto(seq - 1)) return nullptr;
    if (pending.empty() || pending.front()->seq != seq) return nullptr;
    return pending.front();
  }

  void pop_complete(op_rec* r, std::error_code ec, std::uint64_t v) {
    pending.pop_front();
    complete(r, ec, v);
    if (pending.empty()) idle.set();
  }

  static void release_message(void* owner, std::uint64_t slot) noexcept {
    auto* s = static_cast<conn_state*>(owner);
    s->free_slots.push_back(static_cast<std::uint32_t>(slot));
    if (!s->stopping && !s->nak_then_drain) {
      ++s->credits_to_return;
      s->wake_writer();
    }
    if (--s->messages_out == 0) {
      auto last = std::move(s->keepalive);  // may free *s on return
    }
  }

  void queue_response(header h, const std::byte* payload = nullptr, std::size_t len = 0,
                      std::shared_ptr<tcp_region> hold = nullptr) {
    out_frame f;
    encode_header(h, f.hdr);
    f.payload = payload;
    f.len = len;
    f.hold = std::move(hold);
    f.response = h.op == opcode::read_resp || h.op == opcode::atomic_resp;
    if (f.response && ++responses_queued >= our_responder_ops()) responder_room.reset();
    outq.push_back(std::move(f));
    wake_writer();
  }

  static constexpr std::uint32_t our_responder_ops() noexcept { return default_responder_ops; }

  enum class action { next, payload, wait_room, drain, protocol, io };

  // Target side of one request, or initiator side of one response, up to its
  // payload: action::payload sets `dst`, and once the payload is there
  // finish_payload completes the frame. Plain calls, no coroutine: a frame
  // costs the reader no frame of its own, and the stack stays flat however
  // many frames arrive at once.
  action begin_frame(const header& h, std::span<std::byte>& dst) {
    switch (h.op) {
      case opcode::send: {
        if (free_slots.empty()) return action::protocol;  // the peer ignored its credits
        // Taken off the list before the payload read waits: a message
        // released meanwhile pushes its slot, which a pop after the read
        // would take instead of this one (left free under a held message).
        cur_slot = free_slots.back();
        free_slots.pop_back();
        dst = std::span(slot_data(cur_slot), h.length);
        return action::payload;
      }
      case opcode::write:
      case opcode::write_imm:
      case opcode::read_req:
      case opcode::cas:
      case opcode::faa: {
        // Past our responder units the peer is not read from until responses
        // go out: its requests wait in its socket, not in our memory.
        if (needs_responder(h.op) && !responder_room.is_set()) return action::wait_room;
        if (h.op == opcode::write_imm && free_slots.empty()) return action::protocol;
        auto region = dom->find(h.rkey);
        region_view view;
        if (region) view = {region->addr, region->length, region->access};
        grant_use use;  // an access through a grant (of this connection only) is in progress until it goes
        if (auto g = region ? nullptr : dom->find_grant(h.rkey, this)) {
          region = g->region;
          view = {g->addr, g->length, g->access};
          use = grant_use(std::move(g));
        }
        bool atomic = h.op == opcode::cas || h.op == opcode::faa;
        auto target = check_access(view, h.addr, h.length, required_access(h.op), atomic);
        if (!target) {
          header n;
          n.op = opcode::nak;
          n.st = status::remote_access_error;
          n.seq = h.seq;
          queue_response(n);
          nak_then_drain = true;
          nak_deadline = clock::now() + linger;
          set_error(err(errc::peer_access_refused));
          return action::drain;
        }
        std::byte* p = *target;
        if (h.op == opcode::write || h.op == opcode::write_imm) {
          if (h.op == opcode::write_imm) {  // its slot taken now, as a SEND's
            cur_slot = free_slots.back();
            free_slots.pop_back();
          }
          cur_use = std::move(use);
          dst = std::span(p, h.length);
          return action::payload;
        }
        if (h.op == opcode::read_req) {
          header resp;
          resp.op = opcode::read_resp;
          resp.seq = h.seq;
          resp.length = h.length;
          queue_response(resp, p, h.length, std::move(region));
          outq.back().use = std::move(use);
        } else {
          std::atomic_ref<std::uint64_t> word(*reinterpret_cast<std::uint64_t*>(p));
          std::uint64_t old;
          if (h.op == opcode::cas) {
            old = h.arg0;
            word.compare_exchange_strong(old, h.arg1);
          } else {
            old = word.fetch_add(h.arg0);
          }
          header resp;
          resp.op = opcode::atomic_resp;
          resp.seq = h.seq;
          resp.arg0 = old;
          queue_response(resp);
        }
        return action::next;
      }
      case opcode::ack:
        return ack_upto(h.seq) ? action::next : action::protocol;
      case opcode::nak: {
        op_rec* r = answered(h.seq);
        if (!r) return action::protocol;
        r->ec = h.st == status::remote_access_error ? err(errc::remote_access_error)
                                                    : err(errc::remote_operation_error);
        return action::io;  // the connection is in error; r completes with its own error
      }
      case opcode::read_resp: {
        op_rec* r = answered(h.seq);
        if (!r || r->op != opcode::read_req || r->read_dst.size() != h.length) return action::protocol;
        cur_op = r;  // stays the front: only the reader pops, and finish() waits for the reader
        dst = r->read_dst;
        return action::payload;
      }
      case opcode::atomic_resp: {
        op_rec* r = answered(h.seq);
        if (!r || (r->op != opcode::cas && r->op != opcode::faa)) return action::protocol;
        pop_complete(r, {}, h.arg0);
        return action::next;
      }
      case opcode::credit: {
        if (h.arg0 > credits_out) return action::protocol;
        credits_out -= static_cast<std::uint32_t>(h.arg0);
        credits.release(h.arg0);
        return action::next;
      }
    }
    return action::protocol;
  }

  // The frame whose payload begin_frame asked for is complete.
  void finish_payload(const header& h) {
    if (h.op == opcode::read_resp) {
      pop_complete(std::exchange(cur_op, nullptr), {}, 0);
      return;
    }
    if (h.op == opcode::send || h.op == opcode::write_imm) {
      inbound in{cur_slot, h.op == opcode::send ? h.length : 0, {}};
      if (h.flags & flag_imm) in.imm = h.imm;
      (void)inbox.try_send(in);
    }
    cur_use = {};
    ack_seq = h.seq;  // SEND, WRITE, WRITE_IMM
    wake_writer();
  }

  // Takes what the socket already holds with a plain non-blocking recv
  // straight into `buf` (still no user-space copy): a frame's payload, and
  // often the next header, are there by the time its header is parsed, and a
  // loop turn through io_uring costs more than the syscall. Returns the bytes
  // taken (fewer than asked: the rest must be awaited), or the error.
  result<std::size_t> recv_now(std::span<std::byte> buf) {
    std::size_t got = 0;
    while (got < buf.size()) {
      ssize_t n = ::recv(sock.native_handle(), buf.data() + got, buf.size() - got, MSG_DONTWAIT);
      if (n > 0) {
        got += static_cast<std::size_t>(n);
        continue;
      }
      if (n == 0) return err(errc::eof);
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return errno_code(errno);
      break;
    }
    return got;
  }

  // The reader is one coroutine whose only suspensions are real waits (the
  // socket, the responder units) and the budget's yield: everything a frame
  // needs when its bytes are there runs in plain calls.
  static task<void> reader_loop(std::shared_ptr<conn_state> s) {
    std::array<std::byte, header_size> hb{};
    std::error_code ec = err(errc::disconnected);
    unsigned frames = 0;  // handled since the loop turn began
    for (;;) {
      auto got = s->recv_now(hb);
      if (!got) break;
      if (*got < header_size) {
        auto r = co_await s->sock.read_exact(std::span(hb).subspan(*got));
        if (!r) break;
        frames = 0;  // resumed by the loop: a new turn
      }
      auto h = decode_header(hb, s->lim);
      if (!h) {
        ec = err(errc::protocol_error);
        break;
      }
      std::span<std::byte> dst;
      action a;
      try {
        a = s->begin_frame(*h, dst);
      } catch (const std::bad_alloc&) {  // no memory for a receive buffer: this connection fails, not the process
        ec = std::make_error_code(std::errc::not_enough_memory);
        break;
      }
      while (a == action::wait_room) {
        auto r = co_await s->responder_room.wait();
        if (!r || s->stopping) {
          a = action::io;
          break;
        }
        frames = 0;
        a = s->begin_frame(*h, dst);
      }
      if (a == action::payload) {
        auto n = s->recv_now(dst);
        if (!n) break;
        if (*n < dst.size()) {
          auto r = co_await s->sock.read_exact(dst.subspan(*n));
          if (!r) break;
          frames = 0;
        }
        s->finish_payload(*h);
        a = action::next;
      }
      if (a == action::next) {
        // A peer that keeps the socket full gets `reader_frame_budget`
        // frames, then the others have their turn.
        if (++frames == reader_frame_budget) {
          frames = 0;
          co_await yield();
          if (s->stopping && !s->nak_then_drain) break;
        }
        continue;
      }
      if (a == action::protocol) ec = err(errc::protocol_error);
      if (a == action::drain) {
        // After a NAK: discard what the peer still sends, touching nothing,
        // until it closes (it goes to the error state on the NAK) or the
        // linger time is up.
        std::vector<std::byte> scratch(16384);
        for (;;) {
          auto left = std::chrono::duration_cast<std::chrono::milliseconds>(s->nak_deadline - clock::now());
          if (left.count() <= 0) break;
          auto n = co_await with_timeout(s->sock.read_some(scratch), left);
          if (!n || *n == 0) break;
        }
      }
      break;
    }
    s->cur_use = {};  // a payload cut short: nothing writes through the grant any more
    s->enter_error(ec);
    s->loop_exited();
  }

  struct writer_park {
    conn_state& s;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) noexcept { s.writer_waiter = h; }
    void await_resume() const noexcept {}
  };

  static task<void> writer_loop(std::shared_ptr<conn_state> s) {
    std::vector<out_frame> batch;
    std::vector<iovec> iov;
    std::array<std::byte, header_size> ackh{}, credh{};
    bool ack_waited = false;
    batch.reserve(256);
    while (!s->stopping || s->nak_then_drain) {
      if (s->outq.empty() && s->ack_seq == s->ack_sent && s->credits_to_return == 0) {
        if (s->nak_then_drain) {
          (void)s->sock.shutdown(SHUT_WR);  // the NAK is out; the reader drains until the peer closes
          break;
        }
        co_await writer_park{*s};
        continue;
      }
      if (s->outq.empty() && s->credits_to_return == 0 && !ack_waited) {
        // Only an ACK to send: wait one loop turn, so that a response the
        // application makes to what was just received (a ping-pong, an echo)
        // carries it in the same segment instead of following it.
        ack_waited = true;
        co_await yield();
        continue;
      }
      ack_waited = false;
      batch.clear();
      iov.clear();
      while (!s->outq.empty() && batch.size() < 256) {
        batch.push_back(std::move(s->outq.front()));
        s->outq.pop_front();
        s->responses_queued -= batch.back().response;
      }
      if (s->responses_queued < our_responder_ops()) s->responder_room.set();
      for (auto& f : batch) {
        iov.push_back({f.hdr.data(), header_size});
        if (f.len) iov.push_back({const_cast<std::byte*>(f.payload), f.len});
      }
      // A cumulative ACK goes after every response queued before it.
      if (s->outq.empty() && s->ack_seq != s->ack_sent) {
        header a;
        a.op = opcode::ack;
        a.seq = s->ack_seq;
        encode_header(a, ackh);
        iov.push_back({ackh.data(), header_size});
        s->ack_sent = s->ack_seq;
      }
      if (s->credits_to_return) {
        header c;
        c.op = opcode::credit;
        c.arg0 = s->credits_to_return;
        s->credits_to_return = 0;
        encode_header(c, credh);
        iov.push_back({credh.data(), header_size});
      }
      result<void> r;
      if (!s->nak_then_drain) {
        r = co_await s->sock.writev_all(iov);
      } else {  // a peer that does not read gets until the linger time is up
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(s->nak_deadline - clock::now());
        r = left.count() > 0 ? co_await with_timeout(s->sock.writev_all(iov), left) : err(errc::disconnected);
        if (!r) s->abort_io();
      }
      batch.clear();
      if (!r) {
        s->enter_error(err(errc::disconnected));
        break;
      }
    }
    s->loop_exited();
  }

  static driver run_detached(task<void> t) {
    try {
      co_await std::move(t);
    } catch (...) {
    }
  }

  void start() {
    for (int i = 0; i < 2; ++i) {
      driver d = run_detached(i == 0 ? reader_loop(shared_from_this()) : writer_loop(shared_from_this()));
      d.set_stop_token(stop.get_token());
      d.on_done(nullptr, nullptr, true);
      d.release().resume();
    }
  }

  // ------------------------------------------------------------ operations

  struct wait_rec {
    op_rec& r;
    bool await_ready() const noexcept { return r.done; }
    void await_suspend(std::coroutine_handle<> h) noexcept { r.waiter = h; }
    void await_resume() const noexcept {}
  };

  struct canceller {
    conn_state* s;
    std::uint64_t seq;
    void operator()() const noexcept {
      if (s->ctx->running_in_this_thread()) {
        s->cancel_op(seq);
        return;
      }
      try {
        s->ctx->dispatch([sp = s->shared_from_this(), q = seq] { sp->cancel_op(q); });
      } catch (...) {
      }
    }
  };

  static task<result<std::uint64_t>> submit(std::shared_ptr<conn_state> s, header h, std::span<const std::byte> payload,
                                            std::span<std::byte> read_dst) {
    std::stop_token token = co_await get_stop_token();
    if (s->error) co_return s->later_error();
    if (token.stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
    if (!s->slots.try_acquire()) {
      ++s->slot_waiters;
      auto r = co_await s->slots.acquire();
      --s->slot_waiters;
      if (!r) co_return r.error();
    }
    if (s->error) co_return s->later_error();
    const bool needs_credit = h.op == opcode::send || h.op == opcode::write_imm;
    if (needs_credit) {
      if (!s->credits.try_acquire()) {
        ++s->credit_waiters;
        auto r = co_await s->credits.acquire();
        --s->credit_waiters;
        if (!r) {
          s->slots.release();
          co_return r.error();
        }
      }
      if (s->error) co_return s->later_error();
      ++s->credits_out;
    }
    // As credits: the peer answers at most its announced READ/atomic
    // requests at once; more wait here, not in its socket.
    const bool responder = needs_responder(h.op);
    if (responder && !s->responder_units.try_acquire()) {
      ++s->responder_waiters;
      auto r = co_await s->responder_units.acquire();
      --s->responder_waiters;
      if (!r) {
        s->slots.release();
        co_return r.error();
      }
    }
    if (s->error) co_return s->later_error();
    op_rec rec;
    rec.holds_responder = responder;
    rec.op = h.op;
    rec.seq = h.seq = s->next_seq++;
    rec.read_dst = read_dst;
    out_frame f;
    encode_header(h, f.hdr);
    f.payload = payload.data();
    f.len = payload.size();
    s->outq.push_back(std::move(f));
    s->pending.push_back(&rec);
    s->idle.reset();
    s->wake_writer();
    {
      std::stop_callback<canceller> cb(token, canceller{s.get(), rec.seq});
      co_await wait_rec{rec};
    }
    s->slots.release();
    if (rec.ec) co_return rec.ec;
    co_return rec.value;
  }

  static task<result<void>> submit_void(std::shared_ptr<conn_state> s, header h, std::span<const std::byte> payload) {
    auto r = co_await submit(std::move(s), h, payload, {});
    if (!r) co_return r.error();
    co_return result<void>{};
  }

  // A batch (connection::post_batch): the frames of a chunk are queued
  // together, so the writer sends them in one writev; the peer's cumulative
  // ACK completes them.
  static task<result<void>> submit_batch(std::shared_ptr<conn_state> s, std::vector<header> hs,
                                         std::span<const operation> ops) {
    std::stop_token token = co_await get_stop_token();
    if (s->error) co_return s->later_error();
    if (token.stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
    std::vector<op_rec> recs(ops.size());
    std::size_t queued = 0;
    std::error_code early{};
    const std::size_t max_ops = s->opts.send_queue_depth;
    while (queued < ops.size() && !early) {
      // The chunk [queued, end): as many operations as slots, credits and
      // the peer's responder units allow now (at most send_queue_depth);
      // only an empty chunk waits, so a batch never holds units while it
      // waits for more.
      std::size_t end = queued, credits_taken = 0, responders_taken = 0;
      while (end < ops.size() && end - queued < max_ops) {
        const bool c = hs[end].op == opcode::send || hs[end].op == opcode::write_imm;
        const bool rd = needs_responder(hs[end].op);
        if (!s->slots.try_acquire()) {
          if (end > queued) break;
          ++s->slot_waiters;
          auto r = co_await s->slots.acquire();
          --s->slot_waiters;
          if (!r) {
            early = r.error();
            break;
          }
        }
        if (c && !s->credits.try_acquire()) {
          if (end > queued) {
            s->slots.release();
            break;
          }
          ++s->credit_waiters;
          auto r = co_await s->credits.acquire();
          --s->credit_waiters;
          if (!r) {
            s->slots.release();
            early = r.error();
            break;
          }
        }
        if (rd && !s->responder_units.try_acquire()) {
          if (end > queued) {
            s->slots.release();
            break;
          }
          ++s->responder_waiters;
          auto r = co_await s->responder_units.acquire();
          --s->responder_waiters;
          if (!r) {
            s->slots.release();
            early = r.error();
            break;
          }
        }
        credits_taken += c;
        responders_taken += rd;
        ++end;
      }
      if (!early && s->error) early = s->later_error();
      if (early) {
        s->slots.release(end - queued);
        s->credits.release(credits_taken);
        s->responder_units.release(responders_taken);
        break;
      }
      s->credits_out += static_cast<std::uint32_t>(credits_taken);
      for (std::size_t i = queued; i < end; ++i) {
        header& h = hs[i];
        op_rec& rec = recs[i];
        rec.op = h.op;
        rec.seq = h.seq = s->next_seq++;
        rec.owns_slot = true;
        rec.holds_responder = needs_responder(h.op);
        if (h.op == opcode::read_req)
          rec.read_dst = std::span(const_cast<std::byte*>(ops[i].local.data()), ops[i].local.size());
        out_frame f;
        encode_header(h, f.hdr);
        if (h.op != opcode::read_req) {
          f.payload = ops[i].local.data();
          f.len = ops[i].local.size();
        }
        s->outq.push_back(std::move(f));
        s->pending.push_back(&rec);
      }
      queued = end;
      s->idle.reset();
      s->wake_writer();
    }
    if (queued > 0) {
      // What was queued completes (or fails) in order; wait for all of it.
      std::stop_callback<canceller> cb(token, canceller{s.get(), recs[queued - 1].seq});
      for (std::size_t i = 0; i < queued; ++i) co_await wait_rec{recs[i]};
    }
    for (std::size_t i = 0; i < queued; ++i)
      if (recs[i].ec) co_return token.stop_requested() ? std::make_error_code(std::errc::operation_canceled) : recs[i].ec;
    if (early) {
      if (queued > 0) s->enter_error(err(errc::disconnected));  // part of the batch is done: RC has no partial undo
      co_return early;
    }
    co_return result<void>{};
  }

  static task<result<message>> recv(std::shared_ptr<conn_state> s) {
    auto r = co_await s->inbox.receive();
    if (!r) {
      if (r.error() == std::errc::broken_pipe) co_return s->error ? s->error : err(errc::disconnected);
      co_return r.error();
    }
    inbound in = *r;
    if (s->messages_out++ == 0) s->keepalive = s;
    co_return message(std::span<const std::byte>(s->slot_data(in.slot), in.len), in.imm, &release_message, s.get(),
                      in.slot);
  }

  static task<result<void>> close(std::shared_ptr<conn_state> s) {
    while (!s->stopping && !s->pending.empty()) {
      auto r = co_await s->idle.wait();
      if (!r) co_return r.error();
    }
    // What we owe the peer goes out first (the ACK of the message we just
    // consumed, returned credits): the writer is parked with nothing left to
    // send, so its last writev completed. A peer that does not read gets
    // the linger time.
    const auto deadline = clock::now() + linger;
    while (!s->stopping && !s->error && clock::now() < deadline &&
           (!s->writer_waiter || !s->outq.empty() || s->ack_seq != s->ack_sent || s->credits_to_return != 0)) {
      if ((co_await get_stop_token()).stop_requested()) break;  // a cancelled close aborts
      s->wake_writer();
      co_await yield();
    }
    s->enter_error(err(errc::disconnected));
    if (!s->finished) {
      auto r = co_await s->finished_ev.wait();
      if (!r) co_return r.error();
    }
    co_return result<void>{};
  }
};

// A memory_grant: its entry in the domain's grant table.
struct tcp_grant final : grant_impl {
  std::shared_ptr<domain_state> dom;
  std::shared_ptr<grant_entry> e;
  remote_buffer remote() const noexcept override {
    if (e->revoked) return {};
    return {reinterpret_cast<std::uint64_t>(e->addr), e->rkey, e->length};
  }
  ~tcp_grant() override { dom->drop_grant(*e); }
};

class tcp_connection final : public connection_impl {
 public:
  explicit tcp_connection(std::shared_ptr<conn_state> s) noexcept
      : connection_impl(launch_table_of<tcp_connection>), s_(std::move(s)) {}
  ~tcp_connection() override {
    for (auto& g : grants_) s_->dom->drop_grant(*g);  // the connection's grants go with it
    s_->enter_error(err(errc::disconnected));
  }

  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                   unsigned rights) override {
    return ready(make_grant(r, offset, len, rights));
  }
  task<result<void>> revoke(grant_impl& g) override {
    auto e = static_cast<tcp_grant&>(g).e;
    s_->dom->drop_grant(*e);
    return wait_unused(std::move(e));
  }

  // The tcp provider's operations stay coroutines: next to a socket round
  // trip, their frames cost nothing measurable.
  void send(op_slot<void>& out, std::span<const std::byte> msg) { out.set_task(send_task(msg)); }
  void recv(op_slot<message>& out) { out.set_task(recv_task()); }
  void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) {
    out.set_task(write_task(local, remote));
  }
  void write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                      std::uint32_t imm) {
    out.set_task(write_with_imm_task(local, remote, imm));
  }
  void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) {
    out.set_task(read_task(local, remote));
  }
  void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                        std::uint64_t desired) {
    out.set_task(compare_and_swap_task(remote, expected, desired));
  }
  void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
    out.set_task(fetch_and_add_task(remote, add));
  }
  // One operation's request header, as post_batch and prepare build it.
  result<header> header_of(const operation& o) const {
    switch (o.op) {
      case operation::type::send: {
        if (o.local.size() > s_->peer.receive_buffer_size) return make_error_code(errc::message_too_long);
        header h;
        h.op = opcode::send;
        h.length = static_cast<std::uint32_t>(o.local.size());
        return h;
      }
      case operation::type::write:
      case operation::type::write_with_imm:
      case operation::type::read: {
        if (o.local.size() > max_rdma_length) return make_error_code(errc::message_too_long);
        opcode op = o.op == operation::type::write  ? opcode::write
                    : o.op == operation::type::read ? opcode::read_req
                                                    : opcode::write_imm;
        header h = one_sided(op, o.remote, o.local.size());
        if (op == opcode::write_imm) {
          h.flags = flag_imm;
          h.imm = o.imm;
        }
        return h;
      }
      default: return std::make_error_code(std::errc::invalid_argument);
    }
  }
  task<result<void>> post_batch(std::span<const operation> ops) override {
    std::vector<header> hs;
    hs.reserve(ops.size());
    for (const operation& o : ops) {
      auto h = header_of(o);
      if (!h) return finish_now(h.error());
      hs.push_back(*h);
    }
    if (hs.empty()) return finish_now({});
    return conn_state::submit_batch(s_, std::move(hs), ops);
  }
  result<std::unique_ptr<prepared_impl>> prepare(const operation& o) override {
    auto h = header_of(o);
    if (!h) return h.error();
    auto p = std::make_unique<prepared_state>();
    p->s = s_;
    p->h = *h;
    p->local = o.local;
    return std::unique_ptr<prepared_impl>(std::move(p));
  }
  task<result<void>> close() override { return conn_state::close(s_); }
  bool is_open() const noexcept override { return !s_->error && !s_->stopping; }
  transport_kind kind() const noexcept override { return transport_kind::tcp; }
  std::size_t max_message_size() const noexcept override { return s_->peer.receive_buffer_size; }
  endpoint remote_endpoint() const noexcept override { return s_->remote; }

 private:
  task<result<void>> send_task(std::span<const std::byte> msg) {
    if (msg.size() > s_->peer.receive_buffer_size) return fail<void>(errc::message_too_long);
    header h;
    h.op = opcode::send;
    h.length = static_cast<std::uint32_t>(msg.size());
    return conn_state::submit_void(s_, h, msg);
  }
  task<result<message>> recv_task() { return conn_state::recv(s_); }
  task<result<void>> write_task(std::span<const std::byte> local, remote_buffer remote) {
    if (local.size() > max_rdma_length) return fail<void>(errc::message_too_long);
    return conn_state::submit_void(s_, one_sided(opcode::write, remote, local.size()), local);
  }
  task<result<void>> write_with_imm_task(std::span<const std::byte> local, remote_buffer remote,
                                    std::uint32_t imm) {
    if (local.size() > max_rdma_length) return fail<void>(errc::message_too_long);
    header h = one_sided(opcode::write_imm, remote, local.size());
    h.flags = flag_imm;
    h.imm = imm;
    return conn_state::submit_void(s_, h, local);
  }
  task<result<void>> read_task(std::span<std::byte> local, remote_buffer remote) {
    if (local.size() > max_rdma_length) return fail<void>(errc::message_too_long);
    return read_impl(s_, one_sided(opcode::read_req, remote, local.size()), local);
  }
  task<result<std::uint64_t>> compare_and_swap_task(remote_buffer remote, std::uint64_t expected,
                                               std::uint64_t desired) {
    header h = one_sided(opcode::cas, remote, 8);
    h.arg0 = expected;
    h.arg1 = desired;
    return conn_state::submit(s_, h, {}, {});
  }
  task<result<std::uint64_t>> fetch_and_add_task(remote_buffer remote, std::uint64_t add) {
    header h = one_sided(opcode::faa, remote, 8);
    h.arg0 = add;
    return conn_state::submit(s_, h, {}, {});
  }
  // The request header of a one-sided operation on `remote`.
  static header one_sided(opcode op, remote_buffer remote, std::size_t length) noexcept {
    header h;
    h.op = op;
    h.addr = remote.address;
    h.rkey = remote.rkey;
    h.length = static_cast<std::uint32_t>(length);
    return h;
  }
  template <class T>
  static task<result<T>> fail(errc e) {
    co_return make_error_code(e);
  }
  static task<result<void>> finish_now(std::error_code ec) {
    if (ec) co_return ec;
    co_return result<void>{};
  }
  static task<result<void>> read_impl(std::shared_ptr<conn_state> s, header h, std::span<std::byte> local) {
    auto r = co_await conn_state::submit(std::move(s), h, {}, local);
    if (!r) co_return r.error();
    co_return result<void>{};
  }
  // A prepared operation: the request header built once; each start is
  // the single operation's task (next to a socket round trip, a frame per
  // start costs nothing measurable).
  struct prepared_state final : prepared_impl {
    std::shared_ptr<conn_state> s;
    header h;
    std::span<const std::byte> local;
    op_slot<void> slot;  // the current start's task
    start_result start() noexcept override { return start_result::pending; }
    std::coroutine_handle<> suspend(std::coroutine_handle<> awaiter, std::stop_token token) override {
      if (h.op == opcode::read_req)
        slot.set_task(read_impl(s, h, {const_cast<std::byte*>(local.data()), local.size()}));
      else
        slot.set_task(conn_state::submit_void(s, h, local));
      if (slot.start()) return awaiter;
      return slot.suspend(awaiter, std::move(token));
    }
    result<void> take() override { return slot.take(); }
  };
  result<memory_grant> make_grant(const memory_region& r, std::size_t offset, std::size_t len, unsigned rights) {
    if (auto c = check_grant(r, offset, len, rights); !c) return c.error();
    auto region = std::dynamic_pointer_cast<tcp_region>(r.impl());
    if (!region || region->dom != s_->dom) return std::make_error_code(std::errc::invalid_argument);
    if (s_->error || s_->stopping) return err(errc::disconnected);
    auto e = std::make_shared<grant_entry>();
    e->conn = s_.get();
    e->region = std::move(region);
    e->addr = e->region->addr + offset;
    e->length = len;
    e->access = rights;
    auto key = s_->dom->new_key();
    if (!key) return key.error();
    e->rkey = *key;
    s_->dom->grants[e->rkey] = e;
    std::erase_if(grants_, [](const auto& g) { return g->revoked; });  // bounded by the live grants
    grants_.push_back(e);
    auto g = std::make_unique<tcp_grant>();
    g->owner = this;
    g->dom = s_->dom;
    g->e = std::move(e);
    return memory_grant(std::move(g));
  }
  static task<result<memory_grant>> ready(result<memory_grant> r) { co_return r; }
  // Out of the table already: waits for the accesses through it in progress.
  static task<result<void>> wait_unused(std::shared_ptr<grant_entry> e) {
    while (e->in_use > 0)
      if (auto r = co_await e->idle.wait(); !r) co_return r.error();
    co_return result<void>{};
  }
  std::shared_ptr<conn_state> s_;
  std::vector<std::shared_ptr<grant_entry>> grants_;  // revoked with the connection
};

// ---------------------------------------------------------------- set-up

}  // namespace

std::size_t tcp_receive_buffer_bytes() noexcept { return receive_buffer_bytes.load(std::memory_order_relaxed); }

namespace {

result<void> check_options(const connection_options& o) {
  // No SRQ equivalent here (see connection_options::shared_receive_queue):
  // refused rather than ignored.
  if (o.shared_receive_queue) return make_error_code(errc::not_supported);
  if (o.send_queue_depth == 0 || o.receive_buffers == 0 || o.receive_buffers > max_receive_buffers ||
      o.receive_buffer_size == 0 || o.receive_buffer_size > max_receive_buffer_size)
    return std::make_error_code(std::errc::invalid_argument);
  return {};
}

// The hello exchange. The connection's loops are not started here: a
// handshake that loses its race against a deadline leaves nothing running.
task<result<std::shared_ptr<conn_state>>> handshake(tcp_socket& sock, std::shared_ptr<domain_state> dom,
                                                    connection_options opts) {
  (void)sock.set_nodelay(true);
  // A connection lives long and does a read and a writev per batch of
  // frames: a registered-file slot saves a file lookup on each (best effort).
  (void)sock.register_file();
  std::array<std::byte, hello_size> mine{}, theirs{};
  hello h;
  h.receive_buffers = opts.receive_buffers;
  h.receive_buffer_size = opts.receive_buffer_size;
  encode_hello(h, mine);
  if (auto r = co_await sock.write_all(mine); !r) co_return r.error();
  if (auto r = co_await sock.read_exact(theirs); !r) co_return r.error();
  auto peer = decode_hello(theirs);
  if (!peer) co_return peer.error();
  auto ep = sock.remote_endpoint();
  co_return std::make_shared<conn_state>(std::move(sock), std::move(dom), opts, *peer, ep ? *ep : endpoint{});
}

task<result<connection>> establish(tcp_socket sock, std::shared_ptr<domain_state> dom, connection_options opts) {
  auto s = co_await with_timeout(handshake(sock, std::move(dom), opts), opts.connect_timeout);
  if (!s) co_return s.error();
  (*s)->start();
  co_return connection(std::make_unique<tcp_connection>(std::move(*s)));
}

// Runs `t` on the calling loop, owned by nobody; `token` cancels it.
void spawn_detached(task<void> t, std::stop_token token) {
  driver d = conn_state::run_detached(std::move(t));
  d.set_stop_token(std::move(token));
  d.on_done(nullptr, nullptr, true);
  d.release().resume();
}

// Fails the connection once no byte has arrived from the peer for `limit`
// (listener_options::idle_timeout). The kernel keeps the time of the last
// data received (TCP_INFO's tcpi_last_data_recv), so nothing is done per
// frame: this wakes about once per `limit` on a busy connection, and fires
// between `limit` and `limit` plus a sixteenth of it after the last byte.
task<void> idle_watch(std::shared_ptr<conn_state> s, std::chrono::milliseconds limit) {
  const auto min_wait = std::max(limit / 16, std::chrono::milliseconds(1));
  std::chrono::milliseconds wait = limit;
  while (!s->stopping) {
    if (!co_await sleep_for(wait)) break;  // the connection stopped
    if (s->stopping || !s->sock.is_open()) break;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (::getsockopt(s->sock.native_handle(), IPPROTO_TCP, TCP_INFO, &info, &len) != 0) break;
    const std::chrono::milliseconds quiet{info.tcpi_last_data_recv};
    if (quiet >= limit) {
      s->enter_error(err(errc::idle_timeout));
      break;
    }
    wait = std::max(limit - quiet, min_wait);
  }
}

// A listener's state, shared with its handshakes: they end a loop turn after
// close() (their stop is requested) and may outlive it.
struct listener_core {
  listener_core(tcp_listener l, std::shared_ptr<domain_state> d, connection_options o, listener_options lim)
      : sock(std::move(l)),
        dom(std::move(d)),
        opts(o),
        limits(lim),
        ready(std::max<std::uint32_t>(lim.accept_backlog, 1)) {}

  tcp_listener sock;
  std::shared_ptr<domain_state> dom;
  connection_options opts;
  listener_options limits;
  channel<connection> ready;  // established, not yet taken by accept()
  std::shared_ptr<live_count> live = std::make_shared<live_count>();
  std::uint32_t handshakes = 0;  // in progress
  std::error_code failure{};     // the listening socket's own error, for accept()
  event established;             // set when a handshake puts a connection in `ready`, and on close
  bool closed = false;
  std::stop_source stop;

  // A new TCP connection that may not start its handshake (refusal()) is
  // closed at once (the peer reads EOF) and costs nothing more.

  void close() noexcept {
    if (closed) return;
    closed = true;
    stop.request_stop();  // every handshake in progress ends, closing its socket
    sock.close();
    ready.close();
    while (ready.try_receive()) {}  // established, never taken: closed here
    established.set();              // accept() calls waiting fail
  }

  void refused(const tcp_socket& peer, std::string_view why) const {
    if (!limits.on_refused) return;
    auto ep = peer.remote_endpoint();
    try {
      limits.on_refused(ep ? *ep : endpoint{}, why);
    } catch (...) {  // the application's logger: its failure is not the listener's
    }
  }

  // Why a new TCP connection is refused at once, or nullptr if it may start
  // its handshake.
  const char* refusal() const noexcept {
    if (handshakes >= limits.max_handshakes) return "refused: too many handshakes in progress";
    if (ready.size() >= ready.capacity()) return "refused: accept backlog full";
    if (limits.max_connections != 0 && live->n + handshakes >= limits.max_connections)
      return "refused: connection cap reached";
    return nullptr;
  }

  static bool transient(const std::error_code& ec) noexcept {
    // Out of descriptors or memory, or a peer that gave up before accept:
    // the listening socket itself is fine; back off and accept again.
    return ec != std::errc::bad_file_descriptor && ec != std::errc::invalid_argument &&
           ec != std::errc::not_a_socket && ec != std::errc::operation_not_supported &&
           ec != std::errc::operation_canceled;
  }

  // Takes one TCP connection from the kernel and starts its handshake, or
  // refuses it. Run by accept(): a socket it got is never lost, even when
  // accept() stops waiting for it (a handshake finished first).
  static task<void> accept_one(std::shared_ptr<listener_core> c) {
    auto s = co_await c->sock.accept();
    if (c->closed) co_return;
    if (!s) {
      if (s.error() == std::errc::operation_canceled) co_return;
      if (transient(s.error())) {
        (void)co_await sleep_for(std::chrono::milliseconds(10));
        co_return;
      }
      c->failure = s.error();
      c->ready.close();
      c->established.set();
      co_return;
    }
    if (const char* why = c->refusal()) {
      c->refused(*s, why);
      s->close();
      co_return;
    }
    ++c->handshakes;
    spawn_detached(handshake_one(c, std::move(*s)), c->stop.get_token());
  }

  static task<void> await_established(std::shared_ptr<listener_core> c) { (void)co_await c->established.wait(); }

  // One peer's hello, with its own deadline, concurrently with the others.
  static task<void> handshake_one(std::shared_ptr<listener_core> c, tcp_socket sock) {
    auto s = co_await with_timeout(handshake(sock, c->dom, c->opts), c->limits.handshake_timeout);
    --c->handshakes;
    if (!s) {  // a failed, late or cancelled hello: `sock` closes here
      if (!c->closed && s.error() != std::errc::operation_canceled)
        c->refused(sock, "handshake failed: " + s.error().message());
      co_return;
    }
    (*s)->origin = c->live;
    ++c->live->n;
    (*s)->start();
    if (c->limits.idle_timeout.count() > 0)
      spawn_detached(idle_watch(*s, c->limits.idle_timeout), (*s)->stop.get_token());
    connection conn(std::make_unique<tcp_connection>(std::move(*s)));
    // Closed meanwhile, or the backlog filled up since refusal(): refused, and
    // `conn` closes here.
    if (!c->closed && c->ready.try_send(conn)) c->established.set();
  }
};

// accept() takes TCP connections from the kernel and starts their handshakes,
// which run in the background, each with its own deadline, until it finds
// an established connection in the backlog. Nothing runs for the listener
// while no accept() waits and no handshake is in progress, so a listener
// closed then leaves nothing behind. See listener_options for the limits.
class tcp_listener_impl final : public listener_impl {
 public:
  tcp_listener_impl(tcp_listener l, std::shared_ptr<domain_state> d, connection_options o, listener_options lim)
      : c_(std::make_shared<listener_core>(std::move(l), std::move(d), o, lim)) {}
  ~tcp_listener_impl() override { c_->close(); }

  task<result<connection>> accept() override { return accept_impl(c_); }
  endpoint local_endpoint() const override {
    auto e = c_->sock.local_endpoint();
    return e ? *e : endpoint{};
  }
  void close() noexcept override { c_->close(); }

 private:
  static task<result<connection>> accept_impl(std::shared_ptr<listener_core> c) {
    for (;;) {
      if (auto conn = c->ready.try_receive()) co_return std::move(*conn);
      if (c->closed || c->ready.closed())
        co_return c->failure ? c->failure : std::make_error_code(std::errc::bad_file_descriptor);
      c->established.reset();
      co_await when_any(listener_core::accept_one(c), listener_core::await_established(c));
      if ((co_await get_stop_token()).stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
    }
  }

  std::shared_ptr<listener_core> c_;
};

class tcp_domain final : public domain_impl {
 public:
  transport_kind kind() const noexcept override { return transport_kind::tcp; }
  std::string describe() const override {
    return "tcp (user-space RC semantics over TCP, wire protocol v" + std::to_string(protocol_version) + ")";
  }

  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) override {
    if (mem.empty() || (flags & ~access::all) != 0) return std::make_error_code(std::errc::invalid_argument);
    // As ibv_reg_mr: remote write and atomic rights need local write.
    if ((flags & (access::remote_write | access::remote_atomic)) && !(flags & access::local_write))
      return std::make_error_code(std::errc::invalid_argument);
    domain_state::cache_key key{reinterpret_cast<std::uintptr_t>(mem.data()), mem.size(), flags};
    if (auto it = st_->cache.find(key); it != st_->cache.end()) {
      if (auto r = st_->find(it->second)) return memory_region(std::move(r));
    }
    auto r = std::make_shared<tcp_region>();
    r->dom = st_;
    r->addr = mem.data();
    r->length = mem.size();
    r->access = flags;
    auto rkey = st_->new_key();
    if (!rkey) return rkey.error();
    r->rkey = r->lkey = *rkey;
    st_->table[r->rkey] = r;
    st_->cache[key] = r->rkey;
    return memory_region(std::move(r));
  }

  task<result<connection>> connect(endpoint remote, connection_options opts) override {
    if (auto c = check_options(opts); !c) return fail(c.error());
    return connect_impl(st_, remote, opts);
  }

  result<listener> listen(endpoint local, connection_options opts, listener_options limits) override {
    if (auto c = check_options(opts); !c) return c.error();
    auto l = tcp_listener::bind(local);
    if (!l) return l.error();
    return listener(std::make_unique<tcp_listener_impl>(std::move(*l), st_, opts, limits));
  }

 private:
  static task<result<connection>> fail(std::error_code ec) { co_return ec; }
  static task<result<connection>> connect_impl(std::shared_ptr<domain_state> dom, endpoint remote,
                                               connection_options opts) {
    auto start = clock::now();
    auto s = co_await tcp_socket::connect(remote, opts.connect_timeout);
    if (!s) co_return s.error();
    auto left = opts.connect_timeout - std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
    opts.connect_timeout = std::max(left, std::chrono::milliseconds(1));
    co_return co_await establish(std::move(*s), std::move(dom), opts);
  }

  std::shared_ptr<domain_state> st_ = std::make_shared<domain_state>();
};

}  // namespace

result<std::shared_ptr<domain_impl>> make_tcp_domain(const domain_options&) {
  return std::shared_ptr<domain_impl>(std::make_shared<tcp_domain>());
}

}  // namespace shuttle::detail
