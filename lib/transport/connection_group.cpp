// connection_group (shuttle/connection_group.hpp): a transfer split over
// rails by bytes and queue occupancy, its parts awaited together.
#include <shuttle/connection_group.hpp>
#include <shuttle/when_all.hpp>

#include <algorithm>
#include <memory>
#include <stdexcept>

namespace shuttle {

connection_group::connection_group(std::vector<connection> rails)
    : rails_(std::move(rails)), loops_(rails_.size(), nullptr), in_flight_(rails_.size(), 0) {}

connection_group::connection_group(std::vector<connection> rails, std::vector<io_context*> loops)
    : rails_(std::move(rails)), loops_(std::move(loops)), in_flight_(rails_.size(), 0) {
  if (loops_.size() != rails_.size()) throw std::invalid_argument("connection_group: one loop per rail");
  io_context* here = io_context::current_or_null();
  for (io_context*& l : loops_)
    if (l == here) l = nullptr;
}

connection_group& connection_group::operator=(connection_group&& o) noexcept {
  if (this != &o) {
    drop_rails();
    rails_ = std::move(o.rails_);
    loops_ = std::move(o.loops_);
    in_flight_ = std::move(o.in_flight_);
  }
  return *this;
}

connection_group::~connection_group() { drop_rails(); }

// A rail of another loop is destroyed there: its destructor aborts the
// connection, which only its loop's thread may do.
void connection_group::drop_rails() noexcept {
  for (std::size_t r = 0; r < rails_.size(); ++r) {
    if (!loops_[r]) continue;
    auto c = std::make_shared<connection>(std::move(rails_[r]));
    loops_[r]->dispatch([c] { *c = connection{}; });
  }
  rails_.clear();
  loops_.clear();
  in_flight_.clear();
}

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

namespace {

// A part on rail `c` of loop `loop` (nullptr: this one): there and back, so
// that the group's own code runs on its thread only.
task<block_result> rail_part(connection& c, bool write, std::span<std::byte> local, remote_buffer remote,
                             std::span<const block> blocks) {
  // Not `co_await (write ? a : b)`: g++ 12 destroys that temporary twice.
  if (write) return c.write_blocks(local, remote, blocks);
  return c.read_blocks(local, remote, blocks);
}

task<block_result> part_on(io_context* loop, connection& c, bool write, std::span<std::byte> local,
                           remote_buffer remote, std::span<const block> blocks) {
  if (!loop) co_return co_await rail_part(c, write, local, remote, blocks);
  io_context& home = io_context::current();
  co_await loop->schedule();
  block_result r = co_await rail_part(c, write, local, remote, blocks);
  co_await home.schedule();
  co_return r;
}

task<result<void>> notify_on(io_context* loop, connection& c, remote_buffer remote, std::uint32_t imm) {
  if (!loop) co_return co_await c.write_with_imm({}, remote_buffer{remote.address, remote.rkey, 0}, imm);
  io_context& home = io_context::current();
  co_await loop->schedule();
  result<void> r = co_await c.write_with_imm({}, remote_buffer{remote.address, remote.rkey, 0}, imm);
  co_await home.schedule();
  co_return r;
}

task<result<void>> close_on(io_context* loop, connection& c) {
  if (!loop) co_return co_await c.close();
  io_context& home = io_context::current();
  co_await loop->schedule();
  result<void> r = co_await c.close();
  co_await home.schedule();
  co_return r;
}

}  // namespace

task<block_result> connection_group::striped(bool write, std::span<std::byte> local, std::vector<remote_buffer> remotes,
                                             std::span<const block> blocks, block_options options) {
  if (rails_.empty()) co_return block_result{make_error_code(errc::disconnected), 0};
  if (remotes.size() != 1 && remotes.size() != rails_.size())
    co_return block_result{std::make_error_code(std::errc::invalid_argument), 0};
  auto remote_of = [&](std::size_t r) { return remotes.size() == 1 ? remotes[0] : remotes[r]; };
  const std::vector<std::size_t> cut = cut_list(blocks, in_flight_);
  std::vector<task<block_result>> parts;
  std::vector<std::size_t> first, rail_of;
  std::vector<std::uint64_t> bytes;
  for (std::size_t r = 0; r < rails_.size(); ++r) {
    if (cut[r] == cut[r + 1]) continue;
    auto part = blocks.subspan(cut[r], cut[r + 1] - cut[r]);
    std::uint64_t b = 0;
    for (const block& x : part) b += x.length;
    parts.push_back(part_on(loops_[r], rails_[r], write, local, remote_of(r), part));
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
    auto n = co_await notify_on(loops_[0], rails_[0], remote_of(0), *options.notify);
    if (!n) co_return block_result{n.error(), blocks.size() - 1};
  }
  co_return block_result{};
}

task<block_result> connection_group::write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                                  std::span<const block> blocks, block_options options) {
  // Only read from: write_blocks takes it as const again.
  return striped(true, {const_cast<std::byte*>(local.data()), local.size()}, {remote}, blocks, options);
}

task<block_result> connection_group::read_blocks(std::span<std::byte> local, remote_buffer remote,
                                                 std::span<const block> blocks) {
  return striped(false, local, {remote}, blocks, {});
}

task<block_result> connection_group::write_blocks(std::span<const std::byte> local,
                                                  std::span<const remote_buffer> remotes,
                                                  std::span<const block> blocks, block_options options) {
  return striped(true, {const_cast<std::byte*>(local.data()), local.size()}, std::vector<remote_buffer>(remotes.begin(), remotes.end()), blocks,
                 options);
}

task<block_result> connection_group::read_blocks(std::span<std::byte> local, std::span<const remote_buffer> remotes,
                                                 std::span<const block> blocks) {
  return striped(false, local, std::vector<remote_buffer>(remotes.begin(), remotes.end()), blocks, {});
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

task<result<void>> connection_group::contiguous(bool write, std::span<std::byte> local,
                                                std::vector<remote_buffer> remotes) {
  for (const remote_buffer& rb : remotes)
    if (local.size() > rb.length) co_return std::make_error_code(std::errc::result_out_of_range);
  auto b = as_blocks(local.size(), rails_.size());
  auto r = co_await striped(write, local, std::move(remotes), b, {});
  if (!r) co_return r.error();
  co_return result<void>{};
}

task<result<void>> connection_group::write(std::span<const std::byte> local, remote_buffer remote) {
  return contiguous(true, {const_cast<std::byte*>(local.data()), local.size()}, {remote});
}

task<result<void>> connection_group::read(std::span<std::byte> local, remote_buffer remote) {
  return contiguous(false, local, {remote});
}

task<result<void>> connection_group::write(std::span<const std::byte> local, std::span<const remote_buffer> remotes) {
  return contiguous(true, {const_cast<std::byte*>(local.data()), local.size()}, std::vector<remote_buffer>(remotes.begin(), remotes.end()));
}

task<result<void>> connection_group::read(std::span<std::byte> local, std::span<const remote_buffer> remotes) {
  return contiguous(false, local, std::vector<remote_buffer>(remotes.begin(), remotes.end()));
}

task<result<void>> connection_group::close() {
  result<void> first{};
  for (std::size_t i = 0; i < rails_.size(); ++i) {
    auto r = co_await close_on(loops_[i], rails_[i]);
    if (!r && first) first = r;
  }
  co_return first;
}

}  // namespace shuttle
