// Small kernels for the examples, tests and benchmarks (lib/cuda/kernels.cu,
// sm_90 plus PTX): a position-dependent byte pattern, an order-independent
// but position-sensitive checksum, a producer and a consumer of tunable cost,
// and a timed spin. All are asynchronous on `s` and return the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace shuttle::cuda::kernels {

// The pattern byte at global offset `o` for `seed` (host and device agree).
constexpr std::uint8_t pattern_byte(std::uint64_t o, std::uint32_t seed) noexcept {
  std::uint64_t x = (o >> 2) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(seed) << 32 | seed);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<std::uint8_t>(x >> (8 * (o & 3)));
}
// The checksum term of byte `b` at global offset `o`.
constexpr std::uint64_t checksum_term(std::uint8_t b, std::uint64_t o) noexcept {
  return (static_cast<std::uint64_t>(b) + 1) * ((o * 0x9E3779B97F4A7C15ull) | 1);
}

// dst[i] = pattern_byte(base + i, seed) for i < n.
cudaError_t fill_pattern(void* dst, std::size_t n, std::uint64_t base, std::uint32_t seed, cudaStream_t s);
// *sum += sum of checksum_term(src[i], base + i) (sum is device memory, or mapped pinned).
cudaError_t checksum(const void* src, std::size_t n, std::uint64_t base, unsigned long long* sum, cudaStream_t s);
// Host reference of checksum() over the pattern.
std::uint64_t pattern_checksum(std::size_t n, std::uint64_t base, std::uint32_t seed) noexcept;

// The streaming pipeline's compute function (examples/stream_pipeline), the
// same as its CPU version: record i is bytes [offsets[i], offsets[i+1]) of
// `data`; digests[i] = 64-bit FNV-1a of the record as it was, then every byte
// of it is XORed with 0x5a. One thread per record. All pointers are device
// memory (or mapped pinned memory).
cudaError_t digest_and_mask(std::uint8_t* data, const std::uint64_t* offsets, std::size_t count,
                            std::uint64_t* digests, cudaStream_t s);

// A producer: fill_pattern plus `rounds` of dependent arithmetic per 16 bytes
// (the result is unchanged; rounds only set the kernel's cost).
cudaError_t produce(void* dst, std::size_t n, std::uint64_t base, std::uint32_t seed, unsigned rounds, cudaStream_t s);
// A consumer: checksum plus `rounds` of arithmetic per 16 bytes.
cudaError_t consume(const void* src, std::size_t n, std::uint64_t base, unsigned rounds, unsigned long long* sum,
                    cudaStream_t s);

// One thread spins for `ns` nanoseconds (%globaltimer).
cudaError_t spin(std::uint64_t ns, cudaStream_t s);

}  // namespace shuttle::cuda::kernels
