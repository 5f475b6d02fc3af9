// What the example servers share beyond the command line: a rate-limited
// error log, and waiting on the main thread for SIGINT/SIGTERM.
//
//   tools::throttled_log log{"shuttle-echo-server"};
//   log("connection from 10.0.0.2:4711 failed: protocol error");
//   ...
//   log.flush();  // at exit: the count of lines held back, if any
//
//   shuttle::block_signals({SIGINT, SIGTERM, SIGPIPE});  // before any thread starts
//   shuttle::signal_set signals{SIGINT, SIGTERM};
//   int sig = ctx.run(tools::wait_for_signal(signals, kProg));
#pragma once

#include <shuttle/shuttle.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace tools {

// At most `lines_per_second` lines a second, from any thread; past it lines
// are counted, and the count is printed ("N similar messages suppressed")
// before the next line shown in a later second, or by flush(). A hostile
// peer can then make the log neither grow without bound nor hide the count.
class throttled_log {
 public:
  explicit throttled_log(const char* prog, unsigned lines_per_second = 5) : prog_(prog), limit_(lines_per_second) {}
  throttled_log(const throttled_log&) = delete;
  throttled_log& operator=(const throttled_log&) = delete;

  void operator()(const std::string& line) {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= std::chrono::seconds(1)) {
      report_suppressed();
      window_start_ = now;
      shown_ = 0;
    }
    if (shown_ >= limit_) {
      ++suppressed_;
      return;
    }
    ++shown_;
    std::fprintf(stderr, "%s: %s\n", prog_, line.c_str());
  }

  void flush() {
    std::lock_guard lock(mutex_);
    report_suppressed();
  }

 private:
  void report_suppressed() {
    if (suppressed_ == 0) return;
    std::fprintf(stderr, "%s: %llu similar messages suppressed\n", prog_, static_cast<unsigned long long>(suppressed_));
    suppressed_ = 0;
  }

  const char* prog_;
  unsigned limit_;
  std::mutex mutex_;
  std::chrono::steady_clock::time_point window_start_{};
  unsigned shown_ = 0;
  std::uint64_t suppressed_ = 0;
};

// The signal that arrived (its number), or 0 when waiting failed (said on
// stderr) or was cancelled.
inline shuttle::task<int> wait_for_signal(shuttle::signal_set& signals, const char* prog) {
  auto r = co_await signals.wait();
  if (!r) {
    if (r.error() != std::errc::operation_canceled)
      std::fprintf(stderr, "%s: waiting for signals failed: %s\n", prog, r.error().message().c_str());
    co_return 0;
  }
  co_return *r;
}

}  // namespace tools
