// Asio-token forms of the CUDA awaitables (shuttle/cuda/cuda.hpp): wait for
// GPU work with any Asio completion token. Include only in CUDA builds.
//
//   co_await shuttle::asio::async_wait(stream, asio::use_awaitable);   // after launching a kernel on it
//
// Cancellation (stop token, or an Asio slot on Boost >= 1.77) abandons the
// wait only; the GPU work itself runs on.
#pragma once

#include <shuttle/asio/async_run.hpp>
#include <shuttle/cuda/cuda.hpp>

namespace shuttle::asio {

// void(error_code): the event completed (a failed one: its cudaError_t).
template <class Token>
auto async_wait(cudaEvent_t e, Token&& token) {
  return async_run(io_context::current(), [e] { return shuttle::cuda::wait(e); }, std::forward<Token>(token));
}
// void(error_code): records an event on the stream now, completes when the GPU reaches it.
template <class Token>
auto async_wait(cudaStream_t s, Token&& token) {
  return async_run(io_context::current(), [s] { return shuttle::cuda::wait(s); }, std::forward<Token>(token));
}

}  // namespace shuttle::asio
