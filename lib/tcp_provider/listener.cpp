// The tcp provider's listener: accept() takes TCP connections from the
// kernel while under its limits (the rest wait in the kernel's backlog),
// refuses what is over the connection cap, and runs the handshakes in the
// background, each with its own deadline.
#include "listener.hpp"

#include "connection.hpp"

#include <shuttle/when_any.hpp>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <string_view>

namespace shuttle::detail::tcp_provider {

namespace {

// Fails the connection once no byte has arrived from the peer for `limit`
// (listener_options::idle_timeout). The kernel keeps the time of the last
// data received (TCP_INFO's tcpi_last_data_recv), so nothing is done per
// frame: this wakes about once per `limit` on a busy connection, and fires
// between `limit` and `limit` plus a sixteenth of it after the last byte.
task<void> idle_watch(std::shared_ptr<conn_state> s, std::chrono::milliseconds limit) {
  const auto min_wait = std::max(limit / 16, std::chrono::milliseconds(1));
  std::chrono::milliseconds wait = limit;
  while (s->state() == conn_state::phase::open) {
    if (!co_await sleep_for(wait)) break;  // the connection stopped
    if (s->state() != conn_state::phase::open || !s->sock.is_open()) break;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (::getsockopt(s->sock.native_handle(), IPPROTO_TCP, TCP_INFO, &info, &len) != 0) break;
    const std::chrono::milliseconds quiet{info.tcpi_last_data_recv};
    if (quiet >= limit) {
      s->enter_error(err(errc::idle_timeout));
      break;
    }
    wait = std::max(limit - quiet, min_wait);
  }
}

// The same where the socket has no TCP_INFO (the local provider's Unix
// socket): the frames the reader has taken, looked at every sixteenth of
// `limit`, so it fires between `limit` and `limit` plus a sixteenth of it
// after the last frame. Accesses a local peer makes directly in shared
// memory are not seen, as an RDMA peer's one-sided accesses are not.
task<void> idle_watch_frames(std::shared_ptr<conn_state> s, std::chrono::milliseconds limit) {
  const auto step = std::max(limit / 16, std::chrono::milliseconds(1));
  std::uint64_t seen = s->frames_in;
  std::chrono::milliseconds quiet{0};
  while (s->state() == conn_state::phase::open) {
    if (!co_await sleep_for(step)) break;  // the connection stopped
    if (s->state() != conn_state::phase::open) break;
    if (s->frames_in != seen) {
      seen = s->frames_in;
      quiet = {};
      continue;
    }
    quiet += step;
    if (quiet >= limit) {
      s->enter_error(err(errc::idle_timeout));
      break;
    }
  }
}

bool has_tcp_info(const tcp_socket& sock) noexcept {
  tcp_info info{};
  socklen_t len = sizeof info;
  return ::getsockopt(sock.native_handle(), IPPROTO_TCP, TCP_INFO, &info, &len) == 0;
}

// A listener's state, shared with its handshakes: they end a loop turn after
// close() (their stop is requested) and may outlive it.
struct listener_core {
  listener_core(tcp_listener l, std::shared_ptr<domain_state> d, connection_options o, listener_options lim,
                engine_hooks h)
      : sock(std::move(l)),
        dom(std::move(d)),
        opts(o),
        limits(lim),
        ready(std::max<std::uint32_t>(lim.accept_backlog, 1)),
        hooks(h) {}

  tcp_listener sock;
  std::shared_ptr<domain_state> dom;
  connection_options opts;
  listener_options limits;
  channel<connection> ready;  // established, not yet taken by accept()
  engine_hooks hooks;
  std::shared_ptr<live_count> live = std::make_shared<live_count>();
  std::uint32_t handshakes = 0;  // in progress
  std::error_code failure{};     // the listening socket's own error, for accept()
  event established;             // set when a handshake puts a connection in `ready`, and on close
  event slot_freed;              // set when a handshake ends, and on close
  bool closed = false;
  std::stop_source stop;
  task_group tasks{&io_context::current()};  // the handshakes

  // A new TCP connection refused (refusal()) is closed at once (the peer
  // reads EOF) and costs nothing more.

  void close() noexcept {
    if (closed) return;
    closed = true;
    tasks.stopping();
    stop.request_stop();  // every handshake in progress ends, closing its socket
    sock.close();
    ready.close();
    while (ready.try_receive()) {}  // established, never taken: closed here
    established.set();              // accept() calls waiting fail
    slot_freed.set();
  }

  void refused(const tcp_socket& peer, std::string_view why) const {
    if (!limits.on_refused) return;
    auto ep = peer.remote_endpoint();
    try {
      limits.on_refused(ep ? *ep : endpoint{}, why);
    } catch (...) {  // the application's logger: its failure is not the listener's
    }
  }

  // Whether another handshake may start: under the cap on handshakes, and
  // with room in the backlog for it and every handshake in progress, so
  // that an established connection never finds the backlog full. While it
  // may not, new peers stay in the kernel's listen backlog (a burst of good
  // clients waits there instead of being refused); a silent peer holds its
  // slot for handshake_timeout at most.
  bool may_start_handshake() const noexcept {
    return handshakes < limits.max_handshakes && ready.size() + handshakes < ready.capacity();
  }

  // Why a new TCP connection is refused at once, or nullptr if it may start
  // its handshake.
  const char* refusal() const noexcept {
    if (limits.max_connections != 0 && live->n + handshakes >= limits.max_connections)
      return "refused: connection cap reached";
    return nullptr;
  }

  static bool transient(const std::error_code& ec) noexcept {
    // Out of descriptors or memory, or a peer that gave up before accept:
    // the listening socket itself is fine; back off and accept again.
    return ec != std::errc::bad_file_descriptor && ec != std::errc::invalid_argument &&
           ec != std::errc::not_a_socket && ec != std::errc::operation_not_supported &&
           ec != std::errc::operation_canceled;
  }

  // Takes one TCP connection from the kernel and starts its handshake, or
  // refuses it. Run by accept(): a socket it got is never lost, even when
  // accept() stops waiting for it (a handshake finished first).
  static task<void> accept_one(std::shared_ptr<listener_core> c) {
    while (!c->may_start_handshake()) {
      c->slot_freed.reset();
      (void)co_await c->slot_freed.wait();
      if (c->closed || (co_await get_stop_token()).stop_requested()) co_return;
    }
    auto s = co_await c->sock.accept();
    if (c->closed) co_return;
    if (!s) {
      if (s.error() == std::errc::operation_canceled) co_return;
      if (transient(s.error())) {
        (void)co_await sleep_for(std::chrono::milliseconds(10));
        co_return;
      }
      c->failure = s.error();
      c->ready.close();
      c->established.set();
      co_return;
    }
    if (const char* why = c->refusal()) {
      c->refused(*s, why);
      s->close();
      co_return;
    }
    ++c->handshakes;
    spawn_in(c->tasks, handshake_one(c, std::move(*s)), c->stop.get_token());
  }

  static task<void> await_established(std::shared_ptr<listener_core> c) { (void)co_await c->established.wait(); }

  // One peer's hello, with its own deadline, concurrently with the others.
  static task<void> handshake_one(std::shared_ptr<listener_core> c, tcp_socket sock) {
    auto hs = c->hooks.handshake ? c->hooks.handshake(sock, c->dom, c->opts) : handshake(sock, c->dom, c->opts);
    auto s = co_await with_timeout(std::move(hs), c->limits.handshake_timeout);
    if (!s) s = handshake_error(s.error());
    --c->handshakes;
    c->slot_freed.set();
    if (!s) {  // a failed, late or cancelled hello: `sock` closes here
      if (!c->closed && s.error() != std::errc::operation_canceled)
        c->refused(sock, "handshake failed: " + s.error().message());
      co_return;
    }
    (*s)->origin = c->live;
    ++c->live->n;
    (*s)->start();
    if (c->limits.idle_timeout.count() > 0)
      spawn_in((*s)->tasks,
               has_tcp_info((*s)->sock) ? idle_watch(*s, c->limits.idle_timeout)
                                        : idle_watch_frames(*s, c->limits.idle_timeout),
               (*s)->stop.get_token());
    connection conn = c->hooks.make ? c->hooks.make(std::move(*s)) : make_connection(std::move(*s));
    // Closed meanwhile: `conn` closes here (may_start_handshake() kept room
    // in the backlog for it).
    if (!c->closed && c->ready.try_send(conn)) c->established.set();
  }
};

// accept() takes TCP connections from the kernel and starts their handshakes,
// which run in the background, each with its own deadline, until it finds
// an established connection in the backlog. Nothing runs for the listener
// while no accept() waits and no handshake is in progress, so a listener
// closed then leaves nothing behind. See listener_options for the limits.
class tcp_listener_impl final : public listener_impl {
 public:
  tcp_listener_impl(tcp_listener l, std::shared_ptr<domain_state> d, connection_options o, listener_options lim,
                    engine_hooks h)
      : c_(std::make_shared<listener_core>(std::move(l), std::move(d), o, lim, h)) {}
  ~tcp_listener_impl() override { c_->close(); }

  task<result<connection>> accept() override { return accept_impl(c_); }
  endpoint local_endpoint() const override {
    auto e = c_->sock.local_endpoint();
    return e ? *e : endpoint{};
  }
  void close() noexcept override { c_->close(); }

 private:
  static task<result<connection>> accept_impl(std::shared_ptr<listener_core> c) {
    for (;;) {
      if (auto conn = c->ready.try_receive()) {
        c->slot_freed.set();  // room in the backlog: another accept() may start a handshake
        co_return std::move(*conn);
      }
      if (c->closed || c->ready.closed())
        co_return c->failure ? c->failure : std::make_error_code(std::errc::bad_file_descriptor);
      c->established.reset();
      co_await when_any(listener_core::accept_one(c), listener_core::await_established(c));
      if ((co_await get_stop_token()).stop_requested()) co_return std::make_error_code(std::errc::operation_canceled);
    }
  }

  std::shared_ptr<listener_core> c_;
};

}  // namespace

std::unique_ptr<listener_impl> make_listener(tcp_listener l, std::shared_ptr<domain_state> dom,
                                             connection_options opts, listener_options limits,
                                             engine_hooks hooks) {
  return std::make_unique<tcp_listener_impl>(std::move(l), std::move(dom), opts, limits, hooks);
}

}  // namespace shuttle::detail::tcp_provider
