// How a loop learns that GPU work finished: the candidate mechanisms, raw and
// through co_await in the io_context, against a spinning cudaEventSynchronize
// (cudaDeviceScheduleSpin) measured in the same run. Per kernel duration:
// mean and p99 of launch-to-wake time, overhead beyond the kernel, and CPU
// use (process CPU time / wall time, CUDA's own threads included).
//
//   gpu_wait_bench [scale]     (scale multiplies the iteration counts; default 1)
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

  for (auto [ns, iters0] : loads) {
    int iters = std::max(20, int(iters0 * scale));
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
    for (auto m : {cuda::wait_mechanism::event_query, cuda::wait_mechanism::hybrid, cuda::wait_mechanism::host_func}) {
      cuda::set_wait_options({m, std::chrono::microseconds(200)});
      cuda::reset_wait_stats();
      auto r = ctx.run(measure_co(iters, ns, s, ev, false));
      auto st = cuda::get_wait_stats();
      char name[64];
      std::snprintf(name, sizeof name, "co_await event (%s)", cuda::to_string(m));
      row(name, r, base, ns);
      std::printf("  %-34s queries/wait %.1f  host funcs/wait %.2f  loop sleeps %llu\n", "", double(st.queries) / double(st.waits ? st.waits : 1),
                  double(st.host_funcs) / double(st.waits ? st.waits : 1), (unsigned long long)ctx.loop_sleeps());
    }
    // co_await stream (records a pooled event), hybrid.
    cuda::set_wait_options({});
    auto r = ctx.run(measure_co(iters, ns, s, ev, true));
    row("co_await stream (hybrid)", r, base, ns);
  }
  ::close(efd);
  return 0;
}
