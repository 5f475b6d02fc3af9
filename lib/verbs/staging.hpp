// Staging: registered slots that sends and writes from memory the library
// does not own are copied into. Such memory is never registered for longer
// than one operation, since nothing tells the library when it is unmapped
// (docs/memory-registration.md); copying a small source into memory that
// stays registered often costs less than registering it per operation
// (copy_or_register measures which).
#pragma once

#include "registration.hpp"

#include <array>
#include <cstdint>
#include <optional>

namespace shuttle::detail::verbs_impl {

// Sources up to staging_max are staged, in slots of the next power of two
// from staging_min. The pool registers staging_chunk bytes at a time, as
// operations in flight need them, up to staging_cap per domain; past that
// (and for larger sources and read targets) an operation registers its
// memory for itself.
constexpr std::size_t staging_min = 4 << 10;
constexpr std::size_t staging_max = 64 << 10;
constexpr std::size_t staging_chunk = 2 << 20;
constexpr std::size_t staging_cap = 16 << 20;
constexpr unsigned staging_classes = 5;  // 4, 8, 16, 32, 64 KiB
static_assert((staging_min << (staging_classes - 1)) == staging_max);
static_assert(staging_chunk % staging_max == 0 && staging_cap % staging_chunk == 0);

constexpr unsigned staging_class(std::size_t bytes) noexcept {
  unsigned c = 0;
  while ((staging_min << c) < bytes) ++c;
  return c;
}

// Copy or register, per size class. Which of the two costs less depends on
// the machine: on a NIC whose registrations go through firmware a copy of
// 64 KiB is the cheaper, under Soft-RoCE in an emulated guest a copy of
// 64 KiB costs about three registrations (docs/memory-registration.md). So
// each domain measures both as it goes (the copy; ibv_reg_mr plus, when the
// operation lets go, ibv_dereg_mr) and takes the cheaper, trying the other
// now and then to keep its figure current: every probe_min-th source while
// a figure is missing, else less often the dearer the other path is (a
// probe costs about 1/probe_min of the cheaper path on average). Neither
// choice caches anything: a stale registration stays impossible.
class copy_or_register {
 public:
  static constexpr std::uint32_t probe_min = 64, probe_max = 4096;

  // Whether to stage the next source of this class (else register it for
  // the operation). Until a registration has been measured: stage.
  bool stage(unsigned cls) noexcept {
    auto& e = classes_[cls];
    const bool cheaper = e.reg_ns == 0 || e.copy_ns <= e.reg_ns;
    if (++e.since_probe < probe_interval(cls)) return cheaper;
    e.since_probe = 0;
    return !cheaper;
  }
  void copied(unsigned cls, std::int64_t ns) noexcept { blend(classes_[cls].copy_ns, ns); }
  void registered(unsigned cls, std::int64_t ns) noexcept { blend(classes_[cls].reg_ns, ns); }
  double copy_ns(unsigned cls) const noexcept { return classes_[cls].copy_ns; }
  double register_ns(unsigned cls) const noexcept { return classes_[cls].reg_ns; }
  std::uint32_t probe_interval(unsigned cls) const noexcept {
    const auto& e = classes_[cls];
    if (e.copy_ns == 0 || e.reg_ns == 0) return probe_min;
    const double dearer = e.copy_ns > e.reg_ns ? e.copy_ns / e.reg_ns : e.reg_ns / e.copy_ns;
    return dearer * probe_min >= probe_max ? probe_max : std::uint32_t(dearer * probe_min);
  }

 private:
  struct costs {
    double copy_ns = 0, reg_ns = 0;  // moving averages; 0: not measured yet
    std::uint32_t since_probe = 0;
  };
  static void blend(double& avg, std::int64_t ns) noexcept {
    const double v = ns > 0 ? double(ns) : 1.0;
    avg = avg == 0 ? v : avg + (v - avg) / 8;
  }
  std::array<costs, staging_classes> classes_{};
};

struct staging_pool;

// One operation's slot: where to copy, the chunk's registration, and the
// hold that gives the slot back when the operation lets go of it.
struct staging_lease {
  std::byte* addr;
  verbs_region* region;
  std::shared_ptr<verbs_region> hold;
};

struct staging_pool : std::enable_shared_from_this<staging_pool> {
  struct chunk {
    std::byte* mem;
    std::shared_ptr<verbs_region> region;
  };
  struct slot {
    std::uint32_t chunk, offset;
  };
  struct give_back {
    std::shared_ptr<staging_pool> pool;
    unsigned cls;
    slot s;
    void operator()(verbs_region*) const noexcept { pool->free[cls].push_back(s); }
  };

  std::vector<chunk> chunks;
  // Blocks of staging_max bytes handed out to the size classes so far, in
  // chunk order; a class splits its blocks into its slots and keeps them.
  std::size_t blocks_carved = 0;
  // Free slots per class; capacity reserved for every slot the class could
  // ever hold, so giving one back never allocates.
  std::array<std::vector<slot>, staging_classes> free;

  std::size_t registered_bytes() const noexcept { return chunks.size() * staging_chunk; }

  // A free slot for `bytes` (<= staging_max), growing the pool with
  // `reg(span) -> result<shared_ptr<verbs_region>>` when the class has none;
  // nullopt when the pool is at its cap or cannot grow.
  template <class Register>
  std::optional<staging_lease> take(std::size_t bytes, Register&& reg) {
    const unsigned cls = staging_class(bytes);
    auto& list = free[cls];
    if (list.empty() && !carve(cls, reg)) return std::nullopt;
    const slot s = list.back();
    list.pop_back();
    const chunk& c = chunks[s.chunk];
    return staging_lease{c.mem + s.offset, c.region.get(),
                         std::shared_ptr<verbs_region>(c.region.get(), give_back{shared_from_this(), cls, s})};
  }

  ~staging_pool() {
    for (auto& c : chunks) {
      c.region.reset();  // deregistered before the pages go
      ::munmap(c.mem, staging_chunk);
    }
  }

 private:
  template <class Register>
  bool carve(unsigned cls, Register& reg) {
    constexpr std::size_t blocks_per_chunk = staging_chunk / staging_max;
    if (blocks_carved == chunks.size() * blocks_per_chunk) {
      if (registered_bytes() >= staging_cap) return false;
      void* p = ::mmap(nullptr, staging_chunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return false;
      auto mem = static_cast<std::byte*>(p);
      auto r = reg(std::span<std::byte>(mem, staging_chunk));
      if (!r) {
        ::munmap(p, staging_chunk);
        return false;
      }
      if (chunks.empty()) chunks.reserve(staging_cap / staging_chunk);
      chunks.push_back({mem, std::move(*r)});
    }
    const std::size_t size = staging_min << cls;
    auto& list = free[cls];
    if (list.capacity() == 0) list.reserve(staging_cap / size);
    const auto ci = static_cast<std::uint32_t>(blocks_carved / blocks_per_chunk);
    const std::size_t base = (blocks_carved % blocks_per_chunk) * staging_max;
    ++blocks_carved;
    for (std::size_t off = staging_max; off >= size; off -= size)  // lowest address taken first
      list.push_back({ci, static_cast<std::uint32_t>(base + off - size)});
    return true;
  }
};

}  // namespace shuttle::detail::verbs_impl
