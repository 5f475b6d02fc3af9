// Block-list transfers (connection::write_blocks / read_blocks), over any
// provider: the provider's transfer_blocks, by default (here) the blocks
// checked, adjacent ones merged, and the resulting operations through the
// provider's batch path (post_batch_at), which cuts them into chains that
// fit the send queue. The tcp engine and the local provider have list
// paths of their own (lib/tcp_provider/blocks.cpp, lib/local_provider/
// operations.cpp) with the same checks, merging, results and stats.
#include "provider.hpp"
#include "scratch.hpp"

#include <algorithm>
#include <vector>

namespace shuttle {

namespace detail {

namespace {

thread_local block_stats stats;  // a connection belongs to one thread

// Checks every block and merges runs of adjacent ones into `ops`; on a bad
// block, its error and index (nothing is posted then). A merged operation
// stays well under every provider's limit on one transfer (tcp: 2 GiB;
// verbs: the port's max_msg_sz, 2 GiB on rxe).
block_result plan_blocks(scratch_vector<operation>& ops, const block_list& l) {
  ops.reserve(l.blocks.size());
  const operation::type t = l.write ? operation::type::write : operation::type::read;
  // The end of the last operation, locally and remotely: a block starting
  // at both extends it.
  std::uint64_t local_end = UINT64_MAX, remote_end = UINT64_MAX;
  for (std::size_t i = 0; i < l.blocks.size(); ++i) {
    const block& b = l.blocks[i];
    if (auto e = block_error(b, l.size, l.remote.length)) return {e, i};
    if (!ops.empty() && extends(b, local_end, remote_end, ops.back().local.size())) {
      operation& o = ops.back();
      o.local = {o.local.data(), o.local.size() + b.length};
      o.remote.length += b.length;
    } else {
      ops.push_back({t, {l.base + b.local_offset, b.length}, {l.remote.address + b.remote_offset, l.remote.rkey, b.length}, 0});
    }
    local_end = b.local_offset + b.length;
    remote_end = b.remote_offset + b.length;
  }
  if (l.notify && !ops.empty()) {
    ops.back().op = operation::type::write_with_imm;
    ops.back().imm = *l.notify;
  }
  return {};
}

}  // namespace

block_result check_blocks(const block_list& l, std::uint64_t& longest) noexcept {
  const block* blocks = l.blocks.data();
  const std::size_t n = l.blocks.size();
  const std::uint64_t size = l.size, remote_length = l.remote.length;
  std::uint64_t most = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const block b = blocks[i];
    most = std::max(most, b.length);
    if (auto e = block_error(b, size, remote_length)) return {e, i};
  }
  longest = most;
  return {};
}

void count_block_list(std::size_t blocks, std::size_t operations) noexcept {
  ++stats.lists;
  stats.blocks += blocks;
  stats.operations += operations;
}

// Only on an error: the list is walked again rather than an index kept per
// operation while it goes well.
std::size_t block_of_operation(const block_list& l, std::size_t op) noexcept {
  std::uint64_t local_end = UINT64_MAX, remote_end = UINT64_MAX, length = 0;
  std::size_t ops = 0;
  for (std::size_t i = 0; i < l.blocks.size(); ++i) {
    const block& b = l.blocks[i];
    if (i > 0 && extends(b, local_end, remote_end, length)) {
      length += b.length;
    } else {
      if (ops++ == op) return i;
      length = b.length;
    }
    local_end = b.local_offset + b.length;
    remote_end = b.remote_offset + b.length;
  }
  return block_result::unknown;
}

task<block_result> connection_impl::transfer_blocks(block_list l) {
  scratch_vector<operation> ops;
  if (auto bad = plan_blocks(ops, l); !bad) co_return bad;
  // RC: a failed connection fails every later operation; the list's first
  // block is the one that failed.
  if (!is_open()) co_return block_result{make_error_code(errc::disconnected), 0};
  count_block_list(l.blocks.size(), ops.size());
  std::size_t failed = ops.size();
  auto r = co_await post_batch_at(ops, failed);
  if (r) co_return block_result{};
  co_return block_result{r.error(), failed < ops.size() ? block_of_operation(l, failed) : block_result::unknown};
}

}  // namespace detail

namespace {

task<block_result> finish_now(block_result r) { co_return r; }

task<block_result> transfer(detail::connection_impl* c, detail::block_list l) {
  if (!c) return finish_now({make_error_code(errc::disconnected), 0});
  if (l.blocks.empty()) return finish_now({});
  return c->transfer_blocks(l);
}

}  // namespace

block_stats block_transfer_stats() noexcept { return detail::stats; }

task<block_result> connection::write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                            std::span<const block> blocks, block_options options) {
  // The data is only read: a write's span is const in operation too.
  return transfer(impl_.get(), {true, const_cast<std::byte*>(local.data()), local.size(), remote, blocks, options.notify});
}

task<block_result> connection::read_blocks(std::span<std::byte> local, remote_buffer remote,
                                           std::span<const block> blocks) {
  return transfer(impl_.get(), {false, local.data(), local.size(), remote, blocks, std::nullopt});
}

}  // namespace shuttle
