// Device-to-device transfers over any transport, through pinned host bounce
// buffers: a layer on the transport API (the tcp provider never sees device
// memory).
//
//   sender                                   receiver
//   producer(i) -> D2H copy into bounce b    ring of K pinned slots, registered
//   (stream order, double-buffered)          remote-writable, described to the
//   write_with_imm(bounce b -> slot i%K,     sender once (open()).
//                  imm = i)          ---->   recv(): imm i -> H2D copy of slot
//   waits for a credit per slot      <----   i%K on the consumer's stream, then
//                                            after(i) enqueues the consumer
//                                            kernel; once the copy is done the
//                                            slot's credit goes back (send).
//
// The copies run on the channel's own copy streams, ordered with the
// caller's stream by events: the D2H copy of chunk i waits for the work
// enqueued on the caller's stream before it (cudaStreamWaitEvent), so the
// producer of chunk i+1 runs while chunk i is copied and on the wire; the
// caller's stream waits for the H2D copy of chunk i before after(i)
// enqueues the consumer there (received data is visible to the consumer
// kernel), and the copy of chunk i+1 does not wait for that consumer.
//
// While a transfer runs the connection belongs to it (its recv() reads the
// credits). A sender whose source range the gpu_registry registers directly
// (dmabuf / peermem on a verbs domain) writes from device memory and skips
// the copy; path() reports what was used.
#pragma once

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
  // Pinned bounce buffers of the sender and ring slots of the receiver (the
  // sender's credits). 2 is plain double-buffering; on the H200 over the tcp
  // provider (one loop, loopback, 512 MiB, kernels as costly as the
  // transfer) 2/4 reached 0.48 of max(kernel, transfer) and 4/8 0.94
  // (bench/gpu/pipeline_bench.cpp), hence the defaults.
  unsigned sender_buffers = 4;
  unsigned receiver_slots = 8;
};

// (chunk index in the transfer, byte offset, bytes, the transfer's stream)
using chunk_fn = std::function<void(std::size_t index, std::size_t offset, std::size_t size, cudaStream_t s)>;

struct transfer_stats {
  std::uint64_t bytes = 0;
  std::uint64_t chunks = 0;
  std::uint64_t credit_waits = 0;  // the sender waited for the receiver to free a slot
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
                                       unsigned sender_buffers = 4);

  // Sends device memory [src, src+len); before(i, off, n, s) runs just before
  // chunk i's copy is enqueued on `s` (enqueue the producer of the chunk
  // there). Completes when every chunk has been written (and so acknowledged
  // by the transport).
  task<result<void>> send(const void* src, std::size_t len, cudaStream_t s, chunk_fn before = {});

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
  // H2D copy is enqueued on `s`, then after(i, off, n, s) (enqueue the
  // consumer there: it sees the data). Completes when every chunk's copy has
  // finished and its slot was handed back.
  task<result<void>> recv(void* dst, std::size_t len, cudaStream_t s, chunk_fn after = {});

  std::size_t chunk_size() const noexcept;
  const transfer_stats& stats() const noexcept;

  struct state;

 private:
  std::unique_ptr<state> s_;
};

}  // namespace shuttle::cuda
