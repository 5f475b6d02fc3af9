// memory_monitor: userfaultfd's unmap events, read on a thread of its own.
#include "memory_monitor.hpp"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace shuttle::detail::verbs_impl {
namespace {

constexpr std::uint64_t wanted_events = UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_REMAP;

std::error_code errno_ec(int e) { return {e, std::generic_category()}; }

struct mapping {
  std::uintptr_t begin, end;
  bool private_anonymous;
};

// The mappings overlapping [begin, end), from /proc/self/maps.
std::error_code mappings_of(std::uintptr_t begin, std::uintptr_t end, std::vector<mapping>& out) {
  int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_ec(errno);
  std::string text;
  char buf[16384];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      ::close(fd);
      return errno_ec(e);
    }
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  // "start-end perms offset dev inode   path"
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    const char* line = text.c_str() + pos;
    char* p = nullptr;
    const std::uintptr_t b = std::strtoull(line, &p, 16);
    const std::uintptr_t e = (p && *p == '-') ? std::strtoull(p + 1, &p, 16) : 0;
    pos = eol + 1;
    if (e <= begin) continue;
    if (b >= end) break;  // the file is in address order
    char perms[5] = {};
    unsigned long long offset = 0, inode = 0;
    unsigned dev_major = 0, dev_minor = 0;
    int consumed = 0;
    if (std::sscanf(p, " %4s %llx %x:%x %llu%n", perms, &offset, &dev_major, &dev_minor, &inode, &consumed) < 5)
      return std::make_error_code(std::errc::protocol_error);
    const char* name = p + consumed;
    while (*name == ' ') ++name;
    const std::size_t name_len = static_cast<std::size_t>(text.c_str() + eol - name);
    const std::string_view path(name, name_len);
    const bool anon_name = path.empty() || path == "[heap]" || path == "[stack]" || path.starts_with("[anon:");
    out.push_back({b, e, perms[3] == 'p' && inode == 0 && dev_major == 0 && dev_minor == 0 && anon_name});
  }
  return {};
}

}  // namespace

namespace {
std::error_code start_error;  // written once, before instance() first returns
}  // namespace

memory_monitor* memory_monitor::instance() noexcept {
  static memory_monitor m;
  static const bool started = [] {
    start_error = start(m);
    return !start_error;
  }();
  return started && !forked_ ? &m : nullptr;
}

std::error_code memory_monitor::unavailable_reason() noexcept {
  if (instance()) return {};
  if (forked_) return std::make_error_code(std::errc::not_supported);  // a child of fork(): see usable()
  return start_error;
}

std::error_code memory_monitor::start(memory_monitor& m) noexcept {
  if (const char* v = std::getenv("SHUTTLE_REGISTRATION_CACHE"); v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0))
    return std::make_error_code(std::errc::operation_canceled);  // turned off by the user
  // User-mode-only: no fault of ours is ever handled, and unprivileged
  // processes may have that kind (vm.unprivileged_userfaultfd = 0).
  int fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (fd < 0 && errno == EINVAL) fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd < 0) return errno_ec(errno);
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = wanted_events;
  if (::ioctl(fd, UFFDIO_API, &api) != 0 || (api.features & wanted_events) != wanted_events ||
      !(api.features & UFFD_FEATURE_PAGEFAULT_FLAG_WP) || !(api.ioctls & (1ULL << _UFFDIO_REGISTER))) {
    int e = errno ? errno : ENOTSUP;
    ::close(fd);
    return errno_ec(e);
  }
  if (int e = pthread_atfork(nullptr, nullptr, &memory_monitor::on_fork_child); e != 0) {
    ::close(fd);
    return errno_ec(e);
  }
  m.uffd_ = fd;
  // The thread takes no signal: the process's handlers run on its own threads.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t t;
  int e = pthread_create(&t, nullptr, &memory_monitor::run, &m);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (e != 0) {
    ::close(fd);
    m.uffd_ = -1;
    return errno_ec(e);
  }
  pthread_setname_np(t, "shuttle-memmon");
  pthread_detach(t);
  return {};
}

void* memory_monitor::run(void* self) noexcept {
  auto& m = *static_cast<memory_monitor*>(self);
  uffd_msg msgs[32];
  for (;;) {
    pollfd p{m.uffd_, POLLIN, 0};
    if (::poll(&p, 1, -1) < 0) continue;  // EINTR
    std::lock_guard g(m.lock_);
    for (;;) {
      const ssize_t n = ::read(m.uffd_, msgs, sizeof msgs);
      if (n <= 0) break;  // EAGAIN: all read
      for (std::size_t i = 0; i < static_cast<std::size_t>(n) / sizeof(uffd_msg); ++i) {
        const uffd_msg& msg = msgs[i];
        switch (msg.event) {
          case UFFD_EVENT_UNMAP:
          case UFFD_EVENT_REMOVE:
            m.apply(msg.arg.remove.start, msg.arg.remove.end);
            break;
          case UFFD_EVENT_REMAP:
            m.apply(msg.arg.remap.from, msg.arg.remap.from + msg.arg.remap.len);
            break;
          case UFFD_EVENT_PAGEFAULT: {
            // Never write-protected, so never expected: should one come,
            // lift the protection and wake the thread rather than hang it.
            uffdio_writeprotect wp{};
            wp.range.start = msg.arg.pagefault.address & ~std::uint64_t(4095);
            wp.range.len = 4096;
            wp.mode = 0;
            (void)::ioctl(m.uffd_, UFFDIO_WRITEPROTECT, &wp);
            break;
          }
          default:
            break;
        }
      }
    }
  }
  return nullptr;
}

void memory_monitor::apply(std::uintptr_t begin, std::uintptr_t end) noexcept {
  events_.fetch_add(1, std::memory_order_acq_rel);
  for (unmap_listener* l = listeners_; l; l = l->next_) l->on_unmapped(begin, end);
}

void memory_monitor::subscribe(unmap_listener& l) noexcept {
  l.prev_ = nullptr;
  l.next_ = listeners_;
  if (listeners_) listeners_->prev_ = &l;
  listeners_ = &l;
}

void memory_monitor::unsubscribe(unmap_listener& l) noexcept {
  if (l.prev_)
    l.prev_->next_ = l.next_;
  else if (listeners_ == &l)
    listeners_ = l.next_;
  if (l.next_) l.next_->prev_ = l.prev_;
  l.next_ = l.prev_ = nullptr;
}

std::error_code memory_monitor::watch(std::uintptr_t begin, std::uintptr_t end) {
  if (forked_) return std::make_error_code(std::errc::not_supported);
  std::vector<mapping> maps;
  if (auto ec = mappings_of(begin, end, maps)) return ec;
  std::uintptr_t covered = begin;
  for (const mapping& m : maps) {
    if (m.begin > covered || !m.private_anonymous) return std::make_error_code(std::errc::not_supported);
    covered = m.end;
  }
  if (covered < end) return std::make_error_code(std::errc::not_supported);
  for (const mapping& m : maps) {
    uffdio_register r{};
    r.range.start = m.begin;
    r.range.len = m.end - m.begin;
    r.mode = UFFDIO_REGISTER_MODE_WP;
    if (::ioctl(uffd_, UFFDIO_REGISTER, &r) != 0) return errno_ec(errno);
  }
  return {};
}

}  // namespace shuttle::detail::verbs_impl
