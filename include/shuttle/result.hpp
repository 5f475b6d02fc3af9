// result<T>: a value or a std::error_code. Every I/O operation returns one, so
// hot paths never throw; value() throws std::system_error for callers who
// prefer exceptions.
#pragma once

#include <string>
#include <system_error>
#include <optional>
#include <type_traits>
#include <utility>
#include <cerrno>

namespace shuttle {

namespace detail {
// An error_code as stored in a result: a null category means "no error", so
// that a successful result is built and tested without touching
// std::system_category() (a call into libstdc++ per default error_code,
// several per operation on the hot paths).
class stored_error {
 public:
  stored_error() noexcept = default;
  stored_error(std::error_code ec) noexcept : value_(ec.value()), category_(ec ? &ec.category() : nullptr) {}
  explicit operator bool() const noexcept { return category_ != nullptr; }
  std::error_code get() const noexcept { return category_ ? std::error_code(value_, *category_) : std::error_code(); }

 private:
  int value_ = 0;
  const std::error_category* category_ = nullptr;
};
}  // namespace detail

template <class T>
class [[nodiscard]] result {
  static_assert(!std::is_reference_v<T>, "result<T&> is not supported");

 public:
  using value_type = T;

  result() = default;  // an error-free empty result; value() on it is a bug
  result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  result(std::error_code ec) : error_(ec) {}      // NOLINT: implicit by design
  // The value built in place (no move: a provider's hot path hands over
  // what it received this way).
  template <class... A>
  explicit result(std::in_place_t, A&&... a) : value_(std::in_place, std::forward<A>(a)...) {}

  bool has_value() const noexcept { return !error_; }
  explicit operator bool() const noexcept { return has_value(); }
  std::error_code error() const noexcept { return error_.get(); }

  T& value() & { check(); return *value_; }
  const T& value() const& { check(); return *value_; }
  T&& value() && { check(); return std::move(*value_); }
  T& operator*() & noexcept { return *value_; }
  T&& operator*() && noexcept { return std::move(*value_); }
  T* operator->() noexcept { return &*value_; }
  const T* operator->() const noexcept { return &*value_; }

 private:
  void check() const {
    if (error_) throw std::system_error(error_.get());
  }
  std::optional<T> value_{};
  detail::stored_error error_{};
};

template <>
class [[nodiscard]] result<void> {
 public:
  result() = default;
  result(std::error_code ec) : error_(ec) {}  // NOLINT: implicit by design
  bool has_value() const noexcept { return !error_; }
  explicit operator bool() const noexcept { return has_value(); }
  std::error_code error() const noexcept { return error_.get(); }
  void value() const {
    if (error_) throw std::system_error(error_.get());
  }

 private:
  detail::stored_error error_{};
};

// errno value -> error_code in the system category; but cancellation is
// always std::errc::operation_canceled in the generic category, as the
// library's own waits report it, whether the kernel (ECANCELED from the
// ring) or the library noticed the stop request.
inline std::error_code errno_code(int e) noexcept {
  if (e == ECANCELED) return std::make_error_code(std::errc::operation_canceled);
  return {e, std::system_category()};
}

// Throws std::system_error carrying errno and a description of what was tried.
[[noreturn]] void throw_errno(int e, const std::string& what);

}  // namespace shuttle
