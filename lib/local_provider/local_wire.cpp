// The local provider's hello and service messages (local_wire.hpp).
#include "local_wire.hpp"

#include "../transport/little_endian.hpp"

#include <shuttle/error.hpp>
#include <shuttle/transport.hpp>

#include <algorithm>
#include <cstring>

namespace shuttle::detail::local_wire {

namespace {
std::error_code bad() noexcept { return make_error_code(errc::protocol_error); }
}  // namespace

void encode_hello(const hello& h, std::span<std::byte, hello_size> out) noexcept {
  put_le(out.data(), hello_magic, 4);
  put_le(out.data() + 4, h.version, 2);
  put_le(out.data() + 6, static_cast<std::uint8_t>(h.from), 1);
  put_le(out.data() + 7, (h.rings ? 1 : 0) | (h.membarrier ? 2 : 0) | (h.carried ? 4 : 0), 1);  // flags
  put_le(out.data() + 8, h.slots, 4);
  put_le(out.data() + 12, 0, 4);
}

result<hello> decode_hello(std::span<const std::byte, hello_size> in) noexcept {
  if (get_le(in.data(), 4) != hello_magic) return make_error_code(errc::not_a_shuttle_peer);
  hello h;
  h.version = static_cast<std::uint16_t>(get_le(in.data() + 4, 2));
  if (h.version != protocol_version) return make_error_code(errc::wire_version_mismatch);
  auto r = get_le(in.data() + 6, 1);
  if (r != 1 && r != 2) return bad();
  h.from = static_cast<role>(r);
  h.slots = static_cast<std::uint32_t>(get_le(in.data() + 8, 4));
  const auto flags = get_le(in.data() + 7, 1);
  if (h.slots != key_slots || (flags & ~7u) != 0 || get_le(in.data() + 12, 4) != 0) return bad();
  h.rings = flags & 1;
  h.membarrier = (flags & 2) != 0;
  h.carried = (flags & 4) != 0;
  return h;
}

void encode_query(std::uint32_t rkey, std::span<std::byte, query_size> out) noexcept {
  put_le(out.data(), static_cast<std::uint32_t>(msg_type::query), 4);
  put_le(out.data() + 4, rkey, 4);
}

void encode_answer(const answer& a, std::span<std::byte, answer_size> out) noexcept {
  put_le(out.data(), static_cast<std::uint32_t>(msg_type::answer), 4);
  put_le(out.data() + 4, a.rkey, 4);
  put_le(out.data() + 8, a.ok ? 0 : 1, 4);
  put_le(out.data() + 12, a.ok ? static_cast<std::uint32_t>(a.kind) : 0, 4);
  put_le(out.data() + 16, a.addr, 8);
  put_le(out.data() + 24, a.length, 8);
  put_le(out.data() + 32, a.offset, 8);
  put_le(out.data() + 40, a.access, 4);
  put_le(out.data() + 44, a.slot, 4);
}

std::size_t encode_full_answer(const answer& a, std::span<std::byte, max_message> out) noexcept {
  encode_answer(a, out.first<answer_size>());
  if (!a.ok || a.kind == shared_kind::host_memfd) return answer_size;
  if (a.kind == shared_kind::cuda_ipc) {
    std::memcpy(out.data() + answer_size, a.handle.data(), gpu_handle_size);
  } else {
    std::fill_n(out.data() + answer_size, gpu_handle_size, std::byte{0});
    put_le(out.data() + answer_size, a.alloc_size, 8);
  }
  return gpu_answer_size;
}

result<message> decode_message(std::span<const std::byte> in) noexcept {
  if (in.size() < 8) return bad();
  message m;
  auto type = get_le(in.data(), 4);
  m.rkey = static_cast<std::uint32_t>(get_le(in.data() + 4, 4));
  if (type == static_cast<std::uint32_t>(msg_type::query)) {
    if (in.size() != query_size) return bad();
    m.type = msg_type::query;
    return m;
  }
  if (type != static_cast<std::uint32_t>(msg_type::answer) || in.size() < answer_size) return bad();
  m.type = msg_type::answer;
  answer& a = m.ans;
  a.rkey = m.rkey;
  auto status = get_le(in.data() + 8, 4);
  auto kind = get_le(in.data() + 12, 4);
  a.addr = get_le(in.data() + 16, 8);
  a.length = get_le(in.data() + 24, 8);
  a.offset = get_le(in.data() + 32, 8);
  a.access = static_cast<std::uint32_t>(get_le(in.data() + 40, 4));
  a.slot = static_cast<std::uint32_t>(get_le(in.data() + 44, 4));
  if (status == 1) {  // refused: nothing else may be set
    if (in.size() != answer_size || kind || a.addr || a.length || a.offset || a.access || a.slot) return bad();
    return m;
  }
  constexpr unsigned remote = access::remote_write | access::remote_read | access::remote_atomic;
  const bool gpu = kind == static_cast<std::uint32_t>(shared_kind::cuda_ipc) ||
                   kind == static_cast<std::uint32_t>(shared_kind::cuda_fd);
  if (in.size() != (gpu ? gpu_answer_size : answer_size)) return bad();
  if (status != 0 || (kind != static_cast<std::uint32_t>(shared_kind::host_memfd) && !gpu) || a.length == 0 ||
      a.addr + a.length < a.addr || a.offset + a.length < a.offset || a.slot >= key_slots ||
      (a.access & ~(remote | access::local_write)) != 0 || (a.access & remote) == 0)
    return bad();
  a.ok = true;
  a.kind = static_cast<shared_kind>(kind);
  if (a.kind == shared_kind::cuda_ipc) std::memcpy(a.handle.data(), in.data() + answer_size, gpu_handle_size);
  if (a.kind == shared_kind::cuda_fd) {
    a.alloc_size = get_le(in.data() + answer_size, 8);
    for (std::size_t i = 8; i < gpu_handle_size; ++i)
      if (in[answer_size + i] != std::byte{0}) return bad();
    if (a.offset > a.alloc_size || a.length > a.alloc_size - a.offset) return bad();
  }
  return m;
}

}  // namespace shuttle::detail::local_wire
