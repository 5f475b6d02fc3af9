#!/bin/bash
# Echo: shuttle-echo-server vs the Boost.Asio C++20-coroutine echo server
# (bench/asio_echo_server.cpp), driven by the same client in the same run, at
# 1, 64 and 1024 connections with 64 B and 4 KiB messages (targets: >= 1.0
# everywhere, >= 1.3 at 1024 connections).
#
# For each point the two servers run REPS times each, alternately (shuttle
# first on odd repetitions, Asio first on even ones), and the medians are
# printed:
#   req/s        requests per second seen by the client;
#   srv_us/req   the server process's CPU time (user + system, from
#                /proc/PID/stat) per request: what serving one request costs;
#   ratio        shuttle req/s / Asio req/s;
#   cpu_ratio    Asio srv_us/req / shuttle srv_us/req: how much more work
#                the same requests cost the Asio server;
#   cli_us/req   the client's CPU time per request (its own getrusage over
#                the load), with each server;
#   paired       the median of the REPS per-repetition req/s ratios (the two
#                runs of a repetition are adjacent in time, so a slow phase
#                of the machine tends to hit both), with a bootstrap 90%
#                interval of that median: where it is wide, more REPS help.
# Server and client share this machine's cores. When they keep every core
# busy, req/s = cores / (cli_us + srv_us), so the req/s ratio is
# (cli_a + srv_a) / (cli_s + srv_s): a client that costs as much as the
# server halves what a cheaper server can show in req/s; cpu_ratio still
# compares the servers alone. When the client, not the server, is what
# saturates, req/s ratios tend to 1. Run on a quiet machine.
#
# Usage: bench/echo_bench.sh [BUILD_DIR] [DURATION_S] [SERVER_THREADS] [CLIENT_THREADS] [SHUTTLE_SERVER_ARGS]
# Environment: REPS (default 3), SIZES ("64 4096"), CONNS ("1 64 1024"), CLIENT_ARGS (e.g. "--recv-ring 1024": same
# client for both servers), SERVER_CPUS / CLIENT_CPUS (taskset CPU lists, e.g.
# 1 and 0, to pin them apart; default: not pinned).
# e.g. bench/echo_bench.sh build-bench 3 1 2 "--recv-ring 1024"
set -euo pipefail
build=${1:-build-bench}
duration=${2:-3}
sthreads=${3:-1}
cthreads=${4:-1}
shuttle_args=${5:-}
reps=${REPS:-3}
client_args=${CLIENT_ARGS:-}
cd "$(dirname "$0")/.."
# A directory with the three binaries and no build.ninja (carried to another
# machine, e.g. one with more cores) is used as it is.
if [ ! -d "$build" ]; then meson setup "$build" --buildtype=release >/dev/null; fi
if [ -f "$build/build.ninja" ]; then
  ninja -C "$build" examples/shuttle-echo-server examples/shuttle-echo-client bench/asio_echo_server >/dev/null
fi
ulimit -n 65536 2>/dev/null || true
pin() {  # cpus cmd...: execs cmd (pinned to cpus when set): call it in a subshell or with &
  local cpus=$1; shift
  if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}

pid=
log=$(mktemp)
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -f "$log"; true' EXIT
start_server() {  # binary args... -> sets pid and port
  pin "${SERVER_CPUS:-}" "$@" --port 0 --threads "$sthreads" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do grep -q "listening on port" "$log" && break; sleep 0.05; done
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log")
  [ -n "$port" ] || { cat "$log"; exit 1; }
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
stop_server() { kill -INT "$pid"; wait "$pid" || true; pid=; }
measure() {  # server... -> "req/s server_us_per_request p99_us client_us_per_request"
  start_server "$@"
  local t0 t1 out
  t0=$(cpu_ticks)
  # shellcheck disable=SC2086
  out=$( (pin "${CLIENT_CPUS:-}" "$build/examples/shuttle-echo-client" --host 127.0.0.1 --port "$port" \
    --connections "$conns" --size "$size" --duration "$duration" --threads "$cthreads" $client_args --json) | tail -n 1)
  t1=$(cpu_ticks)
  stop_server
  python3 -c 'import json,sys
d = json.loads(sys.argv[1]); assert d["errors"] == 0, d
ticks = int(sys.argv[2]); hz = int(sys.argv[3])
n = max(d["requests"], 1)
print("%.0f %.3f %.1f %.3f" % (d["requests_per_s"], ticks / hz * 1e6 / n, d["p99_us"], d["cpu_s"] * 1e6 / n))' \
    "$out" $((t1 - t0)) "$(getconf CLK_TCK)"
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "echo_bench: $sthreads server thread(s), $cthreads client thread(s), ${duration}s x $reps per server and point," \
  "shuttle server args '${shuttle_args}', client args '${client_args}'," \
  "cpus server '${SERVER_CPUS:-any}' client '${CLIENT_CPUS:-any}', $(nproc) cpus, load $(cut -d' ' -f1 /proc/loadavg)"
printf "%-6s %-6s %12s %10s %8s %10s %12s %10s %8s %10s %7s %9s %7s %13s\n" conns size shuttle_req/s srv_us/req p99_us cli_us/req \
  asio_req/s srv_us/req p99_us cli_us/req ratio cpu_ratio paired "90% CI"
for size in ${SIZES:-64 4096}; do
  for conns in ${CONNS:-1 64 1024}; do
    s_rps=() s_cpu=() s_p99=() s_cli=() a_rps=() a_cpu=() a_p99=() a_cli=()
    for rep in $(seq "$reps"); do
      for which in $([ $((rep % 2)) = 1 ] && echo "s a" || echo "a s"); do
        if [ "$which" = s ]; then
          # shellcheck disable=SC2086
          read -r r c p k < <(measure "$build/examples/shuttle-echo-server" $shuttle_args)
          s_rps+=("$r"); s_cpu+=("$c"); s_p99+=("$p"); s_cli+=("$k")
        else
          read -r r c p k < <(measure "$build/bench/asio_echo_server")
          a_rps+=("$r"); a_cpu+=("$c"); a_p99+=("$p"); a_cli+=("$k")
        fi
      done
    done
    sr=$(median "${s_rps[@]}") sc=$(median "${s_cpu[@]}") sp=$(median "${s_p99[@]}") sk=$(median "${s_cli[@]}")
    ar=$(median "${a_rps[@]}") ac=$(median "${a_cpu[@]}") ap=$(median "${a_p99[@]}") ak=$(median "${a_cli[@]}")
    ratios=$(awk -v s="${s_rps[*]}" -v a="${a_rps[*]}" \
      'BEGIN { n = split(s, x, " "); split(a, y, " "); for (i = 1; i <= n; i++) printf "%s ", (y[i] > 0 ? x[i] / y[i] : "nan") }')
    # shellcheck disable=SC2086
    paired=$(python3 bench/median_ci.py $ratios)
    read -r pr pl ph <<<"$paired"
    printf "%-6s %-6s %12s %10s %8s %10s %12s %10s %8s %10s %7s %9s %7s %13s\n" "$conns" "$size" "$sr" "$sc" "$sp" "$sk" "$ar" "$ac" "$ap" "$ak" \
      "$(python3 -c "print('%.3f' % ($sr / $ar))")" "$(python3 -c "print('%.3f' % ($ac / $sc))")" "$pr" "$pl-$ph"
  done
done
