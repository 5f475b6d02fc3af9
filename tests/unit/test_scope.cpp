// async_scope and the stop token of the task that owns it (issue 29, point 1):
// a timeout or a when_any around a task reaches the tasks its scope spawned.
// Each test checks the order of events, not durations; every wait is bounded
// (a blocked child is released after 30 s at the latest, so the old code
// fails the order check instead of hanging).
#include <doctest/doctest.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <shuttle/shuttle.hpp>

using namespace shuttle;
using namespace std::chrono_literals;
using events = std::vector<std::string>;

namespace {
constexpr auto bound = 30s;  // how long a child that is never stopped stays blocked

// Shuts a socket down from another thread after `bound` (the read blocked on
// it then returns 0), unless dismissed first.
class watchdog {
 public:
  explicit watchdog(int fd)
      : thread_([this, fd] {
          std::unique_lock lock(m_);
          if (!cv_.wait_for(lock, bound, [this] { return dismissed_; })) ::shutdown(fd, SHUT_RDWR);
        }) {}
  ~watchdog() {
    {
      std::lock_guard lock(m_);
      dismissed_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool dismissed_ = false;
  std::thread thread_;
};

// One line, so that doctest prints both sides of a failed comparison.
std::string str(const events& ev) {
  std::string out;
  for (const auto& e : ev) out += (out.empty() ? "" : " | ") + e;
  return out;
}

std::string outcome(const result<void>& r, const char* who) {
  return std::string(who) + (r ? ": ran to the end, never stopped" : ": " + r.error().message());
}
const std::string cancelled = ": " + std::make_error_code(std::errc::operation_canceled).message();
}  // namespace

TEST_CASE("with_timeout around a server loop stops the handlers its scope spawned") {
  // The case: a server loop under a timeout, one handler blocked
  // reading from a client that never writes. The timeout must end the handler
  // too, not only the accept loop.
  io_context ctx;
  auto listener = tcp_listener::bind(endpoint::loopback(0)).value();
  auto ep = endpoint::loopback(listener.local_endpoint()->port());
  auto client = ctx.run(tcp_socket::connect(ep)).value();
  auto first = ctx.run(listener.accept()).value();
  watchdog release_after_bound(client.native_handle());
  events ev;

  auto handler = [&](tcp_socket s) -> task<void> {
    std::byte buf[64];
    ev.push_back("handler: reading");
    auto n = co_await s.read_some(buf);
    if (n)
      ev.push_back("handler: read returned " + std::to_string(*n) + ", never stopped");
    else
      ev.push_back("handler: " + n.error().message());
  };
  auto server = [&](tcp_socket accepted) -> task<void> {
    async_scope connections;  // default: follows whoever awaits join()
    // The handler runs to its read before spawn returns, so it is blocked
    // before with_timeout even starts its timer.
    connections.spawn(handler(std::move(accepted)));
    for (;;) {
      auto s = co_await listener.accept();
      if (!s) {
        ev.push_back("server: accept: " + s.error().message());
        break;
      }
      connections.spawn(handler(std::move(*s)));
    }
    co_await connections.join();
    ev.push_back("server: joined");
  };

  auto r = ctx.run(with_timeout(server(std::move(first)), 50ms));
  CHECK(r.error() == std::errc::timed_out);
  CHECK(str(ev) == str({"handler: reading", "server: accept" + cancelled, "handler" + cancelled, "server: joined"}));
}

TEST_CASE("when_any stops a scope's children while its owner is inside join()") {
  io_context ctx;
  events ev;
  event owner_joining;
  async_scope scope;  // not created in a task: join() links it to the joiner
  auto child = [&]() -> task<void> { ev.push_back(outcome(co_await sleep_for(bound), "child")); };
  auto owner = [&]() -> task<void> {
    scope.spawn(child());
    owner_joining.set();
    co_await scope.join();
    ev.push_back("owner: joined");
  };
  auto trigger = [&]() -> task<void> {
    (void)co_await owner_joining.wait();
    ev.push_back("trigger: won");
  };
  auto r = ctx.run(when_any(owner(), trigger()));
  CHECK(r.index() == 1);
  CHECK(str(ev) == str({"trigger: won", "child" + cancelled, "owner: joined"}));
  CHECK(scope.get_stop_token().stop_requested());  // sticky: the scope stays stopped
}

TEST_CASE("a scope built with its creator's stop token stops children before join()") {
  io_context ctx;
  events ev;
  bool child_ended = false;
  event spawned;
  auto child = [&]() -> task<void> {
    ev.push_back(outcome(co_await sleep_for(bound), "child"));
    child_ended = true;
  };
  auto owner = [&]() -> task<void> {
    async_scope scope{co_await get_stop_token()};
    scope.spawn(child());
    spawned.set();
    // Busy elsewhere, on something that ignores stop (yield does): only the
    // link made at construction can reach the child now.
    for (auto give_up = clock::now() + bound; !child_ended && clock::now() < give_up;) co_await yield();
    ev.push_back("owner: reaches join");
    co_await scope.join();
  };
  auto trigger = [&]() -> task<void> { (void)co_await spawned.wait(); };
  ctx.run(when_any(owner(), trigger()));
  CHECK(str(ev) == str({"child" + cancelled, "owner: reaches join"}));
}

TEST_CASE("async_scope::independent: a stopped owner's join() lets children finish") {
  io_context ctx;
  events ev;
  event joining;
  auto child = [&]() -> task<void> { ev.push_back(outcome(co_await sleep_for(20ms), "child")); };
  auto owner = [&]() -> task<void> {
    async_scope scope{async_scope::independent};
    scope.spawn(child());
    joining.set();
    co_await scope.join();
    ev.push_back(std::string("owner: joined, owner stopped: ") +
                 ((co_await get_stop_token()).stop_requested() ? "yes" : "no"));
  };
  auto trigger = [&]() -> task<void> { (void)co_await joining.wait(); };
  ctx.run(when_any(owner(), trigger()));
  CHECK(str(ev) == str({"child: ran to the end, never stopped", "owner: joined, owner stopped: yes"}));
}

TEST_CASE("spawn after stop starts the task with a stopped token; join waits for it") {
  io_context ctx;
  events ev;
  async_scope scope;
  scope.request_stop();
  auto late = [&]() -> task<void> {
    ev.push_back(std::string("late: started, stopped: ") +
                 ((co_await get_stop_token()).stop_requested() ? "yes" : "no"));
    ev.push_back(outcome(co_await sleep_for(bound), "late"));
  };
  scope.spawn(late());
  ctx.run(scope.join());
  CHECK(str(ev) == str({"late: started, stopped: yes", "late" + cancelled}));
  CHECK(scope.active() == 0);
}

TEST_CASE("join() is awaitable through with_timeout (the awaitable moves)") {
  io_context ctx;
  async_scope scope;
  events ev;
  auto child = [&]() -> task<void> { ev.push_back(outcome(co_await sleep_for(bound), "child")); };
  scope.spawn(child());
  auto r = ctx.run(with_timeout(scope.join(), 20ms));
  CHECK(r.error() == std::errc::timed_out);
  CHECK(str(ev) == str({"child" + cancelled}));  // the timeout stopped the children; join still awaited them
  CHECK(scope.active() == 0);
}
