// std::error_code (shuttle's results) <-> boost::system::error_code (Asio's
// handlers).
//
// Errno values (std's system and generic categories) become Boost's system
// category, so a cancelled shuttle operation compares equal to
// asio::error::operation_aborted and a reset to asio::error::connection_reset,
// exactly like Asio's own operations. Other categories (shuttle::errc,
// provider categories) are wrapped in a Boost category that forwards name,
// message and equivalence to the std one; from_boost undoes the wrapping.
#pragma once

#include <shuttle/asio/config.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>

#include <boost/system/error_code.hpp>

namespace shuttle::asio {

namespace detail {

class wrapped_std_category final : public boost::system::error_category {
 public:
  explicit wrapped_std_category(const std::error_category& c) noexcept : std_(c) {}
  const char* name() const noexcept override { return std_.name(); }
  std::string message(int ev) const override { return std_.message(ev); }
  boost::system::error_condition default_error_condition(int ev) const noexcept override {
    std::error_condition c = std_.default_error_condition(ev);
    if (c.category() == std::generic_category()) return {c.value(), boost::system::generic_category()};
    return {ev, *this};
  }
  const std::error_category& std_category() const noexcept { return std_; }

 private:
  const std::error_category& std_;
};

inline const boost::system::error_category& wrap_category(const std::error_category& c) {
  // A handful of categories per process: a locked map, entries never freed.
  static std::mutex m;
  static std::map<const std::error_category*, std::unique_ptr<wrapped_std_category>> wrapped;
  std::lock_guard lock(m);
  auto& slot = wrapped[&c];
  if (!slot) slot = std::make_unique<wrapped_std_category>(c);
  return *slot;
}

}  // namespace detail

inline boost::system::error_code to_boost(const std::error_code& ec) {
  if (!ec) return {};
  const auto& cat = ec.category();
  if (cat == std::system_category() || cat == std::generic_category())
    return {ec.value(), boost::system::system_category()};
  return {ec.value(), detail::wrap_category(cat)};
}

inline std::error_code from_boost(const boost::system::error_code& ec) {
  if (!ec) return {};
  const auto& cat = ec.category();
  if (cat == boost::system::system_category()) return {ec.value(), std::system_category()};
  if (cat == boost::system::generic_category()) return {ec.value(), std::generic_category()};
  if (auto* w = dynamic_cast<const detail::wrapped_std_category*>(&cat)) return {ec.value(), w->std_category()};
  return ec;  // Boost's own std interoperability (Asio's misc/netdb categories)
}

}  // namespace shuttle::asio
