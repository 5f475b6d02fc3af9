// Wire format of the tcp provider (RDMA semantics over a TCP stream).
//
// A connection starts with a hello from each side (versioned; carries the
// receive pool geometry, so the initiator can refuse oversize sends and count
// credits, and the responder resources: how many READ/atomic requests the
// side answers at once, as verbs' max_dest_rd_atomic). Then both directions carry frames: a fixed 48-byte header,
// followed by a payload for SEND, WRITE, WRITE_IMM and READ_RESP, and a
// descriptor table (and its payloads) for WRITE_LIST and READ_LIST.
//
// List frames carry a block list's one-sided operations on one region in
// one frame: WRITE_LIST is one header, `count` descriptors of
// list_entry_size bytes, then the descriptors' payloads back to back;
// READ_LIST is the header and the descriptors, answered by one
// READ_LIST_RESP with the payloads back to back. Descriptor i is request
// seq+i: ACKs, NAKs and the order are as for single operations. They are
// sent only to a peer that announced them. The hello has no spare field
// (every one is checked, and a new version would be refused by older
// peers), so the announcement is a frame every peer accepts as a no-op: an
// ACK of seq 0 (a real cumulative ACK names seq >= 1), which a side that
// reads list frames sends first. An older peer neither sends it nor gets
// list frames.
//
// Responder units (the hello's max_responder_ops) count response frames: a
// READ_LIST takes one, as a READ does, whatever its count (its answer is
// one READ_LIST_RESP: one queued frame at the target). An older target
// counted a list's descriptors; past its units it only stops reading until
// its writer has taken the responses (back-pressure, never an error).
//
// Acks and credits carried by a SEND (flag_ack, flag_credit): a SEND's
// arg0 and arg1 are otherwise zero; with flag_ack its arg0 is a cumulative
// ACK (seq >= 1, checked exactly as an ACK frame's), with flag_credit its
// arg1 is a CREDIT's count. So a small message, the acknowledgement of the
// peer's and the credit it returns are one frame (one cache line in a
// ring) instead of three. Only where both peers agreed on it in their
// handshake (limits::carried: the local provider's hello, version 4);
// anywhere else those flags are a protocol_error, as before.
//
// Everything here is pure (bytes in, values out): the connection engine and
// the fuzz target share it, so what the fuzzer exercises is what runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <shuttle/error.hpp>
#include <shuttle/result.hpp>

#include "../transport/little_endian.hpp"

namespace shuttle::tcp_wire {

inline constexpr std::uint32_t hello_magic = 0x4C485453;  // "STHL" little-endian
inline constexpr std::uint16_t protocol_version = 2;  // 2: max_responder_ops
inline constexpr std::size_t hello_size = 24;
inline constexpr std::size_t header_size = 48;
// Largest one-sided transfer (as verbs: 2^31 bytes).
inline constexpr std::uint64_t max_rdma_length = std::uint64_t(1) << 31;
// Largest receive buffer a peer may announce.
inline constexpr std::uint64_t max_receive_buffer_size = std::uint64_t(1) << 30;
inline constexpr std::uint32_t max_receive_buffers = 1u << 16;
// READ/atomic requests a side answers at once (its responses not yet taken
// by its writer); a peer with more outstanding is not read from until
// responses go out (back-pressure). What we announce, and the most a peer may.
inline constexpr std::uint32_t default_responder_ops = 128;
inline constexpr std::uint32_t max_responder_ops_limit = 1u << 16;

struct hello {
  std::uint16_t version = protocol_version;
  std::uint32_t receive_buffers = 0;
  std::uint64_t receive_buffer_size = 0;
  std::uint32_t max_responder_ops = default_responder_ops;
  // Bytes of connection_options::payload that follow the hello on the
  // stream (in what was a reserved zero field: a peer without payloads
  // sends 0), at most max_connect_payload.
  std::uint16_t payload_size = 0;
};
void encode_hello(const hello& h, std::span<std::byte, hello_size> out) noexcept;
// not_a_shuttle_peer on a bad magic, wire_version_mismatch on another
// version, protocol_error on silly sizes, message_too_long for a payload
// over max_connect_payload.
result<hello> decode_hello(std::span<const std::byte, hello_size> in) noexcept;
// Whether `in` (a hello cut short: the peer closed) begins as one does.
bool starts_like_hello(std::span<const std::byte> in) noexcept;

enum class opcode : std::uint8_t {
  send = 1,        // payload -> a posted receive; consumes a credit
  write = 2,       // payload -> [addr, addr+length) of rkey
  write_imm = 3,   // write + an empty message carrying imm; consumes a credit
  read_req = 4,    // asks for [addr, addr+length) of rkey
  cas = 5,         // arg0: expected, arg1: desired (8 bytes at addr)
  faa = 6,         // arg0: addend
  write_list = 7,  // arg0 descriptors (seq .. seq+arg0-1) into rkey; length: their payload bytes
  read_list = 8,   // arg0 descriptors (seq .. seq+arg0-1) of rkey to read; length: their bytes
  ack = 16,        // responder: every request up to and including seq succeeded
  nak = 17,        // responder: request seq failed with `status`; nothing after it was done
  read_resp = 18,  // responder: payload of read seq
  atomic_resp = 19,  // responder: arg0 = the original value
  credit = 20,     // arg0 receive buffers freed
  read_list_resp = 21,  // responder: the payloads of reads seq .. seq+arg0-1, back to back (length bytes)
};

enum class status : std::uint8_t {
  ok = 0,
  remote_access_error = 1,   // rkey unknown, out of bounds, rights missing, misaligned atomic
  remote_operation_error = 2,
};

inline constexpr std::uint8_t flag_imm = 1;
inline constexpr std::uint8_t flag_ack = 2;     // SEND: arg0 is a cumulative ACK (limits::carried only)
inline constexpr std::uint8_t flag_credit = 4;  // SEND: arg1 is a CREDIT's count (limits::carried only)

// WRITE_LIST: a descriptor is the remote address (8 bytes) and the length (4).
inline constexpr std::size_t list_entry_size = 12;
// Descriptors in one list frame: the reader holds one table (and an iovec
// per descriptor) at a time, so this bounds its memory per connection;
// longer lists are several frames.
inline constexpr std::uint32_t max_list_entries = 256;

struct header {
  opcode op{};
  std::uint8_t flags = 0;
  status st = status::ok;
  std::uint32_t imm = 0;
  std::uint64_t seq = 0;
  std::uint64_t addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t length = 0;
  std::uint64_t arg0 = 0;
  std::uint64_t arg1 = 0;

  // Bytes that follow the header on the wire.
  std::size_t payload_length() const noexcept {
    switch (op) {
      case opcode::send:
      case opcode::write:
      case opcode::write_imm:
      case opcode::read_resp:
      case opcode::read_list_resp: return length;
      case opcode::write_list: return arg0 * list_entry_size + length;
      case opcode::read_list: return arg0 * list_entry_size;
      default: return 0;
    }
  }
  // WRITE_LIST, READ_LIST: the descriptor table's bytes (what precedes the payloads).
  std::size_t table_length() const noexcept {
    return op == opcode::write_list || op == opcode::read_list ? arg0 * list_entry_size : 0;
  }
  bool is_request() const noexcept { return static_cast<std::uint8_t>(op) < 16; }
};

void encode_header(const header& h, std::span<std::byte, header_size> out) noexcept;

// What the receiving side accepts.
struct limits {
  std::uint64_t max_send = 65536;  // our receive_buffer_size
  bool carried = false;            // SENDs may carry an ACK and a CREDIT (flag_ack, flag_credit)
};

// Parses and validates one header: known opcode, no unknown flags, zero
// reserved bits, a status only where one belongs, lengths within limits
// (SEND <= max_send, one-sided <= max_rdma_length, atomics exactly 8 bytes),
// an ACK or CREDIT a SEND carries as the frame's would be (lim.carried only).
// Anything else is errc::protocol_error.
result<header> decode_header(std::span<const std::byte, header_size> in, const limits& lim) noexcept;

// A registered region as the target sees it.
struct region_view {
  std::byte* addr = nullptr;
  std::size_t length = 0;
  unsigned access = 0;
};

// [addr, addr+len) in `r`'s memory, or null where it is not inside `r`
// (rights not checked). Overflow-safe. check_access's bounds; a list
// frame's descriptors, whose right is checked once, are checked with it.
inline std::byte* in_region(const region_view& r, std::uint64_t addr, std::uint64_t len) noexcept {
  const auto base = reinterpret_cast<std::uint64_t>(r.addr);
  if (!r.addr || addr < base) return nullptr;
  const std::uint64_t off = addr - base;
  if (off > r.length || len > r.length - off) return nullptr;
  return r.addr + off;
}

// Checks a one-sided access to [addr, addr+len) of `r` needing `required`
// rights (atomics also need 8-byte alignment and len == 8). Returns the
// local pointer, or errc::remote_access_error. Overflow-safe.
result<std::byte*> check_access(const region_view& r, std::uint64_t addr, std::uint64_t len,
                                unsigned required, bool atomic) noexcept;

struct list_entry {
  std::uint64_t addr = 0;
  std::uint32_t length = 0;
};
// Inline: a block list's frames write one per block.
inline void encode_list_entry(const list_entry& e, std::span<std::byte, list_entry_size> out) noexcept {
  detail::put_le(out.data(), e.addr, 8);
  detail::put_le(out.data() + 8, e.length, 4);
}
// A descriptor's length, rewritten (a block merged into it).
inline void set_list_entry_length(std::span<std::byte, list_entry_size> out, std::uint32_t length) noexcept {
  detail::put_le(out.data() + 8, length, 4);
}
// Parses a WRITE_LIST's or READ_LIST's table (h.arg0 descriptors, table.size() ==
// h.table_length()) into `out` (at least h.arg0 long): every length
// non-zero and at most max_rdma_length, their sum exactly h.length (in 64
// bits: no overflow), else errc::protocol_error. Bounds and rights are the
// target's to check (check_access), per descriptor.
result<void> decode_list_table(const header& h, std::span<const std::byte> table, std::span<list_entry> out) noexcept;

// Access right a request needs (shuttle::access values); 0 for non one-sided.
unsigned required_access(opcode op) noexcept;

}  // namespace shuttle::tcp_wire
