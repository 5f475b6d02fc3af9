#!/bin/bash
# What memory the user did not register costs (docs/memory-registration.md):
# verbs_perf's send_bw and write_bw rows (--slots 1, depth 128; 4 KiB and
# 64 KiB) with the client's buffer registered, and left unregistered
# (shuttle-perf --unregistered: from the registration cache where the memory
# monitor runs, else staged or registered per operation;
# SHUTTLE_REGISTRATION_CACHE=0 in the environment measures the latter). One
# Soft-RoCE guest (MTU 9000), REPS (default 3) pairs per row in alternating
# order; the verdict is on the median of the pairs' any/registered ratios
# (target >= 0.95). Each rep also runs registered memory a second time
# (registered, any, registered again, the first two swapped on odd reps):
# "any" is judged against the mean of both, and registered-again /
# registered is the method's own spread (A/A), printed beside the ratio.
# A median within that spread of the target is a tie.
# Usage: [REPS=3] [SIZES="4096 65536"] [TESTS="write_bw send_bw"] bench/verbs_any_memory.sh [BUILD_DIR]
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
if [ "${1:-}" = --in-guest ]; then
  perf=$2
  # shellcheck source=guest_common.sh
  . "$here/guest_common.sh"
  work=$(mktemp -d)
  port=19500
  run() {  # TEST SIZE ITERS EXTRA... -> bw_avg MB/s
    port=$((port + 1))
    $perf $O --bind $addr --port $port --slots 1 >$work/s.log 2>&1 &
    local spid=$!
    wait_for $work/s.log listening || { kill $spid; echo nan; return; }
    timeout 120 $perf $addr $O --port $port --slots 1 --test $1 --size $2 --iters $3 --depth 128 "${@:4}" --json \
      >$work/c.log 2>&1 || { cat $work/c.log >&2; kill $spid 2>/dev/null; echo nan; return; }
    wait $spid 2>/dev/null || true
    grep '^{' $work/c.log | python3 -c 'import json,sys; print("%.1f" % json.loads(sys.stdin.readline())["bw_avg_mb_s"])'
  }
  printf "%-9s %-6s %10s %10s %7s %-13s %s\n" test bytes registered any ratio "A/A range" "reps (any/registered)"
  for size in ${SIZES:-4096 65536}; do
    n=$([ $size = 4096 ] && echo 5000 || echo 1000)
    for t in ${TESTS:-write_bw send_bw}; do
      regs=() anys=() ratios=() aas=()
      for i in $(seq "${REPS:-3}"); do
        if [ $((i % 2)) = 1 ]; then r=$(run $t $size $n); a=$(run $t $size $n --unregistered)
        else a=$(run $t $size $n --unregistered); r=$(run $t $size $n); fi
        r2=$(run $t $size $n)
        regs+=("$r") anys+=("$a")
        ratios+=("$(python3 -c "print('%.3f' % ($a * 2 / ($r + $r2)))")")
        aas+=("$(python3 -c "print('%.3f' % ($r2 / $r))")")
      done
      med() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
      range() { printf '%s\n' "$@" | sort -g | awk 'NR==1 {lo=$1} {hi=$1} END {print lo "-" hi}'; }
      printf "%-9s %-6s %10s %10s %7s %-13s %s\n" $t $size "$(med "${regs[@]}")" "$(med "${anys[@]}")" \
        "$(med "${ratios[@]}")" "$(range "${aas[@]}")" "${ratios[*]}"
    done
  done
  exit 0
fi
build=${1:-build}
exec bash tests/softrdma/guest-run.sh -M 9000 -t 2400 -e REPS="${REPS:-3}" -e SIZES="${SIZES:-4096 65536}" \
  -e TESTS="${TESTS:-write_bw send_bw}" -e SHUTTLE_REGISTRATION_CACHE="${SHUTTLE_REGISTRATION_CACHE:-1}" -- \
  bash "$here/verbs_any_memory.sh" --in-guest "$(readlink -f "$build/examples/shuttle-perf")"
