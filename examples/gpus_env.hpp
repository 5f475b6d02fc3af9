// SHUTTLE_GPUS=A[,B]: which GPU each of a program's two processes (or two
// ends) uses, for runs on two GPUs of one host (issue 33). A is this
// process's (the driving side, the sender, prefill), B its peer's (the
// peer process, the receiver, decode); B defaults to A; unset: both on GPU 0.
// Read by tests/gpu/test_local.cpp, bench/gpu/local_gpu_bench.cpp,
// bench/gpu/pipeline_bench.cpp and shuttle-kv-transfer --gpu. No CUDA here.
#pragma once

#include <cstdlib>
#include <string>

namespace shuttle_gpus {

struct gpu_pair {
  int self = 0, peer = 0;
  bool peer_named = false;  // B was given
};

// Parses `v` (SHUTTLE_GPUS's value; null or empty: the defaults) against
// `count` devices; `why` is empty on success, else says what is wrong.
inline gpu_pair parse(const char* v, int count, std::string& why) {
  gpu_pair g;
  why.clear();
  if (!v || !*v) return g;
  auto number = [](const char*& s) {  // a device number, or -1
    if (*s < '0' || *s > '9') return -1;
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);
    s = end;
    return n > 4096 ? -1 : int(n);
  };
  const char* s = v;
  int a = number(s), b = a;
  bool named = false;
  if (a >= 0 && *s == ',') {
    ++s;
    b = number(s);
    named = true;
  }
  if (a < 0 || b < 0 || *s) {
    why = std::string("SHUTTLE_GPUS='") + v + "': want A or A,B (device numbers)";
  } else if (a >= count || b >= count) {
    why = std::string("SHUTTLE_GPUS='") + v + "': this host has " + std::to_string(count) + " GPU(s)";
  } else {
    g = {a, b, named};
  }
  return g;
}
inline gpu_pair from_env(int count, std::string& why) { return parse(std::getenv("SHUTTLE_GPUS"), count, why); }

}  // namespace shuttle_gpus
