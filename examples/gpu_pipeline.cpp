// gpu_pipeline: a producer kernel fills chunk i while chunk i-1 is on the
// wire; the receiver is notified per chunk (write_with_imm), copies it in on
// its stream and a consumer kernel checksums it; checksums are verified end
// to end. Over the tcp provider (staged through pinned bounce buffers) on
// loopback, sender and receiver on one loop; --transport local or auto (the
// local provider: both ends are on this host) take the local provider.
// SHUTTLE_GPUS=A,B puts the producer on GPU A and the consumer on GPU B
// (issue 33: two GPUs of one host; the receiver then runs a loop of its own
// on a second thread, on which B is the current GPU; --two-loops does that
// on one GPU too).
//
//   shuttle-gpu-pipeline [MiB=256] [chunk KiB=1024] [rounds=16] [--transport tcp|local|auto] [--two-loops]
//   (--help: more)
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/cuda/staged.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include "cli.hpp"
#include "gpus_env.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace shuttle;

int main(int argc, char** argv) {
  std::size_t mib = 256, chunk_kib = 1024;
  unsigned rounds = 16;
  transport_kind kind = transport_kind::tcp;
  CLI::App app{"A staged GPU pipeline on loopback (tcp provider unless --transport), checksums verified per chunk.",
               "shuttle-gpu-pipeline"};
  cli::setup(app,
             "usage: shuttle-gpu-pipeline [MiB] [CHUNK_KiB] [ROUNDS] [--transport tcp|local|auto] [--two-loops]\n");
  bool two_loops = false;
  app.add_flag("--two-loops", two_loops,
               "the receiver on a thread and loop of its own, as with SHUTTLE_GPUS=A,B and A != B (which imply it)");
  app.add_option_function<std::string>(
         "--transport", [&](const std::string& v) { kind = *parse_transport_kind(v); },
         "tcp (default), local or auto (automatic: the local provider, both ends being on this host)")
      ->type_name("T")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            auto k = parse_transport_kind(v);
            return k && *k != transport_kind::verbs ? "" : "bad value '" + v + "' (tcp, local, auto)";
          },
          "", "transport"));
  app.add_option("MiB", mib, "MiB to transfer (default 256)")->type_name("")->transform(cli::count(1, 1u << 16));
  app.add_option("CHUNK_KiB", chunk_kib, "KiB per chunk (default 1024)")->type_name("")->transform(cli::count(1, 1u << 20));
  app.add_option("ROUNDS", rounds, "compute rounds of the producer and consumer kernels, their load (default 16)")->type_name("")->transform(cli::count(1, 1u << 20));
  cli::parse(app, argc, argv);
  if (cuda::device_count() == 0) {
    std::puts("no CUDA device");
    return 77;
  }
  std::string why;
  const auto gpus = shuttle_gpus::from_env(cuda::device_count(), why);
  if (!why.empty()) cli::fail(app, why);
  const std::size_t len = mib << 20;
  const std::size_t chunk = chunk_kib << 10;
  const std::size_t chunks = (len + chunk - 1) / chunk;
  domain_options dopt;
  dopt.kind = kind;
  cuda::staged_options o;
  o.chunk = chunk;
  io_context ctx;  // (first: outlives the connections)

  // The receiving end (consumer, GPU B) and the sending end (producer, GPU
  // A). On one GPU both run on this thread's loop; on two, the receiver has
  // a thread and a loop of its own, on which GPU B is current (a kernel is
  // launched, and an event recorded, on the current GPU's streams only).
  struct receiver_end {
    std::optional<domain> d;
    listener l;
    connection c;
    cuda::gpu_receiver rcv;
    std::optional<cuda::stream> s;
    cuda::device_buffer dst;
    unsigned long long* sums = nullptr;
    std::vector<unsigned long long> got;
    std::size_t notified = 0;
    result<void> r;
  } rx;
  struct sender_end {
    std::optional<domain> d;
    connection c;
    std::optional<cuda::gpu_registry> reg;
    cuda::gpu_sender snd;
    std::optional<cuda::stream> s;
    cuda::device_buffer src;
    unsigned long long* sums = nullptr;
    result<void> r;
  } tx;
  auto fail = [](const char* what, const std::error_code& ec) {
    std::fprintf(stderr, "shuttle-gpu-pipeline: %s: %s\n", what, ec.message().c_str());
    std::exit(1);
  };
  auto set_up = [&](auto& e) {  // on the end's GPU
    e.s.emplace();
    cuda::check(cudaMalloc(reinterpret_cast<void**>(&e.sums), chunks * 8), "cudaMalloc");
    cuda::check(cudaMemset(e.sums, 0, chunks * 8), "memset");
  };
  // Called on the receiver's GPU: its domain and listener; the port.
  auto rx_listen = [&]() {
    auto d = domain::open(dopt);
    if (!d) fail("receiver: domain", d.error());
    rx.d.emplace(std::move(*d));
    auto l = rx.d->listen(endpoint::parse("127.0.0.1:0").value());
    if (!l) fail("receiver: listen", l.error());
    rx.l = std::move(*l);
    rx.dst = cuda::device_buffer(len);
    set_up(rx);
    return rx.l.local_endpoint()->port();
  };
  auto tx_prepare = [&]() {
    auto d = domain::open(dopt);
    if (!d) fail("sender: domain", d.error());
    tx.d.emplace(std::move(*d));
    tx.reg.emplace(*tx.d);
    tx.src = cuda::device_buffer(len);
    set_up(tx);
  };
  auto rx_open = [&]() -> task<void> {
    auto c = co_await rx.l.accept();
    if (!c) fail("receiver: accept", c.error());
    rx.c = std::move(*c);
    auto r = co_await cuda::gpu_receiver::open(rx.c, *rx.d, o);
    if (!r) fail("receiver: open", r.error());
    rx.rcv = std::move(*r);
  };
  auto tx_open = [&](std::uint16_t port) -> task<void> {
    auto c = co_await tx.d->connect(endpoint::parse("127.0.0.1:" + std::to_string(port)).value());
    if (!c) fail("sender: connect", c.error());
    tx.c = std::move(*c);
    auto r = co_await cuda::gpu_sender::open(tx.c, *tx.d, &*tx.reg);
    if (!r) fail("sender: open", r.error());
    tx.snd = std::move(*r);
  };
  auto produce = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t st) {
    cuda::check(cuda::kernels::produce(tx.src.data() + off, n, off, 2024, rounds, st), "produce");
    cuda::check(cuda::kernels::checksum(tx.src.data() + off, n, off, tx.sums + i, st), "checksum");
  };
  auto consume = [&](std::size_t i, std::size_t off, std::size_t n, cudaStream_t st) {
    ++rx.notified;  // per-chunk notification: the chunk's H2D copy is enqueued before this kernel
    cuda::check(cuda::kernels::consume(rx.dst.data() + off, n, off, rounds, rx.sums + i, st), "consume");
  };
  auto rx_run = [&]() -> task<void> {
    rx.r = co_await rx.rcv.recv(rx.dst.data(), len, rx.s->get(), consume);
    (void)co_await cuda::wait(rx.s->get());
  };
  auto tx_run = [&]() -> task<void> { tx.r = co_await tx.snd.send(tx.src.data(), len, tx.s->get(), produce); };
  auto rx_finish = [&]() {  // on the receiver's GPU
    rx.got.resize(chunks);
    cuda::check(cudaMemcpy(rx.got.data(), rx.sums, chunks * 8, cudaMemcpyDeviceToHost), "copy");
  };

  cuda::check(cudaSetDevice(gpus.self), "cudaSetDevice");
  double secs = 0;
  if (gpus.self == gpus.peer && !two_loops) {
    const std::uint16_t port = rx_listen();
    tx_prepare();
    ctx.run(when_all(rx_open(), tx_open(port)));
    auto t0 = std::chrono::steady_clock::now();
    ctx.run(when_all(tx_run(), rx_run()));
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rx_finish();
    ctx.run([&]() -> task<void> {
      (void)co_await tx.c.close();
      (void)co_await rx.c.close();
    }());
  } else {
    // Each end's loop runs from its connection's opening to the end of
    // both closes: a loop that stops while its peer still waits for an
    // acknowledgement or a credit from it would hold the peer for ever.
    // So the two threads meet by flags, their loops turning meanwhile; an
    // end that throws raises `failed`, and the other stops waiting for it.
    std::promise<std::uint16_t> port;
    auto port_f = port.get_future();
    std::atomic<bool> rx_opened{false}, tx_opened{false}, rx_done{false}, tx_done{false}, rx_closed{false},
        tx_closed{false}, failed{false};
    auto until = [&failed](std::atomic<bool>& flag) -> task<void> {
      while (!flag.load(std::memory_order_acquire)) {
        if (failed.load(std::memory_order_acquire)) throw std::runtime_error("the other end failed");
        (void)co_await sleep_for(std::chrono::microseconds(50));
      }
    };
    std::chrono::steady_clock::time_point t0, rx_end;
    auto receive = [&] {
      cuda::check(cudaSetDevice(gpus.peer), "cudaSetDevice");
      io_context rctx;
      port.set_value(rx_listen());
      rctx.run([&]() -> task<void> {
        co_await rx_open();
        rx_opened.store(true, std::memory_order_release);
        co_await until(tx_opened);
        co_await rx_run();
        rx_end = std::chrono::steady_clock::now();
        rx_finish();
        rx_done.store(true, std::memory_order_release);
        co_await until(tx_done);
        (void)co_await rx.c.close();
        rx_closed.store(true, std::memory_order_release);
        co_await until(tx_closed);
      }());
      // This GPU's objects and this loop's connection go here, on their thread.
      (void)cudaFree(rx.sums);
      rx.sums = nullptr;
      rx.rcv = cuda::gpu_receiver{};
      rx.c = connection{};
      rx.l = listener{};
      rx.s.reset();
      rx.dst = cuda::device_buffer{};
      rx.d.reset();
    };
    std::exception_ptr rx_error;
    std::thread receiver([&] {
      try {
        receive();
      } catch (...) {
        rx_error = std::current_exception();
        failed.store(true, std::memory_order_release);
        try {
          port.set_exception(rx_error);  // (if the port was not given yet)
        } catch (const std::future_error&) {
        }
      }
    });
    auto send = [&] {
      tx_prepare();
      ctx.run([&]() -> task<void> {
        co_await tx_open(port_f.get());
        tx_opened.store(true, std::memory_order_release);
        co_await until(rx_opened);
        t0 = std::chrono::steady_clock::now();
        co_await tx_run();
        tx_done.store(true, std::memory_order_release);
        co_await until(rx_done);
        (void)co_await tx.c.close();
        tx_closed.store(true, std::memory_order_release);
        co_await until(rx_closed);
      }());
    };
    try {
      send();
    } catch (...) {
      failed.store(true, std::memory_order_release);
      receiver.join();
      throw;
    }
    receiver.join();
    if (rx_error) std::rethrow_exception(rx_error);
    secs = std::chrono::duration<double>(rx_end - t0).count();
  }
  if (!tx.r || !rx.r) {
    std::fprintf(stderr, "transfer failed: %s / %s\n", tx.r ? "ok" : tx.r.error().message().c_str(),
                 rx.r ? "ok" : rx.r.error().message().c_str());
    return 1;
  }
  std::vector<unsigned long long> ss(chunks);
  cuda::check(cudaMemcpy(ss.data(), tx.sums, chunks * 8, cudaMemcpyDeviceToHost), "copy");
  std::size_t bad = 0;
  for (std::size_t i = 0; i < chunks; ++i)
    if (ss[i] != rx.got[i]) ++bad;
  std::printf("gpu_pipeline: producer on GPU %d (%s), consumer on GPU %d%s, over %s\n"
              "  %zu MiB in %zu chunks of %zu KiB, path %s (%s), %zu notifications, %.1f ms, %.2f GB/s\n"
              "  checksums: %zu/%zu chunks match%s\n",
              gpus.self, cuda::describe_device(gpus.self).c_str(), gpus.peer,
              gpus.self == gpus.peer && !two_loops ? "" : " (its own thread and loop)", to_string(tx.c.kind()),
              len >> 20, chunks,
              chunk >> 10, cuda::to_string(tx.snd.path()),
              tx.reg->register_memory(tx.src.data(), len, 0)->reason.c_str(),
              rx.notified, secs * 1e3, double(len) / secs / 1e9, chunks - bad, chunks, bad ? "  MISMATCH" : "");
  (void)cudaFree(tx.sums);
  if (rx.sums) (void)cudaFree(rx.sums);
  return bad ? 1 : 0;
}
