// An automatic listener: the remote provider's listener on the IP endpoint
// and the local provider's on local_name(port), behind one accept().
//
// accept() waits on both children at once (when_any). A child's accept that
// completes is never lost, even when it loses the race or the caller is
// cancelled: it lands in `ready`, which the next accept() takes first. So
// at most one connection per child per waiting accept() is held here.
#include "auto_provider.hpp"

#include <shuttle/when_any.hpp>

#include <array>
#include <deque>

namespace shuttle::detail::auto_provider {

namespace {

struct listener_core {
  std::array<listener, 2> child;         // 0: remote provider, 1: local provider
  std::array<std::error_code, 2> failed;  // a child's own failure: it is not waited on again
  std::deque<connection> ready;
  bool closed = false;

  void close() noexcept {
    if (closed) return;
    closed = true;
    for (auto& l : child) l.close();
    ready.clear();  // accepted, never taken: aborted here
  }

  static task<void> take(std::shared_ptr<listener_core> c, int i) {
    auto r = co_await c->child[i].accept();
    if (c->closed) co_return;  // a connection got meanwhile closes here
    if (r) c->ready.push_back(std::move(*r));
    else if (r.error() != std::errc::operation_canceled) c->failed[i] = r.error();
  }
};

class auto_listener final : public listener_impl {
 public:
  auto_listener(listener remote, listener local) : c_(std::make_shared<listener_core>()) {
    c_->child[0] = std::move(remote);
    c_->child[1] = std::move(local);
  }
  ~auto_listener() override { c_->close(); }

  task<result<connection>> accept() override { return accept_impl(c_); }
  endpoint local_endpoint() const override {
    if (c_->closed) return {};
    auto e = c_->child[0].local_endpoint();
    return e ? *e : endpoint{};
  }
  void close() noexcept override { c_->close(); }

 private:
  static task<result<connection>> accept_impl(std::shared_ptr<listener_core> c) {
    for (;;) {
      if (!c->ready.empty()) {
        connection conn = std::move(c->ready.front());
        c->ready.pop_front();
        co_return conn;
      }
      if (c->closed) co_return std::make_error_code(std::errc::bad_file_descriptor);
      const auto before = c->failed;
      if (before[0] && before[1]) co_return before[0];
      if (!before[0] && !before[1])
        co_await when_any(listener_core::take(c, 0), listener_core::take(c, 1));
      else
        co_await listener_core::take(c, before[0] ? 1 : 0);
      if (!c->ready.empty()) continue;
      if ((co_await get_stop_token()).stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
      // A child that failed now reports it once; later accepts wait on the other.
      for (int i = 0; i < 2; ++i)
        if (c->failed[i] && !before[i]) co_return c->failed[i];
    }
  }

  std::shared_ptr<listener_core> c_;
};

}  // namespace

listener make_listener(listener remote, listener local) {
  return listener(std::make_unique<auto_listener>(std::move(remote), std::move(local)));
}

}  // namespace shuttle::detail::auto_provider
