// verbs_grant: connection::grant's memory windows.
#pragma once

#include "conn_state.hpp"

namespace shuttle::detail::verbs_impl {

// A memory_grant: a type 2 memory window bound on its connection's QP, to
// a registration of exactly the granted range (window_mr). That
// registration has no remote rights of its own (its rkey opens nothing) and
// its bounds are the grant's: Soft-RoCE checks a window's key, QP and
// rights, but an access's bounds only against the registration under it.
struct verbs_grant final : grant_impl {
  std::shared_ptr<conn_state> conn;
  std::shared_ptr<verbs_region> region;  // the user's registration (the grant keeps it, as documented)
  ibv_mr* window_mr = nullptr;
  ibv_mw* mw = nullptr;
  remote_buffer granted{};
  bool bound = false;
  remote_buffer remote() const noexcept override { return bound ? granted : remote_buffer{}; }
  // Deallocating a bound window invalidates it; its registration goes after it.
  static void free_window(ibv_mw* mw, ibv_mr* mr) noexcept {
    if (mw) ibv_dealloc_mw(mw);
    if (mr) ibv_dereg_mr(mr);
  }
  void release() noexcept {
    bound = false;
    free_window(std::exchange(mw, nullptr), std::exchange(window_mr, nullptr));
  }
  ~verbs_grant() override {
    release();
    std::erase(conn->grants, this);
  }
};

}  // namespace shuttle::detail::verbs_impl
