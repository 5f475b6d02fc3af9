// Event-loop overhead: a nop round trip through shuttle (co_await an
// IORING_OP_NOP in a task) against a raw liburing loop doing the same, with
// the same ring flags, in one run; plus the cost of creating, resuming and
// destroying a coroutine. Prints medians of several rounds and the ratios.
// The same nop round trip is also timed on a spinning loop (the spin-policy
// path of io_context::run_until): once polling the ring (ring_spin_budget),
// once busy-polling a poller that always reports work.
#include <shuttle/detail/uring_op.hpp>
#include <shuttle/shuttle.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace shuttle;
using bench_clock = std::chrono::steady_clock;

namespace {

double raw_liburing_nop(unsigned flags, int n) {
  io_uring ring;
  io_uring_params p{};
  p.flags = flags;
  if (int r = io_uring_queue_init_params(1024, &ring, &p); r < 0) {
    std::fprintf(stderr, "io_uring_queue_init: %s\n", std::strerror(-r));
    std::exit(1);
  }
  auto t0 = bench_clock::now();
  for (int i = 0; i < n; ++i) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, static_cast<std::uint64_t>(i) + 1);
    io_uring_submit_and_wait(&ring, 1);
    io_uring_cqe* cqe;
    while (io_uring_peek_cqe(&ring, &cqe) == 0) {
      if (cqe->user_data == 0) std::abort();
      io_uring_cqe_seen(&ring, cqe);
    }
  }
  auto t1 = bench_clock::now();
  io_uring_queue_exit(&ring);
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

auto nop() {
  return detail::make_uring_awaitable(
      io_context::current(), [](io_uring_sqe* sqe) { io_uring_prep_nop(sqe); },
      [](int res, std::uint32_t) { return res; });
}

task<double> shuttle_nop(int n) {
  auto t0 = bench_clock::now();
  for (int i = 0; i < n; ++i) {
    if (co_await nop() < 0) std::abort();
  }
  auto t1 = bench_clock::now();
  co_return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

// Reports work on every poll, so the loop never leaves its spinning path.
struct busy_poller final : poller {
  bool poll() override { return true; }
  bool try_enter_interrupt_mode() override { return false; }
  void exit_interrupt_mode() override {}
};

task<int> leaf(int v) { co_return v + 1; }

task<double> coroutine_cost(int n) {
  auto t0 = bench_clock::now();
  int acc = 0;
  for (int i = 0; i < n; ++i) acc = co_await leaf(acc);
  auto t1 = bench_clock::now();
  if (acc != n) std::abort();
  co_return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int n = argc > 1 ? std::atoi(argv[1]) : 200000;
  int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  // The flags io_context picks on this kernel (it falls back the same way).
  unsigned flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  {
    io_uring probe;
    io_uring_params p{};
    p.flags = flags;
    if (io_uring_queue_init_params(8, &probe, &p) < 0)
      flags = IORING_SETUP_COOP_TASKRUN;
    else
      io_uring_queue_exit(&probe);
  }
  std::vector<double> raw, sh, co, ring_spin, poller_spin;
  io_context ctx;
  busy_poller busy;
  for (int r = 0; r < rounds; ++r) {
    raw.push_back(raw_liburing_nop(flags, n));
    sh.push_back(ctx.run(shuttle_nop(n)));
    co.push_back(ctx.run(coroutine_cost(n)));
    ctx.set_ring_spin_budget(std::chrono::seconds(1));
    ring_spin.push_back(ctx.run(shuttle_nop(n)));
    ctx.set_ring_spin_budget(std::chrono::nanoseconds(0));
    ctx.backend().add_poller(busy);
    poller_spin.push_back(ctx.run(shuttle_nop(n)));
    ctx.backend().remove_poller(busy);
  }
  double mr = median(raw), ms = median(sh), mc = median(co);
  double mring = median(ring_spin), mpoll = median(poller_spin);
  std::printf("event loop nop round trip (%d ops x %d rounds, median)\n", n, rounds);
  std::printf("  raw liburing       %8.1f ns/op\n", mr);
  std::printf("  shuttle co_await   %8.1f ns/op\n", ms);
  std::printf("  ratio shuttle/raw  %8.3f   (target <= 1.2)\n", ms / mr);
  std::printf("  shuttle, ring spin  %8.1f ns/op   (ring_spin_budget 1 s: never sleeps)\n", mring);
  std::printf("  shuttle, poller spin %7.1f ns/op   (a poller that always reports work)\n", mpoll);
  std::printf("coroutine create + resume + destroy: %.1f ns\n", mc);
  std::printf(
      "{\"raw_ns\":%.1f,\"shuttle_ns\":%.1f,\"ratio\":%.3f,\"coroutine_ns\":%.1f,\"ring_spin_ns\":%.1f,"
      "\"poller_spin_ns\":%.1f}\n",
      mr, ms, ms / mr, mc, mring, mpoll);
  return 0;
}
