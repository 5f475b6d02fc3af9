// List frames (wire.hpp): the target side of WRITE_LIST and READ_LIST, and
// the initiator side of READ_LIST_RESP, as the reader (reader.cpp) calls
// them once it has decoded the header.
#include "conn_state.hpp"

namespace shuttle::detail::tcp_provider {

void conn_state::list_buffers() {
  if (list_table) return;
  list_table = std::make_unique_for_overwrite<std::byte[]>(max_list_entries * list_entry_size);
  list_entries = std::make_unique<list_entry[]>(max_list_entries);
  list_iov = std::make_unique<iovec[]>(max_list_entries + 1);
}

// Fills `v` (list_iov's entries), from the read-ahead and the socket;
// false if the connection ended first.
task<bool> conn_state::scatter_in(std::span<iovec> v) {
  for (;;) {
    auto full = take_now_v(v);
    if (!full) co_return false;
    if (*full) co_return true;
    if (pipe) {  // take_now_v took what the ring had
      if (!co_await pipe_wait(true)) co_return false;
      continue;
    }
    auto r = co_await sock.readv(v);
    if (!r || *r == 0) co_return false;  // an error, or EOF mid-payload
    consume_iov(v, *r);
    if (v.empty()) co_return true;
  }
}

// A WRITE_LIST or READ_LIST: its table is read and checked as a whole, then
// every descriptor against the target region's bounds and rights, before a
// byte is placed or sent. The descriptors before the first refused one are
// done, as a run of single requests would have done them: a WRITE_LIST's
// payloads are scattered straight into the region (one recvmsg for many),
// a READ_LIST's are answered by one READ_LIST_RESP. The refused one is
// NAKed (its own seq) and nothing after it is touched. Bad framing (a zero
// or oversize length, lengths that do not sum to the frame's) is a
// protocol error.
task<conn_state::action> conn_state::take_list(header h) {
  const bool write = h.op == opcode::write_list;
  const auto n = static_cast<std::size_t>(h.arg0);  // decode_header: 1..max_list_entries
  // As single READs: past our responder units the peer is not read from
  // until responses go out (a list is answered by one response frame, which
  // takes one unit, as a READ's does).
  while (!write && !responder_room.is_set()) {
    auto r = co_await responder_room.wait();
    if (!r || state() != phase::open) co_return action::io;
  }
  list_buffers();
  std::span<std::byte> table(list_table.get(), h.table_length());
  auto got = take_now(table);
  if (!got) co_return action::io;
  if (*got < table.size()) {
    auto r = pipe ? co_await pipe_read_exact(table.subspan(*got)) : co_await sock.read_exact(table.subspan(*got));
    if (!r) co_return action::io;
  }
  if (!decode_list_table(h, table, std::span(list_entries.get(), n))) co_return action::protocol;
  list_frames_received.fetch_add(1, std::memory_order_relaxed);
  auto region = dom->find(h.rkey);
  region_view view;
  if (region) view = {region->addr, region->length, region->access};
  grant_use use;  // an access through a grant: revoke waits until the payloads are in, or sent
  if (auto g = region ? nullptr : dom->find_grant(h.rkey, this)) {
    region = g->region;
    view = {g->addr, g->length, g->access};
    use = grant_use(std::move(g));
  }
  std::size_t ok = 0;
  const unsigned need = required_access(h.op);  // check_access's, once for the frame
  if (view.addr && (view.access & need) == need) {
    for (; ok < n; ++ok) {
      const list_entry& e = list_entries[ok];
      std::byte* target = in_region(view, e.addr, e.length);
      if (!target) break;
      list_iov[ok] = {target, e.length};
    }
  }
  if (ok > 0 && write) {
    cur_use = std::move(use);
    if (!co_await scatter_in(std::span(list_iov.get(), ok))) co_return action::io;
    cur_use = {};
  } else if (ok > 0) {
    header resp;
    resp.op = opcode::read_list_resp;
    resp.seq = h.seq;
    resp.arg0 = ok;
    out_frame f;
    std::uint64_t bytes = 0;
    for (std::size_t i = 0; i < ok; ++i) bytes += list_iov[i].iov_len;
    resp.length = static_cast<std::uint32_t>(bytes);  // <= h.length
    encode_header(resp, f.hdr);
    f.parts.assign(list_iov.get(), list_iov.get() + ok);
    f.hold = std::move(region);
    f.use = std::move(use);
    f.response = 1;
    if ((responses_queued += f.response) >= our_responder_ops()) responder_room.reset();
    outq.push_back(std::move(f));
    wake_writer();
  }
  if (ok < n) {
    header nak;
    nak.op = opcode::nak;
    nak.st = status::remote_access_error;
    nak.seq = h.seq + ok;  // the ones before it are acknowledged (or answered) by it
    queue_response(nak);
    refuse_peer();
    co_return action::drain;
  }
  if (write) {
    ack_seq = h.seq + n - 1;
    wake_writer();
  }
  co_return action::next;
}

// A READ_LIST_RESP: the payloads of the `n` READs it answers (the pending
// ones from its seq on, which must all be READs, in order, whose sizes sum
// to its length), scattered straight into their buffers. A block list's
// READ_LIST is one record of several READs (blocks.cpp); an answer that
// stops inside it (a NAK follows) leaves the rest of it pending.
task<conn_state::action> conn_state::take_list_resp(header h) {
  const auto n = static_cast<std::size_t>(h.arg0);  // decode_header: 1..max_list_entries
  if (!answered(h.seq)) co_return action::protocol;
  list_buffers();
  std::uint64_t bytes = 0;
  std::size_t i = 0, recs = 0, last_took = 0;
  while (i < n) {
    if (recs == pending.size()) co_return action::protocol;
    const op_rec* r = pending[recs++];
    if (r->op != opcode::read_req || r->seq != h.seq + i) co_return action::protocol;
    if (!r->read_iov) {
      list_iov[i++] = {r->read_dst.data(), r->read_dst.size()};
      bytes += r->read_dst.size();
      last_took = 1;
      continue;
    }
    last_took = std::min<std::size_t>(r->count, n - i);
    for (std::size_t k = 0; k < last_took; ++k) {
      list_iov[i++] = r->read_iov[k];
      bytes += r->read_iov[k].iov_len;
    }
  }
  if (bytes != h.length) co_return action::protocol;
  // They stay pending while their buffers fill: only the reader pops, and
  // finish() waits for the reader.
  if (!co_await scatter_in(std::span(list_iov.get(), n))) co_return action::io;
  for (std::size_t k = 0; k + 1 < recs; ++k) pop_complete(pending.front(), {}, 0);
  op_rec* r = pending.front();
  if (last_took < r->count) {  // answered in part: the NAK of the rest follows
    r->seq += last_took;
    r->count -= static_cast<std::uint32_t>(last_took);
    r->read_iov += last_took;
    if (r->owns_slot) slots.release(last_took);
  } else {
    pop_complete(r, {}, 0);
  }
  co_return action::next;
}

}  // namespace shuttle::detail::tcp_provider
