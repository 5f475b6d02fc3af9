#!/bin/bash
# The demo command: installs what is missing, builds, then runs
#  1. the echo server and its load client over TCP (1, 64 and 1024 connections);
#  2. the echo server checked by an ordinary TCP client (python3 socket);
#  3. a short echo over the transport API (--transport tcp-provider:
#     shuttle's RDMA semantics over TCP);
#  4. the RDMA-style transfer pipeline over the transport API
#     (shuttle-transfer, over the tcp provider so that it runs anywhere;
#     `--transport rdma --addr ADDR` runs it on an RDMA NIC);
#  5. the streaming pipeline (examples/stream_pipeline: Asio ingest, compute,
#     shuttle transport to a sink that confirms count and checksum);
#  6. with a CUDA build on a machine with a GPU: shuttle-info and the GPU
#     pipeline (shuttle-gpu-pipeline, checksums verified per chunk).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
if [ -d build-demo ]; then meson setup --reconfigure build-demo --buildtype=release >/dev/null
else meson setup build-demo --buildtype=release >/dev/null; fi
ninja -C build-demo
ulimit -n 65536 2>/dev/null || true

server_pid=
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; true; }
trap cleanup EXIT

log=$(mktemp)
./build-demo/examples/shuttle-echo-server --port 0 --threads 2 >"$log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "listening on port" "$log" && break; sleep 0.05; done
port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log")
[ -n "$port" ] || { cat "$log"; echo "echo server did not start"; exit 1; }
echo "== echo server on port $port (2 threads)"

for c in 1 64 1024; do
  echo "== shuttle-echo-client: $c connections, 64 B, 2 s"
  ./build-demo/examples/shuttle-echo-client --host 127.0.0.1 --port "$port" --connections "$c" --size 64 --duration 2 --threads 2
done

echo "== an ordinary TCP client (python3 socket)"
python3 - "$port" <<'PY'
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
msg = b"hello from an ordinary socket\n" * 100
s.sendall(msg)
got = b""
while len(got) < len(msg):
    got += s.recv(65536)
assert got == msg, "echo mismatch"
print("python3 socket: %d bytes echoed and verified" % len(got))
PY

kill -INT "$server_pid"; wait "$server_pid"; server_pid=
cat "$log" | tail -n 2

echo "== echo over the transport API (--transport tcp-provider)"
./build-demo/examples/shuttle-echo-server --port 0 --transport tcp-provider >"$log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "listening on port" "$log" && break; sleep 0.05; done
port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log")
[ -n "$port" ] || { cat "$log"; echo "transport echo server did not start"; exit 1; }
head -n 1 "$log"
./build-demo/examples/shuttle-echo-client --host 127.0.0.1 --port "$port" --transport tcp-provider \
  --connections 4 --size 1000 --duration 1 --threads 2
kill -INT "$server_pid"; wait "$server_pid"; server_pid=
tail -n 1 "$log"

echo "== transfer pipeline over the transport API"
./build-demo/examples/shuttle-transfer --transport tcp-provider --chunks 512 --chunk-size 1m --slots 8

echo "== streaming pipeline: Asio TCP ingest -> compute -> shuttle transport -> sink (counts and checksums)"
./build-demo/examples/stream_pipeline --clients 8 --records-per-client 20000 --report-ms 250

if [ -x ./build-demo/examples/shuttle-gpu-pipeline ] && nvidia-smi -L >/dev/null 2>&1; then
  echo "== GPU pipeline: producer kernel -> staged transfer -> consumer kernel, checksums per chunk"
  ./build-demo/examples/shuttle-info
  ./build-demo/examples/shuttle-gpu-pipeline 256 1024 16
else
  echo "== GPU pipeline: skipped (no CUDA build or no GPU on this machine)"
fi
echo "demo: done"
