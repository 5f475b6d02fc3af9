// LD_PRELOAD shim: times the writes on the uverbs command fd, so that a
// benchmark can take Soft-RoCE's doorbell out of the time a post takes.
//
// Why write(): for a user QP, librxe (rdma-core providers/rxe/rxe.c, v44 as
// Debian 12 ships it, and the same on master) queues each work request of a
// chain into the send queue mapped from the kernel (post_one_send), then
// rings the doorbell once per ibv_post_send: post_send_db() write()s a
// POST_SEND command with wr_count 0 on ibv_context::cmd_fd. The kernel's
// rxe_post_send then runs the requester in that same call (the wire work,
// and with rxe's loopback often the responder and the completer too), so
// under rxe that write is most of what a post costs, and none of it is the
// post path's own work. No other call is involved in the doorbell: no
// ioctl, no writev, no mmap'd doorbell page (rxe has none). Other verbs
// commands (ibv_resize_cq, ibv_req_notify_cq, ...) go through
// libibverbs's execute_cmd_write, as write() or as the ioctl form; the
// writes are counted apart from the doorbells here, the ioctls not at all.
//
// Which fds: decided once per fd, on its first write: a character device
// whose /proc/self/fd/N link starts with /dev/infiniband/uverbs. The
// answer is kept in a table (fds below 4096; above, every write asks
// again) and forgotten when the fd is closed or replaced through close(),
// dup2() or dup3() (interposed for that alone). An fd closed some other
// way (close_range, a raw syscall) and reused for something else would
// keep its old answer: blocks_bench does neither. A write to any other fd
// costs one table load more than the real write.
//
// What is counted: the calls and CLOCK_MONOTONIC nanoseconds around the
// real write, process-wide (relaxed atomics: a loop thread's writes are
// read back by that thread), read with shuttle_doorbell_read().
#include "doorbell_shim.h"

#include <dlfcn.h>
#include <errno.h>
#include <rdma/ib_user_verbs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

using write_fn = ssize_t (*)(int, const void*, size_t);
using close_fn = int (*)(int);
using dup2_fn = int (*)(int, int);
using dup3_fn = int (*)(int, int, int);

template <class F>
F next(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (!p) {
    static const char msg[] = "doorbell_shim: dlsym(RTLD_NEXT) found no libc function to forward to\n";
    // Nothing to forward to: nothing sensible can go on.
    (void)!::syscall(SYS_write, 2, msg, sizeof msg - 1);
    _exit(127);
  }
  return reinterpret_cast<F>(p);
}

write_fn real_write() {
  static const write_fn f = next<write_fn>("write");
  return f;
}
close_fn real_close() {
  static const close_fn f = next<close_fn>("close");
  return f;
}

constexpr int table_size = 4096;
enum : unsigned char { unknown = 0, other_fd = 1, uverbs_fd = 2 };
std::atomic<unsigned char> kinds[table_size];

std::atomic<std::uint64_t> post_send_calls{0}, post_send_ns{0}, other_calls{0}, other_ns{0};

bool is_uverbs(int fd) {
  const int saved = errno;
  bool yes = false;
  struct stat st;
  if (::fstat(fd, &st) == 0 && S_ISCHR(st.st_mode)) {
    char link[40], target[128];
    std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    const ssize_t n = ::readlink(link, target, sizeof target - 1);
    static const char prefix[] = "/dev/infiniband/uverbs";
    yes = n >= static_cast<ssize_t>(sizeof prefix - 1) && std::memcmp(target, prefix, sizeof prefix - 1) == 0;
  }
  errno = saved;
  return yes;
}

bool uverbs(int fd) {
  if (fd < 0) return false;
  if (fd >= table_size) return is_uverbs(fd);
  unsigned char k = kinds[fd].load(std::memory_order_relaxed);
  if (k == unknown) {
    k = is_uverbs(fd) ? uverbs_fd : other_fd;
    kinds[fd].store(k, std::memory_order_relaxed);
  }
  return k == uverbs_fd;
}

void forget(int fd) {
  if (fd >= 0 && fd < table_size) kinds[fd].store(unknown, std::memory_order_relaxed);
}

std::uint64_t now_ns() {
  timespec t;
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return std::uint64_t(t.tv_sec) * 1000000000u + std::uint64_t(t.tv_nsec);
}

// A POST_SEND command in the legacy write() format (the one librxe's
// doorbell uses); extended commands carry IB_USER_VERBS_CMD_FLAG_EXTENDED.
bool is_post_send(const void* buf, size_t n) {
  if (n < sizeof(ib_uverbs_cmd_hdr)) return false;
  ib_uverbs_cmd_hdr h;
  std::memcpy(&h, buf, sizeof h);
  return (h.command & IB_USER_VERBS_CMD_FLAG_EXTENDED) == 0 &&
         (h.command & IB_USER_VERBS_CMD_COMMAND_MASK) == IB_USER_VERBS_CMD_POST_SEND;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) ssize_t write(int fd, const void* buf, size_t n) {
  const write_fn w = real_write();
  if (!uverbs(fd)) return w(fd, buf, n);
  const bool db = is_post_send(buf, n);
  const std::uint64_t t0 = now_ns();
  const ssize_t r = w(fd, buf, n);
  const std::uint64_t dt = now_ns() - t0;
  (db ? post_send_calls : other_calls).fetch_add(1, std::memory_order_relaxed);
  (db ? post_send_ns : other_ns).fetch_add(dt, std::memory_order_relaxed);
  return r;
}

__attribute__((visibility("default"))) int close(int fd) {
  forget(fd);
  return real_close()(fd);
}

__attribute__((visibility("default"))) int dup2(int from, int to) {
  static const dup2_fn f = next<dup2_fn>("dup2");
  forget(to);
  return f(from, to);
}

__attribute__((visibility("default"))) int dup3(int from, int to, int flags) {
  static const dup3_fn f = next<dup3_fn>("dup3");
  forget(to);
  return f(from, to, flags);
}

__attribute__((visibility("default"))) void shuttle_doorbell_read(shuttle_doorbell_counts* out) {
  out->post_send_calls = post_send_calls.load(std::memory_order_relaxed);
  out->post_send_ns = post_send_ns.load(std::memory_order_relaxed);
  out->other_calls = other_calls.load(std::memory_order_relaxed);
  out->other_ns = other_ns.load(std::memory_order_relaxed);
}

}  // extern "C"
