// Stream-ordered network operations: an operation on a connection posted
// when a CUDA stream reaches the point where it is called, without blocking
// the loop and without a CUDA callback thread. The loop notices the point as
// any co_await cuda::wait(stream) does (an event recorded on the stream,
// polled; see cuda.hpp), then posts the operation:
//
//   kernels::produce(buf, n, ..., stream);                  // GPU work
//   co_await cuda::write_after(stream, conn, {buf, n}, remote);
//
// `local` is what the provider can read: GPU memory registered with a verbs
// domain (dma-buf or nvidia-peermem; never sent inline), or host memory
// (pinned, for a cudaMemcpyAsync on the same stream before the call) on any
// provider. The result is the wait's error (a failed stream: its cudaError_t;
// cancellation: operation_canceled, and nothing is posted) or the
// operation's.
//
// The receiving side learns of arrival through write_with_imm (a posted
// receive completes), not by polling GPU memory, and makes the data visible
// to a consumer stream with cuda::stream_flag (cuda.hpp).
#pragma once

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/transport.hpp>

#include <cstdint>
#include <span>

namespace shuttle::cuda {

task<result<void>> write_after(cudaStream_t s, connection& c, std::span<const std::byte> local, remote_buffer remote);
task<result<void>> write_with_imm_after(cudaStream_t s, connection& c, std::span<const std::byte> local,
                                        remote_buffer remote, std::uint32_t imm);
task<result<void>> send_after(cudaStream_t s, connection& c, std::span<const std::byte> msg);

}  // namespace shuttle::cuda
