// GPU memory on the local provider and the ordered lane (conn_state.hpp).
//
// A write or read that involves GPU memory on either side (device_hooks.hpp)
// is a copy on the connection's stream (cudaMemcpyAsync through the hooks),
// awaited on the loop; so is an access to an rkey whose answer has not come
// yet, which waits for it (the socket cannot reach a GPU region). Such an
// operation cannot finish at once, so RC order is kept by the lane: from
// the first of them on, every later operation of the connection (sends,
// writes, reads, atomics, batches; not recv) queues behind it and starts in
// its turn. In its turn:
//  - a GPU copy waits until nothing of ours is in the engine (it must not
//    overtake a frame still queued there), is enqueued and leaves the lane:
//    the next copies are ordered behind it by the stream, so they pipeline;
//  - anything else waits until the copies before it are complete (what it
//    tells the peer, or reads back, must come after them), starts, and
//    leaves the lane.
// A GPU copy is not cancelled by a stop request (the copy goes on using the
// buffers); it ends when the copy does. After it, a peer found dead (the
// socket's hang-up) fails the operation: what it wrote may not have been
// seen. An operation still waiting for its turn is cancelled as usual.
#include "connection.hpp"
#include "stats.hpp"

#include <shuttle/timer.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace shuttle::detail {
namespace {
thread_local std::uint64_t gpu_copies = 0;
}
std::uint64_t local_gpu_copies() noexcept { return gpu_copies; }
}  // namespace shuttle::detail

namespace shuttle::detail::local_provider {

namespace {

std::atomic<const device_hooks*> hooks{nullptr};

template <class T>
struct slot_await {
  op_slot<T>& slot;
  bool await_ready() { return slot.start(); }
  template <class P>
  std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) {
    return slot.suspend(h, stop_token_of(h));
  }
  result<T> await_resume() { return slot.take(); }
};

bool engine_quiet(const tp::conn_state& s) noexcept {
  return s.pending.empty() && !s.slot_waiters && !s.credit_waiters && !s.responder_waiters;
}

// A wait in the lane that was cancelled: the operation never started, but
// those behind it were ordered after it, so the connection fails as when
// an operation in flight is cancelled (tcp provider: cancel_op).
std::error_code cancelled_in_lane(tp::conn_state& s, std::error_code ec) {
  s.enter_error(make_error_code(errc::disconnected));
  return ec;
}

// Until `place` is first in the lane and no copy runs.
task<result<void>> turn(tp::conn_state& s, conn_ext& x, lane_place& place) {
  while (x.lane.front() != place.ticket || x.gpu_inflight != 0) {
    if (auto w = co_await x.changed.wait(); !w) co_return cancelled_in_lane(s, w.error());
  }
  co_return result<void>{};
}

}  // namespace

const device_hooks* set_device_hooks(const device_hooks* h) noexcept { return hooks.exchange(h); }
const device_hooks* installed_device_hooks() noexcept { return hooks.load(std::memory_order_acquire); }

task<result<void>> local_connection::in_lane_void(lane_op op) {
  auto r = co_await in_lane(op);
  if (!r) co_return r.error();
  co_return result<void>{};
}

task<result<std::uint64_t>> local_connection::in_lane(lane_op op) {
  auto keep = s_;  // the state, and its copy queue, while we wait
  lane_place place{x_, x_.next_ticket++};
  x_.lane.push_back(place.ticket);
  co_return co_await at_turn(op, place, false);
}

// `op` once `place` is first in the lane and what it waits for is done; the
// place is given up once the operation has started, unless `hold` (a
// batch's operations, one after the other).
task<result<std::uint64_t>> local_connection::at_turn(lane_op op, lane_place& place, bool hold) {
  tp::conn_state& s = *s_;
  conn_ext& x = x_;
  using kind = lane_op::kind;
  const bool rw = op.k == kind::write || op.k == kind::read || op.k == kind::write_imm;
  for (;;) {
    if (x.dropped) co_return make_error_code(errc::disconnected);  // `this` is gone
    if (x.lane.front() == place.ticket) {
      route rt;
      if (rw) rt = plan(op.remote, op.local, op.len, op.k == kind::read ? access::remote_read : access::remote_write);
      if (op.k == kind::write_imm && rt.how == route::how::host) rt = route{};  // its message: the socket's
      if (rt.how == route::how::ask) {
        x.ask(op.remote.rkey);
        if (!x.asked.contains(op.remote.rkey) && x.queries == 0) {
          // Not asked (too many regions remembered, or the channel full), and
          // no answer coming: as if refused.
          rt = is_device_memory(installed_device_hooks(), *x.dom, op.local, op.len)
                   ? route{route::how::fail, nullptr, make_error_code(errc::unregistered_device_memory)}
                   : route{};
        }
      }
      if (rt.how == route::how::fail) co_return rt.ec;
      if (rt.how == route::how::gpu) {
        const peer_region& pr = x.regions.at(op.remote.rkey);
        // write_with_imm's data by a copy, its notification through the
        // socket: not into GPU memory, which the peer's engine cannot name.
        if (op.k == kind::write_imm && pr.gpu) co_return make_error_code(errc::not_supported);
        if (engine_quiet(s)) {
          auto mapped = pr.map;  // the peer's memory stays mapped until the copy ends
          lane_op data = op;
          if (op.k == kind::write_imm) data.k = kind::write;
          auto t = gpu_copy(data, rt.at, std::move(mapped));  // enqueued at its first resumption, below
          // (Posted wake-ups: the next operation runs after the copy is enqueued.)
          if (!hold && op.k != kind::write_imm) place.leave();
          auto r = co_await std::move(t);
          if (!r) co_return r.error();
          if (op.k != kind::write_imm) co_return std::uint64_t{0};
          // The data is in: now the notification, empty, through the socket, in our turn still.
          op.local = nullptr;
          op.len = 0;
          op.remote.length = 0;
          continue;
        }
        // Frames of ours in the engine: wait until it has none.
        if (!s.idle.is_set()) {
          if (auto w = co_await s.idle.wait(); !w) co_return cancelled_in_lane(s, w.error());
        } else if (auto w = co_await sleep_for(std::chrono::microseconds(20)); !w) {
          co_return cancelled_in_lane(s, w.error());
        }
        continue;
      }
      if (rt.how != route::how::ask && x.gpu_inflight == 0) {
        if (rt.how == route::how::host) {
          if (op.k == kind::write)
            std::memcpy(rt.at, op.local, op.len);
          else
            std::memcpy(op.local, rt.at, op.len);
          co_return std::uint64_t{0};
        }
        // Through the engine (or, for atomics, on our mapping).
        if (op.k == kind::cas || op.k == kind::faa) {
          op_slot<std::uint64_t> slot;
          if (op.k == kind::cas)
            cas_now(slot, op.remote, op.a, op.b);
          else
            faa_now(slot, op.remote, op.a);
          if (!hold) place.leave();
          co_return co_await slot_await<std::uint64_t>{slot};
        }
        op_slot<void> slot;
        switch (op.k) {
          case kind::send: inner_.send(slot, {op.local, op.len}); break;
          case kind::write_imm: inner_.write_with_imm(slot, {op.local, op.len}, op.remote, op.imm); break;
          case kind::write: inner_.write(slot, {op.local, op.len}, op.remote); break;
          default: inner_.read(slot, {op.local, op.len}, op.remote); break;
        }
        if (!hold) place.leave();
        auto r = co_await slot_await<void>{slot};
        if (!r) co_return r.error();
        co_return std::uint64_t{0};
      }
    }
    // Not our turn, copies still running, or the answer not in yet.
    if (auto w = co_await x.changed.wait(); !w) co_return cancelled_in_lane(s, w.error());
  }
}

task<result<void>> local_connection::gpu_copy(lane_op op, std::byte* at, std::shared_ptr<void> hold) {
  auto keep = s_;
  conn_ext& x = x_;
  const device_hooks* h = installed_device_hooks();
  if (!x.copies.q) {
    x.copies.hooks = h;
    x.copies.q = h->open_queue();
    if (!x.copies.q) co_return make_error_code(errc::not_supported);
  }
  auto copy = op.k == lane_op::kind::write ? h->copy(x.copies.q, at, op.local, op.len)
                                           : h->copy(x.copies.q, op.local, at, op.len);
  ++x.gpu_inflight;
  ++gpu_copies;
  auto r = co_await std::move(copy);
  hold.reset();
  --x.gpu_inflight;
  x.pulse();
  if (!r) co_return r.error();
  if (x.dropped) co_return make_error_code(errc::disconnected);  // `this` is gone
  // A peer that died meanwhile: its socket says so (the engine's reader
  // fails the connection on the hang-up; a loop of copies that never lets
  // it run looks at the socket every few accesses).
  if (keep->state() != tp::conn_state::phase::open) co_return keep->later_error();
  if (peer_hung_up()) co_return make_error_code(errc::disconnected);
  co_return result<void>{};
}

// A batch goes to the engine as one, unless GPU memory is in it (a local
// buffer, or a peer's region known to be GPU memory): then its operations
// run one after the other in the lane, each as a single one would (copies,
// the socket for the rest), none overtaken by what was posted after the
// batch. Keys not answered yet are asked first (they may name GPU memory).
task<result<void>> local_connection::batch(std::span<const operation> ops, std::size_t* failed) {
  auto keep = s_;
  conn_ext& x = x_;  // not `this` after a suspension: the connection may be dropped meanwhile
  const auto dropped = [&x] { return x.dropped; };
  const device_hooks* h = installed_device_hooks();
  const auto rkey_of = [](const operation& o) { return o.op == operation::type::send ? 0u : o.remote.rkey; };
  bool by_one = false, unknown = false;
  const auto survey = [&] {
    by_one = unknown = false;
    for (const operation& o : ops) {
      if (is_device_memory(h, *x.dom, o.local.data(), o.local.size())) by_one = true;
      if (o.op == operation::type::send) continue;
      auto it = x.regions.find(rkey_of(o));
      if (it != x.regions.end())
        by_one = by_one || it->second.gpu;
      else if (!x.service_over)
        unknown = true;
    }
  };
  if (h) survey();
  if (!by_one && !unknown && !x.ordered_busy()) {
    // Writes and reads on shared host regions are done here (a block list:
    // a memcpy per block, no frame); the engine takes the rest.
    const std::size_t done = direct_run(ops);
    if (done == ops.size()) {
      if (failed) *failed = done;
      co_return result<void>{};
    }
    // (Not a conditional expression around co_await: g++ 12 destroys its temporary twice.)
    if (failed) {
      auto t = inner_.post_batch_at(ops.subspan(done), *failed);
      auto r = co_await std::move(t);
      *failed += done;
      co_return r;
    }
    auto t = inner_.post_batch(ops.subspan(done));
    co_return co_await std::move(t);
  }
  lane_place place{x, x.next_ticket++};
  x.lane.push_back(place.ticket);
  if (h && unknown && !by_one) {
    while (x.lane.front() != place.ticket)
      if (auto w = co_await x.changed.wait(); !w) co_return cancelled_in_lane(*keep, w.error());
    for (const operation& o : ops)
      if (o.op != operation::type::send && !x.regions.contains(rkey_of(o))) x.ask(rkey_of(o));
    for (;;) {  // until every key asked about is answered (or no answer can come)
      bool waiting = false;
      for (const operation& o : ops) waiting = waiting || x.asked.contains(rkey_of(o));
      if (!waiting || x.service_over) break;
      if (auto w = co_await x.changed.wait(); !w) co_return cancelled_in_lane(*keep, w.error());
    }
    if (dropped()) co_return make_error_code(errc::disconnected);
    survey();
  }
  if (by_one) {
    using kind = lane_op::kind;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const operation& o = ops[i];
      lane_op op{o.op == operation::type::send         ? kind::send
                 : o.op == operation::type::write      ? kind::write
                 : o.op == operation::type::read       ? kind::read
                                                       : kind::write_imm,
                 const_cast<std::byte*>(o.local.data()), o.local.size(), o.remote, o.imm};
      if (op.k == kind::send && on_device(o.local)) {
        if (failed) *failed = i;
        co_return make_error_code(errc::unregistered_device_memory);
      }
      if (dropped()) {
        if (failed) *failed = i;
        co_return make_error_code(errc::disconnected);
      }
      auto r = co_await at_turn(op, place, true);
      if (!r) {
        if (failed) *failed = i;
        co_return r.error();
      }
    }
    co_return result<void>{};
  }
  if (auto t = co_await turn(*keep, x_, place); !t) co_return t.error();
  place.leave();
  if (failed) {
    auto t = inner_.post_batch_at(ops, *failed);
    co_return co_await std::move(t);
  }
  auto t = inner_.post_batch(ops);
  co_return co_await std::move(t);
}

}  // namespace shuttle::detail::local_provider

namespace shuttle::detail::local_provider {

task<result<void>> local_connection::close_in_order() {
  auto keep = s_;
  if (x_.ordered_busy()) {  // what was posted before close() finishes first
    lane_place place{x_, x_.next_ticket++};
    x_.lane.push_back(place.ticket);
    (void)co_await turn(*keep, x_, place);  // cancelled: the connection failed, close() finishes it
    if (ext_of(*keep).dropped) co_return make_error_code(errc::disconnected);  // `this` is gone
    place.leave();
  }
  auto t = inner_.close();
  co_return co_await std::move(t);
}

}  // namespace shuttle::detail::local_provider
