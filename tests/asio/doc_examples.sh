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
#   cpp11/echo/async_tcp_echo_server.cpp, cpp20/coroutines/timeout.cpp echo a
#     client, end on SIGTERM's default action (no signal_set), status 143
#   cpp20/coroutines/chat_server.cpp: a line reaches another client; SIGINT
#   cpp11/chat: chat_server + the example's chat_client (its io_context.run()
#     thread runs the driver; main() posts from its thread): messages both
#     ways, the client ends on EOF, the server on SIGTERM
#   cpp11/http/server (io_context_.run() sits in server::run(), server.cpp):
#     serves a page, ends on SIGINT through its signal_set (out of work)
#   cpp03/http/client/async_client.cpp: async_resolve("127.0.0.1", "http")
#     on the driven loop (the resolver thread posts back), fetches the page
#     from the HTTP server on port 80, ends on its own (skipped when port 80
#     cannot be bound: not root)
#   cpp11/parallel_group/wait_for_one.cpp: stdin beats the 5 s timer, ends
#     on its own
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
# first FILE: FILE unchanged but for the include line put first (the include
# rule holds in every translation unit), for multi-file examples.
first() {
  local dst="$out/$(basename "$(dirname "$1")")_$(basename "$1")"
  { echo '#include <shuttle/asio/asio.hpp>  // added: first (the include rule)'; cat "$1"; } >"$dst"
  echo "$dst"
}
# Every example is prepared first and compiled in parallel (one job per
# core: each is a whole Asio translation unit), then run in turn.
# build_one SOURCES...: queues the compile, prints the binary's name (after
# the first source; -I its original dir via $inc).
build_one() {
  local bin="${1%.cpp}"
  local cmd=("$CXX" -std=c++20 -O0 "${sanflags[@]}" -Werror=return-type -isystem "$boost_inc" -Iinclude
             -I"$build/include" ${inc:+-I"$inc"} "$@" -o "$bin" "$lib" -luring -lpthread)
  printf '%q ' "${cmd[@]}" >"$bin.cmd"
  echo "$bin"
}
# compile_all: runs the queued compiles, $(nproc) at a time; a failed one
# fails the test (its compiler output shown).
compile_all() {
  local cmds=("$out"/*.cmd)
  printf '%s\0' "${cmds[@]}" |
    xargs -0 -P "$(nproc)" -I{} bash -c 'bash "$1" >"${1%.cmd}.build.log" 2>&1 || { echo "doc_examples: compile failed: $(cat "$1")"; cat "${1%.cmd}.build.log"; exit 255; }' _ {} ||
    { echo "doc_examples: FAILED to compile"; exit 1; }
}
status=0
inc=""
# The clients (python3): each waits for its port by polling, bounded.
cat >"$out/client.py" <<'PY'
import socket, subprocess, sys, time
def connect(port):
    for _ in range(400):
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=20)
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"no server on port {port}")
def recv_exact(s, n):
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return got
def recv_line(s):
    got = b""
    while not got.endswith(b"\n"):
        chunk = s.recv(1)
        if not chunk:
            break
        got += chunk
    return got
cmd, port = sys.argv[1], int(sys.argv[2])
if cmd == "wait":
    connect(port).close()
elif cmd == "echo":  # echo PORT MSG: prints what came back
    s = connect(port)
    msg = sys.argv[3].encode()
    s.sendall(msg)
    print(recv_exact(s, len(msg)).decode())
elif cmd == "chat20":  # line chat: a line from A reaches B (and A)
    a, b = connect(port), connect(port)
    # B is in the room once a line from B comes back to B.
    b.sendall(b"b joined\n")
    assert recv_line(b) == b"b joined\n"
    a.sendall(b"hello from a\n")
    while (line := recv_line(b)) != b"hello from a\n":
        assert line, "B lost the connection"
    print("delivered")
elif cmd == "chat11":  # chat11 PORT CLIENT: the example's chat_client talks to a raw participant
    def msg(body):
        return b"%4d" % len(body) + body
    def read_msg(s):
        n = int(recv_exact(s, 4).decode())
        return recv_exact(s, n)
    a = connect(port)
    a.sendall(msg(b"hello client"))
    assert read_msg(a) == b"hello client"  # the room has it (A is in the room)
    import os, pty
    mfd, sfd = pty.openpty()  # a terminal: the client's std::cout is line-buffered
    c = subprocess.Popen([sys.argv[3], "127.0.0.1", str(port)], stdin=subprocess.PIPE,
                         stdout=sfd, text=True)
    os.close(sfd)
    out = os.fdopen(mfd, "r", newline="")
    got = out.readline().replace("\r", "")  # the room's history, printed by the client
    assert got == "hello client\n", repr(got)
    c.stdin.write("hello server\n")
    c.stdin.flush()
    while (m := read_msg(a)) != b"hello server":
        assert m, "A lost the connection"
    c.stdin.close()  # EOF: the client closes and joins its thread
    rc = c.wait(timeout=30)
    assert rc == 0, rc
    print("delivered both ways, client ended")
PY
# serve BIN ARGS...: starts a server in the background, pid in $pid
serve() { "$@" >"$out/server.log" 2>&1 & pid=$!; }
# free_port: a port below the ephemeral range (32768 and up), free to bind
# now: a fixed port in that range may be any client socket's meanwhile (a
# run failed so, the server's bind refused), and one below it is taken only
# by a listener. Random start: runs side by side pick apart.
free_port() {
  python3 - <<'PY'
import random, socket
start = random.randrange(20000, 32000)
for p in list(range(start, 32000)) + list(range(20000, start)):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", p))
    except OSError:
        continue
    finally:
        s.close()
    print(p)
    break
else:
    raise SystemExit("doc_examples: no free port in 20000-31999")
PY
}
# with_port FILE OLD NEW: the example's fixed port OLD replaced (once, checked).
with_port() {
  [ "$(grep -c "$2" "$1")" = 1 ] || { echo "doc_examples: '$2' not once in $1" >&2; exit 1; }
  sed -i "s/$2/$3/" "$1"
}
# stopped_by SIG RC NAME: sends SIG to $pid and checks its exit status is RC
# (what the same program does on a plain io_context).
stopped_by() {
  kill -"$1" "$pid"
  local rc=0
  wait "$pid" || rc=$?
  [ "$rc" = "$2" ] || { echo "$3: FAILED (exit status $rc on SIG$1, expected $2)"; cat "$out/server.log"; status=1; return 1; }
}

# ---- every example, prepared and queued
t1=$(build_one "$(move "$ex/cpp03/timers/time_t_timer.cpp" io_context)")
t3=$(build_one "$(move "$ex/cpp03/tutorial/timer3/timer.cpp" io)")
t5=$(build_one "$(move_pool "$ex/cpp03/tutorial/timer5/timer.cpp")")

src=$(move "$ex/cpp20/coroutines/echo_server.cpp" io_context)
echo20_port=$(free_port)
with_port "$src" 55555 "$echo20_port"
echo20=$(build_one "$src")

echo11=$(build_one "$(move "$ex/cpp11/echo/async_tcp_echo_server.cpp" io_context)")

src=$(move "$ex/cpp20/coroutines/timeout.cpp" ctx)
timeout_port=$(free_port)
with_port "$src" 54321 "$timeout_port"
timeout20=$(build_one "$src")

chat20=$(build_one "$(move "$ex/cpp20/coroutines/chat_server.cpp" io_context)")

inc="$ex/cpp11/chat"
chat_server=$(build_one "$(move "$ex/cpp11/chat/chat_server.cpp" io_context)")
# chat_client runs io_context.run() on a std::thread: that thread runs the
# driver instead; main() posts to the context from its own thread.
l='std::thread t([&io_context](){ io_context.run(); });'
grep -qF "$l" "$ex/cpp11/chat/chat_client.cpp" || { echo "doc_examples: no '$l' in chat_client.cpp" >&2; exit 1; }
src="$out/chat_chat_client.cpp"
{
  echo '#include <shuttle/asio/asio.hpp>  // added: first (the include rule)'
  sed 's|std::thread t(\[&io_context\](){ io_context.run(); });|std::thread t([\&io_context](){ shuttle::io_context shuttle_loop; shuttle::asio::asio_driver shuttle_drive(shuttle_loop, io_context); shuttle_drive.run(); });  // was: io_context.run() on the thread|' \
    "$ex/cpp11/chat/chat_client.cpp"
} >"$src"
chat_client=$(build_one "$src")
inc=""

# The HTTP server (cpp11/http/server): its io_context_.run() is in
# server::run() (server.cpp), called from main(); every file gets the include.
h="$ex/cpp11/http/server"
srcs=("$(move "$h/server.cpp" io_context_)")
for f in "$h"/*.cpp; do [ "$(basename "$f")" = server.cpp ] || srcs+=("$(first "$f")"); done
inc="$h"
httpd=$(build_one "${srcs[@]}")
inc=""
# The async HTTP client resolves "<server>" with service "http": port 80,
# which needs root (CAP_NET_BIND_SERVICE); without it, the server runs on
# another port and the client case is skipped.
if python3 -c 'import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 80))' 2>/dev/null; then
  http_port=80
  http_client=$(build_one "$(move "$ex/cpp03/http/client/async_client.cpp" io_context)")
else
  http_port=$(free_port)
fi

wait_for_one=$(build_one "$(move "$ex/cpp11/parallel_group/wait_for_one.cpp" ctx)")

compile_all

# ---- each run
if timeout 30 "$t1" >"$out/t1.log" 2>&1; then echo "time_t_timer: ended on its own"
else echo "time_t_timer: FAILED (rc $?)"; cat "$out/t1.log"; status=1; fi

if timeout 30 "$t3" >"$out/t3.log" 2>&1 && grep -q "^4$" "$out/t3.log" && grep -q "Final count is 5" "$out/t3.log"; then
  echo "timer3: ended on its own, counted to 5"
else echo "timer3: FAILED"; cat "$out/t3.log"; status=1; fi

if timeout 60 "$t5" >"$out/t5.log" 2>&1 && grep -q "^Timer [12]: 9$" "$out/t5.log" && grep -q "Final count is 10" "$out/t5.log"; then
  echo "timer5: ended on its own on two loops, counted to 10"
else echo "timer5: FAILED"; cat "$out/t5.log"; status=1; fi

"$echo20" >"$out/echo.log" 2>&1 &
pid=$!
reply=$(python3 "$out/client.py" echo "$echo20_port" "hello shuttle") || true
kill -INT $pid
if wait $pid && [ "$reply" = "hello shuttle" ]; then echo "cpp20 echo_server: echoed, ended on SIGINT"
else echo "cpp20 echo_server: FAILED (reply '$reply')"; cat "$out/echo.log"; status=1; fi

port=$(free_port)
serve "$echo11" "$port"
reply=$(python3 "$out/client.py" echo "$port" "hello shuttle") || true
# No signal_set: SIGTERM's default action ends it (status 143), as on io_context
# (a background job of a script ignores SIGINT).
[ "$reply" = "hello shuttle" ] || { echo "cpp11 async_tcp_echo_server: FAILED (reply '$reply')"; cat "$out/server.log"; status=1; }
stopped_by TERM 143 "cpp11 async_tcp_echo_server" && [ "$reply" = "hello shuttle" ] &&
  echo "cpp11 async_tcp_echo_server: echoed, ended on SIGTERM (default action)"

serve "$timeout20"
reply=$(python3 "$out/client.py" echo "$timeout_port" "hello shuttle") || true
[ "$reply" = "hello shuttle" ] || { echo "cpp20 timeout: FAILED (reply '$reply')"; cat "$out/server.log"; status=1; }
stopped_by TERM 143 "cpp20 timeout" && [ "$reply" = "hello shuttle" ] &&
  echo "cpp20 timeout: echoed (watchdog armed), ended on SIGTERM (default action)"

port=$(free_port)
serve "$chat20" "$port"
reply=$(python3 "$out/client.py" chat20 "$port") || true
[ "$reply" = delivered ] || { echo "cpp20 chat_server: FAILED (reply '$reply')"; cat "$out/server.log"; status=1; }
stopped_by INT 0 "cpp20 chat_server" && [ "$reply" = delivered ] &&
  echo "cpp20 chat_server: a line reached the other client, ended on SIGINT (its signal_set)"

port=$(free_port)
serve "$chat_server" "$port"
reply=$(timeout 60 python3 "$out/client.py" chat11 "$port" "$chat_client") || true
[ "$reply" = "delivered both ways, client ended" ] || { echo "cpp11 chat: FAILED (reply '$reply')"; cat "$out/server.log"; status=1; }
stopped_by TERM 143 "cpp11 chat_server" && [ "$reply" = "delivered both ways, client ended" ] &&
  echo "cpp11 chat: server and client (driven on its thread) both ways, client ended on EOF, server on SIGTERM (default action)"

mkdir -p "$out/www"
echo "served by asio on shuttle" >"$out/www/index.html"
serve "$httpd" 127.0.0.1 "$http_port" "$out/www"
python3 "$out/client.py" wait "$http_port" || true
page=$(python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/index.html", timeout=20).read().decode(), end="")' "$http_port") || true
[ "$page" = "served by asio on shuttle" ] || { echo "cpp11 http server: FAILED (page '$page')"; status=1; }
if [ "$http_port" = 80 ]; then
  # Its resolver's thread posts the result back: the loop must wake for it.
  if timeout 30 "$http_client" 127.0.0.1 /index.html >"$out/client.log" 2>&1 && grep -q "^served by asio on shuttle" "$out/client.log" &&
     grep -q "^Content-Type: text/html" "$out/client.log"; then
    echo "cpp03 http async_client: resolved 127.0.0.1 (async_resolve), got the page, ended on its own"
  else echo "cpp03 http async_client: FAILED (rc $?)"; cat "$out/client.log"; status=1; fi
else
  echo "cpp03 http async_client: SKIPPED (cannot bind port 80, the port it asks for)"
fi
stopped_by INT 0 "cpp11 http server" && [ "$page" = "served by asio on shuttle" ] &&
  echo "cpp11 http server: served a page, ended on SIGINT (its signal_set: out of work)"

# Input on stdin wins over the 5 s timer (no waiting on the timer).
if echo hi | timeout 30 "$wait_for_one" >"$out/w1.log" 2>&1 && grep -q "^descriptor finished: .*, 3$" "$out/w1.log"; then
  echo "wait_for_one: the descriptor won, ended on its own (the timer cancelled)"
else echo "wait_for_one: FAILED"; cat "$out/w1.log"; status=1; fi
exit $status
