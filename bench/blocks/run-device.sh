#!/bin/bash
# Issue 31's bandwidth and striping rows on a quiet many-core host (the GPU
# machine used as a 16-core host: no RDMA device, no liburing installed, so
# the binary is built elsewhere with -Dstatic_uring=true and carried).
#
#   here:   bash bench/blocks/run-device.sh --build BUILD_DIR [dir=.device/blocks]
#           (builds blocks_bench in BUILD_DIR, copies it stripped to dir)
#   device: bash bench/blocks/run-device.sh DIR
#           (DIR: that dir, or a build dir; ends with "=== overall: PASS" when
#           every run worked, whatever the ratios; each run has a 40 s
#           timeout, and no run starts past BUDGET seconds, 420 by default)
#
# Rows, each a blocks_bench run whose ratio is measured within the run
# (alternated transfers; see blocks_bench.cpp), ROUNDS rounds (default 5),
# the rows' order rotating from round to round:
#   tcp / local, write / read: 1,000 blocks of 4 KiB and of 64 KiB against one
#     contiguous transfer of the same bytes (targets >= 0.9 and >= 0.97);
#     local: memory not shared (through the engine's frames), and shm-*: the
#     target's memory from shared_memory (a memcpy on the mapping);
#   striping, tcp, write / read: 64 MiB over 2 rails against 1 rail, a loop
#     thread per rail on each side (target >= 1.6); and, for contrast, the
#     write with both rails and the baseline on one loop thread per side.
# Printed: each row's median ratio, the per-round ratios, the median
# bandwidths. SMALL=1: small sizes and few iterations, a check of the
# script (its ratios mean nothing).
set -uo pipefail

if [ "${1:-}" = --build ]; then
  B=${2:?build dir}
  D=${3:-.device/blocks}
  grep -q '"name": "static_uring", "value": true' "$B/meson-info/intro-buildoptions.json" 2>/dev/null ||
    echo "warning: $B may not link liburing statically (meson configure $B -Dstatic_uring=true)"
  ninja -C "$B" bench/blocks/blocks_bench || exit 1
  mkdir -p "$D"
  cp "$B/bench/blocks/blocks_bench" "$D/" && strip --strip-debug "$D/blocks_bench" || exit 1
  ldd "$D/blocks_bench"
  ls -la "$D"
  exit 0
fi

D=${1:?usage: run-device.sh DIR (or --build BUILD_DIR [DIR])}
bin=$D/blocks_bench
[ -x "$bin" ] || bin=$D/bench/blocks/blocks_bench
[ -x "$bin" ] || { echo "no blocks_bench in $D"; exit 2; }
ROUNDS=${ROUNDS:-5}
BUDGET=${BUDGET:-420}
if [ "${SMALL:-0}" = 1 ]; then
  n=100 it4=5 it64=3 sn=64 sit=3
else
  n=1000 it4=100 it64=30 sn=1000 sit=20
fi

# name | target | arguments
rows=(
  "tcp-write-4k|0.9|--transport tcp --blocks $n --block-size 4096 --iters $it4"
  "tcp-write-64k|0.97|--transport tcp --blocks $n --block-size 65536 --iters $it64"
  "tcp-read-4k|0.9|--transport tcp --blocks $n --block-size 4096 --iters $it4 --read"
  "tcp-read-64k|0.97|--transport tcp --blocks $n --block-size 65536 --iters $it64 --read"
  "local-write-4k|0.9|--transport local --blocks $n --block-size 4096 --iters $it4"
  "local-write-64k|0.97|--transport local --blocks $n --block-size 65536 --iters $it64"
  "local-read-4k|0.9|--transport local --blocks $n --block-size 4096 --iters $it4 --read"
  "local-read-64k|0.97|--transport local --blocks $n --block-size 65536 --iters $it64 --read"
  "shm-write-4k|0.9|--transport local --shared --blocks $n --block-size 4096 --iters $it4"
  "shm-read-4k|0.9|--transport local --shared --blocks $n --block-size 4096 --iters $it4 --read"
  "shm-write-64k|0.97|--transport local --shared --blocks $n --block-size 65536 --iters $it64"
  "shm-read-64k|0.97|--transport local --shared --blocks $n --block-size 65536 --iters $it64 --read"
  "stripe-write-2rails|1.6|--transport tcp --rails 2 --blocks $sn --block-size 65536 --iters $sit"
  "stripe-read-2rails|1.6|--transport tcp --rails 2 --blocks $sn --block-size 65536 --iters $sit --read"
  "stripe-write-1loop|-|--transport tcp --rails 2 --one-loop --blocks $sn --block-size 65536 --iters $sit"
)
nrows=${#rows[@]}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
date -u
uname -r
nproc
uptime
echo "binary: $bin, ROUNDS=$ROUNDS SMALL=${SMALL:-0}"
fail=0
start=$SECONDS
done_rounds=0
over=0
for round in $(seq 1 "$ROUNDS"); do
  for k in $(seq 0 $((nrows - 1))); do
    if [ $((SECONDS - start)) -gt "$BUDGET" ]; then
      echo "=== budget of ${BUDGET}s spent in round $round: the rest is not run"
      over=1
      break 2
    fi
    row=${rows[$(((k + round - 1) % nrows))]}
    name=${row%%|*} rest=${row#*|}
    args=${rest#*|}
    # shellcheck disable=SC2086
    out=$(timeout 40 "$bin" $args 2>&1)
    rc=$?
    ratio=$(printf '%s\n' "$out" | awk '/^ratio /{print $NF}')
    if [ $rc -ne 0 ] || [ -z "$ratio" ]; then
      echo "=== $name round $round: rc=$rc"
      printf '%s\n' "$out" | tail -n 20
      fail=1
      continue
    fi
    # The two bandwidths: blocks (or R rails) first, contiguous (or 1 rail) second.
    bws=$(printf '%s\n' "$out" | awk '/^blocks /{a=$4} /^contiguous /{b=$4} /^[0-9]+ rails /{a=$3} /^1 rail /{b=$3} /^1 connection /{b=$3} END {print a, b}')
    echo "$ratio $bws" >>"$work/$name"
    echo "$name round $round: ratio $ratio (GB/s: $bws)"
  done
  done_rounds=$round
done

echo
[ $over = 1 ] && echo "(round $((done_rounds + 1)) is partial)"
echo "=== medians over $done_rounds rounds ($(date -u +%H:%M:%S), $((SECONDS - start)) s)"
printf "%-20s %7s %7s %8s %11s %11s  %s\n" row target median verdict "GB/s(a)" "GB/s(b)" "per-round ratios"
med() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR+1)/2]; else printf "%.3f\n", (v[NR/2]+v[NR/2+1])/2}'; }
for row in "${rows[@]}"; do
  name=${row%%|*} rest=${row#*|}
  target=${rest%%|*}
  f=$work/$name
  [ -s "$f" ] || { printf "%-20s %7s %7s\n" "$name" "$target" "no runs"; continue; }
  m=$(awk '{print $1}' "$f" | med)
  a=$(awk '{print $2}' "$f" | med)
  b=$(awk '{print $3}' "$f" | med)
  verdict=$(awk -v m="$m" -v t="$target" 'BEGIN {print (t == "-") ? "info" : (m + 0 >= t + 0) ? "meets" : "below"}')
  printf "%-20s %7s %7s %8s %11s %11s  %s\n" "$name" "$target" "$m" "$verdict" "$a" "$b" "$(awk '{printf "%s ", $1}' "$f")"
done
echo "(a: blocks or 2 rails; b: contiguous or 1 rail)"
[ $fail -eq 0 ] && echo "=== overall: PASS" || echo "=== overall: FAIL"
exit $fail
