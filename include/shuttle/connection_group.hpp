// Striping: a connection_group of N connections to one peer (rails: on one
// device or on several, on one loop or on several), over which a block list
// or one large transfer is split (issue 31, point 2).
#pragma once

#include <shuttle/io_context.hpp>
#include <shuttle/transport.hpp>

#include <cstdint>
#include <vector>

namespace shuttle {

// The rails are the application's connections (connected as usual, to the
// same peer; they may belong to different domains), moved in. Like a
// connection, a group belongs to one loop's thread.
//
// A rail may belong to another loop (a connection made on another
// io_context's thread, e.g. one of a runtime's): give that loop with it.
// The group then runs that rail's parts there (its task hops to the rail's
// loop, posts and awaits there, and hops back), so each rail's provider work
// runs on its own thread, as multi-rail users arrange it. Such a loop must
// outlive the group; the group's destructor hands each such rail back to its
// loop to be destroyed there (the threading rules: a connection is used and
// destroyed on its loop's thread only).
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
// Cancellation reaches every part (across loops too: a provider carries a
// stop request to its loop). No rails: errc::disconnected, block 0.
//
// The remote side: one remote_buffer for every rail (the peer's rails share
// one domain), or one per rail, in rail order (the peer has a domain per
// rail, e.g. per device or per loop: the same bytes under each one's key).
// Another count of remotes: errc::invalid_argument, block 0.
class connection_group {
 public:
  connection_group() = default;
  explicit connection_group(std::vector<connection> rails);
  // loops[i]: the loop rail i belongs to; nullptr (or this thread's loop):
  // the group's own. loops.size() must be rails.size() (else: std::invalid_argument).
  connection_group(std::vector<connection> rails, std::vector<io_context*> loops);
  connection_group(connection_group&&) noexcept = default;
  connection_group& operator=(connection_group&& o) noexcept;
  ~connection_group();

  std::size_t size() const noexcept { return rails_.size(); }
  connection& rail(std::size_t i) noexcept { return rails_[i]; }
  // The loop rail i belongs to: nullptr for the group's own.
  io_context* loop(std::size_t i) const noexcept { return loops_[i]; }
  // Bytes of this group's transfers in flight on rail i.
  std::uint64_t in_flight(std::size_t i) const noexcept { return in_flight_[i]; }

  task<block_result> write_blocks(std::span<const std::byte> local, remote_buffer remote,
                                  std::span<const block> blocks, block_options options = {});
  task<block_result> read_blocks(std::span<std::byte> local, remote_buffer remote, std::span<const block> blocks);
  // One remote per rail (each stays valid, as `blocks`, until the task completes).
  task<block_result> write_blocks(std::span<const std::byte> local, std::span<const remote_buffer> remotes,
                                  std::span<const block> blocks, block_options options = {});
  task<block_result> read_blocks(std::span<std::byte> local, std::span<const remote_buffer> remotes,
                                 std::span<const block> blocks);
  // One contiguous transfer, cut into one part per rail.
  task<result<void>> write(std::span<const std::byte> local, remote_buffer remote);
  task<result<void>> read(std::span<std::byte> local, remote_buffer remote);
  task<result<void>> write(std::span<const std::byte> local, std::span<const remote_buffer> remotes);
  task<result<void>> read(std::span<std::byte> local, std::span<const remote_buffer> remotes);

  // close() on every rail (each on its loop); the first error, if any.
  task<result<void>> close();

 private:
  task<block_result> striped(bool write, std::span<std::byte> local, std::vector<remote_buffer> remotes,
                             std::span<const block> blocks, block_options options);
  task<result<void>> contiguous(bool write, std::span<std::byte> local, std::vector<remote_buffer> remotes);
  void drop_rails() noexcept;
  std::vector<connection> rails_;
  std::vector<io_context*> loops_;
  std::vector<std::uint64_t> in_flight_;
};

}  // namespace shuttle
