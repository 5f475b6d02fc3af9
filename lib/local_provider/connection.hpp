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

  void send(op_slot<void>& out, std::span<const std::byte> msg) { inner_.send(out, msg); }
  void recv(op_slot<message>& out) { inner_.recv(out); }
  void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote);
  void write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                      std::uint32_t imm) {
    inner_.write_with_imm(out, local, remote, imm);  // its message goes through the socket anyway
  }
  void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote);
  void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                        std::uint64_t desired);
  void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add);

  task<result<void>> post_batch(std::span<const operation> ops) override { return inner_.post_batch(ops); }
  task<result<void>> post_batch_at(std::span<const operation> ops, std::size_t& failed) override {
    return inner_.post_batch_at(ops, failed);
  }
  result<std::unique_ptr<prepared_impl>> prepare(const operation& o) override { return inner_.prepare(o); }
  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                   unsigned rights) override;
  task<result<void>> revoke(grant_impl& g) override;
  task<result<void>> close() override { return inner_.close(); }
  bool is_open() const noexcept override { return inner_.is_open(); }
  transport_kind kind() const noexcept override { return transport_kind::local; }
  std::size_t max_message_size() const noexcept override { return inner_.max_message_size(); }
  endpoint remote_endpoint() const noexcept override {
    return x_.named.size() ? x_.named : inner_.remote_endpoint();
  }
  // Sent after the engine's hello (tp::handshake), which follows the local hello.
  std::span<const std::byte> peer_payload() const noexcept override { return inner_.peer_payload(); }

 private:
  // Where an access of `len` bytes at `r` needing `right` is done here, or
  // null: it goes through the engine (operations.cpp).
  std::byte* direct(const remote_buffer& r, std::size_t len, unsigned right) noexcept;
  bool peer_hung_up() noexcept;

  std::shared_ptr<tp::conn_state> s_;
  conn_ext& x_;
  tp::tcp_connection inner_;  // last: destroyed (aborted, its grants revoked) first
};

}  // namespace shuttle::detail::local_provider
