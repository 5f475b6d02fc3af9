#!/bin/bash
# The test command: installs what is missing, then builds and runs every test
# in five configurations (each one after build-ci compiles while the one
# before it runs its tests):
#   build-ci     g++, all suites (unit, transport, verbs in the Soft-RoCE guest)
#                but asio-doc, then meson install and a downstream build
#                (tools/test-consumers.sh)
#   build-asan   g++ -O0 with ASan+UBSan, the same suites
#   build-asio181 g++ -O0 ASan+UBSan against Boost 1.81 (tools/boost-alt.sh): asio targets, the asio
#                suite and asio-doc (Asio's own examples, built against 1.81; once is enough)
#   build-fuzz   clang, the libFuzzer frame-decoder target, 60 s
#   build-tsan   clang with TSan, the multi-threaded suites (only their targets built)
# Exit status: non-zero if any suite failed. Skips (exit 77) are reported by meson.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
jobs=$(nproc)
status=0
failed_steps=()  # what failed, named again at the end (a CI log is often kept only by its tail)

setup() {  # dir, then meson options: configures (or reconfigures) without building
  local dir=$1; shift
  if [ -d "$dir" ]; then meson setup --reconfigure "$dir" "$@" >/dev/null
  else meson setup "$dir" "$@" >/dev/null; fi
}
configure() {  # dir, then meson options: configures and builds everything
  setup "$@"
  ninja -C "$1" -j "$jobs"
}
run_suites() {  # dir, then meson test options
  local dir=$1; shift
  echo "=== meson test in $dir $*"
  if ! meson test -C "$dir" --print-errorlogs --num-processes "$jobs" "$@"; then
    status=1
    failed_steps+=("$dir")
  fi
}

# Most tests run one at a time (is_parallel : false) and leave a core idle,
# so the next configurations compile meanwhile in the background, as
# SCHED_IDLE (they get the CPU only when no test wants it). Their output
# goes to BUILD_DIR/meson-logs/background-build.log, shown whole if the build
# fails.
background_builds() {  # "dir target..." per build, one after another
  (
    chrt --idle -p 0 "$BASHPID" >/dev/null 2>&1 || renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true
    for spec in "$@"; do
      read -r -d '' -a args <<<"$spec" || true
      if ! ninja -C "${args[0]}" -j "$jobs" "${args[@]:1}" >"${args[0]}/meson-logs/background-build.log" 2>&1; then
        echo "run-tests: the build in ${args[0]} failed:"; cat "${args[0]}/meson-logs/background-build.log"; exit 1
      fi
    done
  ) &
  background=$!
}
wait_background() {
  if ! wait "$background"; then echo "run-tests: a build failed (above)"; exit 1; fi
}

configure build-ci --buildtype=debugoptimized
# -O0 (buildtype debug): the sanitizers find the same faults at any level,
# and instrumented -O2 compiles 4-5x slower (19 min of this script on 2
# cores, against 4); build-ci covers the optimized code.
setup build-asan --buildtype=debug -Db_sanitize=address,undefined -Db_lundef=false -Dbench=false
background_builds build-asan
run_suites build-ci --no-suite asio-doc
echo "=== downstream use: meson install + pkg-config, meson subproject"
bash tools/test-consumers.sh build-ci || { status=1; failed_steps+=("downstream use (tools/test-consumers.sh)"); }
wait_background
echo "=== built in the background: build-asan ($(grep -c "^\[" build-asan/meson-logs/background-build.log) steps)"

# The Asio interop against the other Boost Debian 12 packages (1.81; the
# system one is 1.74), unpacked beside it by tools/boost-alt.sh (conflicting
# packages: nothing is installed). Only the asio targets are built, with
# ASan+UBSan, and only the asio suites run; the forms 1.74 lacks (slots,
# deferred, as_tuple, ||, &&) run here and are SKIP in the builds above.
later=()
have181=0
if boost181=$(bash tools/boost-alt.sh 1.81); then
  have181=1
  setup build-asio181 --native-file "$boost181" --buildtype=debug -Db_sanitize=address,undefined -Db_lundef=false \
    -Dbench=false
  later+=("build-asio181 lib/libshuttle.a tests/asio/test_asio_tokens tests/asio/test_asio_pipeline
           tests/asio/test_asio_driver tests/asio/test_asio_pool")
else
  echo "run-tests: Boost 1.81 unavailable (tools/boost-alt.sh failed): asio suite not run against it"
  status=1
  failed_steps+=("Boost 1.81 (tools/boost-alt.sh)")
fi
# The frame fuzzer (clang libFuzzer): only its target is built.
CC=clang CXX=clang++ setup build-fuzz -Dbench=false
later+=("build-fuzz tests/transport/fuzz_frame")
# TSan: only the targets of the multi-threaded suite are built.
CC=clang CXX=clang++ setup build-tsan --buildtype=debugoptimized -Db_sanitize=thread -Db_lundef=false -Dbench=false
later+=("build-tsan tests/test_runtime tests/asio/test_asio_tokens tests/asio/test_asio_driver tests/asio/test_asio_pool")
background_builds "${later[@]}"

# The guest suites too (about 3 minutes more under ASan): LeakSanitizer
# sees what the verbs provider leaves behind when a context ends.
run_suites build-asan --no-rebuild --no-suite fuzz --no-suite asio-doc
wait_background
echo "=== built in the background: ${later[*]%% *}"

if [ $have181 = 1 ]; then run_suites build-asio181 --no-rebuild --suite asio --suite asio-doc; fi
run_suites build-fuzz --no-rebuild --suite fuzz  # a bounded 60 s run
TSAN_OPTIONS=halt_on_error=1 run_suites build-tsan --no-rebuild --suite threads

if [ $status -eq 0 ]; then echo "run-tests: all suites passed"; exit 0; fi
echo "run-tests: FAILURES in: ${failed_steps[*]}"
for step in "${failed_steps[@]}"; do
  if [ -f "$step/meson-logs/testlog.json" ]; then python3 tools/failed-tests.py "$step" || true; fi
done
echo "run-tests: FAILURES in: ${failed_steps[*]}"
exit $status
