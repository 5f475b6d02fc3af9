// The stream_pipeline example, in process: backpressure from a slow sink, a
// sink that restarts (every record delivered exactly once), a sink that
// never comes back (the error surfaces, lost records counted), and a drain on
// stop with nothing lost.
#define STREAM_PIPELINE_NO_MAIN
// Included .cpp: g++ treats it as a header and warns about its coroutine
// frames holding lambdas (no linkage); harmless in one translation unit.
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic ignored "-Wsubobject-linkage"
#endif
#include "../../examples/stream_pipeline.cpp"

#include <doctest/doctest.h>

using namespace stream_pipeline;

namespace {
report run_with(config cfg) {
  cfg.quiet = true;
  cfg.install_sigint = false;
  cfg.report_ms = 50;
  shuttle::io_context loop;
  net::io_context actx(1);
  sa::asio_driver driver(loop, actx);
  pipeline p(loop, actx, cfg);
  return loop.run(p.run());
}
}  // namespace

TEST_CASE("pipeline: slow sink back-pressures to the clients, nothing lost") {
  config cfg;
  cfg.clients = 4;
  cfg.records_per_client = 400;
  cfg.batch = 16;
  cfg.queue = 64;
  cfg.slots = 2;
  cfg.sink_delay_us = 2000;  // ~8k records/s at most through two slots
  auto r = run_with(cfg);
  INFO("error: " << r.error);
  CHECK(r.ok());
  CHECK(r.in == 1600);
  CHECK(r.sink_count == r.in);
  CHECK(r.sink_checksum == r.in_checksum);
  CHECK(r.confirmed_checksum == r.in_checksum);
}

TEST_CASE("pipeline: a sink that drops its connection and comes back gets every record exactly once") {
  config cfg;
  cfg.clients = 4;
  cfg.records_per_client = 5000;
  cfg.batch = 32;
  cfg.slots = 4;
  cfg.sink_die_after = 2000;  // per connection: about ten restarts
  cfg.compute = config::compute_on::cpu;
  auto r = run_with(cfg);
  INFO("error: " << r.error << "; in " << r.in << ", confirmed " << r.confirmed << ", sink " << r.sink_count
                 << ", restarts " << r.sink_restarts << ", reconnects " << r.reconnects << ", resent "
                 << r.resent_batches << ", duplicates " << r.sink_duplicates);
  CHECK(r.error.empty());
  CHECK(r.in == 20000);
  CHECK(r.sink_restarts >= 5);
  CHECK(r.reconnects >= r.sink_restarts);  // more if a link stalled past ack_timeout on a loaded machine
  // The sink applied a batch and dropped the link before acking it, each
  // time: it came back resent, and the sink discarded it.
  CHECK(r.sink_duplicates >= r.sink_restarts);
  CHECK(r.resent_batches >= r.sink_duplicates);
  CHECK(r.lost == 0);
  CHECK(r.confirmed == r.in);
  CHECK(r.confirmed_checksum == r.in_checksum);
  CHECK(r.sink_count == r.in);
  CHECK(r.sink_checksum == r.in_checksum);
  CHECK(r.ok());
}

TEST_CASE("pipeline: a restart on every batch, slow sink, several slots in flight") {
  config cfg;
  cfg.clients = 2;
  cfg.records_per_client = 300;
  cfg.batch = 8;
  cfg.slots = 4;
  cfg.sink_delay_us = 500;
  cfg.sink_die_after = 1;  // the sink drops the link after every batch it applies
  cfg.compute = config::compute_on::cpu;
  auto r = run_with(cfg);
  INFO("error: " << r.error << "; in " << r.in << ", confirmed " << r.confirmed << ", restarts " << r.sink_restarts
                 << ", duplicates " << r.sink_duplicates);
  CHECK(r.ok());
  CHECK(r.in == 600);
  CHECK(r.sink_restarts >= 600 / 8);
  CHECK(r.sink_count == r.in);
  CHECK(r.sink_checksum == r.in_checksum);
}

TEST_CASE("pipeline: a sink that never comes back surfaces an error and the lost records are counted") {
  config cfg;
  cfg.clients = 4;
  cfg.records_per_client = 5000;
  cfg.batch = 32;
  cfg.slots = 4;
  cfg.sink_die_after = 2000;
  cfg.sink_lives = 2;             // then it stops listening
  cfg.reconnect_give_up_s = 0.5;  // how long the network stage keeps trying
  cfg.compute = config::compute_on::cpu;
  auto r = run_with(cfg);
  MESSAGE("error: " << r.error << "; in " << r.in << ", confirmed " << r.confirmed << ", lost " << r.lost);
  CHECK_FALSE(r.ok());
  CHECK(r.error.find("sink unreachable") != std::string::npos);
  CHECK(r.sink_restarts == 2);
  CHECK(r.lost > 0);
  CHECK(r.confirmed + r.lost == r.in);
  CHECK(r.confirmed <= r.sink_count);
}

TEST_CASE("pipeline: stop mid-stream drains everything in flight, out == in") {
  config cfg;
  cfg.clients = 8;
  cfg.records_per_client = 0;  // until stopped
  cfg.duration_s = 0.3;
  auto r = run_with(cfg);
  INFO("error: " << r.error);
  CHECK(r.ok());
  CHECK(r.in > 0);
  CHECK(r.lost == 0);
  CHECK(r.sink_count == r.in);
  CHECK(r.sink_checksum == r.in_checksum);
}
