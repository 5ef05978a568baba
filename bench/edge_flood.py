#!/usr/bin/env python3
"""Floods for the HTTP edge (docs/performance.md "HTTP edge"), and the bench that runs them.

    .venv/bin/python bench/edge_flood.py                  # the bench: a local serve, ~40 s
    .venv/bin/python bench/edge_flood.py sockets --port P --idle 3000 --seconds 8
    .venv/bin/python bench/edge_flood.py headers --port P --connections 4 --mib 100

``sockets`` keeps ``--idle`` sockets that send nothing, ``--header-drip`` ones that send a
header line every ``--drip`` seconds and ``--body-drip`` ones that send a body byte every
``--drip`` seconds open against the port, opening a new one for each the server closes (a
sustained flood), and prints one JSON line: how long the server let each kind live. It prints
``ready`` once the first sockets are all open. ``headers`` streams ``--mib`` MiB header values on
``--connections`` connections and prints how far each got and how it ended.

The bench (no sub-command) starts ``agent-runtime serve --mode local`` with its default bounds,
runs both floods and measures a normal client's /healthz and route latency (one keep-alive
connection, one request at a time) during each, and the server's RSS (VmRSS). Numbers only.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROUTE_BODY = (
    b'{"metadata":{"request_id":"%s","session_id":"s-edge","bot_id":"b-edge",'
    b'"extra":{"group_id":"g-edge"}},"rawdata":{}}'
)


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": round(percentile(values, 0.5), 3),
        "p99": round(percentile(values, 0.99), 3),
        "max": round(max(values), 3) if values else float("nan"),
    }


# --- the socket flood -------------------------------------------------------------------------


def socket_flood(args: argparse.Namespace) -> dict[str, Any]:
    raise_fd_limit()
    addr = ("127.0.0.1", args.port)
    sel = selectors.DefaultSelector()
    opened_at: dict[socket.socket, tuple[str, float]] = {}
    lifetimes: dict[str, list[float]] = {"idle": [], "header_drip": [], "body_drip": []}
    answered: dict[str, int] = {}
    connect_errors = [0]
    target = {"idle": args.idle, "header_drip": args.header_drip, "body_drip": args.body_drip}
    live = dict.fromkeys(target, 0)

    def open_one(kind: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        try:
            sock.connect(addr)
            if kind == "header_drip":
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: flood\r\n")
            elif kind == "body_drip":
                sock.sendall(
                    b"POST /api/session/route HTTP/1.1\r\nHost: flood\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{"
                )
        except OSError:
            connect_errors[0] += 1
            sock.close()
            return
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        opened_at[sock] = (kind, time.monotonic())
        live[kind] += 1

    def closed(sock: socket.socket, now: float) -> None:
        kind, since = opened_at.pop(sock)
        lifetimes[kind].append(now - since)
        live[kind] -= 1
        sel.unregister(sock)
        sock.close()

    for kind, count in target.items():
        for _ in range(count):
            open_one(kind)
    print("ready", flush=True)
    start = time.monotonic()
    end = start + args.seconds
    next_drip = start + args.drip
    while (now := time.monotonic()) < end:
        for key, _ in sel.select(timeout=0.02):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "?"
                answered[status] = answered.get(status, 0) + 1
                continue
            closed(sock, time.monotonic())
        if now >= next_drip:
            next_drip = now + args.drip
            for sock, (kind, _) in list(opened_at.items()):
                if kind == "idle":
                    continue
                piece = b"X-Drip: a\r\n" if kind == "header_drip" else b" "
                try:
                    sock.send(piece)
                except OSError:
                    closed(sock, time.monotonic())
        if args.keep_up:
            for kind, count in target.items():
                for _ in range(min(200, count - live[kind])):  # a slice a turn: keep reading
                    open_one(kind)
    now = time.monotonic()
    still = {k: [now - t for s, (kk, t) in opened_at.items() if kk == k] for k in target}
    for sock in list(opened_at):
        sock.close()
    return {
        "seconds": round(now - start, 2),
        "target": target,
        "closed_by_server": {k: len(v) for k, v in lifetimes.items()},
        "lifetime_s": {k: summary(v) for k, v in lifetimes.items()},
        "still_open": {k: len(v) for k, v in still.items()},
        "oldest_open_s": {k: round(max(v), 3) if v else 0.0 for k, v in still.items()},
        "answers": answered,
        "connect_errors": connect_errors[0],
    }


# --- the header flood -------------------------------------------------------------------------


def header_flood(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in range(args.connections)]
    total = args.mib * (1 << 20)
    chunk = b"a" * 65536

    def stream(i: int) -> None:
        sent, started = 0, time.monotonic()
        ended = "completed"
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=10.0)
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: flood\r\nX-Big: ")
            while sent < total:
                sent += sock.send(chunk)
        except OSError as exc:
            ended = type(exc).__name__
        status = None
        with contextlib.suppress(OSError):
            sock.settimeout(2.0)
            data = sock.recv(4096)
            if data.startswith(b"HTTP/"):
                status = int(data.split(b" ", 2)[1])
        sock.close()
        results[i] = {
            "sent_bytes": sent,
            "ended": ended,
            "status": status,
            "seconds": round(time.monotonic() - started, 3),
        }

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"per_connection": results, "value_bytes": total}


# --- the bench ---------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def client_latencies(port: int, until: threading.Event, kinds: tuple[str, ...]) -> dict[str, Any]:
    """One keep-alive connection, one request at a time, until ``until`` is set: ms per kind."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    failures: list[str] = []
    n = 0
    while not until.is_set():
        for kind in kinds:
            n += 1
            t0 = time.perf_counter()
            try:
                if kind == "healthz":
                    conn.request("GET", "/healthz")
                else:
                    body = ROUTE_BODY % f"r-{os.getpid()}-{n}".encode()
                    headers = {"Content-Type": "application/json"}
                    conn.request("POST", "/api/session/route", body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    failures.append(f"{kind} {resp.status}")
            except (OSError, http.client.HTTPException) as exc:
                failures.append(f"{kind} {type(exc).__name__}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                continue
            times[kind].append((time.perf_counter() - t0) * 1000)
        time.sleep(0.002)
    conn.close()
    return {"ms": {k: summary(v) for k, v in times.items()}, "failures": failures}


def run_flood(cmd: list[str], port: int, pid: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Run a flood sub-command; the client's latencies and the server's peak RSS meanwhile."""
    flood = subprocess.Popen(
        [sys.executable, __file__, *cmd, "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    assert flood.stdout is not None
    if cmd[0] == "sockets":
        assert flood.stdout.readline().strip() == "ready"
    stop = threading.Event()
    peak = [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    box: dict[str, Any] = {}
    client = threading.Thread(
        target=lambda: box.update(client_latencies(port, stop, ("healthz", "route")))
    )
    client.start()
    out, _ = flood.communicate(timeout=300)
    stop.set()
    client.join()
    sampler.join()
    return json.loads(out.strip().splitlines()[-1]), box, peak[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bench(args: argparse.Namespace) -> dict[str, Any]:
    raise_fd_limit()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="edge-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RUNTIME_")}
    env["AGENT_RUNTIME_LOG_LEVEL"] = "WARNING"
    cli = [sys.executable, "-m", "agent_runtime.cli", "serve", "--mode", "local"]
    with (workdir / "server.log").open("wb") as log:
        server = subprocess.Popen(
            [*cli, "--port", str(port)], cwd=workdir, env=env, stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"server not healthy; log in {workdir}")
            time.sleep(0.1)
        quiet_stop = threading.Event()
        timer = threading.Timer(args.quiet_seconds, quiet_stop.set)
        timer.start()
        quiet = client_latencies(port, quiet_stop, ("healthz", "route"))
        rss_start = rss_kib(server.pid)
        sockets = ["sockets", "--idle", str(args.idle), "--header-drip", "50"]
        sockets += ["--body-drip", "50", "--seconds", str(args.seconds), "--keep-up"]
        flood, during, rss_sockets = run_flood(sockets, port, server.pid)
        headers = ["headers", "--connections", "4", "--mib", str(args.mib)]
        hflood, during_headers, rss_headers = run_flood(headers, port, server.pid)
        return {
            "server": "agent-runtime serve --mode local, default bounds",
            "client_quiet": quiet,
            "socket_flood": flood,
            "client_during_socket_flood": during,
            "header_flood": hflood,
            "client_during_header_flood": during_headers,
            "rss_kib": {
                "start": rss_start,
                "peak_socket_flood": rss_sockets,
                "peak_header_flood": rss_headers,
                "end": rss_kib(server.pid),
            },
        }
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("sockets")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--idle", type=int, default=3000)
    s.add_argument("--header-drip", type=int, default=50)
    s.add_argument("--body-drip", type=int, default=50)
    s.add_argument("--drip", type=float, default=0.5, help="seconds between two drips")
    s.add_argument("--seconds", type=float, default=10.0)
    s.add_argument("--keep-up", action="store_true", help="reopen what the server closes")
    h = sub.add_parser("headers")
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--connections", type=int, default=4)
    h.add_argument("--mib", type=int, default=100)
    parser.add_argument("--idle", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--quiet-seconds", type=float, default=5.0)
    parser.add_argument("--mib", type=int, default=100)
    args = parser.parse_args()
    if args.command == "sockets":
        out = socket_flood(args)
    elif args.command == "headers":
        out = header_flood(args)
    else:
        out = bench(args)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
