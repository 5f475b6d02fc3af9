#!/usr/bin/env python3
"""pair_ratios.py lower|higher S,P...: one benchmark row of paired runs
(S: shuttle's value, P: perftest's, run back to back), lower|higher: which
way is better. Prints one line:

  s_median p_median ratio lo hi ci_lo ci_hi same all left_out s_slow p_slow

ratio: the median of the pairs' S/P over the pairs whose two runs fell in the
same phase of the guest (below); lo hi: their range; ci_lo ci_hi: a
bootstrap 90% interval of that median (2000 resamples, fixed seed); same:
how many pairs that is; all: the median over every pair with two finite
values; left_out: pairs without a finite value (a failed run gives nan,
perftest at times prints inf); s_slow, p_slow: pairs split by a phase with
shuttle's run, or perftest's, the slow one.

Why phases: a TCG guest on a shared host runs at times much slower for
seconds (read_lat 45-54 us instead of 28-31), long enough to take one run of
a pair and not the other. Such a pair's ratio says nothing about the tools.
A run is in a slow phase when it is more than 25% worse than its own tool's
best run of the row; a pair is split when exactly one of its runs is. Each
tool is judged against itself, so a tool that is simply slower is not left
out; a tool with slow runs of its own shows as a lopsided s_slow / p_slow
(the host's phases hit both tools alike).

pair_ratios.py --median X...: the median of the finite X ("nan" if none)."""
import math
import statistics
import sys

from median_ci import median_ci

SLOW = 1.25


def median(v):
    return statistics.median(v) if v else math.nan


def main():
    if sys.argv[1] == "--median":
        values = [v for v in map(float, sys.argv[2:]) if math.isfinite(v)]
        print("%.3f" % median(values) if values else "nan")
        return
    lower = sys.argv[1] == "lower"
    pairs = [tuple(float(x) for x in a.split(",")) for a in sys.argv[2:]]
    finite = [(s, p) for s, p in pairs if math.isfinite(s) and math.isfinite(p) and s > 0 and p > 0]
    left_out = len(pairs) - len(finite)
    s_vals = [s for s, _ in pairs if math.isfinite(s)]
    p_vals = [p for _, p in pairs if math.isfinite(p)]
    same, s_slow, p_slow = [], 0, 0
    if finite:
        s_best = min(s for s, _ in finite) if lower else max(s for s, _ in finite)
        p_best = min(p for _, p in finite) if lower else max(p for _, p in finite)

        def slow(v, best):
            return v > best * SLOW if lower else v < best / SLOW

        for s, p in finite:
            ss, ps = slow(s, s_best), slow(p, p_best)
            if ss == ps:
                same.append(s / p)
            elif ss:
                s_slow += 1
            else:
                p_slow += 1
    ratio, cl, ch = median_ci(same)
    lo, hi = (min(same), max(same)) if same else (math.nan, math.nan)
    print("%.3f %.3f %.3f %.3f %.3f %.3f %.3f %d %.3f %d %d %d" % (
        median(s_vals), median(p_vals), ratio, lo, hi, cl, ch, len(same),
        median([s / p for s, p in finite]), left_out, s_slow, p_slow))


main()
