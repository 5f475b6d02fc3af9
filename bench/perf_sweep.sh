#!/bin/bash
# A message-size sweep of shuttle-perf beside a reference tool, the raw
# outputs saved for bench/plot.py:
#   verbs: shuttle-perf (verbs provider) and perftest (ib_write_bw, ...) on
#          Soft-RoCE inside ONE QEMU guest (tests/softrdma/guest-run.sh, as
#          bench/verbs_perf.sh: RoCE MTU 4096, the same fair options);
#   tcp:   shuttle-perf (tcp provider) and ucx_perftest (UCX_TLS=tcp; Debian's
#          ucx-utils) on 127.0.0.1. UCX has no read-latency test: read_lat
#          is shuttle's alone there.
# Files in OUT_DIR: shuttle-TEST.jsonl (shuttle-perf --json rows),
# perftest-TEST.txt or ucx-TEST.txt (each run's output as the tool printed
# it; ucx runs each after a "# ucx_perftest -t T -s BYTES" line, the size
# being in no line of its own). One run per tool, test and size, no
# repetitions: a plot's shape, not a verdict (bench/verbs_perf.sh and
# bench/tcp_perf.sh give those). Then, e.g.:
#   python3 bench/plot.py -o perf.png OUT_DIR
#
# Usage: [SIZES="64 512 ..."] [TESTS="write_bw read_bw write_lat read_lat"]
#        bench/perf_sweep.sh verbs|tcp OUT_DIR [BUILD_DIR]
# Iterations: bw min(2000, max(100, 16 MiB / size)) at depth 128, latency 300.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
sizes=${SIZES:-64 512 4096 32768 262144 1048576}
tests=${TESTS:-write_bw read_bw write_lat read_lat}
bw_iters() { local n=$(((16 << 20) / $1)); [ $n -gt 2000 ] && n=2000; [ $n -lt 100 ] && n=100; echo $n; }
lat_iters=300

if [ "${1:-}" = --in-guest ]; then
  # Every file's content goes to stdout after a line "@@file NAME"; the host
  # side sorts it into OUT_DIR.
  perf=$2
  # shellcheck source=guest_common.sh
  . "$here/guest_common.sh"
  work=$(mktemp -d)
  port=19000
  spid=
  trap '[ -n "$spid" ] && kill $spid 2>/dev/null; true' EXIT
  finish() {  # wait for the server, at most 30 s
    for _ in $(seq 300); do kill -0 $spid 2>/dev/null || break; sleep 0.1; done
    kill $spid 2>/dev/null || true; wait $spid 2>/dev/null || true; spid=
  }
  for size in $sizes; do
    for t in $tests; do
      case $t in
      *_lat) n=$lat_iters sx="--rx-depth 16" ;;  # bench/verbs_perf.sh says why --rx-depth 16
      *) n=$(bw_iters "$size") sx="--slots 1 --depth 128" ;;
      esac
      echo "perf_sweep: $t $size B, $n iterations" >&2
      port=$((port + 1))
      # shellcheck disable=SC2086
      $perf $O --bind $addr --port $port $sx >$work/s.log 2>&1 &
      spid=$!
      if wait_for $work/s.log listening; then
        # shellcheck disable=SC2086
        if timeout 300 $perf $addr $O --port $port $sx --test $t --size $size --iters $n --json >$work/c.log 2>&1; then
          echo "@@file shuttle-$t.jsonl"; grep '^{' $work/c.log; echo "@@end"
        else
          echo "@@end"; echo "perf_sweep: shuttle-perf $t $size failed:" >&2; cat $work/c.log $work/s.log >&2
        fi
      fi
      finish
      port=$((port + 1))
      bin=ib_$t
      # shellcheck disable=SC2086
      $bin $P -p $port -s $size -n $n >$work/ps.log 2>&1 &
      spid=$!
      if wait_listen $port $spid; then
        # shellcheck disable=SC2086
        if timeout 300 $bin $P -p $port -s $size -n $n $addr >$work/pc.log 2>&1; then
          echo "@@file perftest-$t.txt"; cat $work/pc.log; echo "@@end"
        else
          echo "@@end"; echo "perf_sweep: $bin $size failed:" >&2; cat $work/pc.log $work/ps.log >&2
        fi
      fi
      finish
    done
  done
  exit 0
fi

mode=${1:?usage: bench/perf_sweep.sh verbs|tcp OUT_DIR [BUILD_DIR]}
out=${2:?usage: bench/perf_sweep.sh verbs|tcp OUT_DIR [BUILD_DIR]}
build=${3:-build-bench}
cd "$here/.."
if [ ! -d "$build" ]; then meson setup "$build" --buildtype=release >/dev/null; fi
ninja -C "$build" examples/shuttle-perf >/dev/null
perf=$(readlink -f "$build/examples/shuttle-perf")
mkdir -p "$out"
rm -f "$out"/shuttle-*.jsonl "$out"/perftest-*.txt "$out"/ucx-*.txt
echo "# host load average: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores); sizes: $sizes; tests: $tests" >&2

case $mode in
verbs)
  for t in $tests; do
    command -v "ib_$t" >/dev/null || { echo "perf_sweep.sh: ib_$t not found (apt-get install perftest)" >&2; exit 1; }
  done
  set +e
  bash tests/softrdma/guest-run.sh -M 9000 -t 6000 -e SIZES="$sizes" -e TESTS="$tests" -- \
    bash "$(readlink -f "$0")" --in-guest "$perf" |
    awk -v dir="$out" '/^@@file / { f = dir "/" $2; next } /^@@end$/ { f = ""; next }
                       { if (f != "") print >> f; else print > "/dev/stderr" }'
  rc=${PIPESTATUS[0]}
  [ "$rc" = 77 ] && echo "perf_sweep.sh: no Soft-RoCE guest available (skipped)" >&2
  exit "$rc"
  ;;
tcp)
  command -v ucx_perftest >/dev/null ||
    { echo "perf_sweep.sh: ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 1; }
  export UCX_TLS=tcp
  work=$(mktemp -d)
  spid=
  trap '[ -n "$spid" ] && kill "$spid" 2>/dev/null; rm -rf "$work"' EXIT
  port=$((20000 + RANDOM % 20000))
  wait_listen() {  # port: until something listens on it
    for _ in $(seq 200); do ss -Hltn "sport = :$1" 2>/dev/null | grep -q LISTEN && return 0; sleep 0.05; done
    echo "perf_sweep.sh: nothing listens on port $1" >&2; return 1
  }
  for size in $sizes; do
    for t in $tests; do
      case $t in *_lat) n=$lat_iters d=1 ;; *) n=$(bw_iters "$size") d=16 ;; esac  # depth 16: bench/tcp_perf.sh's
      echo "perf_sweep: $t $size B, $n iterations" >&2
      port=$((port + 1))
      "$perf" --transport tcp --bind 127.0.0.1 --port $port >"$work/s.log" 2>&1 &
      spid=$!
      wait_listen $port
      "$perf" 127.0.0.1 --transport tcp --port $port --test "$t" --size "$size" --iters "$n" --depth $d --json \
        >"$work/c.log" 2>&1 || { cat "$work/c.log" "$work/s.log" >&2; exit 1; }
      grep '^{' "$work/c.log" >>"$out/shuttle-$t.jsonl"
      wait "$spid" 2>/dev/null || true; spid=
      case $t in write_bw) u=ucp_put_bw ;; read_bw) u=ucp_get ;; write_lat) u=ucp_put_lat ;; *) continue ;; esac
      port=$((port + 1))
      ucx_perftest -p $port >"$work/us.log" 2>&1 &
      spid=$!
      wait_listen $port
      echo "# ucx_perftest -t $u -s $size -n $n" >>"$out/ucx-$t.txt"
      ucx_perftest 127.0.0.1 -p $port -t $u -s "$size" -n "$n" -w $((n / 10 + 1)) -f >>"$out/ucx-$t.txt" 2>&1 ||
        { cat "$work/us.log" >&2; exit 1; }
      wait "$spid" 2>/dev/null || true; spid=
    done
  done
  ;;
*)
  echo "usage: bench/perf_sweep.sh verbs|tcp OUT_DIR [BUILD_DIR]" >&2; exit 2 ;;
esac
