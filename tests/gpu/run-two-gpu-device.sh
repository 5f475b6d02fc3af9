#!/bin/bash
# Issue 33: the local provider and the GPU programs with their two processes
# (or two ends) on two GPUs of one host, from carried binaries (the device
# has no liburing: build them here with -Dstatic_uring=true -Drdma=disabled).
#
#   here:   bash tests/gpu/run-two-gpu-device.sh --build BUILD_DIR [dir=.device/two-gpu]
#           (builds the programs below in BUILD_DIR and copies them, stripped, to dir)
#   device: bash tests/gpu/run-two-gpu-device.sh [dir=.device/two-gpu]
#           (carry dir; ends with "=== overall: PASS" or "=== overall: FAIL" and
#           "two GPUs: yes" or "two GPUs: no (ran on one)"; every step has its
#           own timeout, under 540 s in all)
#
# Which GPU each process takes: SHUTTLE_GPUS=A,B (examples/gpus_env.hpp).
# With two or more GPUs the processes are put on GPUs 0 and 1; with one, on
# GPU 0 both (the same steps, checked on one GPU).
progs="tests/gpu/test_gpu_local tests/transport/transport_local_device bench/gpu/local_gpu_bench
bench/gpu/gpu_pipeline_bench examples/shuttle-kv-transfer examples/shuttle-gpu-pipeline"

if [ "$1" = "--build" ]; then
  B=${2:?build dir}
  D=${3:-.device/two-gpu}
  opts="$B/meson-info/intro-buildoptions.json"
  python3 - "$opts" <<'EOF' || exit 1
import json, sys
o = {x["name"]: x["value"] for x in json.load(open(sys.argv[1]))}
bad = []
if o.get("static_uring") is not True: bad.append("-Dstatic_uring=true")
if o.get("rdma") != "disabled": bad.append("-Drdma=disabled")
if o.get("cuda") == "disabled": bad.append("-Dcuda=enabled")
if bad:
    sys.exit("%s: the device needs %s (meson configure %s %s)" % (sys.argv[1], ", ".join(bad),
             sys.argv[1].split("/meson-info")[0], " ".join(bad)))
EOF
  ninja -C "$B" $progs || exit 1
  mkdir -p "$D"
  # Stripped: the device run carries at most 64 MiB in all.
  for p in $progs; do cp "$B/$p" "$D/" && strip --strip-debug "$D/$(basename "$p")" || exit 1; done
  # Nothing the device lacks: liburing linked in, no libibverbs.
  for p in $progs; do
    if ldd "$D/$(basename "$p")" 2>/dev/null | grep -E "liburing|libibverbs|librdmacm|libshuttle"; then
      echo "$p: links a library the device lacks"; exit 1
    fi
  done
  ls -la "$D"
  du -sh "$D"
  exit 0
fi

D=${1:-.device/two-gpu}
fail=0
run() {  # name timeout command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc"
  [ "$rc" -ne 0 ] && fail=1  # 77 (no GPU) is a failure here: this is the GPU machine
}
date -u
timeout 10 nvidia-smi -L 2>&1 | head -16
timeout 10 nvidia-smi topo -m 2>&1 | head -30
ls -la "$D"
n=$(timeout 10 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "${n:-0}" -ge 2 ]; then
  two=yes
  A=0 B=1
  echo "=== $n GPUs: the two processes on GPUs $A and $B"
else
  two="no (ran on one)"
  A=0 B=0
  echo "=== ${n:-0} GPU(s): fewer than two; every step with both processes on GPU 0"
fi
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
# Every byte checked, refusals, a peer killed mid-transfer; this process on A, the peer on B.
run "gpu-local $A,$B" 120 env SHUTTLE_GPUS=$A,$B "$D/test_gpu_local"
run local-device 30 "$D/transport_local_device"
# 64 MiB chunks GPU A -> GPU B against cudaMemcpyPeerAsync A -> B in one process
# (on one GPU: against a device copy), the peer-access matrix printed.
run "local_gpu_bench $A,$B" 90 env SHUTTLE_GPUS=$A,$B "$D/local_gpu_bench" 64 8 2000
if [ "$two" = yes ]; then
  # The same run on one GPU, for the notes (the link against the GPU's own copy).
  run "local_gpu_bench $A,$A" 60 env SHUTTLE_GPUS=$A,$A "$D/local_gpu_bench" 32 8 1000
fi
# The staged pipeline over the local provider, checksums per chunk: producer (sender) on A,
# consumer (receiver) on B, each end with its own loop and thread when A != B.
run "gpu-pipeline $A,$B" 45 env SHUTTLE_GPUS=$A,$B "$D/shuttle-gpu-pipeline" 512 2048 16 --transport local \
  --two-loops
# Its benchmark (both ends on one loop, so on one GPU: A), against max(kernels, transfer).
run "gpu_pipeline_bench $A" 75 env SHUTTLE_GPUS=$A "$D/gpu_pipeline_bench" 256 2048 3 8 --transport local
# The KV-cache hand-off: prefill's cache on A, decode's on B (GPU to GPU), then decode's in host memory.
run "kv-transfer $A,$B" 45 env SHUTTLE_GPUS=$A,$B "$D/shuttle-kv-transfer" --transport local --gpu --layers 4 \
  --blocks 300 --block-size 64k
run "kv-transfer $A" 30 env SHUTTLE_GPUS=$A "$D/shuttle-kv-transfer" --transport local --gpu --layers 4 \
  --blocks 300 --block-size 64k
# Nothing left behind: no peer process of ours still running.
if pgrep -f -- "--peer shuttle-gpu-" >/dev/null 2>&1; then
  echo "=== stray peer processes:"; pgrep -af -- "--peer shuttle-gpu-"; fail=1
fi
[ $fail -eq 0 ] && echo "=== overall: PASS" || echo "=== overall: FAIL"
echo "two GPUs: $two"
exit $fail
