// asio_interop_bench: what an Asio completion token costs on a shuttle
// operation, against the native co_await form, measured in the same run; and
// the stream_pipeline's throughput against its slowest stage alone.
//
//   asio_interop_bench [round_trips] [pipeline_records] [sections]
//
// sections: a comma-separated subset of ring,tcp,pipeline (default: all).
// Token forms: best of 5 runs each, interleaved; pipeline configurations:
// best of 3 each, interleaved (the machine may be shared). The pipeline line
// also reports the batching achieved (records per shipped batch).
//
// Operations (one thread, loopback):
//   ring op   : a zero-byte send on a TCP socket: one io_uring round trip
//               that does no work, the cheapest shuttle operation (worst
//               case for the ratio);
//   tcp pp    : 64-byte ping-pong on a TCP pair (write_some + read_some on the
//               measured side; the peer echoes natively).
// Forms: native co_await in a shuttle task; use_awaitable in an Asio
// coroutine on shuttle's executor (shuttle::asio::context), both as
// asio::awaitable / asio::use_awaitable (Asio's type-erased any_io_executor)
// and as shuttle::asio::awaitable / use_awaitable (awaitable.hpp: typed on
// shuttle's executor); use_awaitable on an asio::io_context driven by the
// loop (asio_driver); a plain callback chain.
//
// Asio floor (ring op): the same zero-byte send through a hand-written
// minimal Asio initiation (async_initiate; the op object holds only the
// handler, from the same recycled memory; the CQE calls the handler
// directly; no coroutine, no stop token, no factory, no executor or
// cancellation-slot checks). It is what any Asio-token form of this
// operation costs at least, so "interop / floor" is what shuttle's interop
// adds (for write_some, read_some and timers: the direct io_uring operation
// of include/shuttle/asio/sqe_op.hpp, which keeps the executor, allocator
// and slot rules; async_run for the other operations), and "floor / native"
// what Asio's own completion-token machinery (for use_awaitable: its
// coroutine frames and handler) adds to a shuttle operation.
#define STREAM_PIPELINE_NO_MAIN
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic ignored "-Wsubobject-linkage"
#endif
#include "../../examples/stream_pipeline.cpp"

#include <boost/asio/executor_work_guard.hpp>

#include <cstdlib>
#include <cstring>
#include <functional>

namespace {
using namespace stream_pipeline;
using bclock = std::chrono::steady_clock;

struct socket_pair {
  shuttle::tcp_socket client, server;
};
task<socket_pair> connected_pair() {
  auto l = shuttle::tcp_listener::bind(shuttle::endpoint::loopback(0)).value();
  auto ep = l.local_endpoint().value();
  auto accept = [](shuttle::tcp_listener& l) -> task<result<shuttle::tcp_socket>> { co_return co_await l.accept(); };
  auto [c, s] = co_await shuttle::when_all(shuttle::tcp_socket::connect(ep), accept(l));
  c->set_nodelay(true).value();
  s->set_nodelay(true).value();
  co_return socket_pair{std::move(c).value(), std::move(s).value()};
}

task<void> echo(shuttle::tcp_socket& s) {
  std::byte buf[64];
  for (;;) {
    auto n = co_await s.read_some(buf);
    if (!n || *n == 0) co_return;
    if (!co_await s.write_all(std::span(buf, *n))) co_return;
  }
}

constexpr std::size_t msg = 64;

// ---- ring op
shuttle::tcp_socket* ring_sock = nullptr;
task<void> ring_native(long n) {
  for (long i = 0; i < n; ++i) (void)co_await ring_sock->write_some({});
}
// The awaitable forms: Awaitable/Token are asio::awaitable<void> with
// asio::use_awaitable, or shuttle::asio::awaitable<void> with
// shuttle::asio::use_awaitable (typed on shuttle's executor).
template <class Awaitable, class Token>
Awaitable ring_awaitable(long n, Token tok) {
  for (long i = 0; i < n; ++i) co_await sa::async_write_some(*ring_sock, {}, tok);
}
// A callback chain of `left` operations, each started by Start::start.
template <class Start>
struct chain_cb {
  long left;
  shuttle::event* done;
  void operator()(boost::system::error_code, std::size_t) {
    if (--left == 0) {
      done->set();
      return;
    }
    Start::start(std::move(*this));
  }
};
struct ring_start {
  template <class H>
  static void start(H&& h) {
    sa::async_write_some(*ring_sock, {}, std::forward<H>(h));
  }
};
using ring_cb = chain_cb<ring_start>;

// ---- Asio floor for the ring op
template <class Handler>
struct floor_op : shuttle::detail::io_op {
  Handler handler;
  explicit floor_op(Handler&& h) : handler(std::move(h)) {}
  static void done(shuttle::detail::io_op* o, int res, std::uint32_t) noexcept {
    auto* self = static_cast<floor_op*>(o);
    Handler h(std::move(self->handler));
    self->~floor_op();
    sa::detail::free_frame(self, sizeof(floor_op));  // freed before the upcall
    boost::system::error_code ec;
    if (res < 0) ec.assign(-res, boost::system::system_category());
    sa::detail::with_asio_thread([&] { std::move(h)(ec, std::size_t(res < 0 ? 0 : res)); });
  }
};
struct floor_initiate {
  template <class Handler>
  void operator()(Handler&& h, int fd) const {
    using op = floor_op<std::decay_t<Handler>>;
    auto* o = ::new (sa::detail::allocate_frame(sizeof(op), h)) op(std::forward<Handler>(h));
    o->complete = &op::done;
    io_uring_sqe* sqe = shuttle::io_context::current().backend().get_sqe();
    io_uring_prep_send(sqe, fd, nullptr, 0, MSG_NOSIGNAL);
    io_uring_sqe_set_data(sqe, static_cast<shuttle::detail::io_op*>(o));
  }
};
template <class Token>
auto floor_send(int fd, Token&& token) {
  return net::async_initiate<Token, void(boost::system::error_code, std::size_t)>(floor_initiate{}, token, fd);
}
template <class Awaitable, class Token>
Awaitable floor_awaitable(long n, Token tok) {
  for (long i = 0; i < n; ++i) co_await floor_send(ring_sock->native_handle(), tok);
}
struct floor_start {
  template <class H>
  static void start(H&& h) {
    floor_send(ring_sock->native_handle(), std::forward<H>(h));
  }
};
using floor_cb = chain_cb<floor_start>;

// ---- tcp ping-pong
task<void> tcp_native(shuttle::tcp_socket& s, long n) {
  std::byte out[msg]{}, in[msg];
  for (long i = 0; i < n; ++i) {
    (void)co_await s.write_some(out);
    std::size_t got = 0;
    while (got < msg) got += (co_await s.read_some(std::span(in + got, msg - got))).value();
  }
}
template <class Awaitable, class Token>  // as ring_awaitable
Awaitable tcp_awaitable(shuttle::tcp_socket& s, long n, Token tok) {
  std::byte out[msg]{}, in[msg];
  for (long i = 0; i < n; ++i) {
    co_await sa::async_write_some(s, out, tok);
    std::size_t got = 0;
    while (got < msg) got += co_await sa::async_read_some(s, std::span(in + got, msg - got), tok);
  }
}
struct tcp_cb {
  shuttle::tcp_socket* s;
  long left;
  shuttle::event* done;
  std::byte* out;
  std::byte* in;
  std::size_t got = 0;
  bool writing = true;
  void start() {
    writing = true;
    sa::async_write_some(*s, std::span<const std::byte>(out, msg), std::move(*this));
  }
  void operator()(boost::system::error_code ec, std::size_t n) {
    if (ec) {
      done->set();
      return;
    }
    if (writing) {
      writing = false;
      got = 0;
    } else {
      got += n;
      if (got == msg) {
        if (--left == 0) {
          done->set();
          return;
        }
        start();
        return;
      }
    }
    sa::async_read_some(*s, std::span<std::byte>(in + got, msg - got), std::move(*this));
  }
};

double per_op_ns(bclock::duration d, long n) { return std::chrono::duration<double, std::nano>(d).count() / double(n); }

// Runs the loop until `done` is set (the loop sleeps in the ring meanwhile).
void wait_event(shuttle::io_context& loop, shuttle::event& done) {
  (void)loop.run(done.wait());
}

}  // namespace

int main(int argc, char** argv) {
  long n = argc > 1 ? std::atol(argv[1]) : 100000;
  std::uint64_t precs = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 400000;
  const char* sections = argc > 3 ? argv[3] : "ring,tcp,pipeline";
  auto want = [&](const char* s) { return std::strstr(sections, s) != nullptr; };
  const int reps = 5;
  if (want("ring") || want("tcp")) {
    shuttle::io_context loop;
    sa::context sctx(loop);
    net::io_context actx(1);
    // Many runs on one context, with no Asio work between them: a guard
    // keeps it from stopping (Asio's out-of-work rule) until the last.
    auto guard = net::make_work_guard(actx);
    sa::asio_driver driver(loop, actx);

    // One run of each form: returns ns per operation.
    auto run_native = [&](auto make) {
      auto t = bclock::now();
      loop.run(make());
      return per_op_ns(bclock::now() - t, n);
    };
    auto run_aw = [&](auto ex, auto make) {
      shuttle::event done;
      auto t = bclock::now();
      net::co_spawn(ex, make(), [&](std::exception_ptr) { done.set(); });
      wait_event(loop, done);
      return per_op_ns(bclock::now() - t, n);
    };
    auto p = loop.run(connected_pair());
    ring_sock = &p.client;
    shuttle::async_scope peer;
    std::byte out[msg]{}, in[msg];
    auto ring_callback = [&] {
      shuttle::event done;
      auto t = bclock::now();
      loop.run([&]() -> task<void> {
        sa::async_write_some(*ring_sock, {}, ring_cb{n, &done});
        co_return;
      }());
      wait_event(loop, done);
      return per_op_ns(bclock::now() - t, n);
    };
    auto floor_callback = [&] {
      shuttle::event done;
      auto t = bclock::now();
      loop.run([&]() -> task<void> {
        floor_send(ring_sock->native_handle(), floor_cb{n, &done});
        co_return;
      }());
      wait_event(loop, done);
      return per_op_ns(bclock::now() - t, n);
    };
    auto tcp_callback = [&] {
      shuttle::event done;
      auto t = bclock::now();
      loop.run([&]() -> task<void> {
        tcp_cb{&p.client, n, &done, out, in}.start();
        co_return;
      }());
      wait_event(loop, done);
      return per_op_ns(bclock::now() - t, n);
    };
    std::printf("asio_interop_bench: %ld operations per run, forms interleaved, best of %d (Boost.Asio %d)\n", n, reps,
                BOOST_ASIO_VERSION);
    // Forms interleaved, best of `reps` each, after one warm-up round.
    double rn = 1e300, ra = 1e300, rt = 1e300, rd = 1e300, rc = 1e300, fa = 1e300, ft = 1e300, fc = 1e300;
    for (int rep = 0; rep <= reps && want("ring"); ++rep) {
      double a = run_native([&] { return ring_native(n); });
      double b = run_aw(sctx.get_executor(), [&] { return ring_awaitable<net::awaitable<void>>(n, net::use_awaitable); });
      double bt = run_aw(sctx.get_executor(), [&] { return ring_awaitable<sa::awaitable<void>>(n, sa::use_awaitable); });
      double c = run_aw(actx.get_executor(), [&] { return ring_awaitable<net::awaitable<void>>(n, net::use_awaitable); });
      double d = ring_callback();
      double e = run_aw(sctx.get_executor(), [&] { return floor_awaitable<net::awaitable<void>>(n, net::use_awaitable); });
      double et = run_aw(sctx.get_executor(), [&] { return floor_awaitable<sa::awaitable<void>>(n, sa::use_awaitable); });
      double f = floor_callback();
      if (rep == 0) continue;
      rn = std::min(rn, a), ra = std::min(ra, b), rt = std::min(rt, bt), rd = std::min(rd, c), rc = std::min(rc, d);
      fa = std::min(fa, e), ft = std::min(ft, et), fc = std::min(fc, f);
    }
    if (want("ring")) {
      std::printf("  ring op   native %7.0f ns | use_awaitable/shuttle executor: any_io_executor %7.0f ns  %.3fx,"
                  " typed %7.0f ns  %.3fx | use_awaitable/driven asio::io_context %7.0f ns  %.3fx | callback %7.0f ns  %.3fx\n",
                  rn, ra, ra / rn, rt, rt / rn, rd, rd / rn, rc, rc / rn);
      std::printf("  ring op   Asio floor: use_awaitable any_io_executor %7.0f ns  %.3fx native, typed %7.0f ns  %.3fx native |"
                  " callback %7.0f ns  %.3fx native  ->  interop / floor: use_awaitable %.3fx (typed %.3fx), callback %.3fx\n",
                  fa, fa / rn, ft, ft / rn, fc, fc / rn, ra / fa, rt / ft, rc / fc);
    }

    loop.run([&]() -> task<void> {
      peer.spawn(echo(p.server));
      co_return;
    }());
    double tn = 1e300, ta = 1e300, tt = 1e300, td = 1e300, tc = 1e300;
    for (int rep = 0; rep <= reps && want("tcp"); ++rep) {
      double a = run_native([&] { return tcp_native(p.client, n); });
      double b = run_aw(sctx.get_executor(), [&] { return tcp_awaitable<net::awaitable<void>>(p.client, n, net::use_awaitable); });
      double bt = run_aw(sctx.get_executor(), [&] { return tcp_awaitable<sa::awaitable<void>>(p.client, n, sa::use_awaitable); });
      double c = run_aw(actx.get_executor(), [&] { return tcp_awaitable<net::awaitable<void>>(p.client, n, net::use_awaitable); });
      double d = tcp_callback();
      if (rep == 0) continue;
      tn = std::min(tn, a), ta = std::min(ta, b), tt = std::min(tt, bt), td = std::min(td, c), tc = std::min(tc, d);
    }
    if (want("tcp"))
      std::printf("  tcp pp    native %7.0f ns | use_awaitable/shuttle executor: any_io_executor %7.0f ns  %.3fx,"
                  " typed %7.0f ns  %.3fx | use_awaitable/driven asio::io_context %7.0f ns  %.3fx | callback %7.0f ns  %.3fx\n",
                  tn, ta, ta / tn, tt, tt / tn, td, td / tn, tc, tc / tn);
    // The target, from this run's figures only. The ring op's use_awaitable
    // forms also show Asio's own floor for them (its coroutine machinery on
    // a minimal initiation), which no interop can go below.
    if (want("ring") && want("tcp")) {
      auto verdict = [](double r) { return r <= 1.1 ? "met" : "NOT met"; };
      std::printf("  target: Asio-token form <= 1.1x native (shuttle executor): ring op use_awaitable %.3fx %s"
                  " (Asio floor %.3fx), typed %.3fx %s (floor %.3fx), callback %.3fx %s | tcp pp use_awaitable %.3fx %s,"
                  " typed %.3fx %s, callback %.3fx %s\n",
                  ra / rn, verdict(ra / rn), fa / rn, rt / rn, verdict(rt / rn), ft / rn, rc / rn, verdict(rc / rn),
                  ta / tn, verdict(ta / tn), tt / tn, verdict(tt / tn), tc / tn, verdict(tc / tn));
    }
    p.client.close();
    loop.run(peer.join());
  }

  if (!want("pipeline")) return 0;
  // ---- pipeline vs its stages alone
  auto run_cfg = [](config cfg) {
    cfg.quiet = true;
    cfg.install_sigint = false;
    shuttle::io_context loop;
    net::io_context actx(1);
    sa::asio_driver driver(loop, actx);
    pipeline pl(loop, actx, cfg);
    return loop.run(pl.run());
  };
  config base;
  base.clients = 8;
  base.records_per_client = precs / base.clients;
  base.record_size = 256;
  base.report_ms = 100000;
  config ing = base;
  ing.only = config::only_stage::ingest;
  config netw = base;
  netw.only = config::only_stage::network;
  netw.clients = 0;
  netw.records_per_client = 0;
  netw.synthetic_records = precs;
  // Configurations interleaved, best of 3 each (the machine may be shared).
  report full;
  double full_rate = 0, ingest_rate = 0, net_rate = 0, compute_rate = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto f = run_cfg(base);
    if (!f.ok()) {
      full = f;
      break;
    }
    if (double r = double(f.confirmed) / f.seconds; r > full_rate) full_rate = r, full = f;
    auto ri = run_cfg(ing);
    ingest_rate = std::max(ingest_rate, double(ri.confirmed) / ri.seconds);
    auto rn = run_cfg(netw);
    net_rate = std::max(net_rate, double(rn.confirmed) / rn.seconds);
    // compute alone: the CPU function over batches in memory
    batch b;
    for (std::size_t i = 0; i < base.batch; ++i) b.recs.push_back(record{i, 0, {}, std::vector<std::byte>(base.record_size)});
    auto t = bclock::now();
    std::uint64_t done = 0;
    while (done < precs) {
      process(b);
      done += b.recs.size();
    }
    compute_rate = std::max(compute_rate, double(done) / std::chrono::duration<double>(bclock::now() - t).count());
  }
  double slowest = std::min({ingest_rate, compute_rate, net_rate});
  std::printf("pipeline (%llu records of %u B, %u clients, batches of %zu): %.0f rec/s %s, %.1f records/batch shipped"
              " | alone: ingest %.0f, compute %.0f, network+sink %.0f rec/s | pipeline / slowest stage = %.2f\n",
              (unsigned long long)full.in, base.record_size, base.clients, base.batch, full_rate,
              full.ok() ? "(out == in)" : "(MISMATCH)", full.batches ? double(full.confirmed) / double(full.batches) : 0.0,
              ingest_rate, compute_rate, net_rate, full_rate / slowest);
  return full.ok() ? 0 : 1;
}
