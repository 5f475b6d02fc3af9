// Device, port and GID selection (device.hpp).
#include "device.hpp"

#include <arpa/inet.h>

#include <cstring>

namespace shuttle::detail::verbs_impl {

std::string gid_text(const ibv_gid& g) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, g.raw, buf, sizeof buf);
  return buf;
}

bool ipv4_mapped(const ibv_gid& g) noexcept {
  static const std::uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g.raw, prefix, 12) == 0;
}

std::vector<ibv_gid_entry> port_gids(ibv_context* ctx, std::uint8_t port, int table_len) {
  std::vector<ibv_gid_entry> out;
  for (int gi = 0; gi < table_len && gi < 256; ++gi) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, port, static_cast<std::uint32_t>(gi), &e, 0)) continue;
    ibv_gid z{};
    if (std::memcmp(&e.gid, &z, sizeof z) == 0) continue;
    e.gid_index = static_cast<std::uint32_t>(gi);  // whatever the provider filled in
    out.push_back(e);
  }
  return out;
}

int ipv4_gid_index(const std::vector<ibv_gid_entry>& gids) noexcept {
  for (const auto& e : gids)
    if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && ipv4_mapped(e.gid)) return static_cast<int>(e.gid_index);
  return -1;
}

std::optional<choice> choose_device(ibv_context** devices, int n, const std::string& device, int gid_index) {
  for (int i = 0; i < n; ++i) {
    ibv_context* ctx = devices[i];
    if (!device.empty() && device != ibv_get_device_name(ctx->device)) continue;
    ibv_device_attr a{};
    if (ibv_query_device(ctx, &a) != 0) continue;
    for (int p = 1; p <= a.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, static_cast<std::uint8_t>(p), &pa) != 0 || pa.state != IBV_PORT_ACTIVE) continue;
      choice c;
      c.ctx = ctx;
      c.dattr = a;
      c.port = static_cast<std::uint8_t>(p);
      c.max_msg = pa.max_msg_sz;
      c.name = ibv_get_device_name(ctx->device);
      c.gid_index = gid_index >= 0 ? gid_index : ipv4_gid_index(port_gids(ctx, c.port, pa.gid_tbl_len));
      if (c.gid_index < 0) c.gid_index = 0;
      ibv_gid gid{};
      if (ibv_query_gid(ctx, c.port, c.gid_index, &gid) == 0) c.gid = gid_text(gid);
      return c;
    }
  }
  return std::nullopt;
}

}  // namespace shuttle::detail::verbs_impl
