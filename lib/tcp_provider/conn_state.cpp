// A connection's life outside the hot path: set-up, the loops' start, the
// error state's end (finish), cancellation, and a message's release.
#include "conn_state.hpp"
#include "stats.hpp"

namespace shuttle::detail {

std::size_t tcp_receive_buffer_bytes() noexcept {
  return tcp_provider::receive_buffer_bytes.load(std::memory_order_relaxed);
}

tcp_list_counts tcp_list_frames() noexcept {
  return {tcp_provider::list_frames_sent.load(std::memory_order_relaxed),
          tcp_provider::list_frames_received.load(std::memory_order_relaxed)};
}

void tcp_announce_write_list(bool on) noexcept {
  tcp_provider::announce_write_list.store(on, std::memory_order_relaxed);
}

}  // namespace shuttle::detail

namespace shuttle::detail::tcp_provider {

conn_state::conn_state(tcp_socket s, std::shared_ptr<domain_state> d, const connection_options& o,
                       const hello& peer_h, endpoint ep)
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
  tasks.ctx = ctx;
  lim.max_send = o.receive_buffer_size;
  free_slots.reserve(o.receive_buffers);
  for (std::uint32_t i = o.receive_buffers; i > 0; --i) free_slots.push_back(i - 1);
}

conn_state::~conn_state() {
  std::size_t held = 0;
  for (auto& b : slot_buffers) held += b ? opts.receive_buffer_size : 0;
  receive_buffer_bytes.fetch_sub(held, std::memory_order_relaxed);
}

void conn_state::finish() {
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
  state_ = phase::finished;
  finished_ev.set();
}

void conn_state::cancel_op(std::uint64_t seq) {
  for (op_rec* r : pending) {
    if (seq >= r->seq && seq - r->seq < r->count && !r->done) {
      r->cancelled = true;
      enter_error(err(errc::disconnected));
      return;
    }
  }
}

void conn_state::release_message(void* owner, std::uint64_t slot) noexcept {
  auto* s = static_cast<conn_state*>(owner);
  s->free_slots.push_back(static_cast<std::uint32_t>(slot));
  if (s->state() == phase::open) {
    ++s->credits_to_return;
    s->wake_writer();
  }
  if (--s->messages_out == 0) {
    auto last = std::move(s->keepalive);  // may free *s on return
  }
}

task<result<void>> conn_state::close(std::shared_ptr<conn_state> s) {
  while (s->state() == phase::open && !s->pending.empty()) {
    auto r = co_await s->idle.wait();
    if (!r) co_return r.error();
  }
  // What we owe the peer goes out first (the ACK of the message we just
  // consumed, returned credits): the writer is parked with nothing left to
  // send, so its last writev completed. A peer that does not read gets
  // the linger time.
  const auto deadline = clock::now() + linger;
  while (s->state() == phase::open && clock::now() < deadline &&
         (!s->writer_waiter || !s->outq.empty() || s->ack_seq != s->ack_sent || s->credits_to_return != 0)) {
    if ((co_await get_stop_token()).stop_requested()) break;  // a cancelled close aborts
    s->wake_writer();
    co_await yield();
  }
  s->enter_error(err(errc::disconnected));
  if (s->state() != phase::finished) {
    auto r = co_await s->finished_ev.wait();
    if (!r) co_return r.error();
  }
  co_return result<void>{};
}

namespace {
driver run_in(task_group& g, task<void> t) {
  try {
    co_await std::move(t);
  } catch (...) {
  }
  g.ended();  // `t` (and so g's owner) goes with this frame, right after
}
}  // namespace

void spawn_in(task_group& g, task<void> t, std::stop_token token) {
  ++g.running;
  driver d = run_in(g, std::move(t));
  d.set_stop_token(std::move(token));
  d.on_done(nullptr, nullptr, true);
  d.release().resume();
}

void conn_state::start() {
  if (announce_write_list.load(std::memory_order_relaxed)) {
    // We read WRITE_LIST: an ACK of seq 0 says so (wire.hpp), before anything else.
    header a;
    a.op = opcode::ack;
    out_frame f;
    encode_header(a, f.hdr);
    outq.push_back(std::move(f));
  }
  if (pipe) ++loops;  // the socket's doorbells: a third loop, which finish() waits for too
  spawn_in(tasks, reader_loop(shared_from_this()), stop.get_token());
  spawn_in(tasks, writer_loop(shared_from_this()), stop.get_token());
  if (pipe) spawn_in(tasks, bell_loop(shared_from_this()), stop.get_token());
}

}  // namespace shuttle::detail::tcp_provider
