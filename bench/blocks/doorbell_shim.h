// What the doorbell shim (doorbell_shim.cpp, LD_PRELOAD) has counted in
// this process so far: the calls to write() on a uverbs command fd
// (/dev/infiniband/uverbsN) and the nanoseconds spent inside them
// (CLOCK_MONOTONIC around the real write), split into the POST_SEND
// commands (Soft-RoCE's doorbell: librxe rings it after queueing a chain,
// see doorbell_shim.cpp) and every other command written there
// (ibv_resize_cq, ibv_req_notify_cq, ...). blocks_bench finds the function
// with dlsym(RTLD_DEFAULT, "shuttle_doorbell_read"): present only when the
// shim is preloaded.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct shuttle_doorbell_counts {
  uint64_t post_send_calls;
  uint64_t post_send_ns;
  uint64_t other_calls;  // other uverbs commands written (not doorbells)
  uint64_t other_ns;
};

typedef void (*shuttle_doorbell_read_fn)(struct shuttle_doorbell_counts*);

void shuttle_doorbell_read(struct shuttle_doorbell_counts* out);

#ifdef __cplusplus
}
#endif
