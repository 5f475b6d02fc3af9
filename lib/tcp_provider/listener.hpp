// The tcp provider's listener (internal; listener.cpp).
#pragma once

#include "domain_state.hpp"

#include "../transport/provider.hpp"
#include <shuttle/tcp.hpp>

#include <functional>
#include <memory>

namespace shuttle::detail::tcp_provider {

struct conn_state;

// What a provider built on this engine (lib/local_provider) puts in place of
// the tcp provider's own set-up: its handshake (which runs tcp's hello
// exchange) and the connection object for an established conn_state. Null:
// the tcp provider's.
struct engine_hooks {
  std::function<task<result<std::shared_ptr<conn_state>>>(tcp_socket& sock, std::shared_ptr<domain_state> dom,
                                                          connection_options opts)>
      handshake;
  std::function<connection(std::shared_ptr<conn_state> s)> make;
};

// A listener on the bound socket `l`; see listener_options for its limits.
std::unique_ptr<listener_impl> make_listener(tcp_listener l, std::shared_ptr<domain_state> dom,
                                             connection_options opts, listener_options limits,
                                             engine_hooks hooks = {});

}  // namespace shuttle::detail::tcp_provider
