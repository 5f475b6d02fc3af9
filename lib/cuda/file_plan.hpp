// How the io_uring engine of gpu_file cuts a transfer into chunks: pure
// arithmetic, no I/O, so that its unaligned heads and tails, its chunk
// boundaries and its end-of-file handling are tested on any host.
//
// Reads (O_DIRECT needs the file offset, the length and the memory aligned)
// round the range out to the alignment: the first and last blocks are read
// whole and the bytes outside the request are dropped when the chunk is
// copied to the GPU. That costs at most two extra blocks and keeps every
// read direct. Writes cannot do that without reading the neighbouring
// bytes first, so an unaligned head and tail go through the buffered
// descriptor and only the aligned middle is written direct.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shuttle::cuda::detail {

struct file_chunk {
  std::uint64_t file_offset = 0;  // where the read (write) starts in the file
  std::size_t length = 0;         // bytes read from (written to) the file
  std::size_t skip = 0;           // reads: bytes at the chunk's start that precede the request
  std::size_t take = 0;           // bytes of the request in this chunk
  std::uint64_t dest_offset = 0;  // where those bytes go in (come from) the GPU span
  bool direct = true;             // writes: false for the buffered head and tail
};

inline std::uint64_t align_down(std::uint64_t v, std::uint64_t a) noexcept { return v / a * a; }
inline std::uint64_t align_up(std::uint64_t v, std::uint64_t a) noexcept { return (v + a - 1) / a * a; }

// A chunk size usable with `align`: a multiple of it, at least one block.
inline std::size_t usable_chunk(std::size_t chunk, std::size_t align) noexcept {
  if (align == 0) align = 1;
  return std::max<std::size_t>(align, chunk / align * align);
}

// Alignment 0 means none (1); the chunk, a multiple of it.
inline void normalize(std::size_t& align, std::size_t& chunk) noexcept {
  if (align == 0) align = 1;
  chunk = usable_chunk(chunk, align);
}

// Reads of [offset, offset + length) in chunks of at most `chunk` bytes
// whose file offsets and lengths are multiples of `align` (1: buffered,
// no rounding).
inline std::vector<file_chunk> plan_read(std::uint64_t offset, std::size_t length, std::size_t align,
                                         std::size_t chunk) {
  std::vector<file_chunk> out;
  if (length == 0) return out;
  normalize(align, chunk);
  const std::uint64_t end = offset + length;
  const std::uint64_t first = align_down(offset, align), last = align_up(end, align);
  out.reserve((last - first + chunk - 1) / chunk);
  for (std::uint64_t s = first; s < last; s += chunk) {
    std::uint64_t e = std::min<std::uint64_t>(s + chunk, last);
    std::uint64_t from = std::max(s, offset), to = std::min(e, end);
    out.push_back({s, static_cast<std::size_t>(e - s), static_cast<std::size_t>(from - s),
                   static_cast<std::size_t>(to - from), from - offset, true});
  }
  return out;
}

// Of a read chunk of which `got` bytes arrived (fewer at the end of the
// file), how many of the requested bytes it holds.
inline std::size_t usable_bytes(const file_chunk& c, std::size_t got) noexcept {
  if (got <= c.skip) return 0;
  return std::min(c.take, got - c.skip);
}

// Writes of [offset, offset + length): the aligned middle in direct chunks
// of at most `chunk`, an unaligned head and tail as buffered pieces (all
// buffered when `align` is 1 or the range lies within one block).
inline std::vector<file_chunk> plan_write(std::uint64_t offset, std::size_t length, std::size_t align,
                                          std::size_t chunk) {
  std::vector<file_chunk> out;
  if (length == 0) return out;
  normalize(align, chunk);
  const std::uint64_t end = offset + length;
  std::uint64_t mid_begin = align_up(offset, align), mid_end = align_down(end, align);
  auto piece = [&](std::uint64_t s, std::uint64_t e, bool direct) {
    for (std::uint64_t p = s; p < e; p += chunk) {
      std::uint64_t q = std::min<std::uint64_t>(p + chunk, e);
      out.push_back({p, static_cast<std::size_t>(q - p), 0, static_cast<std::size_t>(q - p), p - offset, direct});
    }
  };
  if (align == 1 || mid_begin >= mid_end) {
    piece(offset, end, false);
    return out;
  }
  piece(offset, mid_begin, false);
  piece(mid_begin, mid_end, true);
  piece(mid_end, end, false);
  return out;
}

}  // namespace shuttle::cuda::detail
