// The single operations: an operation takes a send-queue slot (and a credit
// for SEND/WRITE_IMM, a responder unit for READ/atomics), gets a sequence
// number, queues its frame and waits for its response. The launch table of
// tcp_connection is built here, next to the operations it inlines.
#include "connection.hpp"

namespace shuttle::detail::tcp_provider {

namespace {

template <class T>
task<result<T>> fail(std::error_code e) {
  co_return e;
}
template <class T>
task<result<T>> fail(errc e) {
  co_return make_error_code(e);
}
// An atomic on a word that is not 8-byte aligned fails here, before any
// frame, as verbs does: the connection stays usable.
bool misaligned(const remote_buffer& r) noexcept { return r.address % 8 != 0; }

}  // namespace

task<result<std::uint64_t>> conn_state::submit(std::shared_ptr<conn_state> s, header h,
                                               std::span<const std::byte> payload, std::span<std::byte> read_dst) {
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

task<result<void>> conn_state::submit_void(std::shared_ptr<conn_state> s, header h,
                                           std::span<const std::byte> payload) {
  auto r = co_await submit(std::move(s), h, payload, {});
  if (!r) co_return r.error();
  co_return result<void>{};
}

task<result<message>> conn_state::recv(std::shared_ptr<conn_state> s) {
  auto r = co_await s->inbox.receive();
  co_return s->take_message(std::move(r));
}

result<message> conn_state::take_message(result<inbound> r) {
  if (!r) {
    if (r.error() == std::errc::broken_pipe) return error ? error : err(errc::disconnected);
    return r.error();
  }
  inbound in = *r;
  if (messages_out++ == 0) keepalive = shared_from_this();
  return message(std::span<const std::byte>(slot_data(in.slot), in.len), in.imm, &release_message, this, in.slot);
}

tcp_connection::tcp_connection(std::shared_ptr<conn_state> s) noexcept
    : connection_impl(launch_table_of<tcp_connection>), s_(std::move(s)) {}

connection make_connection(std::shared_ptr<conn_state> s) {
  return connection(std::make_unique<tcp_connection>(std::move(s)));
}

void tcp_connection::send(op_slot<void>& out, std::span<const std::byte> msg) { out.set_task(send_task(msg)); }
void tcp_connection::recv(op_slot<message>& out) { out.set_task(recv_task()); }
void tcp_connection::write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) {
  out.set_task(write_task(local, remote));
}
void tcp_connection::write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                                    std::uint32_t imm) {
  out.set_task(write_with_imm_task(local, remote, imm));
}
void tcp_connection::read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) {
  out.set_task(read_task(local, remote));
}
void tcp_connection::compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                                      std::uint64_t desired) {
  out.set_task(compare_and_swap_task(remote, expected, desired));
}
void tcp_connection::fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) {
  out.set_task(fetch_and_add_task(remote, add));
}

task<result<void>> tcp_connection::send_task(std::span<const std::byte> msg) {
  if (msg.size() > s_->peer.receive_buffer_size) return fail<void>(errc::message_too_long);
  header h;
  h.op = opcode::send;
  h.length = static_cast<std::uint32_t>(msg.size());
  return conn_state::submit_void(s_, h, msg);
}
task<result<void>> tcp_connection::write_task(std::span<const std::byte> local, remote_buffer remote) {
  if (local.size() > max_rdma_length) return fail<void>(errc::message_too_long);
  return conn_state::submit_void(s_, one_sided(opcode::write, remote, local.size()), local);
}
task<result<void>> tcp_connection::write_with_imm_task(std::span<const std::byte> local, remote_buffer remote,
                                                       std::uint32_t imm) {
  if (local.size() > max_rdma_length) return fail<void>(errc::message_too_long);
  header h = one_sided(opcode::write_imm, remote, local.size());
  h.flags = flag_imm;
  h.imm = imm;
  return conn_state::submit_void(s_, h, local);
}
task<result<void>> tcp_connection::read_task(std::span<std::byte> local, remote_buffer remote) {
  if (local.size() > max_rdma_length) return fail<void>(errc::message_too_long);
  return read_impl(s_, one_sided(opcode::read_req, remote, local.size()), local);
}
task<result<std::uint64_t>> tcp_connection::compare_and_swap_task(remote_buffer remote, std::uint64_t expected,
                                                                  std::uint64_t desired) {
  if (misaligned(remote)) return fail<std::uint64_t>(std::make_error_code(std::errc::invalid_argument));
  header h = one_sided(opcode::cas, remote, 8);
  h.arg0 = expected;
  h.arg1 = desired;
  return conn_state::submit(s_, h, {}, {});
}
task<result<std::uint64_t>> tcp_connection::fetch_and_add_task(remote_buffer remote, std::uint64_t add) {
  if (misaligned(remote)) return fail<std::uint64_t>(std::make_error_code(std::errc::invalid_argument));
  header h = one_sided(opcode::faa, remote, 8);
  h.arg0 = add;
  return conn_state::submit(s_, h, {}, {});
}

task<result<void>> tcp_connection::read_impl(std::shared_ptr<conn_state> s, header h, std::span<std::byte> local) {
  auto r = co_await conn_state::submit(std::move(s), h, {}, local);
  if (!r) co_return r.error();
  co_return result<void>{};
}

}  // namespace shuttle::detail::tcp_provider
