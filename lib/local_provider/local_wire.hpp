// The local provider's own messages, next to the tcp engine's frames
// (lib/tcp_provider/wire.hpp) that carry everything else:
//
//  - the local hello, the first bytes on the Unix socket from each side
//    (before the engine's hello), with descriptors (SCM_RIGHTS): each side's
//    key table (a sealed memfd: one word per shared region, its rkey while
//    registered, 0 once not), and from the connecting side one end of a
//    SOCK_SEQPACKET pair: the connection's service channel;
//  - on the service channel, a query for an rkey ("can I map it?") and its
//    answer: refused, or the region (address, length, rights, key slot) and
//    where it lies in the memory handle passed with it (kind, offset).
//
// Pure (bytes in, values out), so that the tests feed it garbage directly.
#pragma once

#include "device_hooks.hpp"
#include "shared_memory.hpp"

#include <shuttle/result.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace shuttle::detail::local_wire {

using local_provider::gpu_handle;
using local_provider::gpu_handle_size;

inline constexpr std::uint32_t hello_magic = 0x4F4C4853;  // "SHLO" little-endian
// 2: the rings' flag and memfd; 3: rings of marked records, membarrier flag;
// 4: the `carried` flag (an older peer cannot skip a flag: it is refused,
// wire_version_mismatch, rather than sent SENDs it would not read).
inline constexpr std::uint16_t protocol_version = 4;
inline constexpr std::size_t hello_size = 16;
// Words in a key table: zero-copy registrations a domain holds at once (past
// it, a registration is accessed through the socket only).
inline constexpr std::uint32_t key_slots = 4096;
inline constexpr std::size_t key_table_bytes = key_slots * sizeof(std::uint64_t);

enum class role : std::uint8_t { connector = 1, acceptor = 2 };

struct hello {
  std::uint16_t version = protocol_version;
  role from = role::connector;
  std::uint32_t slots = key_slots;
  // Frames go through shared-memory rings (ring.hpp) if both hellos say so;
  // the connector's then carries the rings' memfd.
  bool rings = false;
  // This process registered for membarrier (ring.hpp): if both did, the
  // rings' publishers do not fence; their sleepers issue a membarrier.
  bool membarrier = false;
  // The engine's SENDs carry ACKs and credits (tcp_wire::limits::carried)
  // if both hellos say so (SHUTTLE_LOCAL_CARRY=0: not from this process).
  bool carried = false;
  // Descriptors that come with it: the key table, and from the connector
  // the service channel (and the rings' memfd).
  std::size_t fds() const noexcept { return from == role::connector ? 2 + rings : 1; }
};
void encode_hello(const hello& h, std::span<std::byte, hello_size> out) noexcept;
// not_a_shuttle_peer on a bad magic, wire_version_mismatch on another
// version, protocol_error on anything else out of place.
result<hello> decode_hello(std::span<const std::byte, hello_size> in) noexcept;

enum class msg_type : std::uint32_t { query = 1, answer = 2 };
inline constexpr std::size_t query_size = 8;
inline constexpr std::size_t answer_size = 48;
// A cuda_ipc answer: the same, then the handle (no descriptor passed); a
// cuda_fd answer: the same, then the allocation's size in the handle's
// first 8 bytes (little-endian), the fd passed along.
inline constexpr std::size_t gpu_answer_size = answer_size + gpu_handle_size;
inline constexpr std::size_t max_message = gpu_answer_size;

struct answer {
  std::uint32_t rkey = 0;
  bool ok = false;  // else refused: not a region we share (unknown, not in a block, no remote rights)
  shared_kind kind = shared_kind::host_memfd;
  std::uint64_t addr = 0;    // the region's address at the target (remote_buffer::address)
  std::uint64_t length = 0;  // its length
  std::uint64_t offset = 0;  // where it starts in the memory handle passed along
  std::uint32_t access = 0;  // access:: rights
  std::uint32_t slot = 0;    // its word in the target's key table
  gpu_handle handle{};       // cuda_ipc: the allocation's IPC handle (offset: the region's in it)
  std::uint64_t alloc_size = 0;  // cuda_fd: the allocation's size (offset: the region's in it)
};

void encode_query(std::uint32_t rkey, std::span<std::byte, query_size> out) noexcept;
// The answer's first answer_size bytes (all of a host_memfd answer's).
void encode_answer(const answer& a, std::span<std::byte, answer_size> out) noexcept;
// The whole answer: answer_size bytes, or gpu_answer_size for a cuda_ipc
// one (its handle follows); returns how many.
std::size_t encode_full_answer(const answer& a, std::span<std::byte, max_message> out) noexcept;

// One service message, decoded: a query's rkey, or an answer.
struct message {
  msg_type type = msg_type::query;
  std::uint32_t rkey = 0;
  answer ans{};
};
// protocol_error for anything that is not exactly one well-formed message
// (a wrong size for its type, an unknown type or kind, a range that wraps,
// a slot past the table, rights that are not remote ones).
result<message> decode_message(std::span<const std::byte> in) noexcept;

}  // namespace shuttle::detail::local_wire
