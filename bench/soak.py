#!/usr/bin/env python3
"""Soak: mixed load with hostile peers among good ones against the echo server.

Usage: bench/soak.py BUILD_DIR [--minutes M] [--mode tcp|tcp-ring|tcp-provider|all]

For each mode, one shuttle-echo-server runs while
  - good clients (shuttle-echo-client, a few connections, sizes 64 B to 64 KiB)
    run back to back; each run verifies every echoed byte and must exit 0 with
    no error;
  - hostile peers run beside them, each kind in its own thread:
      silent     connections that never send a byte (held, reopened when closed)
      partial    half a hello (tcp-provider) or half a request, then nothing
      nonreader  sends without ever reading what comes back
      flood      (tcp-provider) a stream of valid no-op frames (ACK of seq 0)
      nak        (tcp-provider) a READ with a forged rkey: must get its NAK
      garbage    random bytes after the hello
      splitter   (tcp-provider) a correct peer written here that splits every
                 SEND across two writes and checks its echo byte for byte
Every 30 s it prints the server's RSS and open descriptors and the counts.
It fails (exit 1) when a good client or the splitter saw an error, when a NAK
was lost, or when memory grew: the last RSS sample more than 20% + 8 MiB over
the first one taken after the first minute. Not run in CI (it takes
minutes); run it by hand after changes to a provider or the servers.
"""
import argparse
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time

HELLO_MAGIC = 0x4C485453
HDR = 48
OP_SEND, OP_READ_REQ, OP_ACK, OP_NAK, OP_CREDIT = 1, 4, 16, 17, 20


def header(op, seq=0, addr=0, rkey=0, length=0, arg0=0, flags=0, imm=0):
    return struct.pack("<BBBBIQQIIQQ", op, flags, 0, 0, imm, seq, addr, rkey, length, arg0, 0)


def parse_header(b):
    op, flags, st, _, imm, seq, addr, rkey, length, arg0, arg1 = struct.unpack("<BBBBIQQIIQQ", b)
    return op, st, seq, length, arg0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {}

    def add(self, k, n=1):
        with self.lock:
            self.c[k] = self.c.get(k, 0) + n

    def get(self, k):
        with self.lock:
            return self.c.get(k, 0)

    def line(self):
        with self.lock:
            return " ".join(f"{k}={v}" for k, v in sorted(self.c.items()))


def connect(port, timeout=5.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        b = s.recv(n - len(buf))
        if not b:
            raise ConnectionError("closed")
        buf += b
    return buf


def provider_hello(s):
    """Takes the server's hello (it writes first) and answers with the same
    bytes: the same version and receive geometry, whatever they are."""
    s.settimeout(5.0)
    first = s.recv(4096)
    if len(first) < 8 or struct.unpack("<I", first[:4])[0] != HELLO_MAGIC:
        raise ConnectionError("no hello")
    time.sleep(0.05)
    s.setblocking(False)
    try:
        first += s.recv(4096)
    except BlockingIOError:
        pass
    s.setblocking(True)
    s.sendall(first)
    return first


def hostile(kind, port, provider, stop, st):
    held = []
    rnd = random.Random(kind)
    while not stop.is_set():
        try:
            if kind == "silent":
                while len(held) < 40 and not stop.is_set():
                    held.append(connect(port))
                for s in list(held):  # reopen what the server closed (idle timeout, cap)
                    s.setblocking(False)
                    try:
                        if s.recv(65536) == b"":
                            held.remove(s)
                            s.close()
                            st.add("silent_closed")
                    except BlockingIOError:
                        pass
                    except OSError:
                        held.remove(s)
                        s.close()
                        st.add("silent_closed")
                stop.wait(1.0)
            elif kind == "partial":
                s = connect(port)
                if provider:
                    s.sendall(struct.pack("<IH", HELLO_MAGIC, 1))
                else:
                    s.sendall(b"x" * 7)
                held.append(s)
                if len(held) > 30:
                    held.pop(0).close()
                stop.wait(0.5)
            elif kind == "nonreader":
                s = connect(port)
                if provider:
                    h = provider_hello(s)
                    n = struct.unpack("<I", h[8:12])[0]
                    for seq in range(1, n + 1):  # every credit it was given, then it holds
                        s.sendall(header(OP_SEND, seq=seq, length=1024) + b"n" * 1024)
                else:
                    s.setblocking(False)
                    chunk = b"n" * 65536
                    end = time.monotonic() + 5
                    while time.monotonic() < end and not stop.is_set():
                        try:
                            s.send(chunk)
                        except BlockingIOError:
                            time.sleep(0.05)
                held.append(s)
                st.add("nonreader_conns")
                if len(held) > 10:
                    held.pop(0).close()
                stop.wait(2.0)
            elif kind == "flood":
                s = connect(port)
                provider_hello(s)
                frames = header(OP_ACK, seq=0) * 1024
                s.setblocking(False)
                end = time.monotonic() + 3
                sent = 0
                while time.monotonic() < end and not stop.is_set():
                    try:
                        sent += s.send(frames)
                    except BlockingIOError:
                        time.sleep(0.001)
                    except OSError:
                        break
                st.add("flood_frames", sent // HDR)
                s.close()
            elif kind == "nak":
                s = connect(port)
                provider_hello(s)
                s.sendall(header(OP_READ_REQ, seq=1, addr=0x1000, rkey=rnd.getrandbits(32) | 1, length=64))
                s.settimeout(10.0)
                try:
                    got = recv_exact(s, HDR)
                    op, status, seq, _, _ = parse_header(got)
                    st.add("nak_ok" if op == OP_NAK and seq == 1 else "nak_wrong")
                except (ConnectionError, OSError):
                    st.add("nak_lost")
                s.close()
                stop.wait(0.2)
            elif kind == "garbage":
                s = connect(port)
                if provider:
                    provider_hello(s)
                s.sendall(bytes(rnd.getrandbits(8) for _ in range(4096)))
                s.close()
                st.add("garbage_conns")
                stop.wait(0.2)
            elif kind == "splitter":
                splitter(port, stop, st, rnd)
        except (OSError, ConnectionError):
            st.add(kind + "_refused")
            stop.wait(0.2)
    for s in held:
        s.close()


def splitter(port, stop, st, rnd):
    s = connect(port)
    h = provider_hello(s)
    s.settimeout(10.0)
    seq = 0
    for _ in range(200):
        if stop.is_set():
            break
        seq += 1
        n = rnd.choice([1, 100, 4000, 30000])
        payload = bytes(rnd.getrandbits(8) for _ in range(min(n, 64))) * (n // min(n, 64) + 1)
        payload = payload[:n]
        frame = header(OP_SEND, seq=seq, length=n) + payload
        cut = rnd.randrange(1, len(frame))
        s.sendall(frame[:cut])
        time.sleep(0.002)
        s.sendall(frame[cut:])
        while True:  # ACKs and CREDITs until the echo arrives
            op, status, rseq, length, arg0 = parse_header(recv_exact(s, HDR))
            if op == OP_SEND:
                data = recv_exact(s, length)
                s.sendall(header(OP_ACK, seq=rseq) + header(OP_CREDIT, arg0=1))
                st.add("split_ok" if data == payload else "split_mismatch")
                break
            if op not in (OP_ACK, OP_CREDIT):
                st.add("split_unexpected")
                s.close()
                return
    s.close()


def good(exe, port, transport, stop, st, lat):
    rnd = random.Random(7)
    while not stop.is_set():
        size = rnd.choice([64, 4096, 65536])
        cmd = [exe, "--port", str(port), "--transport", transport, "--connections", "4",
               "--size", str(size), "--duration", "4", "--connect-timeout", "10"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        errors = None
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("errors:"):
                errors = int(line.split()[1])
            m = re.match(r"latency:.*\bp99 ([0-9.]+) us", line)
            if m:
                lat.append(float(m.group(1)))
        if p.returncode != 0 or errors != 0:
            st.add("good_failed")
            print(f"  good client failed (rc {p.returncode}):\n{out}", flush=True)
        else:
            st.add("good_runs")


def proc_figures(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def soak(build, mode, minutes):
    server = os.path.join(build, "examples", "shuttle-echo-server")
    client = os.path.join(build, "examples", "shuttle-echo-client")
    port = free_port()
    transport = {"tcp": "tcp", "tcp-ring": "tcp", "tcp-provider": "tcp-provider"}[mode]
    provider = transport == "tcp-provider"
    cmd = [server, "--port", str(port), "--transport", transport]
    if mode == "tcp-ring":
        cmd += ["--recv-ring", "1024"]
    if provider:
        cmd += ["--idle-timeout", "5000", "--handshake-timeout", "2000", "--max-handshakes", "64"]
    print(f"== {mode}: {' '.join(cmd)}", flush=True)
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    errlines = []
    threading.Thread(target=lambda: errlines.extend(srv.stderr), daemon=True).start()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    stop = threading.Event()
    st = Stats()
    lat = []
    kinds = ["silent", "partial", "nonreader", "garbage"]
    if provider:
        kinds += ["flood", "nak", "splitter"]
    threads = [threading.Thread(target=hostile, args=(k, port, provider, stop, st)) for k in kinds]
    threads.append(threading.Thread(target=good, args=(client, port, transport, stop, st, lat)))
    for t in threads:
        t.start()
    start = time.monotonic()
    samples = []
    ok = True
    try:
        while time.monotonic() - start < minutes * 60:
            time.sleep(30)
            if srv.poll() is not None:
                print(f"  server died with {srv.returncode}", flush=True)
                ok = False
                break
            rss, fds = proc_figures(srv.pid)
            t = time.monotonic() - start
            samples.append((t, rss))
            p99 = sorted(lat)[len(lat) // 2] if lat else float("nan")
            print(f"  t={t:5.0f}s rss={rss} KiB fds={fds} good p99 (median of runs)={p99:.0f} us  {st.line()}",
                  flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
        srv.terminate()
        srv.wait(timeout=30)
    base = [r for t, r in samples if t >= 60]
    if len(base) >= 2 and base[-1] > base[0] * 1.2 + 8192:
        print(f"  memory grew: {base[0]} -> {base[-1]} KiB", flush=True)
        ok = False
    for bad in ("good_failed", "split_mismatch", "split_unexpected", "nak_lost", "nak_wrong"):
        if st.get(bad):
            print(f"  {bad}: {st.get(bad)}", flush=True)
            ok = False
    if st.get("good_runs") == 0:
        print("  no good client run completed", flush=True)
        ok = False
    if provider and (st.get("split_ok") == 0 or st.get("nak_ok") == 0):
        print("  the splitter or the NAK peer never completed", flush=True)
        ok = False
    print(f"  server log lines: {len(errlines)} (last: {errlines[-1].strip() if errlines else '-'})", flush=True)
    print(f"== {mode}: {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--mode", default="all", choices=["tcp", "tcp-ring", "tcp-provider", "all"])
    a = ap.parse_args()
    modes = ["tcp", "tcp-ring", "tcp-provider"] if a.mode == "all" else [a.mode]
    ok = all([soak(a.build, m, a.minutes) for m in modes])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
