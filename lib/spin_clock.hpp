// A cheap clock for busy-polling budgets. The loop and the pollers stamp
// their spinning turns with it, where a clock_gettime can cost microseconds
// (an emulated HPET or ACPI PM clocksource: a TCG guest, some VMs) and so
// delay the very completion being polled for. x86: the TSC, scaled by a
// rate measured once per process against steady_clock (about 200 us, on
// first use); elsewhere steady_clock itself. Monotonic per thread where the
// TSC is (invariant TSC); callers treat a step back as "no time passed".
// For budgets of microseconds and up, not for timestamps.
#pragma once

#include <cstdint>

namespace shuttle::detail {

struct spin_clock {
  // Nanoseconds since an arbitrary process-wide origin.
  static std::int64_t now_ns() noexcept;
};

}  // namespace shuttle::detail
