// stream_pipeline: Asio TCP ingest -> batch compute -> RDMA-style shipping to
// a sink over shuttle's transport API, on one thread and one loop.
//
//   clients --framed records--> [ingest: asio::ip::tcp, awaitables]
//        --channel<record>--> [compute: batches, a CUDA kernel or the same function on the CPU]
//        --channel<batch>-->  [network: transport write_with_imm into sink slots]
//        --> sink (verifies every record, acks each slot; slow or dying on request)
//
// One shuttle io_context drives an asio::io_context (shuttle::asio::asio_driver):
// Asio's acceptor and sockets and shuttle's tasks run on the same thread with
// one place to sleep. Stages are joined by bounded shuttle::channels, so a slow
// stage back-pressures the one before it, down to the clients' TCP windows.
// The network stage writes batches into the sink's registered slots with
// write_with_imm (the immediate names the slot) and may reuse a slot only
// when the sink acks it.
//
// The sink may drop its connection and come back (a restart): every batch
// carries a sequence number and stays in its slot until the sink acks it.
// The network stage reconnects with back-off and resends, in order, every
// batch not acked yet; the sink applies each sequence number once and acks a
// duplicate without applying it. Records are delivered exactly once across
// any number of restarts.
//
// SIGINT (or --duration) drains: ingest stops reading (a record is "in" once
// the ingest stage has queued it), compute and network finish everything
// queued, the sink confirms count and checksum, and both are compared with
// what came in. If the sink stays unreachable (no connection for
// --reconnect-give-up seconds), the error is reported with the number of
// records lost (in, but never confirmed by the sink): nothing vanishes silently.
//
//   stream_pipeline [--clients N] [--records-per-client M (0: until SIGINT)]
//                   [--record-size B] [--batch R] [--queue Q] [--slots S]
//                   [--sink-delay-us U] [--sink-die-after R] [--duration S]
//                   [--sink-lives N] [--reconnect-give-up S]
//                   [--report-ms MS] [--compute auto|cpu|gpu]
//
// --sink-die-after R: the sink drops its connection after applying R records
// on it (without acking the last batch) and accepts a new one. --sink-lives N:
// the sink accepts N connections, then stops listening (0: no limit).
//
// --compute auto (the default) runs the compute stage's function as a CUDA
// kernel when shuttle was built with CUDA and a GPU is present, on the CPU
// otherwise. On the GPU a batch is packed into pinned memory, copied to the
// device, processed by kernels::digest_and_mask, copied back, and the stage
// awaits the stream on the loop (co_await cuda::wait(stream)): the loop keeps
// serving ingest and network meanwhile.
// Exit status: 0 when out == in, 3 when records were lost.
#include <shuttle/asio/asio.hpp>  // first: configures Asio

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <shuttle/shuttle.hpp>
#include <shuttle/transport.hpp>
#if SHUTTLE_HAVE_CUDA
#include <shuttle/cuda/cuda.hpp>
#include <shuttle/cuda/kernels.hpp>
#endif

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace stream_pipeline {

namespace net = boost::asio;
namespace sa = shuttle::asio;
using shuttle::clock;
using shuttle::result;
using shuttle::task;
using namespace std::chrono_literals;

struct config {
  unsigned clients = 8;
  std::uint64_t records_per_client = 0;  // 0: until stopped
  std::uint32_t record_size = 256;
  std::size_t batch = 64;
  std::size_t queue = 1024;  // records in the ingest channel; batches: queue / batch
  std::uint32_t slots = 16;
  std::uint32_t sink_delay_us = 0;
  std::uint64_t sink_die_after = 0;  // records per sink connection; 0: never
  unsigned sink_lives = 0;            // connections the sink accepts; 0: no limit
  double reconnect_give_up_s = 10;    // no connection to the sink for this long: its records are lost
  std::chrono::milliseconds ack_timeout{10000};  // no ack for this long: the link is dropped and remade
  double duration_s = 0;             // 0: until SIGINT (or all clients done)
  unsigned report_ms = 1000;
  bool quiet = false;
  bool install_sigint = true;
  enum class compute_on { automatic, cpu, gpu } compute = compute_on::automatic;
  // Benchmarks: run one stage alone. ingest: compute only drains the ingest
  // channel; network: compute feeds synthetic batches (synthetic_records of
  // them) straight to the network stage, with no clients.
  enum class only_stage { all, ingest, network } only = only_stage::all;
  std::uint64_t synthetic_records = 0;
};

struct report {
  std::uint64_t sent_by_clients = 0;
  std::uint64_t in = 0, in_checksum = 0;
  std::uint64_t confirmed = 0, confirmed_checksum = 0;  // acked slot by slot
  std::uint64_t sink_count = 0, sink_checksum = 0;      // the sink's own final totals
  std::uint64_t sink_corrupt = 0;
  std::uint64_t batches = 0;  // shipped by the network stage (confirmed / batches: the batching achieved)
  std::uint64_t lost = 0;
  std::uint64_t sink_restarts = 0;       // connections the sink dropped
  std::uint64_t reconnects = 0;          // connections the network stage remade
  std::uint64_t resent_batches = 0;      // batches written again after a reconnect
  std::uint64_t sink_duplicates = 0;     // resent batches the sink had applied already (discarded)
  std::string error;  // first error that cost records
  double seconds = 0;
  bool ok() const { return error.empty() && lost == 0 && confirmed == in && sink_count == in && sink_checksum == in_checksum; }
};

// ---------------------------------------------------------------- records

inline std::uint64_t fnv1a(std::span<const std::byte> d) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto b : d) h = (h ^ std::to_integer<std::uint8_t>(b)) * 1099511628211ull;
  return h;
}
// Order-independent sum of per-record digests.
inline std::uint64_t mix(std::uint64_t id, std::uint64_t digest) {
  std::uint64_t x = id * 0x9E3779B97F4A7C15ull ^ digest;
  x ^= x >> 31;
  return x * 0xBF58476D1CE4E5B9ull;
}

struct record {
  std::uint64_t id = 0;
  std::uint64_t digest = 0;  // of the original payload
  clock::time_point t_in{};
  std::vector<std::byte> payload;
};
struct batch {
  std::vector<record> recs;
};

// The compute stage's function (a CUDA kernel will take its place): digest
// each record and transform its payload.
inline void process(batch& b) {
  for (auto& r : b.recs) {
    r.digest = fnv1a(r.payload);
    for (auto& x : r.payload) x ^= std::byte{0x5a};
  }
}

#if SHUTTLE_HAVE_CUDA
// The compute function on the GPU. Buffers grow to the largest batch seen.
class gpu_compute {
 public:
  // Whether a GPU can run it (a CUDA build and a device).
  static bool available() noexcept { return shuttle::cuda::device_count() > 0; }

  task<result<void>> run(batch& b) {
    const std::size_t n = b.recs.size();
    std::size_t bytes = 0;
    for (auto& r : b.recs) bytes += r.payload.size();
    reserve(bytes, n);
    auto* offsets = reinterpret_cast<std::uint64_t*>(host_.data());
    auto* digests = offsets + (n + 1);
    std::byte* payload = host_.data() + table_bytes(n);
    std::uint64_t off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      offsets[i] = off;
      std::memcpy(payload + off, b.recs[i].payload.data(), b.recs[i].payload.size());
      off += b.recs[i].payload.size();
    }
    offsets[n] = off;
    const std::size_t total = table_bytes(n) + bytes;
    auto* d_offsets = reinterpret_cast<std::uint64_t*>(dev_.data());
    auto* d_payload = reinterpret_cast<std::uint8_t*>(dev_.data() + table_bytes(n));
    cudaError_t e = cudaMemcpyAsync(dev_.data(), host_.data(), total, cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess) e = shuttle::cuda::kernels::digest_and_mask(d_payload, d_offsets, n, d_offsets + (n + 1), stream_);
    if (e == cudaSuccess) e = cudaMemcpyAsync(host_.data(), dev_.data(), total, cudaMemcpyDeviceToHost, stream_);
    if (e != cudaSuccess) co_return shuttle::cuda::make_error_code(e);
    auto done = co_await shuttle::cuda::wait(stream_);
    if (!done) {
      // Cancelled (or failed): the copies may still be landing in host_;
      // they are finished before anyone touches or frees it again.
      (void)cudaStreamSynchronize(stream_);
      co_return done.error();
    }
    for (std::size_t i = 0; i < n; ++i) {
      auto& r = b.recs[i];
      r.digest = digests[i];
      std::memcpy(r.payload.data(), payload + offsets[i], r.payload.size());
    }
    co_return result<void>{};
  }

 private:
  // offsets (n + 1) and digests (n), 8 bytes each, before the payloads.
  static std::size_t table_bytes(std::size_t n) { return (2 * n + 1) * 8; }
  void reserve(std::size_t bytes, std::size_t n) {
    std::size_t need = table_bytes(n) + bytes;
    if (need <= host_.size()) return;
    need = std::max(need * 2, std::size_t(1) << 20);
    host_ = shuttle::cuda::pinned_buffer(need);
    dev_ = shuttle::cuda::device_buffer(need);
  }
  shuttle::cuda::stream stream_;
  shuttle::cuda::pinned_buffer host_;
  shuttle::cuda::device_buffer dev_;
};
#endif

inline void put64(std::byte* p, std::uint64_t v) { std::memcpy(p, &v, 8); }
inline void put32(std::byte* p, std::uint32_t v) { std::memcpy(p, &v, 4); }
inline std::uint64_t get64(const std::byte* p) { std::uint64_t v; std::memcpy(&v, p, 8); return v; }
inline std::uint32_t get32(const std::byte* p) { std::uint32_t v; std::memcpy(&v, p, 4); return v; }

// ---------------------------------------------------------------- metrics

struct stage_metrics {
  const char* name;
  std::uint64_t total = 0, last_total = 0;
  std::vector<double> lat_us;  // this period
  void add(clock::time_point t_in, clock::time_point now) {
    ++total;
    lat_us.push_back(std::chrono::duration<double, std::micro>(now - t_in).count());
  }
  double p99() {
    if (lat_us.empty()) return 0;
    auto k = lat_us.size() * 99 / 100;
    std::nth_element(lat_us.begin(), lat_us.begin() + k, lat_us.end());
    return lat_us[k];
  }
};

// ---------------------------------------------------------------- the pipeline

class pipeline {
 public:
  pipeline(shuttle::io_context&, net::io_context& actx, config cfg)
      : actx_(actx), cfg_(cfg), ingest_ch_(cfg.queue), batch_ch_(std::max<std::size_t>(1, cfg.queue / cfg.batch)) {
#if SHUTTLE_HAVE_CUDA
    if (cfg.compute == config::compute_on::gpu && !gpu_compute::available())
      throw std::runtime_error("--compute gpu: no usable GPU on this machine (cudaGetDeviceCount found none)");
    if (cfg.compute == config::compute_on::gpu ||
        (cfg.compute == config::compute_on::automatic && gpu_compute::available()))
      gpu_.emplace();
#endif
    if (cfg.compute == config::compute_on::gpu && !on_gpu())
      throw std::runtime_error("--compute gpu: this build has no CUDA layer (configure with -Dcuda=enabled)");
  }
  // Where the compute stage runs.
  bool on_gpu() const noexcept {
#if SHUTTLE_HAVE_CUDA
    return gpu_.has_value();
#else
    return false;
#endif
  }

  task<report> run();
  void request_stop() { stop_.request_stop(); }

 private:
  // -------- sink (its own domain; in-process here, any host in production)
  task<void> sink_main(shuttle::domain& dom, shuttle::listener& l, std::size_t slot_size);
  task<void> stopper();
  // -------- stages
  net::awaitable<void> ingest_session(net::ip::tcp::socket s);
  net::awaitable<void> acceptor_loop();
  task<void> ingest_supervisor();
  task<void> compute_stage();
  // One connection to the sink: its slots' descriptor, and the writes and
  // the ack reader running on it.
  struct sink_link {
    shuttle::connection conn;
    shuttle::remote_buffer slots;
    bool broken = false;  // failed, or stalled: to be remade
    shuttle::async_scope tasks;
  };
  // A batch written to a slot and not acked yet: it stays there for a resend.
  struct in_flight_batch {
    std::uint64_t seq = 0;
    std::size_t bytes = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ids;  // (id, digest)
  };
  task<void> network_stage();
  task<bool> ensure_link();
  task<void> retire_link();
  task<bool> wait_progress();
  task<void> ack_reader(sink_link& l);
  task<void> ship(sink_link& l, std::uint32_t slot);
  task<void> reporter();
  net::awaitable<void> client(unsigned idx, net::ip::tcp::endpoint ep);
  void fail(const std::string& what) {
    if (report_.error.empty()) report_.error = what;
    stop_.request_stop();
  }

  net::io_context& actx_;
  config cfg_;
  report report_;
  std::stop_source stop_;  // SIGINT / duration / sink death: drain
  shuttle::channel<record> ingest_ch_;
  shuttle::channel<batch> batch_ch_;
  std::optional<net::ip::tcp::acceptor> acceptor_;
  std::list<net::ip::tcp::socket*> sessions_;
  unsigned sessions_live_ = 0, clients_live_ = 0;
  shuttle::event ingest_done_, clients_done_, network_done_;
  stage_metrics m_ingest_{"ingest", 0, 0, {}}, m_compute_{"compute", 0, 0, {}}, m_network_{"network", 0, 0, {}};
#if SHUTTLE_HAVE_CUDA
  std::optional<gpu_compute> gpu_;  // the compute stage runs on the GPU
#endif
  // network stage state
  shuttle::domain* src_dom_ = nullptr;
  shuttle::connection_options copts_;
  std::uint16_t sink_port_ = 0;
  std::size_t slot_size_ = 0;
  std::unique_ptr<sink_link> link_;
  std::vector<std::vector<std::byte>> local_slots_;
  std::deque<std::uint32_t> free_slots_;
  std::map<std::uint32_t, in_flight_batch> in_flight_;  // by slot
  std::uint64_t in_flight_records_ = 0;
  std::uint64_t next_seq_ = 1;
  shuttle::event progress_;  // an ack arrived or a link broke
  bool sink_unreachable_ = false, got_totals_ = false;
  // sink state: survives its restarts (a sink with durable state)
  bool sink_finished_ = false;
  clock::time_point t0_{};
};

net::awaitable<void> pipeline::client(unsigned idx, net::ip::tcp::endpoint ep) {
  net::ip::tcp::socket s(actx_);
  boost::system::error_code ec;
  co_await s.async_connect(ep, net::redirect_error(net::use_awaitable, ec));
  std::vector<std::byte> frame(12 + cfg_.record_size);
  for (std::uint64_t i = 0; !ec && (cfg_.records_per_client == 0 || i < cfg_.records_per_client); ++i) {
    std::uint64_t id = (std::uint64_t(idx) << 40) | i;
    put32(frame.data(), cfg_.record_size);
    put64(frame.data() + 4, id);
    for (std::uint32_t k = 0; k < cfg_.record_size; ++k) frame[12 + k] = std::byte(std::uint8_t(id * 31 + k));
    co_await net::async_write(s, net::buffer(frame), net::redirect_error(net::use_awaitable, ec));
    if (!ec) ++report_.sent_by_clients;
  }
  s.shutdown(net::ip::tcp::socket::shutdown_send, ec);
  char sink[64];
  co_await s.async_read_some(net::buffer(sink), net::redirect_error(net::use_awaitable, ec));  // until ingest closes
  if (--clients_live_ == 0) clients_done_.set();
}

net::awaitable<void> pipeline::ingest_session(net::ip::tcp::socket s) {
  sessions_.push_front(&s);
  auto self = sessions_.begin();
  boost::system::error_code ec;
  std::byte hdr[12];
  while (!stop_.stop_requested()) {
    co_await net::async_read(s, net::buffer(hdr), net::redirect_error(net::use_awaitable, ec));
    if (ec) break;
    record r;
    r.id = get64(hdr + 4);
    r.payload.resize(get32(hdr));
    co_await net::async_read(s, net::buffer(r.payload), net::redirect_error(net::use_awaitable, ec));
    if (ec) break;  // a partial record never entered the pipeline
    r.t_in = clock::now();
    auto t_in = r.t_in;
    std::uint64_t sum = mix(r.id, fnv1a(r.payload));
    // Queued without suspending while the channel has room (no operation,
    // no hop through Asio's queue); backpressure: a full channel suspends
    // this session (a shuttle operation with an Asio token), so it stops
    // reading its socket.
    if (!ingest_ch_.try_send(r)) {
      if (ingest_ch_.closed()) break;
      co_await sa::async_send(ingest_ch_, std::move(r), net::redirect_error(net::use_awaitable, ec));
      if (ec) break;
    }
    ++report_.in;
    report_.in_checksum += sum;
    m_ingest_.add(t_in, clock::now());  // read -> queued: grows under backpressure
  }
  sessions_.erase(self);
  s.close(ec);
  if (--sessions_live_ == 0 && !acceptor_) ingest_done_.set();
}

net::awaitable<void> pipeline::acceptor_loop() {
  for (;;) {
    boost::system::error_code ec;
    auto s = co_await acceptor_->async_accept(net::redirect_error(net::use_awaitable, ec));
    if (ec) break;
    ++sessions_live_;
    net::co_spawn(actx_, ingest_session(std::move(s)), net::detached);
  }
}

// Stops ingest on a stop request: no new connections, sessions stop reading
// (they finish queueing the record they hold), then the channel closes.
task<void> pipeline::ingest_supervisor() {
  shuttle::event stopped;
  std::stop_callback cb(stop_.get_token(), [&] { stopped.set(); });
  (void)co_await stopped.wait();
  boost::system::error_code ec;
  acceptor_->close(ec);
  acceptor_.reset();
  for (auto* s : sessions_) s->cancel(ec);
  if (sessions_live_ != 0) (void)co_await ingest_done_.wait();
  ingest_ch_.close();
}

task<void> pipeline::compute_stage() {
  if (cfg_.only == config::only_stage::ingest) {
    while (auto r = co_await ingest_ch_.receive()) {
      ++report_.confirmed;
      report_.confirmed_checksum += mix(r->id, fnv1a(r->payload));
      ++report_.sink_count;
    }
    report_.sink_checksum = report_.confirmed_checksum;
    batch_ch_.close();
    co_return;
  }
  if (cfg_.only == config::only_stage::network) {
    std::uint64_t id = 0;
    while (id < cfg_.synthetic_records && !stop_.stop_requested()) {
      batch b;
      for (std::size_t i = 0; i < cfg_.batch && id < cfg_.synthetic_records; ++i, ++id) {
        record r;
        r.id = id;
        r.payload.assign(cfg_.record_size, std::byte(id));
        r.t_in = clock::now();
        r.digest = fnv1a(r.payload);
        ++report_.in;
        report_.in_checksum += mix(r.id, r.digest);
        for (auto& x : r.payload) x ^= std::byte{0x5a};
        b.recs.push_back(std::move(r));
      }
      if (!co_await batch_ch_.send(std::move(b))) break;
    }
    batch_ch_.close();
    stop_.request_stop();
    co_return;
  }
  for (;;) {
    batch b;
    auto r = co_await ingest_ch_.receive();
    if (!r) break;  // closed and drained
    b.recs.push_back(std::move(*r));
    while (b.recs.size() < cfg_.batch) {
      auto more = ingest_ch_.try_receive();
      if (!more) break;
      b.recs.push_back(std::move(*more));
    }
#if SHUTTLE_HAVE_CUDA
    if (gpu_) {
      auto done = co_await gpu_->run(b);
      if (!done) {
        fail("compute stage (GPU): " + done.error().message());  // the batch's records count as lost
        break;
      }
    } else {
      process(b);
    }
#else
    process(b);
#endif
    auto now = clock::now();
    for (auto& rec : b.recs) m_compute_.add(rec.t_in, now);
    auto sent = co_await batch_ch_.send(std::move(b));
    if (!sent) break;  // network stage gone: the records are counted as lost by the report
  }
  batch_ch_.close();
}

// Slot layout: [records u32][0 u32][sequence number u64], then per record
// [id u64][digest u64][length u32][payload]. Acks: [slot u32][corrupt u32][seq u64].
constexpr std::size_t slot_header = 16, record_header = 20, ack_size = 16, totals_size = 24;
constexpr std::uint32_t totals_tag = 0xFFFFFFFF;

task<void> pipeline::ship(sink_link& l, std::uint32_t slot) {
  const auto& b = in_flight_.at(slot);
  auto remote = l.slots.slice(std::uint64_t(slot) * slot_size_, slot_size_).value();
  auto r = co_await l.conn.write_with_imm(std::span(local_slots_[slot].data(), b.bytes), remote, slot);
  if (!r) {  // the batch stays in flight: it is resent on the next link
    l.broken = true;
    progress_.set();
  }
}

task<void> pipeline::ack_reader(sink_link& l) {
  for (;;) {
    auto m = co_await l.conn.recv();
    if (!m) break;
    auto d = m->data();
    if (d.size() == totals_size && get32(d.data()) == totals_tag) {  // the sink's final totals
      report_.sink_count = get64(d.data() + 8);
      report_.sink_checksum = get64(d.data() + 16);
      got_totals_ = true;
      progress_.set();
      co_return;
    }
    if (d.size() != ack_size) {
      fail("network stage: malformed ack from the sink (" + std::to_string(d.size()) + " bytes)");
      break;
    }
    std::uint32_t slot = get32(d.data());
    report_.sink_corrupt += get32(d.data() + 4);
    std::uint64_t seq = get64(d.data() + 8);
    auto it = in_flight_.find(slot);
    if (it == in_flight_.end() || it->second.seq != seq) continue;  // stale: the slot holds another batch now
    for (auto& [id, digest] : it->second.ids) {
      ++report_.confirmed;
      report_.confirmed_checksum += mix(id, digest);
    }
    in_flight_records_ -= it->second.ids.size();
    in_flight_.erase(it);
    free_slots_.push_back(slot);
    progress_.set();
  }
  l.broken = true;
  progress_.set();
}

// Waits for an ack, the totals or a broken link; false after ack_timeout
// without any. A link on which nothing was acked for that long while
// batches are in flight is stalled: it is dropped and remade.
task<bool> pipeline::wait_progress() {
  progress_.reset();
  auto r = co_await shuttle::with_timeout(as_task(progress_.wait()), cfg_.ack_timeout);
  if (!r && link_ && !in_flight_.empty()) link_->broken = true;
  co_return bool(r);
}

// Cancels what still runs on the current link (its connection fails them)
// and drops it.
task<void> pipeline::retire_link() {
  if (!link_) co_return;
  link_->tasks.request_stop();
  co_await link_->tasks.join();
  if (!link_->broken) (void)co_await link_->conn.close();
  link_.reset();
}

// A healthy link to the sink, remade with back-off when the last one broke;
// every batch not acked is then written again, oldest first (the sink
// discards those it applied already). False once the sink stayed unreachable
// for reconnect_give_up_s: what is in flight is lost (and counted so).
task<bool> pipeline::ensure_link() {
  if (link_ && !link_->broken) co_return true;
  if (sink_unreachable_) co_return false;
  const bool first = !link_;
  co_await retire_link();
  const auto give_up = clock::now() + std::chrono::duration_cast<clock::duration>(
                                          std::chrono::duration<double>(cfg_.reconnect_give_up_s));
  auto backoff = 1ms;
  std::error_code last;
  for (;;) {
    auto c = co_await shuttle::with_timeout(src_dom_->connect(shuttle::endpoint::loopback(sink_port_), copts_), 5s);
    // with_timeout flattens: a connect or recv error, or timed_out.
    if (c) {
      auto conn = std::move(*c);
      auto recv = [](shuttle::connection& cn) -> task<result<shuttle::message>> { co_return co_await cn.recv(); };
      auto d = co_await shuttle::with_timeout(recv(conn), 5s);
      if (d && d->size() == shuttle::remote_buffer::wire_size) {
        link_ = std::make_unique<sink_link>();
        link_->conn = std::move(conn);
        link_->slots = shuttle::remote_buffer::deserialize(d->data().first<shuttle::remote_buffer::wire_size>());
        d->reset();
        break;
      }
      last = d ? std::make_error_code(std::errc::protocol_error) : d.error();
    } else {
      last = c.error();
    }
    if (clock::now() + backoff > give_up) {
      sink_unreachable_ = true;
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g", cfg_.reconnect_give_up_s);
      fail(std::string("network stage: sink unreachable for ") + secs + " s: " + last.message());
      co_return false;
    }
    (void)co_await shuttle::sleep_for(backoff);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, 200ms);
  }
  if (!first) ++report_.reconnects;
  link_->tasks.spawn(ack_reader(*link_));
  std::vector<std::pair<std::uint64_t, std::uint32_t>> resend;  // (seq, slot)
  for (auto& [slot, b] : in_flight_) resend.emplace_back(b.seq, slot);
  std::sort(resend.begin(), resend.end());
  for (auto [seq, slot] : resend) {
    ++report_.resent_batches;
    link_->tasks.spawn(ship(*link_, slot));
  }
  co_return true;
}

task<void> pipeline::network_stage() {
  local_slots_.assign(cfg_.slots, std::vector<std::byte>(slot_size_));
  for (std::uint32_t i = 0; i < cfg_.slots; ++i) free_slots_.push_back(i);
  for (;;) {
    auto b = co_await batch_ch_.receive();
    if (!b) break;
    // A free slot (backpressure from the sink), on a healthy link.
    bool linked = false;
    while ((linked = co_await ensure_link()) && free_slots_.empty()) (void)co_await wait_progress();
    if (!linked) continue;  // the sink is unreachable: these records are lost, and counted so; keep draining upstream
    const std::uint32_t slot = free_slots_.front();
    free_slots_.pop_front();
    auto& buf = local_slots_[slot];
    in_flight_batch f;
    f.seq = next_seq_++;
    std::size_t off = slot_header;
    auto now = clock::now();
    for (auto& r : b->recs) {
      put64(buf.data() + off, r.id);
      put64(buf.data() + off + 8, r.digest);
      put32(buf.data() + off + 16, static_cast<std::uint32_t>(r.payload.size()));
      std::memcpy(buf.data() + off + record_header, r.payload.data(), r.payload.size());
      off += record_header + r.payload.size();
      f.ids.emplace_back(r.id, r.digest);
      m_network_.add(r.t_in, now);
    }
    put32(buf.data(), static_cast<std::uint32_t>(b->recs.size()));
    put32(buf.data() + 4, 0);
    put64(buf.data() + 8, f.seq);
    f.bytes = off;
    in_flight_records_ += f.ids.size();
    in_flight_[slot] = std::move(f);
    ++report_.batches;
    link_->tasks.spawn(ship(*link_, slot));
  }
  // Drain: every batch acked (across reconnects), then exchange totals.
  while (!in_flight_.empty() && co_await ensure_link()) (void)co_await wait_progress();
  network_done_.set();
  for (int attempt = 0; attempt < 5 && !got_totals_ && in_flight_.empty() && co_await ensure_link(); ++attempt) {
    std::byte fin[4];
    put32(fin, totals_tag);
    if (!co_await link_->conn.send(fin)) {
      link_->broken = true;
      continue;
    }
    while (!got_totals_ && !link_->broken)
      if (!co_await wait_progress()) link_->broken = true;  // no totals: ask again on a new link
  }
  co_await retire_link();
}

// The sink: owns registered slots, verifies every record of a slot when the
// write_with_imm naming it arrives, applies each batch sequence number once,
// acks the slot, and reports its totals. Its state outlives its connections:
// after a drop (--sink-die-after) it accepts the next one.
task<void> pipeline::sink_main(shuttle::domain& dom, shuttle::listener& l, std::size_t slot_size) {
  std::vector<std::byte> mem(std::size_t(cfg_.slots) * slot_size);
  auto mr = dom.register_memory(mem, shuttle::access::local_write | shuttle::access::remote_write).value();
  std::byte desc[shuttle::remote_buffer::wire_size];
  mr.remote().serialize(desc);
  std::uint64_t count = 0, checksum = 0, applied_seq = 0;
  std::vector<std::byte> plain;
  for (unsigned lives = 0; !sink_finished_; ++lives) {
    if (cfg_.sink_lives && lives == cfg_.sink_lives) {
      l.close();  // gone for good: new connections are refused
      break;
    }
    auto c = co_await l.accept();
    if (!c) break;
    auto conn = std::move(*c);
    if (!co_await conn.send(desc)) continue;
    std::uint64_t applied_here = 0;
    bool drop = false;
    for (;;) {
      auto m = co_await conn.recv();
      if (!m) break;  // the sender dropped this link: wait for the next one
      if (!m->imm()) {  // the sender's fin: answer with our totals
        std::byte fin[totals_size]{};
        put32(fin, totals_tag);
        put64(fin + 8, count);
        put64(fin + 16, checksum);
        sink_finished_ = true;
        (void)co_await conn.send(fin);
        break;
      }
      const std::uint32_t slot = *m->imm();
      m->reset();
      if (slot >= cfg_.slots) {
        fail("sink: write names slot " + std::to_string(slot) + " of " + std::to_string(cfg_.slots));
        drop = true;
        break;
      }
      const std::byte* p = mem.data() + std::size_t(slot) * slot_size;
      const std::byte* end = p + slot_size;
      const std::uint32_t n = get32(p);
      const std::uint64_t seq = get64(p + 8);
      std::uint32_t corrupt = 0;
      if (seq <= applied_seq) {
        ++report_.sink_duplicates;  // applied before a drop, resent: acked again, not applied again
      } else if (seq != applied_seq + 1) {
        fail("sink: batch " + std::to_string(seq) + " arrived after " + std::to_string(applied_seq) + " (a gap)");
        drop = true;
        break;
      } else {
        p += slot_header;
        std::uint64_t batch_count = 0, batch_sum = 0;
        for (std::uint32_t i = 0; i < n; ++i) {
          std::uint32_t len = end - p >= std::ptrdiff_t(record_header) ? get32(p + 16) : 0;
          if (end - p < std::ptrdiff_t(record_header) || std::size_t(end - p - record_header) < len) {
            corrupt += n - i;  // runs past its slot
            break;
          }
          std::uint64_t id = get64(p), digest = get64(p + 8);
          plain.assign(p + record_header, p + record_header + len);
          for (auto& x : plain) x ^= std::byte{0x5a};
          if (fnv1a(plain) != digest) ++corrupt;
          ++batch_count;
          batch_sum += mix(id, digest);
          p += record_header + len;
        }
        count += batch_count;
        checksum += batch_sum;
        applied_seq = seq;
        applied_here += batch_count;
      }
      if (cfg_.sink_delay_us) (void)co_await shuttle::sleep_for(std::chrono::microseconds(cfg_.sink_delay_us));
      if (cfg_.sink_die_after && applied_here >= cfg_.sink_die_after) {  // dies before acking this batch
        ++report_.sink_restarts;
        drop = true;
        break;
      }
      std::byte ack[ack_size];
      put32(ack, slot);
      put32(ack + 4, corrupt);
      put64(ack + 8, seq);
      if (!co_await conn.send(ack)) break;
    }
    report_.sink_count = count;
    report_.sink_checksum = checksum;
    if (drop) continue;  // abrupt (the connection's destructor): pending operations fail on both sides
    (void)co_await conn.close();
  }
}

task<void> pipeline::stopper() {
  auto sig = [](bool install) -> task<void> {
    if (!install) {
      (void)co_await shuttle::sleep_for(std::chrono::hours(24 * 365));
      co_return;
    }
    shuttle::signal_set sigs{SIGINT, SIGTERM};
    if (auto r = co_await sigs.wait()) std::printf("stream_pipeline: signal %d: draining\n", *r);
  };
  auto dur = [](double s) -> task<void> {
    if (s <= 0) s = 3600.0 * 24 * 365;
    (void)co_await shuttle::sleep_for(std::chrono::duration<double>(s));
  };
  auto clients = [](shuttle::event& e) -> task<void> { (void)co_await e.wait(); };
  auto stopped = [](std::stop_token t) -> task<void> {
    shuttle::event e;
    std::stop_callback cb(t, [&] { e.set(); });
    (void)co_await e.wait();
  };
  (void)co_await shuttle::when_any(sig(cfg_.install_sigint), dur(cfg_.duration_s), clients(clients_done_),
                                   stopped(stop_.get_token()));
  stop_.request_stop();
}

task<report> pipeline::run() {
  t0_ = clock::now();
  slot_size_ = slot_header + cfg_.batch * (record_header + cfg_.record_size);
  auto sink_dom = shuttle::domain::open().value();
  auto src_dom = shuttle::domain::open().value();
  copts_.receive_buffers = std::max<std::uint32_t>(64, cfg_.slots * 2 + 4);
  auto l = sink_dom.listen(shuttle::endpoint::loopback(0), copts_).value();
  src_dom_ = &src_dom;
  sink_port_ = l.local_endpoint()->port();
  shuttle::async_scope sink_scope, aux, stages;
  sink_scope.spawn(sink_main(sink_dom, l, slot_size_));

  acceptor_.emplace(actx_, net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), 0));
  auto ep = acceptor_->local_endpoint();
  net::co_spawn(actx_, acceptor_loop(), net::detached);
  clients_live_ = cfg_.clients;
  for (unsigned i = 0; i < cfg_.clients; ++i) net::co_spawn(actx_, client(i, ep), net::detached);

  aux.spawn(stopper());
  aux.spawn(reporter());
  stages.spawn(ingest_supervisor());
  stages.spawn(compute_stage());
  stages.spawn(network_stage());
  co_await stages.join();
  aux.request_stop();
  co_await aux.join();
  if (!sink_finished_) sink_scope.request_stop();  // no totals exchanged: stop waiting for the sender
  co_await sink_scope.join();
  l.close();
  // Let client coroutines (Asio) see their sockets closed.
  for (int i = 0; i < 100 && clients_live_ != 0; ++i) (void)co_await shuttle::sleep_for(1ms);

  report_.seconds = std::chrono::duration<double>(clock::now() - t0_).count();
  report_.lost = report_.in - report_.confirmed;
  if (report_.sink_corrupt && report_.error.empty()) report_.error = "sink: corrupt records";
  co_return report_;
}

task<void> pipeline::reporter() {
  auto last = clock::now();
  while (!stop_.stop_requested() || !network_done_.is_set()) {
    (void)co_await shuttle::sleep_for(std::chrono::milliseconds(cfg_.report_ms));
    auto now = clock::now();
    double dt = std::chrono::duration<double>(now - last).count();
    last = now;
    if (!cfg_.quiet) {
      std::printf("[%6.1fs]", std::chrono::duration<double>(now - t0_).count());
      for (auto* m : {&m_ingest_, &m_compute_, &m_network_}) {
        std::printf("  %s %8.0f rec/s p99 %7.0f us", m->name, double(m->total - m->last_total) / dt, m->p99());
      }
      std::printf("  | queues ingest %zu/%zu batches %zu/%zu in-flight %llu\n", ingest_ch_.size(), ingest_ch_.capacity(),
                  batch_ch_.size(), batch_ch_.capacity(), static_cast<unsigned long long>(in_flight_records_));
      std::fflush(stdout);
    }
    for (auto* m : {&m_ingest_, &m_compute_, &m_network_}) {
      m->last_total = m->total;
      m->lat_us.clear();
    }
    if (network_done_.is_set()) break;
  }
}

}  // namespace stream_pipeline

#ifndef STREAM_PIPELINE_NO_MAIN
#include "cli.hpp"

namespace {
const char* const kSynopsis =
    "usage: stream_pipeline [--clients N] [--records-per-client M] [--record-size B] [--batch R]\n"
    "         [--queue Q] [--slots S] [--sink-delay-us U] [--sink-die-after R] [--duration S]\n"
    "         [--sink-lives N] [--reconnect-give-up S] [--report-ms MS] [--quiet] [--compute auto|cpu|gpu]\n";

stream_pipeline::config parse_options(int argc, char** argv) {
  using stream_pipeline::config;
  config cfg;
  CLI::App app{"Asio TCP ingest -> batch compute -> shipping to a sink over shuttle's transport API.",
               "stream_pipeline"};
  cli::setup(app, kSynopsis);
  auto d = [](auto v) { return " (default " + std::to_string(v) + ")"; };
  app.add_option("--clients", cfg.clients, "TCP clients feeding the ingest stage" + d(cfg.clients))
      ->type_name("N")
      ->transform(cli::count(1, 65536));
  app.add_option("--records-per-client", cfg.records_per_client,
                 "records each client sends; 0: until SIGINT or --duration (default 0)")
      ->type_name("M")
      ->transform(cli::count(0, 1ull << 40));
  app.add_option("--record-size", cfg.record_size, "payload bytes per record" + d(cfg.record_size))
      ->type_name("B")
      ->transform(cli::bytes(1, 1u << 20));
  app.add_option("--batch", cfg.batch, "records per batch" + d(cfg.batch))
      ->type_name("R")
      ->transform(cli::count(1, 65536));
  app.add_option("--queue", cfg.queue, "records in the ingest channel; batches: queue / batch" + d(cfg.queue))
      ->type_name("Q")
      ->transform(cli::count(1, 1u << 24));
  app.add_option("--slots", cfg.slots, "the sink's slots, one batch each" + d(cfg.slots))
      ->type_name("S")
      ->transform(cli::count(1, 4096));
  app.add_option("--sink-delay-us", cfg.sink_delay_us, "the sink sleeps this long per batch (default 0)")
      ->type_name("U")
      ->transform(cli::count(0, 60'000'000));
  app.add_option("--sink-die-after", cfg.sink_die_after,
                 "the sink drops its connection after applying R records on it (without acking the last batch) "
                 "and accepts a new one; 0: never (default)")
      ->type_name("R")
      ->transform(cli::count(0, 1ull << 40));
  app.add_option("--sink-lives", cfg.sink_lives,
                 "the sink accepts N connections, then stops listening; 0: no limit (default)")
      ->type_name("N")
      ->transform(cli::count(0, 1'000'000));
  app.add_option("--reconnect-give-up", cfg.reconnect_give_up_s,
                 "no connection to the sink for this long: its records are lost (default 10)")
      ->type_name("S")
      ->check(cli::seconds());
  app.add_option("--duration", cfg.duration_s, "seconds, then drain; 0: until SIGINT (default 0)")
      ->type_name("S")
      ->check(cli::seconds(/*zero_ok=*/true));
  app.add_option("--report-ms", cfg.report_ms, "progress report period" + d(cfg.report_ms))
      ->type_name("MS")
      ->transform(cli::count(1, 3'600'000));
  app.add_flag("--quiet", cfg.quiet, "no progress reports");
  std::string compute = "auto";
  app.add_option("--compute", compute,
                 "where the compute stage runs: auto (a CUDA kernel when built with CUDA and a GPU is present, "
                 "else the CPU), cpu or gpu (default auto)")
      ->type_name("auto|cpu|gpu")
      ->check(cli::one_of({"auto", "cpu", "gpu"}));
  cli::parse(app, argc, argv);
  cfg.compute = compute == "cpu"   ? config::compute_on::cpu
                : compute == "gpu" ? config::compute_on::gpu
                                   : config::compute_on::automatic;
  return cfg;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace stream_pipeline;
  const config cfg = parse_options(argc, argv);
  shuttle::block_signals({SIGINT, SIGTERM});
  shuttle::io_context loop;
  net::io_context actx(1);
  report r;
  try {
    sa::asio_driver driver(loop, actx);
    pipeline p(loop, actx, cfg);
    std::printf("stream_pipeline: compute stage on the %s\n", p.on_gpu() ? "GPU (CUDA kernel)" : "CPU");
    r = loop.run(p.run());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stream_pipeline: %s\n", e.what());
    return 2;
  }
  std::printf("stream_pipeline: %.2fs  clients sent %llu  in %llu (checksum %016llx)  sink confirmed %llu (checksum %016llx)"
              "  lost %llu  corrupt %llu  -> %.0f rec/s\n",
              r.seconds, (unsigned long long)r.sent_by_clients, (unsigned long long)r.in,
              (unsigned long long)r.in_checksum, (unsigned long long)r.sink_count, (unsigned long long)r.sink_checksum,
              (unsigned long long)r.lost, (unsigned long long)r.sink_corrupt, double(r.confirmed) / r.seconds);
  if (r.sink_restarts || r.reconnects)
    std::printf("stream_pipeline: sink restarts %llu  reconnects %llu  batches resent %llu  duplicates discarded by the sink %llu\n",
                (unsigned long long)r.sink_restarts, (unsigned long long)r.reconnects, (unsigned long long)r.resent_batches,
                (unsigned long long)r.sink_duplicates);
  if (!r.error.empty()) std::printf("stream_pipeline: ERROR: %s (%llu records lost)\n", r.error.c_str(), (unsigned long long)r.lost);
  if (r.ok()) {
    std::printf("stream_pipeline: OK: out == in (count and checksum)\n");
    return 0;
  }
  return 3;
}
#endif
