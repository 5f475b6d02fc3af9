// Batches (post_batch): chunks of chained WRs, one ibv_post_send each.
#pragma once

#include "operations.hpp"

#include <algorithm>

namespace shuttle::detail::verbs_impl {

struct conn_state::batch_wait {
  conn_state* c = nullptr;
  io_context* ctx = nullptr;
  std::coroutine_handle<> h{};
  std::size_t pending = 0;  // chunks posted, not completed
  std::size_t first_error = SIZE_MAX;  // the lowest index of a WR that completed in error (not flushed)
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

struct conn_state::batch_chunk {
  // Each WR's own wr_id, so that a WR that fails is known by its index
  // (an unsignaled WR completes too when it fails or is flushed).
  struct ctx : wr_ctx {
    batch_chunk* ch = nullptr;
    std::size_t index = 0;  // the WR's (the operation's) index in the batch
  } last;  // the signaled one; the unsignaled ones' are execute_batch's `wr_ids` (errors and flushes only)
  batch_wait* b = nullptr;
  std::uint32_t slots = 0;
  std::size_t partial = 0;  // ibv_post_send took only a prefix: its WRs, each to be flushed
  ibv_wc_status early_status = IBV_WC_SUCCESS, status = IBV_WC_SUCCESS;

  static void note_error(const ctx* x, const ibv_wc& wc) noexcept {
    if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR)
      x->ch->b->first_error = std::min(x->ch->b->first_error, x->index);
  }
  static void on_early(wr_ctx* w, const ibv_wc& wc) noexcept {
    batch_chunk* ch = static_cast<ctx*>(w)->ch;
    conn_state* c = ch->b->c;
    note_error(static_cast<ctx*>(w), wc);
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
    note_error(static_cast<ctx*>(w), wc);
    ch->status = wc.status;
    --c->outstanding;
    --c->dom->inflight;
    c->sq.release(ch->slots);  // the unsignaled WRs before it are complete too
    if (wc.status != IBV_WC_SUCCESS && wc.status != IBV_WC_WR_FLUSH_ERR) c->fail(verbs::make_wc_error(wc.status));
    ch->b->chunk_done();
  }

  // wrs[first, end) as one chain for `ch`: each WR's sge, its successor,
  // its wr_id (the unsignaled ones' in `ids`), the last one signaled, the
  // returned credits (c.to_return) on the chunk's first send. Not in
  // execute_batch's coroutine: its locals stay in registers, not in the
  // frame (per WR, on a list's post path).
  static void link(conn_state& c, ibv_send_wr* wrs, ibv_sge* sges, ctx* ids, std::size_t first, std::size_t end,
                   batch_chunk& ch) noexcept {
    bool piggybacked = false;
    for (std::size_t i = first; i < end; ++i) {
      ibv_send_wr& wr = wrs[i];
      wr.sg_list = &sges[i];
      wr.num_sge = sges[i].length > 0 ? 1 : 0;
      wr.next = i + 1 < end ? &wrs[i + 1] : nullptr;
      ids[i].ch = &ch;
      ids[i].index = i;
      ids[i].on_wc = &on_early;
      wr.wr_id = reinterpret_cast<std::uintptr_t>(static_cast<wr_ctx*>(i + 1 < end ? &ids[i] : &ch.last));
      if (i + 1 == end) wr.send_flags |= IBV_SEND_SIGNALED;
      if (wr.opcode == IBV_WR_SEND_WITH_IMM) {  // piggybacked credits, on the chunk's first send
        std::uint32_t n = piggybacked ? 0 : std::min<std::uint32_t>(c.to_return, 0xffff);
        piggybacked = true;
        c.to_return -= n;
        wr.imm_data = htonl(n);
      }
    }
  }
};

// `wrs[i]` and `sges[i]` describe operation i (opcode, remote side, flags,
// local sge); `credit[i]`: it consumes a receive on the peer.
inline task<result<void>> conn_state::execute_batch(scratch_vector<ibv_send_wr> wrs, scratch_vector<ibv_sge> sges,
                                                    scratch_vector<char> credit,
                                                    std::vector<std::shared_ptr<verbs_region>> keep,
                                                    std::size_t* failed) {
  auto self = shared_from_this();
  (void)keep;
  if (failed) *failed = 0;
  if (!usable()) co_return disconnected();
  // In call order with the other operations (post_order), all of it.
  ordered_turn turn(this);
  auto order = co_await post_order.lock();
  if (!order) co_return order.error();
  // Chunks of at most send_queue_depth WRs (at most one per WR): room
  // for the most there can be, constructed one per chunk posted (a list
  // that fits the queue is one), never moved once posted.
  std::vector<batch_chunk> chunks;
  chunks.reserve(wrs.size());
  const bool any_credit = std::find(credit.begin(), credit.end(), char{1}) != credit.end();
  scratch_vector<batch_chunk::ctx> wr_ids(wrs.size());  // the unsignaled WRs'
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
    // Slots in one take (take_send_slots), then a credit for each WR that
    // needs one, the chunk ending before the first WR that finds none.
    std::size_t end = first;
    std::uint32_t credits_taken = 0;
    const std::size_t want = std::min<std::size_t>(wrs.size() - first, opts.send_queue_depth);
    std::size_t slots = take_send_slots(want);
    if (slots == 0) {
      if (auto r = co_await sq.acquire(); !r) early = r.error();
      else slots = 1 + take_send_slots(want - 1);  // and whatever came free with it
    }
    if (!early) {
      end = first + slots;
      for (std::size_t i = first; any_credit && i < first + slots; ++i) {
        if (!credit[i]) continue;
        if (!credits.try_acquire()) {
          if (i > first) {
            end = i;
            break;
          }
          // The chunk's first WR waits for a credit holding its slot alone.
          sq.release(slots - 1);
          slots = 1;
          end = first + 1;
          if (auto r = co_await credits.acquire(); !r) {
            sq.release();
            early = r.error();
            end = first;
            break;
          }
        }
        ++credits_taken;
      }
      if (end < first + slots && !early) sq.release(first + slots - end);
    }
    const auto need = static_cast<std::uint32_t>(end - first);
    if (!early && !usable()) early = disconnected();
    if (early) {
      sq.release(need);
      credits.release(credits_taken);
      break;
    }
    batch_chunk& ch = chunks.emplace_back();
    ch.b = &b;
    ch.slots = need;
    ch.last.ch = &ch;
    ch.last.index = end - 1;
    ch.last.on_wc = &batch_chunk::on_last;
    batch_chunk::link(*this, wrs.data(), sges.data(), wr_ids.data(), first, end, ch);
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
    if (failed) *failed = b.first_error < wrs.size() ? b.first_error : wrs.size();
    if (b.cancelled.load()) co_return std::make_error_code(std::errc::operation_canceled);
    if (st == IBV_WC_WR_FLUSH_ERR) co_return early ? early : disconnected();
    co_return wc_error(st);
  }
  if (early) {
    if (failed) *failed = first;  // the first WR not done: every one before it completed
    if (posted > 0) fail(disconnected());  // part of the batch is done: RC has no partial undo
    co_return early;
  }
  co_return result<void>{};
}

}  // namespace shuttle::detail::verbs_impl
