// transport_kind::automatic (internal; README.md): which peers are on this
// host, the local socket an automatic listener answers on, and the
// listener over both providers.
#pragma once

#include "../transport/provider.hpp"

namespace shuttle::detail::auto_provider {

// Whether `e` names this host: loopback, unspecified (0.0.0.0, ::), or an
// address of one of its interfaces (getifaddrs). IP endpoints only.
bool same_host(const endpoint& e);

// The abstract Unix socket an automatic listener on IP port `port` answers
// local peers on: "@shuttle-auto:<port>". Not the local provider's own
// "@shuttle-local:<port>": its port space is its own (a local listener on
// port P is not the service on TCP port P), so an automatic client must
// not take one for the other.
endpoint local_name(std::uint16_t port);

// Listens on `remote` (the remote provider's listener on the IP endpoint)
// and `local` (the local provider's on local_name of its port): accept()
// returns the first connection either makes.
listener make_listener(listener remote, listener local);

}  // namespace shuttle::detail::auto_provider
