"""The service's Redis state checked against its invariants (docs/reference/redis-keys.md), as a
typed report rather than an assertion, so that a fault test can tell what must hold from what
a fault lost, and a bench can count it.

Every key is named through ``contract_keys`` (never spelled here): a renamed key in the
contract flows through. What is checked, per scope:

- caps: the scope's live sessions ≤ its ``scope_concurrency``, each pod's ≤ its
  ``pod_concurrency`` (both read from the scope's cached config, ``sm_scope(sid, "config")``,
  unless the caller gives them);
- the four places: a live session is in its hash, its scope's ``session_expiry``, its scope's
  sessions set and its pod's sessions set — and the reverse, every member of those sets has a hash
  that names that scope (and pod); a session bound to a pod that is not registered;
- what a finished load must not leave behind: queue seats, reservations, follower seats,
  deploy placeholders, deploy locks and pending route markers (their leases lapse within
  seconds and a prune takes the expired members: ``settle`` waits, bounded, for that).

``check`` is a snapshot taken command by command, not in one transaction: run it when the load
has ended. ``check_caps`` reads each count with one command, so it holds at any moment (every
change is one script) and may sample a running load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from redis.asyncio import Redis

from contract_keys import (
    rm_deploy_lock,
    rm_pod,
    rm_pod_scope,
    rm_pods_known,
    rm_scope,
    route_marker,
    sm_expiry,
    sm_pod,
    sm_pods_registered,
    sm_scope,
    sm_session,
)

FOLLOWERS = "deploy_followers:"  # rm_scope(sid, FOLLOWERS + deploy_id): one cold deploy's room


@dataclass(frozen=True)
class Caps:
    scope_concurrency: int
    pod_concurrency: int


@dataclass(frozen=True)
class OverCap:
    """A scope (``pod_id`` empty) or a pod holding more sessions than its cap."""

    scope_id: str
    pod_id: str
    sessions: int
    cap: int


@dataclass(frozen=True)
class Misplaced:
    """A session hash missing from some of its places (``missing``: ``session_expiry``,
    ``scope_sessions``, ``pod_sessions``, ``pod_registered``), or a set member without a
    matching hash (``missing`` = ``("hash",)``; ``where`` names the set)."""

    session_id: str
    scope_id: str
    pod_id: str
    missing: tuple[str, ...]
    where: str = ""


@dataclass(frozen=True)
class Leftover:
    """Something a load holds while it works: ``kind`` is ``waiter``, ``reservation``,
    ``follower``, ``placeholder``, ``deploy_lock`` or ``pending_route``; ``lapses_in``: seconds
    until its lease runs out (Redis clock; ≤ 0 once it has, None when the key has no lease)."""

    kind: str
    scope_id: str
    member: str
    lapses_in: float | None


@dataclass
class StateReport:
    sessions: int = 0  # session hashes seen
    live: dict[str, set[str]] = field(default_factory=dict)  # scope -> its session set
    bindings: dict[str, tuple[str, str]] = field(default_factory=dict)  # session -> (scope, pod)
    registered_pods: dict[str, set[str]] = field(default_factory=dict)  # scope -> pods
    caps: dict[str, Caps] = field(default_factory=dict)
    scopes_over_cap: list[OverCap] = field(default_factory=list)
    pods_over_cap: list[OverCap] = field(default_factory=list)
    misplaced: list[Misplaced] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    unknown_caps: list[str] = field(default_factory=list)  # scopes whose caps were not found
    # (scope, pod, what is missing): a pod of the resource manager's scope pool without its
    # info under the scope's tag, or that the pod index does not name with the scope
    unindexed: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def over_cap(self) -> list[OverCap]:
        return self.scopes_over_cap + self.pods_over_cap

    @property
    def consistent(self) -> bool:
        """Caps hold, every session is in all its places (leftovers aside), and every pod of
        a resource-manager pool has its info and its pod index entry."""
        return not (self.over_cap or self.misplaced or self.unindexed)

    def live_leftovers(self) -> list[Leftover]:
        """Leftovers whose lease still runs: something still renews them."""
        return [x for x in self.leftovers if x.lapses_in is None or x.lapses_in > 0]

    def problems(self) -> list[str]:
        out = [f"over cap: {x}" for x in self.over_cap]
        out += [f"misplaced: {x}" for x in self.misplaced]
        out += [f"leftover: {x}" for x in self.leftovers]
        out += [f"caps unknown for scope {sid}" for sid in self.unknown_caps]
        out += [f"resource pod {pod} of {sid}: no {what}" for sid, pod, what in self.unindexed]
        return out


async def redis_now(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return float(seconds) + float(micros) / 1e6


async def scope_caps(redis: Redis, scope_id: str) -> Caps | None:
    """The caps of the scope's cached config (``sm_scope(sid, "config")``), None if not cached."""
    fields = await redis.hmget(sm_scope(scope_id, "config"), "scope_concurrency", "pod_concurrency")
    if fields[0] is None or fields[1] is None:
        return None
    return Caps(int(fields[0]), int(fields[1]))


async def scope_pods(redis: Redis, scope_id: str) -> set[str]:
    """Every pod the state names for the scope: the SM candidates, the RM's pods and the
    scope's registered pods."""
    pods = set(await redis.zrange(sm_scope(scope_id, "pods"), 0, -1))
    pods |= set(await redis.zrange(rm_scope(scope_id, "pods"), 0, -1))
    pods |= set(await redis.smembers(sm_pods_registered(scope_id)))
    return pods


async def check_caps(
    redis: Redis, scopes: Iterable[str], caps: Mapping[str, Caps] | None = None
) -> list[OverCap]:
    """The scopes and pods over their caps now (each count is one command: valid mid-load)."""
    over: list[OverCap] = []
    for sid in scopes:
        cap = (caps or {}).get(sid) or await scope_caps(redis, sid)
        if cap is None:
            continue
        n = await redis.scard(sm_scope(sid, "sessions"))
        if n > cap.scope_concurrency:
            over.append(OverCap(sid, "", n, cap.scope_concurrency))
        for pod in sorted(await scope_pods(redis, sid)):
            n = await redis.scard(sm_pod(sid, pod, "sessions"))
            if n > cap.pod_concurrency:
                over.append(OverCap(sid, pod, n, cap.pod_concurrency))
    return over


async def _scan(redis: Redis, pattern: str) -> list[str]:
    return sorted({k async for k in redis.scan_iter(match=pattern, count=1000)})


async def check(
    redis: Redis, scopes: Iterable[str] = (), caps: Mapping[str, Caps] | None = None
) -> StateReport:
    """The whole report for the given scopes and every scope a session hash names."""
    report = StateReport()
    now = await redis_now(redis)
    hashes: dict[tuple[str, str], dict[str, str]] = {}  # (scope in the key, session) -> hash
    head = sm_session("", "")[: -len("{}:")]  # "session_manager:session:"
    for key in await _scan(redis, sm_session("*", "*")):
        tag, _, session_id = key[len(head) :].partition("}:")
        fields = await redis.hgetall(key)
        if fields:
            hashes[(tag.removeprefix("{"), session_id)] = fields
    report.sessions = len(hashes)
    all_scopes = list(dict.fromkeys([*scopes, *(sid for sid, _ in hashes)]))

    for sid in [s for s in all_scopes if s]:
        expiry = set(await redis.zrange(sm_expiry(sid), 0, -1))
        cap = (caps or {}).get(sid) or await scope_caps(redis, sid)
        if cap is None:
            report.unknown_caps.append(sid)
        else:
            report.caps[sid] = cap
        members = set(await redis.smembers(sm_scope(sid, "sessions")))
        report.live[sid] = members
        pods = await scope_pods(redis, sid)
        report.registered_pods[sid] = {
            pod for pod in pods if await redis.exists(sm_pod(sid, pod, "info"))
        }
        if cap is not None and len(members) > cap.scope_concurrency:
            report.scopes_over_cap.append(OverCap(sid, "", len(members), cap.scope_concurrency))
        bound_here = {s: h for (k, s), h in hashes.items() if k == sid}
        for session_id, h in sorted(bound_here.items()):
            if h.get("scope_id") != sid:  # a hash under one scope's tag naming another
                report.misplaced.append(
                    Misplaced(
                        session_id,
                        sid,
                        h.get("pod_id", ""),
                        ("scope",),
                        sm_session(sid, session_id),
                    )
                )
        pods |= {h.get("pod_id", "") for h in bound_here.values()} - {""}
        on_pods: dict[str, set[str]] = {}
        for pod in sorted(pods):
            on_pods[pod] = set(await redis.smembers(sm_pod(sid, pod, "sessions")))
            n = len(on_pods[pod])
            if cap is not None and n > cap.pod_concurrency:
                report.pods_over_cap.append(OverCap(sid, pod, n, cap.pod_concurrency))
        # forward: each hash in all four places
        for session_id, h in sorted(bound_here.items()):
            pod = h.get("pod_id", "")
            report.bindings[session_id] = (sid, pod)
            missing = []
            if session_id not in expiry:
                missing.append("session_expiry")
            if session_id not in members:
                missing.append("scope_sessions")
            if session_id not in on_pods.get(pod, set()):
                missing.append("pod_sessions")
            if pod not in report.registered_pods[sid]:
                missing.append("pod_registered")
            if missing:
                report.misplaced.append(Misplaced(session_id, sid, pod, tuple(missing)))
        # reverse: each set member has a hash naming this scope (and pod)
        for session_id in sorted(members - set(bound_here)):
            report.misplaced.append(
                Misplaced(session_id, sid, "", ("hash",), where=sm_scope(sid, "sessions"))
            )
        for pod, on_pod in sorted(on_pods.items()):
            for session_id in sorted(on_pod):
                if bound_here.get(session_id, {}).get("pod_id") != pod:
                    where = sm_pod(sid, pod, "sessions")
                    report.misplaced.append(Misplaced(session_id, sid, pod, ("hash",), where))
        report.leftovers += await _leftovers(redis, sid, now)
        report.leftovers += await _pending_routes(redis, sid)
        report.unindexed += await _unindexed(redis, sid)
        for session_id in sorted(expiry - set(bound_here)):
            report.misplaced.append(Misplaced(session_id, sid, "", ("hash",), sm_expiry(sid)))
    return report


async def _leftovers(redis: Redis, sid: str, now: float) -> list[Leftover]:
    out: list[Leftover] = []
    for kind, key in (
        ("waiter", sm_scope(sid, "waiters")),
        ("reservation", sm_scope(sid, "reserved")),
    ):
        for member, deadline in await redis.zrange(key, 0, -1, withscores=True):
            out.append(Leftover(kind, sid, member, float(deadline) - now))
    for room in await _scan(redis, rm_scope(sid, FOLLOWERS + "*")):
        for member, deadline in await redis.zrange(room, 0, -1, withscores=True):
            out.append(Leftover("follower", sid, member, float(deadline) - now))
    for member in sorted(await redis.smembers(rm_scope(sid, "deploying"))):
        _, _, deadline = member.rpartition("@")
        lapses = float(deadline) - now if _is_number(deadline) else None
        out.append(Leftover("placeholder", sid, member, lapses))
    for key in await _scan(redis, rm_deploy_lock(sid, "*")):
        ttl_ms = await redis.pttl(key)
        if ttl_ms != -2:  # gone meanwhile
            out.append(Leftover("deploy_lock", sid, key, ttl_ms / 1000 if ttl_ms >= 0 else None))
    return out


async def _pending_routes(redis: Redis, sid: str) -> list[Leftover]:
    """The scope's routes still marked running (the replay cache is the scope's)."""
    out: list[Leftover] = []
    prefix = route_marker(sid, "")
    for key in await _scan(redis, route_marker(sid, "*")):
        value = await redis.get(key)
        if value is not None and value.startswith("pending:"):
            ttl_ms = await redis.pttl(key)
            lapses = ttl_ms / 1000 if ttl_ms >= 0 else None
            out.append(Leftover("pending_route", sid, key[len(prefix) :], lapses))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


async def _unindexed(redis: Redis, sid: str) -> list[tuple[str, str, str]]:
    """Each pod of the scope's resource pool has its info under the scope's tag and is named
    with the scope by the pod index (registration writes the index first, purge drops it last)."""
    out = []
    for pod in sorted(await redis.zrange(rm_scope(sid, "pods"), 0, -1)):
        if not await redis.exists(rm_pod(sid, pod, "info")):
            out.append((sid, pod, "info"))
        if await rm_pod_scope(redis, pod) != sid:
            out.append((sid, pod, "pod index entry"))
    return out


async def registered_pod_ids(redis: Redis) -> set[str]:
    """Every pod id the resource manager knows (the pod index)."""
    return set(await rm_pods_known(redis))


async def settle(
    redis: Redis,
    scopes: Iterable[str] = (),
    *,
    within: float = 30.0,
    tick: Callable[[], Awaitable[object]] | None = None,
    caps: Mapping[str, Caps] | None = None,
) -> StateReport:
    """The report once nothing is held any more (no leftover at all), or the last one taken
    when ``within`` seconds ran out (the caller judges it). ``tick`` runs before each look,
    e.g. the prune jobs that take expired seats and placeholders out."""
    scopes = list(scopes)
    deadline = time.monotonic() + within
    while True:
        if tick is not None:
            await tick()
        report = await check(redis, scopes, caps)
        if not report.leftovers or time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.2)
