#!/usr/bin/env python3
"""A shuttle Asio header after a Boost.Asio header must not compile (its
configuration would differ: include/shuttle/asio/config.hpp); in the right
order it must. Both files are compiled (-fsyntax-only) with the command
line of test_driver.cpp from the build's compile_commands.json.

usage: include_order.py BUILD_DIR
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile

BODY = "\nint main() { return 0; }\n"
RIGHT = "#include <shuttle/asio/executor.hpp>\n#include <boost/asio/io_context.hpp>\n" + BODY
WRONG = "#include <boost/asio/io_context.hpp>\n#include <shuttle/asio/executor.hpp>\n" + BODY
EXPECTED = "a Boost.Asio header was included before <shuttle/asio/...>"


def command_for(build_dir, source_name):
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        for entry in json.load(f):
            if entry["file"].endswith(source_name):
                args = entry.get("arguments") or shlex.split(entry["command"])
                return entry["directory"], args
    sys.exit(f"include_order: no compile command for {source_name} in {build_dir}")


def syntax_only(directory, args, path):
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MQ", "-c"):
            skip = a != "-c"
            continue
        if a == "-MD" or a.endswith("test_driver.cpp"):
            continue
        out.append(a)
    out += ["-fsyntax-only", path]
    return subprocess.run(out, cwd=directory, capture_output=True, text=True)


def main():
    directory, args = command_for(sys.argv[1], "tests/asio/test_driver.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        right, wrong = os.path.join(tmp, "right.cpp"), os.path.join(tmp, "wrong.cpp")
        with open(right, "w") as f:
            f.write(RIGHT)
        with open(wrong, "w") as f:
            f.write(WRONG)
        r = syntax_only(directory, args, right)
        if r.returncode != 0:
            print(r.stderr)
            sys.exit("include_order: the right order does not compile (the check proves nothing)")
        w = syntax_only(directory, args, wrong)
        if w.returncode == 0:
            sys.exit("include_order: a shuttle Asio header compiled after an Asio header")
        if EXPECTED not in w.stderr:
            print(w.stderr)
            sys.exit("include_order: the wrong order failed, but not with config.hpp's message")
    print("include order: right order compiles; wrong order refused with config.hpp's message")


if __name__ == "__main__":
    main()
