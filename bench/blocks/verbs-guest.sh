#!/bin/bash
# Block lists on the verbs provider in one Soft-RoCE guest (MTU 9000: RoCE
# MTU 4096): read_blocks / write_blocks of BLOCKS blocks of B bytes against
# one contiguous transfer of the same bytes (blocks_bench's ratio, measured
# within each run), REPS runs per row and binary, interleaved (the binaries'
# order alternating); prints each run's ratio and each row's median. BINS
# compares builds in one guest: "label=path ..." (default: BUILD_DIR's).
# Under TCG on a shared host: only ratios within a run mean anything.
# Usage: [REPS=3] [ROWS="read:4096 write:4096"] [BLOCKS=1000] [ITERS=5] [BINS="a=path b=path"] \
#        bash bench/blocks/verbs-guest.sh [BUILD_DIR=build]
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
if [ "${1:-}" = --in-guest ]; then
  read -r -a bins <<<"${BINS:?}"
  work=$(mktemp -d)
  ibv_devinfo -v -d rxe0 2>/dev/null | grep -E "max_qp_rd_atom|max_qp_init_rd_atom|max_res_rd_atom" || true
  for i in $(seq "${REPS:-3}"); do
    order=("${bins[@]}")
    if [ $((i % 2)) = 0 ]; then  # reversed (no process substitution: the guest has no /dev/fd)
      order=()
      for b in "${bins[@]}"; do order=("$b" "${order[@]}"); done
    fi
    for row in ${ROWS:-read:4096 write:4096}; do
      for b in "${order[@]}"; do
        label=${b%%=*} bin=${b#*=}
        op=${row%%:*} size=${row#*:}
        extra=
        [ "$op" = read ] && extra=--read
        # shellcheck disable=SC2086
        out=$(timeout 300 "$bin" --transport verbs --addr 192.168.77.1 --blocks "${BLOCKS:-1000}" --block-size "$size" \
          --iters "${ITERS:-5}" $extra 2>&1) || { echo "$label $row run $i failed:"; echo "$out"; continue; }
        r=$(echo "$out" | awk '/^ratio /{print $NF}')
        bws=$(echo "$out" | awk '/^blocks /{a=$4} /^contiguous /{b=$4} END {print a, b}')
        echo "$label $row run $i: ratio $r (GB/s blocks, contiguous: $bws)"
        echo "$r" >>"$work/$label-$op-$size"
      done
    done
  done
  for f in "$work"/*; do
    printf "%-20s median %s of: %s\n" "$(basename "$f")" \
      "$(sort -g "$f" | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')" "$(tr '\n' ' ' <"$f")"
  done
  exit 0
fi
build=${1:-build}
exec bash tests/softrdma/guest-run.sh -M 9000 -t 1500 -e REPS="${REPS:-3}" -e ROWS="${ROWS:-read:4096 write:4096}" \
  -e BLOCKS="${BLOCKS:-1000}" -e ITERS="${ITERS:-5}" \
  -e BINS="${BINS:-this=$(readlink -f "$build/bench/blocks/blocks_bench")}" -- \
  bash "$here/verbs-guest.sh" --in-guest
