#!/bin/bash
# gpu_file on the GPU machine (issue #32), from carried binaries built
# elsewhere with -Dstatic_uring=true and copied (stripped) into DIR:
# test_gpu_file, shuttle-weights-push, gpu_file_bench, shuttle-info.
#
#   bash tests/gpu/run-file-device.sh [DIR=.device/gpu-file]
#
# Runs: the cuFile declarations against the machine's cufile.h (where a
# C++ compiler is there), shuttle-info, the gpu-file tests without and with
# cuFile's compatibility mode, weights_push on each engine, and the 4 GiB
# cold-cache bench. Files go to $GPU_FILE_DIR (default /var/tmp, the disk).
# Writes $OUT/gpu-file.log (and stdout), ending "=== overall: PASS|FAIL".
D=${1:-.device/gpu-file}
LOG=${OUT:-/tmp}/gpu-file.log
W=${GPU_FILE_DIR:-/var/tmp}/shuttle-gpu-file
mkdir -p "$W" "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
set -o pipefail
fail=0
step() {  # step NAME TIMEOUT CMD...: runs CMD, records its status
  local name=$1 t=$2
  shift 2
  echo "=== $name"
  timeout "$t" "$@"
  local rc=$?
  echo "=== $name rc=$rc"
  [ $rc -ne 0 ] && fail=1
  return 0
}
date -u
nvidia-smi -L 2>&1 | head -2
echo "nvidia modules: $(grep -o '^nvidia[_a-z]*' /proc/modules | tr '\n' ' ')"
df -h "$W" | tail -1

# cuFile's compatibility mode (no nvidia-fs here): a cufile.json of our own.
cat > "$W/cufile.json" <<'JSON'
{
  "logging": { "level": "ERROR" },
  "properties": { "allow_compat_mode": true }
}
JSON

if [ -f /usr/local/cuda/include/cufile.h ] && command -v c++ >/dev/null; then
  step "cufile.h ABI check" 120 c++ -std=c++20 -Wall -Wextra -Werror -fsyntax-only -isystem /usr/local/cuda/include \
    tests/gpu/cufile_abi.cpp
else
  echo "=== cufile.h ABI check: skipped (no cufile.h or no c++ here)"
fi

step "shuttle-info" 60 "$D/shuttle-info"
step "shuttle-info, SHUTTLE_FILE_ENGINE=cufile, compatibility mode" 60 \
  env SHUTTLE_FILE_ENGINE=cufile CUFILE_ENV_PATH_JSON="$W/cufile.json" "$D/shuttle-info"

# Without the json cuFile's registration fails (5027): only uring runs, and
# the fallback note is printed.
step "test_gpu_file (default cuFile config)" 150 env TMPDIR="$W" "$D/test_gpu_file"
step "test_gpu_file (cuFile compatibility mode)" 150 \
  env TMPDIR="$W" CUFILE_ENV_PATH_JSON="$W/cufile.json" "$D/test_gpu_file"

rm -f "$W/weights.dat"
step "weights_push, engine auto" 150 "$D/shuttle-weights-push" "$W/weights.dat" --mib 2048
step "weights_push, engine cufile (compatibility mode)" 150 \
  env SHUTTLE_FILE_ENGINE=cufile CUFILE_ENV_PATH_JSON="$W/cufile.json" "$D/shuttle-weights-push" "$W/weights.dat"
rm -f "$W/weights.dat"

step "gpu_file_bench 4 GiB" 240 env CUFILE_ENV_PATH_JSON="$W/cufile.json" "$D/gpu_file_bench" "$W/bench.dat" 4
rm -f "$W/bench.dat"

if [ $fail -eq 0 ]; then echo "=== overall: PASS"; else echo "=== overall: FAIL"; fi
exit $fail
