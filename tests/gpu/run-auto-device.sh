#!/bin/bash
# transport_kind::automatic on the GPU machine (issue 30, point 3): which path
# shuttle-info reports for a host buffer and a GPU buffer to a peer on this
# host, and the GPU pipeline example over tcp, local and auto (both ends on
# this host: auto must take the local provider). From carried binaries built
# with -Dstatic_uring=true, as tests/gpu/run-device.sh.
# Usage: bash tests/gpu/run-auto-device.sh [dir=.device]  (log to stdout,
# last line "=== overall: PASS|FAIL")
D=${1:-.device}
set -o pipefail
nvidia-smi -L 2>&1 | head -2
fail=0
echo "=== shuttle-info"
info=$(timeout 60 "$D/shuttle-info" 2>&1); rc=$?
echo "$info"
[ $rc -ne 0 ] && { echo "=== shuttle-info rc=$rc"; fail=1; }
echo "$info" | grep -q "connection: local provider" || { echo "=== shuttle-info: no local connection"; fail=1; }
echo "$info" | grep -q "GPU buffer: " || { echo "=== shuttle-info: no GPU buffer line"; fail=1; }
for t in tcp local auto; do
  echo "=== shuttle-gpu-pipeline --transport $t"
  out=$(timeout 120 "$D/shuttle-gpu-pipeline" 256 1024 16 --transport $t 2>&1); rc=$?
  echo "$out"
  [ $rc -ne 0 ] && { echo "=== rc=$rc"; fail=1; }
  want=$([ $t = tcp ] && echo tcp || echo local)
  echo "$out" | grep -q ", over $want" || { echo "=== expected the $want provider"; fail=1; }
done
[ $fail -eq 0 ] && echo "=== overall: PASS" || echo "=== overall: FAIL"
exit $fail
