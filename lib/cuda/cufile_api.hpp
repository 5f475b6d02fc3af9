// The part of cuFile (GPUDirect Storage, libcufile from the CUDA Toolkit)
// that gpu_file uses, declared here with the ABI of CUDA 13's cufile.h so
// that shuttle builds without it and loads the library with dlopen only
// where it exists. tests/gpu/cufile_abi.cpp compiles these declarations
// against the real header, where one is installed, and checks that sizes,
// offsets and values agree.
#pragma once

#include <cuda.h>  // CUresult, CUstream

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace shuttle::cuda::detail::cufile {

// CUfileOpError: 0, or 5000 + a small number.
enum op_error : int {
  success = 0,
  driver_not_initialized = 5001,
  platform_not_supported = 5007,
  io_not_supported = 5008,
  nvfs_driver_error = 5010,
  cuda_driver_error = 5011,
  invalid_value = 5022,
  handle_not_registered = 5027,
  internal_error = 5030,
  async_not_supported = 5038,
};
const char* op_error_name(int e) noexcept;

struct status {  // CUfileError_t
  int err;        // CUfileOpError (an enum: int-sized)
  CUresult cu_err;
};

constexpr int handle_type_opaque_fd = 1;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD

struct descr_t {  // CUfileDescr_t
  int type;       // enum CUfileFileHandleType
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;  // const CUfileFSOps_t*
};

using handle_t = void*;  // CUfileHandle_t

constexpr int param_allow_compat_mode = 1;  // CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE
constexpr int param_force_compat_mode = 2;  // CUFILE_PARAM_FORCE_COMPAT_MODE

struct drv_props_t {  // CUfileDrvProps_t
  struct {
    unsigned int major_version;
    unsigned int minor_version;
    std::size_t poll_thresh_size;
    std::size_t max_direct_io_size;
    unsigned int dstatusflags;
    unsigned int dcontrolflags;
  } nvfs;
  unsigned int fflags;
  unsigned int max_device_cache_size;
  unsigned int per_buffer_cache_size;
  unsigned int max_device_pinned_mem_size;
  unsigned int max_batch_io_size;
  unsigned int max_batch_io_timeout_msecs;
};

// The entry points, resolved from the loaded library; null where absent.
struct api {
  void* lib = nullptr;
  std::string path;   // what was loaded
  std::string error;  // why nothing was (dlerror), when lib is null
  status (*driver_open)() = nullptr;
  status (*driver_close)() = nullptr;
  status (*driver_get_properties)(drv_props_t*) = nullptr;
  status (*get_version)(int*) = nullptr;
  status (*set_parameter_bool)(int, bool) = nullptr;
  status (*handle_register)(handle_t*, descr_t*) = nullptr;
  void (*handle_deregister)(handle_t) = nullptr;
  status (*read_async)(handle_t, void*, std::size_t*, off_t*, off_t*, ssize_t*, CUstream) = nullptr;
  status (*write_async)(handle_t, void*, std::size_t*, off_t*, off_t*, ssize_t*, CUstream) = nullptr;
  bool complete() const noexcept {
    return lib && driver_open && handle_register && handle_deregister && read_async && write_async;
  }
};

// Loads the library from `path`, or from the first of SHUTTLE_CUFILE_LIB,
// libcufile.so.0, libcufile.so, /usr/local/cuda/lib64/libcufile.so.0 that
// opens when `path` is empty. Never throws; a missing library or entry
// point leaves lib null (closed) and says why in `error`.
api load(const std::string& path = {});

// The process's library and driver, opened once (thread-safe): cuFileDriverOpen
// after the CUDA context exists. ok is false with the reason in `why`.
struct driver_state {
  const api* fns = nullptr;
  bool ok = false;
  bool nvfs = false;  // the nvidia-fs module is loaded (true GDS; else compatibility mode at best)
  std::string why;
  std::string params;  // SHUTTLE_CUFILE_COMPAT's cuFileSetParameterBool calls that failed
};
const driver_state& driver();

}  // namespace shuttle::cuda::detail::cufile
