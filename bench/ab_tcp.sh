#!/bin/bash
# A/B: two sets of shuttle binaries (directories A and B, each holding
# shuttle-echo-server, shuttle-echo-client and shuttle-perf, e.g. an old
# release and a new one) on the same machine in the same run, over TCP on
# 127.0.0.1. Needs only bash, coreutils and python3 at run time (no meson,
# ninja, ss or perf tools): build the binaries elsewhere with
# -Dstatic_uring=true (and -Drdma=disabled unless the machine has rdma-core)
# and carry them.
#
# Rows:
#   echo tcp           A's and B's shuttle-echo-server --transport tcp, driven
#                      by B's shuttle-echo-client (the server is the only thing
#                      that differs), at CONNS x SIZES: requests/s.
#   echo tcp-provider  the same with --transport tcp-provider, when A's server
#                      talks to B's client; when it does not (a changed wire
#                      protocol: f3c3b61's v1 against v2), each server is
#                      driven by the client of its own set (the header says
#                      which). Servers that have --max-handshakes get it
#                      raised to the connection count, so that a point measures
#                      echoing, not a handshake cap.
#   perf write_bw, read_bw (64 KiB, 1 MiB; MB/s, MB = 2^20, bw_avg) and
#                      write_lat (8 B; typical one-way us): shuttle-perf over
#                      the tcp provider, A's server + client against B's.
# Every point runs REPS times for each set, alternately (A first on odd
# repetitions, B first on even ones, so that a slow phase of the machine
# tends to hit both runs of a repetition). Columns:
#   A, B         the medians of the REPS runs of each set;
#   B/A          the median of the per-repetition ratios, oriented so that
#                > 1 means B is better (requests/s and MB/s: B/A; latency:
#                A/B);
#   90% CI       a bootstrap 90% interval of that median (median_ci.py):
#                wide means noisy, more REPS help;
#   verdict      tie: the interval contains 1.0 or B/A is within 3% of 1;
#                else better / worse (B against A); fail: no repetition
#                with both values;
#   fail         runs that failed (client errors, a non-zero exit, a
#                server that found wrong data): their values are left out,
#                the first lines of their logs go to stderr.
# Server and client are pinned to disjoint CPU sets (taskset) when the
# machine has at least 4 cores: 8 or more: server on 2-3, client on 4-7
# with 4 echo client threads (capped by the connections); 4-7: server on 1,
# client on 2-3 with 2 client threads; fewer: not pinned, one client thread.
# The echo server runs SERVER_THREADS (1) threads (tcp-provider: always 1).
# Run on a quiet machine: the ratios are what matter, and load from anything
# else widens their intervals.
#
# Usage: bench/ab_tcp.sh [--quick] [A_DIR B_DIR]
#   A_DIR, B_DIR default to .device/ab/A and .device/ab/B (binaries carried
#   to the device machine: bash bench/ab_tcp.sh from the checkout root).
#   --quick: a few seconds per point (1 s echo runs, fewer perf iterations,
#   REPS 3 unless set): to test the script, not to decide.
# Environment: REPS (5), DURATION (echo seconds per run: 3, --quick 1),
#   SIZES ("64 4096"), CONNS ("1 64 1024"), MODES ("tcp tcp-provider"),
#   PERF ("write_bw:65536 write_bw:1048576 read_bw:65536 read_bw:1048576
#   write_lat:8"; empty: no perf rows), PERF_DEPTH (16, as tcp_perf.sh),
#   SERVER_CPUS / CLIENT_CPUS (taskset lists; "" with PIN=0: not pinned),
#   SERVER_THREADS (1), CLIENT_THREADS, ECHO=0 (no echo rows),
#   TCP_SERVER_ARGS (more echo server options for the tcp rows, both sets).
# e.g. REPS=7 bench/ab_tcp.sh /tmp/old/examples build-ab/examples
# A full run (5 reps, 3 s echo runs) takes about 4 minutes per echo mode and
# 2 for the perf rows on 16 quiet cores; under a 10-minute limit per command
# run it in three parts: MODES=tcp PERF= ..., MODES=tcp-provider PERF= ...,
# ECHO=0 ....
#
# Making the sets (here: A = an old commit, B = this checkout), on a machine
# with meson; the binaries need libstdc++ and glibc >= the build machine's:
#   git worktree add --detach /tmp/ab-a OLD_COMMIT
#   for t in /tmp/ab-a .; do (cd $t && meson setup build-ab --buildtype=release \
#     -Dstatic_uring=true -Drdma=disabled -Dcuda=disabled -Dasio=disabled -Dtests=disabled \
#     -Dbench=false && ninja -C build-ab examples/shuttle-echo-server \
#     examples/shuttle-echo-client examples/shuttle-perf); done
#   mkdir -p .device/ab/A .device/ab/B
#   cp /tmp/ab-a/build-ab/examples/shuttle-{echo-server,echo-client,perf} .device/ab/A/
#   cp build-ab/examples/shuttle-{echo-server,echo-client,perf} .device/ab/B/
#   ldd .device/ab/*/shuttle-perf   # no liburing, no libibverbs
set -euo pipefail
quick=0
if [ "${1:-}" = --quick ]; then quick=1; shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)
A=${1:-$root/.device/ab/A}
B=${2:-$root/.device/ab/B}
A=$(cd "$A" && pwd) B=$(cd "$B" && pwd)
for d in "$A" "$B"; do
  for b in shuttle-echo-server shuttle-echo-client shuttle-perf; do
    [ -x "$d/$b" ] || { echo "ab_tcp.sh: $d/$b missing or not executable" >&2; exit 2; }
  done
done

if [ $quick = 1 ]; then reps=${REPS:-3} duration=${DURATION:-1}; else reps=${REPS:-5} duration=${DURATION:-3}; fi
sizes=${SIZES:-64 4096}
conns_list=${CONNS:-1 64 1024}
modes=${MODES:-tcp tcp-provider}
tcp_server_args=${TCP_SERVER_ARGS:-}  # e.g. "--recv-ring 1024": both servers, tcp rows
perf_points=${PERF-write_bw:65536 write_bw:1048576 read_bw:65536 read_bw:1048576 write_lat:8}
depth=${PERF_DEPTH:-16}
sthreads=${SERVER_THREADS:-1}
cores=$(nproc)
if [ "${PIN:-1}" = 0 ]; then def_s='' def_c='' def_t=1
elif [ "$cores" -ge 8 ]; then def_s=2-3 def_c=4-7 def_t=4
elif [ "$cores" -ge 4 ]; then def_s=1 def_c=2-3 def_t=2
else def_s='' def_c='' def_t=1; fi
server_cpus=${SERVER_CPUS-$def_s}
client_cpus=${CLIENT_CPUS-$def_c}
cthreads=${CLIENT_THREADS:-$def_t}

# Connections held open by both sides at once: raise the descriptor limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
work=$(mktemp -d)
spid=
cleanup() { if [ -n "$spid" ]; then kill "$spid" 2>/dev/null || true; fi; rm -rf "$work"; }
trap cleanup EXIT

pin() {  # cpus cmd...: execs cmd (pinned to cpus when set): call it in a subshell or with &
  local cpus=$1; shift
  if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
show_failure() {  # what log...: the first lines of each log, on stderr
  local what=$1; shift
  echo "ab_tcp.sh: FAILED: $what" >&2
  local f; for f in "$@"; do [ -s "$f" ] && head -n 8 "$f" | sed 's/^/    /' >&2; done
  return 0
}
wait_line() {  # log regex: until the log has a line matching regex (10 s)
  for _ in $(seq 200); do grep -q "$2" "$1" && return 0; kill -0 "$spid" 2>/dev/null || return 1; sleep 0.05; done
  return 1
}
stop_server() {  # signal: stops the server (if still running), waits for it (5 s, then SIGKILL)
  [ -n "$spid" ] || return 0
  kill "-$1" "$spid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$spid" 2>/dev/null || break; sleep 0.05; done
  kill -9 "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  spid=
}
has_flag() { "$1" --help 2>&1 | grep -q -- "$2"; }

# ---------------------------------------------------------------- echo
start_echo_server() {  # dir mode conns -> spid, port ("" on failure)
  local args=(--port 0 --transport "$2")
  if [ "$2" = tcp ]; then args+=(--threads "$sthreads" $tcp_server_args)
  elif has_flag "$1/shuttle-echo-server" --max-handshakes && [ "$3" -gt 64 ]; then
    args+=(--max-handshakes "$3")
  fi
  pin "$server_cpus" "$1/shuttle-echo-server" "${args[@]}" >"$work/es.log" 2>&1 &
  spid=$!
  port=
  wait_line "$work/es.log" "listening on port" || return 0
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$work/es.log")
}
echo_run() {  # server_dir client_dir mode conns size -> requests/s or nan
  local port t=$cthreads
  [ "$t" -gt "$4" ] && t=$4
  start_echo_server "$1" "$3" "$4"
  if [ -z "$port" ]; then stop_server KILL; show_failure "echo server $1 $3" "$work/es.log"; echo nan; return; fi
  local rc=0
  (pin "$client_cpus" timeout $((duration + 120)) "$2/shuttle-echo-client" --host 127.0.0.1 --port "$port" \
    --transport "$3" --connections "$4" --size "$5" --duration "$duration" --threads "$t" --json) \
    >"$work/ec.log" 2>&1 || rc=$?
  stop_server INT
  local v
  v=$(tail -n 1 "$work/ec.log" | python3 -c 'import json,sys
try: d = json.loads(sys.stdin.readline())
except ValueError: print("nan"); sys.exit()
print("%.1f" % d["requests_per_s"] if d["errors"] == 0 and d["requests"] > 0 else "nan")')
  if [ $rc != 0 ] || [ "$v" = nan ]; then
    show_failure "echo $3 server $1 client $2, $4 connections, $5 B (exit $rc)" "$work/ec.log" "$work/es.log"
    v=nan
  fi
  echo "$v"
}
# Does B's echo client talk to A's server in this mode? (1 connection, 0.3 s)
# Sets a_wire to A's provider as its server names it.
client_fits() {  # mode
  local port
  start_echo_server "$A" "$1" 1
  [ -n "$port" ] || { stop_server KILL; return 1; }
  a_wire=$(grep -o 'wire protocol v[0-9]*' "$work/es.log" | head -n 1 || true)
  local ok=0
  timeout 30 "$B/shuttle-echo-client" --host 127.0.0.1 --port "$port" --transport "$1" --duration 0.3 \
    >/dev/null 2>&1 || ok=1
  stop_server INT
  return $ok
}

# ---------------------------------------------------------------- perf
iters_for() {  # test size -> iterations: a few seconds (--quick: a fraction of one) per run
  local n
  case $1 in
    *_lat) n=$([ $quick = 1 ] && echo 2000 || echo 20000) ;;
    *) n=$(( ($([ $quick = 1 ] && echo 256 || echo 3072) << 20) / $2 )) ;;
  esac
  # Never a handful: a run of fewer iterations than 16 x depth (with the
  # default warm-up) is known to report wrong data (write_bw 4096 x100).
  [ "$n" -lt $((16 * depth)) ] && n=$((16 * depth))
  echo "$n"
}
perf_run() {  # dir test size -> MB/s (bw) or typical us (lat), nan on failure
  pin "$server_cpus" "$1/shuttle-perf" --transport tcp --bind 127.0.0.1 --port 0 >"$work/ps.log" 2>&1 &
  spid=$!
  local port=
  wait_line "$work/ps.log" "listening on" &&
    port=$(sed -n 's/.*listening on .*:\([0-9]*\)$/\1/p' "$work/ps.log" | head -n 1)
  if [ -z "$port" ]; then stop_server KILL; show_failure "shuttle-perf server $1" "$work/ps.log"; echo nan; return; fi
  local iters d rc=0
  iters=$(iters_for "$2" "$3")
  d=$([[ $2 == *_lat ]] && echo 1 || echo "$depth")
  (pin "$client_cpus" timeout 600 "$1/shuttle-perf" 127.0.0.1 --transport tcp --port "$port" --test "$2" \
    --size "$3" --iters "$iters" --warmup $((iters / 10)) --depth "$d" --json) >"$work/pc.log" 2>&1 || rc=$?
  # The server ends when its client goes; a stuck one is stopped.
  for _ in $(seq 100); do kill -0 "$spid" 2>/dev/null || break; sleep 0.05; done
  stop_server TERM
  local v
  v=$(grep '^{' "$work/pc.log" | tail -n 1 | python3 -c 'import json,sys
try: d = json.loads(sys.stdin.readline())
except ValueError: print("nan"); sys.exit()
print("%.3f" % (d["bw_avg_mb_s"] if "bw_avg_mb_s" in d else d["t_typical_us"]))')
  if [ $rc != 0 ] || [ "$v" = nan ] || grep -qi "wrong data" "$work/ps.log" "$work/pc.log"; then
    show_failure "shuttle-perf $2 $3 B x$iters depth $d, $1 (exit $rc)" "$work/pc.log" "$work/ps.log"
    v=nan
  fi
  echo "$v"
}

# ---------------------------------------------------------------- rows
row() {  # label higher|lower pairs...: one printed row
  local label=$1 way=$2; shift 2
  local a b r lo hi verdict failed
  read -r a b r lo hi verdict failed < <(python3 "$root/bench/ab_row.py" "$way" "$@")
  printf "%-36s %12s %12s %7s %13s %-7s %4s\n" "$label" "$a" "$b" "$r" "$lo-$hi" "$verdict" "$failed"
}
ab_pairs() {  # fn args...: REPS alternated pairs "A,B" of fn's value for each set (fn DIR args...)
  local rep x y
  for rep in $(seq "$reps"); do
    if [ $((rep % 2)) = 1 ]; then x=$("$@" A); y=$("$@" B); else y=$("$@" B); x=$("$@" A); fi
    printf '%s,%s ' "$x" "$y"
  done
}
set_dir() { [ "$1" = A ] && echo "$A" || echo "$B"; }
echo_point() {  # mode conns size which
  local s; s=$(set_dir "$4")
  echo_run "$s" "$([ "${own_client[$1]}" = 1 ] && echo "$s" || echo "$B")" "$1" "$2" "$3"
}
perf_point() { perf_run "$(set_dir "$3")" "$1" "$2"; }

declare -A own_client=()
a_wire=
echo "# ab_tcp: A = $A"
echo "#         B = $B"
if [ -n "$tcp_server_args" ]; then echo "# tcp rows: both servers also get: $tcp_server_args"; fi
echo "# $reps reps per point, alternated; echo ${duration}s per run, $sthreads server thread(s) (tcp)," \
  "$cthreads client thread(s); perf depth $depth (bw); cpus server '${server_cpus:-any}'" \
  "client '${client_cpus:-any}'; $cores cpus, load $(cut -d' ' -f1-3 /proc/loadavg)$([ $quick = 1 ] && echo '; QUICK')"
if [ "${ECHO:-1}" != 0 ]; then
  for mode in $modes; do
    if client_fits "$mode"; then own_client[$mode]=0
      echo "# echo $mode: both servers driven by B's shuttle-echo-client"
    else own_client[$mode]=1
      echo "# echo $mode: B's client cannot talk to A's server (A's: ${a_wire:-no wire version printed}): each server driven by its own set's client"
    fi
    if [ "$mode" != tcp ]; then
      for s in A B; do
        has_flag "$(set_dir $s)/shuttle-echo-server" --max-handshakes &&
          echo "# echo $mode: $s's server gets --max-handshakes CONNS above 64 connections"
      done
    fi
  done
fi
echo "# B/A > 1: B better (echo req/s and bw MB/s: B/A; write_lat us: A/B)"
printf "%-36s %12s %12s %7s %13s %-7s %4s\n" point A B "B/A" "90% CI" verdict fail
if [ "${ECHO:-1}" != 0 ]; then
  for mode in $modes; do
    for size in $sizes; do
      for conns in $conns_list; do
        # shellcheck disable=SC2046
        row "echo $mode ${conns}c ${size}B req/s" higher $(ab_pairs echo_point "$mode" "$conns" "$size")
      done
    done
  done
fi
for p in $perf_points; do
  t=${p%%:*} size=${p#*:}
  way=$([[ $t == *_lat ]] && echo lower || echo higher)
  unit=$([[ $t == *_lat ]] && echo us || echo MB/s)
  # shellcheck disable=SC2046
  row "perf $t ${size}B $unit" "$way" $(ab_pairs perf_point "$t" "$size")
done
