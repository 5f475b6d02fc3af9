// gpu_file's cuFile engine and the loader of libcufile. The library is
// opened with dlopen on first use (nothing links it); the transfers use
// cuFile's stream API: cuFileReadAsync enqueues a read on a CUDA stream,
// an event recorded after it is awaited by the loop's wait poller, and the
// loop thread never blocks in cuFile.
#include "cufile_api.hpp"
#include "file_impl.hpp"

#include <shuttle/error.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>

namespace shuttle::cuda::detail::cufile {

const char* op_error_name(int e) noexcept {
  switch (e) {
    case success: return "CU_FILE_SUCCESS";
    case driver_not_initialized: return "CU_FILE_DRIVER_NOT_INITIALIZED";
    case platform_not_supported: return "CU_FILE_PLATFORM_NOT_SUPPORTED";
    case io_not_supported: return "CU_FILE_IO_NOT_SUPPORTED";
    case nvfs_driver_error: return "CU_FILE_NVFS_DRIVER_ERROR";
    case cuda_driver_error: return "CU_FILE_CUDA_DRIVER_ERROR";
    case invalid_value: return "CU_FILE_INVALID_VALUE";
    case handle_not_registered: return "CU_FILE_HANDLE_NOT_REGISTERED";
    case internal_error: return "CU_FILE_INTERNAL_ERROR";
    case async_not_supported: return "CU_FILE_ASYNC_NOT_SUPPORTED";
    default: return "CUfileOpError";
  }
}

namespace {
class category_t final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cufile"; }
  std::string message(int c) const override { return std::string(op_error_name(c)) + " (" + std::to_string(c) + ")"; }
};
const category_t cat;

std::string describe(status s) {
  std::string m = std::string(op_error_name(s.err)) + " (" + std::to_string(s.err) + ")";
  if (s.err == cuda_driver_error) m += ", CUresult " + std::to_string(static_cast<int>(s.cu_err));
  return m;
}

bool nvfs_loaded() {
  std::ifstream f("/proc/modules");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("nvidia_fs ", 0) == 0) return true;
  return false;
}

template <class F>
bool resolve(api& a, const char* name, F& fn) {
  fn = reinterpret_cast<F>(::dlsym(a.lib, name));
  return fn != nullptr;
}
}  // namespace

api load(const std::string& path) {
  api a;
  std::vector<std::string> tries;
  if (!path.empty()) {
    tries.push_back(path);
  } else {
    if (const char* e = std::getenv("SHUTTLE_CUFILE_LIB"); e && *e) tries.emplace_back(e);
    tries.insert(tries.end(), {"libcufile.so.0", "libcufile.so", "/usr/local/cuda/lib64/libcufile.so.0",
                               "/usr/local/cuda/lib64/libcufile.so"});
  }
  for (auto& t : tries) {
    a.lib = ::dlopen(t.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (a.lib) {
      a.path = t;
      break;
    }
    const char* e = ::dlerror();
    if (!a.error.empty()) a.error += "; ";
    a.error += e ? e : t + ": not found";
  }
  if (!a.lib) {
    a.error = "libcufile not found (" + a.error + ")";
    return a;
  }
  bool ok = resolve(a, "cuFileDriverOpen", a.driver_open) && resolve(a, "cuFileHandleRegister", a.handle_register) &&
            resolve(a, "cuFileHandleDeregister", a.handle_deregister) &&
            resolve(a, "cuFileReadAsync", a.read_async) && resolve(a, "cuFileWriteAsync", a.write_async);
  if (!resolve(a, "cuFileDriverClose_v2", a.driver_close)) resolve(a, "cuFileDriverClose", a.driver_close);
  resolve(a, "cuFileDriverGetProperties", a.driver_get_properties);
  resolve(a, "cuFileGetVersion", a.get_version);
  resolve(a, "cuFileSetParameterBool", a.set_parameter_bool);
  if (!ok) {
    a.error = a.path + " lacks the stream API (cuFileReadAsync, CUDA 12.2 or later)";
    ::dlclose(a.lib);
    a.lib = nullptr;
  }
  return a;
}

const driver_state& driver() {
  static api fns;
  static driver_state st;
  static std::once_flag once;
  std::call_once(once, [] {
    st.fns = &fns;
    st.nvfs = nvfs_loaded();
    fns = load();
    if (!fns.complete()) {
      st.why = fns.error;
      return;
    }
    // cuFile works in the CUDA context the runtime made current.
    if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {
      (void)cudaGetLastError();
      st.why = std::string("no CUDA context: ") + cudaGetErrorString(e);
      return;
    }
    // Before cuFileDriverOpen, as it must be. "force": POSIX I/O even where
    // cuFile would try another path (a kernel with PCI P2PDMA but a device
    // that cannot do it registers nothing otherwise).
    const std::string compat = std::getenv("SHUTTLE_CUFILE_COMPAT") ? std::getenv("SHUTTLE_CUFILE_COMPAT") : "";
    if ((compat == "1" || compat == "force") && fns.set_parameter_bool) {
      if (status p = fns.set_parameter_bool(param_allow_compat_mode, true); p.err != success)
        st.params = "cuFileSetParameterBool(allow_compat_mode): " + describe(p);
      if (compat == "force")
        if (status p = fns.set_parameter_bool(param_force_compat_mode, true); p.err != success)
          st.params += (st.params.empty() ? "" : "; ") + ("cuFileSetParameterBool(force_compat_mode): " + describe(p));
    }
    status s = fns.driver_open();
    if (s.err != success) {
      st.why = "cuFileDriverOpen: " + describe(s) + (st.params.empty() ? "" : " (" + st.params + ")");
      return;
    }
    st.ok = true;
  });
  return st;
}

}  // namespace shuttle::cuda::detail::cufile

namespace shuttle::cuda::detail {

namespace {
using namespace cufile;

std::error_code bytes_error(ssize_t n) {
  if (-n > 5000) return {static_cast<int>(-n), cat};
  return errno_code(static_cast<int>(-n));
}

constexpr std::size_t op_bytes = std::size_t{16} << 20;  // per enqueued operation: the granularity of a stop
constexpr unsigned window = 4;                          // operations enqueued ahead

struct op_slot {
  std::size_t size = 0;
  off_t file_offset = 0;
  off_t buf_offset = 0;
  ssize_t done = 0;
  std::optional<event> ev;
};

task<result<std::size_t>> transfer(gpu_file::impl& f, std::byte* gpu, std::uint64_t offset, std::size_t length,
                                   bool reading) {
  const api& a = *driver().fns;
  cudaStream_t s = *f.cufile_stream;
  std::vector<op_slot> slots(window);
  for (auto& sl : slots) sl.ev.emplace();
  std::stop_token token = co_await get_stop_token();
  const std::size_t n = (length + op_bytes - 1) / op_bytes;
  std::size_t issued = 0, finished = 0;
  std::uint64_t end = offset + length;  // lowered by a short read
  std::error_code err;
  // Awaits operation `i` (in order); every enqueued one is awaited, stop or not.
  auto finish = [&](std::size_t i) -> task<void> {
    op_slot& sl = slots[i % window];
    auto w = co_await unstoppable{cuda::wait(*sl.ev)};
    if (!w) {
      if (!err) err = w.error();
    } else if (sl.done < 0) {
      if (!err) err = bytes_error(sl.done);
    } else if (static_cast<std::size_t>(sl.done) < sl.size) {
      if (!reading && !err) err = errno_code(EIO);
      end = std::min<std::uint64_t>(end, offset + static_cast<std::uint64_t>(sl.buf_offset) +
                                             static_cast<std::uint64_t>(sl.done));
    }
  };
  while (issued < n && !err && !token.stop_requested() && offset + issued * op_bytes < end) {
    if (issued - finished == window) co_await finish(finished++);
    if (err) break;
    op_slot& sl = slots[issued % window];
    sl.buf_offset = static_cast<off_t>(issued * op_bytes);
    sl.file_offset = static_cast<off_t>(offset + issued * op_bytes);
    sl.size = std::min(op_bytes, length - issued * op_bytes);
    sl.done = 0;
    status st = reading ? a.read_async(f.cufile_handle, gpu, &sl.size, &sl.file_offset, &sl.buf_offset, &sl.done, s)
                        : a.write_async(f.cufile_handle, gpu, &sl.size, &sl.file_offset, &sl.buf_offset, &sl.done, s);
    if (st.err != success) {
      err = {st.err, cat};
      break;
    }
    sl.ev->record(s);
    ++issued;
  }
  while (finished < issued) co_await finish(finished++);
  if (err) co_return err;
  if (issued < n && token.stop_requested() && offset + issued * op_bytes < end)
    co_return std::make_error_code(std::errc::operation_canceled);
  co_return static_cast<std::size_t>(std::min<std::uint64_t>(end, offset + length) - offset);
}
}  // namespace

bool cufile_attach(gpu_file::impl& f, std::string& why) {
  const driver_state& d = cufile::driver();
  if (!d.ok) {
    why = d.why;
    return false;
  }
  descr_t descr{};
  descr.type = handle_type_opaque_fd;
  descr.handle.fd = f.dfd >= 0 ? f.dfd : f.fd;
  status s = d.fns->handle_register(&f.cufile_handle, &descr);
  if (s.err != success) {
    f.cufile_handle = nullptr;
    why = "cuFileHandleRegister: " + describe(s);
    if (!d.params.empty()) why += " (" + d.params + ")";
    if (!d.nvfs)
      why += "; nvidia-fs is not loaded: enable cuFile's compatibility mode (docs/gpu-file.md)";
    return false;
  }
  try {
    f.cufile_stream.emplace();
  } catch (const std::exception& e) {
    d.fns->handle_deregister(f.cufile_handle);
    f.cufile_handle = nullptr;
    why = e.what();
    return false;
  }
  return true;
}

void cufile_detach(gpu_file::impl& f) noexcept {
  if (!f.cufile_handle) return;
  if (f.cufile_stream) (void)cudaStreamSynchronize(*f.cufile_stream);
  cufile::driver().fns->handle_deregister(f.cufile_handle);
  f.cufile_handle = nullptr;
  f.cufile_stream.reset();
}

task<result<std::size_t>> cufile_read(gpu_file::impl& f, std::span<std::byte> gpu, std::uint64_t offset) {
  return transfer(f, gpu.data(), offset, gpu.size(), true);
}
task<result<std::size_t>> cufile_write(gpu_file::impl& f, std::span<const std::byte> gpu, std::uint64_t offset) {
  return transfer(f, const_cast<std::byte*>(gpu.data()), offset, gpu.size(), false);
}

}  // namespace shuttle::cuda::detail
