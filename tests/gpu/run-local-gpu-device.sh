#!/bin/bash
# GPU memory on the local provider (issue 30, point 2) on the GPU machine,
# from carried binaries (the device has no liburing: build them here with
# -Dstatic_uring=true).
#
#   here:   bash tests/gpu/run-local-gpu-device.sh --build BUILD_DIR [dir=.device/local-gpu]
#           (builds the programs below in BUILD_DIR and copies them to dir)
#   device: bash tests/gpu/run-local-gpu-device.sh [dir=.device/local-gpu]
#           (carry dir; ends with "=== overall: PASS" or "=== overall: FAIL";
#           every step has its own timeout, under 600 s in all)
#
# Runs: gpu-local (two processes on one GPU, every byte checked, refusals, a
# peer killed mid-transfer), local-device (the provider's GPU logic with fake
# hooks), conformance-local and local-provider (host memory, with the real
# CUDA hooks installed), the benchmark (ratios against same-process
# baselines measured in the same run), and shuttle-kv-transfer --gpu where
# it was built.
progs="tests/gpu/test_gpu_local tests/transport/transport_local_device tests/transport/transport_conformance
tests/transport/transport_local_provider bench/gpu/local_gpu_bench examples/shuttle-kv-transfer"

if [ "$1" = "--build" ]; then
  B=${2:?build dir}
  D=${3:-.device/local-gpu}
  grep -q "static_uring.*true" "$B/meson-info/intro-buildoptions.json" 2>/dev/null ||
    grep -q '"name": "static_uring", "value": true' "$B/meson-info/intro-buildoptions.json" 2>/dev/null ||
    echo "warning: $B may not link liburing statically (meson configure $B -Dstatic_uring=true)"
  ninja -C "$B" $progs || exit 1
  mkdir -p "$D"
  # Stripped: the device run carries at most 64 MiB in all.
  for p in $progs; do cp "$B/$p" "$D/" && strip --strip-debug "$D/$(basename "$p")"; done
  ls -la "$D"
  exit 0
fi

D=${1:-.device/local-gpu}
fail=0
run() {  # name timeout command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tail -n 80
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc"
  [ "$rc" -ne 0 ] && fail=1  # 77 (no GPU) is a failure here: this is the GPU machine
}
date -u
nvidia-smi -L 2>&1 | head -4
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
ls -la "$D"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
run gpu-local 150 "$D/test_gpu_local"
run local-device 40 "$D/transport_local_device"
run conformance-local 90 env SHUTTLE_TRANSPORT=local "$D/transport_conformance"
run local-provider 90 "$D/transport_local_provider"
# chunks of 64 MiB, in flight, latency iterations; then more in flight.
run local_gpu_bench 90 "$D/local_gpu_bench" 64 8 3000
run local_gpu_bench-16 60 "$D/local_gpu_bench" 128 16 1000
if [ -x "$D/shuttle-kv-transfer" ] && "$D/shuttle-kv-transfer" --help 2>&1 | grep -q -- --gpu; then
  run kv-transfer-gpu 60 "$D/shuttle-kv-transfer" --transport local --gpu --layers 4 --blocks 300 --block-size 64k
fi
# Nothing left behind: no peer process of ours still running.
if pgrep -f -- "--peer shuttle-gpu-" >/dev/null 2>&1; then
  echo "=== stray peer processes:"; pgrep -af -- "--peer shuttle-gpu-"; fail=1
fi
[ $fail -eq 0 ] && echo "=== overall: PASS" || echo "=== overall: FAIL"
exit $fail
