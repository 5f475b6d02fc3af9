// connection_group (shuttle/connection_group.hpp): a transfer split over
// rails by bytes and queue occupancy, its parts awaited together.
#include <shuttle/connection_group.hpp>
#include <shuttle/when_all.hpp>

#include <algorithm>

namespace shuttle {

connection_group::connection_group(std::vector<connection> rails)
    : rails_(std::move(rails)), in_flight_(rails_.size(), 0) {}

namespace {

// The first block of each rail's part: rail r takes [cut[r], cut[r+1]).
// Each rail's share: an equal part of the bytes (this transfer's and those
// in flight), less what it has in flight.
std::vector<std::size_t> cut_list(std::span<const block> blocks, const std::vector<std::uint64_t>& in_flight) {
  const std::size_t n = in_flight.size();
  std::uint64_t total = 0, busy = 0;
  for (const block& b : blocks) total += b.length;
  for (std::uint64_t f : in_flight) busy += f;
  const std::uint64_t fair = (total + busy) / n;
  std::vector<std::size_t> cut(n + 1, blocks.size());
  cut[0] = 0;
  std::size_t i = 0;
  for (std::size_t r = 0; r + 1 < n; ++r) {
    const std::uint64_t share = fair > in_flight[r] ? fair - in_flight[r] : 0;
    std::uint64_t got = 0;
    // Whole blocks, up to the one that crosses the share if it crosses it
    // by less than half.
    while (i < blocks.size() && got + blocks[i].length / 2 < share) got += blocks[i++].length;
    cut[r + 1] = i;
  }
  return cut;
}

}  // namespace

task<block_result> connection_group::striped(bool write, std::span<std::byte> local, remote_buffer remote,
                                             std::span<const block> blocks, block_options options) {
  if (rails_.empty()) co_return block_result{make_error_code(errc::disconnected), 0};
  const std::vector<std::size_t> cut = cut_list(blocks, in_flight_);
  std::vector<task<block_result>> parts;
  std::vector<std::size_t> first, rail_of;
  std::vector<std::uint64_t> bytes;
  for (std::size_t r = 0; r < rails_.size(); ++r) {
    if (cut[r] == cut[r + 1]) continue;
    auto part = blocks.subspan(cut[r], cut[r + 1] - cut[r]);
    std::uint64_t b = 0;
    for (const block& x : part) b += x.length;
    parts.push_back(write ? rails_[r].write_blocks(local, remote, part) : rails_[r].read_blocks(local, remote, part));
    first.push_back(cut[r]);
    rail_of.push_back(r);
    bytes.push_back(b);
  }
  if (parts.empty()) co_return block_result{};
  for (std::size_t k = 0; k < parts.size(); ++k) in_flight_[rail_of[k]] += bytes[k];
  std::vector<block_result> out = co_await when_all(std::move(parts));
  for (std::size_t k = 0; k < out.size(); ++k) in_flight_[rail_of[k]] -= bytes[k];
  for (std::size_t k = 0; k < out.size(); ++k) {  // parts in list order: the first failure has the lowest index
    if (out[k]) continue;
    std::size_t idx = out[k].failed_block();
    co_return block_result{out[k].error(), idx == block_result::unknown ? idx : first[k] + idx};
  }
  if (options.notify) {
    auto n = co_await rails_[0].write_with_imm({}, remote_buffer{remote.address, remote.rkey, 0}, *options.notify);
    if (!n) co_return block_result{n.error(), blocks.size() - 1};
  }
  co_return block_result{};
}

task<block_result> connection_group::write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                                  std::span<const block> blocks, block_options options) {
  // Only read from: write_blocks takes it as const again.
  return striped(true, {const_cast<std::byte*>(local.data()), local.size()}, remote, blocks, options);
}

task<block_result> connection_group::read_blocks(std::span<std::byte> local, remote_buffer remote,
                                                 std::span<const block> blocks) {
  return striped(false, local, remote, blocks, {});
}

namespace {
// A contiguous transfer as blocks of a size that splits it evenly over the
// rails (at most 64 per rail, so that occupancy can shift the split).
std::vector<block> as_blocks(std::size_t len, std::size_t rails) {
  std::vector<block> b;
  if (len == 0 || rails == 0) return b;
  const std::size_t pieces = std::max<std::size_t>(1, std::min<std::size_t>(len, rails * 64));
  const std::size_t each = (len + pieces - 1) / pieces;
  for (std::size_t off = 0; off < len; off += each) b.push_back({off, off, std::min(each, len - off)});
  return b;
}
}  // namespace

task<result<void>> connection_group::write(std::span<const std::byte> local, remote_buffer remote) {
  if (local.size() > remote.length) co_return std::make_error_code(std::errc::result_out_of_range);
  auto b = as_blocks(local.size(), rails_.size());
  auto r = co_await write_blocks(local, remote, b);
  if (!r) co_return r.error();
  co_return result<void>{};
}

task<result<void>> connection_group::read(std::span<std::byte> local, remote_buffer remote) {
  if (local.size() > remote.length) co_return std::make_error_code(std::errc::result_out_of_range);
  auto b = as_blocks(local.size(), rails_.size());
  auto r = co_await read_blocks(local, remote, b);
  if (!r) co_return r.error();
  co_return result<void>{};
}

task<result<void>> connection_group::close() {
  result<void> first{};
  for (connection& c : rails_) {
    auto r = co_await c.close();
    if (!r && first) first = r;
  }
  co_return first;
}

}  // namespace shuttle
