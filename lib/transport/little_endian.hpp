// Fixed-width little-endian fields for wire formats (remote_buffer, the tcp
// provider's frames), independent of the host's byte order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shuttle::detail {

inline void put_le(std::byte* p, std::uint64_t v, int bytes) noexcept {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}

inline std::uint64_t get_le(const std::byte* p, int bytes) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(std::to_integer<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace shuttle::detail
