#include <shuttle/detail/spin_clock.hpp>

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define SHUTTLE_SPIN_CLOCK_TSC 1
#endif

namespace shuttle::detail {

namespace {

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#ifdef SHUTTLE_SPIN_CLOCK_TSC
// The TSC rate, against steady_clock over a short spin. The error is about
// one clock read over the window (under 1% even where a read costs 1.4 us).
struct tsc_scale {
  std::uint64_t tick0 = 0;
  std::int64_t ns0 = 0;
  double ns_per_tick = 0;  // 0: no usable TSC, steady_clock is used

  tsc_scale() noexcept {
    constexpr std::int64_t window_ns = 200'000;
    const std::int64_t t0 = steady_ns();
    const std::uint64_t c0 = __rdtsc();
    std::int64_t t1 = t0;
    while ((t1 = steady_ns()) - t0 < window_ns) {
    }
    const std::uint64_t c1 = __rdtsc();
    if (c1 > c0 + 1000) {
      ns_per_tick = double(t1 - t0) / double(c1 - c0);
      tick0 = c0;
      ns0 = t0;
    }
  }
};
#endif

}  // namespace

std::int64_t spin_clock::now_ns() noexcept {
#ifdef SHUTTLE_SPIN_CLOCK_TSC
  static const tsc_scale scale;
  if (scale.ns_per_tick > 0) {
    // A TSC behind the calibration point (another core's) reads as the origin.
    const std::uint64_t c = __rdtsc();
    return scale.ns0 + (c > scale.tick0 ? std::int64_t(double(c - scale.tick0) * scale.ns_per_tick) : 0);
  }
#endif
  return steady_ns();
}

}  // namespace shuttle::detail
