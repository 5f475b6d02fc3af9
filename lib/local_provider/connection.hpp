// The local provider's connection object (internal): the tcp engine's
// connection (tp::tcp_connection over the Unix socket) for everything, and
// one-sided operations on the peer's shared regions done here, on our
// mapping of them (operations.cpp). Grants: connection.cpp.
#pragma once

#include "conn_state.hpp"

#include "../tcp_provider/connection.hpp"

#include <memory>
#include <vector>

namespace shuttle::detail::local_provider {

class local_connection final : public connection_impl {
 public:
  explicit local_connection(std::shared_ptr<tp::conn_state> s) noexcept;  // operations.cpp: the launch table
  ~local_connection() override;

  // Behind a GPU copy or an access waiting for an answer, an operation
  // waits its turn in the lane (device.cpp), else it starts at once.
  void send(op_slot<void>& out, std::span<const std::byte> msg) {
    if (on_device(msg)) return out.set_result(make_error_code(errc::unregistered_device_memory));  // the socket's
    if (x_.ordered_busy())
      out.set_task(in_lane_void({lane_op::kind::send, const_cast<std::byte*>(msg.data()), msg.size()}));
    else if (s_->pipe && msg.size() <= s_->peer.receive_buffer_size)  // (longer: the engine refuses it)
      out.emplace<tp::pipe_send>(s_, msg);  // into the ring from here where it can (tp::conn_state::try_pipe_send)
    else
      inner_.send(out, msg);
  }
  void recv(op_slot<message>& out) { out.emplace<tp::inbox_recv>(s_); }  // the engine's recv, without a task
  void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote);
  void write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                      std::uint32_t imm) {
    if (x_.ordered_busy() || on_device(local))  // GPU data: a copy, then the notification
      out.set_task(in_lane_void(
          {lane_op::kind::write_imm, const_cast<std::byte*>(local.data()), local.size(), remote, imm}));
    else
      inner_.write_with_imm(out, local, remote, imm);  // its message goes through the socket anyway
  }
  void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote);
  void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                        std::uint64_t desired);
  void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add);

  task<result<void>> post_batch(std::span<const operation> ops) override { return batch(ops, nullptr); }
  task<result<void>> post_batch_at(std::span<const operation> ops, std::size_t& failed) override {
    return batch(ops, &failed);
  }
  task<block_result> transfer_blocks(block_list l) override;  // operations.cpp
  // Prepared operations are the engine's: not from GPU memory (the socket
  // would touch it with the CPU), and not ordered behind the lane.
  result<std::unique_ptr<prepared_impl>> prepare(const operation& o) override {
    if (on_device(o.local)) return make_error_code(errc::unregistered_device_memory);
    return inner_.prepare(o);
  }
  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                   unsigned rights) override;
  task<result<void>> revoke(grant_impl& g) override;
  task<result<void>> close() override { return close_in_order(); }
  bool is_open() const noexcept override { return inner_.is_open(); }
  transport_kind kind() const noexcept override { return transport_kind::local; }
  std::size_t max_message_size() const noexcept override { return inner_.max_message_size(); }
  endpoint remote_endpoint() const noexcept override {
    return x_.named.size() ? x_.named : inner_.remote_endpoint();
  }
  // Sent after the engine's hello (tp::handshake), which follows the local hello.
  std::span<const std::byte> peer_payload() const noexcept override { return inner_.peer_payload(); }

 private:
  // Where an atomic at `r` is done here, or null: it goes through the
  // engine (operations.cpp).
  std::byte* direct(const remote_buffer& r, std::size_t len, unsigned right) noexcept;
  bool peer_hung_up() noexcept;

  // GPU memory, which the engine must not touch (device_hooks.hpp).
  bool on_device(std::span<const std::byte> m) const noexcept {
    return is_device_memory(installed_device_hooks(), *x_.dom, m.data(), m.size());
  }

  // How a write or read of `local` at `r` is done (device.cpp).
  struct route {
    enum class how : std::uint8_t { host, gpu, engine, ask, fail } how = how::engine;
    std::byte* at = nullptr;  // host, gpu: the peer's bytes in our mapping
    std::error_code ec{};     // fail
  };
  route plan(const remote_buffer& r, const std::byte* local, std::size_t len, unsigned right) noexcept;

  // An operation waiting in the lane (device.cpp).
  struct lane_op {
    enum class kind : std::uint8_t { send, write, write_imm, read, cas, faa } k;
    std::byte* local = nullptr;  // send, write: only read
    std::size_t len = 0;
    remote_buffer remote{};
    std::uint32_t imm = 0;
    std::uint64_t a = 0, b = 0;  // atomics' operands
  };
  task<result<std::uint64_t>> in_lane(lane_op op);
  task<result<std::uint64_t>> at_turn(lane_op op, lane_place& place, bool hold);
  // Started from the lane at its turn (operations.cpp): no lane check.
  void cas_now(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected, std::uint64_t desired);
  void faa_now(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add);
  task<result<void>> in_lane_void(lane_op op);
  // A GPU copy for `op` (planned: r.at), from its turn in the lane on.
  task<result<void>> gpu_copy(lane_op op, std::byte* at, std::shared_ptr<void> hold);
  task<result<void>> batch(std::span<const operation> ops, std::size_t* failed);
  // The leading writes and reads of a batch that are done here, as single
  // ones would be (operations.cpp); returns how many.
  std::size_t direct_run(std::span<const operation> ops) noexcept;
  task<result<void>> close_in_order();

  std::shared_ptr<tp::conn_state> s_;
  conn_ext& x_;
  tp::tcp_connection inner_;  // last: destroyed (aborted, its grants revoked) first
};

}  // namespace shuttle::detail::local_provider
