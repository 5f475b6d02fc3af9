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
  callgrind_annotate --auto=no --threshold=100 --inclusive=no "$work/cg.$n" >"$work/a.$n" 2>/dev/null
done
python3 - "$work" "$n1" "$n2" "${TOP:-0}" <<'PY'
import re, sys, collections
work, n1, n2, top = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def load(p):
    d = collections.Counter()
    for line in open(p):
        m = re.match(r'\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*)$', line)
        if m and ':' in m.group(2):
            d[m.group(2).strip()] += int(m.group(1).replace(',', ''))
    return d
a, b = load(f'{work}/a.{n1}'), load(f'{work}/a.{n2}')
diff = {k: (b[k] - a[k]) / (n2 - n1) for k in set(a) | set(b)}
mem = re.compile(r'memcpy|memmove|mempcpy|memset')
rest = sum(v for k, v in diff.items() if not mem.search(k))
mc = sum(v for k, v in diff.items() if mem.search(k))
print(f'{rest:.0f} instructions per round trip without memcpy ({mc:.0f} in memcpy/memset)')
for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
    print(f'   {v:8.1f}  {k[:150]}')
PY
