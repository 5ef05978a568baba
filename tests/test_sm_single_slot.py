"""Every session-manager script call touches one Redis Cluster hash slot (issue 17): the keys it
is given all hash to one slot (``redis.crc.key_slot``: the part between the first ``{`` and
the next ``}``). A flow through the state classes and the sweeper calls every script of
``session_manager/lua/`` and the shared ones the session manager uses; each call is recorded
as it is sent and judged. The last part: the same flow on the tests' Redis Cluster, where a
script whose keys span slots is refused (CROSSSLOT) and one deriving a key of another slot
fails: there the scope records' scripts (scope_put, scope_empty, scope_expire) run too.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from agent_runtime import lua
from agent_runtime.scope_buckets import BUCKETS, bucket_of
from agent_runtime.session_manager.demand_state import DemandState
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState
from agent_runtime.session_manager.sweeper import SessionSweeper

SM = "agent_runtime.session_manager"
# the shared scripts the session manager calls, under its labels (scope_buckets, seat_gate)
SHARED_LABELS = {"waiter_gate", *(f"{i}_{v}" for i in ("expiry_due", "leased_scopes") for v in (
    "due", "mark", "settle"))}  # fmt: skip

Call = tuple[str, list[str]]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Call]]:
    """Every call of a script the session manager registers from here on: (name, KEYS)."""
    recorded: list[Call] = []
    real = lua.register

    def register(redis: Redis, package: str, name: str, **options: Any) -> Any:
        script = real(redis, package, name, **options)
        label = options.get("label") or name
        if package != SM and label not in SHARED_LABELS:
            return script

        async def call(keys: Any = None, args: Any = None, client: Any = None) -> Any:
            recorded.append((label, [str(k) for k in keys or []]))
            return await script(keys=keys, args=args, client=client)

        return call

    monkeypatch.setattr(lua, "register", register)
    yield recorded


class Resources:
    """The resource side as the sweeper sees it: every scope may expire, notices are taken."""

    async def idle_consider(self, pod_id: str, scope_id: str) -> None:
        return None

    async def expire_scope(self, scope_id: str) -> bool:
        return True


POLICY = {"scope_concurrency": "2", "pod_concurrency": "1", "max_pods": "2", "session_ttl": "60"}


async def every_script(redis: Redis, sid: str, other: str, *, records: bool = True) -> None:
    """A flow that calls each session-manager script at least once: routes (placed, refresh,
    need_acquire), touch with and without the scope, a session moving scopes, evictions, pods
    registered / retired / cleaned, the sweeper's passes, the demand read and — with
    ``records`` — the scope records' scripts (else their keys are written by plain commands).
    Session and request ids carry ``sid`` (a cluster test's tag)."""
    state, scopes = SessionState(redis), ScopeState(redis)
    resources: Any = Resources()
    sweeper = SessionSweeper(state=state, scopes=scopes, resources=resources, scope_idle_ttl=0)
    for scope_id in (sid, other):
        if records:
            generation = await scopes.config_generation()
            await scopes.fill_scope_config(scope_id, f"g-{scope_id}", "bot", POLICY, generation)
            await scopes.apply_scope(scope_id, f"g-{scope_id}", "bot", None, generation, POLICY)
        else:
            await redis.hset(f"session_manager:scope:{{{scope_id}}}:config", mapping=POLICY)
            registry = f"session_manager:scope_registry:{{b{bucket_of(scope_id):02d}}}"
            await redis.hset(registry, scope_id, '["g", "bot"]')
    await state.register_pod(sid, "p1", "http://p1", "")
    await state.register_pod(other, "q1", "http://q1", "")

    async def route(session: str, scope_id: str, request: str) -> str:
        placement = await state.route_place(
            request_id=f"{sid}-{request}", session_id=f"{sid}-{session}", scope_id=scope_id,
            token="t",
        )  # fmt: skip
        await state.index_writes.flush()  # what the reply asked of other slots: done after it
        return placement.action.value

    assert await route("s1", sid, "r1") == "placed"
    assert await route("s1", sid, "r2") == "refresh"
    assert await route("s2", sid, "r3") == "need_acquire"  # p1 full, a second pod may come
    await state.renew_route(sid, f"{sid}-r3", "t")
    await state.release_route(sid, f"{sid}-r3", "t")
    assert await state.take_waiter_seat(sid, f"{sid}-r4", 3.0, 4)
    assert await route("s1", other, "r5") == "placed"  # moved: evicted from sid
    s1 = f"{sid}-s1"
    assert await state.touch(s1, eos=False) == (True, False)  # through the index
    assert await state.touch(s1, eos=True, request_id=f"{sid}-r6", scope_id=other) == (True, True)
    assert await route("s3", sid, "r7") == "placed"
    await state.evict(f"{sid}-s3", pod_died=True)
    await state.retire_pod(sid, "p1")
    await state.cleanup_pod(sid, "p1")
    await state.register_pod(sid, "p2", "http://p2", "")
    assert await route("s4", sid, "r8") == "placed"
    await redis.zadd(f"session_manager:scope:{{{sid}}}:session_expiry", {f"{sid}-s4": 1.0})
    await state.expiry_due.mark(sid, 1.0)
    assert await sweeper.expire_once() == 1
    await state.leased.mark(sid, 1.0)
    await sweeper.prune_once()
    await sweeper.safety_once()
    await sweeper.notify_idle_once()
    await sweeper.wait_for_notices()
    await state.pod_usage([(sid, "p2"), (other, "q1")])
    await DemandState(redis).scope_demand([sid, other])
    await state.cleanup_pod(sid, "p2")
    await state.cleanup_pod(other, "q1")
    if records:
        await sweeper.expire_scopes_once()


def sm_scripts() -> set[str]:
    folder = resources.files(SM) / "lua"
    return {p.name.removesuffix(".lua") for p in folder.iterdir() if p.name.endswith(".lua")}


def judge(calls: list[Call]) -> dict[str, set[int]]:
    """The slots each script's calls touched (one set per call merged by script)."""
    seen: dict[str, set[int]] = {}
    for name, keys in calls:
        slots = {key_slot(k.encode()) for k in keys}
        assert keys, f"{name}: a call with no keys (the cluster cannot route it)"
        assert len(slots) == 1, f"{name}: keys of {len(slots)} slots: {keys}"
        seen.setdefault(name, set()).update(slots)
    return seen


async def test_every_script_call_touches_one_slot(redis: Redis, calls: list[Call]) -> None:
    await every_script(redis, "scope-a", "scope-b")
    seen = judge(calls)
    expected = {n for n in sm_scripts() if not n.startswith("_")} | SHARED_LABELS
    assert set(seen) == expected, "every script was called"


@pytest.mark.real_backend
async def test_the_scripts_run_on_the_cluster(
    redis_cluster: Redis, cluster_tag: str, calls: list[Call]
) -> None:
    """The same flow on the tests' Redis Cluster (scope ids carry the test's tag, so its keys
    are found and deleted after it): every moved script runs, on whichever node holds its
    slot. The bucket indexes' entries name the test's scopes: taken out at the end."""
    sid, other = f"{cluster_tag}-a", f"{cluster_tag}-b"
    try:
        await every_script(redis_cluster, sid, other)
        seen = judge(calls)
        assert set(seen) == {n for n in sm_scripts() if not n.startswith("_")} | SHARED_LABELS
    finally:  # what names the test's scopes in keys of no scope (the fixture finds the rest)
        for index in ("expiry_due", "leased_scopes", "scope_idle"):
            for bucket in range(BUCKETS):
                await redis_cluster.zrem(f"session_manager:{index}:{{b{bucket:02d}}}", sid, other)
        for bucket in range(BUCKETS):
            await redis_cluster.hdel(
                f"session_manager:scope_registry:{{b{bucket:02d}}}", sid, other
            )
        for index in (f"group:g-{sid}", f"group:g-{other}", "bot:bot"):
            await redis_cluster.srem(f"session_manager:scope_index:{index}", sid, other)
