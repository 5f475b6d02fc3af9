// rdma_cm events and what the two sides tell each other through them: the
// hello in the private data of the request and the reply, a listener's
// reasons for a reject, and the errors an event means.
#pragma once

#include <shuttle/error.hpp>
#include <shuttle/transport.hpp>

#include <rdma/rdma_cma.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <system_error>

namespace shuttle::detail::verbs_impl {

constexpr std::uint32_t wire_magic = 0x53485632u;    // "SHV2"
constexpr std::uint32_t reject_magic = 0x53485252u;  // "SHRR": a reject's private data (reject_reason)

// An event, copied so that it can be acked at once.
struct cm_evt {
  rdma_cm_event_type type{};
  int status = 0;
  rdma_cm_id* id = nullptr;
  std::uint8_t initiator_depth = 0, responder_resources = 0;
  std::array<std::uint8_t, 64> priv{};
  std::size_t priv_len = 0;
};
cm_evt copy_event(const rdma_cm_event* e);

// What each side tells the other in the CM private data (network order).
struct wire_hello {
  std::uint32_t magic;
  std::uint32_t max_slots;      // user receives it may ever have posted: the cap on credits outstanding
  std::uint32_t initial_slots;  // user receives posted now (the initial credits), 1..max_slots
  std::uint32_t buffer_size;    // largest message accepted, >= 1
};

// The private data of a REQ (connect) or REP (accept): the hello, then a
// length byte and connection_options::payload. A peer that sends no
// payload (or 16 bytes only) is read as having sent an empty one: the CM
// pads private data with zeros.
struct wire_hello_payload {
  wire_hello hello;
  std::uint8_t payload_len;  // <= max_connect_payload
  std::uint8_t payload[max_connect_payload];
};
constexpr std::size_t hello_payload_offset = sizeof(wire_hello);
// REQ private data on IB/RoCE (rdma_cm's header takes 36 of the CM's 92).
static_assert(hello_payload_offset + 1 + max_connect_payload <= 56);

// Why a listener rejected a request: the reject's private data is
// {reject_magic, reason} in network order.
enum class reject_reason : std::uint32_t {
  too_many_handshakes = 1,  // listener_options::max_handshakes
  backlog_full = 2,         // listener_options::accept_backlog
  too_many_connections = 3, // listener_options::max_connections
  bad_hello = 4,            // the request's private data is not a hello this side can honour
  no_resources = 5,         // QP, CQ entries or receive buffers could not be had
  bad_payload = 7,          // a payload length byte past max_connect_payload or the private data
  // 6 is not used: a handshake past listener_options::handshake_timeout has
  // had its REP, and its REJ carries no reason (see check_deadlines).
};

// The error a failed connection step's event means.
std::error_code cm_error(const cm_evt& e);

// Why the REP's private data is no hello this side takes: none or another
// protocol's (a plain rdma_cm peer), another wire version's ("SHV" and
// another digit), or a shuttle hello this side cannot honour.
std::error_code hello_error(const cm_evt& e);

}  // namespace shuttle::detail::verbs_impl
