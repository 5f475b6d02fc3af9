// The transport-neutral RDMA API. Applications are written once against it;
// three providers implement it:
//
//  - verbs: rdma-core (libibverbs + librdmacm), RC queue pairs, real NICs and
//    Soft-RoCE;
//  - tcp: a user-space provider with RC semantics over TCP sockets, for
//    machines without an RDMA device (the default there);
//  - local: peers on the same host (lib/local_provider/README.md): set up
//    over a Unix-domain socket, one-sided operations on memory from
//    shuttle/local.hpp as memcpy / std::atomic_ref on the peer's mapping.
//
// transport_kind::automatic (the default) combines them: local for a peer
// on this host, verbs (with a device) or tcp for the others, with one
// registration and one rkey for both (lib/auto_provider/README.md).
//
// The model is the verbs one. A domain (a protection domain) owns memory
// registrations; a connection (an RC queue pair) offers two-sided send/recv
// and one-sided write, write_with_imm, read and 64-bit atomics on memory the
// peer registered and described to us with a remote_buffer.
//
// Ordering and errors follow RC rules on both providers: operations on one
// connection are delivered in order; an error completes the failing
// operation with an error_code, moves the connection to an error state and
// fails every pending and later operation (errc::disconnected). A one-sided
// access that the target refuses (unknown rkey, out of bounds, missing
// rights) fails on the initiator with errc::remote_access_error; the target
// is never touched outside its registered regions.
//
// Cancellation (the awaiting task's stop token) is NIC-safe: a cancelled
// operation resumes only when nothing will touch its buffers any more. An
// operation still waiting for a send-queue slot or a credit is cancelled
// alone; one already handed to the NIC (verbs) or the socket (tcp) cannot be
// withdrawn alone, so cancelling it fails the connection (errc::disconnected).
//
// Lifetimes. A domain belongs to the io_context of the thread that opened it
// (domain::open outside one: errc::no_io_context). Its objects are used and
// destroyed on that thread, before that io_context, and among themselves at
// any time and in any order, with no wait: a connection's destructor aborts
// it (operations in flight complete with errc::disconnected once their
// buffers are safe), a listener's closes it, a domain's drops the handle
// only, and regions, messages, grants and prepared operations keep alive what
// they need. A provider's wind-down after a destructor runs on the loop and
// holds the io_context (io_context::hold), whose destructor lets it finish.
//
// The whole contract, per operation, with the conformance tests that check
// it: docs/transport-semantics.md.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <shuttle/detail/connection_op.hpp>
#include <shuttle/endpoint.hpp>
#include <shuttle/error.hpp>
#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle {

enum class transport_kind { automatic, tcp, verbs, local };
const char* to_string(transport_kind k) noexcept;
// "tcp", "verbs" (also "rdma"), "local", "auto"; anything else is an error.
result<transport_kind> parse_transport_kind(std::string_view s);

// Access rights of a registration (ibv_access_flags values).
namespace access {
inline constexpr unsigned local_write = 1u << 0;
inline constexpr unsigned remote_write = 1u << 1;
inline constexpr unsigned remote_read = 1u << 2;
inline constexpr unsigned remote_atomic = 1u << 3;
inline constexpr unsigned all = local_write | remote_write | remote_read | remote_atomic;
}  // namespace access

// Where a peer's memory is: what the target sends the initiator so that it
// can write, read or apply atomics there.
struct remote_buffer {
  std::uint64_t address = 0;
  std::uint32_t rkey = 0;
  std::uint64_t length = 0;

  static constexpr std::size_t wire_size = 20;  // little-endian address, rkey, length
  // Into / from exactly wire_size bytes: cannot fail.
  void serialize(std::span<std::byte, wire_size> out) const noexcept;
  static remote_buffer deserialize(std::span<const std::byte, wire_size> in) noexcept;
  // Into the first wire_size bytes of any span (a connect payload, a
  // message's data), from the first wire_size bytes of one; a shorter span:
  // std::errc::invalid_argument, nothing written.
  result<void> serialize(std::span<std::byte> out) const noexcept;
  static result<remote_buffer> deserialize(std::span<const std::byte> in) noexcept;
  // An array of exactly wire_size bytes (else it would convert to either span).
  void serialize(std::array<std::byte, wire_size>& out) const noexcept { serialize(std::span(out)); }
  static remote_buffer deserialize(const std::array<std::byte, wire_size>& in) noexcept {
    return deserialize(std::span(in));
  }
  void serialize(std::byte (&out)[wire_size]) const noexcept { serialize(std::span(out)); }
  static remote_buffer deserialize(const std::byte (&in)[wire_size]) noexcept { return deserialize(std::span(in)); }
  // A sub-range; std::errc::result_out_of_range if it is not inside this one.
  result<remote_buffer> slice(std::uint64_t offset, std::uint64_t len) const noexcept;
};

namespace detail {
class region_impl;
class connection_impl;
class listener_impl;
class domain_impl;
class grant_impl;
// lib/'s access to a handle's implementation (lib/transport/provider.hpp).
struct impl_access;
}  // namespace detail

// A registered memory range (ibv_mr). Deregistered when the last copy goes.
class memory_region {
 public:
  memory_region() noexcept = default;
  explicit memory_region(std::shared_ptr<detail::region_impl> impl) noexcept : impl_(std::move(impl)) {}

  std::byte* data() const noexcept;
  std::size_t size() const noexcept;
  unsigned access() const noexcept;
  std::uint32_t lkey() const noexcept;
  std::uint32_t rkey() const noexcept;
  // The descriptor a peer needs for one-sided access to [offset, offset+len).
  remote_buffer remote(std::size_t offset = 0, std::size_t len = SIZE_MAX) const noexcept;
  explicit operator bool() const noexcept { return static_cast<bool>(impl_); }

 private:
  friend struct detail::impl_access;
  std::shared_ptr<detail::region_impl> impl_;
};

// A range of a registration exposed to one connection's peer only, until it
// is revoked (connection::grant). The registration's own rkey opens it to
// every peer of the domain (all connections share one protection domain);
// a grant's key opens the range to the peer of the connection it was
// granted on and to no other: an access through it from any other
// connection fails there with errc::remote_access_error (and, RC rules,
// moves that connection to the error state), the granting connection and
// the others carry on.
//  - verbs: a type 2 memory window (ibv_alloc_mw, IBV_MW_TYPE_2) bound on
//    the connection's QP with an IBV_WR_BIND_MW work request, to a
//    registration of exactly the granted range (IBV_ACCESS_MW_BIND, no
//    remote rights of its own), so that the range is enforced even where
//    the device checks an access's bounds against the registration only
//    (Soft-RoCE); revoked with IBV_WR_LOCAL_INV, deallocated when the grant
//    goes. On a device without type 2A/2B windows (device_cap_flags),
//    grant() fails with errc::not_supported.
//  - tcp: an entry in the domain's key table that names its connection,
//    with an unguessable key (getrandom); the target's reader accepts it
//    only from that connection.
// Destroying a grant, or its connection, revokes it at once without
// waiting: use connection::revoke to know that no access through it is
// still touching the memory. It keeps the registration alive.
class memory_grant {
 public:
  memory_grant() noexcept;
  explicit memory_grant(std::unique_ptr<detail::grant_impl> impl) noexcept;
  memory_grant(memory_grant&&) noexcept;
  memory_grant& operator=(memory_grant&&) noexcept;
  ~memory_grant();

  // What the peer needs: address and length of the granted range, and the
  // grant's own key (never the registration's). Empty once revoked.
  remote_buffer remote() const noexcept;
  // Granted, and not revoked (nor its connection destroyed) since.
  explicit operator bool() const noexcept;

 private:
  friend struct detail::impl_access;
  std::unique_ptr<detail::grant_impl> impl_;
};

// A received message. Its buffer belongs to the connection's receive pool
// and goes back to it when the message is destroyed (verbs: posted again at
// the loop's next poll, with the other buffers released since, in one
// ibv_post_recv; its credit goes back to the peer once it is posted).
class message {
 public:
  using release_fn = void (*)(void* owner, std::uint64_t slot) noexcept;
  message() noexcept = default;
  message(std::span<const std::byte> data, std::optional<std::uint32_t> imm, release_fn release, void* owner,
          std::uint64_t slot) noexcept
      : data_(data), imm_(imm), release_(release), owner_(owner), slot_(slot) {}
  message(message&& o) noexcept { *this = std::move(o); }
  message& operator=(message&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = o.data_;
      imm_ = o.imm_;
      release_ = std::exchange(o.release_, nullptr);
      owner_ = o.owner_;
      slot_ = o.slot_;
    }
    return *this;
  }
  ~message() { reset(); }

  std::span<const std::byte> data() const noexcept { return data_; }
  std::size_t size() const noexcept { return data_.size(); }
  // The immediate of a write_with_imm (or a send with immediate).
  std::optional<std::uint32_t> imm() const noexcept { return imm_; }
  void reset() noexcept {
    if (release_) std::exchange(release_, nullptr)(owner_, slot_);
  }

 private:
  std::span<const std::byte> data_{};
  std::optional<std::uint32_t> imm_{};
  release_fn release_ = nullptr;
  void* owner_ = nullptr;
  std::uint64_t slot_ = 0;
};

// What a connection speaks on the wire (connection_options::protocol).
enum class wire_protocol : std::uint8_t {
  // shuttle's handshake (hello, credits, connect payload): both peers run shuttle.
  shuttle,
  // Interop with programs that use librdmacm and libibverbs directly
  // (verbs provider only; elsewhere errc::not_supported): plain RC, no
  // handshake and no credit protocol. connect sends `payload` as the bare
  // rdma_cm private data, and peer_payload() is the peer's private data as
  // the CM delivers it (on IB/RoCE a REQ's is padded with zeros to 56
  // bytes). The application sizes the receives: receive_buffers buffers of
  // receive_buffer_size bytes are posted from the start and each goes back
  // when its message is destroyed; a peer that sends more than are posted
  // is told "receiver not ready" and retries as its QP says (RNR), then
  // fails. A send is a plain IBV_WR_SEND (an incoming send with immediate
  // gives message::imm()), up to the port's largest message: one larger
  // than the peer's posted buffer fails that connection on both sides, as
  // in plain verbs. write / read / atomics are unchanged (the peer must
  // describe its memory itself). No shared receive queue (not_supported).
  plain,
  // Listeners only: a request carrying shuttle's hello gets a shuttle
  // connection, any other (no private data, or another program's) a plain
  // one (connection::protocol() tells which). connect: as shuttle.
  detect,
};

struct connection_options {
  std::uint32_t send_queue_depth = 128;     // work requests in flight; more wait for a slot
  std::uint32_t receive_buffers = 64;       // posted receives (and so the peer's send credits)
  std::size_t receive_buffer_size = 65536;  // largest message accepted by send/recv
  std::uint32_t max_inline_data = 64;       // sends up to this size go inline (verbs)
  // Shared receive queue (verbs). The connection takes its receives from one
  // ibv_srq of its domain (created by the first such connection; every
  // later one must ask for a receive_buffer_size no larger than the first's,
  // else std::errc::invalid_argument) instead of a receive queue of its own.
  // The SRQ is kept posted: a consumed buffer goes back to the SRQ when its
  // message is destroyed. Flow control is unchanged: the peer still gets
  // `receive_buffers` credits and spends one per send / write_with_imm, and
  // the SRQ always holds at least as many posted buffers as all its
  // connections' peers may still consume (each joining connection grows the
  // SRQ by its grant unless buffers left by closed connections cover it), so
  // RNR cannot happen, however unevenly the connections are loaded; the
  // credit freed by a message goes back to the connection it arrived on.
  // What is shared is one registration, one set of buffers reused across
  // connection lifetimes and one repost path; the credit window of each
  // connection stays `receive_buffers`. errc::not_supported on a device
  // without SRQs and on the tcp provider (which has no SRQ equivalent).
  bool shared_receive_queue = false;
  std::chrono::milliseconds connect_timeout{5000};
  // Bytes handed to the peer with the handshake, so that no message round
  // trip is needed for what a peer must know at once (a remote_buffer: see
  // remote_buffer::serialize). domain::connect sends them with its request;
  // a listener (domain::listen) answers every peer it accepts with them.
  // The other side reads them with connection::peer_payload(). At most
  // max_connect_payload bytes, else connect() and listen() fail with
  // errc::message_too_long before anything is sent. A peer's payload over
  // the bound (a hostile peer) fails its handshake: refused with a reason
  // (listener_options::on_refused), or errc::protocol_error on connect.
  //  - verbs: after the hello in the rdma_cm private data (REQ, REP);
  //  - tcp and local: after the hello on the stream.
  std::vector<std::byte> payload;
  wire_protocol protocol = wire_protocol::shuttle;
};

// The most bytes connection_options::payload may hold, on every provider:
// what the verbs provider's connection request has room for (rdma_cm's REQ
// carries 56 bytes of private data on IB and RoCE; the 16-byte hello and a
// length byte leave 39, of which 7 are kept for the hello to grow).
inline constexpr std::size_t max_connect_payload = 32;

// What a listener may hold on behalf of peers it has not accepted yet, and
// for how long (domain::listen). Every peer may be hostile: one that never
// finishes its handshake, or that connects and says nothing, costs a
// bounded amount of memory and time and never delays the others.
// tcp provider: while an accept() waits, the listener takes peers from the
// kernel and starts their handshakes, which then run in the background,
// concurrently, each with its own deadline; accept() returns the first
// connection established. A refused peer's socket is closed at once (it
// reads EOF, without the server's hello).
struct listener_options {
  // Handshakes in progress at once. tcp provider: past it, new peers wait
  // in the kernel's listen backlog until a handshake ends (a burst of good
  // clients is served, not refused). verbs: a connection request past it is
  // rejected at once, with a reason in the reject's private data.
  std::uint32_t max_handshakes = 64;
  // How long a peer has to finish its handshake; past it, it is dropped.
  std::chrono::milliseconds handshake_timeout{5000};
  // Connections established and not yet taken by accept(). tcp provider:
  // handshakes in progress count too, and past it new peers wait in the
  // kernel's backlog, so an established connection is never dropped for
  // want of room (0 counts as 1). verbs: past it new requests are rejected.
  std::uint32_t accept_backlog = 64;
  // Connections from this listener alive at once (0: no cap); past it a
  // new request is refused. Handshakes in progress count too, so that they
  // cannot overshoot it; a connection counts until it has failed or closed
  // (tcp provider: until its socket is closed, even while the application
  // still holds the connection object).
  std::uint32_t max_connections = 0;
  // An accepted connection on which nothing arrives from the peer for this
  // long fails with errc::idle_timeout (0: never). tcp provider: no byte
  // of data (the kernel's time of the last data received, checked about
  // once per timeout); it fails up to about a sixteenth of it late. local
  // provider: no frame through the socket (direct accesses in shared
  // memory are not seen, as on verbs), the same lateness.
  std::chrono::milliseconds idle_timeout{0};
  // Told, on the listener's loop, of each peer refused or dropped before
  // accept() could return it (a cap, a deadline, a bad hello), with its
  // address and the reason: what an operator's log needs. Optional.
  std::function<void(const endpoint& peer, std::string_view why)> on_refused;
};

// One operation of a batch (connection::post_batch). Atomics are not
// batched (each returns a value): use compare_and_swap / fetch_and_add.
struct operation {
  enum class type : std::uint8_t { send, write, write_with_imm, read };
  type op = type::write;
  std::span<const std::byte> local{};  // read: the destination (writable memory)
  remote_buffer remote{};              // not used by send
  std::uint32_t imm = 0;               // write_with_imm

  static operation send(std::span<const std::byte> msg) noexcept { return {type::send, msg, {}, 0}; }
  static operation write(std::span<const std::byte> l, remote_buffer r) noexcept { return {type::write, l, r, 0}; }
  static operation write_with_imm(std::span<const std::byte> l, remote_buffer r, std::uint32_t imm) noexcept {
    return {type::write_with_imm, l, r, imm};
  }
  static operation read(std::span<std::byte> l, remote_buffer r) noexcept { return {type::read, l, r, 0}; }
};

// One block of a block-list transfer (connection::write_blocks /
// read_blocks): `length` bytes at `local_offset` in the local span and at
// `remote_offset` in the remote_buffer.
struct block {
  std::uint64_t local_offset = 0;
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;
};

struct block_options {
  // write_blocks: the peer is told with this immediate (as write_with_imm:
  // it takes one of its receive credits and arrives as a message) once every
  // block is in its memory.
  std::optional<std::uint32_t> notify{};
};

// The outcome of a block-list transfer: success, or an error and which
// block it concerns (failed_block(): its index in the list given;
// block_result::unknown where the provider cannot tell which: see
// connection::write_blocks).
class [[nodiscard]] block_result {
 public:
  static constexpr std::size_t unknown = SIZE_MAX;
  block_result() noexcept = default;
  block_result(std::error_code ec, std::size_t index) noexcept : ec_(ec), index_(index) {}
  bool has_value() const noexcept { return !ec_; }
  explicit operator bool() const noexcept { return has_value(); }
  std::error_code error() const noexcept { return ec_; }
  std::size_t failed_block() const noexcept { return index_; }

 private:
  std::error_code ec_{};
  std::size_t index_ = unknown;
};

// What the block-list transfers of this thread have done since it started
// (they belong to its loop): lists transferred, blocks in them, and the
// operations (work requests, frames) posted for them after merging.
struct block_stats {
  std::uint64_t lists = 0;
  std::uint64_t blocks = 0;
  std::uint64_t operations = 0;
};
block_stats block_transfer_stats() noexcept;

namespace detail {
// A provider's single operations: connection_op::await_ready calls the
// entry straight into the provider's code (one indirect call from co_await),
// which builds the operation in `out` (connection_op.hpp). A provider fills
// its table with launch_table_of (lib/transport/provider.hpp).
struct launch_table {
  launch_fn<void> send;
  launch_fn<message> recv;
  launch_fn<void> write;
  launch_fn<void> write_with_imm;
  launch_fn<void> read;
  launch_fn<std::uint64_t> compare_and_swap;
  launch_fn<std::uint64_t> fetch_and_add;
};
// A connection without a provider (default-constructed, moved from): each
// operation fails with errc::disconnected.
extern const launch_table no_connection_ops;

inline op_args make_op_args(std::span<const std::byte> local, remote_buffer remote = {}, std::uint32_t imm = 0,
                            std::uint64_t a = 0, std::uint64_t b = 0) noexcept {
  // read() alone writes `local`, and it took a writable span
  return {const_cast<std::byte*>(local.data()), local.size(), remote.address, remote.rkey, imm, remote.length, a, b};
}
}  // namespace detail

// An operation prepared once and started any number of times, one start at
// a time (as MPI_Start on a persistent request): connection::prepare checks
// the arguments, finds the local memory's registration and builds the work
// request, so that a start posts it and does nothing else: no argument
// passing, no registration lookup, no per-start state to build or destroy.
// For loops that repeat one transfer (polling a remote flag, a ring slot, a
// latency benchmark). It keeps the connection's state and the local
// registration alive until it is destroyed; the memory it was prepared
// with must stay valid as long.
//
// co_await op.start() yields result<void>, as the single operation does
// (errors, cancellation: see the top of this file), and besides:
//  - std::errc::operation_in_progress while another start of it is awaited;
//  - std::errc::invalid_argument for an empty one (default or moved from);
//  - errc::disconnected once the connection failed or was closed.
// Destroying it while a start is awaited is allowed: that start still ends
// normally, its state freed after it.
class prepared_operation {
 public:
  prepared_operation() noexcept = default;
  explicit prepared_operation(std::unique_ptr<detail::prepared_impl> impl) noexcept : impl_(impl.release()) {}
  prepared_operation(prepared_operation&& o) noexcept : impl_(std::exchange(o.impl_, nullptr)) {}
  prepared_operation& operator=(prepared_operation&& o) noexcept {
    if (this != &o) {
      reset();
      impl_ = std::exchange(o.impl_, nullptr);
    }
    return *this;
  }
  ~prepared_operation() { reset(); }

  explicit operator bool() const noexcept { return impl_ != nullptr; }
  bool busy() const noexcept { return impl_ && impl_->in_flight; }

  class [[nodiscard]] awaiter {
   public:
    using start_result = detail::prepared_impl::start_result;
    explicit awaiter(detail::prepared_impl* p) noexcept : p_(p) {}
    // Inlined into the awaiting coroutine, as connection_op's.
    [[gnu::always_inline]] bool await_ready() noexcept {
      if (!p_ || p_->in_flight) return true;
      p_->in_flight = true;
      state_ = p_->start();
      return state_ != start_result::pending;
    }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) {
      try {
        return p_->suspend(h, detail::stop_token_of(h));
      } catch (...) {  // nothing was left waiting
        p_->in_flight = false;
        throw;
      }
    }
    // Inlined too: left to the compiler, g++ 12 made it an out-of-line
    // clone in some callers, a tenth of read_lat's instructions
    // (docs/measurements.md, 2026-12-06).
    [[gnu::always_inline]] result<void> await_resume() {
      if (state_ == start_result::succeeded) {  // over in await_ready: nothing ran since, nothing to free
        p_->in_flight = false;
        return {};
      }
      if (state_ == start_result::not_started)
        return std::make_error_code(p_ ? std::errc::operation_in_progress : std::errc::invalid_argument);
      struct end_start {
        detail::prepared_impl* p;
        ~end_start() {
          p->in_flight = false;
          if (p->orphaned) delete p;
        }
      } end{p_};
      return p_->take();
    }

   private:
    detail::prepared_impl* p_;
    start_result state_ = start_result::not_started;
  };
  // One execution: co_await op.start() (or pass it to as_task / with_timeout).
  awaiter start() noexcept { return awaiter{impl_}; }

 private:
  void reset() noexcept {
    if (!impl_) return;
    if (impl_->in_flight)
      std::exchange(impl_, nullptr)->orphaned = true;  // the awaiter frees it
    else
      delete std::exchange(impl_, nullptr);
  }
  detail::prepared_impl* impl_ = nullptr;
};

class connection {
 public:
  connection() noexcept;
  explicit connection(std::unique_ptr<detail::connection_impl> impl) noexcept;
  connection(connection&&) noexcept;
  connection& operator=(connection&&) noexcept;
  ~connection();  // aborts: pending operations fail (errc::disconnected); see "Lifetimes" above

  // Two-sided. `msg` may be any memory: it is sent from a live
  // memory_region of the user's that covers it, or, when small, inline;
  // other memory is never registered beyond the operation (verbs: copied
  // into a registered staging slot, or registered for this operation
  // alone; docs/memory-registration.md). At most max_message_size() bytes.
  //
  // A send completes once `msg` may be reused. On verbs a send of at most
  // max_inline_data bytes goes inline (copied into the work request) and
  // completes as soon as it is posted, a larger one when the peer's NIC has
  // acknowledged it; on tcp, when the peer's provider has. A send that
  // fails after it completed (the peer died) fails the connection: pending
  // and later operations fail, and close() returns errc::disconnected.
  // close() delivers completed inline sends before it disconnects; the
  // destructor (an abort) may drop those the NIC has not sent yet.
  //
  // Each single operation returns a connection_op<T> (connection_op.hpp):
  // co_await it for a result<T>, or pass it to when_all / when_any /
  // with_timeout, or convert it to task<result<T>>. Awaited directly, it
  // keeps its state in the awaiting frame (no allocation on the fast path).
  connection_op<void> send(std::span<const std::byte> msg) {
    return {impl_.get(), ops_->send, detail::make_op_args(msg)};
  }
  // Concurrent recv() calls on one connection are served oldest first; a
  // cancelled one takes no message.
  connection_op<message> recv() { return {impl_.get(), ops_->recv, {}}; }

  // One-sided. Local memory: as send's (a read target is registered for the
  // operation alone unless a memory_region covers it).
  connection_op<void> write(std::span<const std::byte> local, remote_buffer remote) {
    return {impl_.get(), ops_->write, detail::make_op_args(local, remote)};
  }
  connection_op<void> write_with_imm(std::span<const std::byte> local, remote_buffer remote, std::uint32_t imm) {
    return {impl_.get(), ops_->write_with_imm, detail::make_op_args(local, remote, imm)};
  }
  connection_op<void> read(std::span<std::byte> local, remote_buffer remote) {
    return {impl_.get(), ops_->read, detail::make_op_args(local, remote)};
  }
  // 8-byte aligned remote word; both return the value found there before.
  connection_op<std::uint64_t> compare_and_swap(remote_buffer remote, std::uint64_t expected, std::uint64_t desired) {
    return {impl_.get(), ops_->compare_and_swap, detail::make_op_args({}, remote, 0, expected, desired)};
  }
  connection_op<std::uint64_t> fetch_and_add(remote_buffer remote, std::uint64_t add) {
    return {impl_.get(), ops_->fetch_and_add, detail::make_op_args({}, remote, 0, add)};
  }

  // A batch: the operations are posted in order as one unit and the task
  // completes when all of them have (RC order: they are performed in order,
  // as if issued one after the other). Local memory as for the single
  // operations; the spans (and `ops` itself) must stay valid until the task
  // completes.
  //  - verbs: one ibv_post_send of a chained work-request list with only the
  //    last WR signaled (selective signaling), inline where small. Unsignaled
  //    WRs still hold send-queue slots until that completion, so the batch
  //    takes one slot per operation and returns them all at its completion.
  //    When slots or credits (send / write_with_imm use one each) are short,
  //    the batch is posted in chunks: as many operations as are free at that
  //    moment (at most send_queue_depth), each chunk signaled at its end;
  //    the batch waits for more only while holding none, so batches cannot
  //    deadlock each other or against a peer that keeps some messages.
  //    Concurrent batches and single operations interleave only at chunk
  //    boundaries.
  //  - tcp: the frames of a chunk go to the socket together (one writev) and
  //    the peer's cumulative acknowledgement completes them.
  // Errors: arguments are checked before anything is posted (an oversize
  // send: errc::message_too_long, nothing done; an empty batch succeeds at
  // once). A failing operation fails the batch with that operation's error
  // (the first failing one: e.g. errc::remote_access_error), the operations
  // before it have been performed, the later ones are not, and the
  // connection goes to the error state (RC rules). Cancellation as for one
  // operation: a batch still waiting for slots or credits with nothing
  // posted is cancelled alone; once anything is posted, the connection goes
  // to the error state and the task resumes when no buffer is touched any
  // more.
  task<result<void>> post_batch(std::span<const operation> ops);

  // Block-list transfers (the KV-cache workload: thousands of small blocks
  // between two regions, as one awaitable). Each block of `blocks` moves
  // [local_offset, +length) of `local` to [remote_offset, +length) of
  // `remote` (read_blocks: the other way); `local`, `blocks` and the memory
  // must stay valid until the task completes. One result for the list.
  //  - Checks first, nothing posted when one fails, reported with the
  //    block's index: length 0 (std::errc::invalid_argument), not inside
  //    `local` or not inside `remote` (std::errc::result_out_of_range). An
  //    empty list succeeds at once.
  //  - Blocks that follow each other in both memories (block i+1 starts
  //    where block i ends, locally and remotely) are merged into one
  //    operation (at most 1 GiB each).
  //  - The operations go through post_batch, or a provider's list path with
  //    the same results: chains cut to fit the send queue, only the last of
  //    each chain signaled (verbs), list frames cut likewise, one writev per
  //    chain (tcp; local: on the peer's shared regions a memcpy per run of
  //    adjacent blocks); options.notify turns the last one into a
  //    write_with_imm, so the peer's message arrives after every block.
  //  - Errors, cancellation: post_batch's. A failure fails the whole list
  //    (never a silent partial success); blocks before the failing one have
  //    been transferred, later ones not, and failed_block() names the first
  //    block of the failing operation (verbs: from the failed work request's
  //    own completion; block_result::unknown where only a flush or a failed
  //    post says so; a connection already failed: block 0,
  //    errc::disconnected).
  task<block_result> write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                  std::span<const block> blocks, block_options options = {});
  task<block_result> read_blocks(std::span<std::byte> local, remote_buffer remote, std::span<const block> blocks);

  // One operation (as a batch's: send, write, write_with_imm, read) built
  // once, to be started many times: see prepared_operation. The arguments
  // are checked now (an oversize send: errc::message_too_long) and local
  // memory no memory_region covers is registered for the prepared
  // operation's life (the memory must outlive it).
  // errc::disconnected for a connection without a provider.
  result<prepared_operation> prepare(const operation& op);

  // Exposes [offset, offset+len) of `r` (a registration of this
  // connection's domain) to this connection's peer only, with `rights` (a
  // non-empty set of access::remote_write / remote_read / remote_atomic,
  // all of which `r` must hold): see memory_grant. Errors:
  // std::errc::invalid_argument (no registration, one of another domain,
  // len 0, rights empty or not remote ones), std::errc::result_out_of_range
  // (the range is not inside `r`), std::errc::permission_denied (rights `r`
  // lacks), errc::not_supported (a device without type 2 memory windows),
  // errc::disconnected (the connection failed or was closed).
  task<result<memory_grant>> grant(const memory_region& r, std::size_t offset, std::size_t len, unsigned rights);
  // Takes a grant of this connection back. When it completes, the peer's
  // accesses through the grant fail (errc::remote_access_error) and none
  // is still touching the memory (verbs: the IBV_WR_LOCAL_INV has
  // completed; tcp: no access through it is in progress in the reader).
  // Revoking one already revoked (or whose connection failed) succeeds;
  // std::errc::invalid_argument for an empty grant or one of another
  // connection. Cancelled, the grant is revoked all the same, but accesses
  // may still be in progress (std::errc::operation_canceled). On tcp a peer
  // that stops sending in the middle of a write's payload holds its access
  // in progress: bound the wait (with_timeout) and destroy the connection.
  task<result<void>> revoke(memory_grant& g);

  // Graceful disconnect: waits for what is in flight (inline sends
  // included), then tells the peer; errc::disconnected if the connection
  // failed first.
  task<result<void>> close();

  bool is_open() const noexcept;
  transport_kind kind() const noexcept;
  std::size_t max_message_size() const noexcept;
  endpoint remote_endpoint() const noexcept;
  // What the peer sent with its handshake (connection_options::payload): on
  // an accepted connection the connecting peer's, on a connected one the
  // listener's answer; empty if it sent none. Valid as long as the
  // connection object (not moved from).
  std::span<const std::byte> peer_payload() const noexcept;
  // shuttle, or plain for a connection made or accepted as one (wire_protocol).
  wire_protocol protocol() const noexcept;

 private:
  std::unique_ptr<detail::connection_impl> impl_;
  const detail::launch_table* ops_;  // impl_'s, or no_connection_ops
};

class listener {
 public:
  listener() noexcept;
  explicit listener(std::unique_ptr<detail::listener_impl> impl) noexcept;
  listener(listener&&) noexcept;
  listener& operator=(listener&&) noexcept;
  ~listener();

  task<result<connection>> accept();
  // Where it listens (port 0 bound: the port chosen), as
  // tcp_listener::local_endpoint: std::errc::bad_file_descriptor for no
  // listener (default, moved from) or a closed one.
  result<endpoint> local_endpoint() const;
  void close() noexcept;

 private:
  std::unique_ptr<detail::listener_impl> impl_;
};

struct domain_options {
  transport_kind kind = transport_kind::automatic;  // SHUTTLE_TRANSPORT overrides automatic
  // automatic only: peers on this host through the local provider (see
  // domain::open). false, or SHUTTLE_AUTO_LOCAL=0 in the environment: every
  // peer through verbs or tcp.
  bool local_peers = true;
  std::string device;                               // verbs: "rxe0"; empty: the first active one
  int gid_index = -1;                               // verbs: -1 finds the RoCE v2 IPv4-mapped GID
};

// A protection domain of one provider, owned by one io_context's thread.
class domain {
 public:
  // automatic: verbs when an active RDMA device exists, else tcp, for
  // remote peers, and the local provider for peers on this host
  // (lib/auto_provider/README.md): connect() to an address of this host
  // (loopback, or one of its interfaces) takes the local provider when the
  // peer's listener is an automatic one, else (no such listener, or its
  // local handshake fails within half of connect_timeout) the remote
  // provider; listen() on an IP endpoint listens on both. One registration
  // serves both: a region's rkey is the same for every peer.
  // connection::kind() says which provider a connection took. On the
  // calling thread's io_context: errc::no_io_context on a thread without
  // one (as listen()).
  static result<domain> open(domain_options opts = {});

  // The provider for remote peers (automatic: verbs or tcp; connections to
  // peers on this host may be local: connection::kind()).
  transport_kind kind() const noexcept;
  std::string describe() const;

  // Registers memory for access by peers (and locally). On verbs each call
  // makes a new registration (tcp pins nothing and may serve a repeated
  // one from its cache). As with ibv_reg_mr, a memory_region (every copy of
  // it) must be destroyed before its memory is freed or unmapped: it pins
  // the pages mapped when it was made, and operations on memory it covers
  // use it.
  result<memory_region> register_memory(std::span<std::byte> mem, unsigned access_flags);

  task<result<connection>> connect(endpoint remote, connection_options opts = {});
  // The same, with `payload` (copied now) as opts.payload.
  task<result<connection>> connect(endpoint remote, std::span<const std::byte> payload, connection_options opts = {});
  result<listener> listen(endpoint local, connection_options opts = {}, listener_options limits = {});


 private:
  friend struct detail::impl_access;
  explicit domain(std::shared_ptr<detail::domain_impl> impl) noexcept : impl_(std::move(impl)) {}
  std::shared_ptr<detail::domain_impl> impl_;
};

}  // namespace shuttle
