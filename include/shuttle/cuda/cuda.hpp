// The CUDA layer: RAII device memory, pinned host memory, streams and events,
// and awaitables that let a coroutine wait for GPU work inside the io_context
// without blocking the loop and without a thread per wait:
//
//   co_await cuda::wait(ev);      // result<void>: the event completed
//   co_await cuda::wait(stream);  // records an event on the stream, awaits it
//
// How a wait is noticed (wait_options::mechanism; lib/cuda/await.cpp;
// docs/cuda-waits.md; docs/measurements.md keeps the dated measurements
// that chose the default). The default, hybrid, polls with cudaEventQuery
// and sleeps on a clock, not on a callback: polling an event wakes as fast
// as a thread spinning in cudaEventSynchronize, while CUDA's host-function
// callback path can wake tens of microseconds late.
//
//  - while the youngest pending wait is younger than `spin`, the thread's
//    wait poller (a shuttle::poller) queries every pending event on each
//    turn of the loop. When the ring has been quiet for a while (no
//    completion for 20 us, nothing to submit) poll() keeps re-querying for
//    up to 5 us before handing the turn back, so the wake-up does not wait
//    for an io_uring_enter and the loop makes fewer syscalls; a busy ring is
//    never held up by it;
//  - past `spin` the pending waits are queried once per slice, (age of the
//    youngest) / `sleep_divisor` clamped to [10 us, 1 ms], so a wait is
//    noticed within a fixed fraction of its length at a cost that grows
//    with the logarithm of it: on a turn of the loop while the ring is busy
//    (a staged transfer's sockets, whose CPU a query on every turn would
//    take), from a ring timeout once the ring is quiet; then the poller
//    leaves the loop's poll list and the loop sleeps in io_uring. A new wait
//    puts the poller back on the poll list.
//
// host_func (a host function on an auxiliary stream, cudaStreamWaitEvent +
// cudaLaunchHostFunc, writes an eventfd the loop watches) remains available;
// it never calls CUDA from the callback, never blocks CUDA's callback thread
// and is not placed in the user's stream, so it never delays later work.
//
// Stream-ordered network operations (an RDMA write posted when a stream
// reaches a point): cuda/ordered.hpp, write_after and friends.
//
// A completion made visible to a stream: cuda::stream_flag is a word in
// mapped pinned memory; flag.enqueue_wait(stream, v) makes the stream wait
// (cuStreamWaitValue32, GEQ) until the loop calls flag.set(v), so a consumer
// kernel can be enqueued before its data has arrived.
//
// Everything here is loop-thread code except where noted; CUDA calls use the
// device current on the calling thread.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <system_error>
#include <utility>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/detail/loop_cancel.hpp>
#include <shuttle/result.hpp>
#include <shuttle/task.hpp>

namespace shuttle {
class io_context;
}

namespace shuttle::cuda {

// ------------------------------------------------------------------ errors

// The 'cuda' category: values are cudaError_t, messages cudaGetErrorString.
const std::error_category& category() noexcept;
inline std::error_code make_error_code(cudaError_t e) noexcept { return {static_cast<int>(e), category()}; }
// The 'cuda-driver' category: values are CUresult.
const std::error_category& driver_category() noexcept;
// Throws std::system_error (category()) when e != cudaSuccess.
void check(cudaError_t e, const char* what);

// Devices the runtime can use: 0 without a driver or a GPU (never throws).
int device_count() noexcept;
// A one-line description of device `dev` ("NVIDIA H200, sm_90, 139.8 GiB, PCI 0000:1a:00.0").
std::string describe_device(int dev);

// ------------------------------------------------------------------ memory

// Device memory (cudaMalloc on the current device).
class device_buffer {
 public:
  device_buffer() noexcept = default;
  explicit device_buffer(std::size_t bytes);  // throws std::system_error
  ~device_buffer() { reset(); }
  device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  template <class T>
  T* as() const noexcept {
    return reinterpret_cast<T*>(p_);
  }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  void reset() noexcept;

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

// Page-locked host memory, portable and mapped into the device address space
// (cudaHostAlloc(Portable | Mapped)): DMA source and target at full speed,
// and what the staged path hands the transport.
class pinned_buffer {
 public:
  pinned_buffer() noexcept = default;
  explicit pinned_buffer(std::size_t bytes);  // throws std::system_error
  ~pinned_buffer() { reset(); }
  pinned_buffer(pinned_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  std::span<std::byte> span() const noexcept { return {p_, n_}; }
  // The device-side address of this memory (cudaHostGetDevicePointer).
  void* device_pointer() const;
  explicit operator bool() const noexcept { return p_ != nullptr; }
  void reset() noexcept;

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

// ------------------------------------------------------------------ streams and events

class stream {
 public:
  // A non-blocking stream (no implicit synchronisation with stream 0).
  stream();  // throws
  explicit stream(int priority);
  ~stream() { reset(); }
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  cudaStream_t get() const noexcept { return s_; }
  operator cudaStream_t() const noexcept { return s_; }  // NOLINT: a handle
  void synchronize() const;                              // blocking; for set-up and tests
  void reset() noexcept;

 private:
  cudaStream_t s_ = nullptr;
};

class event {
 public:
  // cudaEventDisableTiming unless `timing`.
  explicit event(bool timing = false);  // throws
  ~event() { reset(); }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  cudaEvent_t get() const noexcept { return e_; }
  operator cudaEvent_t() const noexcept { return e_; }  // NOLINT: a handle
  void record(cudaStream_t s) const;
  bool query() const;  // true once complete; throws on an error
  void reset() noexcept;

 private:
  cudaEvent_t e_ = nullptr;
};

// ------------------------------------------------------------------ awaiting

// How the thread's wait poller notices completions.
enum class wait_mechanism {
  hybrid,       // cudaEventQuery on every loop turn for `spin`, then timed polls from the ring (the loop sleeps)
  event_query,  // cudaEventQuery on every loop turn; the loop never sleeps while a wait is pending
  host_func,    // a host function writes an eventfd the loop watches; the loop sleeps until then
};
const char* to_string(wait_mechanism m) noexcept;

struct wait_options {
  wait_mechanism mechanism = wait_mechanism::hybrid;
  // hybrid: how long after the youngest wait began the loop keeps polling
  // on every turn before it sleeps between timed polls.
  std::chrono::nanoseconds spin = std::chrono::microseconds(50);
  // hybrid: a sleeping poller queries again after (age of the youngest
  // wait) / sleep_divisor, clamped to [10 us, 1 ms]: the wake-up comes at
  // most about 1/sleep_divisor of the wait late.
  unsigned sleep_divisor = 16;
};
// Per thread; applies to waits that start afterwards.
void set_wait_options(const wait_options& o) noexcept;
wait_options get_wait_options() noexcept;

struct wait_stats {
  std::uint64_t waits = 0;        // awaits that suspended
  std::uint64_t immediate = 0;    // awaits whose event was already complete
  std::uint64_t queries = 0;      // cudaEventQuery calls by the poller
  std::uint64_t host_funcs = 0;   // host functions armed (host_func)
  std::uint64_t wakeups = 0;      // eventfd wake-ups of the loop (host_func)
  std::uint64_t timed_polls = 0;  // ring timeouts that woke the poller (hybrid, past `spin`)
  std::uint64_t cancelled = 0;
};
wait_stats get_wait_stats() noexcept;  // this thread's
void reset_wait_stats() noexcept;

namespace detail {
class wait_poller;
struct wait_node : shuttle::detail::loop_cancel<wait_node> {
  struct cancel_callback {
    wait_node* self;
    void operator()() const noexcept;
  };
  cudaEvent_t ev = nullptr;
  std::coroutine_handle<> waiter{};
  wait_poller* poller = nullptr;  // non-null while queued
  wait_node* prev = nullptr;
  wait_node* next = nullptr;
  wait_node* ready_next = nullptr;
  shuttle::io_context* ctx = nullptr;
  std::optional<std::stop_callback<cancel_callback>> stop_cb;
  std::chrono::steady_clock::time_point since{};
  cudaStream_t aux = nullptr;  // the auxiliary stream of an armed host function
  cudaError_t status = cudaSuccess;
  bool cancelled = false;

  // For loop_cancel, on the loop: leaves the poller unless it finished
  // first; drops a reference and posts the waiter if it was the last.
  void cancel_here() noexcept;
  void release() noexcept;
};
// Queues `n` on the calling thread's poller; false when finished without
// suspending (already complete, failed or cancelled).
bool park(wait_node& n, std::coroutine_handle<> h, std::stop_token token);
void note_immediate() noexcept;
cudaEvent_t pooled_event();
void return_pooled_event(cudaEvent_t e) noexcept;
}  // namespace detail

// co_await: result<void>; a failed event yields its cudaError_t, a stop
// request std::errc::operation_canceled (the GPU work itself goes on).
class event_awaiter {
 public:
  explicit event_awaiter(cudaEvent_t e) noexcept { node_.ev = e; }
  event_awaiter(const event_awaiter&) = delete;
  event_awaiter& operator=(const event_awaiter&) = delete;
  event_awaiter(event_awaiter&& o) noexcept { node_.ev = o.node_.ev; }

  bool await_ready() noexcept {
    node_.status = cudaEventQuery(node_.ev);
    if (node_.status == cudaErrorNotReady) return false;
    detail::note_immediate();
    return true;
  }
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return detail::park(node_, h, shuttle::detail::stop_token_of(h));
  }
  result<void> await_resume() const noexcept {
    if (node_.cancelled) return std::make_error_code(std::errc::operation_canceled);
    if (node_.status != cudaSuccess) return make_error_code(node_.status);
    return {};
  }

 protected:
  detail::wait_node node_;
};

// Records a pooled event on the stream when constructed, awaits it.
class stream_awaiter : public event_awaiter {
 public:
  explicit stream_awaiter(cudaStream_t s) : event_awaiter(detail::pooled_event()) {
    record_status_ = cudaEventRecord(node_.ev, s);
  }
  stream_awaiter(stream_awaiter&& o) noexcept : event_awaiter(std::move(o)), record_status_(o.record_status_) {
    o.node_.ev = nullptr;
  }
  ~stream_awaiter() {
    if (node_.ev) detail::return_pooled_event(node_.ev);
  }
  bool await_ready() noexcept {
    if (record_status_ != cudaSuccess) {
      node_.status = record_status_;
      return true;
    }
    return event_awaiter::await_ready();
  }

 private:
  cudaError_t record_status_ = cudaSuccess;
};

inline event_awaiter wait(cudaEvent_t e) noexcept { return event_awaiter{e}; }
inline stream_awaiter wait(cudaStream_t s) { return stream_awaiter{s}; }
inline event_awaiter wait(const event& e) noexcept { return event_awaiter{e.get()}; }
inline stream_awaiter wait(const stream& s) { return stream_awaiter{s.get()}; }

// ------------------------------------------------------------------ stream-visible flags

// A 32-bit word in mapped pinned host memory through which the loop orders
// GPU work: enqueue_wait(s, v) makes stream `s` wait until the word is >= v
// (cuStreamWaitValue32 GEQ, wrap-aware for monotonically increasing values
// below 2^31 apart), set(v) is the host's release store. write_from(s, v)
// enqueues a cuStreamWriteValue32 of v (the stream tells the host).
class stream_flag {
 public:
  stream_flag();  // throws
  ~stream_flag();
  stream_flag(const stream_flag&) = delete;
  stream_flag& operator=(const stream_flag&) = delete;

  // flush_remote_writes: add CU_STREAM_WAIT_VALUE_FLUSH where the device
  // supports it, so that GPUDirect RDMA writes that arrived before the flag
  // are visible to the work after the wait (needed only where the device's
  // GPU_DIRECT_RDMA_WRITES_ORDERING is below OWNER; see gpu_memory.hpp).
  result<void> enqueue_wait(cudaStream_t s, std::uint32_t value, bool flush_remote_writes = false) const;
  result<void> write_from(cudaStream_t s, std::uint32_t value) const;
  void set(std::uint32_t v) noexcept { std::atomic_ref<std::uint32_t>(*word_).store(v, std::memory_order_release); }
  std::uint32_t load() const noexcept { return std::atomic_ref<std::uint32_t>(*word_).load(std::memory_order_acquire); }

 private:
  std::uint32_t* word_ = nullptr;
  unsigned long long dev_ = 0;
};

// Driver-API capabilities used by the layer, found at run time.
struct driver_features {
  bool stream_mem_ops = false;       // cuStreamWaitValue32 / cuStreamWriteValue32
  bool flush_remote_writes = false;  // CU_STREAM_WAIT_VALUE_FLUSH
  bool dmabuf_export = false;        // cuMemGetHandleForAddressRange (entry point and device attribute)
  int driver_version = 0;            // cudaDriverGetVersion
};
driver_features features(int device = -1);  // -1: the current device

}  // namespace shuttle::cuda
