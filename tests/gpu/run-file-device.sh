#!/bin/bash
# gpu_file on the GPU machine (issue #32), from carried binaries built
# elsewhere with -Dstatic_uring=true and copied (stripped) into DIR:
# test_gpu_file, shuttle-weights-push, gpu_file_bench, shuttle-info.
#
#   bash tests/gpu/run-file-device.sh [DIR=.device/gpu-file]
#
# Runs: the cuFile declarations against the machine's cufile.h (where a
# C++ compiler is there), shuttle-info, the gpu-file tests without and with
# cuFile's compatibility mode, weights_push (512 MiB, in rounds) on each engine, and
# the 2 GiB cold-cache bench with its depth x chunk sweep: about 7 minutes at most. Files go to
# $GPU_FILE_DIR (default /var/tmp, the disk). Every binary runs with stdout
# line-buffered, core dumps off, and its own backtrace on a crash (glibc
# 2.39 has no catchsegv; examples/crash_trace.hpp prints the executable
# base and raw addresses: addr2line -f -C -e build/<binary> ADDR-BASE here).
# Writes $OUT/gpu-file.log (and stdout), ending "=== overall: PASS|FAIL".
D=${1:-.device/gpu-file}
LOG=${OUT:-/tmp}/gpu-file.log
W=${GPU_FILE_DIR:-/var/tmp}/shuttle-gpu-file
mkdir -p "$W" "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1
set -o pipefail
fail=0
ulimit -c 0
LINEBUF=()
command -v stdbuf >/dev/null && LINEBUF=(stdbuf -oL -eL)
step() {  # step NAME TIMEOUT CMD...: runs CMD, records its status
  local name=$1 t=$2
  shift 2
  echo "=== $name ($(date -u +%T))"
  timeout -k 10 "$t" "${LINEBUF[@]}" "$@"
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
# CUFILE_ENV_PATH_JSON replaces /etc/cufile.json as a whole, so start from
# that file (its structure: logging, profile, execution, properties, fs,
# ...) and change only properties.allow_compat_mode and the log level; a
# file of two keys may not be taken. cuFile's log goes to $CUFILE_LOGFILE_PATH.
CUFILE_LOG=${OUT:-/tmp}/cufile.log
if [ -f /etc/cufile.json ]; then
  sed -e 's/"allow_compat_mode"[[:space:]]*:[[:space:]]*[a-z]*/"allow_compat_mode": true/' \
      -e '0,/"level"[[:space:]]*:/s/"level"[[:space:]]*:[[:space:]]*"[A-Z]*"/"level": "INFO"/' \
      /etc/cufile.json > "$W/cufile.json"
  grep -q '"allow_compat_mode": true' "$W/cufile.json" || echo "note: /etc/cufile.json has no allow_compat_mode key"
else
  cat > "$W/cufile.json" <<'JSON'
{
  "logging": { "level": "INFO" },
  "properties": { "allow_compat_mode": true }
}
JSON
fi
echo "cufile.json used for compatibility mode: $(grep -E '"(allow_compat_mode|level|use_pci_p2pdma|force_compat_mode)"' "$W/cufile.json" | tr -s ' ' | tr '\n' ' ')"
COMPAT=(env CUFILE_ENV_PATH_JSON="$W/cufile.json" CUFILE_LOGFILE_PATH="$CUFILE_LOG")
# The same through the API (cuFileSetParameterBool before cuFileDriverOpen).
FORCE=(env SHUTTLE_CUFILE_COMPAT=force CUFILE_LOGFILE_PATH="$CUFILE_LOG")

if [ -f /usr/local/cuda/include/cufile.h ] && command -v c++ >/dev/null; then
  step "cufile.h ABI check" 120 c++ -std=c++20 -Wall -Wextra -Werror -fsyntax-only -isystem /usr/local/cuda/include \
    tests/gpu/cufile_abi.cpp
else
  echo "=== cufile.h ABI check: skipped (no cufile.h or no c++ here)"
fi

step "shuttle-info" 60 "$D/shuttle-info"
step "shuttle-info, SHUTTLE_FILE_ENGINE=cufile, compatibility mode" 60 \
  "${COMPAT[@]}" SHUTTLE_FILE_ENGINE=cufile "$D/shuttle-info"

# Without the json cuFile's registration fails (5027): only uring runs, and
# the fallback note is printed.
step "test_gpu_file (default cuFile config)" 150 env TMPDIR="$W" "$D/test_gpu_file"
step "test_gpu_file (cuFile compatibility mode, cufile.json)" 150 \
  "${COMPAT[@]}" TMPDIR="$W" "$D/test_gpu_file"
step "test_gpu_file (cuFile compatibility mode forced, SHUTTLE_CUFILE_COMPAT=force)" 150 \
  "${FORCE[@]}" TMPDIR="$W" "$D/test_gpu_file"
echo "=== cuFile log ($CUFILE_LOG), last 40 lines"
tail -n 40 "$CUFILE_LOG" 2>/dev/null || echo "(none written)"

rm -f "$W/weights.dat"
# Rounds of (pipelined, disk alone, network alone) in rotating order: the
# disk's speed moves between runs, each round is judged on its own bounds.
step "weights_push, engine auto, 7 rounds" 150 "$D/shuttle-weights-push" "$W/weights.dat" --mib 512 --rounds 7
step "weights_push, engine auto, one reader, 7 rounds" 150 "$D/shuttle-weights-push" "$W/weights.dat" --mib 512 \
  --rounds 7 --readers 1
step "weights_push, engine cufile (compatibility mode), 3 rounds" 120 \
  "${COMPAT[@]}" SHUTTLE_FILE_ENGINE=cufile "$D/shuttle-weights-push" "$W/weights.dat" --rounds 3
rm -f "$W/weights.dat" "$W/weights.dat.part"

# SHUTTLE_BENCH_ROUNDS: rounds of dd / naive / uring in rotating order, the
# ratios' medians. SHUTTLE_BENCH_SWEEP (e.g. 1x16,4x16,8x4,4x64) adds a
# table of uring depth x chunk configurations and dd / naive block sizes.
step "gpu_file_bench 2 GiB" 300 "${COMPAT[@]}" \
  SHUTTLE_BENCH_ROUNDS=${SHUTTLE_BENCH_ROUNDS-7} ${SHUTTLE_BENCH_SWEEP:+SHUTTLE_BENCH_SWEEP=$SHUTTLE_BENCH_SWEEP} \
  "$D/gpu_file_bench" "$W/bench.dat" 2
rm -f "$W/bench.dat"
echo "=== cuFile log ($CUFILE_LOG), last 20 lines"
tail -n 20 "$CUFILE_LOG" 2>/dev/null || echo "(none written)"

if [ $fail -eq 0 ]; then echo "=== overall: PASS"; else echo "=== overall: FAIL"; fi
exit $fail
