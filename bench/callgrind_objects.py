#!/usr/bin/env python3
"""Sums the self instruction counts (Ir) of a callgrind output file by object
(executable or shared library) and prints "object instructions" lines.

Self cost only: the cost line after a calls= line is the callee's inclusive
cost, so each instruction is counted once, in the object that executed it.
--exclude REGEX drops the functions whose names match, and what they call
(a report's sort: its comparator lives in a stripped binary and has no name
to match), so that a per-iteration count is the loop's, not the report's.
--drop-self REGEX drops only the own instructions of the functions whose
names match (an event loop's polling, whose amount depends on how long the
peer took), keeping what they call."""
import argparse
import re

def by_object(path: str, exclude, drop_self=None) -> dict:
    names = {}  # "ob:(id)" / "fn:(id)" -> name (callgrind's name compression)
    totals = {}
    ob = fn = cob = cfn = "?"
    call_line = False

    def name_of(kind, text):
        m = re.match(r"\((\d+)\)(?: (.*))?$", text)
        if not m:
            return text
        key = f"{kind}:{m.group(1)}"
        if m.group(2):
            names[key] = m.group(2)
        return names.get(key, key)

    def add(obj, ir):
        totals[obj] = totals.get(obj, 0) + ir

    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if line.startswith("ob="):
                ob = name_of("ob", line[3:])
            elif line.startswith("fn="):
                fn = name_of("fn", line[3:])
            elif line.startswith("cob="):
                cob = name_of("ob", line[4:])
            elif line.startswith("cfn=") or line.startswith("cfi=") or line.startswith("cfl="):
                if line.startswith("cfn="):
                    cfn = name_of("fn", line[4:])
            elif line.startswith("calls="):
                call_line = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                fields = line.split()
                if len(fields) < 2:
                    continue
                ir = int(fields[-1])
                if call_line:
                    call_line = False
                    # An excluded caller's call into a kept callee: that
                    # callee's inclusive cost was counted as its self costs
                    # (and its callees'), so take it back, at the callee's
                    # object (close enough: the callees of a comparator).
                    if exclude and exclude.search(fn) and not exclude.search(cfn):
                        add(cob if cob != "?" else ob, -ir)
                    cob = "?"
                    continue
                if (exclude and exclude.search(fn)) or (drop_self and drop_self.search(fn)):
                    continue
                add(ob, ir)
    return totals

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--exclude", default="")
    ap.add_argument("--drop-self", default="")
    a = ap.parse_args()
    rx = re.compile(a.exclude) if a.exclude else None
    drop = re.compile(a.drop_self) if a.drop_self else None
    for name, ir in sorted(by_object(a.file, rx, drop).items(), key=lambda kv: -kv[1]):
        print(name, ir)
