#!/bin/bash
# Checks that shuttle works for a downstream project, both ways the issue
# promises:
#   1. `meson install` into a staging dir, then tests/consumer/main.cpp built
#      with `pkg-config --cflags --libs shuttle` and run against the
#      installed shared library;
#   2. tests/consumer/ as a meson project that takes shuttle as a subproject
#      (dependency('shuttle') through meson.override_dependency).
# Usage: tools/test-consumers.sh BUILD_DIR   (an already built shuttle build dir)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== meson install into a staging dir, then a pkg-config consumer"
meson install -C "$build" --no-rebuild --destdir "$work/stage" --quiet
pc=$(find "$work/stage" -name shuttle.pc | head -n 1)
[ -n "$pc" ] || { echo "test-consumers: no shuttle.pc installed"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$work/stage
libdir=$(dirname "$(find "$work/stage" -name 'libshuttle.so' | head -n 1)")
# shellcheck disable=SC2046
g++ -std=c++20 -Wall -Wextra -Werror tests/consumer/main.cpp -o "$work/consumer" $(pkg-config --cflags --libs shuttle)
LD_LIBRARY_PATH=$libdir "$work/consumer"
# ldd's whole output first: `ldd | grep -q` under pipefail fails whenever
# grep exits on its match before ldd has written the rest (SIGPIPE).
deps=$(LD_LIBRARY_PATH=$libdir ldd "$work/consumer")
grep -q "$libdir/libshuttle.so" <<<"$deps" || { echo "test-consumers: not linked to the installed libshuttle.so"; exit 1; }

echo "== shuttle as a meson subproject"
mkdir -p "$work/proj/subprojects"
cp tests/consumer/meson.build tests/consumer/main.cpp "$work/proj/"
ln -s "$PWD" "$work/proj/subprojects/shuttle"
meson setup "$work/proj/build" "$work/proj" --force-fallback-for=shuttle >/dev/null
ninja -C "$work/proj/build" consumer >/dev/null
"$work/proj/build/consumer"
echo "test-consumers: OK"
