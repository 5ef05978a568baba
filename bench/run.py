#!/usr/bin/env python3
"""Run the benches of agent-runtime and print their numbers (JSON + a table). Benchmarks
measure; they never assert timings. See docs/performance.md.

    .venv/bin/python bench/run.py                       # all but cluster (about 5 minutes)
    .venv/bin/python bench/run.py --quick               # shorter runs, smaller scale
    .venv/bin/python bench/run.py --only refresh touch  # some (baseline comes along)
    .venv/bin/python bench/run.py --only cluster        # opt-in: Redis Cluster vs one server
    .venv/bin/python bench/run.py --only tracing        # opt-in: refresh, tracing off vs on
    .venv/bin/python bench/run.py --only refresh --profile   # + pyinstrument top frames
    .venv/bin/python bench/run.py --json /tmp/out.json

Needs the local Redis (db 4, or AGENT_RUNTIME_BENCH_REDIS_URL) and, for sound numbers, wrk
(``apt-get install -y wrk``; without it a Python generator is used and the output says so).
Results: bench/results/latest.json and latest.txt (the tables, Markdown).
Exit status: 0 every bench ran, 1 one failed (its entry holds the error), 2 refused to run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

ORDER = [
    "baseline",
    "refresh",
    "placed",
    "touch",
    "redis_cost",
    "cluster",
    "cold_burst",
    "warm_claims",
    "queue_wake",
    "scale",
    "scale_out",
    "loop_check",
    "overload",
    "drains",
    "pod_events",
    "tracing",
]
# only when named (--only): the Redis Cluster of scripts/redis_topologies.sh, and minutes of
# setup at 1,000 scopes; tracing's alternating rounds (about 3.5 minutes)
OPT_IN = {"cluster", "tracing"}
NEEDS_BASELINE = {"refresh", "placed", "touch"}
THROUGHPUT = ["baseline", "refresh", "placed", "touch", "baseline_after"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 s runs, 10k-session scale")
    parser.add_argument("--only", nargs="+", choices=ORDER, metavar="NAME", help=" ".join(ORDER))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=common.RESULTS,
        help="where latest.json and latest.txt go (default bench/results)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="refresh, and scale's job ticks, under pyinstrument"
    )
    parser.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument(
        "--http",
        choices=["edge", "httptools", "h11"],
        default="edge",
        help="the servers' HTTP protocol: edge (the service's, as serve runs it), httptools "
        "(uvicorn's, without the edge's bounds), h11",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("AGENT_RUNTIME_BENCH_REDIS_URL", common.DEFAULT_REDIS_URL),
    )
    return parser.parse_args(argv)


def selected(args: argparse.Namespace) -> list[str]:
    names = set(args.only or [n for n in ORDER if n not in OPT_IN])
    if names & NEEDS_BASELINE:
        names.add("baseline")
    return [n for n in ORDER if n in names]


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    names = selected(args)
    meta: dict[str, Any] = {
        "machine": common.machine(),
        "versions": common.versions(),
        "git": common.git_state(),
        "quick": args.quick,
        "selected": names,
        "redis_url": args.redis_url,
        "http": args.http,
    }
    os.environ[common.HTTP_ENV] = args.http  # the bench servers read it (bench/server.py)
    results: dict[str, Any] = {}
    async with common.bench_context(
        quick=args.quick, redis_url=args.redis_url, loadgen=args.loadgen, profile=args.profile
    ) as ctx:
        if args.loadgen == "wrk" and ctx.loadgen.kind != "wrk":
            raise common.BenchRefused("--loadgen wrk: wrk is not installed (apt-get install wrk)")
        meta["loadgen"] = ctx.loadgen.describe()
        meta["durations_s"] = {
            "loaded": ctx.loaded_seconds,
            "unloaded": ctx.unloaded_seconds,
            "warmup": ctx.warmup_seconds,
            "connections": common.CONNECTIONS,
        }
        meta["redis_version"] = ctx.redis.info("server").get("redis_version")
        ctx.results = results
        last_throughput = max((names.index(n) for n in names if n in NEEDS_BASELINE), default=-1)
        for i, name in enumerate(names):
            results[name] = await run_one(ctx, name)
            if i == last_throughput and not args.quick:  # drift check: the no-op again
                results["baseline_after"] = await run_one(ctx, "baseline")
    meta["machine"]["loadavg_end"] = common.loadavg()
    files = results.pop("_files", {})
    report = {"meta": meta, "results": results, "files": files}
    derive(report)
    return report


async def run_one(ctx: common.Context, name: str) -> dict[str, Any]:
    print(f"bench: {name} ... (load {common.loadavg()})", file=sys.stderr, flush=True)
    module = importlib.import_module(f"bench.{name}")
    started, load = time.perf_counter(), common.loadavg()
    try:
        result = dict(await module.run(ctx))
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result["loadavg_start"], result["loadavg_end"] = load, common.loadavg()
    return result


# --- derived numbers and the targets of the issue --------------------------------------------


def baseline_rps(results: dict[str, Any]) -> float | None:
    values = [
        results[n]["loaded"]["rps"]
        for n in ("baseline", "baseline_after")
        if n in results and "loaded" in results[n]
    ]
    return sum(values) / len(values) if values else None


def derive(report: dict[str, Any]) -> None:
    results = report["results"]
    base = baseline_rps(results)
    report["baseline_rps"] = round(base, 1) if base else None
    for name in ("refresh", "placed", "touch"):
        if base and "loaded" in results.get(name, {}):
            # OK answers only: a shed request is no route served
            ok = results[name]["loaded"].get("ok_rps", results[name]["loaded"]["rps"])
            results[name]["ratio_to_baseline"] = round(ok / base, 3)
    report["targets"] = targets(results)


def _get(data: Any, *path: Any) -> Any:
    for key in path:
        in_list = isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data)
        if (isinstance(data, dict) and key in data) or in_list:
            data = data[key]
        else:
            return None
    return data


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(name: str, value: Any, op: str, bound: float, unit: str = "") -> None:
        met = None
        if isinstance(value, int | float):
            met = value >= bound if op == ">=" else value <= bound if op == "<=" else value == bound
        rows.append({"target": name, "value": value, "bound": f"{op} {bound:g}{unit}", "met": met})

    for name, ratio in (("refresh", 0.45), ("placed", 0.45), ("touch", 0.5)):
        if name not in results:
            continue
        add(f"{name} req/s ÷ no-op", _get(results, name, "ratio_to_baseline"), ">=", ratio)
        if name != "touch":
            add(f"{name} unloaded p50", _get(results, name, "unloaded", "p50_ms"), "<=", 1.0, " ms")
            add(f"{name} unloaded p99", _get(results, name, "unloaded", "p99_ms"), "<=", 3.0, " ms")
    if "redis_cost" in results:
        for phase, op, bound in (
            ("refresh", "==", 1),
            ("placed", "==", 1),
            ("touch", "==", 1),
            ("touch_no_ids", "<=", 2),
        ):
            trips = _get(results, "redis_cost", phase, "client", "round_trips_per_request")
            add(f"{phase}: Redis round trips per request", trips, op, bound)
    if "cluster" in results:
        from bench import cluster

        for name, value, op, bound in cluster.targets(results["cluster"]):
            add(name, value, op, bound)
    if "scale_out" in results:
        add("2 replicas ÷ 1 (refresh)", _get(results, "scale_out", "refresh", "ratio"), ">=", 1.6)
    if "cold_burst" in results:
        deploys = _get(results, "cold_burst", "deploys_per_burst") or []
        add("cold burst: deploys per burst (max)", max(deploys, default=None), "==", 1)
        worst = _get(results, "cold_burst", "tail_minus_deploy_ms_worst")
        add("cold burst: tail − D (worst)", worst, "<=", 100, " ms")
    if "warm_claims" in results:
        # the competitor's published figures (issue 16): warm p50 92 / p99 376 ms at 45/s
        warm = {s["rate_per_s"]: s for s in _get(results, "warm_claims", "warm") or []}
        add("warm claims at 45/s: p50", (warm.get(45) or {}).get("p50_ms"), "<=", 92, " ms")
        add("warm claims at 45/s: p99", (warm.get(45) or {}).get("p99_ms"), "<=", 376, " ms")
        burst = _get(results, "warm_claims", "burst") or {}
        refused = (burst.get("time_to_place") or {}).get("answers", {}).get("NO_POD_AVAILABLE", 0)
        add("burst over the pool: NO_POD_AVAILABLE", refused if burst else None, "==", 0)
    if "queue_wake" in results:
        add("queue wake p99", _get(results, "queue_wake", "wake_ms", "p99"), "<=", 20, " ms")
    if "scale" in results:
        add("scale: sm_sweep tick", _get(results, "scale", "ticks", "sm_sweep", "median_ms"),
            "<=", 100, " ms")  # fmt: skip
        # the jobs run in the serving process: no tick may hold the loop longer than the
        # slow-callback threshold of loop_check (the resource manager's ticks have no bound
        # of their own: their durations are in the scale table)
        for tick in ("sm_sweep", "rm_autoscale", "rm_reclaim", "rm_watch", "rm_reconcile"):
            value = _get(results, "scale", "ticks", tick, "loop_stall_max_ms")
            add(f"scale: {tick}, longest loop stall", value, "<=", 10, " ms")
        add(
            "scale: sm_sweep with 1 % due",
            _get(results, "scale", "expiry_tick", "ms"),
            "<=",
            100,
            " ms",
        )
        memory = _get(results, "scale", "memory", "used_memory_delta_bytes_per_session")
        add("scale: Redis bytes per live session", memory, "<=", 1024)
        p99 = _get(results, "scale", "refresh_jobs_off", "unloaded", "p99_ms")
        add("scale: refresh unloaded p99 (jobs off)", p99, "<=", 3.0, " ms")
        p99 = _get(results, "scale", "refresh_jobs_on", "unloaded", "p99_ms")
        add("scale: refresh unloaded p99 (jobs on)", p99, "<=", 3.0, " ms")
    if "loop_check" in results:
        slow = _get(results, "loop_check", "slow_callbacks_refresh_run")
        add("slow callbacks > 10 ms, refresh run (debug)", slow, "==", 0)
        kinds = _get(results, "loop_check", "audit", "refresh_run", "by_kind") or {}
        own = sum(v for k, v in kinds.items() if k != "preempted") if kinds else None
        add("callbacks > 10 ms not preempted, refresh (audit)", own, "==", 0)
    return rows


# --- the human tables ------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return [line, rule] + [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]


def render(report: dict[str, Any]) -> str:
    meta, results = report["meta"], report["results"]
    m = meta["machine"]
    out = [
        f"agent-runtime benches — {m['date']} — git {meta['git'].get('commit')}"
        f"{' (dirty tree)' if meta['git'].get('dirty') else ''}"
        f"{' — QUICK' if meta['quick'] else ''}",
        f"machine: {m['nproc']} CPUs, {m['cpu_model']}; load average {m['loadavg_start']} at "
        f"start, {m.get('loadavg_end')} at end",
        f"load generator: {meta.get('loadgen')}; {meta.get('durations_s')}",
        f"server HTTP protocol: {meta.get('http', 'edge')}",
        "",
    ]
    rows = []
    for name in THROUGHPUT:
        r = results.get(name)
        if not r or "loaded" not in r:
            if r and "error" in r:
                rows.append([name, r["error"], *[None] * 11])
            continue
        lo, un = r["loaded"], r["unloaded"]
        cpu = lo.get("cpu", {})
        server_cpu = next((v for k, v in cpu.items() if k.startswith("server_")), None)
        rows.append(
            [
                name,
                lo["rps"],
                r.get("ratio_to_baseline", 1.0 if name.startswith("baseline") else None),
                lo["p50_ms"],
                lo["p99_ms"],
                un["p50_ms"],
                un["p99_ms"],
                lo["error_total"] + un["error_total"],
                server_cpu,
                cpu.get("redis_cpu_pct"),
                cpu.get("loadgen_cpu_pct"),
                cpu.get("others_cpu_pct"),
                lo["loadavg"][0],
            ]
        )
    if rows:
        out += table(
            [
                "scenario",
                "req/s (50 conn)",
                "× no-op",
                "p50 ms",
                "p99 ms",
                "unloaded p50",
                "unloaded p99",
                "errors",
                "server CPU %",
                "redis CPU %",
                "loadgen CPU %",
                "others CPU %",
                "load1",
            ],
            rows,
        )
        out.append("")
    out += table(
        ["target (issue)", "measured", "bound", "met"],
        [
            [t["target"], t["value"], t["bound"], {True: "yes", False: "NO", None: "?"}[t["met"]]]
            for t in report["targets"]
        ],
    )
    out += details(results)
    return "\n".join(out) + "\n"


def details(results: dict[str, Any]) -> list[str]:
    out: list[str] = []
    cost = results.get("redis_cost")
    if cost and "error" not in cost:
        out += [
            "",
            f"Redis cost per request ({cost['requests_per_phase']} requests a phase; "
            f"idle noise {cost['idle_noise']['commands_per_s']} commands/s from other clients):",
        ]
        rows = []
        for phase in ("noop", "refresh", "placed", "touch", "touch_no_ids"):
            p = cost.get(phase)
            if p is None:
                continue
            rows.append(
                [
                    phase,
                    p["client"]["commands_per_request"],
                    p["client"]["round_trips_per_request"],
                    p["client"]["detached_round_trips_per_request"],
                    p["client"]["evalsha_per_request"],
                    p["server"]["commands_per_request"],
                    ", ".join(f"{k} {v:g}" for k, v in p["server"]["by_command"].items()),
                    ", ".join(f"{k} {v}" for k, v in p["answers"].items()),
                ]
            )
        out += table(
            [
                "phase",
                "cmds sent",
                "round trips (request path)",
                "after the reply",
                "EVALSHA",
                "cmds run (server)",
                "server commandstats per request",
                "answers",
            ],
            rows,
        )
    clustered = results.get("cluster")
    if clustered and "scopes" in clustered:
        from bench import cluster

        out += ["", *cluster.render(clustered)]
    cold = results.get("cold_burst")
    if cold and "error" not in cold:
        out += ["", f"cold burst of {cold['burst']}, deploy {cold['deploy_seconds']} s:"]
        out += table(
            ["burst", "deploys", "min ms", "median ms", "max ms", "tail − D", "spread", "answers"],
            [
                [i, b["deploys"], b["min_ms"], b["median_ms"], b["max_ms"],
                 b["tail_minus_deploy_ms"], b["spread_ms"], b["answers"]]
                for i, b in enumerate(cold["bursts"])
            ],
        )  # fmt: skip
    warm = results.get("warm_claims")
    if warm and "error" not in warm:
        out += ["", "warm claims (pod_concurrency 1, deploy 2 s), per rate of new sessions:"]
        out += table(
            ["rate/s", "claims", "p50 ms", "p90 ms", "p99 ms", "max ms", "answers"],
            [[s["rate_per_s"], s["claims"], s["p50_ms"], s["p90_ms"], s["p99_ms"], s["max_ms"],
              s["answers"]] for s in warm["warm"]],
        )  # fmt: skip
        b = warm["burst"]
        t = b["time_to_place"]
        out += [
            f"sustained: {warm['warm_sustained_per_s']}/s; burst of {b['sessions']} at "
            f"{b['rate_per_s']}/s over a pool of {b['pool']}: place p50 {t['p50_ms']} / p99 "
            f"{t['p99_ms']} ms, {b['deploys']} deploys, refill {b['refill_pods_per_s']} pods/s, "
            f"{b['cold_deploys_peak']} cold deploys at once, answers {t['answers']}"
        ]
    wake = results.get("queue_wake")
    if wake and "error" not in wake:
        out += [
            "",
            f"queue wake ({wake['repetitions']} reps): eos sent → waiter answered "
            f"{wake['wake_ms']} ms; the eos touch alone {wake['eos_touch_ms']} ms; "
            f"answers {wake['answers']}",
        ]
    scale = results.get("scale")
    if scale and "error" not in scale:
        out += [
            "",
            f"scale: {scale['sessions']:,} sessions, {scale['pods']:,} pods, "
            f"{scale['scopes']:,} scopes (setup {scale['setup']['sessions_per_second']:,} "
            "sessions/s through pipelined route_place)",
        ]
        rows = [
            [n, t["median_ms"], t["max_ms"], t.get("loop_stall_max_ms", "-"),
             t["redis_round_trips"], json.dumps(t["result"])]
            for n, t in scale["ticks"].items()
        ]  # fmt: skip
        e = scale["expiry_tick"]
        rows.append(
            [f"sm_sweep, {e['expiring']} due", e["ms"], e["ms"], e.get("loop_stall_max_ms", "-"),
             e["redis_round_trips"], json.dumps(e["result"])]
        )  # fmt: skip
        headers = ["tick", "median ms", "max ms", "loop stall max ms", "Redis round trips"]
        out += table([*headers, "result"], rows)
        for name, tick in scale["ticks"].items():
            if tick.get("loop_stalled_in"):
                out.append(
                    f"{name}: loop held over 5 ms in (stack samples) {tick['loop_stalled_in']}"
                )
            prof = tick.get("profile")
            if prof and "top_self" in prof:
                out.append(f"{name} profile ({prof['total_seconds']} s), top self time:")
                out += [f"  {r['share'] * 100:5.1f} %  {r['frame']}" for r in prof["top_self"][:8]]
        mem = scale["memory"]
        out.append(
            "memory per live session: used_memory delta "
            f"{mem['used_memory_delta_bytes_per_session']} B "
            f"({mem['with_replay_keys_bytes_per_session']} B while the setup's replay keys lived); "
            f"MEMORY USAGE {mem['memory_usage_bytes_per_session']}"
        )
        for key in ("refresh_jobs_off", "refresh_jobs_on"):
            r = scale.get(key)
            if r:
                out.append(
                    f"refresh at size, jobs {'on ' if r['jobs'] else 'off'}: "
                    f"{r['loaded']['rps']} req/s, "
                    f"p99 {r['loaded']['p99_ms']} ms (50 conn); unloaded p50 "
                    f"{r['unloaded']['p50_ms']} / p99 {r['unloaded']['p99_ms']} ms; "
                    f"errors {r['loaded']['error_total'] + r['unloaded']['error_total']}"
                )
    sout = results.get("scale_out")
    if sout and "error" not in sout:
        out.append("")
        for name in ("refresh", "noop"):
            s = sout[name]
            out.append(
                f"scale-out {name}: one replica {s['one_replica']['rps']} req/s, two replicas "
                f"{s['two_replicas']['rps']} req/s → × {s['ratio']}"
            )
    drains = results.get("drains")
    if drains and "error" not in drains:
        costs = drains["script_us"]
        out += [
            "",
            f"drains: drain_begin p50 {costs['drain_begin_p50']} / p99 "
            f"{costs['drain_begin_p99']} µs, retire_pod p50 {costs['retire_pod_p50']} / p99 "
            f"{costs['retire_pod_p99']} µs; a node drain of {drains['pods']} pods × "
            f"{drains['sessions_per_pod']} sessions {drains['node_drain_ms']} ms; their deadline "
            f"tick {drains['tick_ms']} ms ({drains['tick_ms_per_pod']} ms a pod, longest loop "
            f"hold {drains['tick_longest_loop_hold_ms']} ms), {drains['sessions_moved']} "
            f"sessions moved, {drains['pods_deleted']} pods deleted",
        ]
    events = results.get("pod_events")
    if events and "error" not in events:
        from bench.pod_events import summary as pod_events_summary

        out += ["", pod_events_summary(events)]
    traced = results.get("tracing")
    if traced and "error" not in traced:
        from bench.tracing import table as tracing_table

        out += ["", tracing_table(traced)]
    loop = results.get("loop_check")
    if loop and "error" not in loop:
        out += [
            "",
            f"asyncio debug (slow callback > {loop['slow_callback_duration_s']} s): "
            f"{loop['slow_callbacks_setup']} during setup, {loop['slow_callbacks_refresh_run']} "
            f"during the refresh run ({loop['refresh_under_debug']}, load "
            f"{loop['loadavg_during_run']})",
        ]
        for phase in ("setup_by_callback", "refresh_run_by_callback"):
            for what, entry in list(loop[phase].items())[:6]:
                out.append(f"  {phase.split('_by_')[0]}: {what}: {entry}")
        audit = loop.get("audit") or {}
        for phase in ("setup", "refresh_run"):
            if phase in audit:
                a = audit[phase]
                out.append(
                    f"callback audit (stdlib loop), {phase}: {a['slow_callbacks']} over 10 ms, "
                    f"{a['by_kind']}"
                )
                out += [f"    {r}" for r in a["not_preempted"][:5]]
        if "gc_total_after_run" in audit:
            out.append(
                f"  garbage collections (audit server, whole life): {audit['gc_total_after_run']}"
            )
    prof = _get(results, "refresh", "profile")
    if prof and "top_self" in prof:
        out += [
            "",
            f"refresh profile (pyinstrument, {prof['total_seconds']} s sampled; "
            f"under profiler {prof['load_under_profiler']}):",
            "top frames by self time:",
        ]
        out += [f"  {r['share'] * 100:5.1f} %  {r['frame']}" for r in prof["top_self"][:20]]
        out.append("self time by package:")
        out += [f"  {r['share'] * 100:5.1f} %  {r['frame']}" for r in prof["self_by_package"][:15]]
    elif prof:
        out += ["", f"refresh profile: {prof}"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(run_all(args))
    except common.BenchRefused as exc:
        print(f"bench: refused: {exc}", file=sys.stderr)
        return 2
    text = render(report)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(report, indent=2, default=str)
    (args.out_dir / "latest.json").write_text(payload)
    (args.out_dir / "latest.txt").write_text(text)
    if args.json:
        args.json.write_text(payload)
    failed = [n for n, r in report["results"].items() if isinstance(r, dict) and "error" in r]
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
