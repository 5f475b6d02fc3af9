// The verbs provider: rdma-core (libibverbs + librdmacm) on the io_uring loop.
//
// This header: the constants and helpers of every verbs file. The files, one
// per verbs object, are listed in docs/architecture.md; the pieces below name
// them.
//
// Pieces:
//  - core (core.hpp): one device context, its protection domain, one completion channel
//    and one CQ shared by every QP of the domain. The CQ is a poller of the
//    loop (hybrid policy: busy-polled while work is in flight, for up to the
//    domain's budget after the last completion; then ibv_req_notify_cq, poll
//    once more to close the re-arm race, and sleep with the channel fd
//    watched by an IORING_OP_POLL_ADD; CQ events are acked in batches).
//  - conn_state (conn_state.hpp): one RC QP set up through rdma_cm, with its own event channel
//    whose fd the loop watches; receive pool kept posted; send-queue slots and
//    receive credits as loop-local semaphores; a dying state stays in the
//    core's graveyard until every posted WR came back (flushed), so no work
//    completion ever names freed memory. Its receive side (completions,
//    buffers released and reposted) is in receive.cpp.
//  - operations (operations.hpp): one signaled WR each, whose wr_id is a wr_ctx kept in the
//    awaiting frame (connection_op.hpp); the awaiter resumes (through
//    io_context::post) when its completion is reaped. Inline sends instead
//    complete once posted, unsignaled but for one settling WR per quarter of
//    the send queue (conn_state::settle). Cancellation moves the QP to error
//    and waits for the flushed completion (NIC-safe).
//  - credits: each side starts with the peer's posted receive count. Freed
//    receive buffers are reposted and returned to the peer piggybacked on
//    sends (SEND_WITH_IMM, imm = credits) or, in batches, by a zero-length
//    control message to a few reserved extra receives.
//  - shared receive queue (connection_options::shared_receive_queue): one
//    ibv_srq per core, created by the first such connection; its pool of
//    buffers grows so that it always holds the sum of the live connections'
//    grants (receive_buffers + the control reserve), which is what their
//    peers may consume: credits keep RNR impossible. A receive completion
//    names its QP (wc.qp_num -> connection); the freed buffer goes back to
//    the SRQ and the credit to that connection.
//  - batches (batches.hpp, post_batch): chunks of chained WRs, one ibv_post_send each,
//    only the last WR signaled; the chunk holds its send-queue slots until
//    that completion. Unsignaled WRs name the chunk's `early` context, which
//    only ever sees error/flush completions (they come before the chunk's
//    signaled one, RC completes in order).
//  - the connection (connection.hpp: the connection_impl; grant.hpp: its
//    memory windows) and the listener (listener.hpp).
#pragma once

#include "../spin_clock.hpp"
#include "../transport/provider.hpp"
#include "cm_events.hpp"
#include "fd_watch.hpp"
#include "registration.hpp"
#include "device.hpp"
#include <shuttle/detail/loop_cancel.hpp>
#include <shuttle/io_context.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/timer.hpp>
#include <shuttle/verbs/verbs.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <vector>

namespace shuttle::detail::verbs_impl {


constexpr std::uint32_t ctrl_reserve = 2;            // extra receives (and send slots) for credit messages
constexpr std::uint32_t ctrl_flag = 0x80000000u;     // imm of a control message
// A connection posts this many user receives at first (the peer's initial
// credits, announced in the hello) and doubles them as messages arrive, up
// to receive_buffers; each receive added is a credit for the peer once it
// is posted. A peer that connects and sends nothing holds this one and the
// control receives, not the pool. Operations post in call order however
// short credits run (post_order).
constexpr std::uint32_t initial_receives = 1;
// RNR retries of this side's QPs (and what it asks of the peer's): credits
// keep receives posted ahead of sends, so an RNR NAK means a peer that does
// not post what it announced; 7 would retry forever.
constexpr std::uint8_t rnr_retries = 3;
constexpr unsigned ack_batch = 64;

inline std::error_code last_errno() noexcept { return errno_code(errno ? errno : EIO); }
inline std::error_code disconnected() noexcept { return make_error_code(errc::disconnected); }

// The failing operation's error. The neutral API promises
// errc::remote_access_error for a refused one-sided access, and callers (the
// conformance suite) compare error_codes strictly, so that status is returned
// in shuttle's category; every other status keeps its verbs code (message:
// ibv_wc_status_str), equivalent to the neutral conditions.
inline std::error_code wc_error(ibv_wc_status s) noexcept {
  if (s == IBV_WC_REM_ACCESS_ERR) return make_error_code(errc::remote_access_error);
  return verbs::make_wc_error(s);
}

inline bool set_nonblock(int fd) noexcept {
  int fl = fcntl(fd, F_GETFL);
  return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

// The target of a WR: work completions carry its address as wr_id.
struct wr_ctx {
  void (*on_wc)(wr_ctx* self, const ibv_wc& wc) noexcept = nullptr;
};

struct conn_state;
struct core;
struct verbs_grant;

}  // namespace shuttle::detail::verbs_impl
