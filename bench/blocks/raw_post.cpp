// The floor under blocks_bench's verbs post path: the same list (N blocks
// of B bytes, block i from local slot i to a shuffled remote slot, slots 2B
// apart) posted with plain verbs and nothing of shuttle, on one RC QP whose
// send queue holds the whole list, so that blocks_bench's "post path"
// (post minus rxe's doorbell, per block) can be read against what the
// provider library alone costs, measured in the same guest.
//
// Three ways to post, each timed from the first instruction of the list's
// posting to the return of the call that rings the doorbell:
//   chain  the WRs built and chained before the window; the window is
//          ibv_post_send alone (the provider library's own per-WR work:
//          librxe's validation and WQE copy). No library can post for less
//          through ibv_post_send.
//   build  the WRs built, chained and posted inside the window: the least
//          a library that keeps its own descriptors does per block.
//   wr     the extended post API (ibv_wr_start, ibv_wr_rdma_write or
//          ibv_wr_rdma_read, ibv_wr_set_sge per block, ibv_wr_complete):
//          the provider writes each WQE from the arguments, with no
//          ibv_send_wr in between (where the provider has it: rxe, mlx5).
// With doorbell_shim preloaded (LD_PRELOAD=.../libdoorbell_shim.so), the
// doorbell's time inside the window is subtracted exactly as blocks_bench
// does it ("post path"); without it the post time is printed alone. Under
// valgrind only the windows are collected (--collect-atstart=no), as in
// blocks_bench: RAW=1 bench/blocks/insn-post.sh runs it.
//
// The target is a child process (forked first): it registers N*2B bytes,
// accepts one connection and hands its address and rkey over a pipe.
//
// Usage: raw_post --addr IP [--blocks N] [--block-size B] [--iters K] [--read]
//                 [--mode chain|build|wr|all]
#include "doorbell_shim.h"

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define RAW_TOGGLE_COLLECT() CALLGRIND_TOGGLE_COLLECT
#else
#define RAW_TOGGLE_COLLECT() ((void)0)
#endif

#include <dlfcn.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using bench_clock = std::chrono::steady_clock;

struct config {
  std::string addr;
  std::size_t blocks = 1000, block_size = 4096, iters = 5;
  bool read = false;
  std::string mode = "all";
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: raw_post --addr IP [--blocks N] [--block-size B] [--iters K] [--read] "
               "[--mode chain|build|wr|all]\n");
  std::exit(2);
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    auto number = [&]() -> std::size_t {
      std::string v = value();
      char* end = nullptr;
      unsigned long long n = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n == 0) usage();
      return static_cast<std::size_t>(n);
    };
    if (a == "--addr") c.addr = value();
    else if (a == "--blocks") c.blocks = number();
    else if (a == "--block-size") c.block_size = number();
    else if (a == "--iters") c.iters = number();
    else if (a == "--read") c.read = true;
    else if (a == "--mode") c.mode = value();
    else usage();
  }
  if (c.addr.empty() || (c.mode != "chain" && c.mode != "build" && c.mode != "wr" && c.mode != "all")) usage();
  return c;
}

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "raw_post: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

struct remote_info {
  std::uint64_t addr;
  std::uint32_t rkey;
  std::uint16_t port;
};

rdma_addrinfo* resolve(const config& c, const char* port, bool passive) {
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  if (passive) hints.ai_flags = RAI_PASSIVE;
  rdma_addrinfo* res = nullptr;
  if (rdma_getaddrinfo(c.addr.c_str(), port, &hints, &res) != 0) die("rdma_getaddrinfo");
  return res;
}

ibv_qp_init_attr_ex qp_attr(ibv_pd* pd, std::uint32_t send_depth, bool wr_api) {
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = send_depth;
  a.cap.max_recv_wr = 1;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
  a.pd = pd;
  a.comp_mask = IBV_QP_INIT_ATTR_PD;
  if (wr_api) {
    a.comp_mask |= IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ;
  }
  return a;
}

// The target: N*2B registered bytes, one connection accepted; the address,
// rkey and port go to the initiator over `fd`; it waits for the initiator
// to close its end of `done`.
int target(const config& c, int fd, int done) {
  rdma_addrinfo* res = resolve(c, "0", true);
  rdma_cm_id* listen_id = nullptr;
  if (rdma_create_ep(&listen_id, res, nullptr, nullptr) != 0) die("rdma_create_ep (target)");
  rdma_freeaddrinfo(res);
  if (rdma_listen(listen_id, 1) != 0) die("rdma_listen");
  if (!listen_id->verbs) {
    std::fprintf(stderr, "raw_post: %s is not an RDMA device's address\n", c.addr.c_str());
    return 1;
  }
  ibv_pd* pd = ibv_alloc_pd(listen_id->verbs);
  if (!pd) die("ibv_alloc_pd (target)");
  std::vector<char> mem(c.blocks * 2 * c.block_size);
  ibv_mr* mr = ibv_reg_mr(pd, mem.data(), mem.size(),
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr) die("ibv_reg_mr (target)");
  remote_info info{reinterpret_cast<std::uintptr_t>(mem.data()), mr->rkey, ntohs(rdma_get_src_port(listen_id))};
  if (::write(fd, &info, sizeof info) != sizeof info) die("write (target)");
  rdma_cm_id* id = nullptr;
  if (rdma_get_request(listen_id, &id) != 0) die("rdma_get_request");
  ibv_qp_init_attr_ex a = qp_attr(pd, 1, false);
  if (rdma_create_qp_ex(id, &a) != 0) die("rdma_create_qp_ex (target)");
  if (rdma_accept(id, nullptr) != 0) die("rdma_accept");
  char byte;
  while (::read(done, &byte, 1) > 0) {
  }
  rdma_disconnect(id);
  rdma_destroy_qp(id);
  rdma_destroy_id(id);
  ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  rdma_destroy_ep(listen_id);
  return 0;
}

shuttle_doorbell_counts doorbells() {
  static const auto f = reinterpret_cast<shuttle_doorbell_read_fn>(dlsym(RTLD_DEFAULT, "shuttle_doorbell_read"));
  shuttle_doorbell_counts d{};
  if (f) f(&d);
  return d;
}

std::uint64_t page_faults() {
  rusage u{};
  ::getrusage(RUSAGE_THREAD, &u);
  return static_cast<std::uint64_t>(u.ru_minflt + u.ru_majflt);
}

struct sample {
  double post_us = 0, bell_us = 0;
  std::uint64_t bells = 0, faults = 0;
};

struct initiator {
  const config& c;
  remote_info remote{};
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_qp_ex* qpx = nullptr;  // null: the provider has no extended post API
  std::vector<char> mem;
  ibv_mr* mr = nullptr;
  std::vector<std::uint64_t> remote_addr;  // block i's remote address
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;

  initiator(const config& cfg, remote_info r) : c(cfg), remote(r) {}

  void connect() {
    rdma_addrinfo* res = resolve(c, std::to_string(remote.port).c_str(), false);
    if (rdma_create_ep(&id, res, nullptr, nullptr) != 0) die("rdma_create_ep (initiator)");
    rdma_freeaddrinfo(res);
    pd = ibv_alloc_pd(id->verbs);
    if (!pd) die("ibv_alloc_pd");
    const auto depth = static_cast<std::uint32_t>(c.blocks + 1);
    ibv_qp_init_attr_ex a = qp_attr(pd, depth, true);
    if (rdma_create_qp_ex(id, &a) != 0) {
      std::printf("raw_post: no extended post API here (%s): mode wr not measured\n", std::strerror(errno));
      a = qp_attr(pd, depth, false);
      if (rdma_create_qp_ex(id, &a) != 0) die("rdma_create_qp_ex");
    } else {
      qpx = ibv_qp_to_qp_ex(id->qp);
    }
    if (rdma_connect(id, nullptr) != 0) die("rdma_connect");
    mem.assign(c.blocks * c.block_size, 1);
    mr = ibv_reg_mr(pd, mem.data(), mem.size(), static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
    if (!mr) die("ibv_reg_mr");
    std::vector<std::size_t> slot(c.blocks);
    std::iota(slot.begin(), slot.end(), std::size_t{0});
    std::shuffle(slot.begin(), slot.end(), std::mt19937_64(42));
    for (std::size_t s : slot) remote_addr.push_back(remote.addr + s * 2 * c.block_size);
    wrs.resize(c.blocks);
    sges.resize(c.blocks);
  }

  // The whole list as one chain, block i's WR and sge; the last signaled.
  [[gnu::noinline]] void build() noexcept {
    const ibv_wr_opcode op = c.read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    const std::size_t n = c.blocks;
    const auto len = static_cast<std::uint32_t>(c.block_size);
    const std::uint32_t lkey = mr->lkey, rkey = remote.rkey;
    const auto base = reinterpret_cast<std::uintptr_t>(mem.data());
    for (std::size_t i = 0; i < n; ++i) {
      ibv_sge& s = sges[i];
      s.addr = base + i * c.block_size;
      s.length = len;
      s.lkey = lkey;
      ibv_send_wr& w = wrs[i];
      w.wr_id = i;
      w.next = i + 1 < n ? &wrs[i + 1] : nullptr;
      w.sg_list = &s;
      w.num_sge = 1;
      w.opcode = op;
      w.send_flags = i + 1 < n ? 0 : IBV_SEND_SIGNALED;
      w.wr.rdma.remote_addr = remote_addr[i];
      w.wr.rdma.rkey = rkey;
    }
  }

  int post_chain() noexcept {
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(id->qp, wrs.data(), &bad);
  }

  [[gnu::noinline]] int post_wr_api() noexcept {
    const std::size_t n = c.blocks;
    const auto len = static_cast<std::uint32_t>(c.block_size);
    const std::uint32_t lkey = mr->lkey, rkey = remote.rkey;
    const auto base = reinterpret_cast<std::uintptr_t>(mem.data());
    ibv_wr_start(qpx);
    for (std::size_t i = 0; i < n; ++i) {
      qpx->wr_id = i;
      qpx->wr_flags = i + 1 < n ? 0 : IBV_SEND_SIGNALED;
      if (c.read) ibv_wr_rdma_read(qpx, rkey, remote_addr[i]);
      else ibv_wr_rdma_write(qpx, rkey, remote_addr[i]);
      ibv_wr_set_sge(qpx, lkey, base + i * c.block_size, len);
    }
    return ibv_wr_complete(qpx);
  }

  void wait_completion() {
    ibv_wc wc{};
    int n = 0;
    while ((n = ibv_poll_cq(id->send_cq, 1, &wc)) == 0) {
    }
    if (n < 0) die("ibv_poll_cq");
    if (wc.status != IBV_WC_SUCCESS) {
      std::fprintf(stderr, "raw_post: the list completed with %s\n", ibv_wc_status_str(wc.status));
      std::exit(1);
    }
  }

  // One list: posted inside the window, then waited for.
  sample one(const std::string& mode, bool profile) {
    if (mode == "chain") build();
    const auto d0 = doorbells();
    const auto f0 = page_faults();
    if (profile) RAW_TOGGLE_COLLECT();
    const auto t0 = bench_clock::now();
    int rc = 0;
    if (mode == "chain") {
      rc = post_chain();
    } else if (mode == "build") {
      build();
      rc = post_chain();
    } else {
      rc = post_wr_api();
    }
    const auto t1 = bench_clock::now();
    if (profile) RAW_TOGGLE_COLLECT();
    const auto d1 = doorbells();
    const auto f1 = page_faults();
    if (rc != 0) {
      std::fprintf(stderr, "raw_post: posting (%s) failed: %s\n", mode.c_str(), std::strerror(rc));
      std::exit(1);
    }
    wait_completion();
    sample s;
    s.post_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    s.bell_us = double(d1.post_send_ns - d0.post_send_ns) * 1e-3;
    s.bells = d1.post_send_calls - d0.post_send_calls;
    s.faults = f1 - f0;
    return s;
  }

  void row(const std::string& mode) {
    if (mode == "wr" && !qpx) return;
    for (int w = 0; w < 2; ++w) one(mode, false);  // warm-up
    std::vector<sample> v;
    for (std::size_t k = 0; k < c.iters; ++k) v.push_back(one(mode, true));
    double post = 0, bell = 0, path = 0, path_min = 1e300, faults = 0, bells = 0;
    for (auto& s : v) {
      post += s.post_us;
      bell += s.bell_us;
      path += s.post_us - s.bell_us;
      path_min = std::min(path_min, s.post_us - s.bell_us);
      faults += double(s.faults);
      bells += double(s.bells);
    }
    const double k = double(v.size()), n = double(c.blocks);
    std::printf("raw %-6s %s %zu x %zu: post %.1f us avg, doorbells %.1f per list (%.1f us avg), "
                "page faults %.1f per list\n",
                mode.c_str(), c.read ? "read " : "write", c.blocks, c.block_size, post / k, bells / k, bell / k,
                faults / k);
    if (bells == 0)
      std::printf("raw %-6s post path not measured: the shim saw no doorbell (not preloaded, or not rxe)\n",
                  mode.c_str());
    else
      std::printf("raw %-6s post path (post minus doorbells): %.1f ns/block avg, %.1f ns/block min\n",
                  mode.c_str(), path / k * 1e3 / n, path_min * 1e3 / n);
  }

  void close() {
    rdma_disconnect(id);
    ibv_dereg_mr(mr);
    rdma_destroy_qp(id);
    ibv_dealloc_pd(pd);
    rdma_destroy_ep(id);
  }
};

}  // namespace

int main(int argc, char** argv) {
  config c = parse(argc, argv);
  int info_pipe[2], done_pipe[2];
  if (::pipe(info_pipe) != 0 || ::pipe(done_pipe) != 0) die("pipe");
  pid_t child = ::fork();  // first: before any verbs state exists
  if (child < 0) die("fork");
  if (child == 0) {
    ::close(info_pipe[0]);
    ::close(done_pipe[1]);
    std::_Exit(target(c, info_pipe[1], done_pipe[0]));
  }
  ::close(info_pipe[1]);
  ::close(done_pipe[0]);
  remote_info r{};
  if (::read(info_pipe[0], &r, sizeof r) != sizeof r) {
    std::fprintf(stderr, "raw_post: the target did not start\n");
    ::waitpid(child, nullptr, 0);
    return 1;
  }
  initiator in(c, r);
  in.connect();
  for (const char* m : {"chain", "build", "wr"})
    if (c.mode == "all" || c.mode == m) in.row(m);
  in.close();
  ::close(done_pipe[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
