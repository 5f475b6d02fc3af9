// How a loop learns that GPU work finished: the candidate mechanisms, raw and
// through co_await in the io_context, against a spinning cudaEventSynchronize
// (cudaDeviceScheduleSpin) measured in the same run. Per kernel duration:
// mean and p99 of launch-to-wake time, overhead beyond the kernel, and CPU
// use (process CPU time / wall time, CUDA's own threads included).
//
//   gpu_wait_bench [scale [sweep]]   (scale multiplies the iteration counts,
//                                    default 1; sweep: also the hybrid's
//                                    spin and sleep_divisor settings)
//
// H200 (nvidia-h200 machine, 2026-11-29), ratio of the mean to
// cudaEventSynchronize's, and CPU where below 100%; ranges over six runs:
//
//   kernel                          0 us        20 us       200 us            2 ms
//   raw cudaEventQuery poll         0.97-1.00   0.98-1.01   1.00              1.00
//   raw stream write value + poll   0.85-0.95   0.95-0.99   1.00-1.01         1.00
//   raw host func + eventfd read    3.0-5.5     2.3-2.8     1.37-1.60 17-24%  1.08-1.10  4-6%
//   co_await event_query            0.90-1.05   0.97-1.03   1.00-1.01         1.00
//   co_await host_func              0.90-1.04   0.97-1.03   1.30-1.54 37-44%  1.08-1.11  7-9%
//   co_await hybrid (default)       0.90-1.04   0.96-1.02   1.03-1.07 57-68%  1.03       15-19%
//   before: spin 200 us then
//   host func + eventfd             1.115       0.99        1.02 113%         1.086 15%
//
// The sweep (spin 50/100/200 us x age/8, /16, /32) put the default at spin
// 50 us, age/16: /8 wakes 5-10% late, /32 costs 5-10 points of CPU more at
// 2 ms for 1.5% less, and a longer spin costs CPU at 200 us for nothing.
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/shuttle.hpp>

#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string_view>
#include <vector>

using namespace shuttle;
using clk = std::chrono::steady_clock;

namespace {
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

struct result_t {
  double mean_us = 0, p50_us = 0, p99_us = 0, cpu = 0;
};

result_t summarize(std::vector<double>& v, double cpu, double wall) {
  std::sort(v.begin(), v.end());
  result_t r;
  double s = 0;
  for (double x : v) s += x;
  r.mean_us = s / double(v.size());
  r.p50_us = v[v.size() / 2];
  r.p99_us = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  r.cpu = cpu / wall;
  return r;
}

// Runs `iters` times: launch a spin of `ns`, then `wait()`; times each.
template <class Wait>
result_t measure(int iters, std::uint64_t ns, cudaStream_t s, Wait&& wait) {
  std::vector<double> v;
  v.reserve(iters);
  for (int i = 0; i < 20; ++i) {  // warm-up
    (void)cuda::kernels::spin(ns, s);
    wait(i);
  }
  double c0 = cpu_seconds();
  auto w0 = clk::now();
  for (int i = 0; i < iters; ++i) {
    auto t0 = clk::now();
    (void)cuda::kernels::spin(ns, s);
    wait(i);
    v.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
  }
  double wall = std::chrono::duration<double>(clk::now() - w0).count();
  return summarize(v, cpu_seconds() - c0, wall);
}

// The same, inside one coroutine on the io_context: co_await per iteration.
task<result_t> measure_co(int iters, std::uint64_t ns, cudaStream_t s, cudaEvent_t ev, bool stream_wait) {
  std::vector<double> v;
  v.reserve(iters);
  double c0 = 0;
  auto w0 = clk::now();
  for (int i = -20; i < iters; ++i) {
    if (i == 0) {
      c0 = cpu_seconds();
      w0 = clk::now();
    }
    auto t0 = clk::now();
    (void)cuda::kernels::spin(ns, s);
    result<void> r;
    if (stream_wait) {
      r = co_await cuda::wait(s);
    } else {
      (void)cudaEventRecord(ev, s);
      r = co_await cuda::wait(ev);
    }
    if (!r) std::abort();
    if (i >= 0) v.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
  }
  double wall = std::chrono::duration<double>(clk::now() - w0).count();
  co_return summarize(v, cpu_seconds() - c0, wall);
}

void row(const char* name, const result_t& r, const result_t& base, std::uint64_t ns) {
  std::printf("  %-34s mean %9.2f us  p50 %9.2f  p99 %9.2f  over kernel %8.2f us  CPU %5.1f%%  ratio %.3f\n", name,
              r.mean_us, r.p50_us, r.p99_us, r.mean_us - double(ns) / 1000.0, r.cpu * 100, r.mean_us / base.mean_us);
}
}  // namespace

int main(int argc, char** argv) {
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  double scale = argc > 1 ? std::atof(argv[1]) : 1.0;
  const bool sweep = argc > 2 && std::string_view(argv[2]) == "sweep";
  if (cudaSetDeviceFlags(cudaDeviceScheduleSpin) != cudaSuccess) std::puts("warning: cudaDeviceScheduleSpin refused");
  std::printf("gpu_wait_bench: %s\n", cuda::describe_device(0).c_str());
  cuda::stream s;
  cuda::event ev;
  cuda::stream_flag flag;
  int efd = eventfd(0, EFD_CLOEXEC);
  io_context ctx;

  struct workload {
    std::uint64_t ns;
    int iters;
  } loads[] = {{0, 5000}, {20'000, 3000}, {200'000, 1000}, {2'000'000, 200}};

  for (const workload& load : loads) {
    const std::uint64_t ns = load.ns;  // a plain variable: lambdas below capture it (clang 14: no bindings)
    int iters = std::max(20, int(load.iters * scale));
    std::printf("kernel %.0f us, %d iterations:\n", double(ns) / 1000.0, iters);
    auto base = measure(iters, ns, s, [&](int) {
      ev.record(s);
      cuda::check(cudaEventSynchronize(ev), "sync");
    });
    row("cudaEventSynchronize (spin)", base, base, ns);
    // Raw mechanisms, a bare thread waiting.
    row("raw cudaEventQuery poll", measure(iters, ns, s, [&](int) {
          ev.record(s);
          while (cudaEventQuery(ev) == cudaErrorNotReady) {
          }
        }), base, ns);
    row("raw host func + eventfd read", measure(iters, ns, s, [&](int) {
          cuda::check(cudaLaunchHostFunc(
                          s, [](void* p) {
                            std::uint64_t one = 1;
                            [[maybe_unused]] auto n = ::write(*static_cast<int*>(p), &one, 8);
                          },
                          &efd),
                      "host func");
          std::uint64_t v;
          [[maybe_unused]] auto n = ::read(efd, &v, 8);
        }), base, ns);
    std::uint32_t seq = 0;
    row("raw stream write value + poll", measure(iters, ns, s, [&](int) {
          ++seq;
          (void)flag.write_from(s, seq);
          while (flag.load() != seq) {
          }
        }), base, ns);
    // Through the loop.
    auto through_loop = [&](const char* label, cuda::wait_options o, bool stream_wait) {
      cuda::set_wait_options(o);
      cuda::reset_wait_stats();
      auto sleeps0 = ctx.loop_sleeps();
      auto r = ctx.run(measure_co(iters, ns, s, ev, stream_wait));
      auto st = cuda::get_wait_stats();
      row(label, r, base, ns);
      double w = double(st.waits ? st.waits : 1);
      std::printf("  %-34s queries/wait %.1f  host funcs/wait %.2f  timed polls/wait %.1f  loop sleeps/wait %.1f\n", "",
                  double(st.queries) / w, double(st.host_funcs) / w, double(st.timed_polls) / w,
                  double(ctx.loop_sleeps() - sleeps0) / w);
    };
    for (auto m : {cuda::wait_mechanism::event_query, cuda::wait_mechanism::host_func, cuda::wait_mechanism::hybrid}) {
      char name[64];
      std::snprintf(name, sizeof name, "co_await event (%s)", cuda::to_string(m));
      cuda::wait_options o;
      o.mechanism = m;
      through_loop(name, o, false);
    }
    through_loop("co_await stream (hybrid)", {}, true);
    // The hybrid's two settings, where they matter (waits past the spin window).
    if (sweep && ns >= 200'000) {
      for (int spin_us : {50, 100, 200})
        for (unsigned div : {8u, 16u, 32u}) {
          cuda::wait_options o;
          o.spin = std::chrono::microseconds(spin_us);
          o.sleep_divisor = div;
          char name[64];
          std::snprintf(name, sizeof name, "  hybrid spin %d us, age/%u", spin_us, div);
          through_loop(name, o, false);
        }
    }
    cuda::set_wait_options({});
  }
  ::close(efd);
  return 0;
}
