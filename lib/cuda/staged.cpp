// Staged device-to-device transfers (see shuttle/cuda/staged.hpp).
#include <shuttle/cuda/staged.hpp>

#include <shuttle/channel.hpp>
#include <shuttle/scope.hpp>
#include <shuttle/sync.hpp>
#include <shuttle/when_all.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <deque>
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
// A credit message: the number of slots handed back, 32-bit little-endian.
constexpr std::size_t credit_size = 4;
void put32(std::byte* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
std::uint32_t get32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}
std::error_code protocol() { return make_error_code(errc::protocol_error); }

using clock = std::chrono::steady_clock;

// How far producers run ahead of the copies: the bounce buffers on the
// wire plus a margin that absorbs the wire's jitter (a slow stretch of the
// sender's loop), so that the GPU does not run dry of producer work while
// the loop catches up. It costs an event per chunk of lookahead.
std::size_t lookahead_for(std::size_t bounce_buffers) { return std::max<std::size_t>(16, 4 * bounce_buffers); }
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
  std::vector<event> ev;       // per bounce buffer: its chunk's data is ready (D2H copy, or producer when direct)
  std::vector<event> prod_ev;  // per lookahead position: the producer work of a chunk is done
  stream copy;                 // D2H copies: producer work of later chunks is not queued behind them
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
std::size_t gpu_sender::lookahead() const noexcept { return s_ ? s_->prod_ev.size() : 0; }

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
      auto mr = d.register_memory(s->bounce.back().span(), access::local_write);
      if (!mr) co_return mr.error();
      s->bounce_mr.push_back(std::move(*mr));
    }
    for (std::size_t i = 0, n = lookahead_for(nb); i < n; ++i) s->prod_ev.emplace_back();
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
  const std::size_t la = st.prod_ev.size();

  channel<std::size_t> ready(nb);  // chunks whose copy is enqueued, for the writer
  semaphore free_buffers(nb);
  std::error_code err;
  auto fail = [&](std::error_code e) {
    if (!err) err = e;
  };
  async_scope writes;

  auto copier = [&]() -> task<void> {
    std::size_t produced = 0;
    for (std::size_t i = 0; i < n && !err; ++i) {
      // Chunk i's producer writes only its own range of `src`: producers run
      // ahead of the copies, bounded by the lookahead events (prod_ev[j % la]
      // is recorded again for chunk j + la only after chunk j's copy was
      // made to wait for it).
      for (; produced < n && produced < i + la; ++produced) {
        std::size_t off = produced * st.chunk, sz = std::min(st.chunk, len - off);
        if (before) before(produced, off, sz, strm);
        if (cudaError_t e = cudaEventRecord(st.prod_ev[produced % la].get(), strm); e != cudaSuccess) {
          fail(make_error_code(e));
          break;
        }
      }
      if (err || !co_await free_buffers.acquire() || err) break;
      std::size_t off = i * st.chunk, sz = std::min(st.chunk, len - off), b = i % nb;
      // The copy stream waits for chunk i's producer only, not for the
      // producers enqueued after it.
      cudaError_t e = cudaStreamWaitEvent(st.copy.get(), st.prod_ev[i % la].get(), 0);
      if (e == cudaSuccess && !direct)
        e = cudaMemcpyAsync(st.bounce[b].data(), base + off, sz, cudaMemcpyDeviceToHost, st.copy.get());
      if (e == cudaSuccess) e = cudaEventRecord(st.ev[b].get(), st.copy.get());
      if (e != cudaSuccess) {
        fail(make_error_code(e));
        break;
      }
      if (!co_await ready.send(i)) break;
    }
    ready.close();  // what was queued is still received
  };

  auto one_write = [&](std::span<const std::byte> local, remote_buffer remote, std::uint32_t imm) -> task<void> {
    auto r = co_await st.c->write_with_imm(local, remote, imm);
    if (!r) fail(r.error());
    free_buffers.release();
  };

  // Credits come back as messages carrying a count (batched by the
  // receiver); they are read only when none is left, so a transfer that
  // never runs out reads them at the start of the next one.
  auto take_credits = [&]() -> task<void> {
    while (st.credits == 0 && !err) {
      auto m = co_await st.c->recv();
      if (!m) {
        fail(m.error());
        break;
      }
      std::uint32_t v = m->size() == credit_size ? get32(m->data().data()) : 0;
      if (m->size() != credit_size || m->imm() || v == 0 || v > st.slots - st.credits) {
        fail(protocol());
        break;
      }
      st.credits += v;
      ++st.st.credit_messages;
    }
  };

  auto writer = [&]() -> task<void> {
    for (std::size_t i = 0; i < n; ++i) {
      // The copier is held up only by bounce buffers (producers run ahead):
      // waiting here means every buffer is on the wire.
      auto t0 = clock::now();
      auto r = co_await ready.receive();
      if (!r || err) break;
      std::size_t off = i * st.chunk, sz = std::min(st.chunk, len - off), b = i % nb;
      auto tr = clock::now();
      st.st.buffer_wait += tr - t0;
      if (auto w = co_await wait(st.ev[b].get()); !w) {
        fail(w.error());
        break;
      }
      auto t1 = clock::now();
      st.st.data_wait += t1 - tr;
      if (st.credits == 0) {
        ++st.st.credit_waits;
        co_await take_credits();
        st.st.credit_wait += clock::now() - t1;
        if (err) break;
      }
      std::uint64_t slot = st.seq % st.slots;
      auto remote = st.ring.slice(slot * st.chunk, sz);
      if (!remote) {
        fail(remote.error());
        break;
      }
      std::span<const std::byte> local =
          direct ? std::span(base + off, sz) : std::span<const std::byte>(st.bounce[b].data(), sz);
      --st.credits;
      ++st.seq;
      st.st.bytes += sz;
      ++st.st.chunks;
      writes.spawn(one_write(local, *remote, static_cast<std::uint32_t>(st.seq - 1)));  // submitted in order
    }
    if (err) {
      ready.close();
      free_buffers.release(nb);  // unblock the copier
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
  std::deque<std::size_t> copying;  // slots whose H2D copy is enqueued, oldest first
  semaphore queued(0);              // one unit per entry of `copying`, one more when receiving ends
  std::error_code err;
  auto fail = [&](std::error_code e) {
    if (!err) err = e;
  };
  async_scope credit_sends;

  auto receiver = [&]() -> task<void> {
    for (std::size_t i = 0; i < n && !err; ++i) {
      auto m = co_await st.c->recv();
      if (!m) {
        fail(m.error());
        break;
      }
      if (!m->imm() || *m->imm() != static_cast<std::uint32_t>(st.seq)) {
        fail(protocol());
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
        fail(make_error_code(e));
        break;
      }
      if (after) after(i, off, sz, strm);
      st.st.bytes += sz;
      ++st.st.chunks;
      copying.push_back(slot);
      queued.release();
    }
    queued.release();  // tells the crediter that nothing more comes
  };

  auto send_credits = [&](std::uint32_t k) -> task<void> {
    std::array<std::byte, credit_size> msg{};
    put32(msg.data(), k);
    if (auto r = co_await st.c->send(msg); !r) fail(r.error());
  };

  // Hands slots back as their copies finish, oldest first (the sender
  // reuses them in order). A credit message is not awaited before the next
  // slot is looked at: its acknowledgement can queue behind the sender's
  // data writes, and the sender needs the credit, not the acknowledgement.
  auto crediter = [&]() -> task<void> {
    for (;;) {
      if (auto a = co_await queued.acquire(); !a) {
        fail(a.error());  // cancelled
        break;
      }
      if (copying.empty()) break;  // the receiver's final unit
      if (auto w = co_await wait(st.ev[copying.front()].get()); !w) {
        fail(w.error());
        break;
      }
      copying.pop_front();
      std::uint32_t k = 1;
      while (!copying.empty() && cudaEventQuery(st.ev[copying.front()].get()) == cudaSuccess && queued.try_acquire()) {
        copying.pop_front();
        ++k;
      }
      ++st.st.credit_messages;
      credit_sends.spawn(send_credits(k));
    }
  };
  co_await when_all(receiver(), crediter());
  co_await credit_sends.join();
  if (err) co_return err;
  co_return result<void>{};
}

}  // namespace shuttle::cuda
