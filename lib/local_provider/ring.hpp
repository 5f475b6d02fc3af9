// A connection's shared-memory rings: the engine's frames (send/recv,
// write_with_imm, responses, accesses to memory that is not shared) go
// through them in place of the Unix socket (the engine's byte_pipe,
// lib/tcp_provider/pipe.hpp). One sealed memfd, made by the connecting side
// and passed with its hello, holds two single-producer/single-consumer byte
// rings, one per direction:
//
//   ring i (i = 0: connector -> acceptor, 1: acceptor -> connector), at
//   i * (ring_ctl + ring_capacity):
//     +0    tail               u64, the producer's: bytes published so far
//     +256  head               u64, the consumer's: bytes taken so far
//     +512  producer_sleeping  u32, the producer's: waits for room, ring me
//     +768  consumer_sleeping  u32, the consumer's: waits for bytes, ring me
//   (each in its own pair of cache lines: the flags change only around a
//   sleep, so the other side's look at them after every publish hits its
//   cache instead of the line the index is written to)
//     +ring_ctl  ring_capacity bytes of data, byte k at k % ring_capacity
//
// The peer can write anything anywhere in it. Our own indices are kept
// here (what is in shared memory is only published); the peer's are
// checked on every load (the producer loads the head only when the room it
// knows of is short): a tail within [last tail, our head + capacity], a
// head within [last head, our tail]. Anything else fails the connection
// with protocol_error. Header bytes are copied out before they are decoded
// (the engine's reader), so a peer that changes them meanwhile only sends
// garbage, which the engine's checks refuse.
//
// The flags are set only by a loop about to sleep (the pipe is a poller of
// its loop while the engine waits on it, tcp_provider/pipe.hpp): it sets
// its flag, fences, looks again, then sleeps in io_uring on the socket; the
// other side publishes, fences, and rings (one byte on the socket) only if
// the flag was set. A loop that is awake, or spinning, takes the bytes from
// shared memory: no syscall on either side.
#pragma once

#include "../tcp_provider/pipe.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace shuttle::detail::local_provider {

inline constexpr std::size_t ring_capacity = std::size_t{1} << 18;  // a power of two; stays in cache
inline constexpr std::size_t ring_ctl = 4096;
inline constexpr std::size_t ring_bytes = 2 * (ring_ctl + ring_capacity);
inline constexpr std::size_t ring_tail = 0, ring_head = 256, ring_producer_sleeping = 512, ring_consumer_sleeping = 768;

// The rings' memfd, sealed against shrinking and growing.
result<int> make_ring_memfd();

// Maps the peer's (or our) ring memfd, after checking it (a sealed memfd of
// ring_bytes at least): the connector produces into ring 0, the acceptor
// into ring 1. `bell` is the connection's socket (not owned).
result<std::unique_ptr<tcp_provider::byte_pipe>> map_rings(int memfd, bool connector, int bell);

// Whether this process uses rings (SHUTTLE_LOCAL_RINGS=0 keeps frames on
// the socket: the benchmark's baseline; both sides must want them).
bool rings_wanted() noexcept;

}  // namespace shuttle::detail::local_provider
