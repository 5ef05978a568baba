"""The bench server: the service's app over the real Redis, a SQLite file and the in-process
fake Kubernetes, run by uvicorn (uvloop + httptools, one worker) in a process of its own.

Run by ``bench.common.Server`` as ``python -m bench.server --port P --redis-url U ...``. Adds to
the app (never to the shipped one) two routes, first in the route table:

- ``POST /_bench/noop``: the baseline. The same token check and envelope parsing as route
  (``handlers.RouteBody``, the handlers' dependency), then a small envelope; no Redis.
- ``GET /_bench/stats``: what this process counted (Redis commands and round trips when
  ``--count-redis``, slow-callback warnings with ``--asyncio-debug``, fake Kubernetes deploys).

With ``--profile PATH`` also ``POST /_bench/profile/start|stop``: pyinstrument samples the
process between the two calls (the measured window only); stop writes ``PATH.txt`` (the call
tree) and ``PATH.json`` (top frames by self time, self time by package) and answers the latter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

# module level: the routes' annotations are strings (PEP 563), resolved in these globals
from agent_runtime.session_manager.handlers import Deps, RouteBody

COUNTS: Counter[str] = Counter()  # Redis command name -> commands packed (sent)
ROUND_TRIPS = [0]  # writes to a Redis socket: one per command, one per pipeline
# those of them sent after the reply by the detached index writer (jobs.DetachedWrites: its
# task's name starts so), off every request's latency path
DETACHED_ROUND_TRIPS = [0]
DETACHED_TASK = "detached-writes:"
SLOW: list[tuple[float, str, str]] = []  # asyncio slow callbacks: (seconds, what, message)
_TOOK = re.compile(r" took (\d+(?:\.\d+)?) seconds")
_WHAT = re.compile(r"coro=<([\w.<>]+)|<(?:Timer)?Handle ([\w.<>]+)")


def count_redis_commands() -> None:
    """Count every command this process sends to Redis, and every socket write (a round trip:
    one per command, one per pipeline), by wrapping redis-py's async connection."""
    from redis.asyncio.connection import AbstractConnection

    pack = AbstractConnection.pack_command
    send = AbstractConnection.send_packed_command

    def counted_pack(self: Any, *args: Any) -> Any:
        name = args[0]
        if isinstance(name, bytes):
            name = name.decode()
        COUNTS[str(name).split(" ", 1)[0].upper()] += 1
        return pack(self, *args)

    async def counted_send(self: Any, command: Any, check_health: bool = True) -> None:
        ROUND_TRIPS[0] += 1
        task = asyncio.current_task()
        if task is not None and task.get_name().startswith(DETACHED_TASK):
            DETACHED_ROUND_TRIPS[0] += 1
        await send(self, command, check_health)

    AbstractConnection.pack_command = counted_pack  # type: ignore[method-assign]
    AbstractConnection.send_packed_command = counted_send  # type: ignore[method-assign]


class _SlowCallbacks(logging.Handler):
    """Collects asyncio's "Executing <callback> took N seconds" warnings."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        took = _TOOK.search(message)
        if message.startswith("Executing") and took:
            what = _WHAT.search(message)
            name = (what.group(1) or what.group(2)) if what else "?"
            SLOW.append((float(took.group(1)), name, message[:300]))


class _LoopLag:
    """A timer every ``TICK`` seconds; how late each one fired (ms), kept until taken."""

    TICK = 0.005
    KEEP = 100_000

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.TICK
            await asyncio.sleep(self.TICK)
            if len(self.lags) < self.KEEP:
                self.lags.append((loop.time() - due) * 1000)

    def take(self) -> dict[str, float]:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._sample())
        lags, self.lags = sorted(self.lags), []
        if not lags:
            return {"samples": 0}
        at = lambda q: round(lags[min(len(lags) - 1, int(q * len(lags)))], 2)  # noqa: E731
        return {"samples": len(lags), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}


AUDIT: list[dict[str, Any]] = []  # --callback-audit: slow callbacks with CPU and switches
GC_TOTAL = [0.0]  # seconds spent in the garbage collector (audit mode)
GC_STATS: dict[str, dict[str, float]] = {}  # generation -> count, total_ms, max_ms


def audit_callbacks(threshold: float) -> None:
    """On the stdlib loop (``Handle._run`` is Python there; uvloop's is C): time every callback
    and, for one slower than ``threshold``, record its thread CPU time and context switches.
    Kinds: ``gc`` (the garbage collector ran for most of it), ``waited`` (voluntary switches:
    the thread slept — a blocking syscall, or waiting for the GIL held by another thread of the
    process, e.g. the thread pool), ``cpu`` (it computed that long), ``preempted`` (little
    CPU, involuntary switches only: the OS gave the core to another process)."""
    import gc
    import resource
    import threading

    run = asyncio.events.Handle._run
    who = resource.RUSAGE_THREAD
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
            return
        took = time.perf_counter() - gc_started[0]
        GC_TOTAL[0] += took
        entry = GC_STATS.setdefault(str(info.get("generation")), {"count": 0, "max_ms": 0.0})
        entry["count"] += 1
        entry["total_ms"] = round(entry.get("total_ms", 0.0) + took * 1000, 1)
        entry["max_ms"] = max(entry["max_ms"], round(took * 1000, 1))

    gc.callbacks.append(on_gc)

    def timed_run(self: asyncio.events.Handle) -> None:
        t0, c0, r0 = time.perf_counter(), time.thread_time(), resource.getrusage(who)
        g0 = GC_TOTAL[0]
        run(self)
        wall = time.perf_counter() - t0
        if wall >= threshold:
            r1 = resource.getrusage(who)
            cpu = time.thread_time() - c0
            voluntary, involuntary = r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw
            gc_ms = (GC_TOTAL[0] - g0) * 1000
            if gc_ms >= wall * 500:
                kind = "gc"
            elif voluntary:
                kind = "waited"
            elif cpu >= wall / 2:
                kind = "cpu"
            else:
                kind = "preempted"
            what = _WHAT.search(repr(self))
            AUDIT.append(
                {
                    "wall_ms": round(wall * 1000, 1),
                    "cpu_ms": round(cpu * 1000, 1),
                    "gc_ms": round(gc_ms, 1),
                    "voluntary": voluntary,
                    "involuntary": involuntary,
                    "threads": threading.active_count(),
                    "kind": kind,
                    "what": (what.group(1) or what.group(2)) if what else repr(self)[:120],
                }
            )

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]


def seed_fake_k8s(k8s: Any, redis_url: str) -> int:
    """Make the fake Kubernetes know the pods Redis has (written by the scale bench), so the
    watch and reconcile jobs see them alive."""
    import redis as sync_redis

    from agent_runtime.resource_manager.state import pod_info_key, pods_index_key
    from agent_runtime.scope_buckets import BUCKETS, bucket_tag

    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        scopes: dict[str, str] = {}
        for bucket in range(BUCKETS):
            scopes.update(client.hgetall(pods_index_key(bucket_tag(bucket))))
        pods = sorted(scopes)
        pipe = client.pipeline(transaction=False)
        for pod_id in pods:
            pipe.hgetall(pod_info_key(scopes[pod_id], pod_id))
        for pod_id, info in zip(pods, pipe.execute(), strict=True):
            if info.get("scope_id"):
                k8s.add_pod(
                    scope_id=info["scope_id"],
                    deploy_ver=info.get("deploy_ver", ""),
                    pod_id=pod_id,
                    namespace=info.get("namespace") or None,
                )
        return len(pods)
    finally:
        client.close()


def build_app(args: argparse.Namespace) -> tuple[FastAPI, Any]:
    """The app and its settings."""
    from agent_runtime.api.answers import ok
    from agent_runtime.config import Mode, Settings
    from agent_runtime.db.engine import Database
    from agent_runtime.main import create_app
    from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
    from agent_runtime.wiring import Backends, build_redis

    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        mode=Mode.LOCAL,
        local_seed=False,
        instance_id=args.instance_id,
        jobs_enabled=args.jobs,
        redis_url=args.redis_url,
        database_url=args.database_url,
        host="127.0.0.1",
        port=args.port,
        log_level="WARNING",
        log_format="text",
        watch_interval=args.watch_interval,
        pod_watch_stream=not args.no_pod_watch_stream,
    )
    k8s: Any = FakeK8sPodClient(ready_delay=args.ready_delay)
    if args.kubeconfig:  # a (simulated) cluster instead of the in-process fake
        from agent_runtime.resource_manager.k8s_real import RealK8sPodClient

        k8s = RealK8sPodClient(kubeconfig=args.kubeconfig)
    elif args.seed_k8s:
        seed_fake_k8s(k8s, args.redis_url)
    db = Database.from_url(
        settings.sqlalchemy_url(),
        pool_size=settings.db_pool_size,
        connect_timeout=settings.db_connect_timeout,
    )
    backends = Backends(redis=build_redis(settings), db=db, k8s=k8s)
    app = create_app(settings, backends=backends, owns_backends=True)
    from agent_runtime.cli import tune_gc

    tune_gc()  # as `agent-runtime serve` does

    router = APIRouter()

    @router.post("/_bench/noop")
    async def noop(envelope: RouteBody, deps: Deps) -> JSONResponse:
        """The baseline: route's envelope path, no Redis; an answer of route's size."""
        return ok(
            envelope.metadata.request_id,
            {
                "pod_id": "agent-noop000000-00000",
                "pod_sse_url": "http://127.0.0.1:8080/sse",
                "placement": "noop",
            },
        )

    lag = _LoopLag()

    @router.post("/_bench/loop_lag")
    async def loop_lag() -> JSONResponse:
        """Lateness of a 5 ms timer since the last call (first call: starts sampling): how
        long a socket's data can wait for the loop, which no request timer sees."""
        return JSONResponse(lag.take())

    @router.get("/_bench/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(
            {
                "pid": os.getpid(),
                "redis_commands": dict(COUNTS),
                "redis_round_trips": ROUND_TRIPS[0],
                "redis_round_trips_detached": DETACHED_ROUND_TRIPS[0],
                "slow_callbacks": len(SLOW),
                "slow_callback_log": [[round(t, 4), what] for t, what, _ in SLOW[-2000:]],
                "slow_callback_samples": [m for _, _, m in sorted(SLOW, reverse=True)[:10]],
                "callback_audit": AUDIT[-2000:],
                "gc": GC_STATS,
                "k8s_deploy_calls": getattr(k8s, "deploy_calls", None),
                "k8s_pods": len(getattr(k8s, "pods", ())),
            }
        )

    if args.profile:
        profile_state: dict[str, Any] = {}

        @router.post("/_bench/profile/{action}")
        async def profile(action: str) -> JSONResponse:
            """start / stop pyinstrument around the window the client measures; stop writes
            ``PATH.txt`` and ``PATH.json`` and answers the summary."""
            from pyinstrument import Profiler

            if action == "start":
                profiler = Profiler(interval=0.0005, async_mode="disabled")
                profile_state.update(profiler=profiler, started=time.perf_counter())
                profiler.start()
                return JSONResponse({"started": True})
            profiler = profile_state.pop("profiler")
            profiler.stop()
            out = Path(args.profile)
            out.with_suffix(".txt").write_text(
                profiler.output_text(unicode=True, color=False, show_all=False)
            )
            out.with_name(out.name + "-full.txt").write_text(
                profiler.output_text(unicode=True, color=False, show_all=True)
            )
            summary = profile_summary(profiler.last_session, top=60)
            summary["wall_seconds"] = round(time.perf_counter() - profile_state["started"], 3)
            out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
            return JSONResponse(summary)

    app.include_router(router)
    # first in the route table: matching costs the baseline no more than route's own match
    ours = [r for r in app.router.routes if getattr(r, "path", "").startswith("/_bench/")]
    app.router.routes[:] = ours + [r for r in app.router.routes if r not in ours]
    return app, settings


class _Server(uvicorn.Server):
    """Returns from ``serve`` on SIGINT/SIGTERM instead of dying of the re-raised signal: the
    process exits 0 once the lifespan has shut down."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", [])
        while sig in captured:
            captured.remove(sig)


def _package(path: str) -> str:
    """A frame's file as a package name: agent_runtime.session_manager, fastapi, redis, ..."""
    norm = path.replace("\\", "/")
    for marker in ("/site-packages/", "/src/"):
        if marker in norm:
            rest = norm.split(marker, 1)[1].split("/")
            if rest[0] == "agent_runtime" and len(rest) > 2:
                return f"agent_runtime.{rest[1]}"
            return rest[0].removesuffix(".py")
    if "/lib/python3" in norm:
        rest = norm.split("/lib/python3", 1)[1].split("/")
        return f"stdlib.{rest[1].removesuffix('.py')}" if len(rest) > 1 else "stdlib"
    return norm.rsplit("/", 1)[-1] or "?"


def profile_summary(session: Any, top: int = 30) -> dict[str, Any]:
    """Top functions by self time and by inclusive time (recursion counted once), and self
    time by package, from a pyinstrument session. pyinstrument keeps a function's own time in
    synthetic ``[self]``/``[await]`` children: that time is the function's."""
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_package: Counter[str] = Counter()
    root = session.root_frame()
    total = root.time if root is not None else 0.0

    def label(frame: Any, parent: str) -> str:
        path = frame.file_path_short or frame.file_path or "?"
        if path == "<built-in>":
            return f"{frame.function} (built-in, from {parent.split(' (', 1)[0]})"
        return f"{frame.function} ({path}:{frame.line_no})"

    def walk(frame: Any, parent: str, package: str, on_path: frozenset[str]) -> None:
        key = label(frame, parent)
        path = frame.file_path or ""
        package = package if path == "<built-in>" else _package(path)
        real = [c for c in frame.children if not c.is_synthetic]
        own = max(0.0, frame.time - sum(c.time for c in real))
        self_time[key] += own
        by_package[package] += own
        if key not in on_path:
            inclusive[key] += frame.time
        for child in real:
            walk(child, key, package, on_path | {key})

    if root is not None:
        walk(root, "", "?", frozenset())

    def rows(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"frame": k, "seconds": round(v, 4), "share": round(v / total, 4) if total else 0.0}
            for k, v in counter.most_common(top)
        ]

    return {
        "total_seconds": round(total, 3),
        "top_self": rows(self_time),
        "top_inclusive": rows(inclusive),
        "self_by_package": rows(by_package),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--ready-delay", type=float, default=0.0)
    parser.add_argument("--jobs", action="store_true", help="run the background jobs")
    parser.add_argument("--seed-k8s", action="store_true", help="fake K8s knows Redis' pods")
    parser.add_argument("--count-redis", action="store_true")
    parser.add_argument("--asyncio-debug", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--profile", default=None, metavar="PATH")
    parser.add_argument(
        "--callback-audit",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="stdlib asyncio loop; classify callbacks slower than this (see audit_callbacks)",
    )
    parser.add_argument("--instance-id", default=f"bench-{os.getpid()}")
    parser.add_argument("--kubeconfig", default=None, help="a cluster (kubesim), not the fake")
    parser.add_argument("--watch-interval", type=float, default=10.0, help="the rm_watch pass")
    parser.add_argument("--no-pod-watch-stream", action="store_true", help="the pass alone")
    args = parser.parse_args()

    from agent_runtime import logs

    logs.configure("WARNING", "text")
    if args.asyncio_debug:
        asyncio_logger = logging.getLogger("asyncio")
        asyncio_logger.addHandler(_SlowCallbacks())
        asyncio_logger.setLevel(logging.WARNING)
    if args.count_redis:
        count_redis_commands()
    if args.callback_audit:
        audit_callbacks(args.callback_audit)
    app, settings = build_app(args)
    http = os.environ.get("AGENT_RUNTIME_BENCH_HTTP", "edge")  # bench.common.HTTP_ENV
    if http == "edge":  # as `agent-runtime serve` runs it
        from agent_runtime.http_server import fit_descriptors, uvicorn_options

        protocol = uvicorn_options(settings, fit_descriptors(settings)[0], app.state.edge_shed)
    else:
        protocol = {"http": http}
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="asyncio" if args.callback_audit else "uvloop",
        **protocol,
        workers=1,
        access_log=False,
        log_level="warning",
        log_config=None,
        lifespan="on",
    )
    server = _Server(config)

    async def serve() -> None:
        if args.asyncio_debug:
            loop = asyncio.get_running_loop()
            loop.set_debug(True)
            loop.slow_callback_duration = args.asyncio_debug
        await server.serve()

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve())


if __name__ == "__main__":
    main()
