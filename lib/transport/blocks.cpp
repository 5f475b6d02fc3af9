// Block-list transfers (connection::write_blocks / read_blocks), over any
// provider: the blocks are checked, adjacent ones merged, and the resulting
// operations go through the provider's batch path (post_batch_at), which
// cuts them into chains that fit the send queue.
#include "provider.hpp"

#include <vector>

namespace shuttle {

namespace {

thread_local block_stats stats;  // a connection belongs to one thread

// A merged operation stays well under every provider's limit on one
// transfer (tcp: 2 GiB; verbs: the port's max_msg_sz, 2 GiB on rxe).
constexpr std::uint64_t max_merged = std::uint64_t(1) << 30;

// The operations of a list, and for each the index of its first block.
struct block_plan {
  std::vector<operation> ops;
  std::vector<std::size_t> first;
};

// Checks every block and merges runs of adjacent ones; on a bad block, its
// error and index (nothing is posted then).
block_result plan_blocks(block_plan& p, bool write, std::byte* base, std::size_t local_size, remote_buffer remote,
                         std::span<const block> blocks, std::optional<std::uint32_t> notify) {
  p.ops.reserve(blocks.size());
  p.first.reserve(blocks.size());
  const operation::type t = write ? operation::type::write : operation::type::read;
  // The end of the last operation, locally and remotely: a block starting
  // at both extends it.
  std::uint64_t local_end = UINT64_MAX, remote_end = UINT64_MAX;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const block& b = blocks[i];
    if (b.length == 0) return {std::make_error_code(std::errc::invalid_argument), i};
    if (b.local_offset > local_size || b.length > local_size - b.local_offset || b.remote_offset > remote.length ||
        b.length > remote.length - b.remote_offset)
      return {std::make_error_code(std::errc::result_out_of_range), i};
    if (b.local_offset == local_end && b.remote_offset == remote_end && p.ops.back().local.size() + b.length <= max_merged) {
      operation& o = p.ops.back();
      o.local = {o.local.data(), o.local.size() + b.length};
      o.remote.length += b.length;
    } else {
      p.ops.push_back({t, {base + b.local_offset, b.length}, {remote.address + b.remote_offset, remote.rkey, b.length}, 0});
      p.first.push_back(i);
    }
    local_end = b.local_offset + b.length;
    remote_end = b.remote_offset + b.length;
  }
  if (notify && !p.ops.empty()) {
    p.ops.back().op = operation::type::write_with_imm;
    p.ops.back().imm = *notify;
  }
  return {};
}

task<block_result> finish_now(block_result r) { co_return r; }

task<block_result> run_plan(detail::connection_impl* c, block_plan p, std::size_t blocks) {
  // RC: a failed connection fails every later operation; the list's first
  // block is the one that failed.
  if (!c->is_open()) co_return block_result{make_error_code(errc::disconnected), 0};
  ++stats.lists;
  stats.blocks += blocks;
  stats.operations += p.ops.size();
  std::size_t failed = p.ops.size();
  auto r = co_await c->post_batch_at(p.ops, failed);
  if (r) co_return block_result{};
  co_return block_result{r.error(), failed < p.first.size() ? p.first[failed] : block_result::unknown};
}

task<block_result> transfer(detail::connection_impl* c, bool write, std::byte* base, std::size_t size,
                            remote_buffer remote, std::span<const block> blocks, std::optional<std::uint32_t> notify) {
  if (!c) return finish_now({make_error_code(errc::disconnected), 0});
  block_plan p;
  if (auto bad = plan_blocks(p, write, base, size, remote, blocks, notify); !bad) return finish_now(bad);
  if (p.ops.empty()) return finish_now({});
  return run_plan(c, std::move(p), blocks.size());
}

}  // namespace

block_stats block_transfer_stats() noexcept { return stats; }

task<block_result> connection::write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                            std::span<const block> blocks, block_options options) {
  // The data is only read: a write's span is const in operation too.
  return transfer(impl_.get(), true, const_cast<std::byte*>(local.data()), local.size(), remote, blocks,
                  options.notify);
}

task<block_result> connection::read_blocks(std::span<std::byte> local, remote_buffer remote,
                                           std::span<const block> blocks) {
  return transfer(impl_.get(), false, local.data(), local.size(), remote, blocks, std::nullopt);
}

}  // namespace shuttle
