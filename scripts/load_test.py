#!/usr/bin/env python3
"""Load generator for agent-runtime: the gateway's calls (route, touch) at a chosen concurrency,
with latency percentiles, an error-code histogram and, for long runs, interval reports.

Run it with the project's venv (it needs httpx, the standard library and the gateway's client,
``agent-runtime-client``: ``pip install -e ./client``, which scripts/test.sh does). The route and
touch calls go through that client, as a gateway makes them, with its retries off: each
measured request is one attempt, its answer classified as it came.

    # placement of new sessions: a fresh session_id per request; --configure gives the scope
    # room (the local default template allows 10 live sessions per scope)
    .venv/bin/python scripts/load_test.py --scenario route --count 2000 --concurrency 20 \\
        --configure --scope-concurrency 5000 --pod-concurrency 500

    # sticky hits: 10 sessions routed again and again for 30 s (placement "refresh")
    .venv/bin/python scripts/load_test.py --scenario refresh --sessions 10 --duration 30

    # route a new session, touch it twice, end it (eos); per-step numbers in the summary
    .venv/bin/python scripts/load_test.py --scenario route_touch --touches 2 --count 1000 \\
        --json /tmp/rt.json --csv /tmp/rt.csv

    # saturate one scope: 2 slots, a queue of 4, 12 workers holding a slot 0.5 s each
    .venv/bin/python scripts/load_test.py --scenario queued --group-id grp-q --bot-id bot-q \\
        --configure --scope-concurrency 2 --pod-concurrency 2 --hold 0.5 \\
        --concurrency 12 --duration 20

    # an hour-long soak with a report every minute, bounded memory
    .venv/bin/python scripts/load_test.py --scenario route_touch --duration 3600 --soak \\
        --report-every 60 --concurrency 50 --token "$GATEWAY_TOKEN"

Scenarios (one "iteration" is what --count counts):
  route        route a new session (fresh session_id); the sessions are ended (eos) after the
               run unless --no-cleanup, so the scope's slots are free for the next run.
  refresh      pre-create --sessions N sessions, then route them round-robin (sticky hits);
               they are ended after the run.
  route_touch  route a new session, --touches K keep-alive touches, a touch with eos.
  queued       route a new session (it may wait in the scope's queue), hold it --hold S
               seconds, end it (eos, which wakes a waiter); reports the queue outcomes.
               A refused worker (SCOPE_QUEUE_FULL) tries again at once: load, not a gateway.

Bounds: --count N iterations and/or --duration S seconds, whichever comes first (one is
required). At the bound no new iteration starts; iterations in flight finish (each request
is bounded by --timeout). Ctrl-C stops the same way; a second Ctrl-C abandons what is in
flight. The summary covers what was done either way.

Measured: each request's latency with time.perf_counter around the POST (response body
read). Percentiles are exact (nearest rank over every sample, 8 bytes a sample) except with
--soak, where the cumulative ones come from a log-bucket histogram (128 linear sub-buckets
per power of two of microseconds: at most 0.8 % above the true value, memory bounded; max
is exact) and each interval report is exact over its interval. --plot keeps every
(time, latency) pair in memory (16 bytes a request) and needs matplotlib (not a project
dependency). Codes: "OK", the envelope's error_code, HTTP_<status> for an answer that is
not an envelope, CONNECT_ERROR / TIMEOUT / TRANSPORT_ERROR when no answer came.

Output: the summary on stdout (and --json FILE), soak interval reports on stdout, a live
progress line on stderr (when stderr is a terminal, or with --progress), notes on stderr.
Exit status: 0 the run completed (errors are data), 1 setup failed (--configure refused,
refresh could not create a session), 2 bad arguments or the service is not reachable and
healthy at start, 130 interrupted.

Proxies from the environment are ignored (trust_env=False): the numbers are the service's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import importlib.util
import json
import math
import os
import signal
import sys
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx

from agent_runtime_client import (
    AgentRuntimeError,
    AsyncGatewayClient,
    RetryPolicy,
    Route,
    Unavailable,
    UnexpectedAnswer,
)

API = "/api/session"
EXIT_OK, EXIT_SETUP, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_DURATION = 7 * 24 * 3600.0
MAX_COUNT = 100_000_000
MAX_CONCURRENCY = 5_000
MAX_CLEANUP_IDS = 1_000_000  # route scenario: sessions remembered for the end-of-run eos
SCENARIOS = ("route", "refresh", "route_touch", "queued")
QUEUE_CODES = ("OK", "SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT")
PROG = "load_test"


# --- latency recorders ----------------------------------------------------------------------------


def _nearest_rank(n: int, q: float) -> int:
    """1-based rank of the q-quantile among n sorted samples (nearest-rank definition)."""
    return max(1, math.ceil(q * n))


class ExactLatencies:
    """Every sample kept (array of doubles): exact percentiles."""

    def __init__(self) -> None:
        self._ms = array("d")

    def add(self, ms: float) -> None:
        self._ms.append(ms)

    def __len__(self) -> int:
        return len(self._ms)

    def summary(self) -> dict[str, float] | None:
        n = len(self._ms)
        if n == 0:
            return None
        ordered = sorted(self._ms)
        pick = {f"p{round(q * 100)}": ordered[_nearest_rank(n, q) - 1] for q in (0.5, 0.9, 0.99)}
        return _rounded(
            {**pick, "min": ordered[0], "max": ordered[-1], "mean": math.fsum(ordered) / n}
        )


class LogHistogram:
    """Bounded memory for soak runs: microseconds in buckets of 2**7 linear steps per power
    of two (1 µs buckets below 256 µs). A percentile is its bucket's upper end: at most 1/128
    above the true sample, and never above the exact max."""

    SUB_BITS = 7

    def __init__(self) -> None:
        self._buckets: Counter[int] = Counter()
        self._n = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = 0.0

    def add(self, ms: float) -> None:
        self._buckets[self._index(max(0, int(ms * 1000)))] += 1
        self._n += 1
        self._sum += ms
        self._min = min(self._min, ms)
        self._max = max(self._max, ms)

    def __len__(self) -> int:
        return self._n

    @classmethod
    def _index(cls, us: int) -> int:
        shift = max(0, us.bit_length() - cls.SUB_BITS - 1)
        return (shift << cls.SUB_BITS) + (us >> shift)

    @classmethod
    def _upper_ms(cls, index: int) -> float:
        if index < 2 << cls.SUB_BITS:
            return (index + 1) / 1000  # exact µs (shift 0); +1: the bucket is [us, us + 1)
        shift, top = (index >> cls.SUB_BITS) - 1, (index & ((1 << cls.SUB_BITS) - 1))
        top += 1 << cls.SUB_BITS
        return ((top + 1) << shift) / 1000

    def summary(self) -> dict[str, float] | None:
        if self._n == 0:
            return None
        wanted = {f"p{round(q * 100)}": _nearest_rank(self._n, q) for q in (0.5, 0.9, 0.99)}
        result: dict[str, float] = {}
        seen = 0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            for name, rank in wanted.items():
                if name not in result and seen >= rank:
                    result[name] = min(self._upper_ms(index), self._max)
        result.update(min=self._min, max=self._max, mean=self._sum / self._n)
        return _rounded(result)


Latencies = ExactLatencies | LogHistogram


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}


# --- statistics -----------------------------------------------------------------------------------


@dataclass
class StepStats:
    """One step's answers (route, touch, eos) or all of them together."""

    latency: Latencies
    codes: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(self.codes.values())

    @property
    def errors(self) -> int:
        return self.requests - self.codes["OK"]

    def report(self, elapsed: float) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.codes["OK"],
            "errors": self.errors,
            "throughput_rps": round(self.requests / elapsed, 2) if elapsed > 0 else None,
            "latency_ms": self.latency.summary(),
            "codes": dict(self.codes.most_common()),
            "outcomes": dict(self.outcomes.most_common()),
        }


class Stats:
    """Everything measured in one phase: per step, in total, the current soak interval, and
    optionally a CSV row and a (time, latency) pair per request."""

    def __init__(
        self,
        origin: float,
        *,
        bounded: bool = False,
        csv_writer: Any = None,
        keep_series: bool = False,
    ) -> None:
        """``bounded``: --soak (log histograms, interval samples kept for the reports)."""
        self.origin = origin  # perf_counter at the run's start: CSV and plot times are relative
        self._bounded = bounded
        self._csv = csv_writer
        self.total = StepStats(self._recorder())
        self.steps: dict[str, StepStats] = {}
        self.interval: ExactLatencies | None = ExactLatencies() if bounded else None
        self.series: dict[str, tuple[array[float], array[float]]] | None = (
            {} if keep_series else None
        )

    def _recorder(self) -> Latencies:
        return LogHistogram() if self._bounded else ExactLatencies()

    def record(
        self, step: str, t_start: float, ms: float, status: int, code: str, outcome: str | None
    ) -> None:
        stats = self.steps.get(step)
        if stats is None:
            stats = self.steps[step] = StepStats(self._recorder())
        for s in (stats, self.total):
            s.latency.add(ms)
            s.codes[code] += 1
            if outcome is not None:
                s.outcomes[outcome] += 1
        if self.interval is not None:
            self.interval.add(ms)
        t = t_start - self.origin
        if self._csv is not None:
            self._csv.writerow([f"{t:.6f}", step, f"{ms:.3f}", status, code])
        if self.series is not None:
            ts, lat = self.series.setdefault(step, (array("d"), array("d")))
            ts.append(t)
            lat.append(ms)

    def take_interval(self) -> ExactLatencies:
        interval, self.interval = self.interval or ExactLatencies(), ExactLatencies()
        return interval


# --- talking to the service -----------------------------------------------------------------------


@dataclass
class Answer:
    status: int  # HTTP status; 0 when no answer came
    code: str  # "OK", an error_code, HTTP_<status>, CONNECT_ERROR, TIMEOUT, TRANSPORT_ERROR
    data: dict[str, Any]
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def classify(resp: httpx.Response) -> Answer:
    """The contract's envelope, or HTTP_<status> for anything else (a proxy's page, a 404
    of a wrong base URL...)."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        return Answer(resp.status_code, f"HTTP_{resp.status_code}", {}, resp.text[:200])
    if body["ok"]:
        data = body.get("data")
        return Answer(resp.status_code, "OK", data if isinstance(data, dict) else {})
    code = body.get("error_code")
    if not isinstance(code, str) or not code:
        code = f"HTTP_{resp.status_code}"
    return Answer(resp.status_code, code, {}, str(body.get("error_message", "")))


Outcome = Callable[[dict[str, Any]], str]


def placement(data: dict[str, Any]) -> str:
    return str(data.get("placement"))


def touched(data: dict[str, Any]) -> str:
    return "touched" if data.get("touched") else "not_touched"


def released(data: dict[str, Any]) -> str:
    return "released" if data.get("released") else "not_released"


class Api:
    """The gateway's and the claw manager's calls, each one measured into ``stats``: route and
    touch through the gateway's client (``gateway``), config_sync over plain HTTP."""

    def __init__(
        self, client: httpx.AsyncClient, gateway: AsyncGatewayClient, args: argparse.Namespace
    ) -> None:
        self.client = client
        self.gateway = gateway
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self._ids = 0
        self._headers = _bearer(args.token)
        self._admin_headers = _bearer(args.admin_token or args.token)

    def new_id(self, kind: str) -> str:
        self._ids += 1
        return f"lt-{self.run_id}-{kind}{self._ids}"

    async def post(
        self,
        stats: Stats,
        step: str,
        path: str,
        body: dict[str, Any],
        *,
        outcome: Outcome | None = None,
        admin: bool = False,
    ) -> Answer:
        """One POST, measured: latency, code and (for an OK answer) what it said."""
        headers = self._admin_headers if admin else self._headers
        t_start = time.perf_counter()
        try:
            resp = await self.client.post(API + path, json=body, headers=headers)
            ms = (time.perf_counter() - t_start) * 1000
            answer = classify(resp)
        except httpx.RequestError as exc:  # no (usable) answer: connect, timeout, dropped
            ms = (time.perf_counter() - t_start) * 1000
            answer = Answer(0, transport_code(exc), {}, f"{type(exc).__name__}: {exc}")
        said = outcome(answer.data) if outcome and answer.ok else None
        stats.record(step, t_start, ms, answer.status, answer.code, said)
        return answer

    async def gateway_call(
        self, stats: Stats, step: str, call: Awaitable[dict[str, Any]], outcome: Outcome
    ) -> Answer:
        """One call of the gateway's client (one attempt), measured like ``post``."""
        t_start = time.perf_counter()
        try:
            data = await call
            answer = Answer(200, "OK", data)
        except AgentRuntimeError as exc:  # a failure envelope
            answer = Answer(exc.http_status, exc.code, {}, exc.message)
        except UnexpectedAnswer as exc:  # not an envelope: HTTP_<status>
            answer = Answer(exc.http_status, exc.code, {}, exc.excerpt)
        except Unavailable as exc:  # no (usable) answer: connect, timeout, dropped
            cause = exc.cause if exc.cause is not None else exc
            answer = Answer(0, transport_code(cause), {}, f"{type(cause).__name__}: {cause}")
        ms = (time.perf_counter() - t_start) * 1000
        said = outcome(answer.data) if answer.ok else None
        stats.record(step, t_start, ms, answer.status, answer.code, said)
        return answer

    def _scope_ids(self) -> dict[str, str]:
        if self.args.touch_without_ids:  # the index path: a second round trip
            return {}
        return {"bot_id": self.args.bot_id, "group_id": self.args.group_id}

    async def route(self, stats: Stats, step: str, session_id: str) -> Answer:
        async def call() -> dict[str, Any]:
            route: Route = await self.gateway.route(
                session_id, self.args.bot_id, self.args.group_id, request_id=self.new_id("r")
            )
            return {"pod_id": route.pod_id, "placement": route.placement.value}

        return await self.gateway_call(stats, step, call(), placement)

    async def touch(self, stats: Stats, step: str, session_id: str, *, eos: bool = False) -> Answer:
        # as the API reference tells a gateway: with the ids, one EVALSHA
        rid = self.new_id("t")

        async def call() -> dict[str, Any]:
            if eos:
                ended = await self.gateway.end(session_id, request_id=rid, **self._scope_ids())
                return {"touched": ended.touched, "released": ended.released}
            return {
                "touched": await self.gateway.touch(session_id, request_id=rid, **self._scope_ids())
            }

        return await self.gateway_call(stats, step, call(), released if eos else touched)

    async def config_sync(self, stats: Stats, kind: str, item: dict[str, Any]) -> Answer:
        body = {
            "metadata": {"request_id": self.new_id("c")},
            "rawdata": {"kind": kind, "op": "sync", "item": item},
        }
        for _ in range(20):  # another config_sync holds the lock: a short, bounded retry
            answer = await self.post(stats, kind, "/config_sync", body, admin=True)
            if answer.code != "CONFIG_SYNC_BUSY":
                return answer
            body["metadata"] = {"request_id": self.new_id("c")}
            await asyncio.sleep(0.25)
        return answer


def _bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def transport_code(exc: BaseException) -> str:
    # ConnectTimeout too: it never answered; TimeoutError: the gateway client's deadline
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "TIMEOUT"
    if isinstance(exc, httpx.ConnectError):
        return "CONNECT_ERROR"
    return "TRANSPORT_ERROR"  # read/write/protocol errors, a connection the server dropped


# --- bounds and workers ---------------------------------------------------------------------------


class Bounds:
    """Hands out iteration numbers until --count or --duration is reached, or Ctrl-C."""

    def __init__(self, count: int | None, duration: float | None) -> None:
        self.count = count
        self.duration = duration
        self.deadline = math.inf
        self.issued = 0
        self.stopping = False

    def start(self) -> None:
        if self.duration is not None:
            self.deadline = time.monotonic() + self.duration

    def take(self) -> int | None:
        if self.stopping or time.monotonic() >= self.deadline:
            return None
        if self.count is not None and self.issued >= self.count:
            return None
        self.issued += 1
        return self.issued - 1


async def run_workers(
    n: int, take: Callable[[], Any], work: Callable[[Any], Awaitable[None]]
) -> None:
    """n workers, each doing ``work(item)`` for items from ``take()`` until it returns None."""

    async def worker() -> None:
        while (item := take()) is not None:
            await work(item)

    await asyncio.gather(*(worker() for _ in range(n)))


def taker(items: Iterable[Any]) -> Callable[[], Any]:
    it = iter(items)
    return lambda: next(it, None)


# --- scenarios ------------------------------------------------------------------------------------


@dataclass
class Run:
    """What the scenario functions share."""

    api: Api
    args: argparse.Namespace
    stats: Stats
    sessions: list[str] = field(default_factory=list)  # refresh: the pre-created ones
    created: list[str] = field(default_factory=list)  # route: sessions to end after the run
    forgotten: int = 0  # route: sessions beyond MAX_CLEANUP_IDS, left to their session_ttl


async def scenario_route(run: Run, _: int) -> None:
    session_id = run.api.new_id("s")
    answer = await run.api.route(run.stats, "route", session_id)
    if answer.ok and not run.args.no_cleanup:
        if len(run.created) < MAX_CLEANUP_IDS:
            run.created.append(session_id)
        else:
            run.forgotten += 1


async def scenario_refresh(run: Run, i: int) -> None:
    await run.api.route(run.stats, "route", run.sessions[i % len(run.sessions)])


async def scenario_route_touch(run: Run, _: int) -> None:
    session_id = run.api.new_id("s")
    if not (await run.api.route(run.stats, "route", session_id)).ok:
        return
    for _touch in range(run.args.touches):
        await run.api.touch(run.stats, "touch", session_id)
    await run.api.touch(run.stats, "eos", session_id, eos=True)


async def scenario_queued(run: Run, _: int) -> None:
    session_id = run.api.new_id("s")
    if not (await run.api.route(run.stats, "route", session_id)).ok:
        return
    await asyncio.sleep(run.args.hold)
    await run.api.touch(run.stats, "eos", session_id, eos=True)


SCENARIO_FUNCS: dict[str, Callable[[Run, int], Awaitable[None]]] = {
    "route": scenario_route,
    "refresh": scenario_refresh,
    "route_touch": scenario_route_touch,
    "queued": scenario_queued,
}


# --- setup and teardown (not measured into the run's numbers) -------------------------------------


def template_id_of(args: argparse.Namespace) -> str:
    return str(args.template_id or f"loadtest-{args.group_id}-{args.bot_id}"[:256])


async def configure(api: Api, args: argparse.Namespace, side: Stats) -> str | None:
    """Template + rule for the scope through config_sync (op sync: idempotent). None when
    done, else the one-line reason."""
    template_id = template_id_of(args)
    template = {
        "template_id": template_id,
        "image": args.image,
        "scope_concurrency": args.scope_concurrency,
        "pod_concurrency": args.pod_concurrency,
        "session_ttl": args.session_ttl,
    }
    rule = {"group_id": args.group_id, "bot_id": args.bot_id, "template_id": template_id}
    changes = []
    for kind, item in (("template", template), ("routing_rule", rule)):
        answer = await api.config_sync(side, kind, item)
        if not answer.ok:
            return f"config_sync {kind} refused: {answer.code} {answer.message}".rstrip()
        changes.append(f"{kind} {answer.data.get('change_class')}")
    note(
        f"configured: template {template_id!r} (scope_concurrency {args.scope_concurrency}, "
        f"pod_concurrency {args.pod_concurrency}, session_ttl {args.session_ttl} s) for "
        f"({args.group_id}, {args.bot_id}); change_class: {', '.join(changes)}"
    )
    return None


async def precreate(run: Run, side: Stats) -> str | None:
    """refresh: route --sessions new sessions once; the run refreshes the ones that got in."""

    async def create(session_id: str) -> None:
        if (await run.api.route(side, "precreate", session_id)).ok:
            run.sessions.append(session_id)

    wanted = [run.api.new_id("s") for _ in range(run.args.sessions)]
    await run_workers(min(run.args.concurrency, len(wanted)), taker(wanted), create)
    refused = side.steps["precreate"].codes.copy()
    del refused["OK"]
    detail = f" (refused: {_codes_text(refused)})" if refused else ""
    note(f"pre-created {len(run.sessions)}/{len(wanted)} sessions{detail}")
    if not run.sessions:
        return "refresh: no session could be created, nothing to refresh"
    return None


async def end_sessions(run: Run, side: Stats, session_ids: list[str]) -> None:
    """Free the scope's slots now instead of after session_ttl (touch with eos)."""
    if not session_ids:
        return

    async def end(session_id: str) -> None:
        await run.api.touch(side, "cleanup", session_id, eos=True)

    await run_workers(min(run.args.concurrency, len(session_ids)), taker(session_ids), end)
    codes = side.steps["cleanup"].codes
    failed = sum(codes.values()) - codes["OK"]
    note(
        f"ended {codes['OK']}/{len(session_ids)} sessions"
        + (f" ({failed} failed)" if failed else "")
    )


# --- live output ----------------------------------------------------------------------------------


def note(text: str) -> None:
    _clear_progress()
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


_progress_shown = False


def _clear_progress() -> None:
    global _progress_shown
    if _progress_shown:
        sys.stderr.write("\r\x1b[K")
        _progress_shown = False


async def progress_loop(stats: Stats, started: float, tty: bool) -> None:
    """Once a second: requests done, req/s over the last second, errors so far."""
    global _progress_shown
    last_n, last_t = 0, time.perf_counter()
    while True:
        await asyncio.sleep(1.0)
        now, n = time.perf_counter(), stats.total.requests
        rate = (n - last_n) / (now - last_t) if now > last_t else 0.0
        last_n, last_t = n, now
        line = f"{now - started:7.1f}s  {n} requests  {rate:.1f} req/s  errors {stats.total.errors}"
        if tty:
            sys.stderr.write(f"\r{line}\x1b[K")
            _progress_shown = True
        else:
            sys.stderr.write(f"{PROG}: progress {line}\n")
        sys.stderr.flush()


class SoakReporter:
    """--soak: every --report-every seconds, the interval's throughput and latency
    percentiles (exact over the interval) and the cumulative errors, on stdout."""

    def __init__(self, stats: Stats, started: float) -> None:
        self.stats = stats
        self.started = self.last = started
        self.reports: list[dict[str, Any]] = []

    async def loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            self.report()

    def report(self, label: str = "last") -> None:
        """One interval's line; ``label`` "tail" for the part after the last full interval."""
        now = time.perf_counter()
        interval, span = self.stats.take_interval(), now - self.last
        self.last = now
        total = self.stats.total
        lat = interval.summary()
        report: dict[str, Any] = {
            "t_s": round(now - self.started, 3),
            "interval_s": round(span, 3),
            "requests": len(interval),
            "throughput_rps": round(len(interval) / span, 2) if span > 0 else None,
            "latency_ms": lat,
            "total_requests": total.requests,
            "total_errors": total.errors,
            "error_codes": _error_codes(total.codes),
        }
        self.reports.append(report)
        pct = (
            f"p50 {lat['p50']:.2f} p90 {lat['p90']:.2f} p99 {lat['p99']:.2f} "
            f"max {lat['max']:.2f} ms"
            if lat
            else "no answers"
        )
        errors = f" ({_codes_text(Counter(report['error_codes']))})" if total.errors else ""
        _clear_progress()
        print(
            f"[{now - self.started:8.1f}s] {label} {span:.1f}s: {len(interval)} req, "
            f"{report['throughput_rps'] or 0:.1f} req/s, {pct} | total {total.requests} req, "
            f"errors {total.errors}{errors}",
            flush=True,
        )


def _error_codes(codes: Counter[str]) -> dict[str, int]:
    return {code: n for code, n in codes.most_common() if code != "OK"}


def _codes_text(codes: Counter[str]) -> str:
    return ", ".join(f"{code} {n}" for code, n in codes.most_common())


# --- the run --------------------------------------------------------------------------------------


async def check_health(client: httpx.AsyncClient, base_url: str) -> str | None:
    """None when /healthz answers 200 ok, else the one-line reason."""
    try:
        resp = await client.get("/healthz", timeout=5.0)
    except httpx.TransportError as exc:
        return f"service at {base_url} unreachable: GET /healthz: {type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return f"service at {base_url} not ready: GET /healthz answered {resp.status_code}"
    return None


class Interrupts:
    """Ctrl-C: the first stops handing out iterations, the next one cancels what runs."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.count = 0
        self.phase: asyncio.Task[Any] | None = None

    def __call__(self) -> None:
        self.count += 1
        self.bounds.stopping = True
        if self.count == 1:
            note("stopping: letting requests in flight finish (Ctrl-C again to abandon them)")
        elif self.phase is not None:
            self.phase.cancel()

    async def run(self, coro: Awaitable[Any]) -> None:
        """Run one phase; a second Ctrl-C cancels it and the run goes on to its summary."""
        self.phase = asyncio.ensure_future(coro)
        with contextlib.suppress(asyncio.CancelledError):
            await self.phase
        self.phase = None


@dataclass
class Finished:
    exit_status: int
    summary: dict[str, Any] | None = None  # None: refused before the run
    stats: Stats | None = None


async def main_async(args: argparse.Namespace, csv_file: TextIO | None) -> Finished:
    limits = httpx.Limits(  # idle expiry under the server's keep-alive timeout (5 s)
        max_connections=args.concurrency,
        max_keepalive_connections=args.concurrency,
        keepalive_expiry=2.0,
    )
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 5.0))
    gateway = AsyncGatewayClient(
        args.base_url,
        token=args.token or "",  # never the environment's AGENT_RUNTIME_GATEWAY_TOKEN
        deadline=args.timeout,
        retry=RetryPolicy(max_attempts=1),  # a measured request is one attempt, as it came
        limits=limits,
        trust_env=False,
    )
    async with (
        httpx.AsyncClient(
            base_url=args.base_url, limits=limits, timeout=timeout, trust_env=False
        ) as client,
        gateway,
    ):
        reason = await check_health(client, args.base_url)
        if reason:
            print(f"{PROG}: error: {reason}", file=sys.stderr)
            return Finished(EXIT_USAGE)

        api = Api(client, gateway, args)
        origin = time.perf_counter()
        side = Stats(origin)  # setup and teardown: counted apart from the run
        writer = csv.writer(csv_file) if csv_file else None
        if writer:
            writer.writerow(["t_start", "step", "latency_ms", "status", "error_code"])
        stats = Stats(origin, bounded=args.soak, csv_writer=writer, keep_series=bool(args.plot))
        run = Run(api, args, stats)

        if args.configure:
            reason = await configure(api, args, side)
            if reason:
                print(f"{PROG}: error: {reason}", file=sys.stderr)
                return Finished(EXIT_SETUP)
        if args.scenario == "refresh":
            reason = await precreate(run, side)
            if reason:
                print(f"{PROG}: error: {reason}", file=sys.stderr)
                return Finished(EXIT_SETUP)

        bounds = Bounds(args.count, args.duration)
        interrupts = Interrupts(bounds)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGINT, interrupts)

        scenario = SCENARIO_FUNCS[args.scenario]
        helpers: list[asyncio.Task[None]] = []
        started_wall = datetime.now(UTC)
        started = time.perf_counter()
        soak = SoakReporter(stats, started)
        bounds.start()
        if args.progress or sys.stderr.isatty():
            helpers.append(asyncio.create_task(progress_loop(stats, started, sys.stderr.isatty())))
        if args.soak:
            helpers.append(asyncio.create_task(soak.loop(args.report_every)))
        await interrupts.run(run_workers(args.concurrency, bounds.take, lambda i: scenario(run, i)))
        elapsed = time.perf_counter() - started
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        _clear_progress()
        if args.soak and stats.interval:
            soak.report("tail")  # requests that ended after the last full interval

        leftover = run.sessions if args.scenario == "refresh" else run.created
        if leftover and not args.no_cleanup and interrupts.count < 2:
            await interrupts.run(end_sessions(run, side, leftover))
        if run.forgotten:
            note(f"{run.forgotten} sessions not remembered for cleanup: they end by session_ttl")

        summary = build_summary(args, stats, side, bounds, elapsed, started_wall, soak.reports)
        summary["interrupted"] = interrupts.count > 0
        return Finished(EXIT_INTERRUPTED if interrupts.count else EXIT_OK, summary, stats)


# --- summary --------------------------------------------------------------------------------------


def build_summary(
    args: argparse.Namespace,
    stats: Stats,
    side: Stats,
    bounds: Bounds,
    elapsed: float,
    started_wall: datetime,
    reports: list[dict[str, Any]],
) -> dict[str, Any]:
    total = stats.total.report(elapsed)
    summary: dict[str, Any] = {
        "scenario": args.scenario,
        "base_url": args.base_url,
        "scope": {"group_id": args.group_id, "bot_id": args.bot_id},
        "concurrency": args.concurrency,
        "bounds": {"count": args.count, "duration_s": args.duration},
        "started_at": started_wall.isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 3),
        "iterations": bounds.issued,
        "requests": total["requests"],
        "ok": total["ok"],
        "errors": total["errors"],
        "throughput_rps": total["throughput_rps"],
        "latency_ms": total["latency_ms"],
        "codes": total["codes"],
        "latency_method": (
            "log histogram (<=0.8% above the true value; max exact)"
            if args.soak
            else "exact (nearest rank over every sample)"
        ),
        "steps": {name: s.report(elapsed) for name, s in stats.steps.items()},
        # config_sync, refresh's pre-create, the end-of-run eos: answers only, not in the numbers
        "setup_teardown": {name: dict(s.codes) for name, s in side.steps.items()},
    }
    if args.scenario == "queued":
        route = stats.steps.get("route")
        codes = route.codes if route else Counter[str]()
        queue = {code: codes[code] for code in QUEUE_CODES}
        queue["other"] = sum(codes.values()) - sum(queue.values())
        summary["queue_outcomes"] = queue
    if args.soak:
        summary["intervals"] = reports
    return summary


def _fmt(value: float | None, width: int = 8) -> str:
    return f"{value:{width}.2f}" if value is not None else f"{'-':>{width}}"


def print_summary(s: dict[str, Any]) -> None:
    bounds = ", ".join(
        f"{k} {v}"
        for k, v in (("count", s["bounds"]["count"]), ("duration", s["bounds"]["duration_s"]))
        if v
    )
    lines = [
        f"scenario {s['scenario']} against {s['base_url']}, scope "
        f"({s['scope']['group_id']}, {s['scope']['bot_id']}), concurrency {s['concurrency']}, "
        f"bounds: {bounds}" + (" (interrupted)" if s.get("interrupted") else ""),
        f"{s['iterations']} iterations, {s['requests']} requests in {s['elapsed_s']:.2f} s: "
        f"{s['throughput_rps'] or 0:.1f} req/s, {s['errors']} errors",
        "",
        f"{'step':<10}{'requests':>9}{'errors':>8}{'req/s':>9}"
        f"{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}",
    ]
    rows = [*s["steps"].items(), ("all", s)] if len(s["steps"]) > 1 else list(s["steps"].items())
    for name, r in rows:
        lat = r["latency_ms"] or {}
        lines.append(
            f"{name:<10}{r['requests']:>9}{r['errors']:>8}{_fmt(r['throughput_rps'], 9)}"
            + "".join(_fmt(lat.get(k), 9) for k in ("p50", "p90", "p99", "max"))
        )
    lines += ["", f"codes: {_codes_text(Counter(s['codes'])) or '-'}"]
    outcomes = "; ".join(
        f"{name} {_codes_text(Counter(r['outcomes']))}"
        for name, r in s["steps"].items()
        if r["outcomes"]
    )
    if outcomes:
        lines.append(f"outcomes: {outcomes}")
    if "queue_outcomes" in s:
        lines.append(f"queue outcomes (route): {_codes_text(Counter(s['queue_outcomes']))}")
    lines.append(f"latency: {s['latency_method']}")
    print("\n".join(lines), flush=True)


def plot(stats: Stats, path: str, scenario: str) -> None:
    """Latency over time (per step) and a latency histogram; matplotlib is optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note(f"--plot {path} skipped: matplotlib is not installed (pip install matplotlib)")
        return
    assert stats.series is not None
    top = max((max(lat) for _, lat in stats.series.values() if lat), default=1.0) or 1.0
    bins = [top * i / 100 for i in range(101)]  # one set of bins for every step
    fig, (over_time, histogram) = plt.subplots(2, 1, figsize=(10, 7))
    for step, (ts, lat) in stats.series.items():
        over_time.scatter(list(ts), list(lat), s=2, label=step)
        histogram.hist(list(lat), bins=bins, alpha=0.6, label=step)
    over_time.set(title=f"{scenario}: latency over time", xlabel="s since start", ylabel="ms")
    over_time.set_yscale("log")
    histogram.set(title="latency histogram", xlabel="ms", ylabel="requests")
    histogram.set_yscale("log")
    over_time.legend()
    histogram.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    note(f"plot written to {path}")


# --- arguments ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        epilog="Examples and details: see the module docstring (head scripts/load_test.py).",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8091", help="(default: %(default)s)")
    p.add_argument(
        "--token",
        default=os.environ.get("LOAD_TEST_TOKEN"),
        help="bearer token for route/touch (default: $LOAD_TEST_TOKEN)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LOAD_TEST_ADMIN_TOKEN"),
        help="bearer token for config_sync (default: $LOAD_TEST_ADMIN_TOKEN, else --token)",
    )
    p.add_argument("--scenario", choices=SCENARIOS, default="route")
    p.add_argument(
        "--group-id", default="grp-load", help="the scope's group (default: %(default)s)"
    )
    p.add_argument("--bot-id", default="bot-load", help="the scope's bot (default: %(default)s)")

    b = p.add_argument_group("bounds (at least one; whichever comes first)")
    b.add_argument("--count", type=int, help=f"iterations (1..{MAX_COUNT})")
    b.add_argument("--duration", type=float, help=f"seconds (up to {MAX_DURATION:.0f})")
    b.add_argument("--concurrency", type=int, default=10, help="workers = pooled connections (10)")
    b.add_argument("--timeout", type=float, default=60.0, help="per request, seconds (60)")

    sc = p.add_argument_group("scenarios")
    sc.add_argument("--sessions", type=int, default=10, help="refresh: sessions to pre-create (10)")
    sc.add_argument("--touches", type=int, default=1, help="route_touch: keep-alive touches (1)")
    sc.add_argument(
        "--touch-without-ids",
        action="store_true",
        help="touch with the session id alone (the service reads its session-scope index, "
        "written just after the route's reply: a touch right after may find none yet)",
    )
    sc.add_argument("--hold", type=float, default=0.5, help="queued: seconds a slot is held (0.5)")
    sc.add_argument(
        "--no-cleanup", action="store_true", help="route/refresh: leave the sessions to expire"
    )

    cfg = p.add_argument_group("--configure: a template + rule for the scope via config_sync")
    cfg.add_argument("--configure", action="store_true")
    cfg.add_argument("--scope-concurrency", type=int, help="(default: 4 for queued, else 10000)")
    cfg.add_argument("--pod-concurrency", type=int, help="(default: 2 for queued, else 500)")
    cfg.add_argument("--session-ttl", type=int, default=60, help="seconds (60)")
    cfg.add_argument("--template-id", help="(default: loadtest-<group>-<bot>)")
    cfg.add_argument("--image", default="registry.local/agentserver:loadtest")

    out = p.add_argument_group("output")
    out.add_argument("--progress", action="store_true", help="progress line even if not a TTY")
    out.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    out.add_argument("--csv", metavar="FILE", help="one row per request")
    out.add_argument("--plot", metavar="FILE.png", help="latency over time + histogram")
    out.add_argument("--soak", action="store_true", help="interval reports, bounded memory")
    out.add_argument("--report-every", type=float, help="--soak: seconds between reports (60)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot run (argparse exits with status 2 and the usage)."""
    if args.count is None and args.duration is None:
        p.error("a bound is required: --count N and/or --duration S (whichever comes first)")
    if args.count is not None and not 1 <= args.count <= MAX_COUNT:
        p.error(f"--count must be 1..{MAX_COUNT}")
    if args.duration is not None and not 0 < args.duration <= MAX_DURATION:
        p.error(f"--duration must be > 0 and <= {MAX_DURATION:.0f} seconds")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        p.error(f"--concurrency must be 1..{MAX_CONCURRENCY}")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    if not args.base_url.startswith(("http://", "https://")):
        p.error("--base-url must start with http:// or https://")
    args.base_url = args.base_url.rstrip("/")
    if args.sessions < 1 or args.touches < 0 or args.hold < 0:
        p.error("--sessions must be >= 1, --touches and --hold >= 0")
    for name in ("group_id", "bot_id"):
        value = getattr(args, name)
        if not 1 <= len(value) <= 256 or any(ord(c) < 32 or ord(c) == 127 for c in value):
            p.error(f"--{name.replace('_', '-')}: 1-256 characters, no control characters")
    if args.report_every is not None and not args.soak:
        p.error("--report-every goes with --soak")
    if args.report_every is None:
        args.report_every = 60.0
    if args.report_every <= 0:
        p.error("--report-every must be > 0")
    limits_given = args.scope_concurrency is not None or args.pod_concurrency is not None
    if limits_given and not args.configure:
        p.error("--scope-concurrency/--pod-concurrency go with --configure")
    queued = args.scenario == "queued"
    if args.scope_concurrency is None:
        args.scope_concurrency = 4 if queued else 10_000
    if args.pod_concurrency is None:
        args.pod_concurrency = min(2 if queued else 500, args.scope_concurrency)
    if args.scope_concurrency < 1 or args.pod_concurrency < 1 or args.session_ttl < 1:
        p.error("--scope-concurrency, --pod-concurrency and --session-ttl must be >= 1")
    for option in ("json", "csv", "plot"):
        target = getattr(args, option)
        if target and not Path(target).resolve().parent.is_dir():
            p.error(f"--{option} {target}: the directory does not exist")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        note(f"--plot {args.plot}: matplotlib is not installed; the run goes on without a plot")
    if args.configure and args.scenario == "queued" and args.concurrency <= args.scope_concurrency:
        note(
            f"--concurrency {args.concurrency} does not exceed scope_concurrency "
            f"{args.scope_concurrency}: nothing will wait in the queue"
        )
    with contextlib.ExitStack() as stack:
        csv_file = None
        if args.csv:
            csv_file = stack.enter_context(open(args.csv, "w", newline="", encoding="utf-8"))
        finished = asyncio.run(main_async(args, csv_file))
    if finished.summary is not None:
        print_summary(finished.summary)
        if args.json:
            Path(args.json).write_text(json.dumps(finished.summary, indent=2) + "\n")
    if args.plot and finished.stats is not None:
        plot(finished.stats, args.plot, args.scenario)
    return finished.exit_status


if __name__ == "__main__":
    sys.exit(main())
