// The tcp provider's listener (internal; listener.cpp).
#pragma once

#include "domain_state.hpp"

#include "../transport/provider.hpp"
#include <shuttle/tcp.hpp>

#include <memory>

namespace shuttle::detail::tcp_provider {

// A listener on the bound socket `l`; see listener_options for its limits.
std::unique_ptr<listener_impl> make_listener(tcp_listener l, std::shared_ptr<domain_state> dom,
                                             connection_options opts, listener_options limits);

}  // namespace shuttle::detail::tcp_provider
