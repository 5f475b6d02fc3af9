// The shared-memory rings (ring.hpp).
#include "ring.hpp"

#include "shared_memory.hpp"
#include "stats.hpp"

#include "../tcp_provider/conn_state.hpp"

#include <sys/mman.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace shuttle::detail {
namespace {
thread_local std::uint64_t ring_pipes = 0, ring_bytes_out = 0;  // a connection belongs to one thread
}
std::uint64_t local_ring_pipes() noexcept { return ring_pipes; }
std::uint64_t local_ring_bytes() noexcept { return ring_bytes_out; }
}  // namespace shuttle::detail

namespace shuttle::detail::local_provider {

namespace {

constexpr std::uint64_t cap = ring_capacity;
static_assert((cap & (cap - 1)) == 0);

std::uint64_t load(const std::uint64_t* p) noexcept {
  return std::atomic_ref<const std::uint64_t>(*p).load(std::memory_order_acquire);
}
void publish(std::uint64_t* p, std::uint64_t v) noexcept {
  std::atomic_ref<std::uint64_t>(*p).store(v, std::memory_order_release);
}

// One direction, as this side sees it.
struct ring_view {
  std::uint64_t* tail;
  std::uint32_t* producer_sleeping;
  std::uint64_t* head;
  std::uint32_t* consumer_sleeping;
  std::byte* data;
  ring_view(std::byte* base, int i) noexcept {
    std::byte* r = base + static_cast<std::size_t>(i) * (ring_ctl + ring_capacity);
    tail = reinterpret_cast<std::uint64_t*>(r + ring_tail);
    producer_sleeping = reinterpret_cast<std::uint32_t*>(r + ring_producer_sleeping);
    head = reinterpret_cast<std::uint64_t*>(r + ring_head);
    consumer_sleeping = reinterpret_cast<std::uint32_t*>(r + ring_consumer_sleeping);
    data = r + ring_ctl;
  }
};

// Takes a sleeper's flag: true if it was set (then we ring).
bool take_flag(std::uint32_t* f) noexcept {
  std::atomic_ref<std::uint32_t> a(*f);
  return a.load(std::memory_order_relaxed) != 0 && a.exchange(0, std::memory_order_relaxed) != 0;
}
// Relaxed: the order that matters (our flag before our next look at the
// peer's index) is the seq_cst fence's in arm_reader/arm_writer.
void set_flag(std::uint32_t* f, std::uint32_t v) noexcept {
  std::atomic_ref<std::uint32_t>(*f).store(v, std::memory_order_relaxed);
}

class ring_pipe final : public tcp_provider::byte_pipe {
 public:
  ring_pipe(std::byte* base, bool connector, int bell) noexcept
      : base_(base), tx_(base, connector ? 0 : 1), rx_(base, connector ? 1 : 0), bell_(bell) {}
  ~ring_pipe() override { ::munmap(base_, ring_bytes); }

  result<std::size_t> read_now(std::span<std::byte> buf) noexcept override {
    if (fault) return fault;
    const bool hung_up = gone;  // before the tail: what was published before the hang-up is seen
    const std::uint64_t t = load(rx_.tail);
    const std::uint64_t avail = t - head_;
    if (avail > cap || avail < seen_tail_ - head_) return bad();  // past our room, or backwards
    seen_tail_ = t;
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(avail, buf.size()));
    if (n == 0) {
      if (hung_up && !buf.empty()) return make_error_code(errc::eof);
      return std::size_t{0};
    }
    const std::size_t off = static_cast<std::size_t>(head_ & (cap - 1)), first = std::min(n, cap - off);
    std::memcpy(buf.data(), rx_.data + off, first);
    std::memcpy(buf.data() + first, rx_.data, n - first);
    head_ += n;
    publish(rx_.head, head_);
    // Dekker with the producer's arm_writer: its flag is seen, or it sees our head.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (take_flag(rx_.producer_sleeping)) ring();
    return n;
  }

  result<std::size_t> read_now_v(std::span<iovec>& v) noexcept override {
    if (fault) return fault;
    const bool hung_up = gone;  // as read_now
    const std::uint64_t t = load(rx_.tail);
    const std::uint64_t avail = t - head_;
    if (avail > cap || avail < seen_tail_ - head_) return bad();
    seen_tail_ = t;
    std::uint64_t left = avail;
    const std::uint64_t before = head_;
    // Copies of the members the loop moves: kept in registers across the
    // memcpy calls (one iteration per block of a list frame).
    std::uint64_t head = head_;
    std::span<iovec> rest = v;
    std::byte* const data = rx_.data;
    while (!rest.empty() && left > 0) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left, rest.front().iov_len));
      const std::size_t off = static_cast<std::size_t>(head & (cap - 1)), first = std::min(k, cap - off);
      auto* dst = static_cast<std::byte*>(rest.front().iov_base);
      std::memcpy(dst, data + off, first);
      if (k != first) std::memcpy(dst + first, data, k - first);  // wrapped
      head += k;
      left -= k;
      advance(rest, k);
    }
    head_ = head;
    v = rest;
    if (head_ == before) {
      if (hung_up && !v.empty()) return make_error_code(errc::eof);
      return std::size_t{0};
    }
    publish(rx_.head, head_);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // as read_now
    if (take_flag(rx_.producer_sleeping)) ring();
    return static_cast<std::size_t>(head_ - before);
  }

  result<void> write_now(std::span<iovec>& v) noexcept override {
    if (fault) return fault;
    // The peer's head only when the room we know of is short: it is the
    // line the peer writes on every read (a cache miss per look).
    // (Summed only until it passes the room known: a list frame is an iovec
    // per block, and a writev larger than the ring comes back here with
    // what is left until all of it went.)
    const std::uint64_t known = cap - (tail_ - seen_head_);
    std::uint64_t want = 0;
    for (const iovec& e : v)
      if ((want += e.iov_len) > known) break;
    if (known < want && !refresh_head()) return fault;
    std::uint64_t room = cap - (tail_ - seen_head_);
    const std::uint64_t before = tail_;
    std::uint64_t tail = tail_;  // (as read_now_v's copies)
    std::span<iovec> rest = v;
    std::byte* const data = tx_.data;
    while (!rest.empty() && room > 0) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(room, rest.front().iov_len));
      const std::size_t off = static_cast<std::size_t>(tail & (cap - 1)), first = std::min(k, cap - off);
      const auto* src = static_cast<const std::byte*>(rest.front().iov_base);
      std::memcpy(data + off, src, first);
      if (k != first) std::memcpy(data, src + first, k - first);  // wrapped
      tail += k;
      room -= k;
      advance(rest, k);
    }
    tail_ = tail;
    v = rest;
    if (tail_ != before) {
      ring_bytes_out += tail_ - before;
      publish(tx_.tail, tail_);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // Dekker with the consumer's arm_reader
      if (take_flag(tx_.consumer_sleeping)) ring();
    }
    return {};
  }

  // The loop is about to sleep (byte_pipe::try_enter_interrupt_mode).
  // Dekker with write_now: flag, fence, look; it publishes, fences, looks.
  bool arm_reader() noexcept override {
    if (fault) return false;
    set_flag(rx_.consumer_sleeping, 1);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (load(rx_.tail) == head_) return true;
    set_flag(rx_.consumer_sleeping, 0);
    return false;
  }
  bool arm_writer() noexcept override {
    if (fault) return false;
    set_flag(tx_.producer_sleeping, 1);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (load(tx_.head) == seen_head_) return true;  // seen_head_ is fresh: write_now found no room
    set_flag(tx_.producer_sleeping, 0);
    return false;
  }
  bool readable_now() const noexcept override { return load(rx_.tail) != head_; }
  bool writable_now() const noexcept override { return load(tx_.head) != seen_head_; }
  void disarm_reader() noexcept override { set_flag(rx_.consumer_sleeping, 0); }
  void disarm_writer() noexcept override { set_flag(tx_.producer_sleeping, 0); }

 private:
  // consume_iov for `k` bytes of v's first iovec, all of it in the common
  // case (a block list's frame is one iovec per block: no loop for it).
  static void advance(std::span<iovec>& v, std::size_t k) noexcept {
    if (k == v.front().iov_len) {
      v = v.subspan(1);
      if (!v.empty() && v.front().iov_len == 0) tcp_provider::consume_iov(v, 0);  // (skips the empty ones)
    } else {
      tcp_provider::consume_iov(v, k);
    }
  }

  // Loads and checks the peer's head: false (and `fault`) if it went
  // backwards or past what we published.
  bool refresh_head() noexcept {
    const std::uint64_t h = load(tx_.head);
    if (h - seen_head_ > tail_ - seen_head_) {
      bad();
      return false;
    }
    seen_head_ = h;
    return true;
  }
  std::error_code bad() noexcept {
    fault = make_error_code(errc::protocol_error);
    return fault;
  }
  // A full socket buffer (EAGAIN) already holds a doorbell the peer has
  // not read; an error is the hang-up, which the bell loop reads.
  void ring() noexcept {
    const char b = 1;
    (void)::send(bell_, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  }

  std::byte* base_;
  ring_view tx_, rx_;
  int bell_;
  std::uint64_t tail_ = 0, seen_head_ = 0;  // tx: ours, and the peer's last head
  std::uint64_t head_ = 0, seen_tail_ = 0;  // rx: ours, and the peer's last tail
};

}  // namespace

result<int> make_ring_memfd() { return make_sealed_memfd("shuttle-rings", ring_bytes); }

result<std::unique_ptr<tcp_provider::byte_pipe>> map_rings(int memfd, bool connector, int bell) {
  auto size = check_sealed_memfd(memfd);
  if (!size || *size < ring_bytes) return make_error_code(errc::protocol_error);
  void* p = ::mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (p == MAP_FAILED) return errno_code(errno);
  ++ring_pipes;
  return std::unique_ptr<tcp_provider::byte_pipe>(new ring_pipe(static_cast<std::byte*>(p), connector, bell));
}

bool rings_wanted() noexcept {
  const char* e = std::getenv("SHUTTLE_LOCAL_RINGS");
  return !e || std::strcmp(e, "0") != 0;
}

}  // namespace shuttle::detail::local_provider
