#!/usr/bin/env python3
"""ChildLog (child_log.py): a log read while its child writes loses nothing.

A child writes 20,000 numbered lines, one write each, while this side reads
text() as fast as it can. Every line must be there, once, in order, and
every read must begin with line 0. A reader that seeks the shared file
offset back to 0 lets the child's next writes land over the log's
beginning (what once hid a sanitizer report's second line in echo_tcp_test).
"""
import subprocess
import sys

from child_log import ChildLog

LINES = 20000
CHILD = "import os\nfor i in range(%d):\n    os.write(1, b'line %%06d\\n' %% i)\n" % LINES


def main():
    log = ChildLog()
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=log.file, stderr=subprocess.STDOUT)
    reads = 0
    while proc.poll() is None:
        text = log.text()
        reads += 1
        if text and not text.startswith("line 000000\n"):
            print("child-log-test: FAIL: a read began with %r" % text[:40])
            return 1
    proc.wait()
    got = log.text().splitlines()
    want = ["line %06d" % i for i in range(LINES)]
    if got != want:
        bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        print("child-log-test: FAIL: %d lines, want %d; first difference at line %d: %r" %
              (len(got), LINES, bad, got[bad] if bad < len(got) else None))
        return 1
    print("child-log-test: OK: %d lines whole and in order across %d reads while the child wrote" % (LINES, reads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
