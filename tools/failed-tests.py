#!/usr/bin/env python3
"""Prints each test that failed in a meson build directory, with the end of
its output, read from meson-logs/testlog.json.

run-tests.sh calls it once every suite has run, so that the tail of a CI log
(often all that is kept) names what failed and why, not just "FAILURES"."""
import json
import sys

BAD = {"FAIL", "TIMEOUT", "ERROR", "UNEXPECTEDPASS"}
TAIL_LINES = 40

def main(build_dir: str) -> int:
    path = f"{build_dir}/meson-logs/testlog.json"
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            results = [json.loads(line) for line in log if line.strip()]
    except OSError as err:
        print(f"failed-tests: {path}: {err.strerror}")
        return 1
    failed = [r for r in results if r.get("result") in BAD]
    for r in failed:
        print(f"--- {build_dir}: {r['name']}: {r['result']} "
              f"(exit {r.get('returncode')}, {r.get('duration', 0):.1f} s)")
        lines = (r.get("stdout") or "").splitlines()
        for line in lines[-TAIL_LINES:]:
            print(f"    {line}")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
