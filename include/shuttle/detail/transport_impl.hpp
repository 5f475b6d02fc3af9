// What a transport provider implements (see shuttle/transport.hpp for the
// semantics every provider must keep).
#pragma once

#include <shuttle/transport.hpp>

namespace shuttle::detail {

class region_impl {
 public:
  virtual ~region_impl() = default;
  std::byte* addr = nullptr;
  std::size_t length = 0;
  unsigned access = 0;
  std::uint32_t lkey = 0;
  std::uint32_t rkey = 0;
};

class connection_impl {
 public:
  virtual ~connection_impl() = default;
  // The single operations build their state in `out` (connection_op.hpp):
  // a frame-free state of the provider's own, or set_task / set_result.
  virtual void send(op_slot<void>& out, std::span<const std::byte> msg) = 0;
  virtual void recv(op_slot<message>& out) = 0;
  virtual void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote) = 0;
  virtual void write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
                              std::uint32_t imm) = 0;
  virtual void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote) = 0;
  virtual void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
                                std::uint64_t desired) = 0;
  virtual void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add) = 0;
  virtual task<result<void>> post_batch(std::span<const operation> ops) = 0;
  virtual task<result<void>> close() = 0;
  virtual bool is_open() const noexcept = 0;
  virtual transport_kind kind() const noexcept = 0;
  virtual std::size_t max_message_size() const noexcept = 0;
  virtual endpoint remote_endpoint() const noexcept = 0;
};

class listener_impl {
 public:
  virtual ~listener_impl() = default;
  virtual task<result<connection>> accept() = 0;
  virtual endpoint local_endpoint() const = 0;
  virtual void close() noexcept = 0;
};

class domain_impl {
 public:
  virtual ~domain_impl() = default;
  virtual transport_kind kind() const noexcept = 0;
  virtual std::string describe() const = 0;
  virtual result<memory_region> register_memory(std::span<std::byte> mem, unsigned access_flags) = 0;
  virtual task<result<connection>> connect(endpoint remote, connection_options opts) = 0;
  virtual result<listener> listen(endpoint local, connection_options opts) = 0;
};

// Provider entry points (lib/tcp_provider, lib/verbs). make_verbs_domain
// returns errc::not_supported when shuttle was built without rdma-core or no
// usable device exists.
result<std::shared_ptr<domain_impl>> make_tcp_domain(const domain_options& opts);
result<std::shared_ptr<domain_impl>> make_verbs_domain(const domain_options& opts);

}  // namespace shuttle::detail
