// A local-provider connection's grants (connection::grant): as the tcp
// provider's, per-connection keys in the engine's grant table, checked by
// the target's reader. Accesses through a grant always go through the
// socket: a grant's key is never answered on the service channel, so that
// revoke() knows every access in progress.
#include "connection.hpp"

namespace shuttle::detail::local_provider {

namespace {

struct local_grant final : grant_impl {
  std::shared_ptr<tp::domain_state> dom;
  std::shared_ptr<tp::grant_entry> e;
  remote_buffer remote() const noexcept override {
    if (e->revoked) return {};
    return {reinterpret_cast<std::uint64_t>(e->addr), e->rkey, e->length};
  }
  ~local_grant() override { dom->drop_grant(*e); }
};

task<result<memory_grant>> ready(result<memory_grant> r) { co_return r; }

task<result<void>> wait_unused(std::shared_ptr<tp::grant_entry> e) {
  while (e->in_use > 0)
    if (auto r = co_await e->idle.wait(); !r) co_return r.error();
  co_return result<void>{};
}

}  // namespace

local_connection::~local_connection() {
  for (auto& g : grants_) s_->dom->drop_grant(*g);
}

task<result<memory_grant>> local_connection::grant(const memory_region& r, std::size_t offset, std::size_t len,
                                                   unsigned rights) {
  return ready(make_grant(r, offset, len, rights));
}

task<result<void>> local_connection::revoke(grant_impl& g) {
  auto e = static_cast<local_grant&>(g).e;
  s_->dom->drop_grant(*e);
  return wait_unused(std::move(e));
}

result<memory_grant> local_connection::make_grant(const memory_region& r, std::size_t offset, std::size_t len,
                                                  unsigned rights) {
  if (auto c = check_grant(r, offset, len, rights); !c) return c.error();
  auto region = std::dynamic_pointer_cast<local_region>(impl_access::of(r));
  if (!region || region->dom != x_.dom) return std::make_error_code(std::errc::invalid_argument);
  if (s_->state() != tp::conn_state::phase::open) return make_error_code(errc::disconnected);
  auto e = std::make_shared<tp::grant_entry>();
  e->conn = s_.get();
  e->region = region->engine;
  e->addr = region->addr + offset;
  e->length = len;
  e->access = rights;
  auto key = s_->dom->new_key();
  if (!key) return key.error();
  e->rkey = *key;
  s_->dom->grants[e->rkey] = e;
  std::erase_if(grants_, [](const auto& g) { return g->revoked; });
  grants_.push_back(e);
  auto g = std::make_unique<local_grant>();
  g->owner = this;
  g->dom = s_->dom;
  g->e = std::move(e);
  return memory_grant(std::move(g));
}

connection make_local_connection(std::shared_ptr<tp::conn_state> s) {
  tp::spawn_in(s->tasks, service_loop(s), s->stop.get_token());
  return connection(std::make_unique<local_connection>(std::move(s)));
}

}  // namespace shuttle::detail::local_provider
