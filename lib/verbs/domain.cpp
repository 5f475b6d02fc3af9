// verbs_domain and make_verbs_domain; the shuttle::verbs free functions.
#include "listener.hpp"

namespace shuttle::detail {
namespace {

using namespace verbs_impl;

// ------------------------------------------------------------------ domain

class verbs_domain final : public domain_impl {
 public:
  explicit verbs_domain(std::shared_ptr<core> c) : c_(std::move(c)) {}
  transport_kind kind() const noexcept override { return transport_kind::verbs; }
  std::string describe() const override {
    return "verbs " + c_->name + " port " + std::to_string(c_->port) + " gid[" + std::to_string(c_->gid_index) +
           "] " + c_->gid_text;
  }
  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) override {
    return c_->register_memory(mem, flags);
  }
  task<result<connection>> connect(endpoint remote, connection_options opts) override {
    return do_connect(c_, remote, opts);
  }
  result<listener> listen(endpoint local, connection_options opts, listener_options limits) override {
    c_->attach();
    auto l = std::make_unique<verbs_listener>(c_, opts, limits);
    if (auto r = l->start(local); !r) return r.error();
    return listener(std::move(l));
  }
  core& get() noexcept { return *c_; }

 private:
  static task<result<connection>> do_connect(std::shared_ptr<core> c, endpoint remote, connection_options opts) {
    c->attach();
    auto st = std::make_shared<conn_state>(c, opts);
    if (auto r = st->init_channel(); !r) co_return r.error();
    if (rdma_create_id(st->ech, &st->id, st.get(), RDMA_PS_TCP) != 0) co_return last_errno();
    auto r = co_await with_timeout(connect_steps(st, remote), opts.connect_timeout);
    if (!r) {
      // Late once the request (our hello) was out: the peer did not finish the handshake.
      const bool requested = st->qp != nullptr;
      st->shutdown();
      if (r.error() == errc::operation_timeout)
        co_return requested ? make_error_code(errc::handshake_timeout) : std::make_error_code(std::errc::timed_out);
      co_return r.error();
    }
    co_return connection(std::make_unique<verbs_connection>(std::move(st)));
  }
  std::shared_ptr<core> c_;
};

}  // namespace

result<std::shared_ptr<domain_impl>> make_verbs_domain(const domain_options& opts) {
  auto pdh = std::make_shared<pd_holder>();
  int n = 0;
  pdh->devices = rdma_get_devices(&n);
  if (!pdh->devices || n == 0) return make_error_code(errc::not_supported);
  auto chosen = verbs_impl::choose_device(pdh->devices, n, opts.device, opts.gid_index);
  if (!chosen) return make_error_code(errc::not_supported);
  auto c = std::make_shared<core>();
  c->ctx = chosen->ctx;
  c->max_msg = chosen->max_msg;
  c->dattr = chosen->dattr;
  c->port = chosen->port;
  c->name = std::move(chosen->name);
  c->gid_index = chosen->gid_index;
  c->gid_text = std::move(chosen->gid);
  pdh->ctx = c->ctx;
  pdh->pd = ibv_alloc_pd(c->ctx);
  if (!pdh->pd) return last_errno();
  c->pdh = pdh;
  c->pd = pdh->pd;
  c->channel = ibv_create_comp_channel(c->ctx);
  if (!c->channel || !set_nonblock(c->channel->fd)) return last_errno();
  c->cq_size = std::min(c->dattr.max_cqe, 4096);
  c->cq = ibv_create_cq(c->ctx, c->cq_size, nullptr, c->channel, 0);
  if (!c->cq) return last_errno();
  c->cq_size = c->cq->cqe;
  c->cq_limit = c->dattr.max_cqe;
  if (auto* loop = io_context::current_or_null()) {
    (void)loop;
    c->attach();
  }
  return std::shared_ptr<domain_impl>(std::make_shared<verbs_domain>(std::move(c)));
}

}  // namespace shuttle::detail

namespace shuttle::verbs {

result<void> limit_cq_entries(domain& d, int max_entries) {
  auto* v = dynamic_cast<detail::verbs_domain*>(detail::impl_access::of(d));
  if (!v) return make_error_code(errc::not_supported);
  if (max_entries <= 0) return std::make_error_code(std::errc::invalid_argument);
  auto& c = v->get();
  c.cq_limit = std::min(max_entries, c.dattr.max_cqe);
  return {};
}

result<void> set_busy_poll_budget(domain& d, std::chrono::nanoseconds budget) {
  auto* v = dynamic_cast<detail::verbs_domain*>(detail::impl_access::of(d));
  if (!v) return make_error_code(errc::not_supported);
  v->get().budget = budget;
  return {};
}

result<domain_stats> stats(const domain& d) {
  auto* v = dynamic_cast<detail::verbs_domain*>(detail::impl_access::of(d));
  if (!v) return make_error_code(errc::not_supported);
  domain_stats st = v->get().st;
  if (const auto& pool = v->get().staging) st.staging_bytes = pool->registered_bytes();
  if (const auto& rc = v->get().rcache) {
    const auto c = rc->stats();
    st.registration_cache = true;
    st.cached_registrations = c.inserted;
    st.cache_invalidations = c.invalidated;
    st.cache_evictions = c.evicted;
    st.uncacheable_sources = c.unwatchable;
  } else {
    st.registration_cache = !v->get().rcache_decided && detail::verbs_impl::memory_monitor::instance();
  }
  return st;
}

std::error_code memory_monitor_status() noexcept { return detail::verbs_impl::memory_monitor::unavailable_reason(); }

result<void> set_registration_cache(domain& d, bool on) {
  auto* v = dynamic_cast<detail::verbs_domain*>(detail::impl_access::of(d));
  if (!v) return make_error_code(errc::not_supported);
  auto& c = v->get();
  c.rcache_decided = true;
  if (!on) {
    c.rcache.reset();
    return {};
  }
  if (c.rcache) return {};
  auto* m = detail::verbs_impl::memory_monitor::instance();
  if (!m) return detail::verbs_impl::memory_monitor::unavailable_reason();
  c.rcache = std::make_unique<detail::verbs_impl::registration_cache>(*m);
  return {};
}

result<memory_region> register_device_memory(domain& d, std::span<std::byte> mem, unsigned access_flags) {
  auto* v = dynamic_cast<detail::verbs_domain*>(detail::impl_access::of(d));
  if (!v) return make_error_code(errc::not_supported);
  return v->get().register_device_memory(mem, access_flags);
}

result<memory_region> register_dmabuf(domain& d, int fd, std::uint64_t offset, std::size_t length,
                                      std::uint64_t iova, unsigned access_flags) {
  auto* v = dynamic_cast<detail::verbs_domain*>(detail::impl_access::of(d));
  if (!v) return make_error_code(errc::not_supported);
#ifdef SHUTTLE_HAVE_VERBS_DMABUF
  return v->get().register_dmabuf(fd, offset, length, iova, access_flags);
#else
  (void)fd, (void)offset, (void)length, (void)iova, (void)access_flags;
  return make_error_code(errc::not_supported);
#endif
}

}  // namespace shuttle::verbs
