// Striping: a connection_group of N connections to one peer (rails: on one
// device or on several), over which a block list or one large transfer is
// split (issue 31, point 2).
#pragma once

#include <shuttle/transport.hpp>

#include <cstdint>
#include <vector>

namespace shuttle {

// The rails are the application's connections (connected as usual, to the
// same peer; they may belong to different domains), moved in. Like a
// connection, a group belongs to one loop's thread.
//
// A transfer is split into one contiguous run of the list per rail, sized
// by bytes: each rail gets an equal share of the bytes (whole blocks, so
// shares differ by less than one block), less what it already has in flight
// from this group (its queue occupancy), so that a rail still busy with an
// earlier transfer gets less of the next one. The parts run concurrently,
// each a write_blocks / read_blocks on its rail (merging, chains: as there).
// The transfer completes when every part has; a part that fails fails the
// transfer (never a silent partial success), with failed_block() the index
// in the whole list (the lowest one, if several rails failed); the other
// rails' parts still complete, and a rail that failed stays failed (RC).
// `notify` is a zero-length write_with_imm on rail 0 once every part is
// done, so the peer's message follows every block of every rail.
// Cancellation reaches every part. No rails: errc::disconnected, block 0.
class connection_group {
 public:
  connection_group() = default;
  explicit connection_group(std::vector<connection> rails);

  std::size_t size() const noexcept { return rails_.size(); }
  connection& rail(std::size_t i) noexcept { return rails_[i]; }
  // Bytes of this group's transfers in flight on rail i.
  std::uint64_t in_flight(std::size_t i) const noexcept { return in_flight_[i]; }

  task<block_result> write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                  std::span<const block> blocks, block_options options = {});
  task<block_result> read_blocks(std::span<std::byte> local, remote_buffer remote, std::span<const block> blocks);
  // One contiguous transfer, cut into one part per rail.
  task<result<void>> write(std::span<const std::byte> local, remote_buffer remote);
  task<result<void>> read(std::span<std::byte> local, remote_buffer remote);

  // close() on every rail; the first error, if any.
  task<result<void>> close();

 private:
  task<block_result> striped(bool write, std::span<std::byte> local, remote_buffer remote,
                             std::span<const block> blocks, block_options options);
  std::vector<connection> rails_;
  std::vector<std::uint64_t> in_flight_;
};

}  // namespace shuttle
