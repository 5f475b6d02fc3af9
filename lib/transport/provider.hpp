// What a transport provider implements (see shuttle/transport.hpp for the
// semantics every provider must keep; docs/writing-a-provider.md says what a
// provider must implement and guarantee, and how the conformance suite
// accepts it).
#pragma once

#include <shuttle/transport.hpp>

namespace shuttle::detail {

// A handle's implementation, for the providers' own casts (a region or a
// domain handed back to the provider that made it).
struct impl_access {
  static const std::shared_ptr<region_impl>& of(const memory_region& r) noexcept { return r.impl_; }
  static grant_impl* of(const memory_grant& g) noexcept { return g.impl_.get(); }
  // The provider domain behind `d`: itself, or for an automatic domain
  // (lib/auto_provider) the one it uses for remote peers, so that a
  // provider's own API (shuttle/verbs) finds its domain.
  static domain_impl* of(const domain& d) noexcept;
  // The registration a connection of provider `k` takes `r` as: `r`
  // itself, or an automatic domain's registration in that provider.
  static memory_region for_kind(const memory_region& r, transport_kind k);
};

class region_impl {
 public:
  virtual ~region_impl() = default;
  std::byte* addr = nullptr;
  std::size_t length = 0;
  unsigned access = 0;
  std::uint32_t lkey = 0;
  std::uint32_t rkey = 0;
  // An automatic domain's registration: its registration in provider `k`
  // (the one a connection of that provider checks grants against); others:
  // null, the region is its own.
  virtual const memory_region* child(transport_kind) const noexcept { return nullptr; }
};

// A provider's memory_grant. Its destructor revokes it without waiting.
class grant_impl {
 public:
  virtual ~grant_impl() = default;
  // The granted range and the grant's key; empty once revoked.
  virtual remote_buffer remote() const noexcept = 0;
  // Its connection (identity only: never dereferenced by the front).
  const connection_impl* owner = nullptr;
};

// A block-list transfer as connection::write_blocks / read_blocks hand it
// to the provider, unchecked: `blocks` in [base, base+size) and `remote`.
struct block_list {
  bool write = true;
  std::byte* base = nullptr;  // write: only read
  std::size_t size = 0;
  remote_buffer remote{};
  std::span<const block> blocks{};
  std::optional<std::uint32_t> notify{};
};

// What every provider's block-list path does the same (blocks.cpp).
// check_blocks: the list's own checks (transport.hpp: a zero length, a
// block outside `base`/`size` or `remote`), none posted when one fails: the
// first bad block's error and index, or success; `longest`: the longest
// block's length. count_block_list: the
// thread's block_transfer_stats. block_of_operation: the first block of the
// list's merged operation `op` (merge_blocks' rule), for failed_block().
block_result check_blocks(const block_list& l, std::uint64_t& longest) noexcept;
void count_block_list(std::size_t blocks, std::size_t operations) noexcept;
std::size_t block_of_operation(const block_list& l, std::size_t op) noexcept;
// The list's own check of one block (transport.hpp): a zero length is
// invalid_argument, a block outside the local span (`size` bytes) or the
// remote buffer (`remote_length`) result_out_of_range; else no error.
inline std::error_code block_error(const block& b, std::uint64_t size, std::uint64_t remote_length) noexcept {
  if (b.length == 0) return std::make_error_code(std::errc::invalid_argument);
  if (b.local_offset > size || b.length > size - b.local_offset || b.remote_offset > remote_length ||
      b.length > remote_length - b.remote_offset)
    return std::make_error_code(std::errc::result_out_of_range);
  return {};
}
// Whether block `b` extends an operation that ends at (local_end,
// remote_end) with `length` bytes so far (blocks.cpp's merging rule).
inline constexpr std::uint64_t max_merged_block_bytes = std::uint64_t(1) << 30;
inline bool extends(const block& b, std::uint64_t local_end, std::uint64_t remote_end, std::uint64_t length) noexcept {
  return b.local_offset == local_end && b.remote_offset == remote_end && length + b.length <= max_merged_block_bytes;
}

// The single operations are not virtual: a provider hands its table to the
// constructor (launch_table_of), and connection_op calls into it directly.
class connection_impl {
 public:
  explicit connection_impl(const launch_table& ops) noexcept : single_ops(ops) {}
  virtual ~connection_impl() = default;
  const launch_table& single_ops;
  virtual task<result<void>> post_batch(std::span<const operation> ops) = 0;
  // post_batch that also says which operation failed: on an error,
  // `failed` is its index, or ops.size() where the provider cannot tell
  // (the default: post_batch itself). For block-list transfers.
  virtual task<result<void>> post_batch_at(std::span<const operation> ops, std::size_t& failed);
  // connection::write_blocks / read_blocks (`l` unchecked; the connection
  // is not null). The default (blocks.cpp): the list checked, merged into
  // operations and posted with post_batch_at. A provider with a cheaper
  // path for lists overrides it, with the same checks, results and stats.
  virtual task<block_result> transfer_blocks(block_list l);
  virtual result<std::unique_ptr<prepared_impl>> prepare(const operation& op) = 0;
  virtual task<result<void>> close() = 0;
  virtual bool is_open() const noexcept = 0;
  virtual transport_kind kind() const noexcept = 0;
  virtual std::size_t max_message_size() const noexcept = 0;
  virtual endpoint remote_endpoint() const noexcept = 0;
  // connection::peer_payload (connection_options::payload of the peer).
  virtual std::span<const std::byte> peer_payload() const noexcept = 0;
  // connection::protocol: only the verbs provider has plain connections.
  virtual wire_protocol protocol() const noexcept { return wire_protocol::shuttle; }
  // connection::grant / revoke (`g` is one of this connection's); a
  // provider without per-connection exposure: errc::not_supported.
  virtual task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len,
                                           unsigned rights);
  virtual task<result<void>> revoke(grant_impl& g);
};

inline std::span<const std::byte> local_of(const op_args& a) noexcept { return {a.data, a.size}; }
inline remote_buffer remote_of(const op_args& a) noexcept { return {a.address, a.rkey, a.length}; }

// The table of a provider's connection type C, whose members build each
// single operation in `out` (as a frame-free state of the provider's own,
// or with set_task / set_result):
//   void send(op_slot<void>& out, std::span<const std::byte> msg);
//   void recv(op_slot<message>& out);
//   void write(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote);
//   void write_with_imm(op_slot<void>& out, std::span<const std::byte> local, remote_buffer remote,
//                       std::uint32_t imm);
//   void read(op_slot<void>& out, std::span<std::byte> local, remote_buffer remote);
//   void compare_and_swap(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t expected,
//                         std::uint64_t desired);
//   void fetch_and_add(op_slot<std::uint64_t>& out, remote_buffer remote, std::uint64_t add);
// Each entry is one function: C's member inlined into it where C wants.
// Static members rather than lambdas: a lambda's function pointer is a
// thunk that jumps to its call operator, a jump more on every operation.
template <class C>
struct launchers {
  static void send(connection_impl* c, const op_args& a, op_slot<void>& out) {
    static_cast<C*>(c)->send(out, local_of(a));
  }
  static void recv(connection_impl* c, const op_args&, op_slot<message>& out) { static_cast<C*>(c)->recv(out); }
  static void write(connection_impl* c, const op_args& a, op_slot<void>& out) {
    static_cast<C*>(c)->write(out, local_of(a), remote_of(a));
  }
  static void write_with_imm(connection_impl* c, const op_args& a, op_slot<void>& out) {
    static_cast<C*>(c)->write_with_imm(out, local_of(a), remote_of(a), a.imm);
  }
  static void read(connection_impl* c, const op_args& a, op_slot<void>& out) {
    static_cast<C*>(c)->read(out, std::span<std::byte>(a.data, a.size), remote_of(a));
  }
  static void compare_and_swap(connection_impl* c, const op_args& a, op_slot<std::uint64_t>& out) {
    static_cast<C*>(c)->compare_and_swap(out, remote_of(a), a.a, a.b);
  }
  static void fetch_and_add(connection_impl* c, const op_args& a, op_slot<std::uint64_t>& out) {
    static_cast<C*>(c)->fetch_and_add(out, remote_of(a), a.a);
  }
};
template <class C>
inline constexpr launch_table launch_table_of = {
    &launchers<C>::send,           &launchers<C>::recv,
    &launchers<C>::write,          &launchers<C>::write_with_imm,
    &launchers<C>::read,           &launchers<C>::compare_and_swap,
    &launchers<C>::fetch_and_add,
};

// connection::grant's checks that need no provider: the registration's
// domain is the provider's to check.
// What register_memory accepts on every provider: a non-empty range, known
// flags, and (as ibv_reg_mr) remote write or atomic rights only with local
// write.
inline result<void> check_registration(std::span<std::byte> mem, unsigned flags) noexcept {
  if (mem.empty() || (flags & ~access::all) != 0) return std::make_error_code(std::errc::invalid_argument);
  if ((flags & (access::remote_write | access::remote_atomic)) && !(flags & access::local_write))
    return std::make_error_code(std::errc::invalid_argument);
  return {};
}

inline result<void> check_grant(const memory_region& r, std::size_t offset, std::size_t len,
                                unsigned rights) noexcept {
  constexpr unsigned remote_rights = access::remote_write | access::remote_read | access::remote_atomic;
  if (!r || len == 0 || rights == 0 || (rights & ~remote_rights) != 0)
    return std::make_error_code(std::errc::invalid_argument);
  if (offset > r.size() || len > r.size() - offset) return std::make_error_code(std::errc::result_out_of_range);
  if ((r.access() & rights) != rights) return std::make_error_code(std::errc::permission_denied);
  return {};
}

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
  // impl_access::of(domain): the provider domain behind this one.
  virtual domain_impl* provider() noexcept { return this; }
  virtual transport_kind kind() const noexcept = 0;
  virtual std::string describe() const = 0;
  virtual result<memory_region> register_memory(std::span<std::byte> mem, unsigned access_flags) = 0;
  virtual task<result<connection>> connect(endpoint remote, connection_options opts) = 0;
  virtual result<listener> listen(endpoint local, connection_options opts, listener_options limits) = 0;
};

// Provider entry points (lib/tcp_provider, lib/verbs). make_verbs_domain
// returns errc::not_supported when shuttle was built without rdma-core or no
// usable device exists.
result<std::shared_ptr<domain_impl>> make_tcp_domain(const domain_options& opts);
result<std::shared_ptr<domain_impl>> make_verbs_domain(const domain_options& opts);
// lib/local_provider: peers on the same host.
result<std::shared_ptr<domain_impl>> make_local_domain(const domain_options& opts);
// For lib/auto_provider: a registration of `mem` in local domain `d` whose
// rkey is `rkey` (the same key as the registration in the remote provider,
// so that one remote_buffer serves every peer): std::errc::address_in_use
// if that key is taken there; std::errc::invalid_argument if `d` is not a
// local domain or `rkey` is 0.
result<memory_region> register_local_with_key(domain_impl& d, std::span<std::byte> mem, unsigned access_flags,
                                              std::uint32_t rkey);
// A local connection to the Unix socket `socket`, reported as `named`
// (connection::remote_endpoint).
task<result<connection>> connect_local_as(domain_impl& d, endpoint named, endpoint socket, connection_options opts);
// transport_kind::automatic (lib/auto_provider): local for peers on this
// host, `remote` (verbs or tcp) for the others.
result<std::shared_ptr<domain_impl>> make_auto_domain(std::shared_ptr<domain_impl> remote,
                                                      std::shared_ptr<domain_impl> local);

}  // namespace shuttle::detail
