// A tcp-provider connection's set-up (the hello exchange) and its grants
// (connection::grant): per-connection keys in the domain's grant table.
#include "connection.hpp"

namespace shuttle::detail::tcp_provider {

namespace {

// A memory_grant: its entry in the domain's grant table.
struct tcp_grant final : grant_impl {
  std::shared_ptr<domain_state> dom;
  std::shared_ptr<grant_entry> e;
  remote_buffer remote() const noexcept override {
    if (e->revoked) return {};
    return {reinterpret_cast<std::uint64_t>(e->addr), e->rkey, e->length};
  }
  ~tcp_grant() override { dom->drop_grant(*e); }
};

task<result<memory_grant>> ready(result<memory_grant> r) { co_return r; }

// Out of the table already: waits for the accesses through it in progress.
task<result<void>> wait_unused(std::shared_ptr<grant_entry> e) {
  while (e->in_use > 0)
    if (auto r = co_await e->idle.wait(); !r) co_return r.error();
  co_return result<void>{};
}

}  // namespace

tcp_connection::~tcp_connection() {
  for (auto& g : grants_) s_->dom->drop_grant(*g);  // the connection's grants go with it
  s_->enter_error(err(errc::disconnected));
}

task<result<memory_grant>> tcp_connection::grant(const memory_region& r, std::size_t offset, std::size_t len,
                                                 unsigned rights) {
  return ready(make_grant(r, offset, len, rights));
}

task<result<void>> tcp_connection::revoke(grant_impl& g) {
  auto e = static_cast<tcp_grant&>(g).e;
  s_->dom->drop_grant(*e);
  return wait_unused(std::move(e));
}

result<memory_grant> tcp_connection::make_grant(const memory_region& r, std::size_t offset, std::size_t len,
                                                unsigned rights) {
  if (auto c = check_grant(r, offset, len, rights); !c) return c.error();
  auto region = std::dynamic_pointer_cast<tcp_region>(impl_access::of(r));
  if (!region || region->dom != s_->dom) return std::make_error_code(std::errc::invalid_argument);
  if (s_->state() != conn_state::phase::open) return err(errc::disconnected);
  auto e = std::make_shared<grant_entry>();
  e->conn = s_.get();
  e->region = std::move(region);
  e->addr = e->region->addr + offset;
  e->length = len;
  e->access = rights;
  auto key = s_->dom->new_key();
  if (!key) return key.error();
  e->rkey = *key;
  s_->dom->grants[e->rkey] = e;
  std::erase_if(grants_, [](const auto& g) { return g->revoked; });  // bounded by the live grants
  grants_.push_back(e);
  auto g = std::make_unique<tcp_grant>();
  g->owner = this;
  g->dom = s_->dom;
  g->e = std::move(e);
  return memory_grant(std::move(g));
}

task<result<std::shared_ptr<conn_state>>> handshake(tcp_socket& sock, std::shared_ptr<domain_state> dom,
                                                    connection_options opts) {
  (void)sock.set_nodelay(true);
  // A connection lives long and does a read and a writev per batch of
  // frames: a registered-file slot saves a file lookup on each (best effort).
  (void)sock.register_file();
  // The hello, then the payload (at most max_connect_payload: domain::connect and listen checked it).
  std::array<std::byte, hello_size + max_connect_payload> mine{};
  std::array<std::byte, hello_size> theirs{};
  hello h;
  h.receive_buffers = opts.receive_buffers;
  h.receive_buffer_size = opts.receive_buffer_size;
  const std::size_t payload = std::min(opts.payload.size(), max_connect_payload);
  h.payload_size = static_cast<std::uint16_t>(payload);
  encode_hello(h, std::span(mine).first<hello_size>());
  std::copy_n(opts.payload.begin(), payload, mine.begin() + hello_size);
  if (auto r = co_await sock.write_all(std::span(mine).first(hello_size + payload)); !r) co_return r.error();
  // Another protocol's peer is told apart as soon as its first bytes
  // arrive (an SSH or SMTP banner, an HTTP error page), rather than by a
  // timeout or a bare end of stream.
  for (std::size_t got = 0; got < theirs.size();) {
    auto n = co_await sock.read_some(std::span(theirs).subspan(got));
    if (!n) co_return n.error();
    if (*n == 0) co_return err(errc::eof);  // what came was a hello's start (checked below)
    got += *n;
    if (!starts_like_hello(std::span(theirs).first(got))) co_return err(errc::not_a_shuttle_peer);
  }
  auto peer = decode_hello(theirs);
  if (!peer) co_return peer.error();
  std::vector<std::byte> peer_payload(peer->payload_size);  // bounded by decode_hello
  for (std::size_t got = 0; got < peer_payload.size();) {
    auto n = co_await sock.read_some(std::span(peer_payload).subspan(got));
    if (!n) co_return n.error();
    if (*n == 0) co_return err(errc::eof);
    got += *n;
  }
  auto ep = sock.remote_endpoint();
  auto s = std::make_shared<conn_state>(std::move(sock), std::move(dom), opts, *peer, ep ? *ep : endpoint{});
  s->peer_payload = std::move(peer_payload);
  co_return s;
}

task<result<connection>> establish(tcp_socket sock, std::shared_ptr<domain_state> dom, connection_options opts) {
  auto s = co_await with_timeout(handshake(sock, std::move(dom), opts), opts.connect_timeout);
  if (!s) co_return handshake_error(s.error());
  (*s)->start();
  co_return make_connection(std::move(*s));
}

}  // namespace shuttle::detail::tcp_provider
