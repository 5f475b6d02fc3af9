// Stream-ordered network operations (see shuttle/cuda/ordered.hpp).
#include <shuttle/cuda/ordered.hpp>

namespace shuttle::cuda {

task<result<void>> write_after(cudaStream_t s, connection& c, std::span<const std::byte> local, remote_buffer remote) {
  if (auto r = co_await wait(s); !r) co_return r.error();
  co_return co_await c.write(local, remote);
}

task<result<void>> write_with_imm_after(cudaStream_t s, connection& c, std::span<const std::byte> local,
                                        remote_buffer remote, std::uint32_t imm) {
  if (auto r = co_await wait(s); !r) co_return r.error();
  co_return co_await c.write_with_imm(local, remote, imm);
}

task<result<void>> send_after(cudaStream_t s, connection& c, std::span<const std::byte> msg) {
  if (auto r = co_await wait(s); !r) co_return r.error();
  co_return co_await c.send(msg);
}

}  // namespace shuttle::cuda
