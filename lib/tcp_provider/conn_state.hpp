// The tcp provider: RDMA semantics (RC queue pair rules) over a TCP stream,
// driven by the io_uring loop. Think of it as soft-iWARP in user space.
//
// Per connection, one conn_state (internal), shared by the connection object
// (connection.hpp), its two loop coroutines, the operations in flight and
// the messages handed out:
//  - the reader (reader.cpp) validates each frame and applies it: a request
//    against the domain's registrations (domain_state.hpp), a response to
//    the pending operations, in order;
//  - the writer (writer.cpp) gathers queued frames into one writev, plus the
//    cumulative ACK and the CREDIT frame;
//  - operations (operations.cpp, batch.cpp) take a send-queue slot (and a
//    credit for SEND/WRITE_IMM), get a sequence number, queue their frame and
//    wait for their response.
// The wire format is wire.hpp; set-up is connection.cpp, listener.cpp and
// domain.cpp.
//
// Errors: the first error moves the connection out of `open` (conn_state::
// phase): the socket is shut down, both loops are stopped, and only once
// both have exited (nothing touches an operation's buffers any more) are the
// pending operations completed. A cancelled in-flight operation takes the
// same path (NIC-safe cancellation, as verbs). The first error is kept: it is
// what the pending operations fail with.
//
// What the reader, the writer and the operations call per frame is defined
// here, inline: they were one translation unit, and the hot path stays
// inlinable across the files.
#pragma once

#include "domain_state.hpp"
#include "pipe.hpp"
#include "wire.hpp"

#include <shuttle/channel.hpp>
#include <shuttle/detail/driver.hpp>
#include <shuttle/detail/loop_cancel.hpp>
#include "../transport/provider.hpp"
#include <shuttle/io_context.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/tcp.hpp>
#include <shuttle/timer.hpp>

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <stop_token>
#include <vector>

namespace shuttle::detail::tcp_provider {

struct op_rec {
  opcode op{};
  std::uint64_t seq = 0;
  // Requests seq .. seq+count-1: a block list's frame (blocks.cpp) is one
  // record, completed as a whole (a cumulative ACK inside it moves seq on);
  // it holds a send-queue slot per request.
  std::uint32_t count = 1;
  std::span<std::byte> read_dst{};
  const iovec* read_iov = nullptr;  // a block list's READ_LIST: the destinations, `count` of them
  std::coroutine_handle<> waiter{};
  bool done = false;
  bool cancelled = false;
  bool owns_slot = false;  // a batch's: its send-queue slot is returned when it completes
  bool holds_responder = false;  // READ/atomic: one of the peer's responder units, returned on completion
  std::error_code ec{};
  std::uint64_t value = 0;
};

inline bool is_ack_type(opcode op) noexcept {
  return op == opcode::send || op == opcode::write || op == opcode::write_imm;
}
// Requests that take one of the responder's units (its response is queued).
inline bool needs_responder(opcode op) noexcept {
  return op == opcode::read_req || op == opcode::cas || op == opcode::faa;
}

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
  // List frames: the descriptor table (WRITE_LIST, READ_LIST) and the
  // payloads (WRITE_LIST, READ_LIST_RESP), in place of payload/len.
  std::vector<std::byte> table;
  std::vector<iovec> parts;
  std::shared_ptr<tcp_region> hold;  // READ_RESP: the region stays registered while we send from it
  grant_use use;                     // READ_RESP through a grant: its revoke waits until this is sent
  std::uint32_t response = 0;        // READ/atomic responses in it: they count against our responder units
  // A block list's frame (blocks.cpp): its table and payloads in the list's
  // own arrays, which outlive the frame (the list completes after it went).
  std::span<const std::byte> xtable;
  std::span<const iovec> xparts;
  std::size_t iov_count() const noexcept {
    const std::size_t n = !parts.empty() ? parts.size() : !xparts.empty() ? xparts.size() : len != 0;
    return 1 + (!table.empty() || !xtable.empty()) + n;
  }
};

// Bytes of receive buffers held by every connection (stats.hpp).
inline std::atomic<std::size_t> receive_buffer_bytes{0};
// List frames (WRITE_LIST, READ_LIST) sent and received by every
// connection, and whether new connections announce that they read them
// (stats.hpp).
inline std::atomic<std::uint64_t> list_frames_sent{0}, list_frames_received{0};
inline std::atomic<bool> announce_write_list{true};

// Connections established through one listener and not finished yet
// (listener_options::max_connections); shared, as connections outlive it.
struct live_count {
  std::uint32_t n = 0;
};

// The detached tasks of one owner (a connection's loops and idle watch, a
// listener's handshakes). Once the owner is stopping, they hold its
// io_context (io_context::hold) until the last ends, so that the context's
// destructor lets them finish: nothing of a dropped connection or listener
// outlives the loop, and nobody has to wait for them. A live owner's tasks
// do not hold it.
struct task_group {
  io_context* ctx = nullptr;
  std::size_t running = 0;
  bool holding = false;
  void stopping() noexcept {
    if (running > 0 && !holding) {
      holding = true;
      ctx->hold();
    }
  }
  void ended() noexcept {
    if (--running == 0 && holding) {
      holding = false;
      ctx->release();
    }
  }
};

// Runs `t` on the calling loop, owned by nobody, as one of `g`'s tasks;
// `token` stops it. `t` must keep `g`'s owner alive.
void spawn_in(task_group& g, task<void> t, std::stop_token token);

struct inbound {
  std::uint32_t slot = 0;
  std::uint32_t len = 0;
  std::optional<std::uint32_t> imm;
};

struct conn_state : std::enable_shared_from_this<conn_state> {
  // The connection's life. It moves only forward, through the transitions
  // below: open -> refusing (refuse_peer) or stopping (enter_error), then
  // -> finished (finish, once both loops have exited).
  enum class phase : std::uint8_t {
    open,      // both loops run; operations start
    refusing,  // we refused the peer's access: the writer sends our NAK, the reader discards what the peer
               // sends until it closes, both by refuse_deadline; then the loops end by themselves
    stopping,  // the socket is shut down and the loops are stopped
    finished,  // both loops exited; every pending operation completed
  };

  conn_state(tcp_socket s, std::shared_ptr<domain_state> d, const connection_options& o, const hello& peer_h,
             endpoint ep);
  ~conn_state();

  io_context* ctx;
  tcp_socket sock;
  std::shared_ptr<domain_state> dom;
  connection_options opts;
  hello peer;
  std::vector<std::byte> peer_payload;  // what the peer sent after its hello (connection::peer_payload)
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
  bool peer_reads_lists = false;          // the peer announced list frames (an ACK of seq 0: wire.hpp)
  std::uint32_t responses_queued = 0;     // READ/atomic responses in outq (bounded: hello's max_responder_ops)
  event responder_room{true};             // set while responses_queued is below it
  // The frame being read: its receive slot, or the operation its payload completes.
  std::uint32_t cur_slot = 0;
  op_rec* cur_op = nullptr;
  grant_use cur_use;  // a WRITE through a grant whose payload is being read in: revoke waits for it

  // Writer.
  std::deque<out_frame> outq;
  std::coroutine_handle<> writer_waiter{};
  bool pipe_backlog = false;  // the writer waits for room for the rest of what it took from outq
  clock::time_point refuse_deadline{};  // phase::refusing: when the loops give up on the NAK and the peer

  // State (change it through the transitions only).
  phase state() const noexcept { return state_; }
  std::error_code error{};  // the first error: what pending/later operations fail with; set once not open
  int loops = 2;            // running: the reader and the writer (and a pipe's bell loop)
  event finished_ev;        // set on entering phase::finished
  std::stop_source stop;
  task_group tasks;                    // the reader, the writer, the idle watch
  std::shared_ptr<live_count> origin;  // the listener's count, for a connection it accepted
  std::uint64_t frames_in = 0;         // frames the reader has taken (the idle watch of a Unix socket)
  // A provider built on this engine (lib/local_provider): its own state of
  // the connection, from its handshake to its connection object.
  std::shared_ptr<void> ext;
  // Where the frames go in place of the socket, if set before start()
  // (pipe.hpp); the socket then carries doorbells and the hang-up only.
  std::unique_ptr<byte_pipe> pipe;

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
    if (r->owns_slot) slots.release(r->count);
    if (r->holds_responder) responder_units.release();
    r->done = true;
    r->ec = ec;
    r->value = v;
    if (r->waiter) ctx->post(r->waiter);
  }

  // Transition: the connection fails with `ec` (the first error is kept).
  // From open, both loops are stopped (phase::stopping); `finish` runs once
  // both have exited. While refusing, the loops end by themselves (the
  // writer once the NAK is out, the reader once the peer closed, both by
  // refuse_deadline): whoever drops the connection meanwhile (its
  // application, on its peer_access_refused) must not cut the NAK off.
  void enter_error(std::error_code ec) {
    set_error(ec);
    if (state_ != phase::open) return;
    state_ = phase::stopping;
    tasks.stopping();
    abort_io();
  }

  // Transition: we refused the peer's access; its NAK is queued. From open,
  // the NAK goes out and the peer's bytes are discarded until it closes,
  // by the linger time (phase::refusing). Once stopping, the socket is shut
  // down already: only the error is kept.
  void refuse_peer() {
    set_error(err(errc::peer_access_refused));
    refuse_deadline = clock::now() + linger;
    if (state_ == phase::open) {
      state_ = phase::refusing;
      tasks.stopping();
    }
  }

  // Shuts the socket down and stops both loops (the parked writer wakes to see it).
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

  // Transition, once neither loop runs: completes every pending operation
  // (phase::finished).
  void finish();

  // An operation in flight was cancelled: the connection goes to the error state.
  void cancel_op(std::uint64_t seq);

  // Completes ACK-type operations up to `seq`; false on a protocol violation.
  bool ack_upto(std::uint64_t seq) {
    if (seq >= next_seq) return false;
    while (!pending.empty() && pending.front()->seq <= seq) {
      op_rec* r = pending.front();
      if (!is_ack_type(r->op)) return false;
      if (seq - r->seq + 1 < r->count) {  // a list frame's first requests (before a NAK inside it)
        const auto k = static_cast<std::uint32_t>(seq - r->seq + 1);
        r->seq += k;
        r->count -= k;
        if (r->owns_slot) slots.release(k);
        break;
      }
      pending.pop_front();
      complete(r, {}, 0);
    }
    if (pending.empty()) idle.set();
    return true;
  }

  // The peer returned `n` receive buffers; false past what we consumed.
  bool take_credits(std::uint64_t n) {
    if (n > credits_out) return false;
    credits_out -= static_cast<std::uint32_t>(n);
    credits.release(n);
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

  // message's release function: the slot is free again, its credit goes back.
  static void release_message(void* owner, std::uint64_t slot) noexcept;

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

  // Reader (reader.cpp).
  enum class action { next, payload, wait_room, drain, protocol, io };
  action begin_frame(const header& h, std::span<std::byte>& dst);
  void finish_payload(const header& h);
  result<std::size_t> recv_now(std::span<std::byte> buf);
  // The reader's read-ahead: a busy connection (past read_ahead_after
  // frames) reads what follows the bytes it needs in the same syscall, so
  // that a run of small frames (a block list) costs a recv per
  // read_ahead_size bytes, not two per frame. Payloads still land straight
  // in their destination; only what overshoots is copied once.
  static constexpr std::size_t read_ahead_size = 32768;
  static constexpr unsigned read_ahead_after = 16;
  std::unique_ptr<std::byte[]> ahead;
  std::size_t ahead_begin = 0, ahead_end = 0;
  unsigned frames_read = 0;
  result<std::size_t> take_now(std::span<std::byte> buf);
  // List frames (lists.cpp): the table and the iovecs of the frame being
  // read, allocated on the first one (bounded: max_list_entries).
  std::unique_ptr<std::byte[]> list_table;
  std::unique_ptr<list_entry[]> list_entries;
  std::unique_ptr<iovec[]> list_iov;  // one more than the entries: the read-ahead's
  void list_buffers();
  task<action> take_list(header h);       // WRITE_LIST, READ_LIST (target side)
  task<action> take_list_resp(header h);  // READ_LIST_RESP (initiator side)
  task<bool> scatter_in(std::span<iovec> v);
  // take_now for a scatter list: fills `v` (consumed from its front, in
  // place), from the read-ahead, then with recvmsg; v.data()[v.size()] must
  // be free for the read-ahead's iovec. True once `v` is full.
  result<bool> take_now_v(std::span<iovec>& v);
  static task<void> reader_loop(std::shared_ptr<conn_state> s);
  // Over a pipe (pipe.cpp): the waits the socket's awaits are otherwise,
  // and the loop that reads the socket's doorbells and its end.
  task<result<void>> pipe_wait(bool reading);
  task<result<void>> pipe_read_exact(std::span<std::byte> buf);
  task<result<void>> pipe_write_all(std::span<iovec> v);
  static task<void> bell_loop(std::shared_ptr<conn_state> s);
  std::error_code pipe_error(std::error_code ec) const noexcept { return pipe && pipe->fault ? pipe->fault : ec; }
  // A SEND of `msg` written into the pipe now, from the application's call,
  // when nothing of ours is ahead of it (queued, being written, waiting for
  // a slot, a credit or a responder unit) and its slot, its credit and the
  // room are there: what the writer would have written (the ACK and the
  // credits carried as it carries them), without its turn. `rec` is then
  // pending (completed by the ACK, as the engine's). False: nothing done.
  bool try_pipe_send(op_rec& rec, std::span<const std::byte> msg);

  // Writer (writer.cpp).
  static task<void> writer_loop(std::shared_ptr<conn_state> s);

  // Starts the reader and the writer.
  void start();

  // Operations (operations.cpp, batch.cpp).
  static task<result<std::uint64_t>> submit(std::shared_ptr<conn_state> s, header h,
                                            std::span<const std::byte> payload, std::span<std::byte> read_dst);
  static task<result<void>> submit_void(std::shared_ptr<conn_state> s, header h,
                                        std::span<const std::byte> payload);
  // `failed`, where given: on an error, the index of the failing operation.
  static task<result<void>> submit_batch(std::shared_ptr<conn_state> s, std::vector<header> hs,
                                         std::span<const operation> ops, std::size_t* failed = nullptr);
  // A block list as list frames, a record per frame (blocks.cpp); the
  // peer must read list frames.
  static task<block_result> submit_blocks(std::shared_ptr<conn_state> s, block_list l);
  static task<result<message>> recv(std::shared_ptr<conn_state> s);
  // What recv makes of what the inbox gave it (operations.cpp).
  result<message> take_message(result<inbound> r);
  static task<result<void>> close(std::shared_ptr<conn_state> s);

 private:
  // Keeps the first error and wakes whatever waits for a slot, a credit,
  // a responder unit, a message or the pending operations.
  void set_error(std::error_code ec) {
    if (!error) error = ec;
    // Operations waiting for a slot, a credit or a responder unit fail.
    slots.close(later_error());
    credits.close(later_error());
    responder_units.close(later_error());
    inbox.close();
    idle.set();
  }

  phase state_ = phase::open;
};

// Descriptors in one list frame at most: a quarter of what may be in
// flight (send-queue slots), so that several frames in flight keep the
// stream busy while the first ones complete (the target acknowledges or
// answers a frame once it is whole). READs are not bounded by the peer's
// responder units here: a READ_LIST takes one unit, as one READ does (its
// answer is one frame: wire.hpp).
inline std::size_t list_cap(const conn_state& s) noexcept {
  return std::clamp<std::size_t>(s.opts.send_queue_depth / 4, 8, max_list_entries);
}

// Drops `n` bytes (at most what `v` holds) from the front of `v`, in place.
inline void consume_iov(std::span<iovec>& v, std::size_t n) noexcept {
  while (n > 0) {
    const std::size_t k = std::min(n, v.front().iov_len);
    v.front().iov_base = static_cast<std::byte*>(v.front().iov_base) + k;
    v.front().iov_len -= k;
    n -= k;
    if (v.front().iov_len == 0) v = v.subspan(1);
  }
  while (!v.empty() && v.front().iov_len == 0) v = v.subspan(1);
}

// Waits for one operation's completion.
struct wait_rec {
  op_rec& r;
  bool await_ready() const noexcept { return r.done; }
  void await_suspend(std::coroutine_handle<> h) noexcept { r.waiter = h; }
  void await_resume() const noexcept {}
};

// A stop request for the operation `seq`, from any thread: cancelled on the
// connection's loop.
struct canceller {
  conn_state* s;
  std::uint64_t seq;
  void operator()() const noexcept {
    cancel_on_loop(*s->ctx, [sp = s->shared_from_this(), q = seq] { sp->cancel_op(q); });
  }
};

// conn_state::pipe_wait as an awaiter, without a task of its own: the
// reader's wait for the next frame, once per message when the connection
// is not busy. The wait ends (the pipe is no longer polled for it) when
// the awaiter goes, after the resumption or with a frame destroyed suspended.
class pipe_awaiter {
 public:
  pipe_awaiter(byte_pipe& p, io_context& ctx, bool reading) noexcept
      : p_(p), ctx_(ctx), reading_(reading), ev_((reading ? p.readable : p.writable).wait()) {}
  pipe_awaiter(const pipe_awaiter&) = delete;
  pipe_awaiter& operator=(const pipe_awaiter&) = delete;
  ~pipe_awaiter() {
    if (began_) p_.wait_end(reading_);
  }
  bool await_ready() {
    // Hung up: the reader's read_now says eof once the ring is empty; a
    // writer that waits for room would wait for ever (nobody rings).
    if (p_.gone) return true;
    (reading_ ? p_.readable : p_.writable).reset();
    p_.wait_begin(ctx_, reading_);
    began_ = true;
    return false;
  }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return ev_.await_suspend(h);
  }
  result<void> await_resume() const noexcept {
    if (!began_) return reading_ ? result<void>{} : result<void>(err(errc::disconnected));
    return ev_.await_resume();
  }

 private:
  byte_pipe& p_;
  io_context& ctx_;
  bool reading_, began_ = false;
  event::awaiter ev_;
};

// An op_slot state (detail/connection_op.hpp): a SEND over a pipe,
// try_pipe_send's, its op_rec in the awaiting coroutine's frame (no task);
// where it cannot be (something ahead of it, no credit or room), the
// engine's submit, as tcp_connection::send. Either way, the operation's
// checks, order, completion (the peer's ACK), cancellation and errors are
// the engine's.
struct pipe_send {
  std::shared_ptr<conn_state> s;
  std::span<const std::byte> msg;
  op_rec rec;
  std::optional<std::stop_callback<canceller>> cb;
  std::optional<task<result<void>>> engine;
  std::error_code early;
  pipe_send(std::shared_ptr<conn_state> st, std::span<const std::byte> m) noexcept : s(std::move(st)), msg(m) {}
  bool start() noexcept { return false; }  // the stop token comes with suspend()
  std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token token);
  result<void> take();
};

// An op_slot state: conn_state::recv without a task of its own (the
// awaiting coroutine parks on the inbox itself), with its outcomes.
struct inbox_recv {
  std::shared_ptr<conn_state> s;
  channel<inbound>::receive_awaiter rx;
  explicit inbox_recv(std::shared_ptr<conn_state> st) noexcept : s(std::move(st)), rx(s->inbox.receive()) {}
  bool start() { return rx.await_ready(); }
  std::coroutine_handle<> suspend(std::coroutine_handle<> h, std::stop_token token) {
    return rx.suspend_with(h, std::move(token)) ? std::noop_coroutine() : h;
  }
  result<message> take() { return s->take_message(rx.await_resume()); }
};

}  // namespace shuttle::detail::tcp_provider
