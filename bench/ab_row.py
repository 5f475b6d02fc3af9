#!/usr/bin/env python3
"""ab_row.py higher|lower A,B...: one row of an A/B benchmark (bench/ab_tcp.sh).
Each A,B is one repetition: A's value and B's, measured back to back ("nan"
for a failed run). higher|lower: which way the value is better. Prints one
line:

  a_median b_median ratio ci_lo ci_hi verdict failed

ratio: the median over the repetitions of B/A (higher) or A/B (lower), so
that > 1 always means B is better; ci_lo ci_hi: a bootstrap 90% interval of
that median (median_ci.py); verdict: "tie" when the interval contains 1.0 or
the ratio is within TIE (3%) of 1, else "better" or "worse" (B against A);
"fail" when no repetition has both values; failed: runs that gave no value.
"""
import math
import statistics
import sys

from median_ci import median_ci

TIE = 0.03


def row(lower, pairs):
    """(a_median, b_median, ratio, lo, hi, verdict, failed) of (a, b) pairs."""
    a_vals = [a for a, _ in pairs if math.isfinite(a)]
    b_vals = [b for _, b in pairs if math.isfinite(b)]
    failed = 2 * len(pairs) - len(a_vals) - len(b_vals)
    ratios = [(a / b if lower else b / a) for a, b in pairs
              if math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0]
    ratio, lo, hi = median_ci(ratios)
    if not ratios:
        verdict = "fail"
    elif lo <= 1.0 <= hi or abs(ratio - 1.0) <= TIE:
        verdict = "tie"
    else:
        verdict = "better" if ratio > 1.0 else "worse"
    med = lambda v: statistics.median(v) if v else math.nan
    return med(a_vals), med(b_vals), ratio, lo, hi, verdict, failed


def fmt(v):
    """Whole numbers from 1000 up, else 3 decimals."""
    return "%.0f" % v if math.isfinite(v) and v >= 1000 else "%.3f" % v


def main():
    lower = sys.argv[1] == "lower"
    pairs = [tuple(float(x) for x in p.split(",")) for p in sys.argv[2:]]
    a, b, r, lo, hi, verdict, failed = row(lower, pairs)
    print("%s %s %.3f %.3f %.3f %s %d" % (fmt(a), fmt(b), r, lo, hi, verdict, failed))


if __name__ == "__main__":
    main()
