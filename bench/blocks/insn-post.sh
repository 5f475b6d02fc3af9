#!/bin/bash
# User-space instructions per block in a block list's post window, by
# callgrind: blocks_bench --only blocks, collecting only inside the list's
# post windows after the warm-up (blocks_bench toggles callgrind around
# them; valgrind runs with --collect-atstart=no), at --iters LO and --iters
# HI; the difference over HI-LO lists and N blocks, memcpy/memset apart
# (bench/callgrind_diff.py). The kernel's work (rxe's doorbell: the
# requester inside ibv_post_send) is not counted by valgrind at all, so this
# is the post path's own work with the doorbell excluded by construction.
# The window is what blocks_bench's "post" times: see its header.
#
#   [N=1000] [B=4096] [LO=2] [HI=7] [TOP=K] [SHIM=path/libdoorbell_shim.so] \
#     bash bench/blocks/insn-post.sh BLOCKS_BENCH [more blocks_bench args]
#   e.g., in the Soft-RoCE guest (tests/softrdma/guest-run.sh -M 9000):
#     ... build-rel/bench/blocks/blocks_bench --transport verbs --addr 192.168.77.1 [--read]
# SHIM: preloaded too, so that each run's log says whether every list was
# posted inside its window (the doorbell line), printed here.
# RAW=1: the binary is raw_post (plain verbs, the provider library's floor:
# see raw_post.cpp), given its --mode; its windows are toggled the same way.
set -euo pipefail
bin=${1:?blocks_bench binary}
shift
n=${N:-1000} lo=${LO:-2} hi=${HI:-7}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pre=()
[ -n "${SHIM:-}" ] && pre=(env LD_PRELOAD="$SHIM")
only=(--only blocks)
[ "${RAW:-0}" = 1 ] && only=()
for it in "$lo" "$hi"; do
  "${pre[@]}" valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file="$work/cg.$it.%p" "$bin" \
    "${only[@]}" --blocks "$n" --block-size "${B:-4096}" --iters "$it" "$@" >"$work/log.$it" 2>&1 ||
    { cat "$work/log.$it"; exit 1; }
  echo "--iters $it:"
  grep -E "^(provider|blocks |doorbells|post path|raw )" "$work/log.$it" || true
done
# The initiator has the lower pid (it forks the target, which collects nothing).
here=$(dirname "$0")/..
a=($(cd "$work" && ls "cg.$lo".* | sort -t. -k3 -n)) b=($(cd "$work" && ls "cg.$hi".* | sort -t. -k3 -n))
python3 "$here/callgrind_diff.py" --per $(((hi - lo) * n)) --label "initiator's post window, per block" \
  --top "${TOP:-0}" "$work/${a[0]}" "$work/${b[0]}"
