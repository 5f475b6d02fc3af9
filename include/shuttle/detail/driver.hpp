// A minimal coroutine that runs a body to completion and then calls a
// completion function. run(), async_scope::spawn, when_all and when_any are
// built on it; the completion function returns what to resume next, so the
// last finishing child resumes its parent by symmetric transfer.
#pragma once

#include <coroutine>
#include <exception>
#include <stop_token>
#include <utility>

namespace shuttle::detail {

class driver_promise;

class driver {
 public:
  using promise_type = driver_promise;
  using handle_type = std::coroutine_handle<driver_promise>;

  driver() noexcept = default;
  explicit driver(handle_type h) noexcept : h_(h) {}
  driver(driver&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  driver& operator=(driver&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  ~driver() {
    if (h_) h_.destroy();
  }

  using done_fn = std::coroutine_handle<> (*)(void* arg) noexcept;

  // Sets what happens at the end; `self_destroy` frees the frame there (for
  // detached drivers) instead of in ~driver.
  inline void on_done(done_fn fn, void* arg, bool self_destroy) noexcept;
  inline void set_stop_token(std::stop_token t) noexcept;
  handle_type handle() const noexcept { return h_; }
  handle_type release() noexcept { return std::exchange(h_, {}); }
  void start() noexcept { h_.resume(); }

 private:
  handle_type h_{};
};

class driver_promise {
 public:
  driver get_return_object() noexcept { return driver{driver::handle_type::from_promise(*this)}; }
  std::suspend_always initial_suspend() const noexcept { return {}; }
  struct final_awaiter {
    bool await_ready() const noexcept { return false; }
    std::coroutine_handle<> await_suspend(driver::handle_type h) noexcept {
      auto& p = h.promise();
      auto fn = p.done_;
      void* arg = p.arg_;
      if (p.self_destroy_) h.destroy();
      return fn ? fn(arg) : std::noop_coroutine();
    }
    void await_resume() const noexcept {}
  };
  final_awaiter final_suspend() const noexcept { return {}; }
  // Driver bodies catch everything themselves; reaching here is a bug.
  void unhandled_exception() const noexcept { std::terminate(); }
  void return_void() const noexcept {}

  const std::stop_token& get_stop_token() const noexcept { return stop_; }

 private:
  friend class driver;
  std::stop_token stop_{};
  driver::done_fn done_ = nullptr;
  void* arg_ = nullptr;
  bool self_destroy_ = false;
};

inline void driver::on_done(done_fn fn, void* arg, bool self_destroy) noexcept {
  auto& p = h_.promise();
  p.done_ = fn;
  p.arg_ = arg;
  p.self_destroy_ = self_destroy;
}
inline void driver::set_stop_token(std::stop_token t) noexcept { h_.promise().stop_ = std::move(t); }

}  // namespace shuttle::detail
