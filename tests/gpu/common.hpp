// Shared helpers of the gpu suite: a connected pair over the tcp provider.
#pragma once

#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#include <shuttle/cuda/staged.hpp>
#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>

#include <optional>

namespace gpu_test {

using namespace shuttle;

struct pair_t {
  std::optional<domain> server_domain, client_domain;
  listener l;
  connection server, client;
};

inline task<void> make_pair(pair_t& p, connection_options opts = {}) {
  domain_options d;
  d.kind = transport_kind::tcp;
  p.server_domain.emplace(domain::open(d).value());
  p.client_domain.emplace(domain::open(d).value());
  p.l = p.server_domain->listen(endpoint::parse("127.0.0.1:0").value(), opts).value();
  auto ep = endpoint::parse("127.0.0.1:" + std::to_string(p.l.local_endpoint()->port())).value();
  auto [s, c] = co_await when_all(p.l.accept(), p.client_domain->connect(ep, opts));
  p.server = std::move(s).value();
  p.client = std::move(c).value();
}

inline task<void> close_pair(pair_t& p) {
  (void)co_await p.client.close();
  (void)co_await p.server.close();
  p.l.close();
  (void)co_await sleep_for(std::chrono::milliseconds(5));
}

// GPU checksum of device memory (blocking; for checks).
inline std::uint64_t device_checksum(const void* p, std::size_t n, std::uint64_t base, cudaStream_t s) {
  unsigned long long* sum = nullptr;
  cuda::check(cudaMallocHost(reinterpret_cast<void**>(&sum), sizeof *sum), "cudaMallocHost");
  *sum = 0;
  unsigned long long* dsum = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&dsum), sizeof *dsum), "cudaMalloc");
  cuda::check(cudaMemsetAsync(dsum, 0, sizeof *dsum, s), "memset");
  cuda::check(cuda::kernels::checksum(p, n, base, dsum, s), "checksum");
  cuda::check(cudaMemcpyAsync(sum, dsum, sizeof *sum, cudaMemcpyDeviceToHost, s), "copy");
  cuda::check(cudaStreamSynchronize(s), "sync");
  std::uint64_t v = *sum;
  (void)cudaFree(dsum);
  (void)cudaFreeHost(sum);
  return v;
}

}  // namespace gpu_test
