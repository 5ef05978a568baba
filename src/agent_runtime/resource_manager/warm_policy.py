"""How many warm pods a scope keeps: the template's ``warm_pool`` policy, a pure function.

``static`` (the default) is the fixed floor: ``min_idle_pods`` warm pods of the current
version, each one above it reclaimed once idle for ``pod_ttl``. ``predictive`` keeps enough
free capacity to absorb the new sessions expected during one deploy time: a pod asked for now
is Ready about one deploy time later, so what arrives meanwhile must find a free slot. The
arrivals of one deploy time are ``rate × deploy_time`` (the scope's measured arrival rate of
new sessions and a recent high percentile of its deploy times), taken at a Poisson upper
quantile (tail ``margin``: it covers the randomness, which matters most for small tenants
whose mean is well below one); the sessions that end meanwhile give slots back — in a steady
state as many end as arrive (Little's law), at most the live ones, taken at the lower
quantile. Routes already waiting (the queue and the reservations) need slots on top. What the
free slots (``pod_concurrency × (pods + deploys in flight) − live sessions``) do not cover is
deployed now, clamped by ``max_pods`` and the pod budgets' room, never below the static floor.

Scale-down follows the demand: the target rests on the slow arrival EWMA (a 300 s memory),
so after demand falls the target falls over minutes, not at once; a warm pod above the target
goes once idle for ``min(pod_ttl, deploy_time)`` — the break-even of keeping a pod nobody
needs is about what it costs to bring it back, one deploy time. (A static pool keeps every
pod above its floor for ``pod_ttl``: most of its idle pod-seconds are those pods.)

Everything here is pure (no I/O, no clock): autoscale and reclaim (``warm_targets.py``) and
the trace-driven simulation (``bench/warm_pool_sim.py``) drive the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from agent_runtime.resource_manager.session_side import ARRIVAL_FAST_WINDOW

WarmPool = Literal["static", "predictive"]
WARM_POOLS: tuple[WarmPool, ...] = ("static", "predictive")

# How far the fast EWMA must stand above the slow one before it is believed, in standard
# deviations of its own noise (a Poisson EWMA of rate r and window w: sd = sqrt(r / 2w)):
# one arrival of a small tenant lifts the fast EWMA by 1/w, which is noise, not a crowd.
FAST_BELIEF_SD = 2.0
DEFAULT_MARGIN = 0.05  # the predictive target's tail: P(more arrivals than slots) per deploy
DEPLOY_TIME_PERCENTILE = 0.9
DEFAULT_DEPLOY_TIME = 10.0  # seconds, for a scope with no measured deploy yet
_NORMAL_ABOVE = 100.0  # Poisson means above this use the normal approximation
# arrivals per deploy time below which a scope is quiet and keeps no warm slot of its own
# (a 300 s EWMA of one arrival read 20 minutes later, deploys of 10 s: 0.0006)
QUIET_MEAN = 0.01


@dataclass(frozen=True, slots=True)
class WarmInputs:
    """What the policy looks at for one scope (counts of the current version's pods)."""

    pod_concurrency: int
    pods: int  # registered pods of the scope, in use and warm
    idle_pods: int  # of them, warm (current version)
    sessions: int  # live sessions of the scope
    in_flight: int  # deploys on their way (warm and cold placeholders)
    warm_in_flight: int  # of them, the warm pool's own
    queued: int  # routes waiting for a slot: queue seats + reservations
    min_idle_pods: int
    max_pods: int
    budget_room: int | None = None  # pods the pod budgets still allow (None: unbounded)
    rate: float = 0.0  # new sessions per second (arrival_rate)
    # sessions ending per second: in a steady state as many end as arrive (Little's law), so
    # the slow arrival EWMA; bounded by the live sessions that can end at all
    departure_rate: float = 0.0
    deploy_time: float = DEFAULT_DEPLOY_TIME  # a recent high percentile, seconds
    pod_ttl: float = 300.0  # the template's: how long a warm pod above the floor is kept


@dataclass(frozen=True, slots=True)
class WarmPlan:
    """The policy's answer: warm pods to keep (reclaim's floor) and pods to deploy now."""

    keep_idle: int
    deploy: int
    reclaim_after: float  # seconds a warm pod above keep_idle stays before it is reclaimed
    need_slots: int = 0  # predictive: free slots wanted (0 for static)


def plan(mode: str, inputs: WarmInputs, *, margin: float = DEFAULT_MARGIN) -> WarmPlan:
    """The plan of ``mode`` (an unknown one is static: a row written by a newer version)."""
    if mode == "predictive":
        return predictive_plan(inputs, margin=margin)
    return static_plan(inputs)


def static_plan(inputs: WarmInputs) -> WarmPlan:
    """Today's floor: min_idle_pods warm pods, the warm pool's deploys in flight counted."""
    short = inputs.min_idle_pods - inputs.idle_pods - inputs.warm_in_flight
    return WarmPlan(
        keep_idle=inputs.min_idle_pods,
        deploy=_room_clamped(inputs, short),
        reclaim_after=inputs.pod_ttl,
    )


def predictive_plan(inputs: WarmInputs, *, margin: float = DEFAULT_MARGIN) -> WarmPlan:
    """Free slots for the arrivals of one deploy time (upper quantile) plus the routes
    waiting; what is missing deployed now; never less than the static floor."""
    pc = max(inputs.pod_concurrency, 1)
    deploy_time = max(inputs.deploy_time, 0.0)
    expected = max(inputs.rate, 0.0) * deploy_time
    # slots the sessions that end meanwhile give back, as many as can be counted on (the
    # lower quantile): none where no session lives, about the arrivals in a steady state
    leaving = min(max(inputs.departure_rate, 0.0) * deploy_time, max(inputs.sessions, 0))
    returned = poisson_lower(leaving, margin)
    need_slots = max(base_stock(expected, margin) - returned, 0) + max(inputs.queued, 0)
    free_slots = max(pc * (inputs.pods + inputs.in_flight) - inputs.sessions, 0)
    deploy = math.ceil(max(need_slots - free_slots, 0) / pc)
    # the warm pods that the need asks for beyond the free slots of the pods in use
    in_use_free = max(pc * (inputs.pods - inputs.idle_pods) - inputs.sessions, 0)
    keep_idle = math.ceil(max(need_slots - in_use_free, 0) / pc)
    floor = inputs.min_idle_pods - inputs.idle_pods - inputs.warm_in_flight
    return WarmPlan(
        keep_idle=max(keep_idle, inputs.min_idle_pods),
        deploy=_room_clamped(inputs, max(deploy, floor)),
        # the break-even of keeping a pod nobody needs: as long as one takes to bring back
        reclaim_after=min(inputs.pod_ttl, max(deploy_time, 0.0)),
        need_slots=need_slots,
    )


def _room_clamped(inputs: WarmInputs, wanted: int) -> int:
    room = inputs.max_pods - inputs.pods - inputs.in_flight
    if inputs.budget_room is not None:
        room = min(room, inputs.budget_room)
    return max(min(wanted, room), 0)


def reclaimable(
    keep_idle: int, idle_since: Mapping[str, float], now: float, after: float
) -> list[str]:
    """Warm pods above ``keep_idle`` idle for ``after`` seconds or more (the plan's
    ``reclaim_after``). The floor keeps the
    longest-idle ones (acquire hands out the most recently idle, so those stay warm)."""
    by_age = sorted((since, pod) for pod, since in idle_since.items())
    return [pod for since, pod in by_age[max(keep_idle, 0) :] if now - since >= after]


# --- the measurements, as the policy reads them ------------------------------------------------


def arrival_rate(fast: float, slow: float, fast_window: float = ARRIVAL_FAST_WINDOW) -> float:
    """The rate to plan for: the slow EWMA, or the fast one where it stands clearly above
    (FAST_BELIEF_SD of its own noise): a crowd is seen within seconds, a single arrival of a
    small tenant is not taken for one, and the rate falls at the slow EWMA's pace."""
    fast, slow = max(fast, 0.0), max(slow, 0.0)
    believed_fast = fast - FAST_BELIEF_SD * math.sqrt(fast / (2.0 * fast_window))
    return max(slow, believed_fast)


def decayed(value: float, at: float, now: float, window: float) -> float:
    """An EWMA rate read at ``now`` that was last updated at ``at``."""
    return value * math.exp(-max(now - at, 0.0) / window)


def counted_arrival(
    value: float, at: float, now: float, window: float
) -> float:  # mirrors route_place.lua
    """An EWMA rate after one arrival at ``now``: the decayed rate plus 1/window."""
    return decayed(value, at, now, window) + 1.0 / window


def deploy_time_of(samples: Sequence[float], percentile: float = DEPLOY_TIME_PERCENTILE) -> float:
    """A high percentile (nearest rank) of recent deploy times; DEFAULT_DEPLOY_TIME for none."""
    values = sorted(s for s in samples if s >= 0 and math.isfinite(s))
    if not values:
        return DEFAULT_DEPLOY_TIME
    rank = max(math.ceil(percentile * len(values)) - 1, 0)
    return values[min(rank, len(values) - 1)]


def base_stock(mean: float, margin: float) -> int:
    """Slots to hold, free or on their way, for arrivals of Poisson ``mean`` per deploy
    time: a pod asked for when one is taken is Ready one deploy time later, so an arrival
    finds a free slot exactly when fewer than S arrived in the deploy time before it (the
    base-stock rule): S = the upper quantile + 1. A scope whose mean fell below
    QUIET_MEAN (no arrival for a long while) holds none."""
    if mean < QUIET_MEAN:
        return 0
    return poisson_upper(mean, margin) + 1


def poisson_lower(mean: float, margin: float) -> int:
    """The largest k with P(N ≥ k) ≥ 1 − margin for N ~ Poisson(mean): what can be counted
    on; 0 for a small mean."""
    if mean <= 0.0:
        return 0
    margin = min(max(margin, 1e-9), 0.5)
    if mean > _NORMAL_ABOVE:
        z = NormalDist().inv_cdf(1.0 - margin)
        return max(math.floor(mean - z * math.sqrt(mean)), 0)
    term = math.exp(-mean)
    cdf, k = term, 0  # P(N <= k)
    while cdf <= margin:  # P(N >= k + 1) = 1 - cdf >= 1 - margin
        k += 1
        term *= mean / k
        cdf += term
    return k


def poisson_upper(mean: float, margin: float) -> int:
    """The smallest k with P(N ≤ k) ≥ 1 − margin for N ~ Poisson(mean); 0 for a mean of 0.
    Above a mean of 100 the normal approximation (bounded work for any rate)."""
    if mean <= 0.0:
        return 0
    margin = min(max(margin, 1e-9), 0.5)
    if mean > _NORMAL_ABOVE:
        z = NormalDist().inv_cdf(1.0 - margin)
        return math.ceil(mean + z * math.sqrt(mean))
    term = math.exp(-mean)
    cdf, k = term, 0
    while cdf < 1.0 - margin:
        k += 1
        term *= mean / k
        cdf += term
    return k
