// transport_kind::automatic's domain: a remote provider (verbs or tcp) and
// the local provider, side by side (README.md).
#include "auto_provider.hpp"

#include <shuttle/timer.hpp>

#include <algorithm>

namespace shuttle::detail::auto_provider {

namespace {

// One registration in each provider, with one rkey: the local one is made
// with the remote one's key, so that memory_region::remote() serves a peer
// of either kind. A grant asks for the child of its connection's provider.
struct auto_region final : region_impl {
  memory_region remote, local;
  const memory_region* child(transport_kind k) const noexcept override {
    return k == transport_kind::local ? &local : &remote;
  }
};

class auto_domain final : public domain_impl {
 public:
  auto_domain(std::shared_ptr<domain_impl> remote, std::shared_ptr<domain_impl> local) noexcept
      : remote_(std::move(remote)), local_(std::move(local)) {}

  transport_kind kind() const noexcept override { return remote_->kind(); }
  std::string describe() const override {
    return "auto: local provider for peers on this host, " + remote_->describe() + " for the others";
  }
  domain_impl* provider() noexcept override { return remote_.get(); }

  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) override {
    auto r = remote_->register_memory(mem, flags);
    if (!r) return r.error();
    // One rkey for both only where peers may use it: a device may issue no
    // remote key for local-only memory (rxe gives 0), and a local-only
    // region's key is never sent to anyone.
    constexpr unsigned remote_access = access::remote_write | access::remote_read | access::remote_atomic;
    auto l = (flags & remote_access) ? register_local_with_key(*local_, mem, flags, r->rkey())
                                     : local_->register_memory(mem, flags);
    if (!l) return l.error();
    auto a = std::make_shared<auto_region>();
    a->addr = mem.data();
    a->length = mem.size();
    a->access = flags;
    a->lkey = r->lkey();
    a->rkey = r->rkey();
    a->remote = std::move(*r);
    a->local = std::move(*l);
    return memory_region(std::move(a));
  }

  task<result<connection>> connect(endpoint remote, connection_options opts) override {
    if (remote.family() == AF_UNIX) return local_->connect(remote, std::move(opts));
    // Plain RC (verbs) and shared receive queues have no local counterpart;
    // nor has a peer elsewhere.
    if (opts.protocol != wire_protocol::shuttle || opts.shared_receive_queue || !same_host(remote))
      return remote_->connect(remote, std::move(opts));
    return connect_here(remote_, local_, remote, std::move(opts));
  }

  result<listener> listen(endpoint local, connection_options opts, listener_options limits) override {
    if (local.family() == AF_UNIX) return local_->listen(local, opts, limits);
    // Options only the remote provider has: its listener alone (local
    // clients then fall back to it at once: no local socket answers).
    if (opts.protocol != wire_protocol::shuttle || opts.shared_receive_queue) return remote_->listen(local, opts, limits);
    // Port 0: the remote provider picks the port; when its local name is
    // taken (another automatic listener of this host on that port, for
    // another address), another port.
    constexpr int attempts = 16;
    for (int i = 0; i < attempts; ++i) {
      auto r = remote_->listen(local, opts, limits);
      if (!r) return r.error();
      auto bound = r->local_endpoint();
      if (!bound) return bound.error();
      auto l = local_->listen(local_name(bound->port()), opts, limits);
      if (l) return make_listener(std::move(*r), std::move(*l));
      if (l.error() != std::errc::address_in_use || local.port() != 0) return l.error();
    }
    return std::make_error_code(std::errc::address_in_use);
  }

 private:
  // A peer on this host: its automatic listener's local socket first, for
  // at most half of connect_timeout; on any failure (no such listener: at
  // once; a listener that is not one, or is slow or hostile: by then) the
  // remote provider, for what is left. Cancellation is not a failure.
  static task<result<connection>> connect_here(std::shared_ptr<domain_impl> remote,
                                               std::shared_ptr<domain_impl> local, endpoint ep,
                                               connection_options opts) {
    using std::chrono::milliseconds;
    const auto start = shuttle::clock::now();
    const auto total = std::max(opts.connect_timeout, milliseconds(2));
    auto lo = opts;
    lo.connect_timeout = total / 2;
    auto c = co_await with_timeout(connect_local_as(*local, ep, local_name(ep.port()), std::move(lo)),
                                   total / 2 + milliseconds(1));
    if (c) co_return std::move(*c);
    if ((co_await get_stop_token()).stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
    const auto spent = std::chrono::duration_cast<milliseconds>(shuttle::clock::now() - start);
    opts.connect_timeout = std::max(total - spent, milliseconds(1));
    co_return co_await remote->connect(ep, std::move(opts));
  }

  std::shared_ptr<domain_impl> remote_, local_;
};

}  // namespace

}  // namespace shuttle::detail::auto_provider

namespace shuttle::detail {

result<std::shared_ptr<domain_impl>> make_auto_domain(std::shared_ptr<domain_impl> remote,
                                                      std::shared_ptr<domain_impl> local) {
  if (!remote || !local || local->kind() != transport_kind::local)
    return std::make_error_code(std::errc::invalid_argument);
  return std::shared_ptr<domain_impl>(std::make_shared<auto_provider::auto_domain>(std::move(remote), std::move(local)));
}

}  // namespace shuttle::detail
