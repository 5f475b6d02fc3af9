// A connection's shared-memory rings: the engine's frames (send/recv,
// write_with_imm, responses, accesses to memory that is not shared) go
// through them in place of the Unix socket (the engine's byte_pipe,
// lib/tcp_provider/pipe.hpp). One sealed memfd, made by the connecting side
// and passed with its hello, holds two single-producer/single-consumer byte
// rings, one per direction:
//
//   ring i (i = 0: connector -> acceptor, 1: acceptor -> connector), at
//   i * (ring_ctl + ring_capacity):
//     +256  head               u64, the consumer's: bytes taken so far
//     +512  producer_sleeping  u32, the producer's: waits for room, ring me
//     +768  consumer_sleeping  u32, the consumer's: waits for bytes, ring me
//   (each in its own pair of cache lines: the flags change only around a
//   sleep, and the producer loads the head only when the room it knows of
//   is short, so the lines stay in the cache of the side that reads them)
//     +ring_ctl  ring_capacity bytes of data, byte k at k % ring_capacity
//
// The data is a stream of records, each at a 64-byte aligned position p:
// a u64 mark (the record's length in its low half, the low 32 bits of
// p / 64 in its high half), then the bytes (wrapping at the ring's end);
// the next record is at the next aligned position. The producer copies the
// bytes, zeroes the mark of the record after this one, then stores this
// mark (release). The consumer polls the mark where it will read next: the
// mark is in the line the bytes are in (a small frame, 48 + 8 bytes, and
// its mark fill one cache line), so a small message moves one line. No
// record is larger than ring_capacity / 4 (a larger write is several, so
// that both sides copy at once).
//
// The peer can write anything anywhere in it. Our own positions are kept
// here (what is in shared memory is only published); the peer's are
// checked on every load: a mark's position must be the one expected and
// its length within [1, ring_capacity / 4], a head within [last head, our
// tail] (the producer counts only whole lines of the room it frees). Anything else fails the connection with
// protocol_error. Header bytes are copied out before they are decoded
// (the engine's reader), so a peer that changes them meanwhile only sends
// garbage, which the engine's checks refuse.
//
// The flags are set only by a loop about to sleep (the pipe is a poller of
// its loop while the engine waits on it, tcp_provider/pipe.hpp): it sets
// its flag, makes it visible, looks again, then sleeps in io_uring on the
// socket; the other side publishes, and rings (one byte on the socket)
// only if the flag was set. The "makes visible" is a Dekker pair: either
// both sides fence (seq_cst), or, where both processes registered for
// membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) (their hellos say so), the
// sleeper alone pays, with that membarrier (a barrier on every CPU that
// runs either process), and the publishing side has no fence on its path.
// A loop that is awake, or spinning, takes the bytes from shared memory:
// no syscall on either side.
#pragma once

#include "../tcp_provider/pipe.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace shuttle::detail::local_provider {

inline constexpr std::size_t ring_capacity = std::size_t{1} << 18;  // a power of two; stays in cache
inline constexpr std::size_t ring_ctl = 4096;
inline constexpr std::size_t ring_bytes = 2 * (ring_ctl + ring_capacity);
inline constexpr std::size_t ring_head = 256, ring_producer_sleeping = 512, ring_consumer_sleeping = 768;
inline constexpr std::size_t ring_align = 64;  // records start on a cache line
inline constexpr std::size_t ring_max_record = ring_capacity / 4;
// A record's mark: its length and where it is.
constexpr std::uint64_t ring_mark(std::uint64_t pos, std::uint64_t len) noexcept {
  return (((pos / ring_align) & 0xffffffffu) << 32) | len;
}

// The rings' memfd, sealed against shrinking and growing.
result<int> make_ring_memfd();

// Maps the peer's (or our) ring memfd, after checking it (a sealed memfd of
// ring_bytes at least): the connector produces into ring 0, the acceptor
// into ring 1. `bell` is the connection's socket (not owned). `asymmetric`:
// both sides registered for membarrier (asymmetric_fences_available), so
// the sleeper's membarrier stands for the publisher's fence.
result<std::unique_ptr<tcp_provider::byte_pipe>> map_rings(int memfd, bool connector, int bell, bool asymmetric);

// Whether this process registered for MEMBARRIER_CMD_GLOBAL_EXPEDITED (once;
// false where the kernel lacks it, or SHUTTLE_LOCAL_MEMBARRIER=0: then both
// sides of its connections fence).
bool asymmetric_fences_available() noexcept;

// Whether this process uses rings (SHUTTLE_LOCAL_RINGS=0 keeps frames on
// the socket: the benchmark's baseline; both sides must want them).
bool rings_wanted() noexcept;

}  // namespace shuttle::detail::local_provider
