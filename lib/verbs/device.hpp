// Device, port and GID selection, in one place for the device listing
// (verbs::list_devices) and the domain's choice (make_verbs_domain).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shuttle::detail::verbs_impl {

std::string gid_text(const ibv_gid& g);
bool ipv4_mapped(const ibv_gid& g) noexcept;

// The port's GID table entries that are set (of the first 256 indexes).
std::vector<ibv_gid_entry> port_gids(ibv_context* ctx, std::uint8_t port, int table_len);

// The index of the first RoCE v2 IPv4-mapped GID among `gids`, -1 if none:
// the one rdma_cm uses for an IPv4 address, the domain's default.
int ipv4_gid_index(const std::vector<ibv_gid_entry>& gids) noexcept;

struct choice {
  ibv_context* ctx = nullptr;
  ibv_device_attr dattr{};
  std::uint8_t port = 1;
  std::uint32_t max_msg = 0;  // the port's max_msg_sz
  int gid_index = 0;
  std::string name, gid;
};

// The first of `devices` (the one named `device`, if not empty) with an
// active port, and that port's GID `gid_index` if >= 0, else its
// ipv4_gid_index, else 0. None: no such device.
std::optional<choice> choose_device(ibv_context** devices, int n, const std::string& device, int gid_index);

}  // namespace shuttle::detail::verbs_impl
