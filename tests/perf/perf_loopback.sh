#!/bin/bash
# Drives shuttle-perf over the tcp provider on 127.0.0.1: one server (--loop),
# one client per test; fails on a non-zero exit, a missing JSON row, or a
# server that does not exit cleanly. Usage: perf_loopback.sh PATH/TO/shuttle-perf
set -uo pipefail
perf=${1:?usage: perf_loopback.sh SHUTTLE_PERF}
work=$(mktemp -d)
spid=
trap '[ -n "$spid" ] && kill $spid 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "== $f"; cat "$f"; done; exit 1; }

start_server() {  # extra args
  "$perf" --transport tcp --bind 127.0.0.1 --port 0 "$@" >"$work/server.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do grep -q "listening on" "$work/server.log" && break; sleep 0.05; done
  port=$(sed -n 's/.*listening on .*:\([0-9]*\)$/\1/p' "$work/server.log")
  [ -n "$port" ] || fail "server did not start"
}

# One connection, then the server must exit 0 by itself when the client goes.
start_server
"$perf" 127.0.0.1 --transport tcp --port "$port" --test write_bw --size 64K --iters 64 --depth 8 --json \
  >"$work/client.log" 2>&1 || fail "write_bw client exited non-zero"
grep -q '^{"test":"write_bw","transport":"tcp","bytes":65536,"iterations":64' "$work/client.log" ||
  fail "no write_bw JSON row"
for _ in $(seq 100); do kill -0 $spid 2>/dev/null || break; sleep 0.05; done
wait $spid; rc=$?; spid=
[ $rc = 0 ] || fail "server exited $rc after the client disconnected"

# Every test against one --loop server. write_bw at the default depth (128)
# has fewer operations than slots: the server checks the slots the client wrote.
start_server --loop
for t in "write_bw --size 64K --depth 8" "write_bw --size 4K" "write_bw --size 4K --batch 8" "read_bw --size 64K --depth 8" "send_bw --size 4K --depth 16" \
         "write_bw --size 64K --depth 8 --slots 1" "read_bw --size 4K --depth 16 --slots 2" \
         "atomic --depth 4" "write_lat --size 64" "write_lat --size 64 --write-lat-method poll" \
         "write_lat --size 64 --write-lat-method poll --ops single" "send_lat --size 64" \
         "send_lat --size 64 --ops single" "read_lat --size 4K" "read_lat --size 4K --ops single"; do
  # shellcheck disable=SC2086
  "$perf" 127.0.0.1 --transport tcp --port "$port" --test $t --iters 50 --json >"$work/client.log" 2>&1 ||
    fail "client '$t' exited non-zero"
  grep -q '^{"test":' "$work/client.log" || fail "no JSON row for '$t'"
done

# Errors are clear and non-zero.
"$perf" 127.0.0.1 --transport tcp --port "$port" --test nope >"$work/bad.log" 2>&1 && fail "bad --test accepted"
grep -q "unknown test" "$work/bad.log" || fail "no message for a bad --test"
"$perf" 127.0.0.1 --transport tcp --port "$port" --test write_bw --slots 0 >"$work/bad.log" 2>&1 &&
  fail "--slots 0 accepted"
grep -q -- "--slots: bad value '0'" "$work/bad.log" || fail "no message for --slots 0"
"$perf" 127.0.0.1 --transport tcp --port "$port" --test read_lat --ops some >"$work/bad.log" 2>&1 &&
  fail "--ops some accepted"
grep -q -- "--ops: bad value 'some' (prepared, single)" "$work/bad.log" || fail "no message for a bad --ops"
echo "ok"
