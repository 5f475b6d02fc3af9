// The shared-memory rings (ring.hpp).
#include "ring.hpp"

#include "shared_memory.hpp"
#include "stats.hpp"

#include "../tcp_provider/conn_state.hpp"

#include <linux/membarrier.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

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

constexpr std::uint64_t cap = ring_capacity, align = ring_align, max_record = ring_max_record;
static_assert((cap & (cap - 1)) == 0 && cap % align == 0 && align >= 2 * sizeof(std::uint64_t));
// Room a record of `len` bytes takes, with the next record's mark, which
// the producer zeroes before publishing this one.
constexpr std::uint64_t footprint(std::uint64_t len) noexcept {
  return (sizeof(std::uint64_t) + len + align - 1) / align * align;
}
// The most a record can carry in `room` bytes (the head the consumer
// publishes may be inside a record: only whole lines count).
constexpr std::uint64_t fits(std::uint64_t room) noexcept {
  room &= ~(align - 1);
  return room < 2 * align ? 0 : std::min(max_record, room - align - sizeof(std::uint64_t));
}
static_assert(footprint(fits(2 * align + 5)) + align <= 2 * align && footprint(48 + 8) == align);

std::uint64_t load(const std::uint64_t* p) noexcept {
  return std::atomic_ref<const std::uint64_t>(*p).load(std::memory_order_acquire);
}
void publish(std::uint64_t* p, std::uint64_t v) noexcept {
  std::atomic_ref<std::uint64_t>(*p).store(v, std::memory_order_release);
}

bool membarrier_global_expedited() noexcept {
  return ::syscall(SYS_membarrier, MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0) == 0;
}

// One direction, as this side sees it.
struct ring_view {
  std::uint32_t* producer_sleeping;
  std::uint64_t* head;
  std::uint32_t* consumer_sleeping;
  std::byte* data;
  ring_view(std::byte* base, int i) noexcept {
    std::byte* r = base + static_cast<std::size_t>(i) * (ring_ctl + ring_capacity);
    producer_sleeping = reinterpret_cast<std::uint32_t*>(r + ring_producer_sleeping);
    head = reinterpret_cast<std::uint64_t*>(r + ring_head);
    consumer_sleeping = reinterpret_cast<std::uint32_t*>(r + ring_consumer_sleeping);
    data = r + ring_ctl;
  }
  std::uint64_t* mark(std::uint64_t pos) const noexcept {
    return reinterpret_cast<std::uint64_t*>(data + (pos & (cap - 1)));
  }
};

// Takes a sleeper's flag: true if it was set (then we ring).
bool take_flag(std::uint32_t* f) noexcept {
  std::atomic_ref<std::uint32_t> a(*f);
  return a.load(std::memory_order_relaxed) != 0 && a.exchange(0, std::memory_order_relaxed) != 0;
}
// Relaxed: the order that matters (our flag before our next look at the
// peer's side) is the sleeper's barrier's, sleep_barrier.
void set_flag(std::uint32_t* f, std::uint32_t v) noexcept {
  std::atomic_ref<std::uint32_t>(*f).store(v, std::memory_order_relaxed);
}

class ring_pipe final : public tcp_provider::byte_pipe {
 public:
  ring_pipe(std::byte* base, bool connector, int bell, bool asymmetric) noexcept
      : base_(base), tx_(base, connector ? 0 : 1), rx_(base, connector ? 1 : 0), bell_(bell), asym_(asymmetric) {}
  ~ring_pipe() override { ::munmap(base_, ring_bytes); }

  // read_now_v for one buffer (a frame's header, then its payload: twice a
  // message), without the iovec walk.
  result<std::size_t> read_now(std::span<std::byte> buf) noexcept override {
    if (fault) return fault;
    const bool hung_up = gone;  // before the marks, as read_now_v
    std::size_t taken = 0;
    while (taken < buf.size()) {
      if (left_ == 0 && !next_record()) {
        if (fault) return fault;
        break;
      }
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left_, buf.size() - taken));
      const std::size_t off = static_cast<std::size_t>(head_ & (cap - 1)), first = std::min(k, cap - off);
      std::memcpy(buf.data() + taken, rx_.data + off, first);
      if (k != first) std::memcpy(buf.data() + taken + first, rx_.data, k - first);  // wrapped
      head_ += k;
      left_ -= k;
      taken += k;
      if (left_ == 0) head_ = record_end_;
    }
    if (taken == 0) {
      if (hung_up && !buf.empty()) return make_error_code(errc::eof);
      return std::size_t{0};
    }
    publish(rx_.head, head_);
    publish_barrier();
    if (take_flag(rx_.producer_sleeping)) ring();
    return taken;
  }

  result<std::size_t> read_now_v(std::span<iovec>& v) noexcept override {
    if (fault) return fault;
    const bool hung_up = gone;  // before the marks: what was published before the hang-up is seen
    std::uint64_t taken = 0;
    while (!v.empty()) {
      if (v.front().iov_len == 0) {
        v = v.subspan(1);
        continue;
      }
      if (left_ == 0 && !next_record()) {
        if (fault) return fault;
        break;
      }
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left_, v.front().iov_len));
      const std::size_t off = static_cast<std::size_t>(head_ & (cap - 1)), first = std::min(k, cap - off);
      auto* dst = static_cast<std::byte*>(v.front().iov_base);
      std::memcpy(dst, rx_.data + off, first);
      if (k != first) std::memcpy(dst + first, rx_.data, k - first);  // wrapped
      head_ += k;
      left_ -= k;
      taken += k;
      advance(v, k);
      if (left_ == 0) head_ = record_end_;
    }
    if (taken == 0) {
      if (hung_up && !v.empty()) return make_error_code(errc::eof);
      return std::size_t{0};
    }
    // The head, as far as taken (inside a record too, as a byte stream
    // frees what is read: no more room is held back than before). A line
    // only the producer's room check reads: it stays in our cache meanwhile.
    publish(rx_.head, head_);
    // Dekker with the producer's arm_writer: its flag is seen, or it sees our head.
    publish_barrier();
    if (take_flag(rx_.producer_sleeping)) ring();
    return static_cast<std::size_t>(taken);
  }

  result<void> write_now(std::span<iovec>& v) noexcept override {
    if (fault) return fault;
    // The peer's head only when the room we know of is short: it is the
    // line the peer writes as it reads (a cache miss per look).
    tcp_provider::consume_iov(v, 0);  // leading empty buffers
    // Summed only as far as one record takes: a list frame is an iovec per
    // block, and a writev larger than the ring comes back here with what
    // is left until all of it went.
    auto wanted = [](std::span<const iovec> rest) noexcept {
      std::uint64_t w = 0;
      for (const iovec& e : rest)
        if ((w += e.iov_len) >= max_record) break;
      return w;
    };
    std::uint64_t want = wanted(v);
    if (want == 0) return {};
    if (fits(cap - (tail_ - seen_head_)) < std::min(want, max_record) && !refresh_head()) return fault;
    bool wrote = false;
    while (!v.empty()) {
      if (want == 0 && (want = wanted(v)) == 0) break;
      const std::uint64_t len = std::min(want, fits(cap - (tail_ - seen_head_)));
      if (len == 0) break;
      const std::uint64_t pos = tail_;
      std::uint64_t at = pos + sizeof(std::uint64_t), left = len;
      while (left > 0) {
        const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left, v.front().iov_len));
        const std::size_t off = static_cast<std::size_t>(at & (cap - 1)), first = std::min(k, cap - off);
        const auto* src = static_cast<const std::byte*>(v.front().iov_base);
        std::memcpy(tx_.data + off, src, first);
        if (k != first) std::memcpy(tx_.data, src + first, k - first);  // wrapped
        at += k;
        left -= k;
        advance(v, k);
      }
      tail_ = pos + footprint(len);
      // The next record's mark reads "not yet" before this one is published
      // (the line may hold an older lap's bytes).
      std::atomic_ref<std::uint64_t>(*tx_.mark(tail_)).store(0, std::memory_order_relaxed);
      publish(tx_.mark(pos), ring_mark(pos, len));
      want -= len;
      ring_bytes_out += len;
      wrote = true;
    }
    if (wrote) {
      publish_barrier();  // Dekker with the consumer's arm_reader
      if (take_flag(tx_.consumer_sleeping)) ring();
    }
    return {};
  }

  bool try_write_now(std::span<iovec> v) noexcept override {
    if (fault) return false;
    std::uint64_t want = 0;
    for (const iovec& e : v) want += e.iov_len;
    if (want == 0 || want > max_record) return false;
    if (fits(cap - (tail_ - seen_head_)) < want && (!refresh_head() || fits(cap - (tail_ - seen_head_)) < want))
      return false;  // (a bad head: `fault`, which the engine's writer fails with)
    // write_now's record, in one go.
    const std::uint64_t pos = tail_;
    std::uint64_t at = pos + sizeof(std::uint64_t);
    for (const iovec& e : v) {
      const std::size_t k = e.iov_len;
      const std::size_t off = static_cast<std::size_t>(at & (cap - 1)), first = std::min(k, cap - off);
      const auto* src = static_cast<const std::byte*>(e.iov_base);
      std::memcpy(tx_.data + off, src, first);
      if (k != first) std::memcpy(tx_.data, src + first, k - first);  // wrapped
      at += k;
    }
    tail_ = pos + footprint(want);
    std::atomic_ref<std::uint64_t>(*tx_.mark(tail_)).store(0, std::memory_order_relaxed);
    publish(tx_.mark(pos), ring_mark(pos, want));
    ring_bytes_out += want;
    publish_barrier();  // Dekker with the consumer's arm_reader
    if (take_flag(tx_.consumer_sleeping)) ring();
    return true;
  }

  // The loop is about to sleep (byte_pipe::try_enter_interrupt_mode).
  // Dekker with write_now: flag, barrier, look; it publishes, barrier, looks.
  bool arm_reader() noexcept override {
    if (fault) return false;
    set_flag(rx_.consumer_sleeping, 1);
    sleep_barrier();
    if (!readable_now()) return true;
    set_flag(rx_.consumer_sleeping, 0);
    return false;
  }
  bool arm_writer() noexcept override {
    if (fault) return false;
    set_flag(tx_.producer_sleeping, 1);
    sleep_barrier();
    if (load(tx_.head) == seen_head_) return true;  // seen_head_ is fresh: write_now found no room
    set_flag(tx_.producer_sleeping, 0);
    return false;
  }
  bool readable_now() const noexcept override { return left_ != 0 || load(rx_.mark(head_)) != 0; }
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
  // The record at head_, if published: false if not yet (or a bad mark:
  // `fault`).
  bool next_record() noexcept {
    const std::uint64_t m = load(rx_.mark(head_));
    if (m == 0) return false;
    const std::uint64_t len = m & 0xffffffffu;
    if (m != ring_mark(head_, len) || len == 0 || len > max_record) {
      bad();
      return false;
    }
    record_end_ = head_ + footprint(len);
    head_ += sizeof(std::uint64_t);
    left_ = len;
    return true;
  }
  // After a publish: the store before the load that follows it (the
  // sleeper's flag). With membarrier, the sleeper's barrier orders both.
  void publish_barrier() const noexcept {
    if (asym_) std::atomic_signal_fence(std::memory_order_seq_cst);
    else std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  // Before a sleeper's look: our flag before the peer's side, and with
  // membarrier, the peer's last publish (a barrier on its CPU) before it.
  // (Once registered, the membarrier cannot fail: man 2 membarrier; the
  // fence is for the symmetric case.)
  void sleep_barrier() const noexcept {
    if (!asym_ || !membarrier_global_expedited()) std::atomic_thread_fence(std::memory_order_seq_cst);
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
  bool asym_;
  std::uint64_t tail_ = 0, seen_head_ = 0;  // tx: ours (a record's start), and the peer's last head
  // rx: the next byte to take, what is left of the record it is in, and
  // that record's end.
  std::uint64_t head_ = 0, left_ = 0, record_end_ = 0;
};

}  // namespace

result<int> make_ring_memfd() { return make_sealed_memfd("shuttle-rings", ring_bytes); }

result<std::unique_ptr<tcp_provider::byte_pipe>> map_rings(int memfd, bool connector, int bell, bool asymmetric) {
  auto size = check_sealed_memfd(memfd);
  if (!size || *size < ring_bytes) return make_error_code(errc::protocol_error);
  void* p = ::mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (p == MAP_FAILED) return errno_code(errno);
  ++ring_pipes;
  return std::unique_ptr<tcp_provider::byte_pipe>(
      new ring_pipe(static_cast<std::byte*>(p), connector, bell, asymmetric));
}

bool rings_wanted() noexcept {
  const char* e = std::getenv("SHUTTLE_LOCAL_RINGS");
  return !e || std::strcmp(e, "0") != 0;
}

bool asymmetric_fences_available() noexcept {
  static const bool supported = [] {
    const char* e = std::getenv("SHUTTLE_LOCAL_MEMBARRIER");
    if (e && std::strcmp(e, "0") == 0) return false;
    const long cmds = ::syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    return cmds >= 0 && (cmds & MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0 &&
           (cmds & MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) != 0;
  }();
  if (!supported) return false;
  // Per process: a child forked after we registered registers itself (it
  // would otherwise rely on a registration that may not be its own).
  static std::atomic<pid_t> registered{0};
  const pid_t me = ::getpid();
  if (registered.load(std::memory_order_acquire) == me) return true;
  if (::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) != 0) return false;
  registered.store(me, std::memory_order_release);
  return true;
}

}  // namespace shuttle::detail::local_provider
