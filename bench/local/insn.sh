#!/bin/bash
# Instructions per 8-byte send/recv round trip on the local provider's
# rings, both peers on one loop (local_bench --rtts), by callgrind (stable
# on a noisy host, unlike wall clock): the difference between N2 and N1
# round trips, memcpy/memmove apart (valgrind counts rep movsb per byte).
#   bash bench/local/insn.sh LOCAL_BENCH     e.g. build-rel/bench/local/local_bench
# Env: N1 (default 2000), N2 (default 12000), TOP=N: also the N functions
# whose self count grew most; SHUTTLE_LOCAL_CARRY=0 passes through (the
# ACK and the CREDIT as frames of their own).
set -euo pipefail
bin=${1:?local_bench binary}
n1=${N1:-2000}
n2=${N2:-12000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for n in "$n1" "$n2"; do
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$n" "$bin" --rtts "$n" >"$work/log.$n" 2>&1 ||
    { cat "$work/log.$n"; exit 1; }
done
python3 "$(dirname "$0")/../callgrind_diff.py" --per $((n2 - n1)) --label "per round trip" --top "${TOP:-0}" \
  "$work/cg.$n1" "$work/cg.$n2"
