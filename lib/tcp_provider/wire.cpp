#include "wire.hpp"

#include "../transport/little_endian.hpp"
#include <shuttle/transport.hpp>

#include <algorithm>

namespace shuttle::tcp_wire {

namespace {
constexpr auto put = detail::put_le;
constexpr auto get = detail::get_le;
std::error_code proto() noexcept { return make_error_code(errc::protocol_error); }
}  // namespace

bool starts_like_hello(std::span<const std::byte> in) noexcept {
  std::byte magic[4];
  put(magic, hello_magic, 4);
  return std::equal(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(in.size(), 4)), magic);
}

void encode_hello(const hello& h, std::span<std::byte, hello_size> out) noexcept {
  std::byte* p = out.data();
  put(p, hello_magic, 4);
  put(p + 4, h.version, 2);
  put(p + 6, h.payload_size, 2);
  put(p + 8, h.receive_buffers, 4);
  put(p + 12, h.max_responder_ops, 4);
  put(p + 16, h.receive_buffer_size, 8);
}

result<hello> decode_hello(std::span<const std::byte, hello_size> in) noexcept {
  const std::byte* p = in.data();
  if (get(p, 4) != hello_magic) return make_error_code(errc::not_a_shuttle_peer);
  hello h;
  h.version = static_cast<std::uint16_t>(get(p + 4, 2));
  if (h.version != protocol_version) return make_error_code(errc::wire_version_mismatch);
  h.payload_size = static_cast<std::uint16_t>(get(p + 6, 2));
  if (h.payload_size > max_connect_payload) return make_error_code(errc::message_too_long);
  h.receive_buffers = static_cast<std::uint32_t>(get(p + 8, 4));
  h.max_responder_ops = static_cast<std::uint32_t>(get(p + 12, 4));
  h.receive_buffer_size = get(p + 16, 8);
  if (h.receive_buffers == 0 || h.receive_buffers > max_receive_buffers) return proto();
  if (h.receive_buffer_size == 0 || h.receive_buffer_size > max_receive_buffer_size) return proto();
  if (h.max_responder_ops == 0 || h.max_responder_ops > max_responder_ops_limit) return proto();
  return h;
}

void encode_header(const header& h, std::span<std::byte, header_size> out) noexcept {
  std::byte* p = out.data();
  put(p, static_cast<std::uint8_t>(h.op), 1);
  put(p + 1, h.flags, 1);
  put(p + 2, static_cast<std::uint8_t>(h.st), 1);
  put(p + 3, 0, 1);
  put(p + 4, h.imm, 4);
  put(p + 8, h.seq, 8);
  put(p + 16, h.addr, 8);
  put(p + 24, h.rkey, 4);
  put(p + 28, h.length, 4);
  put(p + 32, h.arg0, 8);
  put(p + 40, h.arg1, 8);
}

result<header> decode_header(std::span<const std::byte, header_size> in, const limits& lim) noexcept {
  const std::byte* p = in.data();
  header h;
  h.op = static_cast<opcode>(get(p, 1));
  h.flags = static_cast<std::uint8_t>(get(p + 1, 1));
  auto st = get(p + 2, 1);
  if (get(p + 3, 1) != 0) return proto();
  h.imm = static_cast<std::uint32_t>(get(p + 4, 4));
  h.seq = get(p + 8, 8);
  h.addr = get(p + 16, 8);
  h.rkey = static_cast<std::uint32_t>(get(p + 24, 4));
  h.length = static_cast<std::uint32_t>(get(p + 28, 4));
  h.arg0 = get(p + 32, 8);
  h.arg1 = get(p + 40, 8);

  // Only SEND carries an optional immediate; WRITE_IMM always has one.
  const bool imm_allowed = h.op == opcode::send || h.op == opcode::write_imm;
  const std::uint8_t carry = lim.carried && h.op == opcode::send ? flag_ack | flag_credit : 0;
  if (h.flags & ~(flag_imm | carry)) return proto();
  if ((h.flags & flag_imm) && !imm_allowed) return proto();
  if (!(h.flags & flag_imm) && h.imm != 0) return proto();
  if (h.op == opcode::write_imm && !(h.flags & flag_imm)) return proto();

  if (h.op == opcode::nak) {
    if (st != static_cast<std::uint8_t>(status::remote_access_error) &&
        st != static_cast<std::uint8_t>(status::remote_operation_error))
      return proto();
  } else if (st != 0) {
    return proto();
  }
  h.st = static_cast<status>(st);

  auto no_target = [&] { return h.addr == 0 && h.rkey == 0; };
  switch (h.op) {
    case opcode::send:
      if (h.length > lim.max_send || !no_target()) return proto();
      // What it carries: an ACK's seq (>= 1: seq 0 is no acknowledgement), a CREDIT's count.
      if ((h.flags & flag_ack) ? h.arg0 == 0 : h.arg0 != 0) return proto();
      if ((h.flags & flag_credit) ? h.arg1 == 0 || h.arg1 > max_receive_buffers : h.arg1 != 0) return proto();
      break;
    case opcode::write:
    case opcode::write_imm:
    case opcode::read_req:
      if (h.length > max_rdma_length || h.arg0 || h.arg1) return proto();
      break;
    case opcode::cas:
      if (h.length != 8) return proto();
      break;
    case opcode::faa:
      if (h.length != 8 || h.arg1) return proto();
      break;
    case opcode::write_list:
    case opcode::read_list:
      // The descriptors carry the addresses; arg0 of them, each at least a
      // byte, at most max_rdma_length in all.
      if (h.addr || h.arg1 || h.arg0 == 0 || h.arg0 > max_list_entries || h.length < h.arg0 ||
          h.length > max_rdma_length)
        return proto();
      break;
    case opcode::read_list_resp:
      if (!no_target() || h.arg1 || h.arg0 == 0 || h.arg0 > max_list_entries || h.length < h.arg0 ||
          h.length > max_rdma_length)
        return proto();
      break;
    case opcode::ack:
    case opcode::nak:
      if (h.length || !no_target() || h.arg0 || h.arg1) return proto();
      break;
    case opcode::read_resp:
      if (h.length > max_rdma_length || !no_target() || h.arg0 || h.arg1) return proto();
      break;
    case opcode::atomic_resp:
      if (h.length || !no_target() || h.arg1) return proto();
      break;
    case opcode::credit:
      if (h.length || !no_target() || h.seq || h.arg1 || h.arg0 == 0 || h.arg0 > max_receive_buffers)
        return proto();
      break;
    default: return proto();
  }
  return h;
}

result<std::byte*> check_access(const region_view& r, std::uint64_t addr, std::uint64_t len, unsigned required,
                                bool atomic) noexcept {
  auto refuse = [] { return make_error_code(errc::remote_access_error); };
  if (!r.addr || (r.access & required) != required) return refuse();
  std::byte* p = in_region(r, addr, len);
  if (!p) return refuse();
  if (atomic && (len != 8 || addr % 8 != 0)) return refuse();
  return p;
}

result<void> decode_list_table(const header& h, std::span<const std::byte> table, std::span<list_entry> out) noexcept {
  if ((h.op != opcode::write_list && h.op != opcode::read_list) || table.size() != h.table_length() ||
      out.size() < h.arg0)
    return proto();
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < h.arg0; ++i) {
    const std::byte* p = table.data() + i * list_entry_size;
    list_entry& e = out[i];
    e.addr = get(p, 8);
    e.length = static_cast<std::uint32_t>(get(p + 8, 4));
    if (e.length == 0 || e.length > max_rdma_length) return proto();
    sum += e.length;  // <= 256 * 2^32: no overflow
  }
  if (sum != h.length) return proto();
  return {};
}

unsigned required_access(opcode op) noexcept {
  switch (op) {
    case opcode::write_list:
    case opcode::write:
    case opcode::write_imm: return access::remote_write;
    case opcode::read_list:
    case opcode::read_req: return access::remote_read;
    case opcode::cas:
    case opcode::faa: return access::remote_atomic;
    default: return 0;
  }
}

}  // namespace shuttle::tcp_wire
