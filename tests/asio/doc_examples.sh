#!/bin/bash
# Boost.Asio's own examples on shuttle's loop, taken at test time from
# Debian's libboost1.81-doc (not copied into the project): each is changed
# only in main() (its `X.run();` becomes an asio_driver's run() on a shuttle
# loop) plus one include line put first (shuttle/asio/asio.hpp: the include
# rule), built against Boost 1.81 (tools/boost-alt.sh) and run:
#   cpp03/timers/time_t_timer.cpp   must end on its own (out of work)
#   cpp03/tutorial/timer3/timer.cpp must end on its own, printing 0..4
#   cpp20/coroutines/echo_server.cpp answers a client, ends on SIGINT
#   cpp03/tutorial/timer5/timer.cpp must end on its own, counting to 10; its
#     pool (io.run() on main and on a boost::thread) becomes a
#     shuttle::runtime of two loops: shuttle::asio::run(rt, io) (pool.hpp)
#
#   tests/asio/doc_examples.sh BUILD_DIR     (a configured and built build dir)
#
# Exit 77 (skip) when the package cannot be fetched (no apt lists, offline).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:?usage: $0 BUILD_DIR}
lib="$build/lib/libshuttle.a"
[ -f "$lib" ] || { echo "doc_examples: $lib missing (build first)" >&2; exit 1; }
cache=${SHUTTLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shuttle}
docs="$cache/boost-1.81-doc"
if [ -d /usr/share/doc/libboost1.81-doc/examples ]; then  # installed (tools/install-deps.sh)
  docs=""
elif [ ! -f "$docs/.complete" ]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/asio-doc.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download -q libboost1.81-doc 2>&1 | grep -v "unsandboxed as root" >&2 || true)
  deb=$(ls "$work"/libboost1.81-doc_*.deb 2>/dev/null | head -n 1)
  [ -n "$deb" ] || { echo "doc_examples: could not download libboost1.81-doc: SKIP" >&2; exit 77; }
  rm -rf "$docs.tmp" && mkdir -p "$docs.tmp"
  dpkg -x "$deb" "$docs.tmp"
  touch "$docs.tmp/.complete"
  rm -rf "$docs" && mv "$docs.tmp" "$docs"
fi
boost_inc=$(bash tools/boost-alt.sh 1.81 --include) || { echo "doc_examples: no Boost 1.81: SKIP" >&2; exit 77; }
ex="$docs/usr/share/doc/libboost1.81-doc/examples/libs/asio/example"
out=$(mktemp -d "${TMPDIR:-/tmp}/asio-doc-run.XXXXXX")
trap 'rm -rf "$out"' EXIT
CXX=${CXX:-c++}
# A sanitized build's libshuttle.a needs the same -fsanitize at link time.
san=$(meson introspect "$build" --buildoptions 2>/dev/null |
  python3 -c 'import json,sys; print(next((o["value"] for o in json.load(sys.stdin) if o["name"]=="b_sanitize"),"none"))' ||
  echo none)
sanflags=()
[ "$san" = none ] || sanflags=(-fsanitize="$san" -fno-omit-frame-pointer)

# move FILE CONTEXT_VAR: the example with its main()'s `CONTEXT_VAR.run();` on shuttle's loop.
move() {
  local src=$1 var=$2 dst="$out/$(basename "$(dirname "$1")")_$(basename "$1")"
  grep -q "^ *$var\.run();" "$src" || { echo "doc_examples: no '$var.run();' in $src" >&2; exit 1; }
  {
    echo '#include <shuttle/asio/asio.hpp>  // added: first (the include rule)'
    sed "s|^\( *\)$var\.run();|\1shuttle::io_context shuttle_loop; shuttle::asio::asio_driver shuttle_drive(shuttle_loop, $var); shuttle_drive.run();  // was: $var.run();|" "$src"
  } >"$dst"
  echo "$dst"
}
# move_pool FILE: timer5's main() (a thread in io.run(), main in io.run(),
# join) on a shuttle::runtime of two loops sharing io.
move_pool() {
  local src=$1 dst="$out/$(basename "$(dirname "$1")")_$(basename "$1")"
  for l in '^ *boost::thread t(boost::bind(&boost::asio::io_context::run, &io));' '^ *io\.run();' '^ *t\.join();'; do
    grep -q "$l" "$src" || { echo "doc_examples: no '$l' in $src" >&2; exit 1; }
  done
  {
    echo '#include <shuttle/asio/asio.hpp>  // added: first (the include rule)'
    sed -e 's|^\( *\)boost::thread t(boost::bind(&boost::asio::io_context::run, &io));|\1shuttle::runtime shuttle_rt(2);  // was: a boost::thread running io.run()|' \
        -e 's|^\( *\)io\.run();|\1shuttle::asio::run(shuttle_rt, io);  // was: io.run();|' \
        -e 's|^\( *\)t\.join();|\1// was: t.join();|' "$src"
  } >"$dst"
  echo "$dst"
}
build_one() {  # source -> binary
  local bin="${1%.cpp}"
  $CXX -std=c++20 -O1 "${sanflags[@]}" -Werror=return-type -isystem "$boost_inc" -Iinclude -I"$build/include" "$1" -o "$bin" \
    "$lib" -luring -lpthread
  echo "$bin"
}

status=0
src=$(move "$ex/cpp03/timers/time_t_timer.cpp" io_context)
bin=$(build_one "$src")
if timeout 30 "$bin" >"$out/t1.log" 2>&1; then echo "time_t_timer: ended on its own"
else echo "time_t_timer: FAILED (rc $?)"; cat "$out/t1.log"; status=1; fi

src=$(move "$ex/cpp03/tutorial/timer3/timer.cpp" io)
bin=$(build_one "$src")
if timeout 30 "$bin" >"$out/t3.log" 2>&1 && grep -q "^4$" "$out/t3.log" && grep -q "Final count is 5" "$out/t3.log"; then
  echo "timer3: ended on its own, counted to 5"
else echo "timer3: FAILED"; cat "$out/t3.log"; status=1; fi

src=$(move_pool "$ex/cpp03/tutorial/timer5/timer.cpp")
bin=$(build_one "$src")
if timeout 60 "$bin" >"$out/t5.log" 2>&1 && grep -q "^Timer [12]: 9$" "$out/t5.log" && grep -q "Final count is 10" "$out/t5.log"; then
  echo "timer5: ended on its own on two loops, counted to 10"
else echo "timer5: FAILED"; cat "$out/t5.log"; status=1; fi

src=$(move "$ex/cpp20/coroutines/echo_server.cpp" io_context)
bin=$(build_one "$src")
"$bin" >"$out/echo.log" 2>&1 &
pid=$!
reply=$(python3 - <<'PY'
import socket, time
for _ in range(200):
    try:
        s = socket.create_connection(("127.0.0.1", 55555), timeout=10)
        break
    except OSError:
        time.sleep(0.05)
else:
    raise SystemExit("no server on port 55555")
s.sendall(b"hello shuttle")
got = b""
while len(got) < 13:
    chunk = s.recv(64)
    if not chunk:
        break
    got += chunk
print(got.decode())
PY
) || true
kill -INT $pid
if wait $pid && [ "$reply" = "hello shuttle" ]; then echo "cpp20 echo_server: echoed, ended on SIGINT"
else echo "cpp20 echo_server: FAILED (reply '$reply')"; cat "$out/echo.log"; status=1; fi
exit $status
