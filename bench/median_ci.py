#!/usr/bin/env python3
"""median_ci.py X...: prints the median of the numbers, and a bootstrap 90%
interval of that median (2000 resamples, fixed seed), as "median lo hi".
Non-finite values are left out; with none left it prints "nan nan nan".
Used by the benchmark scripts for their ratio columns."""
import math
import random
import statistics
import sys

values = [v for v in map(float, sys.argv[1:]) if math.isfinite(v)]
if not values:
    print("nan nan nan")
else:
    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    print("%.3f %.3f %.3f" % (statistics.median(values), medians[100], medians[1899]))
