// README.md, "The transport API": one-sided RDMA between two peers. The
// server registers a buffer and a counter and sends the client their
// descriptors; the client writes into the buffer, reads it back, adds to the
// counter with an atomic and bounds a wait with a timeout. Both peers run in
// this one process over loopback on the tcp provider; on machines with RDMA
// NICs the same code runs on verbs (domain_options::kind, the NIC's address).
// tools/test-consumers.sh builds and runs it against the installed library.
#include <shuttle/shuttle.hpp>

#include <array>
#include <cstdio>
#include <vector>

using namespace shuttle;
using namespace std::chrono_literals;
constexpr std::size_t desc_size = remote_buffer::wire_size;

// Exposes `buffer` and `counter` to one client, then waits for its "done".
task<result<void>> serve(domain& d, listener& l, std::span<std::byte> buffer, std::uint64_t& counter) {
  auto buffer_mr = d.register_memory(buffer, access::all);
  if (!buffer_mr) co_return buffer_mr.error();
  auto counter_mr = d.register_memory(std::as_writable_bytes(std::span(&counter, 1)), access::all);
  if (!counter_mr) co_return counter_mr.error();
  auto c = co_await with_timeout(l.accept(), 10s);
  if (!c) co_return c.error();
  std::array<std::byte, 2 * desc_size> descriptors;
  buffer_mr->remote().serialize(std::span(descriptors).first<desc_size>());
  counter_mr->remote().serialize(std::span(descriptors).last<desc_size>());
  if (auto s = co_await c->send(descriptors); !s) co_return s.error();
  auto done = co_await with_timeout(c->recv(), 10s);
  if (!done) co_return done.error();
  co_return co_await c->close();
}

// Returns the counter's value before its fetch_and_add.
task<result<std::uint64_t>> client(domain& d, endpoint server) {
  auto c = co_await with_timeout(d.connect(server), 10s);
  if (!c) co_return c.error();
  auto descriptors = co_await with_timeout(c->recv(), 10s);
  if (!descriptors) co_return descriptors.error();
  if (descriptors->size() != 2 * desc_size) co_return make_error_code(errc::protocol_error);
  auto buffer = remote_buffer::deserialize(descriptors->data().first<desc_size>());
  auto counter = remote_buffer::deserialize(descriptors->data().last<desc_size>());

  std::array<std::byte, 64> out, in{};
  out.fill(std::byte{0x5a});
  auto slice = buffer.slice(128, out.size());  // bounds-checked against the descriptor
  if (!slice) co_return slice.error();
  if (auto w = co_await c->write(out, *slice); !w) co_return w.error();  // one-sided: no server code runs
  if (auto r = co_await c->read(in, *slice); !r) co_return r.error();
  if (in != out) co_return make_error_code(std::errc::io_error);
  auto before = co_await c->fetch_and_add(counter, 1);  // a 64-bit atomic on the server's memory
  if (!before) co_return before.error();

  // Any operation takes a timeout; the server sends nothing now, so this
  // recv is cancelled after 50 ms and the connection stays usable.
  auto nothing = co_await with_timeout(c->recv(), 50ms);
  if (nothing || nothing.error() != std::errc::timed_out) co_return make_error_code(std::errc::io_error);

  const char done[] = "done";
  if (auto s = co_await c->send(std::as_bytes(std::span(done))); !s) co_return s.error();
  if (auto closed = co_await c->close(); !closed) co_return closed.error();
  co_return *before;
}

int main() {
  io_context ctx;  // domains and connections belong to the loop of the thread that opens them
  domain_options tcp;
  tcp.kind = transport_kind::tcp;  // automatic: verbs where an RDMA device is active
  auto server_domain = domain::open(tcp);
  auto client_domain = domain::open(tcp);
  if (!server_domain || !client_domain) return 1;
  auto l = server_domain->listen(endpoint::loopback(0));
  if (!l) return 1;
  std::vector<std::byte> buffer(4096);
  std::uint64_t counter = 41;
  auto [served, before] = ctx.run(when_all(serve(*server_domain, *l, buffer, counter),
                                           client(*client_domain, endpoint::loopback(l->local_endpoint()->port()))));
  if (!served || !before) {
    std::printf("transport example failed: %s\n", (served ? before.error() : served.error()).message().c_str());
    return 1;
  }
  bool ok = *before == 41 && counter == 42 && buffer[128] == std::byte{0x5a} && buffer[127] == std::byte{0};
  std::printf("shuttle consumer: transport example (write, read, fetch_and_add, timeout) %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
