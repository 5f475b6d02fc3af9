#!/usr/bin/env python3
"""The example tools' ends and their error log, as an operator meets them.

tools_test.py ECHO_SERVER ECHO_CLIENT PERF TRANSFER

  1. shuttle-perf's server (--loop, tcp provider): SIGTERM after a session
     and SIGINT while idle: exit 0 and its summary line;
  2. shuttle-transfer, stopped mid-run by SIGTERM and by SIGINT: exit 0, the
     summary with "interrupted by SIG...", every chunk so far intact;
  3. shuttle-echo-client exits non-zero when no request completed: nothing
     listening, a server that accepts and closes, a server that accepts and
     never answers;
  4. shuttle-echo-server --transport tcp-provider, with clients that finish
     the hello and then send garbage: each failure is logged with the peer's
     address, a few lines a second, the rest counted in a "suppressed" line
     (every failure shown or counted); the server still serves, and SIGTERM
     ends it with exit 0 and its summary.
Every wait is bounded; exit status 0 when all of that holds.
"""
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from child_log import ChildLog

TIMEOUT = 30.0
LINES_PER_SECOND = 5  # tools::throttled_log's default


def fail(msg, log=None):
    print("tools-test: FAIL:", msg)
    if log is not None:
        print("--- log:")
        print(log[-4000:])
    sys.exit(1)


class Process:
    """A tool in the background, its stdout and stderr in one file."""

    def __init__(self, argv, ready):
        self.log = ChildLog()
        self.proc = subprocess.Popen(argv, stdout=self.log.file, stderr=subprocess.STDOUT)
        deadline = time.time() + TIMEOUT
        self.match = None
        while time.time() < deadline and self.match is None:
            if self.proc.poll() is not None:
                fail("%s exited (%d) before it was ready" % (argv[0], self.proc.returncode), self.text())
            self.match = re.search(ready, self.text())
            time.sleep(0.05)
        if self.match is None:
            self.proc.kill()
            fail("%s was not ready within %d s" % (argv[0], TIMEOUT), self.text())

    def text(self):
        return self.log.text()

    def stop(self, sig, summary):
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("no exit within %d s of %s" % (TIMEOUT, signal.Signals(sig).name), self.text())
        if rc != 0:
            fail("exit status %d after %s" % (rc, signal.Signals(sig).name), self.text())
        m = re.search(summary, self.text())
        if m is None:
            fail("no summary line (%r) after %s" % (summary, signal.Signals(sig).name), self.text())
        return m


def perf(perf_exe):
    print("== shuttle-perf server")
    srv = Process([perf_exe, "--transport", "tcp", "--port", "0", "--bind", "127.0.0.1", "--loop"],
                  r"listening on \S+:(\d+)")
    port = srv.match.group(1)
    r = subprocess.run([perf_exe, "127.0.0.1", "--transport", "tcp", "--port", port, "--test", "send_lat",
                        "--size", "64", "--iters", "200", "--warmup", "0", "--spin-us", "0"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        fail("shuttle-perf client: status %d\n%s%s" % (r.returncode, r.stdout, r.stderr))
    srv.stop(signal.SIGTERM, r"shuttle-perf: served 1 sessions \(0 failed\)")
    print("   SIGTERM after a session: exit 0, served 1 sessions")
    srv = Process([perf_exe, "--transport", "tcp", "--port", "0", "--bind", "127.0.0.1", "--loop"], r"listening on")
    srv.stop(signal.SIGINT, r"shuttle-perf: served 0 sessions \(0 failed\)")
    print("   SIGINT while idle: exit 0, served 0 sessions")


def transfer(transfer_exe):
    print("== shuttle-transfer")
    for sig in (signal.SIGTERM, signal.SIGINT):
        run = Process([transfer_exe, "--transport", "tcp-provider", "--chunks", "1000000000", "--chunk-size", "64k"],
                      r"receiver listening on")
        m = run.stop(sig, r"checksum: OK \((\d+) verified, 0 corrupt\), interrupted by %s" % sig.name)
        if "chunks:" not in run.text():
            fail("no chunk count in the summary", run.text())
        print("   %s: exit 0, %s chunks verified before it" % (sig.name, m.group(1)))


def serve_in_background(handle):
    """A listening socket whose accepted connections go to handle(conn)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    held = []

    def loop():
        while True:
            try:
                c, _ = lsock.accept()
            except OSError:
                return
            held.append(c)
            handle(c)

    threading.Thread(target=loop, daemon=True).start()
    return lsock, held


def echo_client_fails(client_exe, port, what):
    r = subprocess.run([client_exe, "--host", "127.0.0.1", "--port", str(port), "--duration", "0.5",
                        "--connect-timeout", "5", "--json"], capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode == 0:
        fail("shuttle-echo-client against %s: exit 0\n%s%s" % (what, r.stdout, r.stderr))
    print("   %s: exit %d" % (what, r.returncode))


def echo_client(client_exe):
    print("== shuttle-echo-client with no request completed")
    # A port with nothing: bound, never listening (so nobody else takes it).
    idle = socket.socket()
    idle.bind(("127.0.0.1", 0))
    echo_client_fails(client_exe, idle.getsockname()[1], "nothing listening")
    idle.close()
    closing, _ = serve_in_background(lambda c: c.close())
    echo_client_fails(client_exe, closing.getsockname()[1], "a server that accepts and closes")
    closing.close()
    silent, held = serve_in_background(lambda c: None)
    echo_client_fails(client_exe, silent.getsockname()[1], "a server that accepts and never answers")
    silent.close()
    for c in held:
        c.close()


def hostile_hello_then_garbage(port):
    """Completes the tcp provider's hello (the server's own hello is a valid
    one), then sends a frame header that decodes to nothing; waits until the
    server drops the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    s.settimeout(TIMEOUT)
    hello = b""
    while len(hello) < 24:
        chunk = s.recv(24 - len(hello))
        if not chunk:
            fail("the server closed before its hello")
        hello += chunk
    s.sendall(hello + b"\xff" * 48)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        fail("the server did not drop a connection that sent garbage within %d s" % TIMEOUT)
    s.close()


def echo_server_log(server_exe, client_exe):
    print("== shuttle-echo-server --transport tcp-provider: hostile clients are logged, rate-limited")
    srv = Process([server_exe, "--port", "0", "--bind", "127.0.0.1", "--transport", "tcp-provider"],
                  r"listening on port (\d+)")
    port = int(srv.match.group(1))
    hostile = 100
    start = time.time()
    for _ in range(hostile):
        hostile_hello_then_garbage(port)
    elapsed = time.time() - start
    r = subprocess.run([client_exe, "--host", "127.0.0.1", "--port", str(port), "--transport", "tcp-provider",
                        "--duration", "0.5", "--json"], capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        fail("a good client after the hostile ones: status %d\n%s%s" % (r.returncode, r.stdout, r.stderr),
             srv.text())
    srv.stop(signal.SIGTERM, r"served \d+ connections, echoed \d+ bytes")
    log = srv.text()
    shown = re.findall(r"connection from 127\.0\.0\.1:\d+ failed: (.*)", log)
    suppressed = sum(int(n) for n in re.findall(r"(\d+) similar messages suppressed", log))
    if not shown:
        fail("no connection failure logged for %d clients that sent garbage" % hostile, log)
    if sum("protocol" in why for why in shown) < len(shown) - 1:
        fail("the logged failures do not name the protocol error", log)
    # Every failure is shown or counted; the good client's one connection
    # may add one (a reset when it exits).
    if not hostile <= len(shown) + suppressed <= hostile + 1:
        fail("%d lines shown + %d suppressed, for %d failures" % (len(shown), suppressed, hostile), log)
    # The log's windows are seconds of the server's clock: the failures
    # spanned at most ceil(elapsed) + 1 of them (plus the client's run).
    bound = LINES_PER_SECOND * (math.ceil(elapsed) + 2)
    if len(shown) > bound:
        fail("%d lines shown in %.1f s: not rate-limited" % (len(shown), elapsed), log)
    print("   %d failures in %.1f s: %d lines shown, %d counted as suppressed; SIGTERM: exit 0"
          % (hostile, elapsed, len(shown), suppressed))


def main():
    if len(sys.argv) != 5:
        print("usage: tools_test.py ECHO_SERVER ECHO_CLIENT PERF TRANSFER")
        return 2
    server_exe, client_exe, perf_exe, transfer_exe = sys.argv[1:]
    perf(perf_exe)
    transfer(transfer_exe)
    echo_client(client_exe)
    echo_server_log(server_exe, client_exe)
    print("tools-test: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
