#!/usr/bin/env python3
"""Every installed tool's command line keeps the conventions users expect.

cli_test.py VERSION TOOL...

For each TOOL:
  --help            exit 0, "usage: NAME" on stdout, nothing on stderr;
  --version         exit 0, "NAME VERSION" on stdout;
  --no-such-option  exit 2, stdout empty, on stderr the option named, the
                    usage line and a pointer to --help;
  a bad value       (for the tools that take one, from BAD_VALUES) the same,
                    the value named.
Exit status 0 when all of that holds; each miss is printed.
"""
import os
import subprocess
import sys

TIMEOUT = 30

# A value each tool must refuse (a usage error, caught before it does
# anything), and the text its message must contain.
BAD_VALUES = {
    "shuttle-echo-server": (["--port", "70000"], "70000"),
    "shuttle-echo-client": (["--port", "1", "--recv-ring", "3"], "power of two"),
    "shuttle-perf": (["127.0.0.1", "--depth", "0"], "--depth"),
    "shuttle-transfer": (["--chunk-size", "12q"], "12q"),
    "shuttle-kv-transfer": (["--layers", "0"], "--layers"),
    "stream_pipeline": (["--batch", "0"], "--batch"),
    "shuttle-gpu-pipeline": (["0"], "'0'"),
    "shuttle-weights-push": (["--piece-mib", "0"], "--piece-mib"),
}

failures = []


def check(cond, tool, what, r):
    if not cond:
        failures.append("%s: %s\n  exit %s\n  stdout: %r\n  stderr: %r" % (tool, what, r.returncode, r.stdout[-600:],
                                                                          r.stderr[-600:]))


def run(exe, args):
    try:
        return subprocess.run([exe] + args, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        failures.append("%s %s: no exit within %d s" % (exe, " ".join(args), TIMEOUT))
        return None


def usage_error(tool, exe, args, must_name):
    r = run(exe, args)
    if r is None:
        return
    what = " ".join(args)
    check(r.returncode == 2, tool, "%s: exit status 2" % what, r)
    check(r.stdout == "", tool, "%s: nothing on stdout" % what, r)
    check(r.stderr.startswith(tool + ": "), tool, "%s: stderr starts with '%s: '" % (what, tool), r)
    check(must_name in r.stderr, tool, "%s: the message names %r" % (what, must_name), r)
    check("usage: " + tool in r.stderr, tool, "%s: the usage line on stderr" % what, r)
    check("--help" in r.stderr, tool, "%s: a pointer to --help" % what, r)


def main():
    if len(sys.argv) < 3:
        print("usage: cli_test.py VERSION TOOL...")
        return 2
    version = sys.argv[1]
    for exe in sys.argv[2:]:
        tool = os.path.basename(exe)
        print("==", tool)
        r = run(exe, ["--help"])
        if r is not None:
            check(r.returncode == 0, tool, "--help: exit status 0", r)
            check(("usage: " + tool) in r.stdout, tool, "--help: 'usage: %s' on stdout" % tool, r)
            check("--version" in r.stdout, tool, "--help: lists --version", r)
            check(r.stderr == "", tool, "--help: nothing on stderr", r)
        r = run(exe, ["--version"])
        if r is not None:
            check(r.returncode == 0, tool, "--version: exit status 0", r)
            check(r.stdout.strip() == "%s %s" % (tool, version), tool, "--version: '%s %s'" % (tool, version), r)
        usage_error(tool, exe, ["--no-such-option"], "--no-such-option")
        if tool in BAD_VALUES:
            args, must_name = BAD_VALUES[tool]
            usage_error(tool, exe, args, must_name)
    for f in failures:
        print("FAIL:", f)
    print("%d tools, %d failures" % (len(sys.argv) - 2, len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
