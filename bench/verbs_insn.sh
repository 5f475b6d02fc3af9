#!/bin/bash
# User-space instructions per latency iteration: shuttle-perf (verbs provider)
# vs perftest (ib_send_lat, ib_write_lat, ib_read_lat) on Soft-RoCE inside one
# QEMU guest, counted by callgrind on one side while the other runs natively.
#
# Why: in the TCG guest, the kernel's Soft-RoCE work per round trip is the same
# for both tools (kprobe counts, session 8), and what a latency row measures
# on top of it is the user-space code between a completion and the next post,
# which TCG runs many times slower than a real CPU. Instruction counts are
# exact where guest timings are noisy, so this is the benchmark that shows a
# change to that path.
#
# Each count is (Ir at N2 iterations - Ir at N1) / (N2 - N1): start-up and
# tear-down cancel; the reports' sorting of the samples is left out
# (bench/callgrind_objects.py --exclude). "ops" is shuttle's app count less
# its loop's own polling: the per-operation path, which does not depend on
# how long the measured side waited (compare shuttle builds on it). Split by object: "app" (the tool's own binary, with
# shuttle linked in), "verbs" (libibverbs + the rxe provider), "libc", other.
# The measured side runs ~50x slower, so its peer's answer is nearly always
# waiting when it polls: busy-poll spins hardly count.
#
# shuttle-perf issues its latency operations as OPS says (--ops: prepared, its
# default and the way perftest posts one pre-built WR, or single).
#
# Usage: [TESTS="send_lat write_lat read_lat"] [N1=500] [N2=4500] [OPS=prepared] bench/verbs_insn.sh [BUILD_DIR]
# (needs valgrind and perftest, and tests/softrdma/install-deps.sh's packages)
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
if [ "${1:-}" = --in-guest ]; then
  perf=$2
  # shellcheck source=guest_common.sh
  . "$here/guest_common.sh"
  work=$(mktemp -d)
  port=19000
  n1=${N1:-500} n2=${N2:-4500}
  # The reports' work on the N samples (sorting them: N log N, so it does
  # not cancel in the difference) is not the loop's.
  report_fns='msort|qsort|introsort|insertion_sort|__adjust_heap|__heap_select|lat_stats|random|printf|scanf|strto'
  vg() { timeout 600 valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" "$@"; }
  # run TOOL SIDE TEST N: one pair with SIDE (client|server) under callgrind;
  # leaves the callgrind file in $work/cg.out
  run() {
    local tool=$1 side=$2 t=$3 n=$4 c=() s=()
    port=$((port + 1))
    if [ "$tool" = shuttle ]; then
      s=("$perf" $O --bind $addr --port $port)
      c=("$perf" $addr $O --port $port --test "$t" --size 2 --iters "$n" --warmup 0 --depth 1 --ops "${OPS:-prepared}")
    else
      s=("ib_$t" $P -p $port -s 2 -n "$n")
      c=("ib_$t" $P -p $port -s 2 -n "$n" $addr)
    fi
    rm -f "$work/cg.out"
    if [ "$side" = server ]; then vg "${s[@]}" >"$work/s.log" 2>&1 & else "${s[@]}" >"$work/s.log" 2>&1 & fi
    local spid=$!
    if [ "$tool" = shuttle ]; then wait_for "$work/s.log" listening; else wait_listen $port $spid; fi
    if [ "$side" = client ]; then vg "${c[@]}" >"$work/c.log" 2>&1
    else timeout 600 "${c[@]}" >"$work/c.log" 2>&1; fi || {
      echo "verbs_insn: $tool $t $side client failed:" >&2; cat "$work/c.log" "$work/s.log" >&2; kill $spid 2>/dev/null; }
    wait $spid || true
  }
  # counts -> "app verbs libc other ops" for the last run; ops: app less the
  # own instructions of shuttle's loop and CQ polling (the part that grows
  # when the peer is slow), so the per-operation path alone, for comparing
  # one shuttle build with another
  loop_fns='io_context::run_until|io_context::poll_pollers|io_context::run_ready|io_context::drain_remote|core::poll\(|core::poll_cq|try_enter_interrupt_mode|spin_clock'
  split() {
    local ops
    ops=$(python3 "$here/callgrind_objects.py" --exclude "$report_fns" --drop-self "$loop_fns" "$work/cg.out" |
      awk -v app="$1" '$1 ~ app { a += $2 } END { printf "%d", a }')
    python3 "$here/callgrind_objects.py" --exclude "$report_fns" "$work/cg.out" | awk -v app="$1" -v ops="$ops" '
      { if ($1 ~ app) a += $2; else if ($1 ~ /libibverbs|librxe/) v += $2; else if ($1 ~ /libc\.so/) c += $2; else o += $2 }
      END { printf "%d %d %d %d %d\n", a, v, c, o, ops }'
  }
  per_iter() {  # tool side test -> "app verbs libc other ops total" per iteration
    local a b
    run "$1" "$2" "$3" "$n1"; a=$(split "$4")
    run "$1" "$2" "$3" "$n2"; b=$(split "$4")
    python3 -c 'import sys
a = [int(x) for x in sys.argv[1].split()]; b = [int(x) for x in sys.argv[2].split()]; d = int(sys.argv[3])
v = [(y - x) / d for x, y in zip(a, b)]
print(" ".join("%.0f" % x for x in v + [sum(v[:4])]))' "$a" "$b" $((n2 - n1))
  }
  printf "%-9s %-6s | %-36s | %-29s | %s\n" test side "shuttle: app (ops) verbs libc total" "perftest: app verbs libc total" \
    "ratio (total, app+libc)"
  for t in ${TESTS:-send_lat write_lat read_lat}; do
    for side in client server; do
      [ "$t" = read_lat ] && [ "$side" = server ] && continue  # the read_lat server only waits
      read -r sa sv sc so sops st <<<"$(per_iter shuttle $side $t shuttle-perf)"
      read -r pa pv pc po _ pt <<<"$(per_iter perftest $side $t "ib_$t")"
      printf "%-9s %-6s | %6s %6s %6s %6s %8s | %6s %6s %6s %8s | %.2f %.2f\n" $t $side $sa "($sops)" $sv $sc $st $pa $pv $pc $pt \
        "$(python3 -c "print($st / $pt)")" "$(python3 -c "print(($sa + $sc) / max($pa + $pc, 1))")"
    done
  done
  exit 0
fi

build=${1:-build-bench}
cd "$(dirname "$0")/.."
if [ ! -d "$build" ]; then meson setup "$build" --buildtype=release >/dev/null; fi
ninja -C "$build" examples/shuttle-perf >/dev/null
for b in valgrind ib_send_lat ib_write_lat ib_read_lat; do
  command -v $b >/dev/null || { echo "verbs_insn.sh: $b not found (apt-get install valgrind perftest)" >&2; exit 1; }
done
perf=$(readlink -f "$build/examples/shuttle-perf")
echo "# verbs_insn: user-space instructions per iteration (callgrind), shuttle-perf vs perftest" \
  "$(dpkg-query -W -f='${Version}' perftest 2>/dev/null), 2-byte messages, shuttle --ops ${OPS:-prepared}, Soft-RoCE rxe0 in a TCG guest"
set +e
bash tests/softrdma/guest-run.sh -M 9000 -t 3000 -e TESTS="${TESTS:-send_lat write_lat read_lat}" -e N1="${N1:-500}" -e OPS="${OPS:-prepared}" \
  -e N2="${N2:-4500}" -- bash "$(readlink -f "$0")" --in-guest "$perf"
rc=$?
[ $rc = 77 ] && echo "verbs_insn.sh: no Soft-RoCE guest available (skipped)" >&2
exit $rc
