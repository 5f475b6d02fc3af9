// A program that uses shuttle the way a downstream project does: through
// `pkg-config shuttle` after `meson install`, or as a meson subproject
// (dependency('shuttle')). It echoes one message over loopback TCP and over
// the transport API's tcp provider. It includes <shuttle/shuttle.hpp> alone:
// that one header must declare the whole runtime, the transport API included.
#include <shuttle/shuttle.hpp>

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

task<int> transport_echo_once() {
  domain_options opts;
  opts.kind = transport_kind::tcp;
  auto server_domain = domain::open(opts), client_domain = domain::open(opts);
  if (!server_domain || !client_domain) co_return 1;
  auto l = server_domain->listen(endpoint::loopback(0));
  if (!l) co_return 1;
  auto serve = [&]() -> task<bool> {
    auto c = co_await with_timeout(l->accept(), std::chrono::seconds(10));
    if (!c) co_return false;
    auto m = co_await c->recv();
    bool ok = m && co_await c->send(m->data());
    co_return ok && co_await c->close();
  };
  auto ask = [&]() -> task<bool> {
    auto c = co_await client_domain->connect(endpoint::loopback(l->local_endpoint()->port()));
    if (!c) co_return false;
    const char msg[] = "ping";
    if (!co_await c->send(std::as_bytes(std::span(msg, 4)))) co_return false;
    auto m = co_await c->recv();
    bool ok = m && m->size() == 4 && std::memcmp(m->data().data(), msg, 4) == 0;
    co_return ok && co_await c->close();
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
  int trc = sync_wait(transport_echo_once());
  std::printf("shuttle consumer: transport echo (tcp provider) %s\n", trc == 0 ? "ok" : "FAILED");
  return rc || trc;
}
