// The rings alone (lib/local_provider/ring.hpp), without the engine: two
// processes, pinned to CPUs 0 and 1, ping-pong a 56-byte record (an 8-byte
// send's frame: a 48-byte header and the payload) through map_rings'
// byte pipes, both sides spinning on read_now. Prints the half round trip
// with the sleepers' membarrier (the publisher does not fence) and with
// both sides fencing, to set against ucp_am_lat (bench/local/ucx_compare.sh)
// and the engine's send_lat (local_bench --peer): what the ring costs, and
// what the engine's path adds.
// Usage: ring_pingpong [seconds per figure, default 1]
#include "../../lib/local_provider/ring.hpp"

#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace lp = shuttle::detail::local_provider;

namespace {

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0) std::perror("sched_setaffinity");
}

constexpr std::size_t frame = 56;

// One side: `first` sends first; returns the round trips done.
long run(shuttle::detail::tcp_provider::byte_pipe& p, bool first, double seconds, double* half_rtt_ns) {
  std::array<std::byte, frame> out{}, in{};
  auto send = [&] {
    iovec v{out.data(), out.size()};
    std::span<iovec> s(&v, 1);
    if (!p.write_now(s) || !s.empty()) std::abort();
  };
  auto recv = [&]() -> bool {
    std::size_t got = 0;
    while (got < frame) {
      auto n = p.read_now(std::span(in).subspan(got));
      if (!n) return false;  // the peer hung up
      got += *n;
    }
    return in[0] != std::byte{0xff};
  };
  long n = 0;
  if (!first) {
    while (recv()) send();
    return 0;
  }
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < 10000; ++i, ++n) {
    send();
    recv();
  }
  const auto t0 = clock::now();
  long k = 0;
  std::chrono::duration<double> el{};
  do {
    for (int i = 0; i < 4096; ++i, ++k) {
      send();
      recv();
    }
    el = clock::now() - t0;
  } while (el.count() < seconds);
  *half_rtt_ns = el.count() * 1e9 / double(k) / 2;
  out[0] = std::byte{0xff};
  send();
  return n + k;
}

double measure(bool asym, double seconds) {
  auto fd = lp::make_ring_memfd();
  int bell[2];
  if (!fd || ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, bell) != 0) std::abort();
  if (asym && !lp::asymmetric_fences_available()) return -1;
  const pid_t child = ::fork();
  if (child == 0) {
    pin(0);
    if (asym && !lp::asymmetric_fences_available()) std::_Exit(1);  // this process registers too
    auto p = lp::map_rings(*fd, false, bell[1], asym);
    if (!p) std::_Exit(1);
    run(**p, false, seconds, nullptr);
    std::_Exit(0);
  }
  pin(1);
  double half = 0;
  {
    auto p = lp::map_rings(*fd, true, bell[0], asym);
    if (!p) std::abort();
    run(**p, true, seconds, &half);
  }
  ::waitpid(child, nullptr, 0);
  ::close(*fd);
  ::close(bell[0]);
  ::close(bell[1]);
  return half;
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  // A, B, B, A: an order effect (the host warming up) shows as a spread.
  const double a1 = measure(true, seconds), f1 = measure(false, seconds);
  const double f2 = measure(false, seconds), a2 = measure(true, seconds);
  std::printf("ring_half_rtt_56B_membarrier_ns %.1f %.1f\nring_half_rtt_56B_fenced_ns %.1f %.1f\n", a1, a2, f1, f2);
  return 0;
}
