// Device-to-device transfers over any transport, through pinned host bounce
// buffers: a layer on the transport API (the tcp provider never sees device
// memory).
//
//   sender                                   receiver
//   producer(i) on the caller's stream,      ring of K pinned slots, registered
//   up to `lookahead` chunks ahead           remote-writable, described to the
//   D2H copy into bounce buffer i%B          sender once (open()).
//   write_with_imm(bounce -> slot i%K,       recv(): imm i -> H2D copy of slot
//                  imm = i)          ---->   i%K on the channel's copy stream,
//   needs a credit (a free slot)     <----   after(i) enqueues the consumer;
//                                            slots whose copies are done go
//                                            back as credits, batched.
//
// What keeps the pipe full:
//  - producers are not tied to bounce buffers: chunk i's producer writes only
//    its own range of the source, so before(i) runs up to `lookahead` chunks
//    ahead of chunk i's copy, and the GPU produces chunk i+1.. while chunk i
//    is copied and on the wire;
//  - the copies run on the channel's own copy streams, ordered with the
//    caller's streams by events: a D2H copy waits only for its producer, the
//    consumer's stream waits for its H2D copy (received data is visible to
//    the consumer kernel), and the H2D copy of chunk i+1 does not wait for
//    chunk i's consumer;
//  - a slot is handed back as soon as its H2D copy is done, not after the
//    consumer; credits whose copies finished together travel in one message,
//    and a credit message never waits for the acknowledgement of the one
//    before it (on the tcp provider that acknowledgement queues behind the
//    sender's multi-megabyte writes).
//
// The pipeline aims at max(kernel time, transfer time);
// bench/gpu/pipeline_bench.cpp measures how close it gets (figures:
// docs/measurements.md).
//
// While a transfer runs the connection belongs to it (its recv() reads the
// credits). A transfer that fails on one side (a CUDA error, cancellation)
// leaves the channel out of step: the other side may wait until the
// connection is closed, so close it. A sender whose source range the gpu_registry registers directly
// (dmabuf / peermem on a verbs domain) writes from device memory and skips
// the copy; path() reports what was used.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/gpu_memory.hpp>
#include <shuttle/transport.hpp>

namespace shuttle::cuda {

struct staged_options {
  std::size_t chunk = std::size_t(1) << 20;  // bytes per write
  // Pinned bounce buffers of the sender (writes in flight) and ring slots of
  // the receiver (the sender's credits). A slot is busy from its write until
  // its H2D copy is done, so slots cover the writes in flight plus the
  // credit's way back; the receiver's credit messages take receive buffers
  // of the connection, so receiver_slots must not exceed the sender
  // connection's connection_options::receive_buffers (64 by default).
  unsigned sender_buffers = 3;
  unsigned receiver_slots = 8;
};
// (chunk index in the transfer, byte offset, bytes, the transfer's stream)
using chunk_fn = std::function<void(std::size_t index, std::size_t offset, std::size_t size, cudaStream_t s)>;

struct transfer_stats {
  std::uint64_t bytes = 0;
  std::uint64_t chunks = 0;
  std::uint64_t credit_waits = 0;     // sender: chunks that found no credit at hand (it then reads credit messages)
  std::uint64_t credit_messages = 0;  // credit messages read (sender) or sent (receiver)
  // Sender: time the writer waited for a free bounce buffer (every one on
  // the wire: the transport is the bottleneck), for a chunk's data (its
  // producer or D2H copy not done: the GPU is) and for credits (receiver
  // slots: the receiver is).
  std::chrono::nanoseconds buffer_wait{0};
  std::chrono::nanoseconds data_wait{0};
  std::chrono::nanoseconds credit_wait{0};
};

class gpu_sender {
 public:
  gpu_sender() noexcept;
  gpu_sender(gpu_sender&&) noexcept;
  gpu_sender& operator=(gpu_sender&&) noexcept;
  ~gpu_sender();

  // Reads the receiver's ring description (the first message on `c`).
  // `reg` (optional) selects direct writes from device memory where it can.
  static task<result<gpu_sender>> open(connection& c, domain& d, gpu_registry* reg = nullptr,
                                       unsigned sender_buffers = staged_options{}.sender_buffers);

  // Sends device memory [src, src+len). before(i, off, n, s) enqueues chunk
  // i's producer on `s`: it is called in chunk order, up to lookahead()
  // chunks ahead of chunk i's copy, and the copy waits for what `s` holds
  // when it returns. Completes when every chunk has been written (and so
  // acknowledged by the transport).
  task<result<void>> send(const void* src, std::size_t len, cudaStream_t s, chunk_fn before = {});

  std::size_t lookahead() const noexcept;
  gpu_path path() const noexcept;  // of the last send
  std::size_t chunk_size() const noexcept;
  const transfer_stats& stats() const noexcept;

  struct state;

 private:
  std::unique_ptr<state> s_;
};

class gpu_receiver {
 public:
  gpu_receiver() noexcept;
  gpu_receiver(gpu_receiver&&) noexcept;
  gpu_receiver& operator=(gpu_receiver&&) noexcept;
  ~gpu_receiver();

  // Allocates and registers the ring and describes it to the peer.
  static task<result<gpu_receiver>> open(connection& c, domain& d, staged_options o = {});

  // Receives `len` bytes into device memory [dst, dst+len): per chunk, the
  // H2D copy is enqueued on the channel's copy stream and `s` waits for it,
  // then after(i, off, n, s) runs (enqueue the consumer on `s`: it sees the
  // data). Completes when every chunk's copy has finished and its slot was
  // handed back.
  task<result<void>> recv(void* dst, std::size_t len, cudaStream_t s, chunk_fn after = {});

  std::size_t chunk_size() const noexcept;
  const transfer_stats& stats() const noexcept;

  struct state;

 private:
  std::unique_ptr<state> s_;
};

}  // namespace shuttle::cuda
