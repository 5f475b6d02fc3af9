// A program that uses shuttle the way a downstream project does: through
// `pkg-config shuttle` after `meson install`, or as a meson subproject
// (dependency('shuttle')). It echoes one message over loopback TCP and over
// the transport API's tcp provider.
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <cstdio>
#include <cstring>

using namespace shuttle;

namespace {
task<int> echo_once() {
  auto listener = tcp_listener::bind(endpoint::loopback(0));
  if (!listener) co_return 1;
  auto ep = endpoint::loopback(listener->local_endpoint()->port());
  auto serve = [&]() -> task<bool> {
    auto s = co_await listener->accept();
    if (!s) co_return false;
    std::byte buf[16];
    auto n = co_await s->read_some(buf);
    co_return n && *n > 0 && co_await s->write_all(std::span(buf, *n));
  };
  auto ask = [&]() -> task<bool> {
    auto c = co_await tcp_socket::connect(ep);
    if (!c) co_return false;
    const char msg[] = "ping";
    if (!co_await c->write_all(std::as_bytes(std::span(msg, 4)))) co_return false;
    std::byte got[4];
    co_return co_await c->read_exact(got) && std::memcmp(got, msg, 4) == 0;
  };
  auto served = serve();
  auto asked = ask();
  auto [s, a] = co_await when_all(std::move(served), std::move(asked));
  co_return s && a ? 0 : 1;
}
}  // namespace

int main() {
  int rc = sync_wait(echo_once());
  std::printf("shuttle consumer: tcp echo %s\n", rc == 0 ? "ok" : "FAILED");
  return rc;
}
