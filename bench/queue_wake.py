"""queue_wake: a saturated scope (scope_concurrency 1) with one route waiting in its queue;
the holder ends its session (touch eos) and the waiter must be answered within
milliseconds (the scope's ``free`` signal, not the 0.5 s poll). Per repetition: time from
sending the eos touch to the waiter's answer; the waiter then holds the slot for the next.
The waiter is known to wait once its seat is in ``scope:{sid}:waiters`` (read from Redis)
plus a 20 ms settle, so the wake goes through the signal path."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import Any

from redis.asyncio import Redis

from agent_runtime.session_manager.state import scope_waiters_key
from agent_runtime.util import scope_id_of
from bench.common import API, Context, RawConnection, client, configure, pct, rid, route_body

NAME = "queue_wake"
GROUP, BOT = "g-wake", "b-0"
SETTLE = 0.02


async def run(ctx: Context) -> dict[str, Any]:
    reps = 20 if ctx.quick else 100
    server = await ctx.main_server()
    waiters = scope_waiters_key(scope_id_of(GROUP, BOT))
    wake_ms: list[float] = []
    eos_ms: list[float] = []
    after_eos_ms: list[float] = []
    answers: Counter[str] = Counter()
    redis = Redis.from_url(ctx.redis.url, decode_responses=True)
    # raw keep-alive connections, requests prepared before the clock starts: the client's
    # own time stays in the tens of microseconds
    waiting_conn = await RawConnection(server.url).open()
    control = await RawConnection(server.url).open()
    try:
        async with client(server.url) as http:
            await configure(http, "wake", GROUP, scope_concurrency=1, pod_concurrency=1)
        holder = f"q-{time.time_ns()}-0"
        first = await control.post(f"{API}/route", route_body(rid(), holder, GROUP, BOT))
        answers[(first.get("data") or {}).get("placement", "?")] += 1
        plain_ms = []  # a keep-alive touch on the same connection: the round trip to compare
        for _ in range(20):
            request = control.prepare(f"{API}/touch", touch_body(holder, eos=False))
            t0 = time.perf_counter()
            await control.send(request)
            plain_ms.append((time.perf_counter() - t0) * 1000)
        for i in range(1, reps + 1):
            waiter = f"q-{time.time_ns()}-{i}"
            body = route_body(rid(), waiter, GROUP, BOT)
            waiting = asyncio.create_task(waiting_conn.post(f"{API}/route", body))
            await until_seated(redis, waiters, waiting)
            await asyncio.sleep(SETTLE)
            request = control.prepare(f"{API}/touch", touch_body(holder, eos=True))
            t0 = time.perf_counter()
            ended = await control.send(request)
            t1 = time.perf_counter()
            answer = await waiting
            t2 = time.perf_counter()
            if not (ended.get("data") or {}).get("released"):
                answers["eos_not_released"] += 1
            answers[(answer.get("data") or {}).get("placement") or answer.get("error_code")] += 1
            wake_ms.append((t2 - t0) * 1000)
            eos_ms.append((t1 - t0) * 1000)
            after_eos_ms.append((t2 - t1) * 1000)
            holder = waiter
        await control.post(f"{API}/touch", touch_body(holder, eos=True))
    finally:
        await waiting_conn.close()
        await control.close()
        await redis.aclose()
    return {
        "repetitions": reps,
        "answers": dict(answers),
        "wake_ms": summary(wake_ms),
        "eos_touch_ms": summary(eos_ms),
        "after_eos_answer_ms": summary(after_eos_ms),
        "plain_touch_ms": summary(plain_ms),
    }


async def until_seated(redis: Redis, key: str, waiting: asyncio.Task[Any]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not waiting.done():
        if await redis.zcard(key) >= 1:
            return
        await asyncio.sleep(0.002)
    raise RuntimeError(f"the waiting route never took a queue seat ({key})")


def touch_body(session: str, *, eos: bool) -> dict[str, Any]:
    return {"metadata": {"request_id": rid(), "session_id": session}, "rawdata": {"eos": eos}}


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(values, 0.5), 2),
        "p99": round(pct(values, 0.99), 2),
        "max": round(max(values), 2),
        "mean": round(statistics.fmean(values), 2),
    }
