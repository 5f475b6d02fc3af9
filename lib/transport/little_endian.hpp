// Fixed-width little-endian fields for wire formats (remote_buffer, the tcp
// provider's frames), independent of the host's byte order.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shuttle::detail {

// On a little-endian host the usual widths are one load or store: the
// byte loop cost a block-list frame about 60 instructions per descriptor
// on each side (docs/measurements.md, 2026-12-07).
inline void put_le(std::byte* p, std::uint64_t v, int bytes) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    switch (bytes) {
      case 8: std::memcpy(p, &v, 8); return;
      case 4: {
        const auto w = static_cast<std::uint32_t>(v);
        std::memcpy(p, &w, 4);
        return;
      }
      case 2: {
        const auto w = static_cast<std::uint16_t>(v);
        std::memcpy(p, &w, 2);
        return;
      }
      default: break;
    }
  }
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}

inline std::uint64_t get_le(const std::byte* p, int bytes) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    switch (bytes) {
      case 8: {
        std::uint64_t v;
        std::memcpy(&v, p, 8);
        return v;
      }
      case 4: {
        std::uint32_t v;
        std::memcpy(&v, p, 4);
        return v;
      }
      case 2: {
        std::uint16_t v;
        std::memcpy(&v, p, 2);
        return v;
      }
      default: break;
    }
  }
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(std::to_integer<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

}  // namespace shuttle::detail
