// Block lists (connection::write_blocks / read_blocks) through the engine,
// to a peer that reads list frames: WRITE_LIST / READ_LIST frames built
// straight from the blocks, one pass over the list (each block checked,
// merged with the one before where adjacent, its descriptor and iovec
// written into two arrays of the list's), then a frame at a time queued
// from those arrays with one record (op_rec) for all its requests: the
// slots, the pending entry, the completion and the wait are per frame, not
// per block. Checks, merging, results and stats are those of the generic
// path (lib/transport/blocks.cpp); the wire and the target are unchanged.
#include "connection.hpp"
#include "counted_acquire.hpp"

#include "../transport/little_endian.hpp"

#include <deque>

namespace shuttle::detail::tcp_provider {

namespace {

// The one pass over the list: each block checked (as the generic path's
// checks, with its errors and index), merged with the one before where
// adjacent, and its descriptor and iovec written; `ops`: how many
// operations. A plain function, not the coroutine: its counters stay in
// registers (in a coroutine's frame, every byte stored into the table
// could alias them).
block_result build_list(const block_list& l, std::byte* table, iovec* iov, std::size_t& ops) noexcept {
  const std::size_t n = l.blocks.size();
  const block* blocks = l.blocks.data();
  const std::uint64_t size = l.size, remote_length = l.remote.length, remote_address = l.remote.address;
  std::byte* const base = l.base;
  const auto entry = [table](std::size_t k) { return std::span<std::byte, list_entry_size>(table + k * list_entry_size, list_entry_size); };
  std::size_t m = 0;
  std::uint64_t local_end = UINT64_MAX, remote_end = UINT64_MAX;
  for (std::size_t i = 0; i < n; ++i) {
    const block b = blocks[i];
    if (auto e = block_error(b, size, remote_length)) return {e, i};
    if (m > 0 && extends(b, local_end, remote_end, iov[m - 1].iov_len)) {
      iov[m - 1].iov_len += b.length;  // <= max_merged_block_bytes
      set_list_entry_length(entry(m - 1), static_cast<std::uint32_t>(iov[m - 1].iov_len));
    } else {
      // As post_batch's check of one operation (a merged one never fails it).
      if (b.length > max_rdma_length) return {make_error_code(errc::message_too_long), i};
      encode_list_entry({remote_address + b.remote_offset, static_cast<std::uint32_t>(b.length)}, entry(m));
      iov[m++] = {base + b.local_offset, b.length};
    }
    local_end = b.local_offset + b.length;
    remote_end = b.remote_offset + b.length;
  }
  ops = m;
  return {};
}

// How many of the `k` operations at `v` one frame carries (its payload is
// at most max_rdma_length, its length field), at least one (an operation
// is at most that); `bytes`: theirs.
std::size_t frame_fit(const iovec* v, std::size_t k, std::uint64_t& bytes) noexcept {
  std::uint64_t sum = 0;
  std::size_t j = 0;
  for (; j < k && sum + v[j].iov_len <= max_rdma_length; ++j) sum += v[j].iov_len;
  bytes = sum;
  return j;
}

}  // namespace

task<block_result> conn_state::submit_blocks(std::shared_ptr<conn_state> s, block_list l) {
  const std::size_t n = l.blocks.size();
  // Descriptors (the frames' tables, back to back) and the local side of
  // each merged operation (a WRITE_LIST's payloads, a READ_LIST's
  // destinations).
  auto table = std::make_unique_for_overwrite<std::byte[]>(n * list_entry_size);
  auto iov = std::make_unique_for_overwrite<iovec[]>(n);
  std::size_t ops = 0;
  if (auto bad = build_list(l, table.get(), iov.get(), ops); !bad) co_return bad;
  // The operation `op`'s first block, for failed_block().
  const auto block_of = [&](std::size_t op) { return ops == n ? op : block_of_operation(l, op); };
  if (s->state() != phase::open) co_return block_result{make_error_code(errc::disconnected), 0};
  count_block_list(n, ops);
  std::stop_token token = co_await get_stop_token();
  if (s->error) co_return block_result{s->later_error(), 0};
  if (token.stop_requested()) co_return block_result{std::make_error_code(std::errc::operation_canceled), 0};

  struct frame {
    op_rec rec;
    std::size_t first;  // its first operation
    std::uint64_t seq;  // its first request (rec.seq moves on with a partial ACK)
  };
  std::deque<frame> frames;  // stable: the records are in `pending`
  const bool write = l.write;
  const std::size_t cap = list_cap(*s);
  // With a notification, the last operation is a WRITE_IMM of its own,
  // after the list frames (below).
  const std::size_t listed = l.notify ? ops - 1 : ops;
  std::size_t next = 0;  // the first operation not queued
  std::error_code early{};
  while (next < listed) {
    // A READ_LIST takes one of the peer's responder units; each descriptor
    // a send-queue slot, as many as are free now up to `cap`, at least one
    // (waited for): as a batch's chunk, a frame never holds slots while it
    // waits for more. (A READ_LIST waits for its first slot holding its
    // unit, as a batch's first READ does: slots come back as what is in
    // flight completes, which needs no unit.)
    if (!write && !s->responder_units.try_acquire()) {
      auto r = co_await counted_acquire(s->responder_units, s->responder_waiters);
      if (!r) {
        early = r.error();
        break;
      }
    }
    const std::size_t want = std::min(cap, listed - next);
    std::size_t k = s->slots.try_acquire_up_to(want);
    if (k == 0) {
      auto r = co_await counted_acquire(s->slots, s->slot_waiters);
      if (!r) {
        if (!write) s->responder_units.release();
        early = r.error();
        break;
      }
      k = 1 + s->slots.try_acquire_up_to(want - 1);
    }
    std::uint64_t bytes = 0;
    const std::size_t fit = frame_fit(iov.get() + next, k, bytes);
    if (fit < k) s->slots.release(k - fit);
    k = fit;
    if (s->error) {
      s->slots.release(k);
      if (!write) s->responder_units.release();
      early = s->later_error();
      break;
    }
    frame& f = frames.emplace_back();
    f.first = next;
    f.seq = s->next_seq;
    f.rec.op = write ? opcode::write : opcode::read_req;
    f.rec.seq = s->next_seq;
    f.rec.count = static_cast<std::uint32_t>(k);
    f.rec.owns_slot = true;
    f.rec.holds_responder = !write;
    if (!write) f.rec.read_iov = iov.get() + next;
    s->next_seq += k;
    header h;
    h.op = write ? opcode::write_list : opcode::read_list;
    h.seq = f.seq;
    h.rkey = l.remote.rkey;
    h.arg0 = k;
    h.length = static_cast<std::uint32_t>(bytes);
    out_frame o;
    encode_header(h, o.hdr);
    o.xtable = std::span<const std::byte>(table.get() + next * list_entry_size, k * list_entry_size);
    if (write) o.xparts = std::span<const iovec>(iov.get() + next, k);
    s->outq.push_back(std::move(o));
    s->pending.push_back(&f.rec);
    list_frames_sent.fetch_add(1, std::memory_order_relaxed);
    s->idle.reset();
    s->wake_writer();
    next += k;
  }
  if (l.notify && !early) {
    // The notification: a slot and one of the peer's receive credits, as a
    // single WRITE_WITH_IMM takes them.
    if (!s->slots.try_acquire()) {
      auto r = co_await counted_acquire(s->slots, s->slot_waiters);
      if (!r) early = r.error();
    }
    if (!early && !s->credits.try_acquire()) {
      auto r = co_await counted_acquire(s->credits, s->credit_waiters);
      if (!r) {
        s->slots.release();
        early = r.error();
      }
    }
    if (!early && s->error) {
      s->slots.release();
      s->credits.release();
      early = s->later_error();
    }
    if (!early) {
      ++s->credits_out;
      frame& f = frames.emplace_back();
      f.first = next;
      f.seq = s->next_seq;
      f.rec.op = opcode::write_imm;
      f.rec.seq = s->next_seq++;
      f.rec.owns_slot = true;
      header h;
      h.op = opcode::write_imm;
      h.flags = flag_imm;
      h.imm = *l.notify;
      h.seq = f.seq;
      h.addr = get_le(table.get() + next * list_entry_size, 8);  // its descriptor's address
      h.rkey = l.remote.rkey;
      h.length = static_cast<std::uint32_t>(iov[next].iov_len);
      out_frame o;
      encode_header(h, o.hdr);
      o.payload = static_cast<const std::byte*>(iov[next].iov_base);
      o.len = iov[next].iov_len;
      s->outq.push_back(std::move(o));
      s->pending.push_back(&f.rec);
      s->idle.reset();
      s->wake_writer();
      next = ops;
    }
  }
  if (!frames.empty()) {
    // What was queued completes (or fails) in order; wait for all of it:
    // the arrays stay until nothing reads them.
    const op_rec& last = frames.back().rec;
    std::stop_callback<canceller> cb(token, canceller{s.get(), last.seq + last.count - 1});
    for (frame& f : frames) co_await wait_rec{f.rec};
  }
  for (const frame& f : frames) {
    if (!f.rec.ec) continue;
    const std::size_t op = f.first + static_cast<std::size_t>(f.rec.seq - f.seq);
    co_return block_result{token.stop_requested() ? std::make_error_code(std::errc::operation_canceled) : f.rec.ec,
                           block_of(op)};
  }
  if (early) {
    if (!frames.empty()) s->enter_error(err(errc::disconnected));  // part of the list is done: RC has no partial undo
    co_return block_result{early, block_of(next)};
  }
  co_return block_result{};
}

// Lists go as list frames to a peer that reads them; to an older peer as
// the generic path's batch (a frame per operation).
task<block_result> tcp_connection::transfer_blocks(block_list l) {
  if (!s_->peer_reads_lists) return connection_impl::transfer_blocks(l);
  return conn_state::submit_blocks(s_, l);
}

}  // namespace shuttle::detail::tcp_provider
