#!/usr/bin/env bash
# The local provider against UCX's shared-memory transports (issue 30's
# targets: >= 1.0x UCX's bandwidth, <= 1.0x its latency), both as two
# processes on this host, in one run:
#   ucx_perftest -t ucp_put_bw  (1 MiB)  vs local_bench --peer: write_bw 1 MiB into a shared region
#   ucx_perftest -t ucp_put_lat (8 B)    vs a write ping-pong, 8 B: each side writes
#     the other's shared region and spins on its own (half a round trip), as
#     ucp_put_lat runs; and write_lat 8 B (a write's completion: the memcpy
#     alone, not like for like, printed for reference)
#   ucx_perftest -t ucp_am_lat  (8 B)    vs send/recv 8 B (half a round trip, as ucx_perftest reports)
#   (and ucp_tag_lat, printed for reference; and ring_pingpong, the rings
#   without the engine, if built)
# UCX_TLS=sm,self. ucx_perftest busy-polls; so do both local_bench
# processes here (io_context::options::ring_spin_budget, SPIN_US, default
# 1000 us: the loops poll the rings, no doorbells). The row "no spin" is the
# default set-up (loops sleep; a doorbell per message). A benchmark script only: it may install ucx-utils
# (apt-get), never run in CI or the tests.
# Usage: bench/local/ucx_compare.sh [build dir, default build-rel] [seconds per local figure, default 1]
set -euo pipefail
build=${1:-build-rel}
secs=${2:-1}
spin_us=${SPIN_US:-1000}
# PIN=1: each side on its own CPU (servers on 0, the measuring sides on 1),
# UCX's and ours alike: two busy-polling processes that share a core (a
# third task on the other one) take turns by time slices.
pin=${PIN:-0}
on() { if [[ $pin == 1 ]]; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }
# As `on`, for a command put in the background: the subshell becomes the
# command (exec), so that $! is its pid and `kill` reaches it.
on_bg() { if [[ $pin == 1 ]]; then exec taskset -c "$1" "${@:2}"; else exec "${@:2}"; fi; }
bench="$build/bench/local/local_bench"
[[ -x $bench ]] || { echo "no $bench: build it first (meson -Dbench=true)" >&2; exit 1; }
if ! command -v ucx_perftest >/dev/null; then
  echo "installing ucx-utils (for ucx_perftest)" >&2
  apt-get install -y ucx-utils >/dev/null
fi
export UCX_TLS=sm,self
port=$((20000 + RANDOM % 20000))

# One ucx_perftest pair; prints the "Final:" line's fields: latency (us,
# average) and bandwidth (MB/s, average; ucx_perftest's MB are 2^20 bytes,
# as local_bench's MiB/s), counted from the end (older
# versions have no percentile column).
ucx() {
  local test=$1 size=$2 iters=$3 port=$4
  on_bg 0 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.5
  local line
  line=$(on 1 ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" -n "$iters" 2>/dev/null | grep '^Final:' || true)
  kill "$srv" 2>/dev/null || true  # a server whose client failed would wait for ever
  wait "$srv" 2>/dev/null || true
  [[ -n $line ]] || { echo "nan nan"; return; }
  awk '{print $(NF-5), $(NF-3)}' <<<"$line"
}

read -r _ ucx_bw < <(ucx ucp_put_bw $((1 << 20)) 2000 "$port")
read -r ucx_put_lat _ < <(ucx ucp_put_lat 8 200000 $((port + 1)))
read -r ucx_am_lat _ < <(ucx ucp_am_lat 8 200000 $((port + 2)))
read -r ucx_tag_lat _ < <(ucx ucp_tag_lat 8 200000 $((port + 3)))

declare -A ours
while read -r k v; do ours[$k]=$v; done < <("$bench" --peer "$secs" "$spin_us" "$pin")
declare -A nospin
while read -r k v; do nospin[$k]=$v; done < <("$bench" --peer "$secs" 0 "$pin")
declare -A sock
while read -r k v; do sock[$k]=$v; done < <(SHUTTLE_LOCAL_RINGS=0 "$bench" --peer "$secs" 0 "$pin")
# The rings alone, no engine (pinned to CPUs 0 and 1 always), if built.
declare -A ring
if [[ -x $build/bench/local/ring_pingpong ]]; then
  while read -r k v _; do ring[$k]=$v; done < <("$build/bench/local/ring_pingpong" "$secs")
fi

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 == 0) print "nan"; else printf "%.2f", a / b }'; }
echo "date: $(date -u +%F) host: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); UCX $(ucx_info -v 2>/dev/null | head -1 | sed 's/^# *//')"
[[ $pin == 1 ]] && echo "pinned: servers on CPU 0, measuring sides on CPU 1"
echo "shuttle: ring_spin_budget ${ours[spin_budget_us]} us on both sides (sleeps per round trip: ${ours[sleeps_per_rtt]}); UCX busy-polls"
printf '%-34s %12s %12s %8s %s\n' "" "shuttle" "UCX sm" "ratio" "target"
printf '%-34s %12s %12s %8s %s\n' "put/write bw 1 MiB (MiB/s)" "${ours[write_bw_1MiB_MiBps]}" "$ucx_bw" \
  "$(ratio "${ours[write_bw_1MiB_MiBps]}" "$ucx_bw")" ">= 1.0"
printf '%-34s %12s %12s %8s %s\n' "put/write lat 8 B, ping-pong (us)" "${ours[write_pingpong_8B_us]}" "$ucx_put_lat" \
  "$(ratio "${ours[write_pingpong_8B_us]}" "$ucx_put_lat")" "<= 1.0"
printf '%-34s %12s %12s %8s %s\n' "write completion 8 B (us)" "${ours[write_lat_8B_us]}" "$ucx_put_lat" \
  "$(ratio "${ours[write_lat_8B_us]}" "$ucx_put_lat")" "(the memcpy alone: not like for like)"
printf '%-34s %12s %12s %8s %s\n' "send lat 8 B, rings (us)" "${ours[send_lat_8B_us]}" "$ucx_am_lat" \
  "$(ratio "${ours[send_lat_8B_us]}" "$ucx_am_lat")" "<= 1.0 (vs ucp_am_lat)"
printf '%-34s %12s %12s %8s %s\n' "send lat 8 B, rings, no spin (us)" "${nospin[send_lat_8B_us]}" "$ucx_am_lat" \
  "$(ratio "${nospin[send_lat_8B_us]}" "$ucx_am_lat")" "(loops sleep: a doorbell each)"
printf '%-34s %12s %12s %8s %s\n' "send lat 8 B, socket path (us)" "${sock[send_lat_8B_us]}" "$ucx_am_lat" \
  "$(ratio "${sock[send_lat_8B_us]}" "$ucx_am_lat")" "(SHUTTLE_LOCAL_RINGS=0)"
if [[ -n ${ring[ring_half_rtt_56B_membarrier_ns]:-} ]]; then
  r=$(awk -v n="${ring[ring_half_rtt_56B_membarrier_ns]}" 'BEGIN { printf "%.4f", n / 1e3 }')
  printf '%-34s %12s %12s %8s %s\n' "56 B, the rings alone (us)" "$r" "$ucx_am_lat" "$(ratio "$r" "$ucx_am_lat")" \
    "(ring_pingpong: no engine)"
fi
printf '%-34s %12s %12s\n' "ucp_tag_lat 8 B (us)" "" "$ucx_tag_lat"
