// Loopback benchmark of the transport API (tcp provider unless
// SHUTTLE_TRANSPORT says otherwise): the target runs on its own thread and
// io_context, the initiator on the main thread.
//   - send/recv ping-pong latency (64 B)
//   - one-sided WRITE and READ bandwidth at several sizes, `depth` in flight
//   - fetch_and_add rate
// Usage: tcp_provider_bench [seconds-per-point=1] [depth=16]
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t region_size = 64 << 20;

task<void> serve(listener& l, domain& d, std::vector<std::byte>& mem) {
  auto c = (co_await l.accept()).value();
  auto mr = d.register_memory(mem, access::all).value();
  std::array<std::byte, remote_buffer::wire_size> wire{};
  mr.remote().serialize(wire);
  (void)co_await c.send(wire);
  // Echo until the initiator goes.
  for (;;) {
    auto m = co_await c.recv();
    if (!m) break;
    std::vector<std::byte> copy(m->data().begin(), m->data().end());
    m->reset();
    if (!co_await c.send(copy)) break;
  }
}

double seconds_since(clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); }

task<void> bench(connection& c, remote_buffer rb, double secs, int depth) {
  // Ping-pong latency.
  {
    std::vector<std::byte> msg(64);
    std::size_t n = 0;
    auto t0 = clock::now();
    while (seconds_since(t0) < secs) {
      (void)(co_await c.send(msg)).value();
      auto m = (co_await c.recv()).value();
      ++n;
    }
    double s = seconds_since(t0);
    std::printf("send/recv ping-pong 64 B: %.1f us round trip (%zu)\n", s / n * 1e6, n);
  }
  for (std::size_t size : {std::size_t(4096), std::size_t(65536), std::size_t(1 << 20), std::size_t(8 << 20)}) {
    for (int op = 0; op < 2; ++op) {
      std::vector<std::vector<std::byte>> bufs(depth, std::vector<std::byte>(size));
      std::size_t bytes = 0;
      auto t0 = clock::now();
      while (seconds_since(t0) < secs) {
        std::vector<task<result<void>>> ops;
        for (int i = 0; i < depth; ++i) {
          auto slot = rb.slice((i * size) % (region_size - size + 1), size).value();
          ops.push_back(op == 0 ? c.write(bufs[i], slot) : c.read(bufs[i], slot));
        }
        for (auto& r : co_await when_all(std::move(ops))) r.value();
        bytes += size * depth;
      }
      double s = seconds_since(t0);
      std::printf("%-5s %8zu B x%d: %8.2f GB/s  %9.0f ops/s\n", op == 0 ? "write" : "read", size, depth,
                  bytes / s / 1e9, bytes / size / s);
    }
  }
  {
    std::size_t n = 0;
    auto t0 = clock::now();
    while (seconds_since(t0) < secs) {
      std::vector<task<result<std::uint64_t>>> ops;
      for (int i = 0; i < depth; ++i) ops.push_back(c.fetch_and_add(rb.slice(0, 8).value(), 1));
      for (auto& r : co_await when_all(std::move(ops))) (void)r.value();
      n += depth;
    }
    std::printf("fetch_and_add x%d: %.0f ops/s\n", depth, n / seconds_since(t0));
  }
}

}  // namespace

int main(int argc, char** argv) {
  double secs = argc > 1 ? std::atof(argv[1]) : 1.0;
  int depth = argc > 2 ? std::atoi(argv[2]) : 16;
  std::uint16_t port = 0;
  std::atomic<bool> ready{false};
  std::thread target([&] {
    io_context ctx;
    auto d = domain::open().value();
    auto l = d.listen(endpoint::loopback(0)).value();
    port = l.local_endpoint()->port();
    ready = true;
    std::vector<std::byte> mem(region_size);
    ctx.run(serve(l, d, mem));
    (void)ctx.run(sleep_for(10ms));
  });
  while (!ready) std::this_thread::yield();
  {
    io_context ctx;
    auto d = domain::open().value();
    std::printf("provider: %s\n", d.describe().c_str());
    ctx.run([&]() -> task<void> {
      auto c = (co_await d.connect(endpoint::loopback(port))).value();
      auto m = (co_await c.recv()).value();
      auto rb = remote_buffer::deserialize(m.data().first<remote_buffer::wire_size>());
      m.reset();
      co_await bench(c, rb, secs, depth);
      (void)co_await c.close();
    }());
    (void)ctx.run(sleep_for(10ms));
  }
  target.join();
}
