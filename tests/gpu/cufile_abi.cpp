// Checks lib/cuda/cufile_api.hpp, shuttle's own declarations of cuFile,
// against NVIDIA's cufile.h: built only where that header is installed
// (meson: has_header), and a build is the test (static_asserts); the
// program itself prints what it compared.
#include <cufile.h>

#include "../../lib/cuda/cufile_api.hpp"

#include <cstddef>
#include <cstdio>
#include <tuple>
#include <type_traits>

namespace cf = shuttle::cuda::detail::cufile;

static_assert(sizeof(cf::status) == sizeof(CUfileError_t));
static_assert(offsetof(cf::status, err) == offsetof(CUfileError_t, err));
static_assert(offsetof(cf::status, cu_err) == offsetof(CUfileError_t, cu_err));
static_assert(sizeof(CUfileOpError) == sizeof(int));

static_assert(sizeof(cf::descr_t) == sizeof(CUfileDescr_t));
static_assert(offsetof(cf::descr_t, type) == offsetof(CUfileDescr_t, type));
static_assert(offsetof(cf::descr_t, handle) == offsetof(CUfileDescr_t, handle));
static_assert(offsetof(cf::descr_t, fs_ops) == offsetof(CUfileDescr_t, fs_ops));
static_assert(int{cf::handle_type_opaque_fd} == int{CU_FILE_HANDLE_TYPE_OPAQUE_FD});
static_assert(std::is_same_v<cf::handle_t, CUfileHandle_t>);

static_assert(sizeof(cf::drv_props_t) == sizeof(CUfileDrvProps_t));
static_assert(offsetof(cf::drv_props_t, fflags) == offsetof(CUfileDrvProps_t, fflags));
static_assert(offsetof(cf::drv_props_t, max_batch_io_timeout_msecs) ==
              offsetof(CUfileDrvProps_t, max_batch_io_timeout_msecs));

static_assert(int{cf::success} == int{CU_FILE_SUCCESS});
static_assert(int{cf::driver_not_initialized} == int{CU_FILE_DRIVER_NOT_INITIALIZED});
static_assert(int{cf::platform_not_supported} == int{CU_FILE_PLATFORM_NOT_SUPPORTED});
static_assert(int{cf::io_not_supported} == int{CU_FILE_IO_NOT_SUPPORTED});
static_assert(int{cf::nvfs_driver_error} == int{CU_FILE_NVFS_DRIVER_ERROR});
static_assert(int{cf::cuda_driver_error} == int{CU_FILE_CUDA_DRIVER_ERROR});
static_assert(int{cf::invalid_value} == int{CU_FILE_INVALID_VALUE});
static_assert(int{cf::handle_not_registered} == int{CU_FILE_HANDLE_NOT_REGISTERED});
static_assert(int{cf::internal_error} == int{CU_FILE_INTERNAL_ERROR});
static_assert(int{cf::async_not_supported} == int{CU_FILE_ASYNC_NOT_SUPPORTED});
static_assert(cf::param_allow_compat_mode == int{CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE});
static_assert(cf::param_force_compat_mode == int{CUFILE_PARAM_FORCE_COMPAT_MODE});

// The entry points: the same parameters (the structs above stand for
// theirs), the same return layout.
template <class F>
struct sig;
template <class R, class... A>
struct sig<R (*)(A...)> {
  using params = std::tuple<A...>;
};
template <class F, class G>
constexpr bool same_params = std::is_same_v<typename sig<F>::params, typename sig<G>::params>;
using api = cf::api;

static_assert(same_params<decltype(&cuFileDriverOpen), decltype(api::driver_open)>);
static_assert(std::is_same_v<decltype(&cuFileHandleRegister), CUfileError_t (*)(CUfileHandle_t*, CUfileDescr_t*)>);
static_assert(std::is_same_v<decltype(api::handle_register), cf::status (*)(cf::handle_t*, cf::descr_t*)>);
static_assert(std::is_same_v<decltype(&cuFileHandleDeregister), decltype(api::handle_deregister)>);
static_assert(same_params<decltype(&cuFileReadAsync), decltype(api::read_async)>);
static_assert(same_params<decltype(&cuFileWriteAsync), decltype(api::write_async)>);
static_assert(std::is_same_v<decltype(&cuFileDriverGetProperties), CUfileError_t (*)(CUfileDrvProps_t*)>);
static_assert(std::is_same_v<decltype(api::driver_get_properties), cf::status (*)(cf::drv_props_t*)>);
static_assert(same_params<decltype(&cuFileGetVersion), decltype(api::get_version)>);
static_assert(std::is_same_v<decltype(&cuFileSetParameterBool), CUfileError_t (*)(CUFileBoolConfigParameter_t, bool)>);
static_assert(std::is_same_v<decltype(api::set_parameter_bool), cf::status (*)(int, bool)>);

int main() {
  std::printf("cufile_abi: shuttle's cuFile declarations match cufile.h (checked at compile time)\n");
  return 0;
}
