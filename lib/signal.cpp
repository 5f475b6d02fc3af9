#include <shuttle/detail/uring_op.hpp>
#include <shuttle/signal.hpp>

#include <pthread.h>
#include <sys/signalfd.h>
#include <unistd.h>

namespace shuttle {

namespace {
sigset_t make_set(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  return set;
}
}  // namespace

void block_signals(std::initializer_list<int> signals) {
  sigset_t set = make_set(signals);
  if (int e = pthread_sigmask(SIG_BLOCK, &set, nullptr)) throw_errno(e, "pthread_sigmask");
}

signal_set::signal_set(std::initializer_list<int> signals) {
  sigset_t set = make_set(signals);
  if (int e = pthread_sigmask(SIG_BLOCK, &set, nullptr)) throw_errno(e, "pthread_sigmask");
  fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (fd_ < 0) throw_errno(errno, "signalfd");
}

signal_set::~signal_set() {
  if (fd_ >= 0) ::close(fd_);
}

task<result<int>> signal_set::wait() {
  signalfd_siginfo info{};
  int fd = fd_;
  auto r = co_await detail::make_uring_awaitable(
      io_context::current(),
      [&](io_uring_sqe* sqe) { io_uring_prep_read(sqe, fd, &info, sizeof info, 0); },
      [](int res, std::uint32_t) { return res; });
  if (r < 0) co_return errno_code(-r);
  if (r != static_cast<int>(sizeof info)) co_return errno_code(EIO);
  co_return static_cast<int>(info.ssi_signo);
}

}  // namespace shuttle
