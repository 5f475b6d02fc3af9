// co_await on CUDA events and streams inside the io_context; stream flags.
#include <doctest/doctest.h>

#include "common.hpp"

#include <chrono>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

namespace {
struct mechanism_guard {
  cuda::wait_options saved = cuda::get_wait_options();
  explicit mechanism_guard(cuda::wait_options o) { cuda::set_wait_options(o); }
  ~mechanism_guard() { cuda::set_wait_options(saved); }
};
}  // namespace

TEST_CASE("co_await event: resumes after the kernel, for every mechanism") {
  for (auto m : {cuda::wait_mechanism::hybrid, cuda::wait_mechanism::event_query, cuda::wait_mechanism::host_func}) {
    CAPTURE(cuda::to_string(m));
    mechanism_guard g({m, std::chrono::microseconds(100)});
    io_context ctx;
    cuda::stream s;
    cuda::event ev;
    cuda::reset_wait_stats();
    auto t0 = clk::now();
    auto r = ctx.run([&]() -> task<result<void>> {
      REQUIRE(cuda::kernels::spin(3'000'000, s) == cudaSuccess);
      ev.record(s);
      co_return co_await cuda::wait(ev);
    }());
    CHECK(r.has_value());
    CHECK(clk::now() - t0 >= 3ms);
    CHECK(ev.query());
    auto st = cuda::get_wait_stats();
    CHECK(st.waits == 1);
    switch (m) {
      case cuda::wait_mechanism::event_query:
        CHECK(st.host_funcs == 0);
        CHECK(st.timed_polls == 0);
        break;
      case cuda::wait_mechanism::hybrid:
        // Past the 100 us spin window the loop sleeps between timed polls,
        // each after 1/16 of the wait's age (10 us to 1 ms): a few dozen.
        CHECK(st.host_funcs == 0);
        CHECK(st.timed_polls > 0);
        CHECK(st.timed_polls < 200);
        CHECK(ctx.loop_sleeps() > 0);  // the loop slept instead of spinning 3 ms
        break;
      case cuda::wait_mechanism::host_func:
        CHECK(st.host_funcs == 1);
        CHECK(ctx.loop_sleeps() > 0);
        break;
    }
  }
}

TEST_CASE("co_await: a sleeping poller is woken for a new wait; waits of both kinds complete") {
  // One long wait puts the poller to sleep between timed polls; a short one
  // started later must be polled on every turn again (not after the long
  // wait's timed-poll slice), and both must resume.
  io_context ctx;
  cuda::stream a, b;
  cuda::reset_wait_stats();
  clk::time_point short_done{}, long_done{};
  ctx.run([&]() -> task<void> {
    auto long_wait = [&]() -> task<void> {
      REQUIRE(cuda::kernels::spin(20'000'000, a) == cudaSuccess);  // 20 ms
      CHECK((co_await cuda::wait(a.get())).has_value());
      long_done = clk::now();
    };
    auto short_wait = [&]() -> task<void> {
      (void)co_await sleep_for(10ms);  // the long wait's poller sleeps by now (slices up to ~600 us)
      REQUIRE(cuda::kernels::spin(50'000, b) == cudaSuccess);
      auto t0 = clk::now();
      CHECK((co_await cuda::wait(b.get())).has_value());
      short_done = clk::now();
      CHECK(short_done - t0 < 400us);  // polled on every turn, not at the long wait's next slice
    };
    co_await when_all(long_wait(), short_wait());
  }());
  CHECK(short_done < long_done);
  auto st = cuda::get_wait_stats();
  CHECK(st.waits == 2);
  CHECK(st.timed_polls > 0);
}

TEST_CASE("co_await: an event already complete does not suspend; stream waits") {
  io_context ctx;
  cuda::stream s;
  cuda::event ev;
  ev.record(s);
  s.synchronize();
  cuda::reset_wait_stats();
  auto r = ctx.run([&]() -> task<result<void>> { co_return co_await cuda::wait(ev); }());
  CHECK(r.has_value());
  CHECK(cuda::get_wait_stats().immediate == 1);

  cuda::device_buffer buf(1 << 20);
  auto r2 = ctx.run([&]() -> task<result<void>> {
    REQUIRE(cuda::kernels::spin(500'000, s) == cudaSuccess);
    REQUIRE(cuda::kernels::fill_pattern(buf.data(), buf.size(), 0, 7, s) == cudaSuccess);
    co_return co_await cuda::wait(s);  // records and awaits
  }());
  CHECK(r2.has_value());
  CHECK(cudaStreamQuery(s) == cudaSuccess);
  CHECK(gpu_test::device_checksum(buf.data(), buf.size(), 0, s) == cuda::kernels::pattern_checksum(buf.size(), 0, 7));
}

TEST_CASE("co_await: many waits on independent streams complete in their own order") {
  io_context ctx;
  constexpr int n = 8;
  std::vector<cuda::stream> streams(n);
  std::vector<int> order;
  auto one = [&](int i) -> task<void> {
    REQUIRE(cuda::kernels::spin(std::uint64_t(n - i) * 1'000'000, streams[i]) == cudaSuccess);  // the last is shortest
    auto r = co_await cuda::wait(streams[i].get());
    CHECK(r.has_value());
    order.push_back(i);
  };
  ctx.run([&]() -> task<void> {
    std::vector<task<void>> ts;
    for (int i = 0; i < n; ++i) ts.push_back(one(i));
    co_await when_all(std::move(ts));
  }());
  REQUIRE(order.size() == n);
  for (int i = 0; i < n; ++i) CHECK(order[i] == n - 1 - i);
}

TEST_CASE("co_await: cancellation resumes the waiter; the GPU work goes on") {
  io_context ctx;
  cuda::stream s;
  cuda::event ev;
  cuda::reset_wait_stats();
  auto t0 = clk::now();
  auto r = ctx.run([&]() -> task<result<void>> {
    REQUIRE(cuda::kernels::spin(200'000'000, s) == cudaSuccess);  // 200 ms
    ev.record(s);
    co_return co_await with_timeout(as_task(cuda::wait(ev)), 5ms);
  }());
  CHECK(clk::now() - t0 < 150ms);
  CHECK(r.error() == std::errc::timed_out);
  CHECK(cuda::get_wait_stats().cancelled == 1);
  CHECK(!ev.query());
  s.synchronize();
  // The poller is idle again: a later wait works.
  auto r2 = ctx.run([&]() -> task<result<void>> {
    REQUIRE(cuda::kernels::spin(1'000'000, s) == cudaSuccess);
    co_return co_await cuda::wait(s.get());
  }());
  CHECK(r2.has_value());
}

TEST_CASE("stream_flag: a consumer enqueued before its data waits for the loop") {
  auto f = cuda::features();
  if (!f.stream_mem_ops) {
    MESSAGE("no stream memory operations: skipped");
    return;
  }
  io_context ctx;
  cuda::stream s;
  cuda::device_buffer buf(4 << 20);
  cuda::stream_flag flag;
  cuda::event done;
  REQUIRE(cudaMemsetAsync(buf.data(), 0, buf.size(), s) == cudaSuccess);
  REQUIRE(flag.enqueue_wait(s, 1).has_value());
  REQUIRE(cuda::kernels::fill_pattern(buf.data(), buf.size(), 0, 3, s) == cudaSuccess);
  done.record(s);
  bool ran_early = true;
  auto r = ctx.run([&]() -> task<result<void>> {
    (void)co_await sleep_for(20ms);
    ran_early = done.query();
    flag.set(1);  // the "data arrived" completion, written by the loop
    co_return co_await cuda::wait(done);
  }());
  CHECK(r.has_value());
  CHECK(!ran_early);
  CHECK(gpu_test::device_checksum(buf.data(), buf.size(), 0, s) == cuda::kernels::pattern_checksum(buf.size(), 0, 3));

  // write_from: the stream tells the host (the stream-write-value mechanism).
  cuda::stream_flag back;
  REQUIRE(cuda::kernels::spin(1'000'000, s) == cudaSuccess);
  REQUIRE(back.write_from(s, 42).has_value());
  s.synchronize();
  CHECK(back.load() == 42);
}
