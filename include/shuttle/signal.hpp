// signal_set: await POSIX signals through a signalfd read in the ring.
// The constructor blocks the signals in the calling thread; block them before
// starting other threads (runtime does) so no thread takes them the old way.
#pragma once

#include <csignal>
#include <initializer_list>

#include <shuttle/io_context.hpp>
#include <shuttle/result.hpp>

namespace shuttle {

class signal_set {
 public:
  explicit signal_set(std::initializer_list<int> signals);
  ~signal_set();
  signal_set(const signal_set&) = delete;
  signal_set& operator=(const signal_set&) = delete;

  // co_await set.wait(): result<int> with the signal number.
  task<result<int>> wait();

 private:
  int fd_ = -1;
};

// Blocks `signals` in the calling thread (inherited by threads it starts).
void block_signals(std::initializer_list<int> signals);

}  // namespace shuttle
