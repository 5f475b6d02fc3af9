// The tcp provider's connection object (internal): what connection's front
// calls. Its single operations and the launch table built from them live in
// operations.cpp, so that each launcher inlines its operation; batches and
// prepared operations in batch.cpp; grants and set-up in connection.cpp.
#pragma once

#include "conn_state.hpp"

#include "../transport/provider.hpp"

#include <memory>
#include <vector>

namespace shuttle::detail::tcp_provider {

class tcp_connection final : public connection_impl {
 public:
  explicit tcp_connection(std::shared_ptr<conn_state> s) noexcept;  // operations.cpp: the launch table
  ~tcp_connection() override;

  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                   unsigned rights) override;
  task<result<void>> revoke(grant_impl& g) override;

  // The tcp provider's operations stay coroutines: next to a socket round
  // trip, their frames cost nothing measurable.
  void send(op_slot<void>& out, std::span<const std::byte> msg);
  void recv(op_slot<message>& out);
  void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote);
  void write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                      std::uint32_t imm);
  void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote);
  void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                        std::uint64_t desired);
  void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add);

  // One operation's request header, as post_batch and prepare build it.
  result<header> header_of(const operation& o) const;
  task<result<void>> post_batch(std::span<const operation> ops) override;
  task<result<void>> post_batch_at(std::span<const operation> ops, std::size_t& failed) override;
  task<result<void>> post_batch_to(std::span<const operation> ops, std::size_t* failed);
  result<std::unique_ptr<prepared_impl>> prepare(const operation& o) override;
  task<block_result> transfer_blocks(block_list l) override;  // blocks.cpp
  task<result<void>> close() override { return conn_state::close(s_); }
  bool is_open() const noexcept override { return s_->state() == conn_state::phase::open; }
  transport_kind kind() const noexcept override { return transport_kind::tcp; }
  std::size_t max_message_size() const noexcept override { return s_->peer.receive_buffer_size; }
  endpoint remote_endpoint() const noexcept override { return s_->remote; }
  std::span<const std::byte> peer_payload() const noexcept override { return s_->peer_payload; }

 private:
  task<result<void>> send_task(std::span<const std::byte> msg);
  task<result<message>> recv_task() { return conn_state::recv(s_); }
  task<result<void>> write_task(std::span<const std::byte> local, remote_buffer remote);
  task<result<void>> write_with_imm_task(std::span<const std::byte> local, remote_buffer remote,
                                         std::uint32_t imm);
  task<result<void>> read_task(std::span<std::byte> local, remote_buffer remote);
  task<result<std::uint64_t>> compare_and_swap_task(remote_buffer remote, std::uint64_t expected,
                                                    std::uint64_t desired);
  task<result<std::uint64_t>> fetch_and_add_task(remote_buffer remote, std::uint64_t add);
  // The request header of a one-sided operation on `remote`.
  static header one_sided(opcode op, remote_buffer remote, std::size_t length) noexcept {
    header h;
    h.op = op;
    h.addr = remote.address;
    h.rkey = remote.rkey;
    h.length = static_cast<std::uint32_t>(length);
    return h;
  }
  static task<result<void>> read_impl(std::shared_ptr<conn_state> s, header h, std::span<std::byte> local);
  struct prepared_state;

  result<memory_grant> make_grant(const memory_region& r, std::size_t offset, std::size_t len, unsigned rights);

  std::shared_ptr<conn_state> s_;
  std::vector<std::shared_ptr<grant_entry>> grants_;  // revoked with the connection
};

// The connection object for an established conn_state (its loops started).
connection make_connection(std::shared_ptr<conn_state> s);

// The hello exchange. The connection's loops are not started here: a
// handshake that loses its race against a deadline leaves nothing running.
task<result<std::shared_ptr<conn_state>>> handshake(tcp_socket& sock, std::shared_ptr<domain_state> dom,
                                                    connection_options opts);

// A handshake's failure as the application sees it: its deadline passing
// is a handshake_timeout (the TCP connection was made), not an operation's.
inline std::error_code handshake_error(std::error_code ec) noexcept {
  return ec == errc::operation_timeout ? err(errc::handshake_timeout) : ec;
}

// The hello exchange within opts.connect_timeout, then the loops start.
task<result<connection>> establish(tcp_socket sock, std::shared_ptr<domain_state> dom, connection_options opts);

}  // namespace shuttle::detail::tcp_provider
