#!/bin/bash
# The verbs post path's own cost per block, rxe's doorbell excluded, in one
# Soft-RoCE guest: blocks_bench --only blocks with the doorbell shim
# preloaded (see blocks_bench.cpp's header), REPS runs per row and binary,
# interleaved (the binaries' order alternating). Prints each run's post
# line and its doorbell and post-path lines. BINS compares builds in one
# guest: "label=path ..." (default: BUILD_DIR's). The shim comes from
# BUILD_DIR. Under TCG: emulated time, several times slower than native;
# compare binaries within one guest. RAW=path/raw_post: per row and run,
# the same list posted with plain verbs too (raw_post.cpp: the provider
# library's floor), and each binary's post path (min list) over raw_post's
# "build" mode (min list) printed as a ratio, from the same guest and run.
# Usage: [REPS=3] [RAW=build/bench/blocks/raw_post] [ROWS="write:18880 read:18880 write:1000 read:1000"] [B=4096] [ITERS=5] \
#        [BINS="a=path b=path"] bash bench/blocks/post-guest.sh [BUILD_DIR=build]
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
if [ "${1:-}" = --in-guest ]; then
  read -r -a bins <<<"${BINS:?}"
  mins=
  for i in $(seq "${REPS:-3}"); do
    order=("${bins[@]}")
    if [ $((i % 2)) = 0 ]; then  # reversed (no process substitution: the guest has no /dev/fd)
      order=()
      for b in "${bins[@]}"; do order=("$b" "${order[@]}"); done
    fi
    for row in ${ROWS:-write:18880 read:18880 write:1000 read:1000}; do
      for b in "${order[@]}"; do
        label=${b%%=*} bin=${b#*=}
        op=${row%%:*} n=${row#*:}
        extra=
        [ "$op" = read ] && extra=--read
        # shellcheck disable=SC2086
        out=$(LD_PRELOAD=${SHIM:?} timeout 600 "$bin" --transport verbs --addr 192.168.77.1 --only blocks --blocks "$n" \
          --block-size "${B:-4096}" --iters "${ITERS:-5}" $extra 2>&1) ||
          { echo "$label $row run $i failed:"; echo "$out"; continue; }
        echo "== $label $op $n x ${B:-4096} run $i"
        echo "$out" | grep -E "^(blocks |doorbells|post path)"
        mins="$mins $label=$(echo "$out" | sed -n 's|^post path .* \([0-9.]*\) ns/block min$|\1|p')"
      done
      if [ -n "${RAW:-}" ]; then
        raw=$(LD_PRELOAD=${SHIM:?} timeout 600 "$RAW" --addr 192.168.77.1 --blocks "$n" --block-size "${B:-4096}" \
          --iters "${ITERS:-5}" $extra 2>&1) || { echo "raw_post $row run $i failed:"; echo "$raw"; mins=; continue; }
        echo "$raw" | grep -E "^raw "
        floor=$(echo "$raw" | sed -n 's|^raw build  post path .* \([0-9.]*\) ns/block min$|\1|p')
        for m in $mins; do
          if [ -n "${m#*=}" ] && [ -n "$floor" ]; then
            echo "ratio ${m%%=*} / raw build, post path per block (min lists): $(echo "${m#*=} $floor" | awk '{printf "%.2f", $1 / $2}')"
          fi
        done
      fi
      mins=
    done
  done
  exit 0
fi
build=${1:-build}
shim=$(readlink -f "$build/bench/blocks/libdoorbell_shim.so")
[ -f "$shim" ] || { echo "post-guest.sh: no $shim (build with rdma)" >&2; exit 1; }
exec bash tests/softrdma/guest-run.sh -M 9000 -t 3000 -e REPS="${REPS:-3}" \
  -e ROWS="${ROWS:-write:18880 read:18880 write:1000 read:1000}" -e B="${B:-4096}" -e ITERS="${ITERS:-5}" \
  -e SHIM="$shim" -e RAW="${RAW:+$(readlink -f "$RAW")}" -e BINS="${BINS:-this=$(readlink -f "$build/bench/blocks/blocks_bench")}" -- \
  bash "$here/post-guest.sh" --in-guest
