// rdma_cm events (cm_events.hpp).
#include "cm_events.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

namespace shuttle::detail::verbs_impl {

cm_evt copy_event(const rdma_cm_event* e) {
  cm_evt c;
  c.type = e->event;
  c.status = e->status;
  c.id = e->id;
  if (e->id && e->id->ps == RDMA_PS_TCP) {
    c.initiator_depth = e->param.conn.initiator_depth;
    c.responder_resources = e->param.conn.responder_resources;
    if (e->param.conn.private_data && e->param.conn.private_data_len) {
      c.priv_len = std::min<std::size_t>(e->param.conn.private_data_len, c.priv.size());
      std::memcpy(c.priv.data(), e->param.conn.private_data, c.priv_len);
    }
  }
  return c;
}

std::error_code cm_error(const cm_evt& e) {
  switch (e.type) {
    case RDMA_CM_EVENT_REJECTED: return std::make_error_code(std::errc::connection_refused);
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR: return std::make_error_code(std::errc::host_unreachable);
    case RDMA_CM_EVENT_CONNECT_ERROR: return std::make_error_code(std::errc::connection_aborted);
    default: return make_error_code(errc::protocol_error);
  }
}

std::error_code hello_error(const cm_evt& e) {
  std::uint32_t magic = 0;
  if (e.priv_len >= sizeof magic) std::memcpy(&magic, e.priv.data(), sizeof magic);
  magic = ntohl(magic);
  if (magic == wire_magic) return make_error_code(errc::protocol_error);
  return make_error_code((magic >> 8) == (wire_magic >> 8) ? errc::wire_version_mismatch : errc::not_a_shuttle_peer);
}

}  // namespace shuttle::detail::verbs_impl
