// Staged device-to-device transfers (see shuttle/cuda/staged.hpp).
#include <shuttle/cuda/staged.hpp>

#include <shuttle/channel.hpp>
#include <shuttle/scope.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/when_all.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

namespace shuttle::cuda {

namespace {
constexpr std::size_t hello_size = remote_buffer::wire_size + 16;  // ring, chunk, slots (little-endian)

void put64(std::byte* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
std::uint64_t get64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}
std::error_code protocol() { return make_error_code(errc::protocol_error); }
}  // namespace

// ------------------------------------------------------------------ sender

struct gpu_sender::state {
  connection* c = nullptr;
  domain* d = nullptr;
  gpu_registry* reg = nullptr;
  remote_buffer ring;
  std::size_t chunk = 0;
  std::uint32_t slots = 0;
  std::uint32_t credits = 0;
  std::uint64_t seq = 0;
  std::vector<pinned_buffer> bounce;
  std::vector<memory_region> bounce_mr;
  std::vector<event> ev;       // per bounce buffer: its D2H copy is done
  std::vector<event> prod_ev;  // per bounce buffer: the producer work before the copy is done
  stream copy;                 // D2H copies: producer work of the next chunk is not queued behind them
  gpu_path path = gpu_path::staged;
  transfer_stats st;
};

gpu_sender::gpu_sender() noexcept = default;
gpu_sender::gpu_sender(gpu_sender&&) noexcept = default;
gpu_sender& gpu_sender::operator=(gpu_sender&&) noexcept = default;
gpu_sender::~gpu_sender() = default;
gpu_path gpu_sender::path() const noexcept { return s_ ? s_->path : gpu_path::staged; }
std::size_t gpu_sender::chunk_size() const noexcept { return s_ ? s_->chunk : 0; }
const transfer_stats& gpu_sender::stats() const noexcept { return s_->st; }

task<result<gpu_sender>> gpu_sender::open(connection& c, domain& d, gpu_registry* reg, unsigned sender_buffers) {
  auto m = co_await c.recv();
  if (!m) co_return m.error();
  if (m->size() != hello_size) co_return protocol();
  auto s = std::make_unique<state>();
  s->c = &c;
  s->d = &d;
  s->reg = reg;
  s->ring = remote_buffer::deserialize(m->data().first<remote_buffer::wire_size>());
  s->chunk = get64(m->data().data() + remote_buffer::wire_size);
  s->slots = static_cast<std::uint32_t>(get64(m->data().data() + remote_buffer::wire_size + 8) & 0xffffffffu);
  if (s->chunk == 0 || s->slots == 0 || s->ring.length < s->chunk * s->slots) co_return protocol();
  s->credits = s->slots;
  unsigned nb = std::max(1u, sender_buffers);
  try {
    for (unsigned i = 0; i < nb; ++i) {
      s->bounce.emplace_back(s->chunk);
      s->ev.emplace_back();
      s->prod_ev.emplace_back();
      auto mr = d.register_memory(s->bounce.back().span(), access::local_write);
      if (!mr) co_return mr.error();
      s->bounce_mr.push_back(std::move(*mr));
    }
  } catch (const std::system_error& e) {
    co_return e.code();
  }
  gpu_sender out;
  out.s_ = std::move(s);
  co_return out;
}

task<result<void>> gpu_sender::send(const void* src, std::size_t len, cudaStream_t strm, chunk_fn before) {
  if (!s_) co_return make_error_code(std::errc::invalid_argument);
  state& st = *s_;
  if (len == 0) co_return result<void>{};
  const std::size_t n = (len + st.chunk - 1) / st.chunk;
  const std::size_t nb = st.bounce.size();
  bool direct = false;
  st.path = gpu_path::staged;
  if (st.reg) {
    auto r = st.reg->register_memory(src, len, 0);
    if (r && r->path != gpu_path::staged) {
      direct = true;
      st.path = r->path;
    }
  }
  const auto* base = static_cast<const std::byte*>(src);

  channel<std::size_t> ready(nb);
  semaphore free_slots(nb);
  std::error_code err;
  async_scope writes;

  auto copier = [&]() -> task<void> {
    for (std::size_t i = 0; i < n; ++i) {
      if (!co_await free_slots.acquire() || err) break;
      std::size_t off = i * st.chunk, sz = std::min(st.chunk, len - off), b = i % nb;
      if (before) before(i, off, sz, strm);
      // The copy runs on the channel's copy stream after what `strm` holds now.
      cudaError_t e = cudaSuccess;
      if (direct) {
        e = cudaEventRecord(st.ev[b].get(), strm);
      } else {
        e = cudaEventRecord(st.prod_ev[b].get(), strm);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(st.copy.get(), st.prod_ev[b].get(), 0);
        if (e == cudaSuccess)
          e = cudaMemcpyAsync(st.bounce[b].data(), base + off, sz, cudaMemcpyDeviceToHost, st.copy.get());
        if (e == cudaSuccess) e = cudaEventRecord(st.ev[b].get(), st.copy.get());
      }
      if (e != cudaSuccess) {
        if (!err) err = make_error_code(e);
        break;
      }
      if (!co_await ready.send(i)) break;
    }
    ready.close();  // what was queued is still received
  };

  auto one_write = [&](std::span<const std::byte> local, remote_buffer remote, std::uint32_t imm) -> task<void> {
    auto r = co_await st.c->write_with_imm(local, remote, imm);
    if (!r && !err) err = r.error();
    free_slots.release();
  };

  auto writer = [&]() -> task<void> {
    for (std::size_t i = 0; i < n; ++i) {
      auto r = co_await ready.receive();
      if (!r || err) break;
      std::size_t off = i * st.chunk, sz = std::min(st.chunk, len - off), b = i % nb;
      if (auto w = co_await wait(st.ev[b].get()); !w) {
        if (!err) err = w.error();
        break;
      }
      while (st.credits == 0 && !err) {
        ++st.st.credit_waits;
        auto m = co_await st.c->recv();
        if (!m) {
          err = m.error();
          break;
        }
        if (m->size() != 4) {
          err = protocol();
          break;
        }
        std::uint32_t v = 0;
        std::memcpy(&v, m->data().data(), 4);
        st.credits += v;
      }
      if (err) break;
      std::uint64_t slot = st.seq % st.slots;
      auto remote = st.ring.slice(slot * st.chunk, sz);
      if (!remote) {
        err = remote.error();
        break;
      }
      std::span<const std::byte> local = direct ? std::span(base + off, sz) : std::span<const std::byte>(st.bounce[b].data(), sz);
      --st.credits;
      ++st.seq;
      st.st.bytes += sz;
      ++st.st.chunks;
      writes.spawn(one_write(local, *remote, static_cast<std::uint32_t>(st.seq - 1)));  // submitted in order
    }
    if (err) {
      ready.close();
      free_slots.release(nb);  // unblock the copier
    }
  };

  co_await when_all(copier(), writer());
  co_await writes.join();
  if (err) co_return err;
  co_return result<void>{};
}

// ------------------------------------------------------------------ receiver

struct gpu_receiver::state {
  connection* c = nullptr;
  staged_options o;
  pinned_buffer ring;
  memory_region mr;
  std::vector<event> ev;  // per slot: its H2D copy is done
  stream copy;            // H2D copies: not queued behind the consumer's kernels
  std::uint64_t seq = 0;
  transfer_stats st;
};

gpu_receiver::gpu_receiver() noexcept = default;
gpu_receiver::gpu_receiver(gpu_receiver&&) noexcept = default;
gpu_receiver& gpu_receiver::operator=(gpu_receiver&&) noexcept = default;
gpu_receiver::~gpu_receiver() = default;
std::size_t gpu_receiver::chunk_size() const noexcept { return s_ ? s_->o.chunk : 0; }
const transfer_stats& gpu_receiver::stats() const noexcept { return s_->st; }

task<result<gpu_receiver>> gpu_receiver::open(connection& c, domain& d, staged_options o) {
  if (o.chunk == 0 || o.receiver_slots == 0) co_return make_error_code(std::errc::invalid_argument);
  auto s = std::make_unique<state>();
  s->c = &c;
  s->o = o;
  try {
    s->ring = pinned_buffer(o.chunk * o.receiver_slots);
    for (unsigned i = 0; i < o.receiver_slots; ++i) s->ev.emplace_back();
  } catch (const std::system_error& e) {
    co_return e.code();
  }
  auto mr = d.register_memory(s->ring.span(), access::local_write | access::remote_write);
  if (!mr) co_return mr.error();
  s->mr = std::move(*mr);
  std::array<std::byte, hello_size> hello{};
  s->mr.remote().serialize(std::span<std::byte, remote_buffer::wire_size>(hello.data(), remote_buffer::wire_size));
  put64(hello.data() + remote_buffer::wire_size, o.chunk);
  put64(hello.data() + remote_buffer::wire_size + 8, o.receiver_slots);
  if (auto r = co_await c.send(std::span<const std::byte>(hello.data(), hello_size)); !r) co_return r.error();
  gpu_receiver out;
  out.s_ = std::move(s);
  co_return out;
}

task<result<void>> gpu_receiver::recv(void* dst, std::size_t len, cudaStream_t strm, chunk_fn after) {
  if (!s_) co_return make_error_code(std::errc::invalid_argument);
  state& st = *s_;
  if (len == 0) co_return result<void>{};
  const std::size_t chunk = st.o.chunk, slots = st.o.receiver_slots;
  const std::size_t n = (len + chunk - 1) / chunk;
  auto* base = static_cast<std::byte*>(dst);
  channel<std::size_t> copied(slots);
  std::error_code err;

  auto receiver = [&]() -> task<void> {
    for (std::size_t i = 0; i < n; ++i) {
      auto m = co_await st.c->recv();
      if (!m) {
        if (!err) err = m.error();
        break;
      }
      if (!m->imm() || *m->imm() != static_cast<std::uint32_t>(st.seq)) {
        if (!err) err = protocol();
        break;
      }
      std::size_t slot = st.seq % slots, off = i * chunk, sz = std::min(chunk, len - off);
      ++st.seq;
      // Copy on the channel's stream; the consumer's stream waits for it, so
      // work enqueued there next (after()) sees the data.
      cudaError_t e =
          cudaMemcpyAsync(base + off, st.ring.data() + slot * chunk, sz, cudaMemcpyHostToDevice, st.copy.get());
      if (e == cudaSuccess) e = cudaEventRecord(st.ev[slot].get(), st.copy.get());
      if (e == cudaSuccess) e = cudaStreamWaitEvent(strm, st.ev[slot].get(), 0);
      if (e != cudaSuccess) {
        if (!err) err = make_error_code(e);
        break;
      }
      if (after) after(i, off, sz, strm);
      st.st.bytes += sz;
      ++st.st.chunks;
      if (!co_await copied.send(slot)) break;
    }
    copied.close();
  };
  auto crediter = [&]() -> task<void> {
    for (;;) {
      auto slot = co_await copied.receive();
      if (!slot) break;
      if (auto w = co_await wait(st.ev[*slot].get()); !w) {
        if (!err) err = w.error();
        copied.close();
        break;
      }
      std::uint32_t one = 1;
      std::array<std::byte, 4> msg{};
      std::memcpy(msg.data(), &one, 4);
      if (auto r = co_await st.c->send(msg); !r) {
        if (!err) err = r.error();
        copied.close();
        break;
      }
    }
  };
  co_await when_all(receiver(), crediter());
  if (err) co_return err;
  co_return result<void>{};
}

}  // namespace shuttle::cuda
