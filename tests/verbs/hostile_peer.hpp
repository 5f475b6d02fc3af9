// A hostile peer of the verbs provider, written with librdmacm and
// libibverbs directly (blocking calls: it runs on a thread of its own while
// the shuttle side runs its loop). It says in the CM private data whatever
// a test wants, may never send the RTU, never post receives, or grant
// credits it never had.
#pragma once

#include <arpa/inet.h>
#include <poll.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

namespace hostile {

// The provider's wire (lib/verbs/cm_events.hpp): the hello and the reject's
// reason. SHUTTLE_TEST_OLD_WIRE: the hello of the code before the checks
// (to show that a test fails there).
inline std::vector<std::uint8_t> hello(std::uint32_t max_slots, std::uint32_t initial, std::uint32_t buffer) {
#ifdef SHUTTLE_TEST_OLD_WIRE
  (void)initial;
  const std::uint32_t w[3] = {htonl(0x53485631u), htonl(max_slots), htonl(buffer)};
#else
  const std::uint32_t w[4] = {htonl(0x53485632u), htonl(max_slots), htonl(initial), htonl(buffer)};
#endif
  std::vector<std::uint8_t> v(sizeof w);
  std::memcpy(v.data(), w, sizeof w);
  return v;
}
constexpr std::uint32_t ctrl_flag = 0x80000000u;  // imm of a credit-only message
enum reason : std::uint32_t {
  none = 0,
  too_many_handshakes = 1,
  backlog_full = 2,
  too_many_connections = 3,
  bad_hello = 4,
  no_resources = 5,
  handshake_timeout = 6,
  bad_payload = 7
};
// A hello followed by a connect payload's length byte and `n` bytes of it.
inline std::vector<std::uint8_t> hello_with_payload(std::uint8_t len, std::size_t n) {
  auto v = hello(4, 1, 4096);
  v.push_back(len);
  for (std::size_t i = 0; i < n; ++i) v.push_back(static_cast<std::uint8_t>(0xa0 + i));
  return v;
}

struct event {
  rdma_cm_event_type type{};
  int status = 0;
  rdma_cm_id* id = nullptr;
  std::vector<std::uint8_t> priv;
  // A reject's reason ({"SHRR", reason}), else none.
  std::uint32_t reason() const {
    if (type != RDMA_CM_EVENT_REJECTED || priv.size() < 8) return none;
    std::uint32_t w[2];
    std::memcpy(w, priv.data(), sizeof w);
    return ntohl(w[0]) == 0x53485252u ? ntohl(w[1]) : std::uint32_t(none);
  }
};

// One event channel; events of ids other than the awaited one are kept.
class channel {
 public:
  channel() : ch_(rdma_create_event_channel()) {}
  ~channel() {
    if (ch_) rdma_destroy_event_channel(ch_);
  }
  channel(const channel&) = delete;
  channel& operator=(const channel&) = delete;
  rdma_event_channel* get() const { return ch_; }
  bool ok() const { return ch_ != nullptr; }

  // The next event, from the kept ones or within `ms`.
  std::optional<event> next(int ms) {
    if (!kept_.empty()) {
      event e = std::move(kept_.front());
      kept_.erase(kept_.begin());
      return e;
    }
    return read(ms);
  }
  // The next event of `id` within `ms` (others are kept for next()).
  std::optional<event> next_for(rdma_cm_id* id, int ms) {
    for (auto it = kept_.begin(); it != kept_.end(); ++it)
      if (it->id == id) {
        event e = std::move(*it);
        kept_.erase(it);
        return e;
      }
    for (int waited = 0; waited < ms; waited += 50) {
      auto e = read(50);
      if (!e) continue;
      if (e->id == id) return e;
      kept_.push_back(std::move(*e));
    }
    return std::nullopt;
  }

 private:
  std::optional<event> read(int ms) {
    pollfd p{ch_->fd, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return std::nullopt;
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(ch_, &e) != 0) return std::nullopt;
    event r;
    r.type = e->event;
    r.status = e->status;
    r.id = e->id;
    if (e->param.conn.private_data && e->param.conn.private_data_len)
      r.priv.assign(static_cast<const std::uint8_t*>(e->param.conn.private_data),
                    static_cast<const std::uint8_t*>(e->param.conn.private_data) + e->param.conn.private_data_len);
    rdma_ack_cm_event(e);
    return r;
  }
  rdma_event_channel* ch_;
  std::vector<event> kept_;
};

// An id on `ch` with its address and route resolved to `dst`; null on failure.
inline rdma_cm_id* resolved_id(channel& ch, const sockaddr* dst) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(ch.get(), &id, nullptr, RDMA_PS_TCP) != 0) return nullptr;
  auto fail = [&] {
    rdma_destroy_id(id);
    return nullptr;
  };
  if (rdma_resolve_addr(id, nullptr, const_cast<sockaddr*>(dst), 5000) != 0) return fail();
  auto e = ch.next_for(id, 10000);
  if (!e || e->type != RDMA_CM_EVENT_ADDR_RESOLVED) {
    std::printf("resolve addr: %d\n", e ? int(e->type) : -1);
    return fail();
  }
  if (rdma_resolve_route(id, 5000) != 0) return fail();
  e = ch.next_for(id, 10000);
  if (!e || e->type != RDMA_CM_EVENT_ROUTE_RESOLVED) {
    std::printf("resolve route: %d\n", e ? int(e->type) : -1);
    return fail();
  }
  return id;
}

inline rdma_conn_param conn_param(const std::vector<std::uint8_t>& priv, std::uint32_t qp_num) {
  rdma_conn_param p{};
  p.private_data = priv.data();
  p.private_data_len = static_cast<std::uint8_t>(priv.size());
  p.responder_resources = 1;
  p.initiator_depth = 1;
  p.retry_count = 7;
  p.rnr_retry_count = 7;  // "retry for ever" on the listener's side
  p.qp_num = qp_num;
  return p;
}

// A connect request with no QP behind it, whose answer is awaited but never
// completed (no RTU): the listener holds a half-open handshake, unless it
// rejects it. `out`: the answer (REJECTED, CONNECT_RESPONSE, or nothing).
inline rdma_cm_id* half_open(channel& ch, const sockaddr* dst, const std::vector<std::uint8_t>& priv,
                             std::uint32_t fake_qp_num, std::optional<event>& out) {
  rdma_cm_id* id = resolved_id(ch, dst);
  if (!id) return nullptr;
  rdma_conn_param p = conn_param(priv, fake_qp_num);
  if (rdma_connect(id, &p) != 0) {
    rdma_destroy_id(id);
    return nullptr;
  }
  out = ch.next_for(id, 20000);
  return id;
}

// `n` connect requests with no QP behind them, issued at once (each id goes
// through address, route and connect as its events arrive) and never
// completed (no RTU). Returns the answer of each (nullopt: none within
// `ms`); every id is kept in `held`.
inline std::vector<std::optional<event>> half_open_burst(channel& ch, const sockaddr* dst, int n,
                                                         const std::vector<std::uint8_t>& priv, int ms,
                                                         std::vector<rdma_cm_id*>& held) {
  std::map<rdma_cm_id*, int> index;
  std::vector<std::optional<event>> answers(static_cast<std::size_t>(n));
  int pending = 0;
  for (int i = 0; i < n; ++i) {
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(ch.get(), &id, nullptr, RDMA_PS_TCP) != 0) continue;
    held.push_back(id);
    if (rdma_resolve_addr(id, nullptr, const_cast<sockaddr*>(dst), 20000) != 0) continue;
    index[id] = i;
    ++pending;
  }
  for (int waited = 0; pending > 0 && waited < ms; waited += 50) {
    auto e = ch.next(50);
    if (waited % 5000 == 0) std::printf("burst: %d pending after %d ms\n", pending, waited);
    if (!e) continue;
    auto it = index.find(e->id);
    if (it == index.end() || answers[static_cast<std::size_t>(it->second)]) continue;
    bool answered = false;
    if (e->type == RDMA_CM_EVENT_ADDR_RESOLVED) {
      answered = rdma_resolve_route(e->id, 20000) != 0;
    } else if (e->type == RDMA_CM_EVENT_ROUTE_RESOLVED) {
      rdma_conn_param p = conn_param(priv, 0x1000u + static_cast<std::uint32_t>(it->second));
      answered = rdma_connect(e->id, &p) != 0;
    } else {
      answered = true;  // REJECTED, CONNECT_RESPONSE, or an error
    }
    if (answered) {
      answers[static_cast<std::size_t>(it->second)] = std::move(*e);
      --pending;
    }
  }
  return answers;
}

// A whole connection with an RC QP of its own that posts no receives unless
// told to, and sends what it is told to.
class qp_peer {
 public:
  ~qp_peer() {
    if (id_ && established_) rdma_disconnect(id_);
    if (id_ && id_->qp) rdma_destroy_qp(id_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (id_) rdma_destroy_id(id_);
  }
  bool connect(const sockaddr* dst, const std::vector<std::uint8_t>& priv) {
    if (!ch_.ok()) return false;
    id_ = resolved_id(ch_, dst);
    if (!id_) return false;
    pd_ = ibv_alloc_pd(id_->verbs);
    cq_ = pd_ ? ibv_create_cq(id_->verbs, 256, nullptr, nullptr, 0) : nullptr;
    if (!cq_) return false;
    ibv_qp_init_attr a{};
    a.send_cq = cq_;
    a.recv_cq = cq_;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 64;
    a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    if (rdma_create_qp(id_, pd_, &a) != 0) return false;
    rdma_conn_param p = conn_param(priv, 0);
    if (rdma_connect(id_, &p) != 0) return false;
    auto e = ch_.next_for(id_, 20000);
    established_ = e && e->type == RDMA_CM_EVENT_ESTABLISHED;
    return established_;
  }
  // A zero-length SEND_WITH_IMM, awaited: true if it completed successfully.
  bool send_imm(std::uint32_t imm, int ms = 20000) {
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_SEND_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(imm);
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(id_->qp, &wr, &bad) != 0) return false;
    for (int waited = 0; waited < ms; ++waited) {
      ibv_wc wc{};
      int n = ibv_poll_cq(cq_, 1, &wc);
      if (n < 0) return false;
      if (n == 1) return wc.status == IBV_WC_SUCCESS;
      ::poll(nullptr, 0, 1);
    }
    return false;
  }

 private:
  channel ch_;
  rdma_cm_id* id_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool established_ = false;
};

// A listener that accepts one connection with an RC QP of its own, asks the
// client's QP for infinite RNR retries (7) in its REP, and never posts a
// receive.
class qp_server {
 public:
  ~qp_server() {
    if (conn_ && established_) rdma_disconnect(conn_);
    if (conn_ && conn_->qp) rdma_destroy_qp(conn_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (conn_) rdma_destroy_id(conn_);
    if (listen_) rdma_destroy_id(listen_);
  }
  // Listens on `addr` (port 0: any); the port, or 0 on failure.
  std::uint16_t listen(const sockaddr* addr) {
    if (!ch_.ok() || rdma_create_id(ch_.get(), &listen_, nullptr, RDMA_PS_TCP) != 0) return 0;
    if (rdma_bind_addr(listen_, const_cast<sockaddr*>(addr)) != 0 || rdma_listen(listen_, 4) != 0) return 0;
    return ntohs(rdma_get_src_port(listen_));
  }
  // Accepts the first request within `ms`: true once established.
  bool accept(const std::vector<std::uint8_t>& priv, int ms) {
    std::optional<event> e;
    for (int waited = 0; waited < ms && !e; waited += 50) {
      e = ch_.next(50);
      if (e && e->type != RDMA_CM_EVENT_CONNECT_REQUEST) e.reset();
    }
    if (!e) return false;
    conn_ = e->id;
    pd_ = ibv_alloc_pd(conn_->verbs);
    cq_ = pd_ ? ibv_create_cq(conn_->verbs, 256, nullptr, nullptr, 0) : nullptr;
    if (!cq_) return false;
    ibv_qp_init_attr a{};
    a.send_cq = cq_;
    a.recv_cq = cq_;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 64;
    a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    if (rdma_create_qp(conn_, pd_, &a) != 0) return false;
    rdma_conn_param p = conn_param(priv, 0);  // rnr_retry_count 7
    if (rdma_accept(conn_, &p) != 0) return false;
    auto est = ch_.next_for(conn_, ms);
    established_ = est && est->type == RDMA_CM_EVENT_ESTABLISHED;
    return established_;
  }

 private:
  channel ch_;
  rdma_cm_id* listen_ = nullptr;
  rdma_cm_id* conn_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool established_ = false;
};

}  // namespace hostile
