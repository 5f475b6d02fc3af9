// The provider-neutral front: wrappers that forward to the provider, and the
// choice of provider.
#include "little_endian.hpp"
#include "provider.hpp"

#include <shuttle/io_context.hpp>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace shuttle {

const char* to_string(transport_kind k) noexcept {
  switch (k) {
    case transport_kind::automatic: return "auto";
    case transport_kind::tcp: return "tcp";
    case transport_kind::verbs: return "verbs";
    case transport_kind::local: return "local";
  }
  return "?";
}

result<transport_kind> parse_transport_kind(std::string_view s) {
  if (s == "auto" || s.empty()) return transport_kind::automatic;
  if (s == "tcp") return transport_kind::tcp;
  if (s == "verbs" || s == "rdma") return transport_kind::verbs;
  if (s == "local") return transport_kind::local;
  return std::make_error_code(std::errc::invalid_argument);
}

// ---------------------------------------------------------------- remote_buffer

using detail::get_le;
using detail::put_le;

void remote_buffer::serialize(std::span<std::byte, wire_size> out) const noexcept {
  put_le(out.data(), address, 8);
  put_le(out.data() + 8, rkey, 4);
  put_le(out.data() + 12, length, 8);
}

remote_buffer remote_buffer::deserialize(std::span<const std::byte, wire_size> in) noexcept {
  return {get_le(in.data(), 8), static_cast<std::uint32_t>(get_le(in.data() + 8, 4)), get_le(in.data() + 12, 8)};
}

result<void> remote_buffer::serialize(std::span<std::byte> out) const noexcept {
  if (out.size() < wire_size) return std::make_error_code(std::errc::invalid_argument);
  serialize(out.first<wire_size>());
  return {};
}

result<remote_buffer> remote_buffer::deserialize(std::span<const std::byte> in) noexcept {
  if (in.size() < wire_size) return std::make_error_code(std::errc::invalid_argument);
  return deserialize(in.first<wire_size>());
}

result<remote_buffer> remote_buffer::slice(std::uint64_t offset, std::uint64_t len) const noexcept {
  if (offset > length || len > length - offset) return std::make_error_code(std::errc::result_out_of_range);
  return remote_buffer{address + offset, rkey, len};
}

// ---------------------------------------------------------------- memory_region

std::byte* memory_region::data() const noexcept { return impl_ ? impl_->addr : nullptr; }
std::size_t memory_region::size() const noexcept { return impl_ ? impl_->length : 0; }
unsigned memory_region::access() const noexcept { return impl_ ? impl_->access : 0; }
std::uint32_t memory_region::lkey() const noexcept { return impl_ ? impl_->lkey : 0; }
std::uint32_t memory_region::rkey() const noexcept { return impl_ ? impl_->rkey : 0; }

remote_buffer memory_region::remote(std::size_t offset, std::size_t len) const noexcept {
  if (!impl_ || offset > impl_->length) return {};
  len = std::min(len, impl_->length - offset);
  return {reinterpret_cast<std::uint64_t>(impl_->addr) + offset, impl_->rkey, len};
}

namespace detail {
domain_impl* impl_access::of(const domain& d) noexcept { return d.impl_ ? d.impl_->provider() : nullptr; }
memory_region impl_access::for_kind(const memory_region& r, transport_kind k) {
  if (const memory_region* c = r.impl_ ? r.impl_->child(k) : nullptr) return *c;
  return r;
}
}  // namespace detail

// ---------------------------------------------------------------- memory_grant

memory_grant::memory_grant() noexcept = default;
memory_grant::memory_grant(std::unique_ptr<detail::grant_impl> impl) noexcept : impl_(std::move(impl)) {}
memory_grant::memory_grant(memory_grant&&) noexcept = default;
memory_grant& memory_grant::operator=(memory_grant&&) noexcept = default;
memory_grant::~memory_grant() = default;
remote_buffer memory_grant::remote() const noexcept { return impl_ ? impl_->remote() : remote_buffer{}; }
memory_grant::operator bool() const noexcept { return impl_ && impl_->remote().rkey != 0; }

// ---------------------------------------------------------------- connection

namespace {
template <class T>
task<result<T>> not_connected() {
  co_return make_error_code(errc::disconnected);
}
task<result<void>> invalid_grant() { co_return std::make_error_code(std::errc::invalid_argument); }
}  // namespace

namespace detail {
task<result<memory_grant>> connection_impl::grant(const memory_region&, std::size_t, std::size_t, unsigned) {
  co_return make_error_code(errc::not_supported);
}
task<result<void>> connection_impl::revoke(grant_impl&) { co_return make_error_code(errc::not_supported); }
task<result<void>> connection_impl::post_batch_at(std::span<const operation> ops, std::size_t& failed) {
  failed = ops.size();
  co_return co_await post_batch(ops);
}

namespace {
template <class T>
void fail_disconnected(connection_impl*, const op_args&, op_slot<T>& out) {
  out.set_result(make_error_code(errc::disconnected));
}
}  // namespace
const launch_table no_connection_ops = {fail_disconnected<void>, fail_disconnected<message>,
                                        fail_disconnected<void>, fail_disconnected<void>,
                                        fail_disconnected<void>, fail_disconnected<std::uint64_t>,
                                        fail_disconnected<std::uint64_t>};
}  // namespace detail

connection::connection() noexcept : ops_(&detail::no_connection_ops) {}
connection::connection(std::unique_ptr<detail::connection_impl> impl) noexcept
    : impl_(std::move(impl)), ops_(impl_ ? &impl_->single_ops : &detail::no_connection_ops) {}
connection::connection(connection&& o) noexcept
    : impl_(std::move(o.impl_)), ops_(std::exchange(o.ops_, &detail::no_connection_ops)) {}
connection& connection::operator=(connection&& o) noexcept {
  if (this != &o) {
    impl_ = std::move(o.impl_);
    ops_ = std::exchange(o.ops_, &detail::no_connection_ops);
  }
  return *this;
}
connection::~connection() = default;

task<result<void>> connection::post_batch(std::span<const operation> ops) {
  return impl_ ? impl_->post_batch(ops) : not_connected<void>();
}
result<prepared_operation> connection::prepare(const operation& op) {
  if (!impl_) return make_error_code(errc::disconnected);
  auto r = impl_->prepare(op);
  if (!r) return r.error();
  return prepared_operation(std::move(*r));
}
task<result<memory_grant>> connection::grant(const memory_region& r, std::size_t offset, std::size_t len,
                                             unsigned rights) {
  if (!impl_) co_return co_await not_connected<memory_grant>();
  // The provider's task is lazy: the region it is given must outlive it,
  // so this frame holds the one for_kind returns.
  const memory_region mine = detail::impl_access::for_kind(r, impl_->kind());
  co_return co_await impl_->grant(mine, offset, len, rights);
}
task<result<void>> connection::revoke(memory_grant& g) {
  if (!detail::impl_access::of(g) || detail::impl_access::of(g)->owner != impl_.get() || !impl_) return invalid_grant();
  return impl_->revoke(*detail::impl_access::of(g));
}
task<result<void>> connection::close() { return impl_ ? impl_->close() : not_connected<void>(); }
bool connection::is_open() const noexcept { return impl_ && impl_->is_open(); }
transport_kind connection::kind() const noexcept { return impl_ ? impl_->kind() : transport_kind::automatic; }
std::size_t connection::max_message_size() const noexcept { return impl_ ? impl_->max_message_size() : 0; }
endpoint connection::remote_endpoint() const noexcept { return impl_ ? impl_->remote_endpoint() : endpoint{}; }
wire_protocol connection::protocol() const noexcept {
  return impl_ ? impl_->protocol() : wire_protocol::shuttle;
}
std::span<const std::byte> connection::peer_payload() const noexcept {
  return impl_ ? impl_->peer_payload() : std::span<const std::byte>{};
}

// ---------------------------------------------------------------- listener

listener::listener() noexcept = default;
listener::listener(std::unique_ptr<detail::listener_impl> impl) noexcept : impl_(std::move(impl)) {}
listener::listener(listener&&) noexcept = default;
listener& listener::operator=(listener&&) noexcept = default;
listener::~listener() = default;

task<result<connection>> listener::accept() {
  if (!impl_) return not_connected<connection>();
  return impl_->accept();
}
result<endpoint> listener::local_endpoint() const {
  // As tcp_listener's: an error for no listener or a closed one.
  endpoint e = impl_ ? impl_->local_endpoint() : endpoint{};
  if (e.size() == 0) return std::make_error_code(std::errc::bad_file_descriptor);
  return e;
}
void listener::close() noexcept {
  if (impl_) impl_->close();
}

// ---------------------------------------------------------------- domain

result<domain> domain::open(domain_options opts) {
  // A domain belongs to the calling thread's loop (its connections' I/O
  // and completions run there).
  if (!io_context::current_or_null()) return make_error_code(errc::no_io_context);
  if (opts.kind == transport_kind::automatic) {
    if (const char* env = std::getenv("SHUTTLE_TRANSPORT")) {
      auto k = parse_transport_kind(env);
      if (!k) return k.error();
      opts.kind = *k;
    }
  }
  if (opts.kind == transport_kind::verbs) {
    auto d = detail::make_verbs_domain(opts);
    if (!d) return d.error();
    return domain(std::move(*d));
  }
  if (opts.kind == transport_kind::local) {
    auto d = detail::make_local_domain(opts);
    if (!d) return d.error();
    return domain(std::move(*d));
  }
  std::shared_ptr<detail::domain_impl> remote;
  if (opts.kind == transport_kind::automatic) {
    if (auto d = detail::make_verbs_domain(opts)) remote = std::move(*d);
  }
  if (!remote) {
    auto d = detail::make_tcp_domain(opts);
    if (!d) return d.error();
    remote = std::move(*d);
  }
  if (opts.kind != transport_kind::automatic || !opts.local_peers) return domain(std::move(remote));
  if (const char* env = std::getenv("SHUTTLE_AUTO_LOCAL"); env && std::strcmp(env, "0") == 0)
    return domain(std::move(remote));
  // Automatic: the local provider too, for peers on this host
  // (lib/auto_provider/README.md). Without it (no memfd), the remote one alone.
  auto local = detail::make_local_domain(opts);
  if (!local) return domain(std::move(remote));
  auto d = detail::make_auto_domain(std::move(remote), std::move(*local));
  if (!d) return d.error();
  return domain(std::move(*d));
}

transport_kind domain::kind() const noexcept { return impl_->kind(); }
std::string domain::describe() const { return impl_->describe(); }
result<memory_region> domain::register_memory(std::span<std::byte> mem, unsigned access_flags) {
  return impl_->register_memory(mem, access_flags);
}
namespace {
task<result<connection>> failed_connect(std::error_code ec) { co_return ec; }
}  // namespace

task<result<connection>> domain::connect(endpoint remote, connection_options opts) {
  // Checked here, once for every provider: nothing is sent.
  if (opts.payload.size() > max_connect_payload) return failed_connect(make_error_code(errc::message_too_long));
  if (opts.protocol != wire_protocol::shuttle && impl_->kind() != transport_kind::verbs)
    return failed_connect(make_error_code(errc::not_supported));  // plain RC: verbs only
  if (opts.protocol == wire_protocol::detect) opts.protocol = wire_protocol::shuttle;  // a listener's choice
  return impl_->connect(remote, std::move(opts));
}
task<result<connection>> domain::connect(endpoint remote, std::span<const std::byte> payload,
                                         connection_options opts) {
  opts.payload.assign(payload.begin(), payload.end());
  return connect(remote, std::move(opts));
}
result<listener> domain::listen(endpoint local, connection_options opts, listener_options limits) {
  if (!io_context::current_or_null()) return make_error_code(errc::no_io_context);
  if (opts.payload.size() > max_connect_payload) return make_error_code(errc::message_too_long);
  if (opts.protocol != wire_protocol::shuttle && impl_->kind() != transport_kind::verbs)
    return make_error_code(errc::not_supported);
  return impl_->listen(local, opts, limits);
}

}  // namespace shuttle
