// A client of an echo server written against librdmacm alone (rdma_cma.h and
// its rdma_verbs.h helpers, as librdmacm's own rdma_client example): no
// shuttle code, no private data in its connect request. It sends messages of
// a few sizes and checks that each comes back whole.
//
//   plain_echo_client HOST PORT [ROUNDS]
//
// Exit status: 0 every echo verified; 3 the connection was not made (a
// server that does not take plain peers rejects it); 1 anything else.
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

struct endpoint_guard {
  rdma_cm_id* id = nullptr;
  rdma_addrinfo* res = nullptr;
  ibv_mr* send_mr = nullptr;
  ibv_mr* recv_mr = nullptr;
  bool connected = false;
  ~endpoint_guard() {
    if (connected) rdma_disconnect(id);
    if (send_mr) rdma_dereg_mr(send_mr);
    if (recv_mr) rdma_dereg_mr(recv_mr);
    if (id) rdma_destroy_ep(id);
    if (res) rdma_freeaddrinfo(res);
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: plain_echo_client HOST PORT [ROUNDS]\n");
    return 2;
  }
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 20;
  constexpr std::size_t max_size = 65536;  // the echo server's default --max-message
  const std::size_t sizes[] = {1, 64, 1000, 4096, max_size};

  endpoint_guard ep;
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  if (rdma_getaddrinfo(argv[1], argv[2], &hints, &ep.res) != 0) {
    std::perror("rdma_getaddrinfo");
    return 1;
  }
  ibv_qp_init_attr attr{};
  attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
  attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
  attr.sq_sig_all = 1;
  if (rdma_create_ep(&ep.id, ep.res, nullptr, &attr) != 0) {
    std::perror("rdma_create_ep");
    return 1;
  }
  std::vector<unsigned char> out(max_size), in(max_size);
  ep.send_mr = rdma_reg_msgs(ep.id, out.data(), out.size());
  ep.recv_mr = rdma_reg_msgs(ep.id, in.data(), in.size());
  if (!ep.send_mr || !ep.recv_mr) {
    std::perror("rdma_reg_msgs");
    return 1;
  }
  // The first reply's receive is posted before the connection exists.
  if (rdma_post_recv(ep.id, nullptr, in.data(), in.size(), ep.recv_mr) != 0) {
    std::perror("rdma_post_recv");
    return 1;
  }
  if (rdma_connect(ep.id, nullptr) != 0) {  // no private data: not a shuttle peer
    std::perror("rdma_connect");
    return 3;
  }
  ep.connected = true;
  int verified = 0;
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t n : sizes) {
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<unsigned char>(i * 31 + r * 7 + n);
      if (rdma_post_send(ep.id, nullptr, out.data(), n, ep.send_mr, 0) != 0) {
        std::perror("rdma_post_send");
        return 1;
      }
      ibv_wc wc{};
      if (rdma_get_send_comp(ep.id, &wc) <= 0 || wc.status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "send of %zu bytes: %s\n", n, ibv_wc_status_str(wc.status));
        return 1;
      }
      if (rdma_get_recv_comp(ep.id, &wc) <= 0 || wc.status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "echo of %zu bytes: %s\n", n, ibv_wc_status_str(wc.status));
        return 1;
      }
      if (wc.byte_len != n || std::memcmp(in.data(), out.data(), n) != 0 || (wc.wc_flags & IBV_WC_WITH_IMM)) {
        std::fprintf(stderr, "echo of %zu bytes: %u bytes came back, %s\n", n, wc.byte_len,
                     (wc.wc_flags & IBV_WC_WITH_IMM) ? "with an immediate" : "different");
        return 1;
      }
      ++verified;
      // The next reply's receive, before the next send.
      if (rdma_post_recv(ep.id, nullptr, in.data(), in.size(), ep.recv_mr) != 0) {
        std::perror("rdma_post_recv");
        return 1;
      }
    }
  }
  std::printf("plain client: %d echoes verified\n", verified);
  return 0;
}
