#!/bin/bash
# shuttle-perf over the tcp provider vs UCX's tcp transport (ucx_perftest, UCP
# tests with UCX_TLS=tcp) and vs iperf3 single-stream, all on 127.0.0.1, in the
# same run (order alternated per point). Prints a table of ratios:
#   write_bw, read_bw at 64 KiB, 1 MiB, 4 MiB:   shuttle / UCX ucp_put_bw|ucp_get   (target >= 1.2)
#                                               shuttle write_bw / iperf3           (target >= 0.8)
#   write_lat at 8 B, 64 KiB, 1 MiB, 4 MiB:      shuttle / UCX ucp_put_lat, typical (target <= 1.0),
#                                               medians of LAT_REPS (3) alternated runs
# Bandwidths are MB/s with MB = 2^20 (perftest's and ucx_perftest's unit).
# Server and client share this machine's cores: the ratios matter, not the
# absolute numbers.
#
# Usage: bench/tcp_perf.sh [BUILD_DIR] [DEPTH]   (installs ucx-utils and iperf3 with apt-get when missing)
set -euo pipefail
build=${1:-build-bench}
depth=${2:-16}
cd "$(dirname "$0")/.."
if [ ! -d "$build" ]; then meson setup "$build" --buildtype=release >/dev/null; fi
ninja -C "$build" examples/shuttle-perf >/dev/null
perf=$build/examples/shuttle-perf

missing=()
for p in ucx-utils iperf3; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "tcp_perf.sh: installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >/dev/null
fi

export UCX_TLS=tcp
export SHUTTLE_TRANSPORT=tcp
work=$(mktemp -d)
spid=
cleanup() { [ -n "$spid" ] && kill "$spid" 2>/dev/null; rm -rf "$work"; true; }
trap cleanup EXIT
port=$((20000 + RANDOM % 20000))

wait_listen() {  # port: until something listens on 127.0.0.1:port (tcp)
  for _ in $(seq 200); do
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q LISTEN && return 0
    sleep 0.05
  done
  echo "tcp_perf.sh: nothing listens on port $1" >&2; return 1
}
finish_server() { wait "$spid" 2>/dev/null || true; spid=; }

iters_for() {  # size -> iterations (about 1 GiB per bandwidth point, at least 200)
  local n=$(( (1 << 30) / $1 )); [ $n -gt 20000 ] && n=20000; [ $n -lt 200 ] && n=200; echo $n
}

shuttle() {  # test size iters depth -> "bw_avg" or "t_typical"
  port=$((port + 1))
  "$perf" --transport tcp --bind 127.0.0.1 --port $port >"$work/s.log" 2>&1 &
  spid=$!
  wait_listen $port
  "$perf" 127.0.0.1 --transport tcp --port $port --test "$1" --size "$2" --iters "$3" --depth "$4" --json \
    >"$work/c.log" 2>&1 || { cat "$work/c.log" "$work/s.log" >&2; exit 1; }
  finish_server
  grep '^{' "$work/c.log" | python3 -c 'import json,sys; d=json.loads(sys.stdin.readline());
print("%.2f" % (d["bw_avg_mb_s"] if "bw_avg_mb_s" in d else d["t_typical_us"]))'
}

ucx() {  # test size iters -> bandwidth average MB/s (bw tests) or 50%ile latency us (lat)
  port=$((port + 1))
  ucx_perftest -p $port >"$work/us.log" 2>&1 &
  spid=$!
  wait_listen $port
  ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" -w $(( $3 / 10 + 1 )) -f >"$work/uc.log" 2>&1 ||
    { cat "$work/uc.log" "$work/us.log" >&2; exit 1; }
  finish_server
  # -f prints only the final row: iterations, overhead/latency 50%ile avg overall, MB/s avg overall, msg/s ...
  awk -v lat="$4" '$1 ~ /^[0-9]+$/ && NF >= 7 { v = lat ? $2 : $5 } END { if (v == "") exit 1; print v }' "$work/uc.log"
}

iperf() {  # -> MB/s
  port=$((port + 1))
  iperf3 -s -1 -p $port >"$work/is.log" 2>&1 &
  spid=$!
  wait_listen $port
  iperf3 -c 127.0.0.1 -p $port -t 3 --json >"$work/ic.json" 2>&1 || { cat "$work/ic.json" >&2; exit 1; }
  finish_server
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1]));
print("%.2f" % (d["end"]["sum_received"]["bits_per_second"] / 8 / 1048576))' "$work/ic.json"
}

ratio() { python3 -c "print('%.3f' % ($1 / $2))"; }
verdict() {  # value op target
  python3 -c "print('ok' if $1 $2 $3 else 'MISS')"
}

echo "# tcp_perf: shuttle-perf (tcp provider, depth $depth) vs ucx_perftest UCX_TLS=tcp ($(ucx_info -v | sed -n 's/^# Version //p')) vs iperf3 -P1, loopback"
echo "# bandwidth MB/s (2^20), latency us (one-way, half the ping-pong round trip; typical = median)"
printf "%-10s %-8s %12s %12s %8s %12s %8s %s\n" test bytes shuttle ucx_tcp ratio iperf3 ratio verdict
flip=0
ip_bw=
for size in 65536 1048576 4194304; do
  n=$(iters_for $size)
  for t in write_bw read_bw; do
    u=$([ $t = write_bw ] && echo ucp_put_bw || echo ucp_get)
    if [ $flip = 0 ]; then s=$(shuttle $t $size $n "$depth"); b=$(ucx $u $size $n 0)
    else b=$(ucx $u $size $n 0); s=$(shuttle $t $size $n "$depth"); fi
    flip=$((1 - flip))
    r=$(ratio "$s" "$b")
    v=$(verdict "$r" ">=" 1.2)
    if [ $t = write_bw ]; then
      ip=$(iperf); ri=$(ratio "$s" "$ip"); vi=$(verdict "$ri" ">=" 0.8)
      [ "$vi" = ok ] || v="$v(iperf3:MISS)"
    else ip=-; ri=-; fi
    printf "%-10s %-8s %12s %12s %8s %12s %8s %s\n" $t $size "$s" "$b" "$r" "$ip" "$ri" "$v"
  done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# Latency: the median of LAT_REPS (default 3) alternated runs of each.
for size in 8 65536 1048576 4194304; do
  n=$(( $(iters_for $size) / 4 )); [ $n -gt 5000 ] && n=5000; [ $n -lt 100 ] && n=100
  ss=() bs=()
  for _ in $(seq "${LAT_REPS:-3}"); do
    if [ $flip = 0 ]; then ss+=("$(shuttle write_lat $size $n 1)"); bs+=("$(ucx ucp_put_lat $size $n 1)")
    else bs+=("$(ucx ucp_put_lat $size $n 1)"); ss+=("$(shuttle write_lat $size $n 1)"); fi
    flip=$((1 - flip))
  done
  s=$(median "${ss[@]}") b=$(median "${bs[@]}")
  r=$(ratio "$s" "$b")
  printf "%-10s %-8s %12s %12s %8s %12s %8s %s\n" write_lat $size "$s" "$b" "$r" - - "$(verdict "$r" "<=" 1.0)"
done
