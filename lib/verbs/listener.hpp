// Connect and accept: the active side's handshake and verbs_listener.
#pragma once

#include "connection.hpp"

namespace shuttle::detail::verbs_impl {

// ------------------------------------------------------------------ connect / accept

inline task<result<void>> connect_steps(std::shared_ptr<conn_state> st, endpoint ep) {
  int ms = static_cast<int>(std::max<std::int64_t>(100, st->opts.connect_timeout.count()));
  if (rdma_resolve_addr(st->id, nullptr, const_cast<sockaddr*>(ep.data()), ms) != 0) co_return last_errno();
  auto e = co_await st->next_event();
  if (!e) co_return e.error();
  if (e->type != RDMA_CM_EVENT_ADDR_RESOLVED) co_return cm_error(*e);
  if (rdma_resolve_route(st->id, ms) != 0) co_return last_errno();
  e = co_await st->next_event();
  if (!e) co_return e.error();
  if (e->type != RDMA_CM_EVENT_ROUTE_RESOLVED) co_return cm_error(*e);
  if (auto r = st->create_qp(); !r) co_return r.error();
  wire_hello_payload hello;
  rdma_conn_param p = st->conn_param(hello, nullptr);
  p.qp_num = st->qp_num;  // the QP is not the id's: librdmacm leaves its transitions to us
  p.srq = st->srq_grant ? 1 : 0;
  if (rdma_connect(st->id, &p) != 0) co_return last_errno();
  e = co_await st->next_event();
  if (!e) co_return e.error();
  if (e->type != RDMA_CM_EVENT_CONNECT_RESPONSE) co_return cm_error(*e);
  // The REP: the peer's hello checked, the QP readied with this side's RNR
  // retry count (not the REP's), then the RTU. A failure here destroys the
  // id, which rejects the REP.
  if (st->plain)
    st->take_plain(*e);
  else if (auto bad = st->take_hello(*e))
    co_return bad == errc::message_too_long ? bad : hello_error(*e);
  if (auto r = st->ready_qp(nullptr); !r) co_return r.error();
  if (rdma_establish(st->id) != 0) co_return last_errno();
  st->enter_open();
  co_return result<void>{};
}

// Connection requests are handled as listener_options says: a request past
// a cap is rejected at once, with a reject_reason in its private data; an
// accepted handshake has until its deadline to reach ESTABLISHED; accepted
// connections on which nothing arrives for idle_timeout fail with
// errc::idle_timeout. A timerfd on the loop drives the deadlines.
class verbs_listener final : public listener_impl {
 public:
  verbs_listener(std::shared_ptr<core> d, connection_options o, listener_options lim)
      : dom_(std::move(d)), opts_(o), limits_(lim) {}
  ~verbs_listener() override {
    *alive_ = false;
    close();
  }

  result<void> start(endpoint ep) {
    ech_ = rdma_create_event_channel();
    if (!ech_ || !set_nonblock(ech_->fd)) return last_errno();
    if (rdma_create_id(ech_, &id_, this, RDMA_PS_TCP) != 0) return last_errno();
    if (rdma_bind_addr(id_, const_cast<sockaddr*>(ep.data())) != 0) return last_errno();
    // The kernel's backlog: requests the listener has not read yet. Large,
    // so that every request is read at once and answered (accepted or
    // rejected with a reason) rather than left to the peer's CM retries.
    if (rdma_listen(id_, 1024) != 0) return last_errno();
    watch_ = new fd_watch(ech_->fd, &on_cm, this);
    watch_->arm(*dom_->loop);
    if (auto r = start_ticks(); !r) return r;
    return {};
  }

  task<result<connection>> accept() override {
    auto alive = alive_;  // the listener may be destroyed while this waits
    while (ready_.empty()) {
      if (closed_) co_return disconnected();
      ev_.reset();
      if (auto r = co_await ev_.wait(); !r) co_return r.error();
      if (!*alive) co_return disconnected();
    }
    auto st = std::move(ready_.front());
    ready_.pop_front();
    if (limits_.max_connections != 0 || limits_.idle_timeout.count() > 0)
      accepted_.push_back({st, st->rx_count, clock::now()});
    co_return connection(std::make_unique<verbs_connection>(std::move(st)));
  }

  endpoint local_endpoint() const override {
    if (!id_) return {};
    sockaddr* sa = rdma_get_local_addr(id_);
    return endpoint(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }

  void close() noexcept override {
    if (closed_) return;
    closed_ = true;
    if (watch_) std::exchange(watch_, nullptr)->destroy();
    if (tick_) std::exchange(tick_, nullptr)->destroy();
    if (tfd_ >= 0) ::close(std::exchange(tfd_, -1));
    for (auto& h : pending_) {
      h.st->acceptor = nullptr;
      h.st->shutdown();
    }
    pending_.clear();
    for (auto& st : ready_) st->shutdown();
    ready_.clear();
    accepted_.clear();
    if (id_) rdma_destroy_id(std::exchange(id_, nullptr));
    if (ech_) rdma_destroy_event_channel(std::exchange(ech_, nullptr));
    ev_.set();
  }

 private:
  static void on_cm(void* arg) noexcept {
    auto* self = static_cast<verbs_listener*>(arg);
    rdma_cm_event* e;
    while (rdma_get_cm_event(self->ech_, &e) == 0) {
      cm_evt c = copy_event(e);
      rdma_ack_cm_event(e);
      if (c.type == RDMA_CM_EVENT_CONNECT_REQUEST) self->on_request(c);
    }
    if (!self->closed_) self->watch_->arm(*self->dom_->loop);
    self->tell_refused();
  }

  // The peer of a request, as far as the CM knows it.
  static endpoint peer_of(rdma_cm_id* id) noexcept {
    sockaddr* sa = id ? rdma_get_peer_addr(id) : nullptr;
    if (!sa || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6)) return {};
    return endpoint(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in));
  }

  // listener_options::on_refused, told once the listener's own state is
  // consistent (at the end of each handler: the application may close the
  // listener from it).
  void refused(rdma_cm_id* id, std::string why) {
    if (limits_.on_refused) refusals_.emplace_back(peer_of(id), std::move(why));
  }
  void tell_refused() noexcept {
    if (refusals_.empty()) return;
    auto told = std::move(refusals_);
    refusals_.clear();
    auto tell = limits_.on_refused;  // the application may even destroy the listener from it
    for (auto& [peer, why] : told) {
      try {
        tell(peer, why);
      } catch (...) {  // the application's logger: its failure is not the listener's
      }
    }
  }

  static const char* describe(reject_reason why) noexcept {
    switch (why) {
      case reject_reason::too_many_handshakes: return "refused: too many handshakes in progress";
      case reject_reason::backlog_full: return "refused: accept backlog full";
      case reject_reason::too_many_connections: return "refused: connection cap reached";
      case reject_reason::bad_hello: return "refused: a hello this side cannot honour (credits or buffer size)";
      case reject_reason::no_resources: return "refused: no resources (QP, CQ entries or receive buffers)";
      case reject_reason::bad_payload:
        static_assert(max_connect_payload == 32, "the text below");
        return "refused: a connect payload over 32 bytes, or past the private data";
    }
    return "refused";
  }

  static bool carries_hello(const cm_evt& req) noexcept {
    std::uint32_t magic = 0;
    if (req.priv_len >= sizeof magic) std::memcpy(&magic, req.priv.data(), sizeof magic);
    return ntohl(magic) == wire_magic;
  }

  static void reject(rdma_cm_id* id, reject_reason why) noexcept {
    const std::uint32_t data[2] = {htonl(reject_magic), htonl(static_cast<std::uint32_t>(why))};
    rdma_reject(id, data, sizeof data);
  }

  // Connections of this listener holding resources: handshakes, the
  // backlog, and accepted ones not dropped yet.
  std::size_t live_connections() noexcept {
    std::erase_if(accepted_, [](const accepted_conn& a) {
      auto sp = a.st.lock();
      return !sp || sp->dying;
    });
    return pending_.size() + ready_.size() + accepted_.size();
  }

  void on_request(const cm_evt& req) noexcept {
    std::optional<reject_reason> refuse;
    if (pending_.size() >= limits_.max_handshakes)
      refuse = reject_reason::too_many_handshakes;
    else if (ready_.size() >= limits_.accept_backlog)
      refuse = reject_reason::backlog_full;
    else if (limits_.max_connections != 0 && live_connections() >= limits_.max_connections)
      refuse = reject_reason::too_many_connections;
    auto st = std::make_shared<conn_state>(dom_, opts_);
    if (!st->init_channel() || rdma_migrate_id(req.id, st->ech) != 0) {
      ++dom_->st.handshakes_refused;
      refused(req.id, describe(reject_reason::no_resources));
      reject(req.id, reject_reason::no_resources);
      rdma_destroy_id(req.id);
      st->shutdown();
      return;
    }
    // The request's id moves to a channel of its own before it is rejected
    // or destroyed: on the listener's channel that stops the listener.
    st->id = req.id;
    req.id->context = st.get();
    // The hello is checked before anything is allocated for the peer.
    // wire_protocol::detect: a request without shuttle's magic is a plain peer.
    if (!refuse && (opts_.protocol == wire_protocol::plain ||
                    (opts_.protocol == wire_protocol::detect && !carries_hello(req)))) {
      st->make_plain();
      st->take_plain(req);
    } else if (!refuse) {
      if (auto bad = st->take_hello(req))
        refuse = bad == errc::message_too_long ? reject_reason::bad_payload : reject_reason::bad_hello;
    }
    wire_hello_payload hello;
    if (!refuse) {
      bool ok = static_cast<bool>(st->create_qp());
      rdma_conn_param p = st->conn_param(hello, &req);
      ok = ok && static_cast<bool>(st->ready_qp(&p));
      p.qp_num = st->qp_num;
      p.srq = st->srq_grant ? 1 : 0;
      if (ok && rdma_accept(st->id, &p) != 0) ok = false;
      if (!ok) refuse = reject_reason::no_resources;
    }
    if (refuse) {
      ++dom_->st.handshakes_refused;
      if (*refuse == reject_reason::bad_hello && !carries_hello(req))
        refused(st->id, "refused: not a shuttle peer (no shuttle hello in its request; see wire_protocol::detect)");
      else
        refused(st->id, describe(*refuse));
      reject(st->id, *refuse);
      st->shutdown();
      return;
    }
    st->acceptor = this;
    st->on_accept_done = &accept_done;
    pending_.push_back({std::move(st), clock::now() + limits_.handshake_timeout});
  }

  static void accept_done(void* arg, conn_state* st, std::error_code failed) noexcept {
    auto* self = static_cast<verbs_listener*>(arg);
    auto it = std::find_if(self->pending_.begin(), self->pending_.end(), [&](auto& h) { return h.st.get() == st; });
    if (it == self->pending_.end()) return;
    auto sp = std::move(it->st);
    self->pending_.erase(it);
    if (!failed && self->ready_.size() < self->limits_.accept_backlog) {
      self->ready_.push_back(std::move(sp));
      self->ev_.set();
    } else {
      if (!failed) {
        ++self->dom_->st.handshakes_refused;  // the backlog filled up meanwhile
        self->refused(sp->id, describe(reject_reason::backlog_full));
      } else {
        self->refused(sp->id, "handshake failed: " + failed.message());
      }
      sp->shutdown();
    }
    self->tell_refused();
  }

  // The deadlines are looked at a few times per the shortest of them.
  result<void> start_ticks() {
    auto period = limits_.handshake_timeout;
    if (limits_.idle_timeout.count() > 0) period = std::min(period, limits_.idle_timeout);
    period = std::clamp(period / 4, std::chrono::milliseconds(20), std::chrono::milliseconds(1000));
    tfd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (tfd_ < 0) return last_errno();
    itimerspec its{};
    its.it_interval.tv_sec = period.count() / 1000;
    its.it_interval.tv_nsec = (period.count() % 1000) * 1000000;
    its.it_value = its.it_interval;
    if (timerfd_settime(tfd_, 0, &its, nullptr) != 0) return last_errno();
    tick_ = new fd_watch(tfd_, &on_tick, this);
    tick_->arm(*dom_->loop);
    return {};
  }

  static void on_tick(void* arg) noexcept {
    auto* self = static_cast<verbs_listener*>(arg);
    std::uint64_t expirations;
    while (::read(self->tfd_, &expirations, sizeof expirations) > 0) {
    }
    self->check_deadlines(clock::now());
    self->tick_->arm(*self->dom_->loop);
    self->tell_refused();
  }

  void check_deadlines(clock::time_point now) noexcept {
    // Handshakes past their deadline: dropped (the peer sees a reject).
    for (std::size_t i = 0; i < pending_.size();) {
      if (now < pending_[i].deadline) {
        ++i;
        continue;
      }
      auto st = std::move(pending_[i].st);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      ++dom_->st.handshakes_timed_out;
      st->acceptor = nullptr;
      refused(st->id, "handshake failed: not established within " + std::to_string(limits_.handshake_timeout.count()) +
                          " ms");
      // Destroyed, not rejected: the REP is still out, and the kernel's CM
      // cancels it only when the id is destroyed in REP_SENT (it then sends
      // a REJ of its own, with no private data). rdma_reject would move the
      // id to timewait with the REP still retried, and its destroy would
      // wait until the REP's retries ran out: (max_cm_retries + 1) x the
      // CM response timeout, both taken from the peer's REQ (65 s with
      // librdmacm's defaults, up to days from a hostile peer).
      st->shutdown();
    }
    if (limits_.idle_timeout.count() <= 0) return;
    for (auto& a : accepted_) {
      auto st = a.st.lock();
      if (!st || st->state != conn_state::phase::open || st->dying) continue;
      if (st->rx_count != a.rx_seen) {
        a.rx_seen = st->rx_count;
        a.since = now;
      } else if (now - a.since >= limits_.idle_timeout) {
        ++dom_->st.idle_timeouts;
        st->fail(make_error_code(errc::idle_timeout));
      }
    }
  }

  struct handshake {
    std::shared_ptr<conn_state> st;
    clock::time_point deadline;
  };
  struct accepted_conn {
    std::weak_ptr<conn_state> st;
    std::uint64_t rx_seen = 0;  // the connection's rx_count when last looked at
    clock::time_point since;    // when it last changed
  };

  std::shared_ptr<core> dom_;
  connection_options opts_;
  listener_options limits_;
  rdma_event_channel* ech_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  fd_watch* watch_ = nullptr;
  int tfd_ = -1;
  fd_watch* tick_ = nullptr;
  std::vector<handshake> pending_;
  std::deque<std::shared_ptr<conn_state>> ready_;
  std::vector<accepted_conn> accepted_;
  std::vector<std::pair<endpoint, std::string>> refusals_;  // for on_refused, at the end of a handler
  event ev_;
  bool closed_ = false;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // false once destroyed: for accept()s waiting
};

}  // namespace shuttle::detail::verbs_impl
