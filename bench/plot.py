#!/usr/bin/env python3
"""Bandwidth and latency against message size, shuttle beside perftest or UCX, as PNG.

  bench/plot.py [-o OUT.png] [--title TEXT] [--tests write_bw,read_lat,...] INPUT...

INPUT: files or directories (every file in them), as bench/perf_sweep.sh
saves them; each file's kind is told from its content:
  - shuttle-perf --json output: one JSON object per line ({"test": ...,
    "bytes": ..., "bw_avg_mb_s" or "t_typical_us"}); other lines ignored;
  - perftest's output (ib_write_bw, ib_read_lat, ...), one or more runs
    concatenated: the test from its banner ("RDMA_Write BW Test"), rows of
    "#bytes #iterations ..." (bw: BW average, column 4; latency: t_typical,
    column 5);
  - ucx_perftest's output (-f), each run after a line
    "# ucx_perftest -t TEST -s BYTES ..." that perf_sweep.sh writes (the tool
    does not print the size): ucp_put_bw and ucp_get as write_bw and
    read_bw (bandwidth average, column 5), ucp_put_lat as write_lat (50th
    percentile, column 2).
Bandwidth in MB/s with MB = 2^20 (the unit of all three tools), latency in
microseconds (the latency tests report half a round trip, read_lat a whole
read). Where a (tool, test, size) appears more than once, the median is
drawn. Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict

PERFTEST_BANNERS = {
    "RDMA_Write BW Test": "write_bw",
    "RDMA_Read BW Test": "read_bw",
    "Send BW Test": "send_bw",
    "RDMA_Write Latency Test": "write_lat",
    "RDMA_Read Latency Test": "read_lat",
    "Send Latency Test": "send_lat",
}
UCX_TESTS = {"ucp_put_bw": "write_bw", "ucp_get": "read_bw", "ucp_put_lat": "write_lat"}


def is_latency(test):
    return test.endswith("_lat")


def parse_shuttle(text, points):
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if "test" not in d or "bytes" not in d:
            continue
        value = d.get("t_typical_us") if is_latency(d["test"]) else d.get("bw_avg_mb_s")
        if value is not None:
            points[("shuttle", d["test"])][int(d["bytes"])].append(float(value))


def parse_perftest(text, points):
    test = None
    for line in text.splitlines():
        for banner, name in PERFTEST_BANNERS.items():
            if banner in line:
                test = name
        f = line.split()
        if test is None or len(f) < 5 or not f[0].isdigit() or not f[1].isdigit():
            continue
        try:
            value = float(f[4] if is_latency(test) else f[3])
        except ValueError:
            continue
        points[("perftest", test)][int(f[0])].append(value)


def parse_ucx(text, points):
    test = size = None
    for line in text.splitlines():
        m = re.match(r"#\s*ucx_perftest\b.*?-t\s+(\S+).*?-s\s+(\d+)", line)
        if m:
            test, size = UCX_TESTS.get(m.group(1)), int(m.group(2))
            continue
        f = line.split()
        if test is None or len(f) < 7 or not f[0].isdigit():
            continue
        points[("ucx", test)][size].append(float(f[1] if is_latency(test) else f[4]))
        test = None  # one row per run


def parse(path, points):
    with open(path, errors="replace") as f:
        text = f.read()
    if re.search(r"^#\s*ucx_perftest\b", text, re.M):
        parse_ucx(text, points)
    elif any(b in text for b in PERFTEST_BANNERS):
        parse_perftest(text, points)
    elif re.search(r'^\{"test":', text, re.M):
        parse_shuttle(text, points)
    else:
        return False
    return True


def size_label(n):
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories of raw tool output")
    ap.add_argument("-o", "--output", default="perf.png", help="the PNG to write (default perf.png)")
    ap.add_argument("--title", default="", help="a title above both panels")
    ap.add_argument("--tests", default="", help="comma-separated tests to draw (default: every one found)")
    args = ap.parse_args()

    files = []
    for p in args.inputs:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if os.path.isfile(os.path.join(p, f)))
        else:
            files.append(p)
    points = defaultdict(lambda: defaultdict(list))
    for f in files:
        if not parse(f, points):
            print("plot.py: %s: not shuttle-perf --json, perftest or ucx_perftest output (skipped)" % f,
                  file=sys.stderr)
    if args.tests:
        keep = set(args.tests.split(","))
        points = {k: v for k, v in points.items() if k[1] in keep}
    if not points:
        print("plot.py: no data points in %s" % " ".join(args.inputs), file=sys.stderr)
        return 1

    try:
        import matplotlib
    except ImportError:
        # Debian's python3-matplotlib serves Debian's python3: another
        # python3 first on PATH (pyenv, a venv) does not see it.
        if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
            os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
        print("plot.py: needs matplotlib (Debian: apt-get install python3-matplotlib)", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tests = sorted({t for _, t in points}, key=lambda t: (is_latency(t), t))
    colors = {t: plt.get_cmap("tab10")(i) for i, t in enumerate(tests)}
    styles = {"shuttle": ("-", "o"), "perftest": ("--", "s"), "ucx": (":", "^")}
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = set()
    for (tool, test), by_size in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        # A zero (perftest prints 0.00 for a run too short to time) has no
        # place on a log scale: left out, and said.
        xs, ys = [], []
        for x in sorted(by_size):
            y = statistics.median(by_size[x])
            if y > 0:
                xs.append(x)
                ys.append(y)
            else:
                print("plot.py: %s %s %d B: %g left out (not > 0)" % (tool, test, x, y), file=sys.stderr)
        sizes.update(xs)
        ax = lat_ax if is_latency(test) else bw_ax
        ls, marker = styles.get(tool, ("-.", "x"))
        ax.plot(xs, ys, linestyle=ls, marker=marker, markersize=4, color=colors[test], label="%s %s" % (tool, test))
    ticks = sorted(sizes)
    for ax, ylabel in ((bw_ax, "bandwidth, MB/s (2^20)"), (lat_ax, "latency, us (typical)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_label(t) for t in ticks], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("message size, bytes")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    bw_ax.set_title("bandwidth (average)")
    lat_ax.set_title("latency")
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.output, dpi=90)
    print("plot.py: wrote %s (%d series, %d sizes)" % (args.output, len(points), len(ticks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
