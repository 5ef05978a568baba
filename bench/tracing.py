"""tracing: the refresh hot path with tracing off and on, in the same run.

Two servers over one Redis and one config DB (the same 1,000 placed sessions): ``off`` (no
``OTEL_*``: the app as shipped, no tracing middleware) and ``on``
(``OTEL_EXPORTER_OTLP_ENDPOINT`` names a receiver in this process that answers every
``POST /v1/traces`` with 200 and drops it: the export's HTTP calls are real, its receiver
costs nothing worth naming). Only one server is loaded at a time, alternating off/on in
each round (the machine's drift lands on both); each load is a warm-up, a loaded run (50
connections) and an unloaded one (1 connection). Prints every round, the medians, and on ÷
off for OK routes/s and the latencies. Numbers only; nothing is asserted.

    .venv/bin/python -m bench.tracing            # 3 rounds of 10 s loaded + 5 s unloaded
    .venv/bin/python -m bench.tracing --quick    # 2 rounds of 3 s + 2 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.common import (
    API,
    DEFAULT_REDIS_URL,
    HOT_PATH_ENV,
    Context,
    LoadSpec,
    Server,
    bench_context,
    client,
    configure,
    place_sessions,
)

NAME = "tracing"
GROUP, SESSIONS, SCOPES = "g-trace", 1000, 10
MAX_BODY = 64 * 1024 * 1024  # the most the receiver reads of one export (a batch is far less)


class DroppingReceiver(ThreadingHTTPServer):
    """OTLP/HTTP's door, and nothing behind it: counts exports and their bytes."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Drop)
        self.exports = 0
        self.bytes = 0
        self.lock = threading.Lock()


class _Drop(BaseHTTPRequestHandler):
    server: DroppingReceiver

    def do_POST(self) -> None:
        length = min(int(self.headers.get("content-length", "0")), MAX_BODY)
        self.rfile.read(length)
        with self.server.lock:
            self.server.exports += 1
            self.server.bytes += length
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _row(result: dict[str, Any], server: str) -> dict[str, float]:
    loaded, unloaded = result["loaded"], result["unloaded"]
    cpu = loaded.get("cpu", {}).get(f"server_{server}_cpu_pct")
    return {
        "ok_rps": loaded["ok_rps"],
        # the server's CPU per OK route: steadier than routes/s when others share the cores
        "server_cpu_us_per_route": (
            round(cpu / 100 * 1e6 / loaded["ok_rps"], 1) if cpu and loaded["ok_rps"] else 0.0
        ),
        "p50_ms": loaded["p50_ms"],
        "p99_ms": loaded["p99_ms"],
        "unloaded_p50_ms": unloaded["p50_ms"],
        "unloaded_p99_ms": unloaded["p99_ms"],
        "errors": loaded["error_total"] + unloaded["error_total"],
    }


async def run(ctx: Context, rounds: int = 3) -> dict[str, Any]:
    receiver = DroppingReceiver()
    serving = threading.Thread(target=receiver.serve_forever, name="otlp-drop", daemon=True)
    serving.start()
    off = Server(ctx, "tracing-off", hot_path=True)
    on = Server(ctx, "tracing-on", hot_path=True)
    on.env = {
        **HOT_PATH_ENV,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
    }
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        if name in os.environ:  # the servers' environment is this one's, theirs on top
            raise RuntimeError(f"{name} is set here: the off server would trace too")
    try:
        await off.start()
        await on.start()
        async with client(off.url) as http:
            await configure(
                http, "trace", GROUP, scope_concurrency=100_000, pod_concurrency=100_000
            )
            await place_sessions(http, GROUP, SESSIONS, SCOPES)
        spec = LoadSpec(
            url="", mode="route_existing", group=GROUP, sessions=SESSIONS, scopes=SCOPES
        )
        measured: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for index in range(rounds):
            order = [("off", off), ("on", on)] if index % 2 == 0 else [("on", on), ("off", off)]
            for name, server in order:
                result = await ctx.throughput(spec, [server], path=f"{API}/route")
                measured[name].append(_row(result, server.name))
                print(f"bench tracing: round {index + 1} {name}: {measured[name][-1]}",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        off.stop()
        on.stop()
        receiver.shutdown()
        receiver.server_close()
    medians = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for name, rows in measured.items()
    }
    ratios = {
        key: round(medians["on"][key] / medians["off"][key], 3)
        for key in medians["off"]
        if key != "errors" and medians["off"][key]
    }
    return {
        "rounds": measured,
        "median": medians,
        "on_over_off": ratios,
        "exports": receiver.exports,
        "export_bytes": receiver.bytes,
    }


def table(result: dict[str, Any]) -> str:
    keys = [
        "ok_rps", "server_cpu_us_per_route", "p50_ms", "p99_ms", "unloaded_p50_ms",
        "unloaded_p99_ms",
    ]  # fmt: skip
    lines = [
        "| tracing | OK routes/s (50 conn) | server CPU µs / route | p50 ms | p99 ms "
        "| unloaded p50 | unloaded p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("off", "on"):
        row = result["median"][name]
        lines.append(f"| {name} (median) | " + " | ".join(f"{row[k]:,.2f}" for k in keys) + " |")
    ratio = result["on_over_off"]
    lines.append("| on ÷ off | " + " | ".join(f"{ratio.get(k, 0):.3f}" for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 s + 2 s")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    redis_url = os.environ.get("AGENT_RUNTIME_BENCH_REDIS_URL", DEFAULT_REDIS_URL)

    async def go() -> dict[str, Any]:
        quick, loadgen = args.quick, args.loadgen
        async with bench_context(quick=quick, redis_url=redis_url, loadgen=loadgen) as ctx:
            result = await run(ctx, rounds)
            result["loadgen"] = ctx.loadgen.kind
            return result

    result = asyncio.run(go())
    print(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
