// doctest main of the gpu suite: exits 77 (meson's "skipped") without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <shuttle/cuda/cuda.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  int n = shuttle::cuda::device_count();
  if (n == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  std::printf("GPU 0: %s\n", shuttle::cuda::describe_device(0).c_str());
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
