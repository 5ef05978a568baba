"""cluster: the hot path on a Redis Cluster against one server, in the same run (issue 17).

On each target — the Redis Cluster (``--redis-url``, default
``AGENT_RUNTIME_BENCH_REDIS_CLUSTER_URL`` or the tests' cluster of scripts/redis_topologies.sh:
3 masters + 3 replicas) and the single server the other benches use
(``AGENT_RUNTIME_BENCH_REDIS_URL``, db 4) — one bench server counting its Redis commands
(``--count-redis``), ``--scopes`` scopes (default 1,000; quick 100), each its own routing rule
``(g-cluster, b-<k>)`` → template ``bench-cl-<k>``, a pod each from the fake Kubernetes, two
live sessions per scope. Then five phases, each a load run (wrk, 50 connections: a discarded
warm-up, each master's idle rate over 0.5 s, the measured run — 2 s, quick 1 s: a few
thousand requests — and the idle rate again) with every master's counters read before and
after the run:

- ``noop``: ``/_bench/noop`` (route's envelope, no Redis): the ratio's denominator;
- ``refresh``: routes of bound sessions; ``placed``: routes of new sessions (every scope);
- ``touch_ids``: touches naming the scope (``bot_id`` + ``extra.group_id``); ``touch``: without.

Per phase: OK answers per second and ÷ the no-op's; the requests the server answered (its own
count, by answer code); those its handlers took (all but ``OVERLOADED``: shed by the in-flight
bound, which a loaded machine's loop lag lowers, before any Redis call); per handled request,
Redis round trips and commands, client side and exact (the server counts what redis-py sends;
a new connection's handshake, a cost per connection, apart); each master's share of the
commands (``INFO commandstats`` deltas, the commands scripts run inside Redis included; INFO
readings, replication's REPLCONF and handshakes left out) and the busiest master ÷ the mean;
Redis CPU per request (``used_cpu_sys`` + ``used_cpu_user`` deltas summed over the masters,
less each master's lower idle rate) in µs. Masters are found with ``CLUSTER NODES`` (those serving
slots); a single server is one master. Replicas' CPU (replication) is not counted. The single
server is shared (other clients' bursts stay in its numbers: its idle rates say how much);
the tests' cluster is the bench's alone while it runs (``common.BenchCluster``).

From those, a model of the installation's ceiling for 1–6 masters: routes/s ≈ masters ×
(1 core ÷ Redis CPU per route) × (mean ÷ busiest share) — the measured CPU per route and
balance, not a measured throughput (the service's replicas are assumed not to be the limit;
Redis spends less CPU per command when it is busier, so a lightly loaded run's model is low).

  .venv/bin/python -m bench.cluster [--quick] [--redis-url URL] [--scopes N] [--json F]

Also ``bench/run.py --only cluster``. Exit status: 0 both targets measured, 1 one failed (its
entry holds the error, the other still ran), 2 refused to run (the single server's db, or a
target's Redis unreachable or held by another run: the other target's numbers are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import (  # noqa: E402
    API,
    BenchRefused,
    Context,
    LoadSpec,
    NodeReading,
    Server,
    bench_context,
    client,
    configure,
    metric_delta,
    place_sessions,
)

NAME = "cluster"
CLUSTER_URL_ENV = "AGENT_RUNTIME_BENCH_REDIS_CLUSTER_URL"
DEFAULT_CLUSTER_URL = "redis+cluster://127.0.0.1:17101,127.0.0.1:17102,127.0.0.1:17103"
GROUP, PREFIX, SESSIONS_PER_SCOPE = "g-cluster", "cl-", 2
# phase → (wrk mode, path)
PHASES = {
    "noop": ("noop", "/_bench/noop"),
    "refresh": ("route_existing", f"{API}/route"),
    "placed": ("route_new", f"{API}/route"),
    "touch_ids": ("touch_ids", f"{API}/touch"),
    "touch": ("touch", f"{API}/touch"),
}
ROUTES = ("refresh", "placed", "touch_ids")  # the model's columns
MASTERS_MODELLED = range(1, 7)
HANDSHAKE = ("HELLO", "AUTH", "CLIENT", "SELECT")  # redis-py's on_connect
IGNORED = {
    "info",
    "replconf",
    "hello",
    "auth",
    "client",
    "select",
}  # readings, replication, handshakes
# of the requests the handlers took (not shed), OK: or the phase measured failures
VALID_SHARE, MIN_HANDLED = 0.99, 100


def cluster_url_default() -> str:
    return os.environ.get(CLUSTER_URL_ENV, DEFAULT_CLUSTER_URL)


def scopes_default(quick: bool) -> int:
    return 100 if quick else 1000


async def run(
    ctx: Context, *, cluster_url: str | None = None, scopes: int | None = None
) -> dict[str, Any]:
    """Both targets: the single server of ``ctx``, then the cluster in a context of its own
    (its claim, its SQLite file). A target that fails is an ``error`` entry; the other still
    runs."""
    url = cluster_url or cluster_url_default()
    n = scopes or scopes_default(ctx.quick)
    out: dict[str, Any] = {"scopes": n, "sessions": n * SESSIONS_PER_SCOPE, "cluster_url": url}
    out["single"] = await guarded(measure_target(ctx, "single", n, configure_scopes=True))
    # the cluster's server reads the same SQL database: the configuration once (config_sync
    # reads every item per call: 1,000 scopes take minutes on a loaded machine)
    configured = "error" not in out["single"]
    out["cluster"] = await guarded(measure_cluster(ctx, url, n, configure_scopes=not configured))
    out["ceiling"] = {
        target: ceiling(out[target])
        for target in ("single", "cluster")
        if "error" not in out[target]
    }
    failed = [t for t in ("single", "cluster") if "error" in out[t]]
    if failed:
        out["error"] = "; ".join(f"{t}: {out[t]['error']}" for t in failed)
    return out


async def guarded(measure: Any) -> dict[str, Any]:
    """A target's result, or why it has none (``refused``: its Redis is unreachable or held by
    another run, as a whole bench's refusal)."""
    try:
        return dict(await measure)
    except BenchRefused as exc:
        return {"error": f"refused: {exc}", "refused": True}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


async def measure_cluster(
    ctx: Context, url: str, scopes: int, *, configure_scopes: bool
) -> dict[str, Any]:
    loadgen = "python" if ctx.loadgen.kind != "wrk" else "auto"
    async with bench_context(
        quick=ctx.quick, redis_url=url, loadgen=loadgen, database_url=ctx.database_url
    ) as cluster_ctx:
        return await measure_target(
            cluster_ctx, "cluster", scopes, configure_scopes=configure_scopes
        )


async def measure_target(
    ctx: Context, label: str, scopes: int, *, configure_scopes: bool
) -> dict[str, Any]:
    masters = sorted(ctx.redis.masters())
    print(f"  {NAME}: {label}: masters {masters}", file=sys.stderr, flush=True)
    server = await Server(ctx, f"cluster-{label}", count_redis=True, hot_path=True).start()
    keeper = asyncio.create_task(keep_claim(ctx), name="bench-cluster-keep-claim")
    try:
        started = time.perf_counter()
        setup = await set_up(server, scopes, configure_scopes=configure_scopes)
        setup["seconds"] = round(time.perf_counter() - started, 1)
        out: dict[str, Any] = {"masters": masters, "setup": setup}
        for phase in PHASES:
            print(f"  {NAME}: {label}: {phase}", file=sys.stderr, flush=True)
            out[phase] = await measure_phase(ctx, server, phase, scopes)
    finally:
        keeper.cancel()
        server.stop()
    noop = out["noop"]["ok_per_s"]
    for phase in PHASES:
        if phase != "noop" and noop:
            out[phase]["ratio_to_noop"] = round(out[phase]["ok_per_s"] / noop, 3)
    return out


async def keep_claim(ctx: Context, every: float = 20.0) -> None:
    """Renew the claim's lease (the tests' cluster: 180 s) while the target is measured."""
    while True:
        await asyncio.sleep(every)
        ctx.redis.keep()


async def set_up(server: Server, scopes: int, *, configure_scopes: bool) -> dict[str, Any]:
    """A template and a rule per scope (config_sync; unless the database has them), then the
    sessions (the first route of each scope deploys its pod on the fake Kubernetes, 4 scopes
    at a time: the in-flight bound's floor on a loaded machine)."""
    async with client(server.url) as http:
        for k in range(scopes if configure_scopes else 0):
            await configure(
                http,
                f"cl-{k}",
                GROUP,
                scope_concurrency=100_000,
                pod_concurrency=100_000,
                bot=f"b-{k}",
            )
        placed = await place_sessions(
            http, GROUP, scopes * SESSIONS_PER_SCOPE, scopes, prefix=PREFIX, first_concurrency=4
        )
    stats = await server.stats()
    return {"placements": dict(placed), "k8s_pods": stats["k8s_pods"]}


async def idle(ctx: Context, seconds: float) -> dict[str, dict[str, float]]:
    """Each master's CPU and commands per second while the bench is idle (other clients,
    replication, the cluster's own cron), just before a phase's run: its CPU is subtracted
    from the run's (other clients' bursts are not: the single server is shared)."""
    masters = ctx.redis.masters()
    r0, t0 = ctx.redis.readings(masters), time.perf_counter()
    await asyncio.sleep(seconds)
    r1, elapsed = ctx.redis.readings(masters), time.perf_counter() - t0
    return {
        name: {
            "cpu_us_per_s": round((r1[name].cpu_s - r0[name].cpu_s) * 1e6 / elapsed, 1),
            "commands_per_s": round(sum(calls(r0[name], r1[name]).values()) / elapsed, 1),
        }
        for name in r0
        if name in r1
    }


def calls(before: NodeReading, after: NodeReading) -> Counter[str]:
    delta = Counter(
        {k: v - before.calls.get(k, 0) for k, v in after.calls.items() if k not in IGNORED}
    )
    return +delta


async def measure_phase(ctx: Context, server: Server, phase: str, scopes: int) -> dict[str, Any]:
    mode, path = PHASES[phase]
    spec = LoadSpec(
        url=server.url + path,
        mode=mode,
        group=GROUP,
        sessions=scopes * SESSIONS_PER_SCOPE,
        scopes=scopes,
        prefix=PREFIX,
        seconds=ctx.warmup_seconds,
    )
    await ctx.loadgen.run(spec, servers=[server])  # warm-up: scripts loaded on every node
    await asyncio.sleep(0.2)  # the requests in flight when the generator stopped end
    before = await idle(ctx, 0.5)
    spec.seconds = 1.0 if ctx.quick else 2.0
    # metrics first (a scrape reads Redis), then the counters; the reverse after the run
    m0 = await server.metrics()
    s0 = await server.stats()
    masters = ctx.redis.masters()
    r0, t0 = ctx.redis.readings(masters), time.perf_counter()
    load = await ctx.loadgen.run(spec, servers=[server])
    await asyncio.sleep(0.2)  # the requests in flight when the generator stopped end
    r1, window = ctx.redis.readings(masters), time.perf_counter() - t0
    s1 = await server.stats()
    m1 = await server.metrics()
    after = await idle(ctx, 0.5)
    # the lower of the two idle rates: another client's burst in one of them is not taken
    # off the run's CPU (what stays of others' bursts makes the CPU per request an upper bound)
    noise = {
        name: min((before[name], after.get(name, before[name])), key=lambda r: r["cpu_us_per_s"])
        for name in before
    }
    out: dict[str, Any] = {
        "load": {
            k: load[k] for k in ("seconds", "requests", "rps", "p50_ms", "p99_ms", "cpu", "loadavg")
        },
        "idle": noise,
    }
    if phase == "noop":  # not an endpoint of the service's metrics: the generator's count
        ok = load["requests"] - load["error_total"]
        out.update(requests=load["requests"], answers={"OK": ok, "not OK": load["error_total"]})
        out["ok_per_s"] = round(ok / load["seconds"], 1) if load["seconds"] else 0.0
        return out
    answers = answer_codes(metric_delta(m0, m1, "agent_runtime_http_requests_total"), path)
    requests = out["requests"] = sum(answers.values())
    ok = answers.get("OK", 0)
    # shed by the in-flight bound (a loaded machine's loop lag lowers it): no Redis call
    handled = out["handled"] = requests - answers.get("OVERLOADED", 0)
    out["answers"] = answers
    out["ok_per_s"] = round(ok / load["seconds"], 1) if load["seconds"] else 0.0
    out["placements"] = {
        key.split('placement="', 1)[1].split('"', 1)[0]: int(v)
        for key, v in metric_delta(m0, m1, "agent_runtime_route_placements_total").items()
        if 'placement="' in key
    }
    out["valid"] = handled >= MIN_HANDLED and ok >= VALID_SHARE * handled
    sent = Counter(s1["redis_commands"])
    sent.subtract(s0["redis_commands"])
    per = max(handled, 1)
    # a connection the pool opened during the run sends its handshake (each command one
    # write): a cost per connection, not per request — counted apart
    handshake = sum(sent[k] for k in HANDSHAKE)
    trips = s1["redis_round_trips"] - s0["redis_round_trips"] - handshake
    # the detached index writer's (after the reply) are off the request's path: apart
    detached = s1["redis_round_trips_detached"] - s0["redis_round_trips_detached"]
    out["client"] = {
        "round_trips_per_request": round((trips - detached) / per, 3),
        "detached_round_trips_per_request": round(detached / per, 3),
        "commands_per_request": round((sum(sent.values()) - handshake) / per, 3),
        "by_command": {k: round(v / per, 3) for k, v in sorted(sent.items()) if v},
        "connections_opened": sent["HELLO"],
    }
    out.update(per_master(r0, r1, window, noise, per))
    # a failover mid-run (the masters found again differ): the shares are not one layout's
    out["topology_changed"] = sorted(set(masters) ^ set(ctx.redis.masters()))
    return out


def answer_codes(delta: dict[str, float], path: str) -> dict[str, int]:
    """Requests by answer code for one endpoint, from ``agent_runtime_http_requests_total``
    deltas."""
    codes: Counter[str] = Counter()
    for series, value in delta.items():
        labels = dict(part.split("=", 1) for part in series.split("{", 1)[1].rstrip("}").split(","))
        endpoint = labels.get("endpoint", "").strip('"')
        if endpoint == path:
            codes[labels.get("code", "?").strip('"')] += int(value)
    return dict(codes)


def per_master(
    r0: dict[str, NodeReading],
    r1: dict[str, NodeReading],
    window: float,
    noise: dict[str, dict[str, float]],
    requests: int,
) -> dict[str, Any]:
    """Each master's commands and CPU over the window, its share, the busiest ÷ the mean,
    and the Redis CPU per request (idle rate subtracted)."""
    names = [n for n in r0 if n in r1]
    rows = []
    for name in names:
        delta = calls(r0[name], r1[name])
        idle_us = noise.get(name, {}).get("cpu_us_per_s", 0.0) * window
        cpu_us = max(0.0, (r1[name].cpu_s - r0[name].cpu_s) * 1e6 - idle_us)
        rows.append(
            {
                "node": name,
                "commands": sum(delta.values()),
                "evalsha": delta.get("evalsha", 0),
                "cpu_us": round(cpu_us),
            }
        )
    commands = sum(r["commands"] for r in rows)
    cpu = sum(r["cpu_us"] for r in rows)
    for r in rows:
        r["share"] = round(r["commands"] / commands, 3) if commands else None
        r["cpu_share"] = round(r["cpu_us"] / cpu, 3) if cpu else None
    return {
        "masters": rows,
        "busiest_over_mean": busiest_over_mean([r["commands"] for r in rows]),
        "busiest_over_mean_cpu": busiest_over_mean([r["cpu_us"] for r in rows]),
        "redis_cpu_us_per_request": round(cpu / requests, 1) if cpu else None,
        "server_commands_per_request": round(commands / requests, 3),
    }


def busiest_over_mean(values: list[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0
    return round(max(values) / mean, 3) if mean else None


def ceiling(target: dict[str, Any]) -> dict[str, Any]:
    """The model per route phase measured validly: routes/s for 1–6 masters ≈ masters ×
    (1 core ÷ CPU per route) × (mean ÷ busiest share), with the CPU per route and the balance
    measured on this target (its own number of masters)."""
    measured = len(target["masters"])
    out: dict[str, Any] = {"masters_measured": measured, "phases": {}}
    for phase in ROUTES:
        p = target.get(phase, {})
        cpu_us, spread = p.get("redis_cpu_us_per_request"), p.get("busiest_over_mean")
        if not p.get("valid") or not cpu_us or not spread:
            continue
        out["phases"][phase] = {
            "cpu_us_per_route": cpu_us,
            "busiest_over_mean": spread,
            "routes_per_s": {m: round(m * 1e6 / cpu_us / spread) for m in MASTERS_MODELLED},
        }
    return out


# --- the tables ------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> list[str]:
    from bench.run import table

    out = [
        f"cluster: {results['scopes']:,} scopes ({results['sessions']:,} sessions), "
        f"single server vs Redis Cluster ({results['cluster_url']})",
    ]
    rows = []
    for target in ("single", "cluster"):
        t = results[target]
        if "error" in t:
            out.append(f"{target}: FAILED: {t['error']}")
            continue
        for phase in PHASES:
            p = t[phase]
            rows.append(
                [
                    target,
                    phase,
                    p["ok_per_s"],
                    p.get("ratio_to_noop", 1.0 if phase == "noop" else None),
                    p["load"]["p50_ms"],
                    p["load"]["p99_ms"],
                    p["load"]["cpu"].get("others_cpu_pct"),
                    p["requests"],
                    ", ".join(f"{k} {v}" for k, v in sorted(p["answers"].items())),
                    (p.get("client") or {}).get("round_trips_per_request"),
                    (p.get("client") or {}).get("commands_per_request"),
                    p.get("server_commands_per_request"),
                    p.get("redis_cpu_us_per_request"),
                    sum(v["commands_per_s"] for v in p["idle"].values()),
                    " / ".join(
                        f"{m['share']:.2f}" for m in p.get("masters", []) if m["share"] is not None
                    ),
                    p.get("busiest_over_mean"),
                ]
            )
    if rows:
        out += table(
            [
                "target",
                "phase",
                "OK/s",
                "÷ no-op",
                "p50 ms",
                "p99 ms",
                "others CPU %",
                "requests",
                "answers",
                "round trips",
                "commands (client)",
                "commands (in Redis)",
                "Redis CPU µs",
                "others' cmds/s",
                "master shares",
                "busiest ÷ mean",
            ],
            rows,
        )
    for target, model in results.get("ceiling", {}).items():
        if not model["phases"]:
            out.append(f"\nceiling model ({target}): no phase answered OK — nothing to model")
            continue
        phases = list(model["phases"])
        out += [
            "",
            f"ceiling model ({target}: CPU per route and balance measured on "
            f"{model['masters_measured']} master(s); a model, not a measured throughput): "
            "routes/s ≈ masters × (1 core ÷ CPU per route) × (mean ÷ busiest share)",
        ]
        out += table(
            ["masters", *phases],
            [
                [m, *(model["phases"][p]["routes_per_s"][m] for p in phases)]
                for m in MASTERS_MODELLED
            ],
        )
    return out


def targets(results: dict[str, Any]) -> list[tuple[str, Any, str, float]]:
    """The issue's bounds on this bench: (name, value, op, bound); a phase that did not
    answer OK has no value."""
    rows: list[tuple[str, Any, str, float]] = []
    single, cluster = results.get("single", {}), results.get("cluster", {})
    for phase in ("refresh", "placed"):
        ratio = (single.get(phase) or {}).get("ratio_to_noop")
        rows.append((f"cluster bench, single server: {phase} ÷ no-op", ratio, ">=", 0.57))
    for phase, op, bound in (
        ("refresh", "==", 1),
        ("placed", "==", 1),
        ("touch_ids", "==", 1),
        ("touch", "<=", 2),
    ):
        p = cluster.get(phase) or {}
        trips = (p.get("client") or {}).get("round_trips_per_request") if p.get("valid") else None
        rows.append((f"cluster: {phase} round trips per request", trips, op, bound))
    for phase in ROUTES:
        p = cluster.get(phase) or {}
        spread = p.get("busiest_over_mean") if p.get("valid") else None
        rows.append((f"cluster: {phase} busiest master ÷ mean", spread, "<=", 1.2))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/cluster.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="100 scopes, 1 s runs")
    parser.add_argument("--redis-url", default=cluster_url_default(), help="the cluster")
    parser.add_argument(
        "--single-redis-url",
        default=os.environ.get("AGENT_RUNTIME_BENCH_REDIS_URL", common.DEFAULT_REDIS_URL),
        help="the single server to compare with (the other benches' db)",
    )
    parser.add_argument("--scopes", type=int, help="default 1000; --quick 100")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    async def go() -> dict[str, Any]:
        async with bench_context(quick=args.quick, redis_url=args.single_redis_url) as ctx:
            results = await run(ctx, cluster_url=args.redis_url, scopes=args.scopes)
            results["loadgen"] = ctx.loadgen.describe()
            return results

    try:
        results = asyncio.run(go())
    except BenchRefused as exc:
        print(f"{NAME}: refused: {exc}", file=sys.stderr)
        return 2
    results["machine"] = common.machine()
    results["git"] = common.git_state()
    print("\n".join(render(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    refused = [t for t in ("single", "cluster") if results[t].get("refused")]
    if refused:  # what was measured is printed; the run is a refusal (exit 2), as a bench's
        print(f"{NAME}: {refused[0]}: {results[refused[0]]['error']}", file=sys.stderr)
        return 2
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
