// The tcp provider's domain: registrations (rkeys from the kernel's CSPRNG,
// a cache by range and rights), connect and listen.
#include "connection.hpp"
#include "domain_state.hpp"
#include "listener.hpp"

#include <sys/random.h>

#include <cerrno>
#include <string>

namespace shuttle::detail::tcp_provider {

result<std::uint32_t> domain_state::new_key() {
  for (;;) {
    if (random_left == 0) {
      auto* p = reinterpret_cast<char*>(random_keys.data());
      std::size_t got = 0;
      while (got < sizeof random_keys) {
        ssize_t n = ::getrandom(p + got, sizeof random_keys - got, 0);
        if (n < 0) {
          if (errno == EINTR) continue;
          return errno_code(errno);
        }
        got += static_cast<std::size_t>(n);
      }
      random_left = random_keys.size();
    }
    std::uint32_t k = random_keys[--random_left];
    if (k != 0 && !table.contains(k) && !grants.contains(k)) return k;
  }
}

tcp_region::~tcp_region() {
  dom->table.erase(rkey);
  auto it = dom->cache.find({reinterpret_cast<std::uintptr_t>(addr), length, access});
  if (it != dom->cache.end() && it->second == rkey) dom->cache.erase(it);
}

namespace {

result<void> check_options(const connection_options& o) {
  // No SRQ equivalent here (see connection_options::shared_receive_queue):
  // refused rather than ignored.
  if (o.shared_receive_queue) return make_error_code(errc::not_supported);
  if (o.send_queue_depth == 0 || o.receive_buffers == 0 || o.receive_buffers > max_receive_buffers ||
      o.receive_buffer_size == 0 || o.receive_buffer_size > max_receive_buffer_size)
    return std::make_error_code(std::errc::invalid_argument);
  return {};
}

class tcp_domain final : public domain_impl {
 public:
  transport_kind kind() const noexcept override { return transport_kind::tcp; }
  std::string describe() const override {
    return "tcp (user-space RC semantics over TCP, wire protocol v" + std::to_string(protocol_version) + ")";
  }

  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) override {
    if (auto c = check_registration(mem, flags); !c) return c.error();
    domain_state::cache_key key{reinterpret_cast<std::uintptr_t>(mem.data()), mem.size(), flags};
    if (auto it = st_->cache.find(key); it != st_->cache.end()) {
      if (auto r = st_->find(it->second)) return memory_region(std::move(r));
    }
    auto r = std::make_shared<tcp_region>();
    r->dom = st_;
    r->addr = mem.data();
    r->length = mem.size();
    r->access = flags;
    auto rkey = st_->new_key();
    if (!rkey) return rkey.error();
    r->rkey = r->lkey = *rkey;
    st_->table[r->rkey] = r;
    st_->cache[key] = r->rkey;
    return memory_region(std::move(r));
  }

  task<result<connection>> connect(endpoint remote, connection_options opts) override {
    if (auto c = check_options(opts); !c) return fail(c.error());
    return connect_impl(st_, remote, opts);
  }

  result<listener> listen(endpoint local, connection_options opts, listener_options limits) override {
    if (auto c = check_options(opts); !c) return c.error();
    auto l = tcp_listener::bind(local);
    if (!l) return l.error();
    return listener(make_listener(std::move(*l), st_, opts, limits));
  }

 private:
  static task<result<connection>> fail(std::error_code ec) { co_return ec; }
  static task<result<connection>> connect_impl(std::shared_ptr<domain_state> dom, endpoint remote,
                                               connection_options opts) {
    auto start = clock::now();
    auto s = co_await tcp_socket::connect(remote, opts.connect_timeout);
    if (!s) co_return s.error();
    auto left = opts.connect_timeout - std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
    opts.connect_timeout = std::max(left, std::chrono::milliseconds(1));
    co_return co_await establish(std::move(*s), std::move(dom), opts);
  }

  std::shared_ptr<domain_state> st_ = std::make_shared<domain_state>();
};

}  // namespace

}  // namespace shuttle::detail::tcp_provider

namespace shuttle::detail {

result<std::shared_ptr<domain_impl>> make_tcp_domain(const domain_options&) {
  return std::shared_ptr<domain_impl>(std::make_shared<tcp_provider::tcp_domain>());
}

}  // namespace shuttle::detail
