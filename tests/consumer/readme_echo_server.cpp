// README.md, the first example (an echo server), verbatim: tools/test-consumers.sh
// compiles it against the installed library (it serves until SIGINT, so it is
// not run). Keep the two in step.
#include <shuttle/shuttle.hpp>
using namespace shuttle;

task<void> echo(tcp_socket s) {
  std::byte buf[16384];
  for (;;) {
    auto n = co_await s.read_some(buf);            // result<size_t>, never throws
    if (!n || *n == 0) co_return;                   // error or peer closed
    if (!co_await s.write_all(std::span(buf, *n))) co_return;
  }
}

task<void> serve(tcp_listener& l, async_scope& conns) {
  for (;;) {
    auto s = co_await l.accept();                   // multishot accept underneath
    if (!s) co_return;
    conns.spawn(echo(std::move(*s)));               // structured: joined before scope dies
  }
}

int main() {
  io_context ctx;                                   // one io_uring for this thread
  auto l = tcp_listener::bind(endpoint::loopback(7000)).value();
  async_scope conns;
  ctx.run(when_any(serve(l, conns), [&]() -> task<void> {
    signal_set sigs{SIGINT, SIGTERM};
    (void)co_await sigs.wait();                     // losers are cancelled and awaited
  }()));
  conns.request_stop();
  ctx.run(conns.join());
}
