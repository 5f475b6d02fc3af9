#!/usr/bin/env python3
"""median_ci.py X...: prints the median of the numbers, and a bootstrap 90%
interval of that median (2000 resamples, fixed seed), as "median lo hi".
Non-finite values are left out; with none left it prints "nan nan nan".
Used by the benchmark scripts for their ratio columns (pair_ratios.py
imports median_ci)."""
import math
import random
import statistics
import sys


def median_ci(values):
    """(median, lo, hi) of the finite values; nans when there are none."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return math.nan, math.nan, math.nan
    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    return statistics.median(values), medians[100], medians[1899]


if __name__ == "__main__":
    print("%.3f %.3f %.3f" % median_ci([float(v) for v in sys.argv[1:]]))
