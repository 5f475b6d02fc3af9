// Verbs pieces that exist with or without rdma-core: the 'verbs' error
// category and device listing.
#include <shuttle/verbs/verbs.hpp>

#include <endian.h>

#include <atomic>

#include <cstdio>
#include <cstring>

#ifdef SHUTTLE_HAVE_VERBS
#include "device.hpp"
#endif

namespace shuttle::verbs {

namespace {
class category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "verbs"; }
  std::string message(int c) const override {
#ifdef SHUTTLE_HAVE_VERBS
    return ibv_wc_status_str(static_cast<ibv_wc_status>(c));
#else
    return "work completion status " + std::to_string(c);
#endif
  }
  std::error_condition default_error_condition(int c) const noexcept override {
    switch (c) {
      case 10: return make_error_condition(errc::remote_access_error);     // IBV_WC_REM_ACCESS_ERR
      case 11: return make_error_condition(errc::remote_operation_error);  // IBV_WC_REM_OP_ERR
      case 5:                                                   // IBV_WC_WR_FLUSH_ERR
      case 12:                                                  // IBV_WC_RETRY_EXC_ERR
      case 13: return make_error_condition(errc::disconnected);            // IBV_WC_RNR_RETRY_EXC_ERR
      default: return {c, *this};
    }
  }
};
#ifdef SHUTTLE_HAVE_VERBS
static_assert(IBV_WC_REM_ACCESS_ERR == 10 && IBV_WC_REM_OP_ERR == 11 && IBV_WC_WR_FLUSH_ERR == 5 &&
              IBV_WC_RETRY_EXC_ERR == 12 && IBV_WC_RNR_RETRY_EXC_ERR == 13);
#endif
}  // namespace

const std::error_category& category() noexcept {
  static const category_impl c;
  return c;
}
std::error_code make_wc_error(int status) noexcept { return {status, category()}; }

// Constant-initialized: a GPU layer's static initializer may install hooks
// before any other code of this library has run.
std::atomic<const device_memory_hooks*> installed_hooks{nullptr};

const device_memory_hooks* set_device_memory_hooks(const device_memory_hooks* h) noexcept {
  return installed_hooks.exchange(h, std::memory_order_acq_rel);
}
const device_memory_hooks* installed_device_memory_hooks() noexcept {
  return installed_hooks.load(std::memory_order_acquire);
}

#ifdef SHUTTLE_HAVE_VERBS
result<std::vector<device_info>> list_devices() {
  std::vector<device_info> out;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) return out;  // no kernel support / no device: an empty list
  for (int i = 0; i < n; ++i) {
    device_info d;
    d.name = ibv_get_device_name(list[i]);
    char guid[32];
    std::uint64_t g = be64toh(ibv_get_device_guid(list[i]));
    std::snprintf(guid, sizeof guid, "%04x:%04x:%04x:%04x", unsigned(g >> 48) & 0xffff, unsigned(g >> 32) & 0xffff,
                  unsigned(g >> 16) & 0xffff, unsigned(g) & 0xffff);
    d.node_guid = guid;
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx) {
      ibv_device_attr a{};
      if (ibv_query_device(ctx, &a) == 0) {
        d.max_qp = a.max_qp;
        d.max_qp_wr = a.max_qp_wr;
        d.max_cq = a.max_cq;
        d.max_cqe = a.max_cqe;
        d.max_mr = a.max_mr;
        d.max_mr_size = a.max_mr_size;
        d.max_qp_rd_atom = a.max_qp_rd_atom;
        d.max_srq = a.max_srq;
        d.atomics = a.atomic_cap != IBV_ATOMIC_NONE;
        for (int p = 1; p <= a.phys_port_cnt; ++p) {
          ibv_port_attr pa{};
          if (ibv_query_port(ctx, static_cast<std::uint8_t>(p), &pa)) continue;
          port_info pi;
          pi.port = p;
          pi.active = pa.state == IBV_PORT_ACTIVE;
          pi.state = ibv_port_state_str(pa.state);
          pi.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
          pi.active_mtu = 128 << pa.active_mtu;
          const auto gids = detail::verbs_impl::port_gids(ctx, static_cast<std::uint8_t>(p), pa.gid_tbl_len);
          pi.ipv4_gid_index = detail::verbs_impl::ipv4_gid_index(gids);
          for (const auto& e : gids) {
            gid_info gin;
            gin.index = static_cast<int>(e.gid_index);
            gin.gid = detail::verbs_impl::gid_text(e.gid);
            gin.type = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2" : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? "RoCE v1" : "IB";
            gin.ipv4_mapped = detail::verbs_impl::ipv4_mapped(e.gid);
            pi.gids.push_back(std::move(gin));
          }
          d.ports.push_back(std::move(pi));
        }
      }
      ibv_close_device(ctx);
    }
    out.push_back(std::move(d));
  }
  ibv_free_device_list(list);
  return out;
}
#else
result<std::vector<device_info>> list_devices() { return std::vector<device_info>{}; }
#endif

std::string describe_devices() {
  auto r = list_devices();
  if (!r) return "device listing failed: " + r.error().message();
  if (r->empty()) return "no RDMA device";
  std::string s;
  for (auto& d : *r) {
    s += d.name + " (guid " + d.node_guid + ", max_qp_wr " + std::to_string(d.max_qp_wr) + ", max_cqe " +
         std::to_string(d.max_cqe) + (d.atomics ? ", atomics" : "") + ")\n";
    for (auto& p : d.ports) {
      s += "  port " + std::to_string(p.port) + ": " + p.state + ", " + p.link_layer + ", mtu " +
           std::to_string(p.active_mtu) + ", ipv4 gid index " + std::to_string(p.ipv4_gid_index) + "\n";
      for (auto& g : p.gids) s += "    gid[" + std::to_string(g.index) + "] " + g.gid + " " + g.type + "\n";
    }
  }
  return s;
}

}  // namespace shuttle::verbs
