#!/bin/bash
# Checks that shuttle works for a downstream project, every way README.md's
# "Using shuttle from another project" shows:
#   0. every ```cpp and ```meson block of README.md is, verbatim, part of a
#      file under tests/consumer/ (so every snippet is compiled below);
#   1. `meson install` of BUILD_DIR into a staging dir, then tests/consumer/
#      programs built with `pkg-config --cflags --libs shuttle` and run
#      against the installed shared library; shuttle.pc names no path
#      outside its prefix (none into a CUDA toolkit);
#   2. the plain compiler command lines: shared (-lshuttle -luring -pthread)
#      and static (libshuttle.a and the libraries it uses);
#   3. a library-only build (-Dexamples=false -Dtests=disabled
#      -Dbench=false): no example is built, and what it installs serves (1);
#   4. tests/consumer/ as a meson project that takes shuttle as a subproject
#      (dependency('shuttle') through meson.override_dependency), library only.
# Programs: main.cpp (TCP and transport echo, <shuttle/shuttle.hpp> alone),
# readme_transport.cpp (run), readme_echo_server.cpp (built only: it serves
# until SIGINT).
# Usage: tools/test-consumers.sh BUILD_DIR   (an already built shuttle build dir)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cxx=(g++ -std=c++20 -Wall -Wextra -Werror)
fail() { echo "test-consumers: $*"; exit 1; }

echo "== README.md's code blocks are files under tests/consumer/"
python3 - <<'EOF'
import pathlib, re, sys
readme = pathlib.Path("README.md").read_text()
files = {p: p.read_text() for p in pathlib.Path("tests/consumer").iterdir() if p.suffix in (".cpp", ".build")}
blocks = re.findall(r"^```(cpp|meson)\n(.*?)^```$", readme, re.S | re.M)
missing = [b for _, b in blocks if not any(b in text for text in files.values())]
for b in missing:
    print("test-consumers: README.md block not found verbatim in tests/consumer/:\n" + b, file=sys.stderr)
print(f"{len(blocks) - len(missing)} of {len(blocks)} blocks found")
sys.exit(1 if missing or not blocks else 0)
EOF

# Builds and runs the consumer programs with the given compiler and linker
# arguments; $1 names the mode in messages, $2 the run-time library path.
# The three compile side by side (each is a whole translation unit of
# shuttle's headers); a failure shows its compiler output.
build_and_run() {
  local mode=$1 libpath=$2; shift 2
  local progs=(main readme_transport readme_echo_server) pids=() i
  for prog in "${progs[@]}"; do
    "${cxx[@]}" "tests/consumer/$prog.cpp" -o "$work/$mode-$prog" "$@" >"$work/$mode-$prog.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!progs[@]}"; do
    wait "${pids[$i]}" || { cat "$work/$mode-${progs[$i]}.log"; fail "$mode: ${progs[$i]}.cpp does not build"; }
  done
  LD_LIBRARY_PATH=$libpath "$work/$mode-main"
  LD_LIBRARY_PATH=$libpath "$work/$mode-readme_transport"
}

# Installs a build dir into $work/$2 and sets pc, prefix, libdir for it.
stage() {
  meson install -C "$1" --no-rebuild --destdir "$work/$2" --quiet
  pc=$(find "$work/$2" -name shuttle.pc | head -n 1)
  [ -n "$pc" ] || fail "no shuttle.pc installed"
  export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$work/$2
  libdir=$(pkg-config --variable=libdir shuttle)  # sysroot-prefixed
  prefix=$(pkg-config --variable=prefix shuttle)  # sysroot-prefixed too
  [ -f "$libdir/libshuttle.so" ] || fail "libshuttle.so is not in the .pc's libdir ($libdir)"
  # Everything in the .pc is relative to ${prefix}: no path into the CUDA
  # toolkit or the build machine.
  if grep -v '^prefix=' "$pc" | grep -Eq '(^|[ =])/'; then
    cat "$pc"
    fail "shuttle.pc names an absolute path"
  fi
}

echo "== meson install into a staging dir, then pkg-config consumers"
stage "$build" stage
# shellcheck disable=SC2046
build_and_run pkg-config "$libdir" $(pkg-config --cflags --libs shuttle)
# ldd's whole output first: `ldd | grep -q` under pipefail fails whenever
# grep exits on its match before ldd has written the rest (SIGPIPE).
deps=$(LD_LIBRARY_PATH=$libdir ldd "$work/pkg-config-main")
grep -q "$libdir/libshuttle.so" <<<"$deps" || fail "not linked to the installed libshuttle.so"

echo "== plain compiler command lines"
multiarch=$(g++ -print-multiarch)
[ "$libdir" = "$prefix/lib/$multiarch" ] || fail "libdir $libdir is not the multiarch $prefix/lib/$multiarch"
build_and_run plain "$prefix/lib/$multiarch" -I"$prefix/include" -L"$prefix/lib/$multiarch" -lshuttle -luring -pthread
# Static, as README.md says: libshuttle.a, liburing, rdma-core where the
# build has the verbs provider, cudart_static (with the toolkit's directory,
# which shuttle.pc leaves out) where it has CUDA.
static=("$libdir/libshuttle.a" -luring)
if grep -q '^Requires.private:.*libibverbs' "$pc"; then static+=(-libverbs -lrdmacm); fi
static+=(-pthread)
if grep -q '^Libs.private:.*-lcudart_static' "$pc"; then
  static+=(-L"${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}/lib64" -lcudart_static -ldl -lrt)
fi
build_and_run static /nonexistent -I"$prefix/include" "${static[@]}"
deps=$(ldd "$work/static-main")
if grep -q libshuttle <<<"$deps"; then fail "the static consumer loads libshuttle.so"; fi

# The two library builds below check what is built and installed, not the
# code (build-ci has the optimized library): -O0 (buildtype debug) compiles
# in about half the time.
echo "== a library-only build (-Dexamples=false -Dtests=disabled -Dbench=false)"
meson setup "$work/libonly" --buildtype=debug -Dexamples=false -Dtests=disabled -Dbench=false >/dev/null
ninja -C "$work/libonly" >/dev/null
if [ -n "$(find "$work/libonly" \( -name 'shuttle-echo-server' -o -name 'test_task' \) -type f)" ]; then
  fail "the library-only build built examples or tests"
fi
stage "$work/libonly" stage-libonly
# shellcheck disable=SC2046
build_and_run libonly "$libdir" $(pkg-config --cflags --libs shuttle)

echo "== shuttle as a meson subproject"
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
mkdir -p "$work/proj/subprojects"
cp tests/consumer/meson.build tests/consumer/*.cpp "$work/proj/"
ln -s "$PWD" "$work/proj/subprojects/shuttle"
meson setup "$work/proj/build" "$work/proj" --buildtype=debug --force-fallback-for=shuttle >/dev/null
ninja -C "$work/proj/build" >/dev/null
if [ -n "$(find "$work/proj/build" -name 'shuttle-echo-*')" ]; then fail "the subproject built examples"; fi
"$work/proj/build/consumer"
"$work/proj/build/readme_transport"
echo "test-consumers: OK"
