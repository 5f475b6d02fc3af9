#!/usr/bin/env bash
# Paired A/B of the local provider's latency on a noisy host: each rep runs
# UCX's ucp_am_lat and ucp_put_bw (UCX_TLS=sm,self), then `local_bench --peer`
# of build A and of build B back to back (spinning, pinned as ucx_compare.sh
# PIN=1 pins), and ring_pingpong of build B if built. Compare within a rep;
# take medians over reps. A benchmark script only (not CI).
# Usage: bench/local/ab_latency.sh <build A> <build B> [reps, default 6] [seconds, default 1]
set -uo pipefail
a=${1:?build A}
b=${2:?build B}
reps=${3:-6}
secs=${4:-1}
command -v ucx_perftest >/dev/null || { echo "needs ucx_perftest (apt-get install ucx-utils)" >&2; exit 1; }
export UCX_TLS=sm,self
port=$((20000 + RANDOM % 20000))
ucx() {  # test size iters column-from-end
  taskset -c 0 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.5
  taskset -c 1 ucx_perftest 127.0.0.1 -p "$port" -t "$1" -s "$2" -n "$3" 2>/dev/null |
    awk -v c="$4" '/^Final:/ {print $(NF - c)}'
  kill "$srv" 2>/dev/null
  wait "$srv" 2>/dev/null
  port=$((port + 1))
}
ours() { "$1/bench/local/local_bench" --peer "$secs" 1000 1 | awk '/send_lat_8B_us|write_bw_1MiB/ {printf "%s ", $2}'; }
echo "rep load ucp_am_lat_us ucp_put_bw_MiBps | A: write_bw send_lat_us | B: write_bw send_lat_us | B ring_pingpong ns"
for rep in $(seq 1 "$reps"); do
  am=$(ucx ucp_am_lat 8 200000 5)
  bw=$(ucx ucp_put_bw $((1 << 20)) 2000 3)
  ra=$(ours "$a")
  rb=$(ours "$b")
  rp=""
  [[ -x $b/bench/local/ring_pingpong ]] && rp=$("$b/bench/local/ring_pingpong" 0.5 | awk '{printf "%s ", $2}' | head -c 40)
  echo "$rep $(cut -d' ' -f1 /proc/loadavg) $am $bw | $ra| $rb| $rp"
done
