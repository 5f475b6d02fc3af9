// Receiving with kernel-provided buffers (io_uring buffer rings) and
// multishot recv: one armed request per socket delivers every arrival into a
// buffer the kernel picks from a ring shared by many sockets. It pays where
// many connections mostly wait (a server with thousands of sockets holds
// ring buffers only for data that arrived, not one buffer per socket) and
// where one submission per message is worth saving.
//
// Sharing: a stream receives ahead of its consumer only on buffers the ring
// promises it (a few at a time, at most its quota: receive_stream_options),
// and the ring promises none out of its reserve (count() / 8), which is kept
// for consumers waiting with nothing queued: these receive one buffer at a
// time. However many consumers stall, their queues hold at most the ring
// less its reserve, and a consumer that keeps taking its buffers keeps
// receiving. A ring that runs dry anyway (buffers held by consumers, a burst
// past a promise) is a normal state: the streams it stopped wait their turn,
// first come first served, and restart as buffers come back. Buffers a
// consumer has taken are its own until it drops them: hold one no longer
// than it takes to use it (copy the data out before a long wait).
//
// Sizing: a stream that keeps up is promised 2 buffers at a time, so a ring
// of at least 2 x connections + count() / 8 lets every busy stream keep a
// multishot request armed. A smaller ring still serves everyone, but the
// streams it cannot promise receive one buffer per submission, so busy
// connections make fewer round trips (docs/measurements.md, 2026-12-05).
//
//   buffer_ring ring(ctx, 1024, 16384);           // per io_context
//   receive_stream rx(sock, ring);
//   while (auto buf = co_await rx.next()) {        // result<provided_buffer>
//     if (buf->empty()) break;                     // peer closed
//     ...buf->data()...                            // returned to the ring when buf dies
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include <shuttle/detail/io_op.hpp>
#include <shuttle/detail/wait_list.hpp>
#include <shuttle/result.hpp>
#include <shuttle/tcp.hpp>

namespace shuttle {

// A ring of equal buffers registered with one io_context's io_uring.
class buffer_ring {
 public:
  // `count` must be a power of two (<= 32768).
  buffer_ring(io_context& ctx, unsigned count, std::size_t buffer_size);
  ~buffer_ring();
  buffer_ring(const buffer_ring&) = delete;
  buffer_ring& operator=(const buffer_ring&) = delete;

  std::uint16_t group() const noexcept { return group_; }
  std::size_t buffer_size() const noexcept { return size_; }
  unsigned count() const noexcept { return count_; }
  std::byte* buffer(unsigned id) noexcept { return storage_.data() + std::size_t(id) * size_; }
  // Gives buffer `id` back to the kernel, and restarts a stream that found
  // the ring empty.
  void recycle(unsigned id) noexcept;

  // Buffers in the kernel's hands (neither received into nor held).
  unsigned available() const noexcept { return free_; }
  // Buffers no stream is promised for receiving ahead of its consumer.
  unsigned reserve() const noexcept { return reserve_; }

  // The share-out, for receive_stream (lib/receive_stream.cpp says how).
  struct client {
    // The ring has buffers again: true when the client re-armed, so it
    // takes one of them.
    virtual bool buffers_available() noexcept = 0;
    virtual void ring_destroyed() noexcept = 0;
    client* next_waiting = nullptr;
    bool waiting = false;

   protected:
    ~client() = default;
  };
  void attach(client& c) { clients_.push_back(&c); }
  void detach(client& c) noexcept;
  // `c` found the ring dry: wake it when a buffer comes back, in arrival
  // order (`first`: ahead of the others, it lost a buffer it was woken for).
  void wait_for_buffers(client& c, bool first = false) noexcept;
  void stop_waiting(client& c) noexcept;
  // Promises up to `want` buffers out of what is free beyond the promises
  // made and the reserve; 0 when there is nothing to promise.
  unsigned promise(unsigned want) noexcept;
  void unpromise(unsigned n) noexcept { promised_ -= n; }
  // A completion carried one of the ring's buffers (against a promise or not).
  void taken(bool promised) noexcept {
    --free_;
    if (promised) --promised_;
  }
  // The most a stream is promised at once, so that many streams share.
  unsigned promise_limit() const noexcept { return promise_limit_; }

 private:
  void serve_waiters() noexcept;

  io_context& ctx_;
  io_uring_buf_ring* ring_ = nullptr;
  std::size_t ring_bytes_ = 0;
  std::vector<std::byte> storage_;
  std::size_t size_;
  unsigned count_;
  std::uint16_t group_;
  unsigned free_;
  unsigned promised_ = 0;
  unsigned reserve_;
  unsigned promise_limit_;
  client* first_waiting_ = nullptr;
  client* last_waiting_ = nullptr;
  bool serving_ = false;
  std::vector<client*> clients_;
};

// Bytes received into a ring buffer; the buffer returns to the ring when
// this is destroyed. Empty (size 0) means the peer closed its side.
class provided_buffer {
 public:
  provided_buffer() noexcept = default;
  provided_buffer(buffer_ring* ring, unsigned id, std::size_t len) noexcept : ring_(ring), id_(id), len_(len) {}
  provided_buffer(provided_buffer&& o) noexcept
      : ring_(std::exchange(o.ring_, nullptr)), id_(o.id_), len_(std::exchange(o.len_, 0)) {}
  provided_buffer& operator=(provided_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ring_ = std::exchange(o.ring_, nullptr);
      id_ = o.id_;
      len_ = std::exchange(o.len_, 0);
    }
    return *this;
  }
  ~provided_buffer() { reset(); }

  std::span<const std::byte> data() const noexcept {
    return ring_ ? std::span<const std::byte>(ring_->buffer(id_), len_) : std::span<const std::byte>();
  }
  std::size_t size() const noexcept { return len_; }
  bool empty() const noexcept { return len_ == 0; }
  void reset() noexcept {
    if (ring_) std::exchange(ring_, nullptr)->recycle(id_);
  }

 private:
  buffer_ring* ring_ = nullptr;
  unsigned id_ = 0;
  std::size_t len_ = 0;
};

struct receive_stream_options {
  // Ring buffers the stream may hold with data that next() has not taken
  // yet. Past it the stream stops receiving (the data waits in the socket)
  // until the consumer has taken them all, so a consumer that stalls, or a
  // peer that sends faster than it is served, cannot empty a ring other
  // streams share. The ring also caps what all streams together may hold
  // ahead of their consumers (see buffer_ring above). A request carries its
  // promise as a byte limit (Linux 6.17+) and is cancelled once it has used
  // the promised buffers: partly filled buffers may overshoot a promise
  // until the cancel lands (the ring's reserve absorbs that); older kernels
  // only get the cancel, which lands after a burst of the kernel's (up to
  // the whole ring). 0: count() / 8 of the ring, at least 1.
  unsigned max_queued = 0;
};

// Multishot recv on one socket into a buffer_ring. The socket and the ring
// must outlive the stream, and no next() may be pending when it is
// destroyed; destroying it cancels the request.
class receive_stream {
 public:
  receive_stream(tcp_socket& socket, buffer_ring& ring, receive_stream_options options = {});
  ~receive_stream();
  receive_stream(const receive_stream&) = delete;
  receive_stream& operator=(const receive_stream&) = delete;

  class next_awaiter;
  // co_await rx.next(): result<provided_buffer>; an empty buffer at EOF.
  next_awaiter next() noexcept;

  // Ring buffers received and not yet taken by next().
  std::size_t queued() const noexcept;

  struct state;

 private:
  state* s_;
};

class receive_stream::next_awaiter {
 public:
  explicit next_awaiter(state* s) noexcept : s_(s) {}
  bool await_ready() noexcept;
  template <class P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return park(h, detail::stop_token_of(h));
  }
  result<provided_buffer> await_resume();

 private:
  bool park(std::coroutine_handle<> h, std::stop_token token);
  state* s_;
  detail::wait_node node_;
};

inline receive_stream::next_awaiter receive_stream::next() noexcept { return next_awaiter{s_}; }

}  // namespace shuttle
