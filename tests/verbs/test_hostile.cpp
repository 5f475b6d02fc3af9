// Hostile peers against a verbs listener (run in the Soft-RoCE guest): the
// peer speaks librdmacm directly (hostile_peer.hpp) on a thread of its own,
// while an echo server and a good client run on this thread's loop. Each
// case holds its attack while the good client must connect and echo.
// Figures (memory per held connection, the good client's time to connect
// and echo) are printed, not asserted, but for the memory bound the issue
// sets (256 KiB per held half-open request).
#include <doctest/doctest.h>

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>
#include <shuttle/verbs/verbs.hpp>

#include "../transport/common.hpp"
#include "hostile_peer.hpp"

#include <algorithm>
#include <atomic>
#include <functional>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <iterator>
#include <memory>

using namespace shuttle;
using namespace std::chrono_literals;

namespace {

using transport_test::test_endpoint;

// A hang shows what was printed before it.
const bool stdout_unbuffered = [] { return std::setvbuf(stdout, nullptr, _IONBF, 0) == 0; }();

domain open_verbs() {
  domain_options o;
  o.kind = transport_kind::verbs;
  auto d = domain::open(o);
  if (!d) {
    std::printf("no verbs domain: %s\n", d.error().message().c_str());
    std::exit(77);
  }
  return std::move(*d);
}

long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return 0;
}

// The echo server's connection options (examples/echo_server.cpp, 64 KiB
// messages): 16 receives of 64 KiB, 128 send slots.
connection_options echo_options() {
  connection_options o;
  o.receive_buffers = 16;
  o.receive_buffer_size = 65536;
  return o;
}

// An echo server: accepts until closed, echoes each message; the error that
// ended each connection is kept.
struct echo_server {
  domain d = open_verbs();
  listener l;
  async_scope scope;
  std::vector<std::error_code> ends;
  std::size_t accepted = 0, live = 0, max_live = 0;

  result<void> start(listener_options limits) {
    auto r = d.listen(test_endpoint(0), echo_options(), limits);
    if (!r) return r.error();
    l = std::move(*r);
    scope.spawn(accept_loop());
    return {};
  }
  endpoint ep() { return test_endpoint(l.local_endpoint()->port()); }
  task<void> accept_loop() {
    for (;;) {
      auto c = co_await l.accept();
      if (!c) co_return;
      ++accepted;
      max_live = std::max(max_live, ++live);
      scope.spawn(serve(std::move(*c)));
    }
  }
  task<void> serve(connection c) {
    for (;;) {
      std::vector<std::byte> copy;
      {
        auto m = co_await c.recv();
        if (!m) {
          ends.push_back(m.error());
          break;
        }
        copy.assign(m->data().begin(), m->data().end());
      }  // the buffer goes back now
      if (auto r = co_await c.send(copy); !r) {
        ends.push_back(r.error());
        break;
      }
    }
    --live;
  }
  bool ended_with(errc e) const {
    return std::any_of(ends.begin(), ends.end(), [&](auto& ec) { return ec == make_error_code(e); });
  }
  task<void> stop() {
    l.close();
    scope.request_stop();
    co_await scope.join();
  }
};

// A good client: connects (again while refused) and echoes one message,
// until `limit`. Its time from the first attempt is printed.
task<bool> good_client(endpoint ep, const char* during, std::chrono::seconds limit = 60s) {
  auto d = open_verbs();
  const auto t0 = clock::now();
  int attempts = 0;
  for (;;) {
    ++attempts;
    auto c = co_await d.connect(ep);
    if (c) {
      const auto ping = transport_test::pattern(100, 7);
      auto s = co_await c->send(ping);
      // Not `s ? co_await ... : ...`: g++ 12 destroys the awaited result
      // of a co_await inside ?: twice (the message's buffer went back to
      // its pool twice, and the pool was freed under posted receives).
      result<message> m = s.error();
      if (s) m = co_await with_timeout(c->recv(), 30s);
      const bool ok = m && transport_test::same(m->data(), ping);
      std::printf("good client during %s: %s after %.1f ms (%d connect attempts)\n", during,
                  ok ? "connected and echoed" : "FAILED to echo",
                  std::chrono::duration<double, std::milli>(clock::now() - t0).count(), attempts);
      (void)co_await c->close();
      co_return ok;
    }
    std::printf("good client attempt %d at %.0f ms: %s\n", attempts,
                std::chrono::duration<double, std::milli>(clock::now() - t0).count(), c.error().message().c_str());
    if (clock::now() - t0 > limit) {
      std::printf("good client during %s: no connection after %d attempts: %s\n", during, attempts,
                  c.error().message().c_str());
      co_return false;
    }
    (void)co_await sleep_for(50ms);
  }
}

// Waits on the loop for a flag another thread sets, up to `limit`.
task<bool> wait_flag(const std::atomic<int>& f, int want, std::chrono::seconds limit) {
  const auto t0 = clock::now();
  while (f.load() < want) {
    if (clock::now() - t0 > limit) co_return false;
    (void)co_await sleep_for(20ms);
  }
  co_return true;
}

task<bool> wait_until(std::function<bool()> cond, std::chrono::seconds limit) {
  const auto t0 = clock::now();
  while (!cond()) {
    if (clock::now() - t0 > limit) co_return false;
    (void)co_await sleep_for(20ms);
  }
  co_return true;
}

// "192.168.77.1:7000" -> "192.168.77.1".
std::string host_of(const endpoint& e) {
  std::string s = e.to_string();
  return s.substr(0, s.rfind(':'));
}

// The rdma_cm ids this process holds in the kernel (`rdma res show cm_id`,
// iproute2), or -1 when that cannot be asked.
int kernel_cm_ids() {
  FILE* p = ::popen("rdma -j res show cm_id 2>/dev/null", "r");
  if (!p) return -1;
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  if (::pclose(p) != 0 || out.empty()) return -1;
  const std::string mine = "\"pid\":" + std::to_string(::getpid()) + ",";
  int n = 0;
  for (auto at = out.find(mine); at != std::string::npos; at = out.find(mine, at + 1)) ++n;
  return n;
}

#ifndef SHUTTLE_TEST_OLD_WIRE
verbs::domain_stats stats_of(const domain& d) { return verbs::stats(d).value(); }
#endif

}  // namespace

// Point 2: 300 requests that never send the RTU (more than the 214 that
// exhausted the shared CQ before). Past max_handshakes they are rejected at
// once with a reason, the held ones are dropped at their deadline, and the
// good client gets in while the attacker still holds every id.
TEST_CASE("half-open connect requests: capped, rejected with a reason, timed out; a good client gets in") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    const int attack = std::getenv("HOSTILE_N") ? std::atoi(std::getenv("HOSTILE_N")) : 300;
    constexpr std::uint32_t cap = 16;
    echo_server srv;
    listener_options lim;
    lim.max_handshakes = cap;
    lim.handshake_timeout = 1500ms;
    std::vector<std::pair<endpoint, std::string>> told;  // on_refused
    lim.on_refused = [&told](const endpoint& peer, std::string_view why) { told.emplace_back(peer, why); };
    REQUIRE(srv.start(lim));
    const endpoint ep = srv.ep();
    const long rss0 = rss_kib();

    std::atomic<int> phase{0};  // 1: the attack is issued and held; 2: let it go
    std::atomic<int> rejected_capped{0}, responded{0}, other{0};
    std::thread attacker([&, attack] {
      hostile::channel ch;
      std::vector<rdma_cm_id*> held;
      const auto priv = hostile::hello(16, 1, 65536);
      auto answers = hostile::half_open_burst(ch, ep.data(), attack, priv, 60000, held);
      for (auto& e : answers) {
        if (e && e->type == RDMA_CM_EVENT_REJECTED && e->reason() == hostile::too_many_handshakes)
          ++rejected_capped;
        else if (e && e->type == RDMA_CM_EVENT_CONNECT_RESPONSE)
          ++responded;  // never completed: no rdma_establish, no RTU
        else
          ++other;
      }
      phase = 1;
      while (phase.load() < 2) (void)ch.next(50);  // held: events read, nothing completed
      for (auto* id : held) rdma_destroy_id(id);
    });
    const bool issued = co_await wait_flag(phase, 1, 240s);
    const long rss1 = rss_kib();
    // The count asked of the kernel below sees the held handshakes now.
    const int held_ids = kernel_cm_ids();
    std::printf("kernel rdma_cm ids of this process while the attack is held: %d\n", held_ids);
    CHECK(held_ids > 0);
#ifndef SHUTTLE_TEST_OLD_WIRE
    std::printf("burst done: server stats %llu refused, %llu timed out\n", (unsigned long long)stats_of(srv.d).handshakes_refused,
                (unsigned long long)stats_of(srv.d).handshakes_timed_out);
#endif
    const bool good = issued && co_await good_client(ep, "300 half-open requests held", 20s);
    phase = 2;
    attacker.join();

    std::printf("half-open: %d rejected (handshake cap), %d answered and never completed, %d other; RSS %ld -> %ld KiB"
                " (%.1f KiB per request, both sides)\n",
                rejected_capped.load(), responded.load(), other.load(), rss0, rss1,
                double(rss1 - rss0) / attack);
    CHECK(issued);
    CHECK(good);
    CHECK(responded.load() <= static_cast<int>(cap));
    CHECK(rejected_capped.load() >= attack - static_cast<int>(cap));
    CHECK((rss1 - rss0) / attack < 256);
#ifndef SHUTTLE_TEST_OLD_WIRE
    auto st = stats_of(srv.d);
    std::printf("server stats: %llu refused, %llu timed out\n", (unsigned long long)st.handshakes_refused,
                (unsigned long long)st.handshakes_timed_out);
    CHECK(st.handshakes_refused >= static_cast<std::uint64_t>(attack - cap));
    CHECK(st.handshakes_timed_out >= 1);
#endif
    // on_refused was told of each, with the peer's address (this host).
    int told_capped = 0, told_late = 0, told_unknown_peer = 0;
    for (auto& [peer, why] : told) {
      told_capped += why.find("too many handshakes") != std::string::npos;
      told_late += why.find("handshake failed: not established within 1500 ms") != std::string::npos;
      told_unknown_peer += peer.port() == 0 || host_of(peer) != host_of(ep);
    }
    std::printf("on_refused: %zu told (%d capped, %d late), first: %s: %s\n", told.size(), told_capped, told_late,
                told.empty() ? "-" : told.front().first.to_string().c_str(), told.empty() ? "-" : told.front().second.c_str());
    CHECK(told_capped >= attack - static_cast<int>(cap));
    CHECK(told_late >= 1);
    CHECK(told_unknown_peer == 0);
    co_await srv.stop();
    // Every id of the dropped handshakes is gone once the server has
    // stopped (the kernel cancels the REP they were retrying), so the
    // process can exit: none may wait out the REP's retries, which the
    // peer's REQ sets (65 s here). The deadline only bounds the wait for
    // connections still flushing their queues.
    int left = kernel_cm_ids();
    std::printf("kernel rdma_cm ids of this process after the server stopped: %d\n", left);
    const bool all_gone = co_await wait_until([&] { return (left = kernel_cm_ids()) <= 0; }, 20s);
    std::printf("... and after waiting for flushes: %d\n", left);
    CHECK(left == 0);
    CHECK(all_gone);
  }());
}

// Point 2: 300 connections that connect and never send. Past
// max_connections they are refused; those accepted fail with
// errc::idle_timeout after idle_timeout; the good client gets in.
TEST_CASE("idle connections: a connection cap and an idle timeout; a good client gets in") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    constexpr int attack = 300;
    constexpr std::uint32_t cap = 64;
    echo_server srv;
    listener_options lim;
    lim.max_connections = cap;
    lim.idle_timeout = 2000ms;
    REQUIRE(srv.start(lim));
    const endpoint ep = srv.ep();
    const long rss0 = rss_kib();
    // The attacker's own domains (a domain's CQ holds ~160-240 connections).
    std::vector<domain> attackers;
    for (int i = 0; i < 3; ++i) attackers.push_back(open_verbs());
    std::vector<connection> idle;
    int refused = 0;
    for (int i = 0; i < attack; ++i) {
      auto c = co_await attackers[static_cast<std::size_t>(i % 3)].connect(ep, echo_options());
      if (c)
        idle.push_back(std::move(*c));
      else
        ++refused;
    }
    const long rss1 = rss_kib();
    const bool good = co_await good_client(ep, "300 idle connections held");
    // Every accepted one stays idle: each ends by the idle timeout.
    const bool timed_out = co_await wait_until([&] { return srv.ended_with(errc::idle_timeout); }, 60s);
    std::printf("idle: %zu connected (never send), %d refused; server accepted %zu, at most %zu at once; RSS %ld -> %ld"
                " KiB (%.1f KiB per connection, both sides)\n",
                idle.size(), refused, srv.accepted, srv.max_live, rss0, rss1,
                idle.empty() ? 0.0 : double(rss1 - rss0) / double(idle.size()));
    CHECK(good);
    CHECK(srv.max_live <= cap + 1);  // + the good client
    CHECK(timed_out);
#ifndef SHUTTLE_TEST_OLD_WIRE
    auto st = stats_of(srv.d);
    std::printf("server stats: %llu refused, %llu idle timeouts\n", (unsigned long long)st.handshakes_refused,
                (unsigned long long)st.idle_timeouts);
    CHECK(st.idle_timeouts >= 1);
#endif
    idle.clear();
    co_await srv.stop();
  }());
}

// Point 3: what the peer says in its hello is checked before anything is
// allocated for it.
TEST_CASE("hello checks: 0xFFFFFFFF credits and a zero buffer size are rejected with a reason") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    echo_server srv;
    REQUIRE(srv.start({}));
    const endpoint ep = srv.ep();
    struct probe {
      std::vector<std::uint8_t> priv;
      bool accept;  // the peer could be honoured
      std::atomic<int> outcome{-1};  // 1 accepted (CONNECT_RESPONSE), 0 rejected as a bad hello, 2 other
    };
    probe probes[] = {{hostile::hello(0xFFFFFFFFu, 0xFFFFFFFFu, 65536), false},
                      {hostile::hello(4, 4, 0), false},
                      {hostile::hello(4, 4, 1), true}};
    std::atomic<int> done{0};
    std::thread peer([&] {
      hostile::channel ch;
      for (auto& p : probes) {
        std::optional<hostile::event> e;
        rdma_cm_id* id = hostile::half_open(ch, ep.data(), p.priv, 0x2000, e);
        if (e && e->type == RDMA_CM_EVENT_CONNECT_RESPONSE)
          p.outcome = 1;
        else if (e && e->type == RDMA_CM_EVENT_REJECTED && e->reason() == hostile::bad_hello)
          p.outcome = 0;
        else
          p.outcome = 2;
        if (id) rdma_destroy_id(id);
      }
      done = 1;
    });
    const bool finished = co_await wait_flag(done, 1, 120s);
    peer.join();
    CHECK(finished);
    for (auto& p : probes) {
      std::printf("hello probe: outcome %d (1 accepted, 0 rejected as bad hello)\n", p.outcome.load());
      CHECK(p.outcome.load() == (p.accept ? 1 : 0));
    }
    CHECK(co_await good_client(ep, "bogus hellos"));
    co_await srv.stop();
  }());
}

// Issue 29 point 4: the connect payload after the hello. A length byte over
// the bound (32) is rejected with its own reason; one within it is taken,
// and the answer (REP) carries the listener's hello and its (empty) payload.
TEST_CASE("connect payload: a length byte over the bound is rejected with a reason; within it, accepted") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    echo_server srv;
    std::vector<std::string> refused;
    listener_options limits;
    limits.on_refused = [&](const endpoint&, std::string_view why) { refused.emplace_back(why); };
    REQUIRE(srv.start(limits));
    const endpoint ep = srv.ep();
    struct probe {
      std::vector<std::uint8_t> priv;
      bool accept;
      std::atomic<int> outcome{-1};  // 1 accepted with a hello and an empty payload, 0 rejected as bad payload, 2 other
    };
    probe probes[] = {{hostile::hello_with_payload(33, 33), false},
                      {hostile::hello_with_payload(39, 39), false},  // fits the REQ, over the bound
                      {hostile::hello_with_payload(255, 39), false},
                      {hostile::hello_with_payload(5, 5), true},
                      {hostile::hello_with_payload(32, 32), true}};
    std::atomic<int> done{0};
    std::thread peer([&] {
      hostile::channel ch;
      for (auto& p : probes) {
        std::optional<hostile::event> e;
        rdma_cm_id* id = hostile::half_open(ch, ep.data(), p.priv, 0x2000, e);
        if (e && e->type == RDMA_CM_EVENT_CONNECT_RESPONSE && e->priv.size() >= 17 && e->priv[0] == 'S' &&
            e->priv[16] == 0)
          p.outcome = 1;
        else if (e && e->type == RDMA_CM_EVENT_REJECTED && e->reason() == hostile::bad_payload)
          p.outcome = 0;
        else
          p.outcome = 2;
        if (id) rdma_destroy_id(id);
      }
      done = 1;
    });
    const bool finished = co_await wait_flag(done, 1, 120s);
    peer.join();
    CHECK(finished);
    for (auto& p : probes) {
      std::printf("payload probe: outcome %d (1 accepted, 0 rejected as bad payload)\n", p.outcome.load());
      CHECK(p.outcome.load() == (p.accept ? 1 : 0));
    }
    const auto bad = std::count(refused.begin(), refused.end(),
                                std::string("refused: a connect payload over 32 bytes, or past the private data"));
    CHECK(bad == 3);
    CHECK(co_await good_client(ep, "bad payloads"));
    co_await srv.stop();
  }());
}

// Point 3: credits are a protocol. A peer that announced 4 receives and
// grants 65535 credits per credit-only message breaks it: that connection
// ends with errc::protocol_error, the others go on.
TEST_CASE("credit flood: credits past the peer's announced receives end that connection only") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    echo_server srv;
    REQUIRE(srv.start({}));
    const endpoint ep = srv.ep();
    std::atomic<int> state{0};  // 1 connected, 2 flood sent (or stopped by an error), -1 failed
    std::atomic<int> sent{0};
    std::thread peer([&] {
      hostile::qp_peer q;
      if (!q.connect(ep.data(), hostile::hello(4, 4, 65536))) {
        state = -1;
        return;
      }
      state = 1;
      for (int i = 0; i < 2000; ++i) {
        if (!q.send_imm(hostile::ctrl_flag | 0xffffu, 5000)) break;
        ++sent;
      }
      state = 2;
    });
    const bool flooded = co_await wait_until([&] { return state.load() == 2 || state.load() < 0; }, 200s);
    const bool ended = co_await wait_until([&] { return !srv.ends.empty(); }, 30s);
    peer.join();
    std::printf("credit flood: %d credit messages delivered before the connection ended\n", sent.load());
    CHECK(flooded);
    CHECK(state.load() == 2);
    CHECK(ended);
    CHECK(srv.ended_with(errc::protocol_error));
    CHECK(sent.load() < 2000);
#ifndef SHUTTLE_TEST_OLD_WIRE
    CHECK(stats_of(srv.d).protocol_errors == 1);
#endif
    CHECK(co_await good_client(ep, "a credit flood"));
    co_await srv.stop();
  }());
}

// Point 3: a peer that asks for infinite RNR retries (7) and never posts a
// receive: the server's echo send ends in an error on that connection
// (finite RNR retries), not in a send that retries for ever.
TEST_CASE("a peer that never posts receives: the send to it fails, the others go on") {
  io_context ctx;
  ctx.run([]() -> task<void> {
    echo_server srv;
    REQUIRE(srv.start({}));
    const endpoint ep = srv.ep();
    std::atomic<int> state{0};  // 1 connected and sent, -1 failed; 2: let go
    std::thread peer([&] {
      hostile::qp_peer q;
      if (!q.connect(ep.data(), hostile::hello(4, 4, 65536)) || !q.send_imm(0)) {
        state = -1;
        return;
      }
      state = 1;
      while (state.load() != 2) ::poll(nullptr, 0, 20);  // holds the connection, posts nothing
    });
    const bool sent = co_await wait_until([&] { return state.load() != 0; }, 120s);
    const auto t0 = clock::now();
    const bool ended = sent && state.load() == 1 && co_await wait_until([&] { return !srv.ends.empty(); }, 60s);
    if (ended)
      std::printf("no receives posted: the echo ended after %.1f ms: %s\n",
                  std::chrono::duration<double, std::milli>(clock::now() - t0).count(),
                  srv.ends.front().message().c_str());
    const bool good = co_await good_client(ep, "a peer that posts no receives");
    if (state.load() == 1) state = 2;
    peer.join();
    CHECK(sent);
    CHECK(ended);
    CHECK(good);
    co_await srv.stop();
  }());
}

namespace {

// A process started with its stdout on a pipe and its stderr in a file.
struct child_process {
  pid_t pid = -1;
  int out = -1;  // its stdout
  std::string err_path;

  bool start(std::vector<std::string> argv) {
    char tmpl[] = "/tmp/shuttle-child-stderr-XXXXXX";
    int err = ::mkstemp(tmpl);
    int p[2];
    if (err < 0 || ::pipe2(p, O_CLOEXEC) != 0) return false;
    err_path = tmpl;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err, 2);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    int rc = ::posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    ::close(err);
    out = p[0];
    return rc == 0;
  }
  // The next stdout line within `ms`, or "".
  std::string line(int ms) {
    std::string l;
    for (int waited = 0; waited < ms;) {
      pollfd f{out, POLLIN, 0};
      if (::poll(&f, 1, 100) <= 0) {
        waited += 100;
        continue;
      }
      char c;
      if (::read(out, &c, 1) != 1) return l;
      if (c == '\n') return l;
      l += c;
    }
    return l;
  }
  std::string err_text() const {
    std::ifstream f(err_path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  // SIGTERM, then its exit status within `ms` (-1: it did not exit; killed).
  int stop(int ms) {
    if (pid < 0) return -1;
    ::kill(pid, SIGTERM);
    for (int waited = 0; waited < ms; waited += 50) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      ::poll(nullptr, 0, 50);
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
    return -1;
  }
  ~child_process() {
    if (pid > 0) stop(1000);
    if (out >= 0) ::close(out);
    if (!err_path.empty()) ::unlink(err_path.c_str());
  }
};

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The sum of N in "N similar messages suppressed" lines.
long suppressed_in(const std::string& text) {
  long n = 0;
  const std::string tag = " similar messages suppressed";
  for (auto at = text.find(tag); at != std::string::npos; at = text.find(tag, at + 1)) {
    auto start = text.rfind(' ', at - 1);
    n += std::atol(text.c_str() + start + 1);
  }
  return n;
}

}  // namespace

// Point 4: the verbs echo server (shuttle-echo-server --transport rdma) logs
// an idle timeout, refused requests and handshakes past their deadline, each
// with the peer's address, through its rate-limited log: every event is
// either shown or counted as suppressed. The phases are apart so that the
// first line of each kind is shown whatever the machine's speed.
TEST_CASE("the rdma echo server logs refused, timed-out and idle peers with their address, rate-limited") {
  const char* exe = std::getenv("SHUTTLE_ECHO_SERVER");
  REQUIRE_MESSAGE(exe != nullptr, "SHUTTLE_ECHO_SERVER (the shuttle-echo-server to test) is not set");
  const std::string host = host_of(test_endpoint(0));
  constexpr int cap = 4, burst = 120;
  child_process srv;
  REQUIRE(srv.start({exe, "--transport", "rdma", "--bind", host, "--port", "0", "--max-handshakes",
                     std::to_string(cap), "--handshake-timeout", "1000", "--idle-timeout", "1500"}));
  const std::string listening = srv.line(60000);
  std::printf("echo server: %s\n", listening.c_str());
  const auto at = listening.find("listening on port ");
  REQUIRE(at != std::string::npos);
  const auto port = static_cast<std::uint16_t>(std::atoi(listening.c_str() + at + 18));
  const endpoint ep = test_endpoint(port);
  const std::string peer_prefix = host + ":";
  auto wait_log = [&](const std::string& what, int n) {
    for (int waited = 0; waited < 60000; waited += 50) {
      if (count_of(srv.err_text(), what) >= n) return true;
      ::poll(nullptr, 0, 50);
    }
    return false;
  };

  // 1. A connection that says nothing: its idle timeout.
  bool idle_logged = false;
  {
    hostile::qp_peer idle;
    REQUIRE(idle.connect(ep.data(), hostile::hello(4, 4, 65536)));
    idle_logged = wait_log("idle timeout", 1);
  }
  // 2. `cap` requests that never complete: each past its deadline.
  hostile::channel ch;
  std::vector<rdma_cm_id*> held;
  const auto priv = hostile::hello(16, 1, 65536);
  auto first = hostile::half_open_burst(ch, ep.data(), cap, priv, 60000, held);
  const int first_answered = static_cast<int>(std::count_if(
      first.begin(), first.end(), [](auto& e) { return e && e->type == RDMA_CM_EVENT_CONNECT_RESPONSE; }));
  const bool late_logged = wait_log("handshake failed: not established within 1000 ms", first_answered);
  // 3. A burst past the cap (the first `cap` of it held again).
  auto answers = hostile::half_open_burst(ch, ep.data(), burst, priv, 120000, held);
  // A request may also end on the client's side before the server saw it
  // (address or route resolution, or the CM's own REQ timeout, on a loaded
  // host): `unseen`, neither refused nor answered.
  int capped = 0, answered = 0, unseen = 0;
  for (auto& e : answers) {
    const bool c = e && e->type == RDMA_CM_EVENT_REJECTED && e->reason() == hostile::too_many_handshakes;
    const bool a = e && e->type == RDMA_CM_EVENT_CONNECT_RESPONSE;
    capped += c;
    answered += a;
    if (!c && !a) {
      ++unseen;
      std::printf("burst: a request ended with %s\n", e ? rdma_event_str(e->type) : "no event");
    }
  }
  // Their deadlines pass: the server destroys them (a REJ comes for each).
  int dropped = 0;
  for (int waited = 0; dropped < answered && waited < 60000; waited += 50)
    if (auto e = ch.next(50); e && e->type == RDMA_CM_EVENT_REJECTED) ++dropped;
  for (auto* id : held) rdma_destroy_id(id);
  const int exit_status = srv.stop(60000);
  const std::string log = srv.err_text();
  const int shown_idle = count_of(log, "failed: idle timeout");
  const int shown_capped = count_of(log, ": refused: too many handshakes in progress");
  const int shown_late = count_of(log, ": handshake failed: not established within 1000 ms");
  const long suppressed = suppressed_in(log);
  std::printf("echo server log: %d idle, %d capped, %d late shown, %ld suppressed; events: 1 idle, %d capped, %d late"
              " (%d answered in the first phase, %d dropped seen, %d ended unseen)\n",
              shown_idle, shown_capped, shown_late, suppressed, capped, first_answered + answered, first_answered,
              dropped, unseen);
  CHECK(exit_status == 0);
  CHECK(idle_logged);
  CHECK(late_logged);
  CHECK(log.find("connection from " + peer_prefix) != std::string::npos);
  CHECK(log.find("peer " + peer_prefix) != std::string::npos);
  CHECK(shown_capped >= 1);
  // The cap held: past the `cap` requests held, none got a handshake.
  CHECK(answered <= cap);
  CHECK(capped + answered + unseen == burst);
  CHECK(capped >= 1);
  CHECK(dropped == answered);
  // Every event is in the log, shown or counted (a request that ended
  // unseen by the client may still have been refused there).
  const long logged = shown_idle + shown_capped + shown_late + suppressed;
  const long events = 1 + capped + first_answered + answered;
  CHECK(logged >= events);
  CHECK(logged <= events + unseen);
  if (logged < events || logged > events + unseen) std::printf("--- the server's stderr:\n%s---\n", log.c_str());
}

// Issue 29 point 6: shuttle-echo-server --transport rdma --accept-plain
// serves a client written against librdmacm alone (no private data, plain
// sends, its own receives) and echoes its sends as plain sends; a shuttle
// client still gets in beside it. Without the flag the plain client is
// refused as not a shuttle peer.
TEST_CASE("the rdma echo server with --accept-plain echoes a plain librdmacm client; without it, refuses it") {
  const char* exe = std::getenv("SHUTTLE_ECHO_SERVER");
  const char* client = std::getenv("SHUTTLE_PLAIN_CLIENT");
  REQUIRE_MESSAGE(exe != nullptr, "SHUTTLE_ECHO_SERVER (the shuttle-echo-server to test) is not set");
  REQUIRE_MESSAGE(client != nullptr, "SHUTTLE_PLAIN_CLIENT (tests/verbs/plain_echo_client) is not set");
  const std::string host = host_of(test_endpoint(0));
  for (bool plain : {true, false}) {
    child_process srv;
    std::vector<std::string> args{exe, "--transport", "rdma", "--bind", host, "--port", "0"};
    if (plain) args.push_back("--accept-plain");
    REQUIRE(srv.start(args));
    const std::string listening = srv.line(60000);
    std::printf("echo server%s: %s\n", plain ? " --accept-plain" : "", listening.c_str());
    const auto at = listening.find("listening on port ");
    REQUIRE(at != std::string::npos);
    const std::string port = std::to_string(std::atoi(listening.c_str() + at + 18));
    // Two plain clients in a row, then a shuttle client.
    for (int i = 0; i < 2; ++i) {
      const int status = std::system((std::string(client) + " " + host + " " + port + " 10").c_str());
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      std::printf("plain client %d: exit %d\n", i, code);
      CHECK(code == (plain ? 0 : 3));
    }
    io_context ctx;
    ctx.run([&]() -> task<void> {
      CHECK(co_await good_client(test_endpoint(static_cast<std::uint16_t>(std::atoi(port.c_str()))),
                                 plain ? "plain peers" : "refused plain peers"));
    }());
    CHECK(srv.stop(60000) == 0);
    if (!plain) CHECK(srv.err_text().find("not a shuttle peer") != std::string::npos);
    if (plain) CHECK(srv.err_text().find("refused") == std::string::npos);
  }
}

// Point 3, client side: a server that asks for infinite RNR retries (7) in
// its REP and never posts a receive. The client's QP retries RNR NAKs a
// finite number of times (its own count, not the REP's): its send ends in
// an error, and the connection with it.
TEST_CASE("a server that never posts receives: the client's send fails instead of retrying for ever") {
  hostile::qp_server hs;
  const std::uint16_t port = hs.listen(test_endpoint(0).data());
  REQUIRE(port != 0);
  std::atomic<int> accepted{0};  // 1 established, -1 failed
  std::thread server([&] { accepted = hs.accept(hostile::hello(4, 4, 65536), 120000) ? 1 : -1; });
  io_context ctx;
  ctx.run([&]() -> task<void> {
    auto d = open_verbs();
    auto c = co_await d.connect(test_endpoint(port));
    const bool up = co_await wait_flag(accepted, 1, 120s);
    REQUIRE_MESSAGE(c, c.error().message());
    CHECK(up);
    const auto t0 = clock::now();
    // The deadline is far past the finite retries (3 x the server's RNR
    // timer, 655 ms by default): on the old code the send never ends.
    auto s = co_await with_timeout(c->send(transport_test::pattern(100, 3)), 90s);
    std::printf("send to a server without receives: %s after %.1f ms\n", s ? "completed" : s.error().message().c_str(),
                std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    CHECK(!s);
    CHECK(s.error() != make_error_code(std::errc::timed_out));
    CHECK(!c->is_open());
    (void)co_await c->close();
  }());
  server.join();
}

namespace {

long rss_kib_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

}  // namespace

// Point 2, the target: the echo server (its own process) holds 300
// half-open requests and 300 idle connections (no cap, no deadline reached,
// no idle timeout), a good client connects and echoes meanwhile, and the
// server's memory per held hostile connection stays under 256 KiB (each
// holds one user receive and the control receives, not the pool). The
// good client's time is printed, not asserted.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool sanitized_build = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool sanitized_build = true;
#else
constexpr bool sanitized_build = false;
#endif
#else
constexpr bool sanitized_build = false;
#endif

TEST_CASE("the rdma echo server holds 300 half-open and 300 idle connections in under 256 KiB each") {
  const char* exe = std::getenv("SHUTTLE_ECHO_SERVER");
  REQUIRE_MESSAGE(exe != nullptr, "SHUTTLE_ECHO_SERVER (the shuttle-echo-server to test) is not set");
  const int half_open = std::getenv("HOSTILE_N") ? std::atoi(std::getenv("HOSTILE_N")) : 300, idle_n = half_open;
  const std::string host = host_of(test_endpoint(0));
  child_process srv;
  REQUIRE(srv.start({exe, "--transport", "rdma", "--bind", host, "--port", "0", "--max-handshakes",
                     std::to_string(half_open + 8), "--handshake-timeout", "3600000"}));
  const std::string listening = srv.line(60000);
  const auto at = listening.find("listening on port ");
  REQUIRE(at != std::string::npos);
  const endpoint ep = test_endpoint(static_cast<std::uint16_t>(std::atoi(listening.c_str() + at + 18)));
  const long rss0 = rss_kib_of(srv.pid);

  hostile::channel ch;
  std::vector<rdma_cm_id*> held;
  auto answers = hostile::half_open_burst(ch, ep.data(), half_open, hostile::hello(16, 1, 65536), 240000, held);
  const int answered = static_cast<int>(std::count_if(
      answers.begin(), answers.end(), [](auto& e) { return e && e->type == RDMA_CM_EVENT_CONNECT_RESPONSE; }));
  std::vector<std::unique_ptr<hostile::qp_peer>> idle;
  for (int i = 0; i < idle_n; ++i) {
    auto q = std::make_unique<hostile::qp_peer>();
    if (!q->connect(ep.data(), hostile::hello(4, 4, 65536))) break;
    idle.push_back(std::move(q));
  }
  const long rss1 = rss_kib_of(srv.pid);
  const int held_n = answered + static_cast<int>(idle.size());
  const double per = held_n > 0 ? double(rss1 - rss0) / held_n : 0;

  io_context ctx;
  const bool good = ctx.run(good_client(ep, "300 half-open and 300 idle connections held (echo server process)", 60s));
  std::printf("echo server RSS %ld -> %ld KiB with %d half-open and %zu idle held: %.1f KiB per held connection\n", rss0,
              rss1, answered, idle.size(), per);
  idle.clear();
  for (auto* id : held) rdma_destroy_id(id);
  CHECK(answered == half_open);
  CHECK(held_n == half_open + idle_n);
  CHECK(good);
  CHECK(rss0 > 0);
  // The 256 KiB target is for the shipped build; ASan's shadow memory and
  // redzones add about a fifth here, so a sanitized build checks twice it.
  CHECK(per < (sanitized_build ? 512.0 : 256.0));
  CHECK(srv.stop(60000) == 0);
}
