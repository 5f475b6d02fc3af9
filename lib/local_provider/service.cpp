// The service channel (local_wire.hpp): our answers to the peer's queries
// ("may I map rkey K?") and the peer's answers to ours, which map its
// shared regions here. Anything out of place there (garbage, an answer
// nobody asked for, a descriptor that is not a sealed memfd, a range past
// its end) fails the connection with errc::protocol_error.
#include "conn_state.hpp"
#include "sys_io.hpp"

#include <sys/mman.h>

#include <array>

namespace shuttle::detail::local_provider {

namespace {

constexpr unsigned remote_rights = access::remote_write | access::remote_read | access::remote_atomic;

// Answers a query: the region, with its block's memfd, if it is ours and
// shared; refused otherwise (then the peer's accesses go through the socket,
// where the reader checks them and refuses what is bad).
bool answer_query(conn_ext& x, std::uint32_t rkey) {
  local_wire::answer a;
  a.rkey = rkey;
  int pass = -1;
  auto it = x.dom->shared.find(rkey);
  if (auto r = it != x.dom->shared.end() ? it->second.lock() : nullptr; r && (r->access & remote_rights)) {
    a.ok = true;
    a.addr = reinterpret_cast<std::uint64_t>(r->addr);
    a.length = r->length;
    a.access = r->access;
    a.slot = r->slot;
    if (r->gpu && r->gpu_fd >= 0) {  // cuMemCreate memory: its fd goes along
      a.kind = shared_kind::cuda_fd;
      a.offset = r->gpu_offset;
      a.alloc_size = r->gpu_size;
      pass = r->gpu_fd;
    } else if (r->gpu) {  // its IPC handle goes in the answer
      a.kind = shared_kind::cuda_ipc;
      a.offset = r->gpu_offset;
      a.handle = r->handle;
    } else {
      a.kind = r->block->kind;
      a.offset = static_cast<std::uint64_t>(r->addr - r->block->base);
      pass = r->block->fd;
    }
  }
  std::array<std::byte, local_wire::max_message> out{};
  const std::size_t n = local_wire::encode_full_answer(a, out);
  // The peer asks at most max_queries at once and reads its answers: a full
  // channel is a peer flooding us.
  return send_with_fds(x.service_fd, std::span(out).first(n),
                       pass >= 0 ? std::span<const int>(&pass, 1) : std::span<const int>{})
      .has_value();
}

// A GPU region's answer: its handle imported (once per process), or the
// reason it cannot be (its accesses fail with it: the socket cannot reach
// GPU memory). False: the answer contradicts itself (a range past the
// allocation it names), a protocol error.
bool take_gpu_answer(const local_wire::answer& a, peer_region& pr, int fd) {
  pr.gpu = true;
  const device_hooks* h = installed_device_hooks();
  if (!h) {  // no CUDA layer in this process
    pr.unusable = make_error_code(errc::not_supported);
    return true;
  }
  if (a.kind == shared_kind::cuda_fd && !h->import_fd) {
    pr.unusable = make_error_code(errc::not_supported);
    return true;
  }
  auto imp = a.kind == shared_kind::cuda_fd ? h->import_fd(fd, a.alloc_size) : h->import_handle(a.handle);
  if (!imp) {  // a forged or stale handle, or a GPU this one cannot reach
    pr.unusable = make_error_code(errc::remote_access_error);
    return true;
  }
  const device_hooks::imported got = *imp;
  pr.map = std::shared_ptr<void>(got.base, [h](void* b) { h->release_import(static_cast<std::byte*>(b)); });
  if (a.offset > got.size || a.length > got.size - a.offset) return false;
  pr.ok = true;
  pr.at = got.base + a.offset;
  pr.addr = a.addr;
  pr.length = a.length;
  pr.access = a.access;
  pr.slot = a.slot;
  return true;
}

// Takes an answer: maps the region (the rights it grants: write too if it
// may be written or updated), or remembers the refusal.
bool take_answer(conn_ext& x, const local_wire::answer& a, fd_list& fds) {
  auto q = x.asked.find(a.rkey);
  if (q == x.asked.end()) return false;
  x.asked.erase(q);
  --x.queries;
  peer_region pr;
  pr.rkey = a.rkey;
  if (!a.ok) {
    if (!fds.fds.empty()) return false;
  } else if (a.kind == shared_kind::cuda_ipc) {
    if (!fds.fds.empty() || !take_gpu_answer(a, pr, -1)) return false;
  } else if (a.kind == shared_kind::cuda_fd) {
    if (fds.fds.size() != 1 || !take_gpu_answer(a, pr, fds.fds[0])) return false;
  } else {
    if (fds.fds.size() != 1) return false;
    auto size = check_sealed_memfd(fds.fds[0]);
    if (!size || a.offset > *size || a.length > *size - a.offset) return false;
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t start = a.offset / page * page;
    const std::size_t len = static_cast<std::size_t>(a.offset + a.length - start);
    const int prot = PROT_READ | ((a.access & (access::remote_write | access::remote_atomic)) ? PROT_WRITE : 0);
    void* p = ::mmap(nullptr, len, prot, MAP_SHARED, fds.fds[0], static_cast<off_t>(start));
    if (p != MAP_FAILED) {  // else (out of address space): through the socket
      pr.ok = true;
      pr.map = std::make_shared<mapping>(p, len);
      pr.at = static_cast<std::byte*>(p) + (a.offset - start);
      pr.addr = a.addr;
      pr.length = a.length;
      pr.access = a.access;
      pr.slot = a.slot;
    }
  }
  x.regions[a.rkey] = std::move(pr);
  x.pulse();  // accesses waiting for it (device.cpp)
  return true;
}

// One message; false: the peer broke the protocol.
bool handle(conn_ext& x, std::span<const std::byte> bytes, fd_list& fds) {
  auto m = local_wire::decode_message(bytes);
  if (!m) return false;
  if (m->type == local_wire::msg_type::query) return fds.fds.empty() && answer_query(x, m->rkey);
  return take_answer(x, m->ans, fds);
}

}  // namespace

task<void> service_loop(std::shared_ptr<tp::conn_state> s) {
  conn_ext& x = ext_of(*s);
  struct over {  // however it ends: accesses waiting for an answer stop waiting
    conn_ext& x;
    ~over() {
      x.service_over = true;
      x.pulse();
    }
  } guard{x};
  std::array<std::byte, local_wire::max_message + 1> buf;  // one byte more: an oversize message is caught
  bool failed = false;
  while (s->state() == tp::conn_state::phase::open && !failed) {
    int r = co_await poll_in(x.service_fd);
    if (r < 0 || s->state() != tp::conn_state::phase::open) break;  // stopped
    // A budget per wake-up: a flooding peer does not starve the loop.
    for (unsigned i = 0; i < 64; ++i) {
      fd_list fds;
      auto n = recv_with_fds(x.service_fd, buf, fds.fds);
      if (!n && n.error() == std::errc::resource_unavailable_try_again) break;
      if (!n || *n == 0) co_return;  // the peer's end closed (or broke): its socket says why
      try {
        if (!handle(x, std::span(buf).first(*n), fds)) failed = true;
      } catch (const std::bad_alloc&) {
        failed = true;
      }
      if (failed) break;
    }
  }
  if (failed) s->enter_error(make_error_code(errc::protocol_error));
}

}  // namespace shuttle::detail::local_provider
