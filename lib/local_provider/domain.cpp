// The local provider's domain: registrations (the engine's rkeys, from
// getrandom; a key-table word for those inside a shared block), connect
// and listen.
#include "connection.hpp"
#include "domain_state.hpp"
#include "listener.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace shuttle::detail::local_provider {

result<std::unique_ptr<key_table>> key_table::create() {
  auto fd = make_sealed_memfd("shuttle-local-keys", local_wire::key_table_bytes);
  if (!fd) return fd.error();
  std::unique_ptr<key_table> t(new key_table);
  t->fd_ = *fd;
  void* p = ::mmap(nullptr, local_wire::key_table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  if (p == MAP_FAILED) return errno_code(errno);
  t->words_ = static_cast<std::uint64_t*>(p);
  t->free_.reserve(local_wire::key_slots);
  for (std::uint32_t i = local_wire::key_slots; i > 0; --i) t->free_.push_back(i - 1);
  return t;
}

key_table::~key_table() {
  if (words_) ::munmap(words_, local_wire::key_table_bytes);
  if (fd_ >= 0) ::close(fd_);
}

local_region::~local_region() {
  if (shared()) {
    dom->keys->clear(slot);  // from now on, peers' direct accesses are refused
    if (auto it = dom->shared.find(rkey); it != dom->shared.end() && it->second.expired()) dom->shared.erase(it);
  }
  auto it = dom->cache.find({reinterpret_cast<std::uintptr_t>(addr), length, access});
  if (it != dom->cache.end() && it->second.expired()) dom->cache.erase(it);
  if (host_range) {
    const auto start = reinterpret_cast<std::uintptr_t>(addr);
    auto [lo, hi] = dom->host_ranges.equal_range(start);
    for (; lo != hi; ++lo)
      if (lo->second == start + length) {
        dom->host_ranges.erase(lo);
        break;
      }
  }
  if (gpu_fd >= 0) ::close(gpu_fd);
  // `engine` goes next: the socket's accesses are refused too.
}

bool is_device_memory(const device_hooks* h, const domain_state& d, const void* p, std::size_t len) noexcept {
  if (!h || len == 0) return false;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  // Only the registration that starts last at or before p is looked at: a
  // miss there asks the driver, which is right whatever else covers p.
  if (auto it = d.host_ranges.upper_bound(a); it != d.host_ranges.begin()) {
    --it;
    if (a < it->second && len <= it->second - a) return false;
  }
  return h->is_device(p, len);
}

namespace {

result<void> check_options(const connection_options& o) {
  if (o.shared_receive_queue) return make_error_code(errc::not_supported);
  if (o.send_queue_depth == 0 || o.receive_buffers == 0 || o.receive_buffers > tp::max_receive_buffers ||
      o.receive_buffer_size == 0 || o.receive_buffer_size > tp::max_receive_buffer_size)
    return std::make_error_code(std::errc::invalid_argument);
  return {};
}

class local_domain final : public domain_impl {
 public:
  explicit local_domain(std::shared_ptr<domain_state> st) noexcept : st_(std::move(st)) {}
  transport_kind kind() const noexcept override { return transport_kind::local; }
  std::string describe() const override {
    return "local (same host: Unix socket, shared memfd regions mapped by the peer; tcp wire protocol v" +
           std::to_string(tp::protocol_version) + " on the socket)";
  }

  result<memory_region> register_memory(std::span<std::byte> mem, unsigned flags) override {
    return register_with(mem, flags, 0);
  }

  // `forced`: the rkey to use (register_local_with_key), or 0 for a new one.
  result<memory_region> register_with(std::span<std::byte> mem, unsigned flags, std::uint32_t forced) {
    if (auto c = check_registration(mem, flags); !c) return c.error();
    domain_state::cache_key key{reinterpret_cast<std::uintptr_t>(mem.data()), mem.size(), flags};
    if (auto it = st_->cache.find(key); it != st_->cache.end()) {
      if (auto r = it->second.lock(); r && (forced == 0 || r->rkey == forced)) return memory_region(std::move(r));
    }
    if (forced != 0 &&
        (st_->engine->table.contains(forced) || st_->engine->grants.contains(forced) || st_->shared.count(forced)))
      return std::make_error_code(std::errc::address_in_use);
    if (const device_hooks* h = installed_device_hooks(); h && h->is_device(mem.data(), mem.size()))
      return register_gpu(*h, mem, flags, key, forced);
    auto rkey = forced != 0 ? result<std::uint32_t>(forced) : fresh_key();
    if (!rkey) return rkey.error();
    auto e = std::make_shared<tp::tcp_region>();
    e->dom = st_->engine;
    e->addr = mem.data();
    e->length = mem.size();
    e->access = flags;
    e->rkey = e->lkey = *rkey;
    auto r = std::make_shared<local_region>();
    r->dom = st_;
    r->addr = mem.data();
    r->length = mem.size();
    r->access = flags;
    r->rkey = r->lkey = *rkey;
    r->engine = e;
    st_->engine->table[*rkey] = e;
    // Inside a shared block, with a word free: peers may map it.
    if (auto b = find_shared_block(mem.data(), mem.size())) {
      if (auto slot = st_->keys->take()) {
        r->block = std::move(b);
        r->slot = *slot;
        st_->keys->set(*slot, *rkey);
        st_->shared[*rkey] = r;
      }
    }
    st_->cache[key] = r;
    const auto start = reinterpret_cast<std::uintptr_t>(mem.data());
    st_->host_ranges.emplace(start, start + mem.size());
    r->host_range = true;
    return memory_region(std::move(r));
  }

  // GPU memory (device.cpp says how it is accessed): exported, with a
  // key-table word, or refused (errc::not_supported: memory that cannot be
  // exported, such as cuMemCreate's, or no word free); never handed to the
  // engine, whose reader would touch it with the CPU.
  result<memory_region> register_gpu(const device_hooks& h, std::span<std::byte> mem, unsigned flags,
                                     const domain_state::cache_key& key, std::uint32_t forced) {
    auto r = std::make_shared<local_region>();
    r->dom = st_;  // (its destructor needs it, should we give up below)
    r->addr = mem.data();
    r->length = mem.size();
    r->access = flags;
    auto off = h.export_handle(mem.data(), mem.size(), r->handle);
    if (!off && h.export_fd) off = h.export_fd(mem.data(), mem.size(), &r->gpu_fd, &r->gpu_size);  // cuMemCreate's
    if (!off) return off.error();
    auto rkey = forced != 0 ? result<std::uint32_t>(forced) : fresh_key();
    if (!rkey) return rkey.error();
    auto slot = st_->keys->take();
    if (!slot) return make_error_code(errc::not_supported);
    r->rkey = r->lkey = *rkey;
    r->gpu = true;
    r->gpu_offset = *off;
    r->slot = *slot;
    st_->keys->set(*slot, *rkey);
    st_->shared[*rkey] = r;
    st_->cache[key] = r;
    return memory_region(std::move(r));
  }

  // A key neither the engine's table nor a GPU registration (which has no
  // engine region) holds.
  result<std::uint32_t> fresh_key() {
    for (;;) {
      auto k = st_->engine->new_key();
      if (!k || !st_->shared.count(*k)) return k;
    }
  }

  task<result<connection>> connect(endpoint remote, connection_options opts) override {
    auto name = socket_name(remote);
    if (!name) return fail(name.error());
    return connect_named(remote, *name, std::move(opts));
  }
  task<result<connection>> connect_named(endpoint named, endpoint socket, connection_options opts) {
    if (auto c = check_options(opts); !c) return fail(c.error());
    return connect_impl(st_, named, socket, opts);
  }

  result<listener> listen(endpoint local, connection_options opts, listener_options limits) override {
    if (auto c = check_options(opts); !c) return c.error();
    return local_provider::listen(st_, local, opts, limits);
  }

 private:
  static task<result<connection>> fail(std::error_code ec) { co_return ec; }
  static task<result<connection>> connect_impl(std::shared_ptr<domain_state> dom, endpoint remote, endpoint name,
                                               connection_options opts) {
    auto start = shuttle::clock::now();
    auto sock = co_await tcp_socket::connect(name, opts.connect_timeout);
    if (!sock) co_return sock.error();
    auto left = opts.connect_timeout - std::chrono::duration_cast<std::chrono::milliseconds>(shuttle::clock::now() - start);
    auto s = co_await with_timeout(handshake(*sock, dom, opts, local_wire::role::connector),
                                   std::max(left, std::chrono::milliseconds(1)));
    if (!s) co_return tp::handshake_error(s.error());
    ext_of(**s).named = remote;
    (*s)->start();
    co_return make_local_connection(std::move(*s));
  }

  std::shared_ptr<domain_state> st_;
};

}  // namespace

// Entry points for transport_kind::automatic (lib/auto_provider).
result<memory_region> register_with_key(domain_impl& d, std::span<std::byte> mem, unsigned flags,
                                        std::uint32_t rkey) {
  auto* l = dynamic_cast<local_domain*>(&d);
  if (!l || rkey == 0) return std::make_error_code(std::errc::invalid_argument);
  return l->register_with(mem, flags, rkey);
}

task<result<connection>> connect_as(domain_impl& d, endpoint named, endpoint socket, connection_options opts) {
  auto* l = dynamic_cast<local_domain*>(&d);
  if (!l) co_return std::make_error_code(std::errc::invalid_argument);
  co_return co_await l->connect_named(named, socket, std::move(opts));
}

}  // namespace shuttle::detail::local_provider

namespace shuttle::detail {

result<std::shared_ptr<domain_impl>> make_local_domain(const domain_options&) {
  auto st = std::make_shared<local_provider::domain_state>();
  auto keys = local_provider::key_table::create();
  if (!keys) return keys.error();
  st->keys = std::move(*keys);
  return std::shared_ptr<domain_impl>(std::make_shared<local_provider::local_domain>(std::move(st)));
}

result<memory_region> register_local_with_key(domain_impl& d, std::span<std::byte> mem, unsigned access_flags,
                                              std::uint32_t rkey) {
  return local_provider::register_with_key(d, mem, access_flags, rkey);
}

task<result<connection>> connect_local_as(domain_impl& d, endpoint named, endpoint socket, connection_options opts) {
  return local_provider::connect_as(d, named, socket, std::move(opts));
}

}  // namespace shuttle::detail
