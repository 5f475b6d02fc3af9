#!/usr/bin/env python3
"""The growth of self instruction counts (Ir) between two callgrind runs of
one program that differ only in how many times the measured thing ran,
divided by that difference: instructions per thing, memcpy/memmove/memset
apart (valgrind counts glibc's rep movsb per byte, so those say nothing
about the rest). Used by bench/local/insn.sh and bench/blocks/insn.sh.

  callgrind_diff.py --per N [--label TEXT] [--top K] FEWER.out MORE.out

Prints "TEXT: X instructions without memcpy (Y in memcpy)", then, with
--top K, the K functions whose self count grew most."""
import argparse
import collections
import re
import subprocess


def self_counts(path: str) -> collections.Counter:
    out = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", "--inclusive=no", path],
                         capture_output=True, text=True, check=True).stdout
    d = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\(\s*[\d.]+%\)\s+)?(\S.*)$", line)
        if m and ":" in m.group(2):
            d[m.group(2).strip()] += int(m.group(1).replace(",", ""))
    return d


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--per", type=float, required=True, help="how many more things MORE ran than FEWER")
    p.add_argument("--label", default="per thing")
    p.add_argument("--top", type=int, default=0)
    p.add_argument("fewer")
    p.add_argument("more")
    a = p.parse_args()
    x, y = self_counts(a.fewer), self_counts(a.more)
    diff = {k: (y[k] - x[k]) / a.per for k in set(x) | set(y)}
    mem = re.compile(r"memcpy|memmove|mempcpy|memset")
    rest = sum(v for k, v in diff.items() if not mem.search(k))
    mc = sum(v for k, v in diff.items() if mem.search(k))
    print(f"{a.label}: {rest:.1f} instructions without memcpy ({mc:.1f} in memcpy/memset)")
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"   {v:8.1f}  {k[:150]}")


if __name__ == "__main__":
    main()
