"""The resource manager's six Lua scripts, through ``ResourceState``, on fakeredis and real Redis.

Each script alone (every branch, limits at the edge, replay = the same EVALSHA sent twice),
real concurrency on the gates (acquire, follower room), and a Hypothesis state machine over
acquire/placeholder/register/release/purge that checks the pool invariants after every step.
Assertions read the Redis keys by their contract names (§4), not only the return values.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.models import AcquiredPod
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import POD_PREFIX, ResourceState
from agent_runtime.resource_manager.state_values import AcquireOutcome, BudgetRepair
from agent_runtime.resource_manager.views import ResourceViews
from contract_keys import rm_pod_known, rm_pod_scope, rm_pods_known
from helpers import other_client, run_redis_state_machine

# every script it drives is of one slot: the single server, the Sentinel set and the cluster
pytestmark = pytest.mark.topologies

T = TypeVar("T")
TTL = 600  # placeholder lifetime: no placeholder expires during a test unless made so on purpose
HOLD = 120  # follower seat lifetime


class K:
    """Contract §4 key names (resource_manager part), spelled out here on purpose."""

    @staticmethod
    def config(sid: str) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:config"

    @staticmethod
    def pods(sid: str) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:pods"

    @staticmethod
    def idle(sid: str) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:idle"

    @staticmethod
    def deploying(sid: str) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:deploying"

    @staticmethod
    def followers(sid: str) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:deploy_followers"

    @staticmethod
    def info(sid: str, pod: str) -> str:
        return f"resource_manager:resource:pod:{{{sid}}}:{pod}:info"

    @staticmethod
    def idle_since(sid: str, pod: str) -> str:
        return f"resource_manager:resource:pod:{{{sid}}}:{pod}:idle_since"

    @staticmethod
    def health_fails(sid: str, pod: str) -> str:
        return f"resource_manager:resource:pod:{{{sid}}}:{pod}:health_fails"

    BUDGET = "resource_manager:budget:{budget}:pods"
    BUDGET_RULES = "resource_manager:budget:{budget}:rules"
    BUDGET_LIMITS = "resource_manager:budget:{budget}:rule_limits"
    BUDGET_LINKS = "resource_manager:budget:{budget}:links"

    @staticmethod
    def scope_units(sid: str) -> str:
        return f"resource_manager:budget:{{budget}}:scope:{sid}:units"

    @staticmethod
    def rule_budget(rule_id: str) -> str:
        return f"resource_manager:budget:{{budget}}:rule:{rule_id}:pods"

    @staticmethod
    def idem(sid: str, request_id: str) -> str:
        return f"resource_manager:idem:{{{sid}}}:{request_id}"


# --- helpers -----------------------------------------------------------------------------------


def sse(pod: str) -> str:
    return f"http://10.0.0.1:8080/sse/{pod}"


async def rnow(redis: Redis) -> int:
    seconds, _ = await redis.time()
    return int(seconds)


async def configure(rs: ResourceState, sid: str, *, max_pods: int = 3, ver: str = "v1") -> None:
    pool = {"min_idle_pods": 0, "max_pods": max_pods, "pod_ttl": 300, "pod_concurrency": 4}
    await rs.write_pool_config(sid, pool, deploy_ver=ver, pod_spec={"image": f"img:{ver}"})


async def add_pod(
    rs: ResourceState, sid: str, pod: str, *, ver: str = "v1", warm: bool = False
) -> None:
    """The normal path: a placeholder, then register with it."""
    member = await DeployState(rs).add_placeholder(sid, f"tok-{pod}", TTL)
    assert member is not None, "test setup: the scope is at max_pods"
    held = await register(rs, sid, pod, member, ver=ver, warm=warm)
    assert held


async def register(
    rs: ResourceState,
    sid: str,
    pod: str,
    placeholder: str | None,
    *,
    ver: str = "v1",
    warm: bool = False,
) -> bool:
    return await rs.register(
        scope_id=sid,
        pod_id=pod,
        placeholder=placeholder,
        pod_sse_url=sse(pod),
        pod_ip="10.0.0.1",
        namespace="agents",
        deploy_ver=ver,
        warm=warm,
    )


async def smembers(redis: Redis, key: str) -> set[str]:
    return set(await redis.smembers(key))  # type: ignore[misc]


async def zmembers(redis: Redis, key: str) -> set[str]:
    return set(await redis.zrange(key, 0, -1))


async def pod_keys(redis: Redis, pod: str) -> set[str]:
    return {k async for k in redis.scan_iter(match=f"resource_manager:*{pod}*")}


async def same_second(redis: Redis, action: Callable[[int], Awaitable[T]]) -> tuple[int, T]:
    """Run ``action(now)`` so that the script's TIME is exactly ``now`` (retry across a tick)."""
    for _ in range(20):
        before = await rnow(redis)
        result = await action(before)
        if await rnow(redis) == before:
            return before, result
    raise AssertionError("the Redis clock ticked on every try")


@asynccontextmanager
async def second_client(redis: Redis) -> AsyncIterator[Redis]:
    """Another client on the same server (another replica): its own connections."""
    client = other_client(redis)
    try:
        yield client
    finally:
        await client.aclose()


def acquire_call(sid: str, request_id: str, token: str) -> dict[str, Any]:
    """The exact EVALSHA keys/args ``ResourceState.acquire`` sends."""
    keys = [K.config(sid), K.idle(sid), K.pods(sid), K.deploying(sid), K.idem(sid, request_id)]
    args = [POD_PREFIX, token, 60, sid, ""]
    return {"keys": keys, "args": args}


# --- acquire -----------------------------------------------------------------------------------


async def test_acquire_without_config_is_no_config_and_writes_nothing(
    rs: ResourceState, redis: Redis
) -> None:
    out = await rs.acquire("s1", "r1", "t1", TTL)
    assert out == AcquireOutcome("no_config")
    assert not await redis.exists(K.deploying("s1"), K.idem("s1", "r1"), K.config("s1"))


async def test_acquire_reuses_only_a_warm_pod_of_the_current_version(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=4, ver="v1")
    await add_pod(rs, "s1", "old", ver="v1", warm=True)
    await configure(rs, "s1", max_pods=4, ver="v2")  # a new pod spec: "old" is out of date
    await add_pod(rs, "s1", "new", ver="v2", warm=True)

    first = await rs.acquire("s1", "r1", "t1", TTL)
    assert first == AcquireOutcome("reuse", "new", sse("new"), "v2")
    second = await rs.acquire("s1", "r2", "t2", TTL)
    assert second.action == "need_deploy"  # never the old-version pod

    assert await smembers(redis, K.idle("s1")) == {"old"}  # stays in the pool (for reclaim)
    assert await redis.exists(K.idle_since("s1", "old"))
    assert await redis.hget(K.info("s1", "old"), "phase") == "idle"
    assert await zmembers(redis, K.pods("s1")) == {"old", "new"}


async def test_acquire_reuse_pops_the_pod_and_caches_the_result(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1")
    await add_pod(rs, "s1", "p1", warm=True)
    await add_pod(rs, "s1", "p2", warm=True)
    await redis.set(K.idle_since("s1", "p1"), 100)
    await redis.set(K.idle_since("s1", "p2"), 50)  # p1 is the most recently idle

    out = await rs.acquire("s1", "r1", "t1", TTL)
    ver = await redis.hget(K.info("s1", "p1"), "deploy_ver")
    assert out == AcquireOutcome("reuse", "p1", sse("p1"), ver)
    assert await smembers(redis, K.idle("s1")) == {"p2"}
    assert not await redis.exists(K.idle_since("s1", "p1"))
    assert await redis.hget(K.info("s1", "p1"), "phase") == "in_use"
    assert "p1" in await zmembers(redis, K.pods("s1"))  # still one of the scope's pods
    assert json.loads(await redis.get(K.idem("s1", "r1"))) == {
        "pod_id": "p1",
        "pod_sse_url": sse("p1"),
        "deploy_ver": ver,
        "scope_id": "s1",  # the binding: replayed for this scope only
    }
    assert 0 < await redis.ttl(K.idem("s1", "r1")) <= 60

    again = await rs.acquire("s1", "r1", "t1-retry", TTL)  # same request id
    assert again == AcquireOutcome("cached", "p1", sse("p1"), ver)
    assert await smembers(redis, K.idle("s1")) == {"p2"}  # p2 not taken by the replay
    assert not await redis.exists(K.deploying("s1"))


async def test_acquire_result_replays_only_for_its_own_scope(
    rs: ResourceState, redis: Redis
) -> None:
    """idem:{sid}:{request_id} is the scope's: the same id from another scope (another tenant)
    is another request's — it gets a pod of its own scope, never the first scope's — and the
    first scope's answer still replays."""
    await configure(rs, "s1")
    await configure(rs, "s2")
    await add_pod(rs, "s1", "p1", warm=True)
    await add_pod(rs, "s2", "q1", warm=True)
    first = await rs.acquire("s1", "r1", "t1", TTL)
    assert first.action == "reuse" and first.pod_id == "p1"
    stored = await redis.get(K.idem("s1", "r1"))
    assert await rs.cached_result("s2", "r1") is None
    other = await rs.acquire("s2", "r1", "t2", TTL)
    assert other.action == "reuse" and other.pod_id == "q1"
    assert json.loads(await redis.get(K.idem("s2", "r1")))["pod_id"] == "q1"
    assert await redis.get(K.idem("s1", "r1")) == stored, "the first answer stays the first's"
    again = await rs.acquire("s1", "r1", "t1-retry", TTL)
    assert again == AcquireOutcome("cached", "p1", sse("p1"), first.deploy_ver)
    assert await rs.cached_result("s1", "r1") == AcquiredPod(
        pod_id="p1",
        pod_sse_url=sse("p1"),
        deploy_ver=first.deploy_ver or "",
    )


async def test_acquire_reuse_replayed_evalsha_is_cached(rs: ResourceState, redis: Redis) -> None:
    await configure(rs, "s1")
    await add_pod(rs, "s1", "p1", warm=True)
    await add_pod(rs, "s1", "p2", warm=True)
    call = acquire_call("s1", "r1", "t1")
    first = await rs._acquire(**call)
    second = await rs._acquire(**call)
    assert first[0] == "reuse"
    assert second[0] == "cached"
    assert json.loads(second[1]) == {
        "pod_id": first[1],
        "pod_sse_url": first[2],
        "deploy_ver": first[3],
        "scope_id": "s1",
    }
    assert len(await smembers(redis, K.idle("s1"))) == 1  # one pod left the pool, not two


async def test_acquire_hands_out_the_most_recently_idle_pod_first(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=3)
    for pod in ("a", "b", "c"):
        await add_pod(rs, "s1", pod, warm=True)
    for pod, since in (("a", 200), ("b", 300), ("c", 100)):
        await redis.set(K.idle_since("s1", pod), since)
    got = [(await rs.acquire("s1", f"r{i}", f"t{i}", TTL)).pod_id for i in range(3)]
    assert got == ["b", "a", "c"]
    assert not await redis.exists(K.idle("s1"))


async def test_acquire_max_reached_counts_pods_and_placeholders(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=3)
    await add_pod(rs, "s1", "p1")  # in use
    assert await ds.add_placeholder("s1", "other", TTL) is not None
    third = await rs.acquire("s1", "r1", "t1", TTL)
    assert third.action == "need_deploy"  # 1 pod + 1 placeholder + this one = 3 = max_pods
    assert await redis.zcard(K.pods("s1")) + await redis.scard(K.deploying("s1")) == 3

    full = await rs.acquire("s1", "r2", "t2", TTL)
    assert full == AcquireOutcome("max_reached")
    assert await redis.scard(K.deploying("s1")) == 2
    assert not any(m.startswith("t2@") for m in await smembers(redis, K.deploying("s1")))
    assert not await redis.exists(K.idem("s1", "r2"))

    # an old-version warm pod counts too (it is one of the scope's pods until reclaimed)
    await configure(rs, "s2", max_pods=1, ver="v1")
    await add_pod(rs, "s2", "q1", ver="v1", warm=True)
    await configure(rs, "s2", max_pods=1, ver="v2")
    assert (await rs.acquire("s2", "r3", "t3", TTL)).action == "max_reached"

    # max_pods 0: nothing ever
    await configure(rs, "s3", max_pods=0)
    assert (await rs.acquire("s3", "r4", "t4", TTL)).action == "max_reached"
    assert not await redis.exists(K.deploying("s3"))


async def test_acquire_need_deploy_adds_exactly_one_placeholder_and_replay_keeps_it(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=3)
    before = await rnow(redis)
    out = await rs.acquire("s1", "r1", "t1", TTL)
    after = await rnow(redis)
    assert out.action == "need_deploy"
    assert out.placeholder is not None
    token, deadline = out.placeholder.rsplit("@", 1)
    assert token == "t1"
    assert before + TTL <= int(deadline) <= after + TTL
    assert await smembers(redis, K.deploying("s1")) == {out.placeholder}

    again = await rs.acquire("s1", "r1", "t1", TTL)  # the same call re-sent
    assert again == out
    raw = acquire_call("s1", "r1", "t1")
    assert await rs._acquire(**raw) == ["cold"]  # the script itself: the claim finds it
    assert await smembers(redis, K.deploying("s1")) == {out.placeholder}
    assert not await redis.exists(K.idem("s1", "r1"))  # only a handed-out pod is cached


async def test_acquire_replay_at_the_cap_still_returns_its_placeholder(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    out = await rs.acquire("s1", "r1", "t1", TTL)
    assert out.action == "need_deploy"
    assert await rs.acquire("s1", "r1", "t1", TTL) == out  # not max_reached: it is ours
    assert (await rs.acquire("s1", "r2", "t2", TTL)).action == "max_reached"


async def test_acquire_drops_expired_placeholders_which_stop_counting(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=2)
    now = await rnow(redis)
    await redis.sadd(K.deploying("s1"), f"crashed@{now - 5}", f"also@{now - 1}", "garbage")
    first = await rs.acquire("s1", "r1", "t1", TTL)
    assert first.action == "need_deploy"
    assert await smembers(redis, K.deploying("s1")) == {first.placeholder}
    second = await rs.acquire("s1", "r2", "t2", TTL)
    assert second.action == "need_deploy"
    assert (await rs.acquire("s1", "r3", "t3", TTL)).action == "max_reached"


async def test_placeholder_deadline_is_inclusive(rs: ResourceState, redis: Redis) -> None:
    """A placeholder expires after its deadline second, not at it (both engines alike)."""
    await configure(rs, "s1", max_pods=5)

    async def act(now: int) -> AcquireOutcome:
        await redis.sadd(K.deploying("s1"), f"edge{now}@{now}")
        return await rs.acquire("s1", f"r{now}", f"t{now}", TTL)

    now, out = await same_second(redis, act)
    assert out.action == "need_deploy"
    assert f"edge{now}@{now}" in await smembers(redis, K.deploying("s1"))


async def test_acquire_replaces_its_own_expired_placeholder(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    now = await rnow(redis)
    await redis.sadd(K.deploying("s1"), f"t1@{now - 3}")
    out = await rs.acquire("s1", "r1", "t1", TTL)
    assert out.action == "need_deploy"
    assert out.placeholder is not None
    assert int(out.placeholder.rsplit("@", 1)[1]) >= now + TTL
    assert await smembers(redis, K.deploying("s1")) == {out.placeholder}


async def test_acquire_without_deploy_ver_in_config_reuses_nothing(
    rs: ResourceState, redis: Redis
) -> None:
    pool = {"min_idle_pods": 0, "max_pods": 3, "pod_ttl": 300, "pod_concurrency": 4}
    await rs.write_pool_config("s1", pool)  # no pod spec yet: no deploy_ver
    await redis.sadd(K.idle("s1"), "ghost")  # an idle member without info
    await redis.zadd(K.pods("s1"), {"ghost": 1})
    out = await rs.acquire("s1", "r1", "t1", TTL)
    assert out.action == "need_deploy"
    assert await smembers(redis, K.idle("s1")) == {"ghost"}


async def test_acquire_concurrent_cold_scope_reserves_exactly_max_pods(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=3)
    async with second_client(redis) as other:
        rs2 = ResourceState(other)
        outs = await asyncio.gather(
            *((rs if i % 2 else rs2).acquire("s1", f"r{i}", f"t{i}", TTL) for i in range(30))
        )
    actions = [o.action for o in outs]
    assert actions.count("need_deploy") == 3
    assert actions.count("max_reached") == 27
    members = {o.placeholder for o in outs if o.action == "need_deploy"}
    assert await smembers(redis, K.deploying("s1")) == members
    assert len(members) == 3


async def test_acquire_concurrent_reuses_each_warm_pod_once_then_reserves_up_to_max(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=5)
    await add_pod(rs, "s1", "w1", warm=True)
    await add_pod(rs, "s1", "w2", warm=True)
    outs = await asyncio.gather(*(rs.acquire("s1", f"r{i}", f"t{i}", TTL) for i in range(30)))
    actions = [o.action for o in outs]
    assert sorted(o.pod_id for o in outs if o.action == "reuse") == ["w1", "w2"]
    assert actions.count("need_deploy") == 3  # 2 pods + 3 placeholders = 5
    assert actions.count("max_reached") == 25
    assert not await redis.exists(K.idle("s1"), K.idle_since("s1", "w1"), K.idle_since("s1", "w2"))
    assert await redis.scard(K.deploying("s1")) == 3
    cached = {i for i, o in enumerate(outs) if o.action == "reuse"}
    for i in range(30):
        assert bool(await redis.exists(K.idem("s1", f"r{i}"))) == (i in cached)


# --- placeholder -------------------------------------------------------------------------------


async def test_placeholder_without_config_is_none(ds: DeployState, redis: Redis) -> None:
    assert await ds.add_placeholder("s1", "t1", TTL) is None
    assert not await redis.exists(K.deploying("s1"))


async def test_placeholder_caps_at_max_pods_and_never_touches_idle(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=3)
    await add_pod(rs, "s1", "w1", warm=True)
    before = await redis.get(K.idle_since("s1", "w1"))
    a = await ds.add_placeholder("s1", "a", TTL)
    b = await ds.add_placeholder("s1", "b", TTL)
    assert a is not None
    assert b is not None
    assert a.startswith("a@")
    assert await ds.add_placeholder("s1", "c", TTL) is None  # 1 pod + 2 placeholders = 3
    assert await smembers(redis, K.deploying("s1")) == {a, b}
    assert await smembers(redis, K.idle("s1")) == {"w1"}  # the warm pod was not consumed
    assert await redis.get(K.idle_since("s1", "w1")) == before
    assert await redis.hget(K.info("s1", "w1"), "phase") == "idle"


async def test_placeholder_replay_returns_the_same_member(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    keys = [K.config("s1"), K.pods("s1"), K.deploying("s1")]
    assert await rs._placeholder(keys=keys, args=["t1", TTL, "0"]) == ["reserve"]
    assert not await redis.exists(K.deploying("s1"))  # asked without its budget unit: nothing
    first_reply = await rs._placeholder(keys=keys, args=["t1", TTL, "1"])
    second_reply = await rs._placeholder(keys=keys, args=["t1", TTL, "0"])  # at the cap, ours
    assert first_reply == second_reply
    first = first_reply[1]
    assert await smembers(redis, K.deploying("s1")) == {first}
    assert await ds.add_placeholder("s1", "t1", TTL) == first
    assert await ds.add_placeholder("s1", "t2", TTL) is None


async def test_placeholder_drops_expired_ones_first(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    now = await rnow(redis)
    await redis.sadd(K.deploying("s1"), f"crashed@{now - 1}")
    member = await ds.add_placeholder("s1", "t1", TTL)
    assert member is not None
    assert await smembers(redis, K.deploying("s1")) == {member}


async def test_drop_placeholder_frees_the_slot(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    member = await ds.add_placeholder("s1", "t1", TTL)
    assert member is not None
    await ds.drop_placeholder("s1", member)
    assert not await redis.exists(K.deploying("s1"))
    await ds.drop_placeholder("s1", member)  # idempotent
    assert await ds.add_placeholder("s1", "t2", TTL) is not None


# --- register ----------------------------------------------------------------------------------


async def test_register_writes_info_pods_and_pods_all_and_gives_back_the_placeholder(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    member = await ds.add_placeholder("s1", "t1", TTL)
    before = await rnow(redis)
    held = await register(rs, "s1", "p1", member, ver="v1", warm=False)
    after = await rnow(redis)
    assert held is True
    info = await redis.hgetall(K.info("s1", "p1"))
    created = float(info.pop("created_ts"))  # Redis seconds with microseconds
    assert before <= created < after + 1
    assert info == {
        "scope_id": "s1",
        "pod_sse_url": sse("p1"),
        "pod_ip": "10.0.0.1",
        "namespace": "agents",
        "phase": "in_use",
        "deploy_ver": "v1",
    }
    assert await redis.zscore(K.pods("s1"), "p1") == created
    assert set(await rm_pods_known(redis)) == {"p1"}
    assert not await redis.exists(K.deploying("s1"))  # the slot is now the pod's
    assert not await redis.exists(K.idle("s1"), K.idle_since("s1", "p1"))
    assert await redis.zcard(K.pods("s1")) + await redis.scard(K.deploying("s1")) == 1


async def test_register_warm_goes_straight_into_the_pool(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1")
    member = await ds.add_placeholder("s1", "t1", TTL)
    assert await register(rs, "s1", "p1", member, warm=True)
    assert await smembers(redis, K.idle("s1")) == {"p1"}
    created = await redis.hget(K.info("s1", "p1"), "created_ts")
    assert await redis.get(K.idle_since("s1", "p1")) == created
    assert await redis.hget(K.info("s1", "p1"), "phase") == "idle"


async def test_register_replay_keeps_the_first_values_and_answer(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1")
    member = await ds.add_placeholder("s1", "t1", TTL)
    assert member is not None
    keys = [
        K.info("s1", "p1"),
        K.pods("s1"),
        K.deploying("s1"),
        K.idle("s1"),
        K.idle_since("s1", "p1"),
        K.config("s1"),
    ]
    args = ["p1", member, "s1", sse("p1"), "10.0.0.1", "agents", "v1", "1"]
    assert await rs._register(keys=keys, args=args) == 1
    # make the first call look older, so that a rewrite would show
    await redis.hset(K.info("s1", "p1"), "created_ts", "1000")
    await redis.zadd(K.pods("s1"), {"p1": 1000}, xx=True)
    await redis.set(K.idle_since("s1", "p1"), "1000")
    snapshot = await redis.hgetall(K.info("s1", "p1"))

    assert await rs._register(keys=keys, args=args) == 1  # the same answer as the first call
    assert await register(rs, "s1", "p1", member, warm=True) is True
    assert await redis.hgetall(K.info("s1", "p1")) == snapshot
    assert await redis.zscore(K.pods("s1"), "p1") == 1000
    assert await redis.get(K.idle_since("s1", "p1")) == "1000"
    assert await smembers(redis, K.idle("s1")) == {"p1"}
    assert await zmembers(redis, K.pods("s1")) == {"p1"}
    assert set(await rm_pods_known(redis)) == {"p1"}
    assert not await redis.exists(K.deploying("s1"))
    assert await redis.zrange(K.BUDGET, 0, -1) == ["p1"]  # the placeholder's unit is the pod's


async def test_register_replay_never_puts_a_taken_pod_back_into_the_pool(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "s1")
    member = await ds.add_placeholder("s1", "t1", TTL)
    assert await register(rs, "s1", "p1", member, warm=True)
    assert (await rs.acquire("s1", "r1", "t-acq", TTL)).pod_id == "p1"  # handed out meanwhile
    assert await register(rs, "s1", "p1", member, warm=True) is True  # a late re-send
    assert not await redis.exists(K.idle("s1"), K.idle_since("s1", "p1"))
    assert await redis.hget(K.info("s1", "p1"), "phase") == "in_use"


async def test_register_with_an_expired_placeholder_registers_but_reports_not_held(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=2)
    now = await rnow(redis)
    stale = f"t1@{now - 10}"
    await redis.sadd(K.deploying("s1"), stale)  # expired, not yet swept
    assert await register(rs, "s1", "p1", stale) is False
    assert await register(rs, "s1", "p1", stale) is False  # replay: the same answer
    assert not await redis.exists(K.deploying("s1"))
    assert await redis.hget(K.info("s1", "p1"), "scope_id") == "s1"
    assert await zmembers(redis, K.pods("s1")) == {"p1"}
    assert set(await rm_pods_known(redis)) == {"p1"}

    # expired and already swept by someone else's acquire
    swept = f"t2@{now - 10}"
    await redis.sadd(K.deploying("s1"), swept)
    assert (await rs.acquire("s1", "r9", "t9", TTL)).action == "need_deploy"
    assert swept not in await smembers(redis, K.deploying("s1"))
    assert await register(rs, "s1", "p2", swept, warm=True) is False
    assert await register(rs, "s1", "p2", swept, warm=True) is False
    assert await zmembers(redis, K.pods("s1")) == {"p1", "p2"}
    assert await smembers(redis, K.idle("s1")) == {"p2"}
    assert await redis.exists(K.idle_since("s1", "p2"))


async def test_register_placeholder_holds_during_its_deadline_second(
    rs: ResourceState, redis: Redis
) -> None:
    """The same boundary as the sweep: deadline == now is not expired yet."""

    async def act(now: int) -> bool:
        member = f"t{now}@{now}"
        await redis.sadd(K.deploying("s1"), member)
        return await register(rs, "s1", f"p{now}", member)

    now, held = await same_second(redis, act)
    assert held is True
    assert await register(rs, "s1", f"p{now}", f"t{now}@{now}") is True  # replay


async def test_register_without_placeholder(rs: ResourceState, redis: Redis) -> None:
    assert await register(rs, "s1", "adopted", None, warm=True) is False
    assert await smembers(redis, K.idle("s1")) == {"adopted"}
    assert set(await rm_pods_known(redis)) == {"adopted"}


# --- release -----------------------------------------------------------------------------------


async def test_release_puts_an_in_use_pod_into_the_pool_once(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1")
    await add_pod(rs, "s1", "p1", warm=False)
    before = await rnow(redis)
    assert await rs.release("s1", "p1") is True
    after = await rnow(redis)
    assert await smembers(redis, K.idle("s1")) == {"p1"}
    assert before <= float(await redis.get(K.idle_since("s1", "p1"))) < after + 1
    assert await redis.hget(K.info("s1", "p1"), "phase") == "idle"

    await redis.set(K.idle_since("s1", "p1"), "1000")  # so that a restart of the clock would show
    assert await rs.release("s1", "p1") is False
    assert await redis.get(K.idle_since("s1", "p1")) == "1000"
    assert await smembers(redis, K.idle("s1")) == {"p1"}


async def test_release_of_a_pod_not_in_the_scope_writes_nothing(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, "s1")
    await configure(rs, "s2")
    await add_pod(rs, "s2", "theirs", warm=False)
    assert await rs.release("s1", "theirs") is False  # another scope's pod
    assert await rs.release("s1", "nobody") is False  # unknown (or purged) pod
    assert not await redis.exists(K.idle("s1"), K.idle("s2"))
    assert not await redis.exists(K.idle_since("s2", "theirs"), K.idle_since("s1", "nobody"))
    assert not await redis.exists(K.info("s1", "nobody"))
    assert await redis.hget(K.info("s2", "theirs"), "phase") == "in_use"


# --- pod_fields (read only) ---------------------------------------------------------------------


async def test_pod_fields_reads_the_asked_fields_of_each_pod_in_order(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await configure(rs, "s1")
    await configure(rs, "s2")
    await add_pod(rs, "s1", "p1", warm=True)
    await add_pod(rs, "s2", "p2", ver="v1", warm=False)
    await redis.hdel(K.info("s2", "p2"), "namespace")
    got = await js.pod_fields(
        {"p2": "s2", "ghost": "s1", "p1": "s1"}, "phase", "scope_id", "namespace"
    )
    assert list(got) == ["p2", "ghost", "p1"]
    assert got["p1"] == ["idle", "s1", await redis.hget(K.info("s1", "p1"), "namespace")]
    assert got["p2"] == ["in_use", "s2", None], "a missing field is None, the row keeps its place"
    assert got["ghost"] == [None, None, None], "an unknown pod: all None"
    assert await js.pod_fields({}, "phase") == {}
    assert await js.pod_versions({"p1": "s1", "ghost": "s1"}) == {"p1": "v1", "ghost": None}


async def test_pod_fields_over_more_pods_than_one_call(
    js: PoolJobsState, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_runtime.resource_manager import pool_jobs_state as state_module

    monkeypatch.setattr(state_module, "SCRIPT_BATCH", 3)
    for i in range(8):
        await redis.hset(K.info(f"s{i}", f"q{i}"), mapping={"phase": "in_use", "scope_id": f"s{i}"})
    got = await js.pod_fields({f"q{i}": f"s{i}" for i in range(8)}, "scope_id")
    assert got == {f"q{i}": [f"s{i}"] for i in range(8)}


# --- read_many (read only) ----------------------------------------------------------------------


async def test_read_many_reads_each_key_in_order_and_refuses_other_commands(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=2)
    missing = "resource_manager:resource:scope:{s1}:missing"  # one slot with s1's keys
    await add_pod(rs, "s1", "p1", warm=True)
    config = await redis.hgetall(K.config("s1"))
    flat = await js._read_many_script(keys=[K.config("s1"), missing], args=["HGETALL"])
    assert dict(zip(flat[0][::2], flat[0][1::2], strict=True)) == config and flat[1] == []
    sets = await js._read_many_script(keys=[K.idle("s1"), missing], args=["SMEMBERS"])
    assert sets == [["p1"], []]
    counts = await js._read_many_script(keys=[K.pods("s1"), missing], args=["ZCARD"])
    assert counts == [1, 0]
    await redis.rpush("resource_manager:resource:scope:{s1}:deploy_times", "3.5", "2.0")
    lists = await js._read_many_script(
        keys=["resource_manager:resource:scope:{s1}:deploy_times", missing], args=["LRANGE"]
    )
    assert lists == [["3.5", "2.0"], []]
    for command in ("DEL", "SET", "hgetall", "LPUSH"):
        with pytest.raises(ResponseError, match="read_many serves"):
            await js._read_many_script(keys=[K.config("s1")], args=[command])
    assert await redis.hgetall(K.config("s1")) == config, "nothing written"
    assert await js.pool_configs(["nope", "s1"]) == {"s1": await rs.pool_config("s1")}
    assert await js.idle_pods_of(["s1", "nope"]) == {
        "s1": {"p1": float(await redis.get(K.idle_since("s1", "p1")))},
        "nope": {},
    }


# --- purge -------------------------------------------------------------------------------------


async def test_purge_forgets_every_key_of_the_pod(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await configure(rs, "s1")
    await add_pod(rs, "s1", "p1", warm=True)
    await add_pod(rs, "s1", "p2", warm=True)
    await js.count_health_failure("s1", "p1")
    assert await pod_keys(redis, "p1") == {
        K.info("s1", "p1"), K.idle_since("s1", "p1"), K.health_fails("s1", "p1")
    }  # fmt: skip

    assert await js.purge("p1") == "s1"
    assert await pod_keys(redis, "p1") == set()
    assert await zmembers(redis, K.pods("s1")) == {"p2"}
    assert await smembers(redis, K.idle("s1")) == {"p2"}
    assert set(await rm_pods_known(redis)) == {"p2"}

    assert await js.purge("p1") is None  # again
    assert await js.purge("never") is None
    assert await pod_keys(redis, "never") == set()
    assert await redis.exists(K.info("s1", "p2"), K.idle_since("s1", "p2")) == 2


async def test_purge_of_an_in_use_pod(
    rs: ResourceState, ds: DeployState, js: PoolJobsState, redis: Redis
) -> None:
    await configure(rs, "s1", max_pods=1)
    await add_pod(rs, "s1", "p1", warm=False)
    assert await js.purge("p1") == "s1"
    assert not await redis.exists(K.pods("s1"), K.info("s1", "p1"))
    assert not await rm_pod_known(redis, "p1")
    assert await ds.add_placeholder("s1", "t1", TTL) is not None  # its slot is free again


async def test_take_out_of_idle_only_while_idle(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await configure(rs, "s1")
    await add_pod(rs, "s1", "p1", warm=True)
    assert await js.take_out_of_idle("s1", "p1") is True
    assert not await redis.exists(K.idle("s1"), K.idle_since("s1", "p1"))
    assert await js.take_out_of_idle("s1", "p1") is False
    assert (await rs.acquire("s1", "r1", "t1", TTL)).action == "need_deploy"


# --- pod budgets ------------------------------------------------------------------------------


async def units(redis: Redis, key: str) -> set[str]:
    return await zmembers(redis, key)


async def test_acquire_refuses_past_the_global_budget_without_a_placeholder(
    redis: Redis,
) -> None:
    rs = ResourceState(redis, pod_budget=2)
    for sid in ("s1", "s2", "s3"):
        await configure(rs, sid, max_pods=3)
    a = await rs.acquire("s1", "r1", "t1", TTL)
    b = await rs.acquire("s2", "r2", "t2", TTL)
    assert a.action == b.action == "need_deploy"
    refused = await rs.acquire("s3", "r3", "t3", TTL)
    assert refused == AcquireOutcome("budget_reached", budget="global")
    assert not await redis.exists(K.deploying("s3"))
    assert await units(redis, K.BUDGET) == {"s1:t1", "s2:t2"}  # "{sid}:{placeholder token}"
    # a unit's score is its placeholder's deadline (+ the margin: two clocks on a cluster)
    deadline = int(str(a.placeholder).rpartition("@")[2])
    assert deadline <= (await redis.zscore(K.BUDGET, "s1:t1") or 0) <= deadline + 2
    # the replay of a call that got a placeholder keeps it, at the budget too
    assert await rs.acquire("s1", "r1", "t1", TTL) == a
    # register: the placeholder's unit becomes the pod's, the count stays
    assert await register(rs, "s1", "p1", a.placeholder)
    assert await units(redis, K.BUDGET) == {"p1", "s2:t2"}
    assert await redis.zscore(K.BUDGET, "p1") == float("inf")
    assert (await rs.acquire("s3", "r4", "t4", TTL)).action == "budget_reached"
    # a failed deploy gives its unit back, and so does a purged pod
    await DeployState(rs).drop_placeholder("s2", str(b.placeholder))
    assert await units(redis, K.BUDGET) == {"p1"}
    c = await rs.acquire("s3", "r5", "t5", TTL)
    assert c.action == "need_deploy"
    assert (await rs.acquire("s2", "r6", "t6", TTL)).action == "budget_reached"
    assert await PoolJobsState(rs).purge("p1") == "s1"
    assert await units(redis, K.BUDGET) == {"s3:t5"}
    assert await ResourceViews(rs).budget_used() == 1


async def test_a_warm_pod_is_handed_out_at_the_budget(redis: Redis) -> None:
    rs = ResourceState(redis, pod_budget=1)
    await configure(rs, "s1")
    await add_pod(rs, "s1", "w1", warm=True)
    out = await rs.acquire("s1", "r1", "t1", TTL)
    assert out.action == "reuse" and out.pod_id == "w1"  # it exists: no new unit
    assert await units(redis, K.BUDGET) == {"w1"}


async def test_expired_placeholders_stop_counting_against_a_budget(redis: Redis) -> None:
    rs = ResourceState(redis, pod_budget=1)
    await configure(rs, "s1")
    await configure(rs, "s2")
    now = await rnow(redis)
    # a crashed deployer of another scope: its placeholder and unit outlived their deadline
    await redis.sadd(K.deploying("s1"), f"crashed@{now - 1}")
    await redis.zadd(K.BUDGET, {"s1:crashed": now - 1})
    assert await ResourceViews(rs).budget_used() == 0
    out = await rs.acquire("s2", "r1", "t1", TTL)
    assert out.action == "need_deploy"
    assert await units(redis, K.BUDGET) == {"s2:t1"}


async def test_rule_budget_counts_the_scopes_of_its_rule_and_follows_the_link(
    redis: Redis,
) -> None:
    rs = ResourceState(redis, pod_budget=100)
    for sid in ("a", "b", "c"):
        await configure(rs, sid, max_pods=3)
    x = await rs.acquire("a", "r1", "t1", TTL, rule_id="R", rule_pod_budget=2)
    y = await rs.acquire("b", "r2", "t2", TTL, rule_id="R", rule_pod_budget=2)
    assert x.action == y.action == "need_deploy"
    assert await redis.hget(K.config("a"), "budget_rule") == "R"
    assert await redis.hget(K.BUDGET_LIMITS, "R") == "2"
    assert await smembers(redis, K.BUDGET_RULES) == {"R"}
    refused = await rs.acquire("c", "r3", "t3", TTL, rule_id="R", rule_pod_budget=2)
    assert refused == AcquireOutcome("budget_reached", budget="rule")
    # another rule (or none) is not bounded by R's budget
    other = await rs.acquire("c", "r4", "t4", TTL, rule_id="S", rule_pod_budget=0)
    assert other.action == "need_deploy"
    assert not await redis.hexists(K.BUDGET_LIMITS, "S")
    assert await units(redis, K.rule_budget("R")) == {"a:t1", "b:t2"}
    # scope b now resolves through S: its units move there, R has room again
    assert await register(rs, "b", "pb", y.placeholder)
    moved = await rs.acquire("b", "r5", "t5", TTL, rule_id="S", rule_pod_budget=0)
    assert moved.action == "need_deploy"
    assert await units(redis, K.rule_budget("R")) == {"a:t1"}
    assert await units(redis, K.rule_budget("S")) == {"c:t4", "pb", "b:t5"}
    # c comes back to R with its unit: R holds a's and c's, its budget of 2 is used up
    back = await rs.acquire("c", "r6", "t6", TTL, rule_id="R", rule_pod_budget=2)
    assert back == AcquireOutcome("budget_reached", budget="rule")
    assert await units(redis, K.rule_budget("R")) == {"a:t1", "c:t4"}
    # purge and drop give back to the rule the scope is linked to
    assert await PoolJobsState(rs).purge("pb") == "b"
    await DeployState(rs).drop_placeholder("b", str(moved.placeholder))
    assert await units(redis, K.rule_budget("S")) == set()
    assert await redis.zcard(K.BUDGET) == 2


async def test_placeholder_respects_both_budgets_and_says_which(redis: Redis) -> None:
    rs = ResourceState(redis, pod_budget=3)
    await configure(rs, "s1", max_pods=5)
    await configure(rs, "s2", max_pods=5)
    assert (await rs.acquire("s1", "r1", "t1", TTL, rule_id="R", rule_pod_budget=1)).placeholder
    refused = await DeployState(rs).try_placeholder(
        "s1", "warm:1", TTL
    )  # autoscale: the link's budget
    assert (refused.member, refused.refused, refused.budget) == (None, "budget_reached", "rule")
    assert await DeployState(rs).add_placeholder("s2", "warm:2", TTL) is not None
    assert await DeployState(rs).add_placeholder("s2", "warm:3", TTL) is not None
    full = await DeployState(rs).try_placeholder("s2", "warm:4", TTL)
    assert (full.member, full.budget) == (None, "global")
    assert (await DeployState(rs).try_placeholder("nope", "warm:5", TTL)).refused == "no_config"
    assert await redis.zcard(K.BUDGET) == 3


async def test_drop_placeholders_of_a_token_gives_back_their_units(redis: Redis) -> None:
    rs = ResourceState(redis)
    await configure(rs, "s1")
    out = await rs.acquire("s1", "r1", "tok:1", TTL, rule_id="R", rule_pod_budget=5)
    assert out.action == "need_deploy"
    assert await DeployState(rs).drop_placeholders_of("s1", "tok:1") == 1
    assert not await redis.exists(K.deploying("s1"))
    assert await redis.zcard(K.BUDGET) == await redis.zcard(K.rule_budget("R")) == 0


async def test_acquire_under_concurrency_never_passes_the_global_budget(redis: Redis) -> None:
    async with second_client(redis) as other:
        rs, rs2 = ResourceState(redis, pod_budget=5), ResourceState(other, pod_budget=5)
        for i in range(30):
            await configure(rs, f"s{i}", max_pods=2)
        outs = await asyncio.gather(
            *(
                (rs if i % 2 else rs2).acquire(
                    f"s{i}", f"r{i}", f"t{i}", TTL, rule_id="R", rule_pod_budget=0
                )
                for i in range(30)
            )
        )
    actions = [o.action for o in outs]
    assert actions.count("need_deploy") == 5
    assert actions.count("budget_reached") == 25
    assert await redis.zcard(K.BUDGET) == 5
    assert await redis.zcard(K.rule_budget("R")) == 5


async def test_repair_budgets_rebuilds_lost_units_and_drops_stale_ones(redis: Redis) -> None:
    rs = ResourceState(redis)
    await configure(rs, "s1")
    ph = await rs.acquire("s1", "r1", "t1", TTL, rule_id="R", rule_pod_budget=9)
    assert ph.placeholder is not None
    await add_pod(rs, "s1", "p1")
    expected = {"p1", "s1:t1"}
    assert await units(redis, K.BUDGET) == expected
    # Redis lost the budgets (or an older version never wrote them)
    await redis.delete(
        K.BUDGET, K.rule_budget("R"), K.BUDGET_RULES, K.BUDGET_LINKS, K.scope_units("s1")
    )
    assert await PoolJobsState(rs).repair_budgets() == BudgetRepair(2, 0)
    assert await units(redis, K.BUDGET) == expected
    # the link was lost with the rest: the scope counts in no rule until its next acquire
    assert await redis.zcard(K.rule_budget("R")) == 0
    assert (await rs.acquire("s1", "r2", "t2", TTL, rule_id="R", rule_pod_budget=9)).placeholder
    assert await units(redis, K.rule_budget("R")) == expected | {"s1:t2"}
    assert await smembers(redis, K.BUDGET_RULES) == {"R"}
    await DeployState(rs).drop_placeholders_of("s1", "t2")
    # units that stand for nothing: a pod no longer registered, a unit of no scope, a
    # rule's unit of a scope linked elsewhere
    await redis.zadd(K.BUDGET, {"ghost": float("inf"), "s9:gone": 99999999999})
    await redis.zadd(K.rule_budget("Q"), {"p1": float("inf")})
    await redis.sadd(K.BUDGET_RULES, "Q")
    assert await PoolJobsState(rs).repair_budgets() == BudgetRepair(0, 3)
    assert await units(redis, K.BUDGET) == expected
    assert not await redis.exists(K.rule_budget("Q"))
    assert await smembers(redis, K.BUDGET_RULES) == {"R"}
    assert await PoolJobsState(rs).repair_budgets() == BudgetRepair(0, 0)  # nothing left to repair


# --- the pool as a state machine ---------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """One scope, its Python model, and the invariants checked in Redis after every step.

    Driven synchronously: each step runs the async call on a loop owned by the test.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, redis: Redis) -> None:
        super().__init__()
        self.loop, self.redis = loop, redis
        self.rs = ResourceState(redis)
        self.ds, self.js = DeployState(self.rs), PoolJobsState(self.rs)
        self.sid = f"hyp-{uuid.uuid4().hex[:10]}"
        self.max_pods = 0
        self.configured = False
        self.ver = 1
        self.seq = 0
        self.placeholders: dict[str, str] = {}  # token -> member
        self.pods: dict[str, tuple[int, bool]] = {}  # pod -> (version, idle)
        self.gone: set[str] = set()  # purged pods

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    def next_id(self, kind: str) -> str:
        self.seq += 1
        return f"{self.sid}-{kind}{self.seq}"

    def used(self) -> int:
        return len(self.pods) + len(self.placeholders)

    async def write_config(self) -> None:
        await configure(self.rs, self.sid, max_pods=self.max_pods, ver=f"v{self.ver}")

    @initialize(max_pods=st.integers(0, 4), configured=st.integers(0, 4))
    def setup(self, max_pods: int, configured: int) -> None:
        self.max_pods = max_pods
        if configured:  # mostly configured; sometimes the no_config branch for a while
            self.configured = True
            self.run(self.write_config())

    @precondition(lambda self: not self.configured)
    @rule()
    def add_config(self) -> None:
        self.configured = True
        self.run(self.write_config())

    @precondition(lambda self: self.configured)
    @rule()
    def new_version(self) -> None:
        self.ver += 1
        self.run(self.write_config())

    @rule(replay=st.booleans())
    def acquire(self, replay: bool) -> None:
        request_id, token = self.next_id("r"), self.next_id("t")
        out = self.run(self.rs.acquire(self.sid, request_id, token, TTL))
        warm = {p for p, (v, idle) in self.pods.items() if idle and v == self.ver}
        if not self.configured:
            assert out == AcquireOutcome("no_config")
        elif warm:
            assert out.action == "reuse"
            assert out.pod_id in warm
            self.pods[out.pod_id] = (self.ver, False)
        elif self.used() >= self.max_pods:
            assert out == AcquireOutcome("max_reached")
        else:
            assert out.action == "need_deploy"
            assert out.placeholder is not None
            assert out.placeholder.startswith(f"{token}@")
            self.placeholders[token] = out.placeholder
        if replay:
            again = self.run(self.rs.acquire(self.sid, request_id, token, TTL))
            if out.action == "reuse":
                assert again == AcquireOutcome(
                    "cached", out.pod_id, out.pod_sse_url, out.deploy_ver
                )
            else:
                assert again == out

    @rule(replay=st.booleans())
    def add_placeholder(self, replay: bool) -> None:
        token = self.next_id("t")
        member = self.run(self.ds.add_placeholder(self.sid, token, TTL))
        if not self.configured or self.used() >= self.max_pods:
            assert member is None
        else:
            assert member is not None
            self.placeholders[token] = member
        if replay:
            assert self.run(self.ds.add_placeholder(self.sid, token, TTL)) == member

    @precondition(lambda self: self.placeholders)
    @rule(data=st.data())
    def drop_placeholder(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(sorted(self.placeholders)))
        self.run(self.ds.drop_placeholder(self.sid, self.placeholders.pop(token)))

    @precondition(lambda self: self.placeholders)
    @rule(data=st.data(), warm=st.booleans(), old=st.booleans(), replay=st.booleans())
    def register(self, data: st.DataObject, warm: bool, old: bool, replay: bool) -> None:
        token = data.draw(st.sampled_from(sorted(self.placeholders)))
        member = self.placeholders.pop(token)
        pod, ver = self.next_id("p"), self.ver - 1 if old else self.ver
        for _ in range(2 if replay else 1):
            held = self.run(register(self.rs, self.sid, pod, member, ver=f"v{ver}", warm=warm))
            assert held is True
        self.pods[pod] = (ver, warm)

    def any_pod(self, data: st.DataObject) -> str:
        known = sorted(self.pods) + sorted(self.gone) + [f"{self.sid}-unknown"]
        return data.draw(st.sampled_from(known))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pod = self.any_pod(data)
        expected = pod in self.pods and not self.pods[pod][1]
        assert self.run(self.rs.release(self.sid, pod)) is expected
        if expected:
            self.pods[pod] = (self.pods[pod][0], True)

    @rule(data=st.data())
    def purge(self, data: st.DataObject) -> None:
        pod = self.any_pod(data)
        assert self.run(self.js.purge(pod)) == (self.sid if pod in self.pods else None)
        self.pods.pop(pod, None)
        if not pod.endswith("-unknown"):
            self.gone.add(pod)

    @precondition(lambda self: self.pods)
    @rule(data=st.data())
    def take_out_of_idle(self, data: st.DataObject) -> None:
        pod = data.draw(st.sampled_from(sorted(self.pods)))
        ver, idle = self.pods[pod]
        assert self.run(self.js.take_out_of_idle(self.sid, pod)) is idle
        self.pods[pod] = (ver, False)

    @invariant()
    def redis_keys_hold_the_invariants(self) -> None:
        self.run(self.check())

    async def check(self) -> None:
        r, sid = self.redis, self.sid
        pods = await zmembers(r, K.pods(sid))
        idle = await smembers(r, K.idle(sid))
        deploying = await smembers(r, K.deploying(sid))
        assert len(pods) + len(deploying) <= self.max_pods
        assert idle <= pods
        for pod in pods | self.gone | set(self.pods):
            assert bool(await r.exists(K.idle_since(sid, pod))) == (pod in idle), pod
        for pod in pods:
            assert await r.hget(K.info(sid, pod), "scope_id") == sid
            assert await rm_pod_scope(r, pod) == sid
        for pod in self.gone:
            assert not await r.exists(K.info(sid, pod))
            assert not await rm_pod_known(r, pod)
        # the budget holds exactly this scope's pods and placeholders (other examples' scopes
        # share the key)
        mine = {u for u in await zmembers(r, K.BUDGET) if u.startswith(sid)}
        assert mine == pods | {f"{sid}:{m.rpartition('@')[0]}" for m in deploying}
        assert set(await zmembers(r, K.scope_units(sid))) == mine
        # and Redis agrees with the model
        assert pods == set(self.pods)
        assert idle == {p for p, (_, is_idle) in self.pods.items() if is_idle}
        assert deploying == set(self.placeholders.values())


@pytest.mark.parametrize("backend", ["fake", "real", "sentinel", "cluster"])
def test_pool_state_machine(backend: str) -> None:
    run_redis_state_machine(backend, PoolMachine, steps=40)
