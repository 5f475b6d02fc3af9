// The local provider's names and listener (internal; listener.cpp).
#pragma once

#include "domain_state.hpp"

namespace shuttle::detail::local_provider {

// The Unix-domain socket an endpoint names (listener.cpp says how).
result<endpoint> socket_name(const endpoint& e);

result<listener> listen(std::shared_ptr<domain_state> dom, const endpoint& local, connection_options opts,
                        listener_options limits);

}  // namespace shuttle::detail::local_provider
