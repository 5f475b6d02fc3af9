// The reader: one coroutine per connection. It reads a header, validates it
// (tcp_wire), and for a request checks rkey/bounds/rights against the
// domain's registration table before reading the payload straight into the
// target region (or the receive buffer); for a response it completes the
// pending operations in order (READ payload straight into the initiator's
// buffer). List frames are lists.cpp's.
#include "conn_state.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace shuttle::detail::tcp_provider {

// Target side of one request, or initiator side of one response, up to its
// payload: action::payload sets `dst`, and once the payload is there
// finish_payload completes the frame. Plain calls, no coroutine: a frame
// costs the reader no frame of its own, and the stack stays flat however
// many frames arrive at once.
conn_state::action conn_state::begin_frame(const header& h, std::span<std::byte>& dst) {
  switch (h.op) {
    case opcode::send: {
      // What it carries (lim.carried: decode_header allowed it), checked as
      // the ACK and CREDIT frames are.
      if ((h.flags & flag_ack) && !ack_upto(h.arg0)) return action::protocol;
      if ((h.flags & flag_credit) && !take_credits(h.arg1)) return action::protocol;
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
        refuse_peer();
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
      if (h.seq == 0) peer_reads_lists = true;  // the announcement (wire.hpp); a no-op to older peers
      return ack_upto(h.seq) ? action::next : action::protocol;
    case opcode::write_list:
    case opcode::read_list:
    case opcode::read_list_resp: return action::protocol;  // take_list's, take_list_resp's
    case opcode::nak: {
      op_rec* r = answered(h.seq);
      if (!r) return action::protocol;
      r->ec = h.st == status::remote_access_error ? err(errc::remote_access_error)
                                                  : err(errc::remote_operation_error);
      return action::io;  // the connection is in error; r completes with its own error
    }
    case opcode::read_resp: {
      op_rec* r = answered(h.seq);
      if (!r || r->op != opcode::read_req || r->read_iov || r->read_dst.size() != h.length) return action::protocol;
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
    case opcode::credit: return take_credits(h.arg0) ? action::next : action::protocol;
  }
  return action::protocol;
}

// The frame whose payload begin_frame asked for is complete.
void conn_state::finish_payload(const header& h) {
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

namespace {
// A non-blocking read that returned `n` <= 0 (not EINTR): EOF or an error
// ends the connection's reading; nothing (EAGAIN) means wait for more.
std::error_code read_ended(ssize_t n) noexcept {
  if (n == 0) return err(errc::eof);
  if (errno != EAGAIN && errno != EWOULDBLOCK) return errno_code(errno);
  return {};
}
}  // namespace

// Takes what the socket already holds with a plain non-blocking recv
// straight into `buf` (still no user-space copy): a frame's payload, and
// often the next header, are there by the time its header is parsed, and a
// loop turn through io_uring costs more than the syscall. Returns the bytes
// taken (fewer than asked: the rest must be awaited), or the error.
result<std::size_t> conn_state::recv_now(std::span<std::byte> buf) {
  std::size_t got = 0;
  while (got < buf.size()) {
    ssize_t n = ::recv(sock.native_handle(), buf.data() + got, buf.size() - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (auto ec = read_ended(n)) return ec;
    break;
  }
  return got;
}

// recv_now with the read-ahead (conn_state::ahead): `buf` is filled from
// what was read ahead first, then from the socket together with what
// follows it (one recvmsg, two iovecs).
result<std::size_t> conn_state::take_now(std::span<std::byte> buf) {
  if (pipe) [[unlikely]] return pipe->read_now(buf);  // no read-ahead: the ring is one already
  std::size_t got = std::min(buf.size(), ahead_end - ahead_begin);
  if (got) {
    std::memcpy(buf.data(), ahead.get() + ahead_begin, got);
    ahead_begin += got;
  }
  if (got == buf.size()) return got;
  if (!ahead) {
    if (++frames_read < read_ahead_after) {  // an idle or quiet connection holds no read-ahead
      auto n = recv_now(buf.subspan(got));
      if (!n) return n;
      return got + *n;
    }
    ahead = std::make_unique<std::byte[]>(read_ahead_size);
  }
  ahead_begin = ahead_end = 0;  // empty: got < buf.size() took all of it
  // Behind a large payload, only the next header: a run of large frames
  // then lands with no copy at all, as one large transfer does.
  const std::size_t ahead_len = buf.size() - got >= read_ahead_size / 2 ? header_size : read_ahead_size;
  while (got < buf.size()) {
    iovec iov[2] = {{buf.data() + got, buf.size() - got}, {ahead.get(), ahead_len}};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = 2;
    ssize_t n = ::recvmsg(sock.native_handle(), &m, MSG_DONTWAIT);
    if (n > 0) {
      const std::size_t want = buf.size() - got, u = static_cast<std::size_t>(n);
      got += std::min(want, u);
      if (u > want) ahead_end = u - want;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (auto ec = read_ended(n)) return ec;
    break;
  }
  return got;
}


result<bool> conn_state::take_now_v(std::span<iovec>& v) {
  if (pipe) [[unlikely]] {
    while (!v.empty()) {
      auto n = pipe->read_now_v(v);
      if (!n) return n.error();
      if (*n == 0) return false;
    }
    return true;
  }
  while (!v.empty() && ahead_begin < ahead_end) {
    const std::size_t k = std::min(v.front().iov_len, ahead_end - ahead_begin);
    std::memcpy(v.front().iov_base, ahead.get() + ahead_begin, k);
    ahead_begin += k;
    consume_iov(v, k);
  }
  if (v.empty()) return true;
  // A list frame: the connection is busy; what follows it is read ahead.
  if (!ahead) ahead = std::make_unique<std::byte[]>(read_ahead_size);
  ahead_begin = ahead_end = 0;
  while (!v.empty()) {
    std::size_t want = 0;
    for (const iovec& e : v) want += e.iov_len;
    // As take_now: behind a large payload, only the next header.
    v.data()[v.size()] = {ahead.get(), want >= read_ahead_size / 2 ? header_size : read_ahead_size};
    msghdr m{};
    m.msg_iov = v.data();
    m.msg_iovlen = v.size() + 1;
    ssize_t n = ::recvmsg(sock.native_handle(), &m, MSG_DONTWAIT);
    if (n > 0) {
      const auto u = static_cast<std::size_t>(n);
      consume_iov(v, std::min(u, want));
      if (u > want) ahead_end = u - want;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (auto ec = read_ended(n)) return ec;
    break;
  }
  return v.empty();
}

// The reader is one coroutine whose only suspensions are real waits (the
// socket, the responder units) and the budget's yield: everything a frame
// needs when its bytes are there runs in plain calls.
task<void> conn_state::reader_loop(std::shared_ptr<conn_state> s) {
  std::array<std::byte, header_size> hb{};
  std::error_code ec = err(errc::disconnected);
  unsigned frames = 0;  // handled since the loop turn began
  for (;;) {
    auto got = s->take_now(hb);
    if (!got) break;
    if (*got < header_size) {
      auto rest = std::span(hb).subspan(*got);
      if (s->pipe) {  // pipe_read_exact's loop, its wait without a task (a wait per message)
        bool ok = true;
        while (ok && !rest.empty()) {
          ok = (co_await pipe_awaiter(*s->pipe, *s->ctx, true)).has_value();
          if (!ok) break;
          auto n = s->pipe->read_now(rest);
          ok = n.has_value();
          if (ok) rest = rest.subspan(*n);
        }
        if (!ok) break;
      } else if (!co_await s->sock.read_exact(rest)) {
        break;
      }
      frames = 0;  // resumed by the loop: a new turn
    }
    auto h = decode_header(hb, s->lim);
    if (!h) {
      ec = err(errc::protocol_error);
      break;
    }
    ++s->frames_in;
    std::span<std::byte> dst;
    action a;
    try {
      if (h->op == opcode::write_list || h->op == opcode::read_list || h->op == opcode::read_list_resp) {
        a = h->op == opcode::read_list_resp ? co_await s->take_list_resp(*h) : co_await s->take_list(*h);
        // Up to max_list_entries blocks: it weighs as several frames.
        frames += reader_frame_budget / 8 - 1;
      } else {
        a = s->begin_frame(*h, dst);
      }
    } catch (const std::bad_alloc&) {  // no memory for a receive buffer: this connection fails, not the process
      ec = std::make_error_code(std::errc::not_enough_memory);
      break;
    }
    while (a == action::wait_room) {
      auto r = co_await s->responder_room.wait();
      if (!r || s->state() != phase::open) {
        a = action::io;
        break;
      }
      frames = 0;
      a = s->begin_frame(*h, dst);
    }
    if (a == action::payload) {
      auto n = s->take_now(dst);
      if (!n) break;
      if (*n < dst.size()) {
        auto rest = dst.subspan(*n);
        auto r = s->pipe ? co_await s->pipe_read_exact(rest) : co_await s->sock.read_exact(rest);
        if (!r) break;
        frames = 0;
      }
      s->finish_payload(*h);
      a = action::next;
    }
    if (a == action::next) {
      // A peer that keeps the socket full gets `reader_frame_budget`
      // frames, then the others have their turn.
      if (++frames >= reader_frame_budget) {
        frames = 0;
        co_await yield();
        if (s->state() == phase::stopping) break;
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
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(s->refuse_deadline - clock::now());
        if (left.count() <= 0) break;
        if (s->pipe) {  // the ring's bytes are discarded likewise, until the peer's hang-up
          auto n = s->pipe->read_now(scratch);
          if (!n) break;
          if (*n == 0 && !co_await with_timeout(s->pipe_wait(true), left)) break;
          continue;
        }
        auto n = co_await with_timeout(s->sock.read_some(scratch), left);
        if (!n || *n == 0) break;
      }
    }
    break;
  }
  s->cur_use = {};  // a payload cut short: nothing writes through the grant any more
  s->enter_error(s->pipe_error(ec));
  s->loop_exited();
}

}  // namespace shuttle::detail::tcp_provider
