// Placeholder until the tcp provider lands: opening it says so.
#include <shuttle/detail/transport_impl.hpp>

namespace shuttle::detail {

result<std::shared_ptr<domain_impl>> make_tcp_domain(const domain_options&) {
  return make_error_code(errc::not_supported);
}

}  // namespace shuttle::detail
