// The writer: one coroutine per connection. It gathers queued frames into
// one writev (header and payload iovecs: the payload is never copied in user
// space), plus the cumulative ACK and the CREDIT frame.
#include "conn_state.hpp"

#include <sys/uio.h>

#include <vector>

namespace shuttle::detail::tcp_provider {

namespace {

constexpr std::size_t max_iov = 1024;  // IOV_MAX on Linux
static_assert(2 + max_list_entries <= max_iov - 2);

// Parks the writer until wake_writer.
struct writer_park {
  conn_state& s;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) noexcept { s.writer_waiter = h; }
  void await_resume() const noexcept {}
};

}  // namespace

task<void> conn_state::writer_loop(std::shared_ptr<conn_state> s) {
  std::vector<out_frame> batch;
  std::vector<iovec> iov;
  std::array<std::byte, header_size> ackh{}, credh{};
  bool ack_waited = false;
  batch.reserve(256);
  iov.reserve(max_iov);
  while (s->state() == phase::open || s->state() == phase::refusing) {
    if (s->outq.empty() && s->ack_seq == s->ack_sent && s->credits_to_return == 0) {
      if (s->state() == phase::refusing) {
        (void)s->sock.shutdown(SHUT_WR);  // the NAK is out; the reader drains until the peer closes
        break;
      }
      co_await writer_park{*s};
      continue;
    }
    if (s->outq.empty() && (s->credits_to_return == 0 || s->lim.carried) && !ack_waited) {
      // Only an ACK to send: wait one loop turn, so that a response the
      // application makes to what was just received (a ping-pong, an echo)
      // carries it in the same segment instead of following it. Where SENDs
      // carry ACKs and credits (wire.hpp), a credit waits that turn too:
      // the reply is then one frame. One turn only: nothing waits longer.
      ack_waited = true;
      co_await yield();
      continue;
    }
    ack_waited = false;
    batch.clear();
    iov.clear();
    // At most 256 frames, and iovecs within the kernel's IOV_MAX (1024; a
    // list frame takes up to 2 + its entries), 2 left for the ACK and the CREDIT.
    std::size_t iovs = 0;
    while (!s->outq.empty() && batch.size() < 256 && iovs + s->outq.front().iov_count() <= max_iov - 2) {
      iovs += s->outq.front().iov_count();
      batch.push_back(std::move(s->outq.front()));
      s->outq.pop_front();
      s->responses_queued -= batch.back().response;
    }
    if (s->responses_queued < our_responder_ops()) s->responder_room.set();
    for (auto& f : batch) {
      iov.push_back({f.hdr.data(), header_size});
      if (!f.table.empty()) iov.push_back({f.table.data(), f.table.size()});
      else if (!f.xtable.empty()) iov.push_back({const_cast<std::byte*>(f.xtable.data()), f.xtable.size()});
      if (!f.parts.empty()) iov.insert(iov.end(), f.parts.begin(), f.parts.end());
      else if (!f.xparts.empty()) iov.insert(iov.end(), f.xparts.begin(), f.xparts.end());
      else if (f.len) iov.push_back({const_cast<std::byte*>(f.payload), f.len});
    }
    // Where the peer reads them, the batch's last frame, if a SEND, carries
    // the ACK (it follows every response in the batch) and the credits.
    std::byte* carrier = nullptr;
    if (s->lim.carried && !batch.empty() && batch.back().hdr[0] == std::byte{std::uint8_t(opcode::send)})
      carrier = batch.back().hdr.data();
    // A cumulative ACK goes after every response queued before it.
    if (s->outq.empty() && s->ack_seq != s->ack_sent && carrier) {
      carrier[1] |= std::byte{flag_ack};
      detail::put_le(carrier + 32, s->ack_seq, 8);
      s->ack_sent = s->ack_seq;
    } else if (s->outq.empty() && s->ack_seq != s->ack_sent) {
      header a;
      a.op = opcode::ack;
      a.seq = s->ack_seq;
      encode_header(a, ackh);
      iov.push_back({ackh.data(), header_size});
      s->ack_sent = s->ack_seq;
    }
    if (s->credits_to_return && carrier) {
      carrier[1] |= std::byte{flag_credit};
      detail::put_le(carrier + 40, std::exchange(s->credits_to_return, 0), 8);
    } else if (s->credits_to_return) {
      header c;
      c.op = opcode::credit;
      c.arg0 = s->credits_to_return;
      s->credits_to_return = 0;
      encode_header(c, credh);
      iov.push_back({credh.data(), header_size});
    }
    result<void> r;
    if (s->pipe) [[unlikely]] {  // what fits is copied into the ring at once; the rest waits for room
      std::span<iovec> v(iov);
      r = s->pipe->write_now(v);
      if (r && !v.empty()) {
        s->pipe_backlog = true;  // no SEND from the application's call overtakes the rest (try_pipe_send)
        if (s->state() != phase::refusing) {
          r = co_await s->pipe_write_all(v);
        } else {
          auto left = std::chrono::duration_cast<std::chrono::milliseconds>(s->refuse_deadline - clock::now());
          r = left.count() > 0 ? co_await with_timeout(s->pipe_write_all(v), left) : err(errc::disconnected);
          if (!r) s->abort_io();
        }
        s->pipe_backlog = false;
      }
    } else if (s->state() != phase::refusing) {
      r = co_await s->sock.writev_all(iov);
    } else {  // a peer that does not read gets until the linger time is up
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(s->refuse_deadline - clock::now());
      r = left.count() > 0 ? co_await with_timeout(s->sock.writev_all(iov), left) : err(errc::disconnected);
      if (!r) s->abort_io();
    }
    batch.clear();
    if (!r) {
      s->enter_error(s->pipe_error(err(errc::disconnected)));
      break;
    }
  }
  s->loop_exited();
}

}  // namespace shuttle::detail::tcp_provider
