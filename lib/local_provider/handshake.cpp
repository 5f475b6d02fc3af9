// A local-provider connection's set-up: the local hello with its
// descriptors (local_wire.hpp), then the engine's hello, on the Unix socket.
#include "conn_state.hpp"
#include "ring.hpp"
#include "sys_io.hpp"

#include "../tcp_provider/connection.hpp"
#include "../transport/little_endian.hpp"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstring>

namespace shuttle::detail::local_provider {

mapping::~mapping() {
  if (base) ::munmap(base, len);
}

conn_ext::~conn_ext() {
  if (service_fd >= 0) ::close(service_fd);
  if (peer_keys) ::munmap(const_cast<std::uint64_t*>(peer_keys), local_wire::key_table_bytes);
}

void conn_ext::ask(std::uint32_t rkey) noexcept {
  if (queries >= max_queries || regions.size() + queries >= max_peer_regions || asked.contains(rkey)) return;
  std::array<std::byte, local_wire::query_size> q{};
  local_wire::encode_query(rkey, q);
  if (::send(service_fd, q.data(), q.size(), MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(q.size())) return;
  try {
    asked.emplace(rkey, true);
    ++queries;
  } catch (...) {  // its answer will be refused as unasked: the connection fails, as out of memory would
  }
}

namespace {
std::error_code protocol() noexcept { return make_error_code(errc::protocol_error); }

// SHUTTLE_LOCAL_CARRY=0: separate ACK and CREDIT frames (the A/B baseline).
bool carry_wanted() noexcept {
  const char* e = std::getenv("SHUTTLE_LOCAL_CARRY");
  return !e || std::strcmp(e, "0") != 0;
}
}  // namespace

task<result<std::shared_ptr<tp::conn_state>>> handshake(tcp_socket& sock, std::shared_ptr<domain_state> dom,
                                                        connection_options opts, local_wire::role me) {
  const int fd = sock.native_handle();
  auto x = std::make_shared<conn_ext>();
  x->dom = dom;
  std::vector<int> passed{dom->keys->fd()};  // the peer gets its own copies
  int theirs_end = -1;
  local_wire::hello h;
  h.from = me;
  h.rings = rings_wanted();
  h.membarrier = h.rings && asymmetric_fences_available();
  h.carried = carry_wanted();
  fd_list ring_fd;  // the connector's rings, made here
  if (me == local_wire::role::connector) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pair) != 0)
      co_return errno_code(errno);
    x->service_fd = pair[0];
    theirs_end = pair[1];
    passed.push_back(pair[1]);
    if (h.rings) {
      auto m = make_ring_memfd();
      if (!m) {
        ::close(theirs_end);
        co_return m.error();
      }
      ring_fd.fds.push_back(*m);
      passed.push_back(*m);
    }
  }
  std::array<std::byte, local_wire::hello_size> mine{}, theirs{};
  local_wire::encode_hello(h, mine);
  auto sent = send_with_fds(fd, mine, passed);
  if (theirs_end >= 0) ::close(theirs_end);
  if (!sent) co_return sent.error();

  fd_list got_fds;
  for (std::size_t got = 0; got < theirs.size();) {
    auto n = recv_with_fds(fd, std::span(theirs).subspan(got), got_fds.fds);
    if (!n) {
      if (n.error() != std::errc::resource_unavailable_try_again) co_return n.error();
      if (int r = co_await poll_in(fd); r < 0) co_return errno_code(-r);
      continue;
    }
    if (*n == 0) co_return make_error_code(errc::eof);
    got += *n;
    // Another protocol's peer is told apart by its first bytes.
    if (got >= 4 && get_le(theirs.data(), 4) != local_wire::hello_magic)
      co_return make_error_code(errc::not_a_shuttle_peer);
  }
  auto peer = local_wire::decode_hello(theirs);
  if (!peer) co_return peer.error();
  if (peer->from == me || got_fds.fds.size() != peer->fds()) co_return protocol();
  auto table_size = check_sealed_memfd(got_fds.fds[0]);
  if (!table_size || *table_size < local_wire::key_table_bytes) co_return protocol();
  void* keys = ::mmap(nullptr, local_wire::key_table_bytes, PROT_READ, MAP_SHARED, got_fds.fds[0], 0);
  if (keys == MAP_FAILED) co_return errno_code(errno);
  x->peer_keys = static_cast<const std::uint64_t*>(keys);
  if (me == local_wire::role::acceptor) {
    int type = 0, family = 0;
    socklen_t len = sizeof type;
    if (::getsockopt(got_fds.fds[1], SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET)
      co_return protocol();
    len = sizeof family;
    if (::getsockopt(got_fds.fds[1], SOL_SOCKET, SO_DOMAIN, &family, &len) != 0 || family != AF_UNIX)
      co_return protocol();
    x->service_fd = std::exchange(got_fds.fds[1], -1);
  }

  // Rings if both want them: the connector's memfd, mapped by both.
  std::unique_ptr<tp::byte_pipe> rings;
  if (h.rings && peer->rings) {
    auto r = map_rings(me == local_wire::role::connector ? ring_fd.fds[0] : got_fds.fds[2],
                       me == local_wire::role::connector, fd, h.membarrier && peer->membarrier);
    if (!r) co_return r.error();
    rings = std::move(*r);
  }

  auto s = co_await tp::handshake(sock, dom->engine, opts);
  if (!s) co_return s.error();
  (*s)->pipe = std::move(rings);
  (*s)->lim.carried = h.carried && peer->carried;
  (*s)->ext = std::move(x);
  co_return std::move(*s);
}

}  // namespace shuttle::detail::local_provider
