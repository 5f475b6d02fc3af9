// A local-provider connection's grants (connection::grant): the tcp
// engine's, made on the engine's registration of the same memory, so they
// are per-connection keys in the engine's grant table, checked by the
// target's reader. Accesses through a grant always go through the socket:
// a grant's key is never answered on the service channel, so that revoke()
// knows every access in progress.
#include "connection.hpp"

namespace shuttle::detail::local_provider {

local_connection::~local_connection() {
  x_.dropped = true;
  x_.pulse();  // waiters in the lane wake (posted), see `dropped` and end
}

task<result<memory_grant>> local_connection::grant(const memory_region& r, std::size_t offset, std::size_t len,
                                                   unsigned rights) {
  if (auto c = check_grant(r, offset, len, rights); !c) co_return c.error();
  auto region = std::dynamic_pointer_cast<local_region>(impl_access::of(r));
  if (!region || region->dom != x_.dom) co_return std::make_error_code(std::errc::invalid_argument);
  if (!region->engine) co_return make_error_code(errc::not_supported);  // GPU memory: the engine cannot touch it
  auto g = co_await inner_.grant(memory_region(region->engine), offset, len, rights);
  if (g) impl_access::of(*g)->owner = this;  // revoked through this connection
  co_return g;
}

task<result<void>> local_connection::revoke(grant_impl& g) { return inner_.revoke(g); }

connection make_local_connection(std::shared_ptr<tp::conn_state> s) {
  tp::spawn_in(s->tasks, service_loop(s), s->stop.get_token());
  return connection(std::make_unique<local_connection>(std::move(s)));
}

}  // namespace shuttle::detail::local_provider
