// Receiving with kernel-provided buffers (io_uring buffer rings) and
// multishot recv: one armed request per socket delivers every arrival into a
// buffer the kernel picks from a ring shared by many sockets. It pays where
// many connections mostly wait (a server with thousands of sockets holds
// ring buffers only for data that arrived, not one buffer per socket) and
// where one submission per message is worth saving. A stream holds at most
// a quota of the ring's buffers that its consumer has not taken
// (receive_stream_options): one stalled consumer cannot starve the others.
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

  // A stream drawing on this ring. The ring restarts one whose multishot
  // request ended for lack of buffers, and tells every one when it goes
  // (a cancelled request may still complete after its stream and the ring).
  struct starved {
    virtual void buffers_available() noexcept = 0;
    virtual void ring_destroyed() noexcept = 0;
    starved* next_starved = nullptr;
    bool is_starved = false;

   protected:
    ~starved() = default;
  };
  void attach(starved& s) { clients_.push_back(&s); }
  void detach(starved& s) noexcept;
  void wait_for_buffers(starved& s) noexcept;

 private:
  io_context& ctx_;
  io_uring_buf_ring* ring_ = nullptr;
  std::size_t ring_bytes_ = 0;
  std::vector<std::byte> storage_;
  std::size_t size_;
  unsigned count_;
  std::uint16_t group_;
  starved* starved_ = nullptr;
  std::vector<starved*> clients_;
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
  // yet. Past it the stream stops receiving (its multishot request is
  // cancelled; the data waits in the socket) until the consumer has taken
  // them all, so a consumer that stalls, or a peer that sends faster than
  // it is served, cannot empty a ring other streams share. The request
  // carries the quota as a byte limit (quota x buffer size; Linux 6.17+), so
  // partly filled buffers may overshoot it until the cancel lands; older
  // kernels only get the cancel, which lands after a burst of the kernel's
  // (up to the whole ring). 0: count() / 8 of the ring, at least 1.
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
