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
# Per process (the initiator has the lower pid: it forks the target), self
# Ir per function.
for it in 2 12; do
  files=($(cd "$work" && ls cg.$it.* | sort -t. -k3 -n))
  files=("${files[@]/#/$work/}")
  callgrind_annotate --auto=no --threshold=100 --inclusive=no "${files[0]}" >"$work/i.$it" 2>/dev/null
  callgrind_annotate --auto=no --threshold=100 --inclusive=no "${files[1]}" >"$work/t.$it" 2>/dev/null
done
python3 - "$work" "$n" "${TOP:-0}" <<'PY'
import re, sys, collections
work, n, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(p):
    d = collections.Counter()
    for line in open(p):
        m = re.match(r'\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*)$', line)
        if m and ':' in m.group(2):
            d[m.group(2).strip()] += int(m.group(1).replace(',', ''))
    return d
mem = re.compile(r'memcpy|memmove|mempcpy')
for side, name in (('i', 'initiator'), ('t', 'target')):
    a, b = load(f'{work}/{side}.2'), load(f'{work}/{side}.12')
    diff = {k: (b[k] - a[k]) / 10 / n for k in set(a) | set(b)}
    rest = sum(v for k, v in diff.items() if not mem.search(k))
    mc = sum(v for k, v in diff.items() if mem.search(k))
    print(f'{name}: {rest:.1f} instructions per block without memcpy ({mc:.1f} in memcpy)')
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
        print(f'   {v:8.1f}  {k[:150]}')
PY
