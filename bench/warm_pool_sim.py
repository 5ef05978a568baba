"""warm_pool_sim: a trace-driven discrete-event simulation of the warm pool policies.

It drives the SAME functions the service's autoscale and reclaim use
(``agent_runtime.resource_manager.warm_policy``: ``plan``, ``reclaimable``, ``arrival_rate``,
``deploy_time_of``, the EWMA update route_place.lua makes) with synthetic arrival traces, and
prints per trace and policy: the fraction of new sessions that waited for a deploy (cold
waits), p50/p99 time to place, idle pod-seconds (the cost) and deploys made.

The model, per scope: a new session takes a free slot (first an in-use pod with room, then
the most recently idle warm pod: what route_place and acquire do) in WARM_CLAIM seconds, else
it waits in the scope's queue and one cold deploy starts per pod the queue needs (within
max_pods); any pod that becomes Ready serves the queue first, and a freed slot too. Every
TICK seconds autoscale starts the plan's deploys and reclaim deletes the warm pods above the
plan's floor idle for pod_ttl (both jobs tick each second in the service). Arrivals are
counted into the EWMAs when a session is placed (as route_place counts them); each finished
deploy's duration goes into the scope's last 32 (deploy_time.lua). Deploy times are drawn
from 2 + 28 × Beta(1.5, 4) seconds (2–30 s, median ≈ 9 s, p90 ≈ 16 s), session lengths
from a log-normal (median 60 s). Deterministic with a seed; pure Python.

    python -m bench.warm_pool_sim [--seed N] [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

from agent_runtime.resource_manager.session_side import ARRIVAL_FAST_WINDOW, ARRIVAL_SLOW_WINDOW
from agent_runtime.resource_manager.warm_policy import (
    DEFAULT_DEPLOY_TIME,
    DEFAULT_MARGIN,
    WarmInputs,
    arrival_rate,
    counted_arrival,
    decayed,
    deploy_time_of,
    plan,
    reclaimable,
)

WARM_CLAIM = 0.003  # seconds: a warm claim (route_place + acquire), the measured p50
TICK = 1.0  # the autoscale and reclaim jobs' interval
# the first seconds of every trace are not counted (for every policy alike): a scope in service
# has a history of arrivals and deploys; a brand-new one starts from nothing either way
WARMUP = 300.0
DEPLOY_TIMES_KEPT = 32
LAZY_TICKS = 10


@dataclass(frozen=True)
class Template:
    pod_concurrency: int = 1
    min_idle_pods: int = 0
    max_pods: int = 10_000
    pod_ttl: float = 300.0


@dataclass
class Scope:
    template: Template
    in_use: dict[int, int] = field(default_factory=dict)  # pod -> sessions (>= 1)
    idle: dict[int, float] = field(default_factory=dict)  # pod -> idle since
    warm_in_flight: int = 0
    cold_in_flight: int = 0
    queue: deque[float] = field(default_factory=deque)  # arrival times waiting for a slot
    fast: float = 0.0
    slow: float = 0.0
    at: float = 0.0
    deploy_times: deque[float] = field(default_factory=lambda: deque(maxlen=DEPLOY_TIMES_KEPT))
    deploy_time: float = 0.0  # deploy_time_of(deploy_times), kept when a deploy starts
    sessions: int = 0
    dirty: bool = True  # something happened since the jobs last looked

    @property
    def pods(self) -> int:
        return len(self.in_use) + len(self.idle)

    @property
    def in_flight(self) -> int:
        return self.warm_in_flight + self.cold_in_flight


@dataclass(frozen=True)
class Trace:
    name: str
    duration: float
    templates: list[Template]
    rate_of: Callable[[int, float], float]  # (scope, t) -> new sessions per second
    peak_rate: Callable[[int], float]  # an upper bound of rate_of(scope, ·) (thinning)
    min_idle_curve: tuple[int, ...]
    warmup: float = WARMUP
    deploy_time: Callable[[random.Random], float] = lambda rng: (
        2.0 + 28.0 * rng.betavariate(1.5, 4.0)
    )
    session_median: float = 60.0
    # the service before issue 16 §1: a scope's cold routes share one deploy at a time
    serial_cold: bool = False


@dataclass
class Result:
    arrivals: int = 0
    cold: int = 0
    waits: list[float] = field(default_factory=list)
    idle_seconds: float = 0.0
    deploys: int = 0

    @property
    def cold_fraction(self) -> float:
        return self.cold / self.arrivals if self.arrivals else 0.0

    def pct(self, q: float) -> float:
        ordered = sorted(self.waits)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def arrivals(trace: Trace, rng: random.Random) -> Iterator[tuple[float, int]]:
    """Non-homogeneous Poisson arrivals of every scope by thinning, in time order."""
    heap: list[tuple[float, int]] = []
    for scope in range(len(trace.templates)):
        peak = trace.peak_rate(scope)
        if peak > 0:
            heapq.heappush(heap, (rng.expovariate(peak), scope))
    while heap:
        t, scope = heapq.heappop(heap)
        if t >= trace.duration + trace.warmup:
            continue
        peak = trace.peak_rate(scope)
        if rng.random() * peak <= trace.rate_of(scope, t):
            yield t, scope
        heapq.heappush(heap, (t + rng.expovariate(peak), scope))


class Simulation:
    def __init__(self, trace: Trace, mode: str, *, margin: float, min_idle: int, seed: int):
        self.trace = trace
        self.mode = mode
        self.margin = margin
        self.rng = random.Random(seed)
        self.arrival_rng = random.Random(seed)  # same arrivals for every policy
        self.scopes = [
            Scope(Template(t.pod_concurrency, min_idle, t.max_pods, t.pod_ttl))
            for t in trace.templates
        ]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.next_pod = 0
        self.now = 0.0
        self.ticks = 0
        self.idle_total = 0
        self.result = Result()

    def push(self, t: float, kind: str, scope: int, pod: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, scope, pod))

    def advance(self, t: float) -> None:
        if t > self.trace.warmup:
            self.result.idle_seconds += self.idle_total * (t - max(self.now, self.trace.warmup))
        self.now = t

    def run(self) -> Result:
        source = arrivals(self.trace, self.arrival_rng)
        pending = next(source, None)
        tick = TICK
        while True:
            upcoming = self.events[0][0] if self.events else math.inf
            moment = min(upcoming, pending[0] if pending else math.inf, tick)
            if moment >= self.trace.duration + self.trace.warmup:
                self.advance(self.trace.duration + self.trace.warmup)
                return self.result
            self.advance(moment)
            if pending is not None and pending[0] == moment:
                self.arrive(pending[1])
                pending = next(source, None)
            elif moment == tick:
                self.tick()
                tick += TICK
            else:
                _, _, kind, scope, pod = heapq.heappop(self.events)
                if kind == "ready":
                    self.ready(scope, pod)
                else:
                    self.end(scope, pod)

    # --- sessions ------------------------------------------------------------------------------

    def arrive(self, s: int) -> None:
        counted = self.now >= self.trace.warmup
        self.result.arrivals += counted
        scope = self.scopes[s]
        if not self.place(s, self.now):
            self.result.cold += counted
            scope.queue.append(self.now)
            self.cold_deploys(s)

    def place(self, s: int, arrived: float) -> bool:
        scope = self.scopes[s]
        pc = scope.template.pod_concurrency
        pod = next((p for p, n in scope.in_use.items() if n < pc), None)
        if pod is None and scope.idle:
            pod = max(scope.idle, key=scope.idle.__getitem__)  # the most recently idle
            del scope.idle[pod]
            self.idle_total -= 1
            scope.in_use[pod] = 0
        if pod is None:
            return False
        scope.in_use[pod] += 1
        scope.sessions += 1
        scope.dirty = True
        if arrived >= self.trace.warmup:
            self.result.waits.append(max(self.now - arrived, 0.0) + WARM_CLAIM)
        scope.fast = counted_arrival(scope.fast, scope.at, self.now, ARRIVAL_FAST_WINDOW)
        scope.slow = counted_arrival(scope.slow, scope.at, self.now, ARRIVAL_SLOW_WINDOW)
        scope.at = self.now
        self.push(self.now + self.session_length(), "end", s, pod)
        return True

    def end(self, s: int, pod: int) -> None:
        scope = self.scopes[s]
        scope.in_use[pod] -= 1
        scope.sessions -= 1
        scope.dirty = True
        if scope.in_use[pod] == 0:
            del scope.in_use[pod]
            scope.idle[pod] = self.now
            self.idle_total += 1
        self.serve_queue(s)

    def serve_queue(self, s: int) -> None:
        scope = self.scopes[s]
        while scope.queue and self.place(s, scope.queue[0]):
            scope.queue.popleft()

    # --- deploys -------------------------------------------------------------------------------

    def cold_deploys(self, s: int) -> None:
        """One deploy per pod the waiting routes need (the slow path's acquire)."""
        scope = self.scopes[s]
        t = scope.template
        needed = math.ceil(len(scope.queue) / t.pod_concurrency) - scope.cold_in_flight
        if self.trace.serial_cold:
            needed = min(needed, 1 - scope.cold_in_flight)
        room = t.max_pods - scope.pods - scope.in_flight
        for _ in range(max(min(needed, room), 0)):
            scope.cold_in_flight += 1
            self.deploy(s, warm=False)

    def deploy(self, s: int, *, warm: bool) -> None:
        took = self.trace.deploy_time(self.rng)
        self.next_pod += 1
        # the pod's id carries its kind: even = warm, odd = cold
        self.push(self.now + took, "ready", s, self.next_pod * 2 + (0 if warm else 1))
        scope = self.scopes[s]
        scope.deploy_times.append(took)
        scope.deploy_time = deploy_time_of(scope.deploy_times)
        scope.dirty = True
        self.result.deploys += self.now >= self.trace.warmup

    def ready(self, s: int, pod: int) -> None:
        scope = self.scopes[s]
        if pod % 2 == 0:
            scope.warm_in_flight -= 1
        else:
            scope.cold_in_flight -= 1
        scope.idle[pod] = self.now
        self.idle_total += 1
        scope.dirty = True
        self.serve_queue(s)
        if self.trace.serial_cold and scope.queue:
            self.cold_deploys(s)  # the next of the one-at-a-time cold deploys

    def session_length(self) -> float:
        return min(self.rng.lognormvariate(math.log(self.trace.session_median), 0.8), 1800.0)

    # --- the jobs ------------------------------------------------------------------------------

    def tick(self) -> None:
        self.ticks += 1
        for s, scope in enumerate(self.scopes):
            t = scope.template
            # A scope where nothing happened is looked at every LAZY_TICKS only (1,000 tenants
            # × every second is too slow in Python): untouched, its rates only decay, so its
            # plan deploys nothing new; what it may reclaim waits up to LAZY_TICKS seconds
            # longer than in the service (for every policy alike).
            if not scope.dirty and (self.ticks + s) % LAZY_TICKS:
                continue
            scope.dirty = False
            if self.mode == "static" and not scope.idle and t.min_idle_pods == 0:
                continue  # nothing to deploy, nothing to reclaim (a shortcut, same outcome)
            rate = arrival_rate(
                decayed(scope.fast, scope.at, self.now, ARRIVAL_FAST_WINDOW),
                decayed(scope.slow, scope.at, self.now, ARRIVAL_SLOW_WINDOW),
            )
            quiet = rate == 0.0 and not scope.idle and not scope.queue and t.min_idle_pods == 0
            if self.mode == "predictive" and quiet:
                continue
            decided = plan(
                self.mode,
                WarmInputs(
                    pod_concurrency=t.pod_concurrency,
                    pods=scope.pods,
                    idle_pods=len(scope.idle),
                    sessions=scope.sessions,
                    in_flight=scope.in_flight,
                    warm_in_flight=scope.warm_in_flight,
                    queued=len(scope.queue),
                    min_idle_pods=t.min_idle_pods,
                    max_pods=t.max_pods,
                    rate=rate,
                    departure_rate=decayed(scope.slow, scope.at, self.now, ARRIVAL_SLOW_WINDOW),
                    deploy_time=scope.deploy_time if scope.deploy_times else DEFAULT_DEPLOY_TIME,
                    pod_ttl=t.pod_ttl,
                ),
                margin=self.margin,
            )
            for _ in range(decided.deploy):
                scope.warm_in_flight += 1
                self.deploy(s, warm=True)
            for pod in reclaimable(decided.keep_idle, scope.idle, self.now, decided.reclaim_after):
                del scope.idle[pod]
                self.idle_total -= 1
                scope.dirty = True


# --- the traces ----------------------------------------------------------------------------------


def traces(quick: bool) -> list[Trace]:
    one = [Template()]
    day = 1800.0 if quick else 3600.0

    def diurnal(_: int, t: float) -> float:  # 0.05/s at night, 2/s at noon
        return 0.05 + 1.95 * (1 - math.cos(2 * math.pi * t / day)) / 2

    def flash(_: int, t: float) -> float:  # 0.3/s, 10x for 10 s at 900 s
        return 3.0 if 900.0 <= t < 910.0 else 0.3

    tenants = 300 if quick else 1000
    return [
        Trace("steady Poisson 0.5/s", 1800.0, one, lambda s, t: 0.5, lambda s: 0.5,
              (0, 2, 4, 8, 16, 32)),
        Trace("diurnal 0.05-2/s", day, one, diurnal, lambda s: 2.0, (0, 4, 8, 16, 32, 64)),
        Trace("flash crowd 10x in 10 s", 1800.0, one, flash, lambda s: 3.0,
              (0, 2, 4, 8, 16, 32)),
        Trace(f"{tenants} tenants at 0.01/s", 1200.0, [Template()] * tenants,
              lambda s, t: 0.01, lambda s: 0.01, (0, 1, 2)),
        Trace("heavy tenant 5/s, pod_concurrency 4", 1800.0, [Template(pod_concurrency=4)],
              lambda s, t: 5.0, lambda s: 5.0, (0, 2, 4, 8, 16)),
    ]  # fmt: skip


MARGINS = (0.5, 0.2, 0.05, 0.01, 0.001)


def below(static: list[tuple[float, float]], predictive: list[tuple[float, float]]) -> bool:
    """Whether the predictive curve (cost, cold fraction) lies at or below every static point:
    at each static point's cost, the predictive curve (its lower envelope, interpolated)
    waits no more. A static point cheaper than every predictive one counts against it."""
    curve = sorted(predictive)
    for cost, cold in static:
        if cost < curve[0][0]:
            if cold < curve[0][1]:
                return False
            continue
        best = min(c for k, c in curve if k <= cost)
        upper = [(k, c) for k, c in curve if k > cost]
        if upper:
            (k0, c0) = max((k, c) for k, c in curve if k <= cost)
            (k1, c1) = upper[0]
            best = min(best, c0 + (c1 - c0) * (cost - k0) / (k1 - k0))
        if best > cold + 1e-12:
            return False
    return True


def points(trace: Trace) -> list[tuple[str, str, float, int]]:
    """The runs of one trace: (label, mode, margin, min_idle_pods). Static over its floors;
    predictive over its margins without a floor, then the default margin and the tightest
    one over each floor (a floor the operator wants kept whatever the demand)."""
    runs = [(f"static {k}", "static", 0.0, k) for k in trace.min_idle_curve]
    runs += [(f"predictive {m}", "predictive", m, 0) for m in MARGINS]
    for k in trace.min_idle_curve[1:]:
        runs += [(f"predictive {m} +{k}", "predictive", m, k) for m in (DEFAULT_MARGIN, 0.001)]
    return runs


def _run(job: tuple[bool, int, int, int]) -> Result:
    quick, trace_index, point_index, seed = job
    trace = traces(quick)[trace_index]
    _, mode, margin, floor = points(trace)[point_index]
    return Simulation(trace, mode, margin=margin, min_idle=floor, seed=seed).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="shorter traces, fewer tenants")
    parser.add_argument("--only", default="", help="the traces whose name holds this")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"warm_pool_sim seed={args.seed} tick={TICK}s deploy 2-30 s, sessions median 60 s")
    head = f"{'policy':<22}{'cold waits':>11}{'p50 place':>11}{'p99 place':>11}"
    head += f"{'idle pod-s':>12}{'deploys':>9}"
    chosen = [(i, t) for i, t in enumerate(traces(args.quick)) if args.only in t.name]
    jobs = [(args.quick, i, n, args.seed) for i, t in chosen for n in range(len(points(t)))]
    # the runs are independent and deterministic: one process per core (fork: the traces'
    # rate functions are not pickled, each worker builds them again)
    with ProcessPoolExecutor(os.cpu_count(), mp_context=get_context("fork")) as pool:
        results = dict(zip(jobs, pool.map(_run, jobs), strict=True))
    verdicts = []
    for i, trace in chosen:
        print(
            f"\n== {trace.name} ({trace.duration:.0f} s after {trace.warmup:.0f} s, pod_ttl 300 s)"
        )
        print(head)
        rows = {
            label: results[(args.quick, i, n, args.seed)]
            for n, (label, *_) in enumerate(points(trace))
        }
        static = [(r.idle_seconds, r.cold_fraction) for k, r in rows.items() if "static" in k]
        predictive = [(r.idle_seconds, r.cold_fraction) for k, r in rows.items() if "pred" in k]
        for name, r in rows.items():
            print(
                f"{name:<22}{r.cold_fraction:>10.1%} {r.pct(0.5):>9.3f}s {r.pct(0.99):>9.2f}s"
                f"{r.idle_seconds:>12.0f}{r.deploys:>9}"
            )
        default = rows[f"predictive {DEFAULT_MARGIN}"]
        pricier = [
            (r.idle_seconds, name, r)
            for name, r in rows.items()
            if name.startswith("static") and r.idle_seconds >= default.idle_seconds
        ]
        if pricier:
            _, name, ref = min(pricier, key=lambda x: x[0])
            ratio = default.cold_fraction / ref.cold_fraction if ref.cold_fraction else math.inf
            cost = default.idle_seconds / ref.idle_seconds
            fifth = f"{ratio:.2f} of {name}'s cold waits at {cost:.2f} of its cost"
        else:
            fifth = "every static point is cheaper"
        curve = below(static, predictive)
        verdicts.append((trace.name, fifth, curve))
        print(f"predictive (margin {DEFAULT_MARGIN}): {fifth}; curve below static: {curve}")
    print("\n== summary")
    for name, fifth, curve in verdicts:
        print(f"{name:<38} {fifth}; curve below static at every point: {curve}")
    print(f"\n({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
