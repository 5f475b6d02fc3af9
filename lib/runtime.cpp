#include <shuttle/runtime.hpp>
#include <shuttle/signal.hpp>

#include <csignal>
#include <cstdio>
#include <latch>
#include <stdexcept>
#include <string>

namespace shuttle {

struct runtime::worker {
  std::thread thread;
  io_context* ctx = nullptr;
  async_scope scope;
  std::exception_ptr start_error;
};

namespace {
// Hands a task to another thread's scope without allocating beyond the node.
struct spawn_op : detail::remote_op {
  task<void> t;
  async_scope* scope;
};
}  // namespace

runtime::runtime(std::size_t threads, io_context::options opts) {
  if (threads == 0) throw std::invalid_argument("shuttle::runtime: needs at least one thread");
  std::latch started(static_cast<std::ptrdiff_t>(threads));
  // Threads inherit the mask: signals go to signalfds, never to a random thread.
  sigset_t set, old;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGPIPE}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, &old);
  for (std::size_t i = 0; i < threads; ++i) {
    auto w = std::make_unique<worker>();
    worker* wp = w.get();
    workers_.push_back(std::move(w));
    wp->thread = std::thread([wp, opts, &started, released = &released_] {
      std::unique_ptr<io_context> ctx;
      try {
        ctx = std::make_unique<io_context>(opts);
        wp->ctx = ctx.get();
      } catch (...) {
        wp->start_error = std::current_exception();
      }
      started.count_down();
      if (!ctx) return;
      ctx->run();
      try {
        // One turn of the loop first, so spawns still in the remote queue
        // reach the scope before it is joined.
        ctx->run([](io_context& c, async_scope& s) -> task<void> {
          co_await c.schedule();
          co_await s.join();
        }(*ctx, wp->scope));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "shuttle::runtime: a spawned task failed: %s\n", e.what());
      }
      // join() may still be signalling this context: keep it alive until then.
      released->wait(false);
    });
  }
  started.wait();
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  for (auto& w : workers_) {
    if (w->start_error) {
      std::exception_ptr e = w->start_error;
      for (auto& x : workers_)
        if (x->ctx) x->ctx->stop();
      released_.store(true);
      released_.notify_all();
      for (auto& x : workers_) x->thread.join();
      joined_ = true;
      std::rethrow_exception(e);
    }
  }
}

runtime::~runtime() {
  if (!joined_) {
    request_stop();
    join();
  }
}

io_context& runtime::context(std::size_t i) {
  if (i >= workers_.size())
    throw std::out_of_range("shuttle::runtime: no thread " + std::to_string(i) + " of " +
                            std::to_string(workers_.size()));
  return *workers_[i]->ctx;
}

void runtime::spawn(std::size_t i, task<void> t) {
  io_context& ctx = context(i);
  auto* op = new spawn_op;
  op->t = std::move(t);
  op->scope = &workers_[i]->scope;
  op->run = [](detail::remote_op* r) noexcept {
    std::unique_ptr<spawn_op> self(static_cast<spawn_op*>(r));
    self->scope->spawn(std::move(self->t));
  };
  ctx.post_remote(op);
}

void runtime::request_stop() noexcept {
  // stop_source is thread-safe; I/O cancellation hops to the owning loops.
  for (auto& w : workers_) w->scope.request_stop();
}

void runtime::join() {
  if (joined_) return;
  joined_ = true;
  // Each loop leaves run(), then its thread runs it again until the tasks
  // spawned on it have finished (see the thread body).
  for (auto& w : workers_) w->ctx->stop();
  released_.store(true);
  released_.notify_all();
  for (auto& w : workers_) w->thread.join();
}

}  // namespace shuttle
