"""warm_claims: new sessions claiming warm pods, and a burst larger than the warm pool, through
the service (one replica, jobs on: autoscale refills the pools) over the fake Kubernetes with
a deploy time D (``ready_delay``, 2 s). Every scope has pod_concurrency 1: each new session
takes a pod of its own.

- ``warm``: per rate (45, 90, 135, 180, 270 new sessions/s) a scope whose warm pool holds the
  whole step (2 s of claims), the pools filled first: per-route latency p50/p90/p99 and the
  answers; ``warm_sustained_per_s``: the highest rate whose claims were all placed with a p99
  under 1 s.
- ``burst``: a pool of 20 (``min_idle_pods``), 180 new sessions open-loop at 45/s (the pool
  drains in half a second): time to place p50/p99/max, answers (placed vs NO_POD_AVAILABLE…),
  deploys made, the peak of cold deploys at once, and the refill rate (pods registered per
  second while deploys ran).

The scope's deploy concurrency is the setting's default unless ``--deploy-concurrency`` (run
directly: ``python -m bench.warm_claims``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
from redis.asyncio import Redis

from agent_runtime.util import scope_id_of
from bench.common import API, BenchRefused, Context, Server, client, pct, rid, route_body

NAME = "warm_claims"
READY_DELAY = 2.0
RM = "resource_manager:resource:scope:"
RATES = (45, 90, 135, 180, 270)  # new sessions per second, each step a scope of its own
STEP_SECONDS = 2.0


async def configure_pool(
    http: httpx.AsyncClient, name: str, group: str, *, scope_concurrency: int, min_idle: int
) -> None:
    """Template ``wc-<name>`` (pod_concurrency 1) and the rule ``(group, *)`` → it."""
    template = {
        "template_id": f"wc-{name}",
        "image": "bench:1",
        "scope_concurrency": scope_concurrency,
        "pod_concurrency": 1,
        "session_ttl": 3600,
        "min_idle_pods": min_idle,
        "ready_timeout": 60,
    }
    rule = {"group_id": group, "bot_id": "*", "template_id": f"wc-{name}"}
    for kind, item in (("template", template), ("routing_rule", rule)):
        body = {
            "metadata": {"request_id": rid()},
            "rawdata": {"kind": kind, "op": "sync", "item": item},
        }
        answer = await http.post(f"{API}/config_sync", json=body)
        if answer.status_code != 200:
            raise BenchRefused(f"config_sync {kind} refused: {answer.text[:300]}")


async def route(http: httpx.AsyncClient, group: str, bot: str, session: str) -> tuple[float, str]:
    started = time.perf_counter()
    answer = (await http.post(f"{API}/route", json=route_body(rid(), session, group, bot))).json()
    took = (time.perf_counter() - started) * 1000
    return took, (answer.get("data") or {}).get("placement") or answer.get("error_code", "?")


async def warm_pool(
    redis: Redis, http: httpx.AsyncClient, group: str, bot: str, n: int, *, primed: bool = False
) -> float:
    """The scope exists after its first route; then autoscale fills its floor. Seconds it
    took to have ``n`` warm pods."""
    if not primed:
        await route(http, group, bot, f"prime-{group}")
    started = time.monotonic()
    sid = scope_id_of(group, bot)
    while await redis.scard(f"{RM}{{{sid}}}:idle") < n:
        if time.monotonic() - started > 120:
            raise BenchRefused(f"{group}: the warm pool did not reach {n} within 120 s")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def open_loop(
    http: httpx.AsyncClient, group: str, bot: str, rate: float, count: int
) -> list[tuple[float, str]]:
    """``count`` new sessions sent at ``rate`` per second whatever the answers' pace."""
    started = time.perf_counter()
    tasks = []
    for i in range(count):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(route(http, group, bot, f"{group}-{i}")))
    return list(await asyncio.gather(*tasks))


def latency(results: list[tuple[float, str]]) -> dict[str, Any]:
    ms = sorted(took for took, _ in results)
    return {
        "p50_ms": round(pct(ms, 0.5), 1),
        "p90_ms": round(pct(ms, 0.9), 1),
        "p99_ms": round(pct(ms, 0.99), 1),
        "max_ms": round(ms[-1], 1),
        "answers": dict(Counter(answer for _, answer in results)),
    }


async def warm_rates(
    redis: Redis, http: httpx.AsyncClient, rates: tuple[int, ...], seconds: float
) -> list[dict[str, Any]]:
    """Per rate a scope of its own whose warm pool holds every claim of the step (all filled
    at once first), then the steps one after another: ``rate × seconds`` new sessions
    open-loop at ``rate`` per second."""
    steps = []
    for rate in rates:
        group, count = f"g-wc{rate}", int(rate * seconds)
        await configure_pool(http, f"r{rate}", group, scope_concurrency=4 * count, min_idle=count)
        await route(http, group, "b", f"prime-{group}")
        steps.append((rate, group, count))
    started = time.monotonic()
    for _, group, count in steps:
        await warm_pool(redis, http, group, "b", count, primed=True)
    fill = time.monotonic() - started
    for rate, group, count in steps:  # filled: no refill from here on (it would load the
        # replica while the next steps run: each claim would start a warm deploy)
        await configure_pool(http, f"r{rate}", group, scope_concurrency=4 * count, min_idle=0)
    report = []
    for rate, group, count in steps:
        results = await open_loop(http, group, "b", float(rate), count)
        report.append({"rate_per_s": rate, "claims": count, **latency(results)})
    report[0]["fill_all_s"] = round(fill, 1)
    return report


def sustained(steps: list[dict[str, Any]], p99_ms: float = 1000.0) -> int | None:
    """The highest rate whose every claim was placed, p99 under ``p99_ms``."""
    clean = [
        s["rate_per_s"]
        for s in steps
        if s["answers"] == {"placed": s["claims"]} and s["p99_ms"] < p99_ms
    ]
    return max(clean, default=None)


async def burst(redis: Redis, http: httpx.AsyncClient, server: Server) -> dict[str, Any]:
    group, bot, pool, rate, count = "g-wcburst", "b", 20, 45.0, 180
    sid = scope_id_of(group, bot)
    await configure_pool(http, "burst", group, scope_concurrency=400, min_idle=pool)
    await warm_pool(redis, http, group, bot, pool)
    before = await server.stats()
    pods_before = await redis.zcard(f"{RM}{{{sid}}}:pods")
    samples: list[tuple[float, int, int, int]] = []  # t, pods, cold deploys, placeholders
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            async with redis.pipeline(transaction=False) as pipe:
                pipe.zcard(f"{RM}{{{sid}}}:pods")
                pipe.zcard(f"{RM}{{{sid}}}:cold_deploys")
                pipe.scard(f"{RM}{{{sid}}}:deploying")
                pods, cold, deploying = await pipe.execute()
            samples.append((time.monotonic(), int(pods), int(cold), int(deploying)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        results = await open_loop(http, group, bot, rate, count)
        placed_at = time.monotonic()
        # the refill: until the floor is warm again (or 30 s); polled, as the sampler
        while time.monotonic() - placed_at < 30:
            if await redis.scard(f"{RM}{{{sid}}}:idle") >= pool:
                break
            await asyncio.sleep(0.1)
        refilled_at = time.monotonic()
    finally:
        stop.set()
        await sampler
    after = await server.stats()
    registered = [(t, pods) for t, pods, _, _ in samples]
    grown = registered[-1][1] - pods_before
    # the refill rate: pods registered per second between the first and the last new pod
    first = next((t for t, p in registered if p > pods_before), started)
    last = next((t for t, p in registered if p == registered[-1][1]), refilled_at)
    return {
        "pool": pool,
        "rate_per_s": rate,
        "sessions": count,
        "deploy_s": READY_DELAY,
        "time_to_place": latency(results),
        "waited_over_1s": sum(took > 1000 for took, _ in results),
        "deploys": after["k8s_deploy_calls"] - before["k8s_deploy_calls"],
        "pods_registered": grown,
        "refill_pods_per_s": round(grown / max(last - first, 0.1), 1),
        "cold_deploys_peak": max(c for _, _, c, _ in samples),
        "placeholders_peak": max(d for _, _, _, d in samples),
        "refilled_s": round(refilled_at - started, 1),
    }


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def run(ctx: Context, deploy_concurrency: int | None = None) -> dict[str, Any]:
    # the budgets out of the way: a `*` rule's default pod budget (100) would cap the pools
    settings = {"AGENT_RUNTIME_POD_BUDGET": "5000", "AGENT_RUNTIME_WILDCARD_RULE_POD_BUDGET": "0"}
    if deploy_concurrency is not None:
        settings["AGENT_RUNTIME_SCOPE_DEPLOY_CONCURRENCY"] = str(deploy_concurrency)
    with env(**settings):
        server = await Server(ctx, "warm", ready_delay=READY_DELAY, jobs=True).start()
    redis = Redis.from_url(ctx.redis.url, decode_responses=True)
    try:
        async with client(server.url, connections=256) as http:
            burst_report = await burst(redis, http, server)  # first: nothing else refills
            steps = await warm_rates(redis, http, RATES, STEP_SECONDS)
            return {
                "deploy_concurrency": deploy_concurrency or "default",
                "warm": steps,
                "warm_sustained_per_s": sustained(steps),
                "burst": burst_report,
            }
    finally:
        await redis.aclose()
        server.stop()


def main() -> None:
    import json

    from bench.common import DEFAULT_REDIS_URL, bench_context

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deploy-concurrency", type=int, default=None)
    parser.add_argument(
        "--redis-url", default=os.environ.get("AGENT_RUNTIME_BENCH_REDIS_URL", DEFAULT_REDIS_URL)
    )
    args = parser.parse_args()

    async def go() -> dict[str, Any]:
        async with bench_context(quick=False, redis_url=args.redis_url) as ctx:
            return await run(ctx, args.deploy_concurrency)

    print(json.dumps(asyncio.run(go()), indent=2))


if __name__ == "__main__":
    main()
