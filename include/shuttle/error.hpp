// shuttle's own error codes (category "shuttle"). System errors stay in
// std::system_category; transports add their own categories (verbs work
// completion status) where the source has one.
#pragma once

#include <string>
#include <system_error>

namespace shuttle {

enum class errc {
  eof = 1,              // the peer closed the stream before the expected bytes arrived
  protocol_error,       // a peer sent something the protocol does not allow
  remote_access_error,  // the target refused a one-sided access (rkey, bounds, rights)
  remote_operation_error,
  disconnected,         // the connection went down with the operation pending
  message_too_long,     // the message exceeds the receive buffer or the limit
  not_supported,
  peer_access_refused,  // this side refused a one-sided access by the peer (its rkey, bounds or rights)
  idle_timeout,         // nothing arrived from the peer for the listener's idle_timeout
  // The peer took the connection (TCP connected, or rdma_cm's request sent)
  // but did not complete shuttle's handshake within connect_timeout (or
  // the listener's handshake_timeout). Equivalent to std::errc::timed_out.
  handshake_timeout,
  // The peer answered with something other than shuttle's handshake:
  // another protocol listens there (or, verbs, a plain rdma_cm peer).
  // Equivalent to errc::protocol_error (matches()).
  not_a_shuttle_peer,
  // The peer speaks shuttle, another version of its wire protocol.
  // Equivalent to errc::protocol_error (matches()).
  wire_version_mismatch,
  // with_timeout: the operation did not finish in time and was cancelled.
  // Equivalent to std::errc::timed_out.
  operation_timeout,
  // Called on a thread without an io_context (domain::open, listen,
  // tcp_listener::bind): create one, or run inside a runtime.
  no_io_context,
  // GPU memory that no registration covers, passed to a verbs operation,
  // that the NIC cannot reach (no dma-buf export, no peer-memory module):
  // register it (cuda::gpu_registry) or copy it to host memory first.
  unregistered_device_memory,
};

const std::error_category& shuttle_category() noexcept;

inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), shuttle_category()}; }

// `ec == errc::x` compares codes strictly (same category and value). A
// provider may report its own code that means the same (a verbs work
// completion status REM_ACCESS_ERR is a remote_access_error): compare with
// the condition, or use matches(). The finer codes compare equal to the
// broader conditions they refine: handshake_timeout and operation_timeout
// to std::errc::timed_out (`ec == std::errc::timed_out` holds for both, and
// for a TCP connect that timed out), not_a_shuttle_peer and
// wire_version_mismatch to errc::protocol_error through matches().
inline std::error_condition make_error_condition(errc e) noexcept { return {static_cast<int>(e), shuttle_category()}; }
inline bool matches(const std::error_code& ec, errc e) noexcept { return ec == make_error_condition(e); }

}  // namespace shuttle

template <>
struct std::is_error_code_enum<shuttle::errc> : std::true_type {};
