// A gdb-free crash report for the tools run on machines without a debugger
// (the GPU machine): on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT, prints
// the signal, the fault address, the executable's load base and the raw
// return addresses to stderr, then dies of the same signal. glibc 2.35 and
// later have no catchsegv or libSegFault.so. The binaries carried there are
// stripped of debug info only, so `addr2line -f -C -e BUILT_BINARY
// $((ADDR - BASE))` on the unstripped build names each frame.
#pragma once

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace crash_trace {
namespace detail {
inline void put(const char* s) noexcept {
  std::size_t n = 0;
  while (s[n]) ++n;
  [[maybe_unused]] auto r = ::write(2, s, n);
}
inline void put_hex(const void* p) noexcept {
  char b[2 + 16 + 1];
  auto v = reinterpret_cast<unsigned long>(p);
  b[0] = '0';
  b[1] = 'x';
  for (int i = 0; i < 16; ++i) b[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xf];
  b[18] = 0;
  put(b);
}
inline void* exe_base() noexcept {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&exe_base), &info) == 0) return nullptr;
  return info.dli_fbase;
}

inline void on_signal(int sig, siginfo_t* si, void*) noexcept {
  put("\n*** fatal signal ");
  put(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGILL ? "SIGILL" : sig == SIGFPE ? "SIGFPE"
                                                                                                    : "SIGABRT");
  put(", fault address ");
  put_hex(si ? si->si_addr : nullptr);
  put(", executable base ");
  put_hex(exe_base());
  put("\n*** backtrace (addr2line -f -C -e BINARY ADDR-BASE):\n");
  void* frames[64];
  int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, 2);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}
}  // namespace detail

// Installs the handlers on an alternate stack (a stack overflow still reports).
inline void install() noexcept {
  static char alt[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  (void)::sigaltstack(&ss, nullptr);
  // backtrace() loads libgcc on its first call: not in a signal handler.
  void* warm[1];
  (void)::backtrace(warm, 1);
  struct sigaction sa {};
  sa.sa_sigaction = &detail::on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) (void)::sigaction(s, &sa, nullptr);
}
}  // namespace crash_trace
