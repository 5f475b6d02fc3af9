// Built when shuttle has no verbs provider: opening one says so.
#include "../transport/provider.hpp"
#include <shuttle/verbs/verbs.hpp>

namespace shuttle::detail {

result<std::shared_ptr<domain_impl>> make_verbs_domain(const domain_options&) {
  return make_error_code(errc::not_supported);
}

}  // namespace shuttle::detail

namespace shuttle::verbs {
result<void> set_busy_poll_budget(domain&, std::chrono::nanoseconds) { return make_error_code(errc::not_supported); }
result<domain_stats> stats(const domain&) { return make_error_code(errc::not_supported); }
result<void> limit_cq_entries(domain&, int) { return make_error_code(errc::not_supported); }
result<void> set_registration_cache(domain&, bool) { return make_error_code(errc::not_supported); }
std::error_code memory_monitor_status() noexcept { return make_error_code(errc::not_supported); }
result<memory_region> register_dmabuf(domain&, int, std::uint64_t, std::size_t, std::uint64_t, unsigned) {
  return make_error_code(errc::not_supported);
}
result<memory_region> register_device_memory(domain&, std::span<std::byte>, unsigned) {
  return make_error_code(errc::not_supported);
}
}  // namespace shuttle::verbs
