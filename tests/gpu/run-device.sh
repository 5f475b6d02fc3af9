#!/bin/bash
# Runs the gpu suite, the GPU benchmarks, the pipeline example and
# shuttle-info from carried binaries (.device/, built elsewhere with
# -Dstatic_uring=true). Usage: bash tests/gpu/run-device.sh [dir=.device]
# WAIT_SWEEP=1 also sweeps the hybrid wait's settings (gpu_wait_bench sweep).
D=${1:-.device}
OUT=${OUT:-/tmp}
set -o pipefail
nvidia-smi -L 2>&1 | head -2
fail=0
for t in test_gpu_await test_gpu_registration test_gpu_staged test_gpu_ordered; do
  echo "=== $t"
  timeout 240 "$D/$t" 2>&1 | tail -25
  rc=$?; echo "=== $t rc=$rc"; [ $rc -ne 0 ] && fail=1
done
echo "=== gpu_wait_bench"; timeout 120 "$D/gpu_wait_bench" 1 ${WAIT_SWEEP:+sweep} 2>&1
# The issue's three configurations (MiB, chunk KiB, sender buffers, receiver slots).
# The same over the local provider (issue 30: >= 0.9 of max(kernels, transfer)).
for cfg in "512 2048 2 4" "512 2048 3 8" "512 1024 4 8" "512 2048 2 4 --transport local" \
  "512 2048 3 8 --transport local" "512 1024 4 8 --transport local"; do
  echo "=== gpu_pipeline_bench $cfg"; timeout 120 "$D/gpu_pipeline_bench" $cfg 2>&1
  rc=$?; [ $rc -ne 0 ] && { echo "=== gpu_pipeline_bench rc=$rc"; fail=1; }
done
echo "=== shuttle-gpu-pipeline"; timeout 60 "$D/shuttle-gpu-pipeline" 256 1024 16 2>&1
rc=$?; echo "rc=$rc"; [ $rc -ne 0 ] && fail=1
if [ -x "$D/stream_pipeline" ]; then
  echo "=== stream_pipeline, compute stage on the GPU"
  timeout 60 bash "$(dirname "$0")/stream-pipeline-gpu.sh" "$D/stream_pipeline" 2>&1
  rc=$?; echo "rc=$rc"; [ $rc -ne 0 ] && fail=1
fi
echo "=== shuttle-info"; timeout 30 "$D/shuttle-info" 2>&1
exit $fail
