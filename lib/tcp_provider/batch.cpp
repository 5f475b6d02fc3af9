// Batches (connection::post_batch) and prepared operations: the request
// headers are built once, up front.
#include "connection.hpp"
#include "counted_acquire.hpp"

#include <algorithm>

namespace shuttle::detail::tcp_provider {

namespace {

task<result<void>> finish_now(std::error_code ec) {
  if (ec) co_return ec;
  co_return result<void>{};
}

// An operation's data up to this size joins a list frame; a larger one goes
// in a frame of its own (its header is nothing next to its payload).
constexpr std::size_t list_block_max = std::size_t(1) << 20;

// Whether operation `o` (header `h`) may be in a list frame at all.
bool list_eligible(const header& h, const operation& o) {
  return (h.op == opcode::write || h.op == opcode::read_req) && !o.local.empty() && o.local.size() <= list_block_max;
}

// How many operations from `i` on (before `end`) one list frame carries:
// WRITEs (WRITE_LIST) or READs (READ_LIST) of 1 byte to list_block_max,
// all to the first one's rkey, at most list_cap. submit_batch's count of
// responder units follows the same runs (a unit for each run of READs).
std::size_t list_run(const conn_state& s, std::span<const header> hs, std::span<const operation> ops, std::size_t i,
                     std::size_t end) {
  const opcode op = hs[i].op;
  if (op != opcode::write && op != opcode::read_req) return 1;
  const std::size_t cap = list_cap(s);
  std::size_t j = i;
  std::uint64_t bytes = 0;
  while (j < end && j - i < cap && hs[j].op == op && hs[j].rkey == hs[i].rkey) {
    if (!list_eligible(hs[j], ops[j]) || bytes + ops[j].local.size() > max_rdma_length) break;
    bytes += ops[j].local.size();
    ++j;
  }
  return j - i;
}

// Queues one list frame for the operations `hs` (their seqs consecutive,
// taken): a WRITE_LIST with their data, or a READ_LIST.
void queue_list(conn_state& s, std::span<const header> hs, std::span<const operation> ops) {
  const bool write = hs.front().op == opcode::write;
  header l;
  l.op = write ? opcode::write_list : opcode::read_list;
  l.seq = hs.front().seq;
  l.rkey = hs.front().rkey;
  l.arg0 = hs.size();
  out_frame f;
  f.table.resize(hs.size() * list_entry_size);
  if (write) f.parts.reserve(hs.size());
  std::uint64_t bytes = 0;
  for (std::size_t k = 0; k < hs.size(); ++k) {
    encode_list_entry({hs[k].addr, hs[k].length}, std::span(f.table).subspan(k * list_entry_size).first<list_entry_size>());
    bytes += hs[k].length;
    if (write) f.parts.push_back({const_cast<std::byte*>(ops[k].local.data()), ops[k].local.size()});
  }
  l.length = static_cast<std::uint32_t>(bytes);
  encode_header(l, f.hdr);
  s.outq.push_back(std::move(f));
  list_frames_sent.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

// A batch (connection::post_batch): the frames of a chunk are queued
// together, so the writer sends them in one writev; the peer's cumulative
// ACK completes them.
task<result<void>> conn_state::submit_batch(std::shared_ptr<conn_state> s, std::vector<header> hs,
                                            std::span<const operation> ops, std::size_t* failed) {
  std::stop_token token = co_await get_stop_token();
  if (failed) *failed = 0;
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
    // The READ list frame being formed (as list_run will cut it): a READ
    // that joins it takes no responder unit of its own.
    std::size_t run_len = 0;
    std::uint64_t run_bytes = 0;
    while (end < ops.size() && end - queued < max_ops) {
      const bool c = hs[end].op == opcode::send || hs[end].op == opcode::write_imm;
      bool rd = needs_responder(hs[end].op);
      if (hs[end].op == opcode::read_req && s->peer_reads_lists && list_eligible(hs[end], ops[end])) {
        const std::size_t len = ops[end].local.size();
        if (run_len > 0 && run_len < list_cap(*s) && hs[end - 1].op == opcode::read_req &&
            hs[end - 1].rkey == hs[end].rkey && run_bytes + len <= max_rdma_length) {
          rd = false;
          ++run_len;
          run_bytes += len;
        } else {
          run_len = 1;
          run_bytes = len;
        }
      } else {
        run_len = 0;
      }
      if (!s->slots.try_acquire()) {
        if (end > queued) break;
        auto r = co_await counted_acquire(s->slots, s->slot_waiters);
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
        auto r = co_await counted_acquire(s->credits, s->credit_waiters);
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
        auto r = co_await counted_acquire(s->responder_units, s->responder_waiters);
        if (!r) {
          s->slots.release();
          early = r.error();
          break;
        }
      }
      credits_taken += c;
      responders_taken += rd;
      recs[end].holds_responder = rd;
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
      if (h.op == opcode::read_req)
        rec.read_dst = std::span(const_cast<std::byte*>(ops[i].local.data()), ops[i].local.size());
      s->pending.push_back(&rec);
    }
    for (std::size_t i = queued; i < end;) {
      const std::size_t run = s->peer_reads_lists ? list_run(*s, hs, ops, i, end) : 1;
      if (run >= 2) {
        queue_list(*s, std::span(hs).subspan(i, run), ops.subspan(i, run));
        i += run;
        continue;
      }
      out_frame f;
      encode_header(hs[i], f.hdr);
      if (hs[i].op != opcode::read_req) {
        f.payload = ops[i].local.data();
        f.len = ops[i].local.size();
      }
      s->outq.push_back(std::move(f));
      ++i;
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
  for (std::size_t i = 0; i < queued; ++i) {
    if (!recs[i].ec) continue;
    if (failed) *failed = i;
    co_return token.stop_requested() ? std::make_error_code(std::errc::operation_canceled) : recs[i].ec;
  }
  if (failed) *failed = queued;
  if (early) {
    if (queued > 0) s->enter_error(err(errc::disconnected));  // part of the batch is done: RC has no partial undo
    co_return early;
  }
  co_return result<void>{};
}

// A prepared operation: the request header built once; each start is
// the single operation's task (next to a socket round trip, a frame per
// start costs nothing measurable).
struct tcp_connection::prepared_state final : prepared_impl {
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

// One operation's request header, as post_batch and prepare build it.
result<header> tcp_connection::header_of(const operation& o) const {
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

task<result<void>> tcp_connection::post_batch(std::span<const operation> ops) {
  std::size_t* no_index = nullptr;
  return post_batch_to(ops, no_index);
}

task<result<void>> tcp_connection::post_batch_at(std::span<const operation> ops, std::size_t& failed) {
  std::size_t* index = &failed;
  return post_batch_to(ops, index);
}

task<result<void>> tcp_connection::post_batch_to(std::span<const operation> ops, std::size_t* failed) {
  std::vector<header> hs;
  hs.reserve(ops.size());
  for (const operation& o : ops) {
    auto h = header_of(o);
    if (!h) {
      if (failed) *failed = hs.size();
      return finish_now(h.error());
    }
    hs.push_back(*h);
  }
  if (hs.empty()) return finish_now({});
  return conn_state::submit_batch(s_, std::move(hs), ops, failed);
}

result<std::unique_ptr<prepared_impl>> tcp_connection::prepare(const operation& o) {
  auto h = header_of(o);
  if (!h) return h.error();
  auto p = std::make_unique<prepared_state>();
  p->s = s_;
  p->h = *h;
  p->local = o.local;
  return std::unique_ptr<prepared_impl>(std::move(p));
}

}  // namespace shuttle::detail::tcp_provider
