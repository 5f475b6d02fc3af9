#!/bin/bash
# Instructions per block of a block list, by callgrind (stable on a noisy
# host, unlike wall clock): blocks_bench --only blocks at --iters 2 and
# --iters 12, both processes (the target is a forked child); the difference
# over 10 lists and N blocks, memcpy/memmove apart (glibc's rep movsb is
# counted per byte by valgrind, so it says nothing about the rest).
#
#   bash bench/blocks/insn.sh BLOCKS_BENCH [more blocks_bench args]
#   e.g. ... build-rel/bench/blocks/blocks_bench --transport local --read
# Prints: initiator and target instructions per block, without memcpy.
# TOP=N: also the N functions whose self count grew most, per process.
set -euo pipefail
bin=${1:?blocks_bench binary}
shift
n=${N:-1000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for it in 2 12; do
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$it.%p" "$bin" --only blocks --blocks "$n" \
    --block-size "${B:-4096}" --iters "$it" "$@" >"$work/log.$it" 2>&1 || { cat "$work/log.$it"; exit 1; }
done
# Per process: the initiator has the lower pid (it forks the target).
here=$(dirname "$0")/..
i2=($(cd "$work" && ls cg.2.* | sort -t. -k3 -n)) i12=($(cd "$work" && ls cg.12.* | sort -t. -k3 -n))
python3 "$here/callgrind_diff.py" --per $((10 * n)) --label "initiator, per block" --top "${TOP:-0}" \
  "$work/${i2[0]}" "$work/${i12[0]}"
python3 "$here/callgrind_diff.py" --per $((10 * n)) --label "target, per block" --top "${TOP:-0}" \
  "$work/${i2[1]}" "$work/${i12[1]}"
