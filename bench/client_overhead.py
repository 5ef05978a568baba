#!/usr/bin/env python3
"""What the gateway's client (``client/``) costs per call on top of plain httpx, in process.

Both sides answer from an ``httpx.MockTransport`` (no network, no service), so what is left
is the client's own work: building the envelope, the bounded streamed read, the envelope's
parsing, the typed result, the retry bookkeeping. ``raw``: ``httpx.AsyncClient.post(json=…)``
and ``.json()`` of the answer, as scripts/load_test.py did before it used the client.
``client``: ``AsyncGatewayClient.route`` / ``GatewayClient.route``. Prints µs per call (the
best of --repeat runs of --calls sequential calls: the machine's noise only ever adds).

    .venv/bin/python bench/client_overhead.py --calls 20000 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import httpx

from agent_runtime_client import AsyncGatewayClient, GatewayClient, RetryPolicy

ANSWER = json.dumps(
    {
        "ok": True,
        "request_id": "r",
        "data": {
            "pod_id": "agent-x1y2z3a4b5-c6d7e",
            "pod_sse_url": "http://10.1.2.3:8080/sse",
            "placement": "refresh",
        },
    }
).encode()
URL = "http://bench.invalid"


def answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=ANSWER, headers={"content-type": "application/json"})


async def raw_async(calls: int) -> float:
    async with httpx.AsyncClient(base_url=URL, transport=httpx.MockTransport(answer)) as http:
        started = time.perf_counter()
        for i in range(calls):
            metadata = {"request_id": uuid.uuid4().hex, "session_id": f"s-{i}", "bot_id": "b",
                        "extra": {"group_id": "g"}}  # fmt: skip
            body = {"metadata": metadata, "rawdata": {}}
            resp = await http.post("/api/session/route", json=body)
            data = resp.json()["data"]
            assert data["placement"] == "refresh"
        return time.perf_counter() - started


async def client_async(calls: int) -> float:
    client = AsyncGatewayClient(
        URL, transport=httpx.MockTransport(answer), retry=RetryPolicy(max_attempts=1)
    )
    async with client:
        started = time.perf_counter()
        for i in range(calls):
            route = await client.route(f"s-{i}", "b", "g")
            assert route.placement == "refresh"
        return time.perf_counter() - started


def client_sync(calls: int) -> float:
    client = GatewayClient(
        URL, transport=httpx.MockTransport(answer), retry=RetryPolicy(max_attempts=1)
    )
    with client:
        started = time.perf_counter()
        for i in range(calls):
            route = client.route(f"s-{i}", "b", "g")
            assert route.placement == "refresh"
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        for name, seconds in (
            ("raw httpx (async)", asyncio.run(raw_async(args.calls))),
            ("AsyncGatewayClient.route", asyncio.run(client_async(args.calls))),
            ("GatewayClient.route", client_sync(args.calls)),
        ):
            best[name] = min(best.get(name, float("inf")), seconds)
    base = best["raw httpx (async)"]
    print(f"client overhead: best of {args.repeat} × {args.calls} sequential calls, MockTransport")
    for name, seconds in best.items():
        per_call = seconds / args.calls * 1e6
        print(f"  {name:<26} {per_call:8.1f} µs/call  ({seconds / base:4.2f}× raw)")


if __name__ == "__main__":
    main()
