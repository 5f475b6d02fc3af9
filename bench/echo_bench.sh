#!/bin/bash
# Echo: shuttle-echo-server vs the Boost.Asio C++20-coroutine echo server
# (bench/asio_echo_server.cpp), driven by the same client in the same run, at
# 1, 64 and 1024 connections with 64 B and 4 KiB messages. Prints requests/s
# for both and the ratio shuttle/asio (targets: >= 1.0 everywhere, >= 1.3 at
# 1024 connections). Server and client share this machine's cores, so the
# ratios matter, not the absolute numbers.
#
# Usage: bench/echo_bench.sh [BUILD_DIR] [DURATION_S] [SERVER_THREADS] [CLIENT_THREADS] [SHUTTLE_SERVER_ARGS]
# e.g. SHUTTLE_SERVER_ARGS="--recv-ring 1024" for kernel-provided receive buffers.
set -euo pipefail
build=${1:-build-bench}
duration=${2:-3}
sthreads=${3:-1}
cthreads=${4:-1}
shuttle_args=${5:-}
cd "$(dirname "$0")/.."
if [ ! -d "$build" ]; then meson setup "$build" --buildtype=release >/dev/null; fi
ninja -C "$build" examples/shuttle-echo-server examples/shuttle-echo-client bench/asio_echo_server >/dev/null
ulimit -n 65536 2>/dev/null || true

pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; true' EXIT
start_server() {  # binary -> sets pid and port
  local log; log=$(mktemp)
  "$@" --port 0 --threads "$sthreads" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do grep -q "listening on port" "$log" && break; sleep 0.05; done
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log")
  [ -n "$port" ] || { cat "$log"; exit 1; }
}
stop_server() { kill -INT "$pid"; wait "$pid" || true; pid=; }
measure() {  # connections size -> requests/s
  "$build/examples/shuttle-echo-client" --host 127.0.0.1 --port "$port" --connections "$1" --size "$2" \
    --duration "$duration" --threads "$cthreads" --json | tail -n 1 |
    python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["errors"]==0, d; print("%.0f %.1f" % (d["requests_per_s"], d["p99_us"]))'
}

printf "%-6s %-6s %14s %10s %14s %10s %8s\n" conns size shuttle_req/s p99_us asio_req/s p99_us ratio
for size in 64 4096; do
  for conns in 1 64 1024; do
    # Alternate the order so neither server always runs on a warmer machine.
    # shellcheck disable=SC2086
    start_server "$build/examples/shuttle-echo-server" $shuttle_args; read -r s_rps s_p99 < <(measure $conns $size); stop_server
    start_server "$build/bench/asio_echo_server"; read -r a_rps a_p99 < <(measure $conns $size); stop_server
    ratio=$(python3 -c "print('%.3f' % ($s_rps / $a_rps))")
    printf "%-6s %-6s %14s %10s %14s %10s %8s\n" "$conns" "$size" "$s_rps" "$s_p99" "$a_rps" "$a_p99" "$ratio"
  done
done
