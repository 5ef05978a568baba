"""The session manager's eight Lua scripts, through ``SessionState``, on fakeredis and real Redis.

Each script alone (every branch, the limits at the edge, replay = the same EVALSHA sent twice
with identical keys and args), real concurrency on the gates (route_place, waiter_gate; one
client and two), the ``free`` signal (subscribed), and a Hypothesis state machine over
route / touch / eos / expiry / pod death / idle notice / registration / deploy change that
checks the four-places invariant, the limits and the model after every step. Assertions read
the Redis keys by their contract names (§4), not only the return values.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
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
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from agent_runtime.scope_buckets import bucket_of
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState, request_hash
from helpers import other_client, run_redis_state_machine, shard_message, spelled

pytestmark = pytest.mark.topologies

T = TypeVar("T")
P = "session_manager:"
SID = "scope-a"
TTL = 600  # session_ttl: nothing expires during a test unless made so on purpose


class K:
    """Contract §4 key names (session_manager part), spelled out here on purpose."""

    @staticmethod
    def session(session_id: str, sid: str = SID) -> str:
        return f"{P}session:{{{sid}}}:{session_id}"

    @staticmethod
    def session_scope(session_id: str) -> str:
        return f"{P}session_scope:{session_id}"

    @staticmethod
    def expiry(sid: str = SID) -> str:
        return f"{P}scope:{{{sid}}}:session_expiry"

    @staticmethod
    def registered(sid: str = SID) -> str:
        return f"{P}pods:{{{sid}}}:registered"

    @staticmethod
    def touch(request_id: str, sid: str = SID) -> str:
        return f"{P}touch:{{{sid}}}:{request_id}"

    @staticmethod
    def tombstone(session_id: str, sid: str = SID) -> str:
        return f"{P}previous_pod:{{{sid}}}:{session_id}"

    @staticmethod
    def route(request_id: str, sid: str = SID) -> str:
        return f"{P}route:{{{sid}}}:{request_id}"

    @staticmethod
    def scope_sessions(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:sessions"

    @staticmethod
    def candidates(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:pods"

    @staticmethod
    def pod_seq(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:pod_seq"

    @staticmethod
    def config(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:config"

    @staticmethod
    def waiters(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:waiters"

    @staticmethod
    def reserved(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:reserved"

    @staticmethod
    def arrivals(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:arrivals"

    @staticmethod
    def free(sid: str) -> str:
        return f"{P}scope:{{{sid}}}:free"

    @staticmethod
    def pod_sessions(sid: str, pod: str) -> str:
        return f"{P}pod:{{{sid}}}:{pod}:sessions"

    @staticmethod
    def pod_info(sid: str, pod: str) -> str:
        return f"{P}pod:{{{sid}}}:{pod}:info"

    @staticmethod
    def idle_notified(sid: str, pod: str) -> str:
        return f"{P}pod:{{{sid}}}:{pod}:idle_notified"


# --- helpers -----------------------------------------------------------------------------------


class Recorder:
    """Wraps a registered script object: remembers each call's keys/args so a test can send
    exactly the same EVALSHA again (a client retry after a lost reply)."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.calls: list[tuple[list[Any], list[Any]]] = []

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        self.calls.append((list(keys or []), list(args or [])))
        return await self.script(keys=keys, args=args, client=client)

    async def again(self, index: int = -1) -> Any:
        """A recorded call (the last by default), re-sent with identical keys and args."""
        keys, args = self.calls[index]
        return await self.script(keys=keys, args=args)


def record(state: SessionState, script: str) -> Recorder:
    recorder = Recorder(getattr(state, f"_{script}"))
    setattr(state, f"_{script}", recorder)
    return recorder


async def idle_sweep(state: SessionState, grace: float) -> set[str]:
    """One sweep over every registered pod: the pods of SID handed back."""
    return {pod for sid, pod in await state.sweep_idle(grace) if sid == SID}


def url(pod: str) -> str:
    return f"http://{pod}.pods:8080/sse"  # slashes: real Redis's cjson escapes them, fakeredis not


def pending(token: str, session_id: str, sid: str = SID) -> str:
    """The replay marker of a running route: its caller's token and the request's binding."""
    return f"pending:{token}\n{request_hash(sid, session_id)}"


def answer_of(reply: list[Any]) -> dict[str, str]:
    """What the gateway sees, from a placing reply or from a replay (the stored JSON)."""
    if reply[0] == "replay":
        stored = dict(json.loads(reply[1]))
        stored.pop("request_hash", None)  # the binding (route_place.lua), not part of the answer
        return stored
    answer = {"pod_id": reply[1], "pod_sse_url": reply[2], "placement": reply[0]}
    if reply[0] == "rebound":
        answer["previous_pod_id"] = reply[3]
    return answer


async def configure(
    redis: Redis,
    sid: str = SID,
    *,
    scope_concurrency: int = 10,
    pod_concurrency: int = 4,
    max_pods: int | None = None,
    session_ttl: int = TTL,
    deploy_ver: str = "v1",
) -> None:
    """The resolve cache as config_store fills it (the fields the scripts read)."""
    if max_pods is None:
        max_pods = math.ceil(scope_concurrency / pod_concurrency)
    fields = {
        "scope_concurrency": str(scope_concurrency),
        "pod_concurrency": str(pod_concurrency),
        "max_pods": str(max_pods),
        "session_ttl": str(session_ttl),
        "deploy_ver": deploy_ver,
    }
    await redis.delete(K.config(sid))
    await redis.hset(K.config(sid), mapping=fields)
    # registered (as resolve's scope_put would): the sweeper's walks go over the registry
    await redis.hset(f"{P}scope_registry:{{b{bucket_of(sid):02d}}}", sid, json.dumps(["g", "bot"]))


async def add_pod(state: SessionState, pod: str, sid: str = SID, ver: str = "v1") -> bool:
    return await state.register_pod(sid, pod, url(pod), ver)


_rid = 0


async def place(state: SessionState, **call: Any) -> list[Any]:
    """One ``route_place`` through ``SessionState``, its answer spelled as the script's reply,
    once the index writes it asked for are done (after the reply: a bounded wait, each batch
    has its deadline)."""
    placement = await state.route_place(**call)
    await state.index_writes.flush()
    return spelled(placement)


async def route(
    state: SessionState,
    session_id: str,
    sid: str = SID,
    *,
    request_id: str | None = None,
    token: str = "tok",
    slow: bool = False,
) -> list[Any]:
    global _rid
    _rid += 1
    return await place(
        state,
        request_id=request_id or f"auto-{_rid}",
        session_id=session_id,
        scope_id=sid,
        token=token,
        slow=slow,
    )


def placed(pod: str, kind: str = "placed", previous: str = "") -> list[str]:
    return [kind, pod, url(pod), previous]


async def rnow(redis: Redis, key: str | None = None) -> float:
    """Redis TIME; with ``key``, of the server that holds it (on a cluster: its slot's master,
    the clock the scripts on that key read)."""
    if key is not None and isinstance(redis, RedisCluster):
        node = redis.get_node_from_key(key)
        seconds, micros = await redis.time(target_nodes=node)  # type: ignore[call-arg]
    else:
        seconds, micros = await redis.time()
    return seconds + micros / 1_000_000


async def expiry_of(redis: Redis, session_id: str) -> float:
    """The session's expiry, after checking that the hash and the ZSET agree."""
    field = await redis.hget(K.session(session_id), "expiry")
    score = await redis.zscore(K.expiry(), session_id)
    assert field is not None and score is not None
    assert abs(float(field) - score) < 1e-5
    return score


async def set_expiry(redis: Redis, session_id: str, when: float, sid: str = SID) -> None:
    """Move a session's expiry (both places), e.g. into the past to expire it."""
    await redis.hset(K.session(session_id, sid), "expiry", f"{when:.6f}")
    await redis.zadd(K.expiry(sid), {session_id: when})


async def expire(redis: Redis, session_id: str, sid: str = SID) -> None:
    await set_expiry(redis, session_id, await rnow(redis) - 5, sid)


async def four_places(redis: Redis, session_id: str, sid: str, pod: str) -> list[bool]:
    return [
        bool(await redis.exists(K.session(session_id, sid))),
        await redis.zscore(K.expiry(sid), session_id) is not None,
        bool(await redis.sismember(K.scope_sessions(sid), session_id)),
        bool(await redis.sismember(K.pod_sessions(sid, pod), session_id)),
    ]


@asynccontextmanager
async def listening(redis: Redis, sid: str = SID) -> AsyncIterator[PubSub]:
    """Subscribed to the scope's ``free`` channel on another connection (another replica)."""
    client = other_client(redis)
    pubsub = client.pubsub()
    try:
        await client.ping()  # (a new cluster client reads its slot map here)
        await pubsub.ssubscribe(K.free(sid))  # (the scripts SPUBLISH: sharded)
        confirm = await shard_message(pubsub, within=2)
        assert confirm is not None and confirm["type"] == "ssubscribe"
        yield pubsub
    finally:
        await pubsub.aclose()
        await client.aclose()


async def signal(pubsub: PubSub, within: float = 2.0) -> str | None:
    """The next message on the channel, or None within ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (remaining := deadline - loop.time()) > 0:
        message = await shard_message(pubsub, within=min(remaining, 0.05))
        if message is not None and message["type"] == "smessage":
            return str(message["data"])
    return None


@pytest.fixture
def state(redis: Redis) -> SessionState:
    return SessionState(redis)


# --- the calls SessionState sends ---------------------------------------------------------------


async def test_the_calls_match_the_script_headers(state: SessionState) -> None:
    """Keys and args as each script's header lists them (contract names, this order)."""
    recorders = {
        name: record(state, name)
        for name in (
            "route_place",
            "evict",
            "touch",
            "register_pod",
            "sweep_idle_notify",
            "cleanup_pod",
            "waiter_gate",
            "route_lease",
            "retire_pod",
        )
    }
    await configure(state.redis)  # registered: the idle sweep walks the registry's scopes
    await state.route_place(request_id="r1", session_id="s1", scope_id=SID, token="t1")
    await state.evict("s1", scope_id=SID, pod_died=True)
    await state.touch("s1", eos=True, request_id="r1", scope_id=SID)
    await state.register_pod(SID, "p1", "u", "v1")
    await state.sweep_idle(2.0)
    await state.cleanup_pod(SID, "p1")
    await state.take_waiter_seat(SID, "r1", 30, 6)
    await state.renew_route(SID, "r1", "t1")
    await state.retire_pod(SID, "p1")
    calls = {name: rec.calls[0] for name, rec in recorders.items()}
    assert calls["route_place"] == (
        [
            K.session("s1"),
            K.expiry(),
            K.scope_sessions(SID),
            K.candidates(SID),
            K.config(SID),
            K.registered(),
            K.route("r1"),
            K.tombstone("s1"),
            K.reserved(SID),
            K.waiters(SID),
            K.arrivals(SID),
        ],
        [P, "s1", SID, "t1", 60, 3.0, "r1", "0", request_hash(SID, "s1"), 15.0, 300.0, 3000],
    )
    assert calls["evict"] == ([K.session("s1"), K.expiry()], [P, "s1", "1", SID])
    assert calls["touch"] == (
        [K.session("s1"), K.expiry(), K.touch("r1")],
        [P, "s1", "1", 60, request_hash("s1"), SID],
    )
    assert calls["register_pod"] == (
        [
            K.candidates(SID),
            K.pod_seq(SID),
            K.pod_info(SID, "p1"),
            K.registered(),
            K.idle_notified(SID, "p1"),
            K.config(SID),
        ],
        [P, SID, "p1", "u", "v1"],
    )
    # a scope per call; a pod's keys are derived from the prefix, per pod of the scope
    assert calls["sweep_idle_notify"] == ([K.registered(), K.candidates(SID)], [P, 2.0, SID])
    assert calls["cleanup_pod"] == (
        [
            K.candidates(SID),
            K.pod_info(SID, "p1"),
            K.pod_sessions(SID, "p1"),
            K.idle_notified(SID, "p1"),
            K.registered(),
        ],
        ["p1"],
    )
    # the resource manager names the pod's scope: its keys, nothing derived
    assert calls["retire_pod"] == ([K.candidates(SID), K.pod_sessions(SID, "p1")], ["p1"])
    assert calls["waiter_gate"] == ([K.waiters(SID)], ["r1", 30, 6])
    assert calls["route_lease"] == (
        [K.route("r1"), K.reserved(SID), K.waiters(SID)],
        ["t1", "r1", 3.0],
    )


# --- route_place -------------------------------------------------------------------------------


async def test_a_cache_miss_is_need_config_and_writes_only_the_pending_marker(
    state: SessionState, redis: Redis
) -> None:
    await add_pod(state, "p1")
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_config"]
    assert await redis.get(K.route("r1")) == pending("t1", "s1")
    assert 0 < await redis.ttl(K.route("r1")) <= 60
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4


async def test_placed_commits_the_four_places_and_clears_the_idle_notice(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await redis.set(K.idle_notified(SID, "p1"), "1", ex=60)
    before = await rnow(redis)
    assert await route(state, "s1", request_id="r1") == placed("p1")
    assert await four_places(redis, "s1", SID, "p1") == [True] * 4
    binding = await redis.hgetall(K.session("s1"))
    assert binding["scope_id"] == SID and binding["pod_id"] == "p1"
    assert binding["session_ttl"] == str(TTL)
    assert before + TTL <= await expiry_of(redis, "s1") <= await rnow(redis) + TTL
    assert not await redis.exists(K.idle_notified(SID, "p1"))
    stored = await redis.get(K.route("r1"))
    assert stored is not None
    assert json.loads(stored) == {
        "pod_id": "p1",
        "pod_sse_url": url("p1"),
        "placement": "placed",
        "request_hash": request_hash(SID, "s1"),  # the binding: replayed for this request only
    }
    assert 0 < await redis.ttl(K.route("r1")) <= 60


async def test_refresh_extends_by_the_sessions_own_ttl_and_needs_no_config(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, session_ttl=TTL)
    await add_pod(state, "p1")
    await route(state, "s1")
    await configure(redis, session_ttl=5)  # a policy change: the live session keeps its own
    await set_expiry(redis, "s1", await rnow(redis) + 10)  # time went by
    before = await rnow(redis)
    assert await route(state, "s1") == placed("p1", "refresh")
    assert await expiry_of(redis, "s1") >= before + TTL
    assert await redis.hget(K.session("s1"), "session_ttl") == str(TTL)

    await redis.delete(K.config(SID))  # cache dropped: a refresh is still one round trip
    assert await route(state, "s1") == placed("p1", "refresh")
    assert await redis.scard(K.scope_sessions(SID)) == 1


async def test_a_sunset_pod_keeps_its_sessions_but_gets_no_new_ones(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, pod_concurrency=4)
    await add_pod(state, "p1")
    await route(state, "s1")
    assert await state.remove_candidates(SID, ["p1"]) == 1  # a deploy change sunsets p1
    assert await route(state, "s1") == placed("p1", "refresh")
    assert await route(state, "s2") == ["need_acquire"]
    assert await four_places(redis, "s1", SID, "p1") == [True] * 4


async def test_an_expired_binding_is_evicted_lazily_then_placed_again(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=1, pod_concurrency=1)
    await add_pod(state, "p1")
    await route(state, "s1")
    await expire(redis, "s1")
    # not yet evicted (no sweeper ran): it still holds the scope's only slot
    assert await route(state, "s2") == ["scope_full", ""]
    async with listening(redis) as pubsub:
        # its own route evicts it first, so the gate lets it through: a new binding
        assert await route(state, "s1") == placed("p1")
        assert await signal(pubsub) == "s1"
    assert await expiry_of(redis, "s1") > await rnow(redis) + TTL - 5
    assert await redis.smembers(K.pod_sessions(SID, "p1")) == {"s1"}


async def test_an_expired_binding_is_evicted_even_when_the_answer_is_need_config(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=4, pod_concurrency=1, max_pods=1)
    await add_pod(state, "p1")
    await route(state, "s1")
    await expire(redis, "s1")
    await redis.delete(K.config(SID))
    assert await route(state, "s1") == ["need_config"]
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4


async def test_a_binding_whose_pod_left_the_registry_is_rebound(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await add_pod(state, "p2")
    await route(state, "s1")
    await redis.srem(K.registered(), "p1")
    await redis.zrem(K.candidates(SID), "p1")
    async with listening(redis) as pubsub:
        assert await route(state, "s1", request_id="r2") == placed("p2", "rebound", "p1")
        assert await signal(pubsub) == "s1"
    assert await four_places(redis, "s1", SID, "p2") == [True] * 4
    assert not await redis.sismember(K.pod_sessions(SID, "p1"), "s1")
    stored = await redis.get(K.route("r2"))
    assert stored is not None and json.loads(stored)["previous_pod_id"] == "p1"
    assert not await redis.exists(K.tombstone("s1"))


async def test_a_rebound_is_not_lost_when_the_first_answer_is_pending(
    state: SessionState, redis: Redis
) -> None:
    """The binding is dropped by a call that cannot place (no pod yet): the call that places
    after the acquire must still say ``rebound`` with the pod that left."""
    await configure(redis, scope_concurrency=4, pod_concurrency=4)
    await add_pod(state, "p1")
    await route(state, "s1")
    await redis.srem(K.registered(), "p1")
    await redis.zrem(K.candidates(SID), "p1")
    assert await route(state, "s1", request_id="r2", token="t2") == ["need_acquire"]
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4
    assert await redis.get(K.tombstone("s1")) == "p1"
    assert 0 < await redis.ttl(K.tombstone("s1")) <= TTL
    await add_pod(state, "p2")
    assert await route(state, "s1", request_id="r2", token="t2") == placed("p2", "rebound", "p1")
    assert not await redis.exists(K.tombstone("s1"))


async def test_a_binding_in_another_scope_moves_to_this_one(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, SID)
    await configure(redis, "scope-b")
    await add_pod(state, "p1", SID)
    await add_pod(state, "q1", "scope-b")
    await route(state, "s1", SID)
    assert await redis.get(K.session_scope("s1")) == SID
    async with listening(redis) as pubsub:
        assert await route(state, "s1", "scope-b") == placed("q1")
        assert await signal(pubsub) == "s1", "the old scope's seat is free"
    # the index named the old scope: the binding there was evicted (no seat held in two scopes)
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4
    assert await four_places(redis, "s1", "scope-b", "q1") == [True] * 4
    assert await redis.hget(K.session("s1", "scope-b"), "scope_id") == "scope-b"
    assert await redis.get(K.session_scope("s1")) == "scope-b"
    assert 0 < await redis.ttl(K.session_scope("s1")) <= 2 * TTL


async def test_a_pod_death_tombstone_makes_the_next_placement_rebound(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=2, pod_concurrency=1, max_pods=2)
    await add_pod(state, "p1")
    await add_pod(state, "p2")
    await route(state, "s1")  # p1
    await route(state, "s2")  # p2
    assert await state.evict("s1", pod_died=True) == (SID, "p1", 0)
    assert await redis.get(K.tombstone("s1")) == "p1"
    assert TTL - 5 <= await redis.ttl(K.tombstone("s1")) <= TTL
    assert await state.cleanup_pod(SID, "p1") == 1
    # no pod with room: the answer is pending (a pod is to be acquired), the tombstone stays
    assert await route(state, "s1", request_id="rb") == ["need_acquire"]
    assert await redis.get(K.tombstone("s1")) == "p1"
    await add_pod(state, "p3")
    again = await route(state, "s1", request_id="rb", slow=True)  # the same call goes on
    assert again == placed("p3", "rebound", "p1")
    assert not await redis.exists(K.tombstone("s1"))
    stored = await redis.get(K.route("rb"))
    assert stored is not None
    assert json.loads(stored) == {
        "pod_id": "p3",
        "pod_sse_url": url("p3"),
        "placement": "rebound",
        "previous_pod_id": "p1",
        "request_hash": request_hash(SID, "s1"),
    }
    assert await route(state, "s1") == placed("p3", "refresh")


async def test_an_evict_without_pod_death_leaves_no_tombstone(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await route(state, "s1")
    assert await state.evict("s1") == (SID, "p1", 0)
    assert not await redis.exists(K.tombstone("s1"))
    assert await route(state, "s1") == placed("p1")


async def test_the_scope_gate_holds_at_exactly_scope_concurrency(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=3, pod_concurrency=4)
    await add_pod(state, "p1")
    for i in range(3):
        assert await route(state, f"s{i}") == placed("p1")
    assert await route(state, "s3", request_id="r-full", token="t") == ["scope_full", ""]
    assert await redis.get(K.route("r-full")) == pending("t", "s3")
    assert await redis.scard(K.scope_sessions(SID)) == 3
    await state.evict("s0")
    assert await route(state, "s3", request_id="r-full", token="t") == placed("p1")
    assert await redis.scard(K.scope_sessions(SID)) == 3


async def test_first_fit_fills_pods_in_arrival_order_to_exactly_pod_concurrency(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=10, pod_concurrency=2)  # max_pods 5
    await add_pod(state, "pod-b")  # arrives first although it sorts last
    await add_pod(state, "pod-a")
    assert [(await route(state, f"s{i}"))[1] for i in range(4)] == [
        "pod-b",
        "pod-b",
        "pod-a",
        "pod-a",
    ]
    assert await redis.scard(K.pod_sessions(SID, "pod-b")) == 2
    assert await redis.scard(K.pod_sessions(SID, "pod-a")) == 2
    assert await route(state, "s4") == ["need_acquire"]  # 2 candidates < max_pods 5
    await state.evict("s0")
    assert await route(state, "s4") == placed("pod-b")  # the first with room again


async def test_no_room_is_need_acquire_below_max_pods_and_scope_full_at_it(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=10, pod_concurrency=2, max_pods=2)
    await add_pod(state, "p1")
    await add_pod(state, "p2")
    for i in range(4):
        await route(state, f"s{i}")
    assert await route(state, "s4") == ["scope_full", ""]  # 2 candidates = max_pods
    for session in ("s2", "s3"):  # p2 empty again
        await state.evict(session)
    await state.remove_candidates(SID, ["p2"])  # sunset: it no longer counts as a candidate
    assert await route(state, "s4") == ["need_acquire"]
    await configure(redis, scope_concurrency=10, pod_concurrency=2, max_pods=1)
    assert await route(state, "s5") == ["scope_full", ""]
    assert await redis.scard(K.scope_sessions(SID)) == 2


async def test_reservations_count_like_sessions_and_are_bounded_by_what_max_pods_holds(
    state: SessionState, redis: Redis
) -> None:
    """The worked example's core: a cold scope (sc 10, pc 5, max_pods 2) promises exactly
    scope_concurrency slots to routes headed for pods being acquired; the rest must queue,
    and a queued route cannot take a slot that was promised."""
    await configure(redis, scope_concurrency=10, pod_concurrency=5, max_pods=2)
    replies = [await route(state, f"s{i}", request_id=f"r{i}") for i in range(12)]
    assert replies == [["need_acquire"]] * 10 + [["scope_full", ""]] * 2
    assert await redis.zcard(K.reserved(SID)) == 10
    assert await route(state, "s0", request_id="r0") == ["need_acquire"], "re-asking keeps it"
    await add_pod(state, "p1")
    # a queued route (no reservation) finds room on p1 but the slots are promised
    assert await route(state, "s10", request_id="r10", slow=True) == ["scope_full", ""]
    for i in range(5):
        assert (await route(state, f"s{i}", request_id=f"r{i}", slow=True))[0] == "placed"
    assert await redis.zcard(K.reserved(SID)) == 5
    # p1 is full, a second pod may come: the remaining holders are told to acquire again
    assert await route(state, "s5", request_id="r5", slow=True) == ["need_acquire"]
    await configure(redis, scope_concurrency=10, pod_concurrency=5, max_pods=1)
    assert await route(state, "s5", request_id="r5", slow=True) == ["scope_full", "1"]
    # capacity: at max_pods × pod_concurrency below scope_concurrency, no more is promised
    await configure(redis, "scope-b", scope_concurrency=10, pod_concurrency=3, max_pods=2)
    cold = [await route(state, f"b{i}", "scope-b", request_id=f"rb{i}") for i in range(8)]
    assert cold == [["need_acquire"]] * 6 + [["scope_full", ""]] * 2


async def test_a_lapsed_reservation_stops_counting(state: SessionState, redis: Redis) -> None:
    await configure(redis, scope_concurrency=1, pod_concurrency=1, max_pods=1)
    assert await route(state, "s1", request_id="r1") == ["need_acquire"]
    assert await route(state, "s2", request_id="r2") == ["scope_full", ""]
    await redis.zadd(K.reserved(SID), {"r1": 1.0})  # its owner died: the lease ran out
    assert await route(state, "s2", request_id="r2") == ["need_acquire"]
    assert await redis.zrange(K.reserved(SID), 0, -1) == ["r2"]


async def test_a_reservation_taken_from_the_queue_leaves_the_queue(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=2, pod_concurrency=1, max_pods=2)
    await state.take_waiter_seat(SID, "r1", 30, 4)
    assert await route(state, "s1", request_id="r1", slow=True) == ["need_acquire"]
    assert not await redis.exists(K.waiters(SID))
    await state.take_waiter_seat(SID, "r1", 30, 4)  # queued again, then placed
    await add_pod(state, "p1")
    assert (await route(state, "s1", request_id="r1", slow=True))[0] == "placed"
    assert not await redis.exists(K.waiters(SID), K.reserved(SID))


async def test_no_candidate_at_all_is_need_acquire(state: SessionState, redis: Redis) -> None:
    await configure(redis)
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    assert await redis.get(K.route("r1")) == pending("t1", "s1")
    assert not await redis.exists(K.session("s1"))


# --- route_place: replay ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["placed", "refresh", "rebound"])
async def test_a_resent_placing_call_returns_the_first_answer(
    state: SessionState, redis: Redis, kind: str
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    if kind != "placed":
        await route(state, "s1")
    if kind == "rebound":
        await state.evict("s1", pod_died=True)
        await state.cleanup_pod(SID, "p1")
        await add_pod(state, "p2")
    recorder = record(state, "route_place")
    first = await route(state, "s1", request_id="r1", token="t1")
    assert first[0] == kind
    expiry = await expiry_of(redis, "s1")
    again = await recorder.again()  # the identical EVALSHA, after a lost reply
    assert again[0] == "replay"
    assert answer_of(again) == answer_of(first)
    assert await expiry_of(redis, "s1") == expiry, "nothing done the second time"
    assert await redis.scard(K.scope_sessions(SID)) == 1
    # the same request on another replica (its own token) gets the same answer too
    client = other_client(redis)
    try:
        other = await place(
            SessionState(client), request_id="r1", session_id="s1", scope_id=SID, token="t-other"
        )
    finally:
        await client.aclose()
    assert other[0] == "replay" and answer_of(other) == answer_of(first)


async def test_a_resent_pending_call_is_recomputed_and_a_duplicate_is_in_flight(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, pod_concurrency=1)
    recorder = record(state, "route_place")
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    assert (await recorder.again())[0] == "need_acquire"
    assert await route(state, "s1", request_id="r1", token="t2") == ["in_flight"]
    await add_pod(state, "p1")
    assert await route(state, "s1", request_id="r1", token="t2") == ["in_flight"]
    assert (await recorder.again(0))[:4] == placed("p1")  # the owner of the marker goes on
    dup = await route(state, "s1", request_id="r1", token="t2")
    assert dup[0] == "replay" and answer_of(dup) == answer_of(placed("p1"))
    assert await redis.smembers(K.scope_sessions(SID)) == {"s1"}


async def test_release_route_gives_back_only_its_own_marker_reservation_and_seat(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    assert await redis.zscore(K.reserved(SID), "r1") is not None
    await state.take_waiter_seat(SID, "r1", 30, 6)
    assert await state.release_route(SID, "r1", "t2") is False  # not the owner: untouched
    assert await redis.get(K.route("r1")) == pending("t1", "s1")
    assert await redis.zscore(K.reserved(SID), "r1") is not None
    assert await redis.zscore(K.waiters(SID), "r1") is not None
    assert await state.release_route(SID, "r1", "t1") is True
    assert not await redis.exists(K.route("r1"), K.reserved(SID), K.waiters(SID))
    assert await state.release_route(SID, "r1", "t1") is True  # replay: nothing more to do
    assert await route(state, "s1", request_id="r1", token="t2") == ["need_acquire"]


async def test_release_route_after_the_marker_expired_still_frees_the_seat(
    state: SessionState, redis: Redis
) -> None:
    """A route that lost Redis longer than its lease: nobody took its request_id over, so
    what it held is still its own to give back."""
    await configure(redis)
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    await state.take_waiter_seat(SID, "r1", 30, 6)
    await redis.delete(K.route("r1"))  # the lease ran out
    assert await state.release_route(SID, "r1", "t1") is True
    assert not await redis.exists(K.reserved(SID), K.waiters(SID))


async def test_release_route_after_the_answer_leaves_the_answer(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    first = await route(state, "s1", request_id="r1", token="t1")
    assert first[0] == "placed"
    assert await state.release_route(SID, "r1", "t1") is False
    again = await route(state, "s1", request_id="r1", token="t2")
    assert again[0] == "replay" and answer_of(again) == answer_of(first)


async def test_renew_route_extends_only_what_the_owner_holds(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    await redis.pexpire(K.route("r1"), 200)
    await redis.zadd(K.reserved(SID), {"r1": 1.0})  # about to lapse
    assert await state.renew_route(SID, "r1", "t1") is True
    assert 2000 < await redis.pttl(K.route("r1")) <= 3000
    now = await rnow(redis)
    assert now + 2 < (await redis.zscore(K.reserved(SID), "r1") or 0) <= now + 3.5
    assert not await redis.exists(K.waiters(SID)), "renewal never creates a seat"
    assert await state.renew_route(SID, "r1", "t-other") is False
    # a pending marker lives the lease, not the replay time: a dead caller frees it soon
    await state.release_route(SID, "r1", "t1")
    assert await route(state, "s2", request_id="r2", token="t1") == ["need_acquire"]
    assert 0 < await redis.pttl(K.route("r2")) <= 3000


async def test_a_renewal_after_the_answer_does_not_shorten_the_replay(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    await add_pod(state, "p1")
    assert (await route(state, "s1", request_id="r1", token="t1", slow=True))[0] == "placed"
    assert await state.renew_route(SID, "r1", "t1") is False
    assert await redis.ttl(K.route("r1")) > 50
    assert not await redis.exists(K.reserved(SID)), "placing gave the reservation back"


async def test_concurrent_duplicates_of_one_request_place_once(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    client = other_client(redis)
    states = [state, SessionState(client)]
    try:
        replies = await asyncio.gather(
            *(
                place(states[i % 2], request_id="r1", session_id="s1", scope_id=SID, token=f"t{i}")
                for i in range(20)
            )
        )
    finally:
        await client.aclose()
    kinds = Counter(r[0] for r in replies)
    assert kinds == {"placed": 1, "replay": 19}
    assert {json.dumps(answer_of(r), sort_keys=True) for r in replies} == {
        json.dumps(answer_of(placed("p1")), sort_keys=True)
    }
    assert await redis.scard(K.scope_sessions(SID)) == 1


# --- route_place: a request_id reused by another request ---------------------------------------


async def test_an_answered_request_id_replays_only_for_its_own_request(
    state: SessionState, redis: Redis
) -> None:
    """Another session of the scope with a used request_id gets "reused" — never the first
    caller's pod — and nothing is done for it; the first request keeps replaying (any replica).
    Replays are kept per scope (route:{sid}:{request_id}): in another scope the id is another
    request's, placed there on its own, and never sees the first answer."""
    await configure(redis)
    await configure(redis, "scope-b")
    await add_pod(state, "p1")
    await add_pod(state, "q1", "scope-b")
    first = await route(state, "s1", request_id="r1", token="t1")
    assert first == placed("p1")
    stored = await redis.get(K.route("r1"))
    assert await route(state, "s2", request_id="r1", token="t2") == ["reused"]
    assert not await redis.exists(K.session("s2"))
    assert await redis.smembers(K.scope_sessions(SID)) == {"s1"}
    assert not await redis.exists(K.reserved(SID))
    assert await route(state, "s3", "scope-b", request_id="r1", token="t3") == placed("q1")
    assert await redis.smembers(K.scope_sessions("scope-b")) == {"s3"}
    assert json.loads(await redis.get(K.route("r1", "scope-b")))["pod_id"] == "q1"
    assert await redis.get(K.route("r1")) == stored, "the first answer is left as it was"
    client = other_client(redis)
    try:
        again = await place(
            SessionState(client), request_id="r1", session_id="s1", scope_id=SID, token="t4"
        )
    finally:
        await client.aclose()
    assert again[0] == "replay" and answer_of(again) == answer_of(first)


async def test_a_running_request_id_is_reused_for_another_request_at_once(
    state: SessionState, redis: Redis
) -> None:
    """A pending marker carries the request's binding: the same request waits (in_flight),
    another one is told "reused" without waiting and without a reservation or a seat."""
    await configure(redis, pod_concurrency=1)
    assert await route(state, "s1", request_id="r1", token="t1") == ["need_acquire"]
    assert await route(state, "s1", request_id="r1", token="t2") == ["in_flight"]
    assert await route(state, "s2", request_id="r1", token="t3") == ["reused"]
    assert await redis.zcard(K.reserved(SID)) == 1  # the first request's own reservation
    assert await redis.get(K.route("r1")) == pending("t1", "s1")
    await add_pod(state, "p1")
    assert await route(state, "s1", request_id="r1", token="t1", slow=True) == placed("p1")
    assert await route(state, "s2", request_id="r1", token="t3") == ["reused"]
    assert not await redis.exists(K.session("s2"))


async def test_an_unbound_answer_of_an_older_version_still_replays(
    state: SessionState, redis: Redis
) -> None:
    """Values written before answers were bound (a rolling upgrade) keep their replay."""
    await configure(redis)
    old = {"pod_id": "p9", "pod_sse_url": "u", "placement": "placed"}
    await redis.set(K.route("r-old"), json.dumps(old), ex=60)
    reply = await route(state, "s-any", request_id="r-old", token="t1")
    assert reply[0] == "replay" and json.loads(reply[1]) == old
    await redis.set(K.route("r-pending"), "pending:t-old", px=3000)
    assert await route(state, "s-any", request_id="r-pending", token="t2") == ["in_flight"]
    assert await state.release_route(SID, "r-pending", "t-old") is True  # its owner still can


async def test_concurrent_routes_of_different_sessions_with_one_request_id_place_one(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=50, pod_concurrency=50)
    await add_pod(state, "p1")
    client = other_client(redis)
    states = [state, SessionState(client)]
    try:
        replies = await asyncio.gather(
            *(
                place(
                    states[i % 2],
                    request_id="r1",
                    session_id=f"s{i % 4}",
                    scope_id=SID,
                    token=f"t{i}",
                )
                for i in range(20)
            )
        )
    finally:
        await client.aclose()
    kinds = Counter(r[0] for r in replies)
    assert kinds["placed"] == 1 and kinds["placed"] + kinds["replay"] + kinds["reused"] == 20
    winner = next(i for i, r in enumerate(replies) if r[0] == "placed")
    for i, reply in enumerate(replies):  # a replay only ever for the winner's own session
        assert reply[0] != "replay" or i % 4 == winner % 4
        assert reply[0] != "reused" or i % 4 != winner % 4
    assert await redis.smembers(K.scope_sessions(SID)) == {f"s{winner % 4}"}


async def test_an_eos_request_id_of_another_session_does_nothing(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    for sid in ("s1", "s2"):
        await route(state, sid)
    assert await state.touch("s1", eos=True, request_id="r-eos") == (True, True)
    assert await state.touch("s2", eos=True, request_id="r-eos") is None  # s2 not ended
    assert (
        await state.touch("s3", eos=True, request_id="r-eos", scope_id=SID) is None
    )  # nor told "ended"
    # the scope's: in another scope the request_id is another request (here: s3 unknown)
    assert await state.touch("s3", eos=True, request_id="r-eos", scope_id="scope-b") == (
        False,
        False,
    )
    assert await four_places(redis, "s2", SID, "p1") == [True] * 4
    assert await state.touch("s1", eos=True, request_id="r-eos") == (True, True)  # replay
    assert await state.touch("s2", eos=False, request_id="r-eos") == (True, False)  # no eos
    # an answer kept before answers were bound (no fingerprint) replays as it did
    await redis.set(K.touch("r-old"), "1,1", ex=60)
    assert await state.touch("s9", eos=True, request_id="r-old", scope_id=SID) == (True, True)


# --- route_place: concurrency ----------------------------------------------------------------


def replayed_as_placed(reply: list[Any]) -> list[Any]:
    """A replay as the answer it replays. A cluster client sends a call again after a
    connection error or timeout (redis-py's cluster retries; ``GatedCluster``'s write on a
    connection closed under it), and when the first send had run, the script's replay cache
    answers the second: the same placement, once (seen on a loaded CI machine: 5 placed and
    1 replay) — what the burst tests count."""
    if reply[0] != "replay":
        return reply
    first = json.loads(reply[1])
    return [first["placement"], first["pod_id"], first["pod_sse_url"], ""]


async def burst_on_two_pods(redis: Redis, clients: int) -> list[list[str]]:
    """Pods p1 and p2 registered, then 100 concurrent route_place calls for new sessions,
    spread over ``clients`` connections (a replayed call counted as what it replays)."""
    extra = [other_client(redis) for _ in range(clients - 1)]
    states = [SessionState(c) for c in [redis, *extra]]
    try:
        await add_pod(states[0], "p1")
        await add_pod(states[0], "p2")
        replies = await asyncio.gather(
            *(
                place(
                    states[i % clients],
                    request_id=f"r{i}",
                    session_id=f"s{i}",
                    scope_id=SID,
                    token=f"t{i}",
                )
                for i in range(100)
            )
        )
        return [replayed_as_placed(reply) for reply in replies]
    finally:
        for client in extra:
            await client.aclose()


@pytest.mark.parametrize("clients", [1, 2])
@pytest.mark.parametrize(
    ("max_pods", "rest"),
    [(3, {"need_acquire": 2, "scope_full": 90}), (2, {"scope_full": 92})],
)
async def test_100_concurrent_routes_fill_two_pods_exactly(
    redis: Redis, clients: int, max_pods: int, rest: dict[str, int]
) -> None:
    """Below max_pods, the 2 slots a third pod would add are promised (reserved) to the
    first two losers; the others are scope_full."""
    await configure(redis, scope_concurrency=10, pod_concurrency=4, max_pods=max_pods)
    replies = await burst_on_two_pods(redis, clients)
    assert Counter(r[0] for r in replies) == {"placed": 8, **rest}
    assert Counter(r[1] for r in replies if r[0] == "placed") == {"p1": 4, "p2": 4}
    assert await redis.scard(K.pod_sessions(SID, "p1")) == 4
    assert await redis.scard(K.pod_sessions(SID, "p2")) == 4
    winners = {f"s{i}" for i, r in enumerate(replies) if r[0] == "placed"}
    assert await redis.smembers(K.scope_sessions(SID)) == winners
    assert set(await redis.zrange(K.expiry(), 0, -1)) == winners


@pytest.mark.parametrize("clients", [1, 2])
async def test_100_concurrent_routes_stop_at_scope_concurrency(redis: Redis, clients: int) -> None:
    await configure(redis, scope_concurrency=6, pod_concurrency=4)
    replies = await burst_on_two_pods(redis, clients)
    assert Counter(r[0] for r in replies) == {"placed": 6, "scope_full": 94}
    assert Counter(r[1] for r in replies if r[0] == "placed") == {"p1": 4, "p2": 2}
    assert await redis.scard(K.scope_sessions(SID)) == 6


# --- evict -------------------------------------------------------------------------------------


async def test_evict_leaves_the_four_places_signals_and_is_idempotent(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await route(state, "s1")
    await route(state, "s2")
    recorder = record(state, "evict")
    async with listening(redis) as pubsub:
        assert await state.evict("s1") == (SID, "p1", 1)
        assert await signal(pubsub) == "s1"
        assert await recorder.again() == []  # a re-sent evict: nothing left to do
        assert await signal(pubsub, within=0.2) is None, "no second signal"
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4
    assert await four_places(redis, "s2", SID, "p1") == [True] * 4
    assert await state.evict("never-seen") is None


async def test_evict_of_a_dead_pods_session_is_idempotent_and_keeps_the_tombstone(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, session_ttl=90)
    await add_pod(state, "p1")
    await route(state, "s1")
    recorder = record(state, "evict")
    assert await state.evict("s1", pod_died=True) == (SID, "p1", 0)
    assert await recorder.again() == []
    assert await redis.get(K.tombstone("s1")) == "p1"
    assert 85 <= await redis.ttl(K.tombstone("s1")) <= 90


async def test_evict_expired_evicts_only_what_is_due_oldest_first_up_to_the_limit(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=10, pod_concurrency=10)
    await add_pod(state, "p1")
    for i in range(5):
        await route(state, f"s{i}")
    now = await rnow(redis)
    for i, age in ((0, 30), (1, 10), (2, 20)):
        await set_expiry(redis, f"s{i}", now - age)
    await redis.zadd(K.expiry(), {"ghost": now - 40})  # a stray entry: no session hash
    recorder = record(state, "evict_expired")
    async with listening(redis) as pubsub:
        first = await state.expire_scope_sessions(SID, 3)
        assert first.evicted == ["ghost", "s0", "s2"]
        assert first.next_due == await redis.zscore(K.expiry(), "s1"), "the earliest left"
        assert {await signal(pubsub), await signal(pubsub)} == {"s0", "s2"}
    last = await state.expire_scope_sessions(SID, 3)
    assert last.evicted == ["s1"], "fewer than the limit: nothing more due"
    assert last.next_due is not None and last.next_due > now
    assert (await recorder.again(0))[1:] == [], "a re-sent call: nothing left to do"
    for i in range(3):
        assert await four_places(redis, f"s{i}", SID, "p1") == [False] * 4
    for i in (3, 4):
        assert await four_places(redis, f"s{i}", SID, "p1") == [True] * 4
    assert await redis.scard(K.pod_sessions(SID, "p1")) == 2
    assert (await state.expire_scope_sessions(SID, 3)).evicted == []


async def test_evict_drops_a_stray_expiry_entry(state: SessionState, redis: Redis) -> None:
    await redis.zadd(K.expiry(), {"ghost": 1})
    assert await state.evict("ghost", scope_id=SID, pod_died=True) is None
    assert await redis.zscore(K.expiry(), "ghost") is None
    assert not await redis.exists(K.tombstone("ghost"))


# --- touch -------------------------------------------------------------------------------------


async def test_touch_extends_by_the_sessions_own_ttl(state: SessionState, redis: Redis) -> None:
    await configure(redis, session_ttl=TTL)
    await add_pod(state, "p1")
    await route(state, "s1")
    await configure(redis, session_ttl=5)  # the policy changed; the session keeps its ttl
    await set_expiry(redis, "s1", await rnow(redis) + 10)
    recorder = record(state, "touch")
    before = await rnow(redis)
    assert await state.touch("s1", eos=False) == (True, False)
    assert before + TTL <= await expiry_of(redis, "s1") <= await rnow(redis) + TTL
    assert await recorder.again() == [1, 0, 0]  # a re-sent touch extends again: harmless
    assert await four_places(redis, "s1", SID, "p1") == [True] * 4
    assert await state.touch("unknown", eos=False) == (False, False)
    assert await state.touch("unknown", eos=True) == (False, False)


async def test_touch_of_an_expired_session_evicts_it_on_the_spot(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await route(state, "s1")
    await expire(redis, "s1")
    recorder = record(state, "touch")
    async with listening(redis) as pubsub:
        assert await state.touch("s1", eos=False) == (False, True)
        assert await signal(pubsub) == "s1"
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4
    assert await recorder.again() == [0, 0, 0]
    assert not await redis.exists(K.tombstone("s1"))


async def test_touch_eos_ends_the_session_and_signals(state: SessionState, redis: Redis) -> None:
    await configure(redis, scope_concurrency=1)
    await add_pod(state, "p1")
    await route(state, "s1")
    assert await route(state, "s2") == ["scope_full", ""]
    recorder = record(state, "touch")
    async with listening(redis) as pubsub:
        assert await state.touch("s1", eos=True, request_id="r-eos") == (True, True)
        assert await signal(pubsub) == "s1"
        assert await recorder.again() == [1, 1, 0]  # a re-sent eos: the first one's answer
        assert await signal(pubsub, within=0.2) is None  # ... and nothing done again
    assert await state.touch("s1", eos=True, request_id="r-eos-2") == (False, False)  # another
    assert await state.touch("s1", eos=False) == (False, False)  # a keep-alive: it is gone
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4
    assert await route(state, "s2") == placed("p1")


async def test_eos_on_an_expired_session_frees_it_but_is_not_touched(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await route(state, "s1")
    await expire(redis, "s1")
    assert await state.touch("s1", eos=True) == (False, True)
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4


async def test_touch_naming_a_scope_finds_only_a_session_of_that_scope(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, session_ttl=TTL)
    await add_pod(state, "p1")
    await route(state, "s1")
    await set_expiry(redis, "s1", await rnow(redis) + 10)
    other = "f" * 32
    recorder = record(state, "touch")
    assert await state.touch("s1", eos=False, scope_id=other) == (False, False)
    assert await expiry_of(redis, "s1") <= await rnow(redis) + 10, "not extended"
    assert await state.touch("s1", eos=True, request_id="r-x", scope_id=other) == (False, False)
    assert await four_places(redis, "s1", SID, "p1") == [True] * 4, "another scope's eos: kept"
    await expire(redis, "s1")
    assert await state.touch("s1", eos=False, scope_id=other) == (False, False)
    assert await four_places(redis, "s1", SID, "p1") == [True] * 4, "not evicted from there"
    assert await recorder.again() == [0, 0, 0]
    await set_expiry(redis, "s1", await rnow(redis) + 10)
    assert await state.touch("s1", eos=False, scope_id=SID) == (True, False)
    assert await expiry_of(redis, "s1") >= await rnow(redis) + TTL - 1
    assert await state.touch("s1", eos=True, request_id="r-y", scope_id=SID) == (True, True)
    assert await four_places(redis, "s1", SID, "p1") == [False] * 4


# --- sweep_idle_notify -------------------------------------------------------------------------


async def test_idle_notify_takes_an_empty_pod_out_once(state: SessionState, redis: Redis) -> None:
    await configure(redis, scope_concurrency=10, pod_concurrency=1)
    await add_pod(state, "p1")
    await add_pod(state, "p2")
    await route(state, "s1")  # p1
    await redis.sadd(K.registered(), "ghost")  # a member whose pod info is gone
    assert await idle_sweep(state, 60) == set(), "p1 busy, p2 within the grace, ghost unknown"
    assert not await redis.exists(K.idle_notified(SID, "p2"))
    recorder = record(state, "sweep_idle_notify")
    assert await idle_sweep(state, 0) == {"p2"}
    assert await redis.zrange(K.candidates(SID), 0, -1) == ["p1"]
    assert await redis.sismember(K.registered(), "p2"), "still registered"
    assert 0 < await redis.ttl(K.idle_notified(SID, "p2")) <= 60
    assert await recorder.again() == [], "one notice per 60 s"
    assert await route(state, "s2") == ["need_acquire"], "never placed on a pod handed back"


async def test_idle_notify_waits_for_the_grace_since_registration(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await redis.hset(K.pod_info(SID, "p1"), "registered_at", f"{await rnow(redis) - 10:.6f}")
    assert await idle_sweep(state, 30) == set()
    assert await idle_sweep(state, 5) == {"p1"}


async def test_a_sunset_pod_is_notified_once_it_is_empty(state: SessionState, redis: Redis) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await route(state, "s1")
    await state.remove_candidates(SID, ["p1"])
    assert await idle_sweep(state, 0) == set()
    await state.evict("s1")
    assert await idle_sweep(state, 0) == {"p1"}
    assert await redis.exists(K.idle_notified(SID, "p1"))


async def test_a_notified_pod_registered_again_comes_back_last_in_line(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, pod_concurrency=1)
    await add_pod(state, "p1")
    await add_pod(state, "p2")
    await redis.hset(K.pod_info(SID, "p2"), "registered_at", f"{await rnow(redis) + 60:.6f}")
    assert await idle_sweep(state, 0) == {"p1"}, "p2 is within its grace"
    assert await add_pod(state, "p1") is True  # reused from the warm pool
    assert await redis.zrange(K.candidates(SID), 0, -1, withscores=True) == [
        ("p2", 2.0),
        ("p1", 3.0),
    ]
    assert not await redis.exists(K.idle_notified(SID, "p1"))
    assert await route(state, "s1") == placed("p2")
    assert await route(state, "s2") == placed("p1")


async def test_idle_notify_judges_each_registered_pod_on_its_own(
    state: SessionState, redis: Redis
) -> None:
    """Pods of two scopes: only the empty, registered, past-grace, not-yet-notified ones are
    handed back, each out of its own scope's candidates."""
    other = "f" * 32
    await configure(redis, scope_concurrency=10, pod_concurrency=1)
    await configure(redis, other, scope_concurrency=10, pod_concurrency=1)
    for pod in ("busy", "empty", "notified", "fresh"):
        await add_pod(state, pod)
    await add_pod(state, "empty2", other)
    await route(state, "s1")  # on "busy", the first candidate
    await redis.set(K.idle_notified(SID, "notified"), "1", ex=60)  # told within the last minute
    await redis.hset(K.pod_info(SID, "fresh"), "registered_at", f"{await rnow(redis) + 30:.6f}")
    await redis.sadd(K.registered(), "ghost", "no-colon")
    assert set(await state.sweep_idle(0)) == {(SID, "empty"), (other, "empty2")}
    assert await redis.zrange(K.candidates(SID), 0, -1) == ["busy", "notified", "fresh"]
    assert await redis.zrange(K.candidates(other), 0, -1) == []
    assert await state.sweep_idle(0) == [], "one notice per 60 s"


async def test_sweep_idle_walks_every_registered_scope_one_call_each(
    state: SessionState, redis: Redis
) -> None:
    scopes = [SID, *(f"scope-{i}" for i in range(12))]
    for sid in scopes:
        await configure(redis, sid, scope_concurrency=50, pod_concurrency=1)
    pods = [f"p{i}" for i in range(23)]
    for pod in pods:
        await add_pod(state, pod)
    for sid in scopes[1:]:
        await add_pod(state, "q", sid)
    for i in range(5):
        await route(state, f"s{i}")  # p0..p4 busy
    calls = record(state, "sweep_idle_notify")
    notified = await state.sweep_idle(0)
    assert sorted(notified) == sorted([(SID, p) for p in pods[5:]] + [(s, "q") for s in scopes[1:]])
    assert sorted(args[2] for _, args in calls.calls) == sorted(scopes), "one call per scope"
    assert sorted(await redis.zrange(K.candidates(SID), 0, -1)) == sorted(pods[:5])
    assert await state.sweep_idle(0) == []


# --- pod_usage (read only) ----------------------------------------------------------------------


async def test_pod_usage_tells_candidate_and_sessions_per_pod(
    state: SessionState, redis: Redis
) -> None:
    other = "f" * 32
    await configure(redis, scope_concurrency=10, pod_concurrency=2)
    await configure(redis, other)
    await add_pod(state, "p1")
    await add_pod(state, "p2")
    await add_pod(state, "q1", other)
    await route(state, "s1")
    await route(state, "s2")  # p1 full
    await route(state, "s3")  # p2
    await state.remove_candidates(SID, ["p2"])  # sunset: keeps its session
    pairs = [(SID, "p1"), (SID, "p2"), (other, "q1"), (SID, "ghost")]
    assert await state.pod_usage(pairs) == [(True, 2), (False, 1), (True, 0), (False, 0)]
    assert await state.pod_usage([]) == []


# --- register_pod ------------------------------------------------------------------------------


async def test_register_pod_makes_a_candidate_in_arrival_order_and_signals(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, deploy_ver="v1")
    recorder = record(state, "register_pod")
    async with listening(redis) as pubsub:
        before = await rnow(redis)
        assert await add_pod(state, "p1") is True
        assert await signal(pubsub) == "pod:p1"
        assert await add_pod(state, "p2") is True
        assert await signal(pubsub) == "pod:p2"
        assert await recorder.again() == 1  # a re-sent registration of p2
        assert await signal(pubsub, within=0.2) is None
    assert await redis.zrange(K.candidates(SID), 0, -1, withscores=True) == [
        ("p1", 1.0),
        ("p2", 2.0),
    ]
    assert await redis.get(K.pod_seq(SID)) == "2"
    info = await redis.hgetall(K.pod_info(SID, "p1"))
    assert info["sse_url"] == url("p1") and info["deploy_ver"] == "v1"
    assert before <= float(info["registered_at"]) <= await rnow(redis)
    assert await redis.smembers(K.registered()) == {"p1", "p2"}


async def test_register_pod_refuses_a_pod_of_an_old_version(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, deploy_ver="v2")
    async with listening(redis) as pubsub:
        assert await add_pod(state, "old", ver="v1") is False
        assert await signal(pubsub, within=0.2) is None
    for key in (K.candidates(SID), K.pod_info(SID, "old"), K.pod_seq(SID)):
        assert not await redis.exists(key), key
    assert not await redis.sismember(K.registered(), "old")
    # a candidate that is now of an old version is refused too (kept as it is)
    await configure(redis, deploy_ver="v1")
    await add_pod(state, "p1", ver="v1")
    await configure(redis, deploy_ver="v2")
    assert await add_pod(state, "p1", ver="v1") is False


async def test_register_pod_without_a_cache_registers(state: SessionState, redis: Redis) -> None:
    assert await add_pod(state, "p1", ver="anything") is True
    assert await redis.zrange(K.candidates(SID), 0, -1) == ["p1"]


async def test_one_pod_in_two_scopes(state: SessionState, redis: Redis) -> None:
    """A pod id's registrations are per scope: cleaning one leaves the other as it was."""
    await add_pod(state, "p1", SID)
    await add_pod(state, "p1", "scope-b")
    assert await state.cleanup_pod(SID, "p1") == 1
    assert await redis.smembers(K.registered()) == set()
    assert await redis.smembers(K.registered("scope-b")) == {"p1"}
    assert await redis.zrange(K.candidates("scope-b"), 0, -1) == ["p1"]
    assert await redis.exists(K.pod_info("scope-b", "p1"))


# --- cleanup_pod -------------------------------------------------------------------------------


async def test_cleanup_pod_branches_and_replay(state: SessionState, redis: Redis) -> None:
    await configure(redis)
    await add_pod(state, "p1")
    await route(state, "s1")
    await redis.set(K.idle_notified(SID, "p1"), "1")
    recorder = record(state, "cleanup_pod")
    assert await state.cleanup_pod(SID, "p1") == -1
    assert await recorder.again() == -1
    assert await redis.zscore(K.candidates(SID), "p1") is None, "no session may land on it"
    assert await redis.sismember(K.registered(), "p1"), "registered while sessions live"
    assert await route(state, "s1") == placed("p1", "refresh")
    await state.evict("s1", pod_died=True)
    assert await state.cleanup_pod(SID, "p1") == 1
    assert await recorder.again() == 0
    for key in (
        K.pod_info(SID, "p1"),
        K.pod_sessions(SID, "p1"),
        K.idle_notified(SID, "p1"),
    ):
        assert not await redis.exists(key), key
    assert not await redis.sismember(K.registered(), "p1")


# --- waiter_gate -------------------------------------------------------------------------------


async def test_waiter_gate_seats_up_to_the_limit(state: SessionState, redis: Redis) -> None:
    recorder = record(state, "waiter_gate")
    for i in range(3):
        assert await state.take_waiter_seat(SID, f"w{i}", 30, 3) is True
    before = await redis.zscore(K.waiters(SID), "w2")
    assert await recorder.again() == 1, "a re-sent seat request keeps its seat"
    after = await redis.zscore(K.waiters(SID), "w2")
    assert before is not None and after is not None and after >= before
    assert await redis.zcard(K.waiters(SID)) == 3
    assert await state.take_waiter_seat(SID, "w3", 30, 3) is False
    assert await recorder.again() == 0
    assert await redis.zscore(K.waiters(SID), "w3") is None, "a refused seat is not kept"
    await redis.zrem(K.waiters(SID), "w0")  # what release_route does to a seat
    assert await state.take_waiter_seat(SID, "w3", 30, 3) is True
    assert set(await redis.zrange(K.waiters(SID), 0, -1)) == {"w1", "w2", "w3"}


async def test_waiter_gate_drops_expired_seats(state: SessionState, redis: Redis) -> None:
    now = await rnow(redis)
    await redis.zadd(K.waiters(SID), {"crashed-1": now - 1, "crashed-2": now - 100})
    await redis.zadd(K.waiters(SID), {"alive": now + 100})
    assert await state.take_waiter_seat(SID, "w1", 30, 2) is True
    assert set(await redis.zrange(K.waiters(SID), 0, -1)) == {"alive", "w1"}
    deadline = await redis.zscore(K.waiters(SID), "w1")
    assert deadline is not None and now + 29 <= deadline <= await rnow(redis) + 30


@pytest.mark.parametrize("clients", [1, 2])
async def test_50_concurrent_seats_with_limit_6(redis: Redis, clients: int) -> None:
    extra = [other_client(redis) for _ in range(clients - 1)]
    states = [SessionState(c) for c in [redis, *extra]]
    try:
        seated = await asyncio.gather(
            *(states[i % clients].take_waiter_seat(SID, f"w{i}", 30, 6) for i in range(50))
        )
    finally:
        for client in extra:
            await client.aclose()
    assert sum(seated) == 6
    winners = {f"w{i}" for i, ok in enumerate(seated) if ok}
    assert set(await redis.zrange(K.waiters(SID), 0, -1)) == winners


# --- the free signal, heard by another replica ---------------------------------------------------


async def test_every_slot_freed_and_every_new_pod_signals_free(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis)
    async with listening(redis) as pubsub:
        await add_pod(state, "p1")
        assert await signal(pubsub) == "pod:p1"
        for i in range(4):
            await route(state, f"s{i}")
        assert await signal(pubsub, within=0.2) is None, "placing frees nothing"
        await state.evict("s0")
        assert await signal(pubsub) == "s0"
        await state.evict("s1", pod_died=True)
        assert await signal(pubsub) == "s1"
        await state.touch("s2", eos=True)
        assert await signal(pubsub) == "s2"
        await expire(redis, "s3")
        await state.touch("s3", eos=False)
        assert await signal(pubsub) == "s3"
        await state.touch("s3", eos=True)
        await state.evict("s3")
        await state.cleanup_pod(SID, "p1")
        assert await signal(pubsub, within=0.2) is None, "nothing more was freed"


# --- the scripts as a state machine ----------------------------------------------------------


class SessionMachine(RuleBasedStateMachine):
    """One scope, its Python model, and the invariants checked in Redis after every step.

    Driven synchronously: each step runs the async call on a loop owned by the test. Every key
    and member of one run carries its own scope id, and ``teardown`` deletes them (the db is
    shared by the runs of one test process; nothing is flushed).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, redis: Redis) -> None:
        super().__init__()
        self.loop, self.redis = loop, redis
        self.state = SessionState(redis)
        self.scopes = ScopeState(redis)
        self.scripts = {
            name: record(self.state, name)
            for name in ("route_place", "evict", "touch", "register_pod", "cleanup_pod")
        }
        self.sid = f"hyp-{uuid.uuid4().hex[:10]}"
        self.seq = 0
        # policy (the resolve cache) and deploy version
        self.scope_concurrency = self.pod_concurrency = self.max_pods = 0
        self.configured = False
        self.drops = 0  # cache drops so far (each run has a few, not mostly need_config)
        self.ver = 1
        # the model
        self.ttl = TTL  # the policy's session_ttl (a live session keeps the one it got)
        self.sessions: dict[str, str] = {}  # session -> pod, for every live session
        self.ttls: dict[str, int] = {}  # session -> its own session_ttl
        self.expired: set[str] = set()  # live sessions whose expiry has passed
        self.pods: dict[str, int] = {}  # registered pod -> deploy version
        self.candidates: list[str] = []  # in arrival order
        self.notified: set[str] = set()
        self.dead: set[str] = set()
        self.tombstones: dict[str, str] = {}  # session -> the pod that died under it
        self.known: list[str] = []  # every session id used so far
        self.reserved: dict[str, str] = {}  # request_id -> token, reservations held

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    def next_id(self, kind: str) -> str:
        self.seq += 1
        return f"{self.sid}-{kind}{self.seq}"

    def on_pod(self, pod: str) -> int:
        return sum(1 for p in self.sessions.values() if p == pod)

    def drop(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.expired.discard(session)

    async def write_config(self) -> None:
        await configure(
            self.redis,
            self.sid,
            scope_concurrency=self.scope_concurrency,
            pod_concurrency=self.pod_concurrency,
            max_pods=self.max_pods,
            session_ttl=self.ttl,
            deploy_ver=f"v{self.ver}",
        )

    @initialize(
        scope_concurrency=st.integers(1, 6),
        pod_concurrency=st.integers(1, 3),
        pods=st.integers(0, 2),
    )
    def setup(self, scope_concurrency: int, pod_concurrency: int, pods: int) -> None:
        self.scope_concurrency, self.pod_concurrency = scope_concurrency, pod_concurrency
        self.max_pods = math.ceil(scope_concurrency / pod_concurrency)
        self.configured = True
        self.run(self.write_config())
        for _ in range(min(pods, self.max_pods)):
            self.add_new_pod(replay=False, stale=False)

    # --- config ---

    @precondition(lambda self: self.configured and self.drops < 2)
    @rule()
    def drop_config(self) -> None:
        self.drops += 1
        self.configured = False
        self.run(self.scopes.drop_scope_configs([self.sid]))

    @precondition(lambda self: not self.configured)
    @rule()
    def fill_config(self) -> None:
        self.configured = True
        self.run(self.write_config())

    @precondition(lambda self: self.configured)
    @rule()
    def policy_change(self) -> None:
        """A new session_ttl: new bindings get it, live ones keep theirs."""
        self.ttl = 2 * TTL if self.ttl == TTL else TTL
        self.run(self.write_config())

    @precondition(lambda self: self.configured and self.ver < 3)
    @rule()
    def deploy_change(self) -> None:
        """A new deploy_ver: the old version's candidates leave first-fit (sunset)."""
        self.ver += 1
        old = [p for p in self.candidates if self.pods[p] != self.ver]
        self.run(self.state.remove_candidates(self.sid, old))
        self.candidates = [p for p in self.candidates if p not in old]
        self.run(self.write_config())

    # --- pods ---

    @precondition(lambda self: len(self.pods) < self.max_pods)
    @rule(replay=st.booleans(), stale=st.booleans())
    def register_new_pod(self, replay: bool, stale: bool) -> None:
        self.add_new_pod(replay, stale)

    def add_new_pod(self, replay: bool, stale: bool) -> None:
        pod = self.next_id("p")
        ver = self.ver - 1 if stale else self.ver
        accepted = self.run(self.state.register_pod(self.sid, pod, url(pod), f"v{ver}"))
        expected = not stale or not self.configured
        assert accepted is expected
        if accepted:
            self.pods[pod] = ver
            self.candidates.append(pod)
        if replay:
            assert self.run(self.scripts["register_pod"].again()) == int(expected)

    @precondition(lambda self: self.notified)
    @rule(data=st.data())
    def reuse_notified_pod(self, data: st.DataObject) -> None:
        """The resource manager hands a warm (notified) pod out again."""
        self.reuse(data.draw(st.sampled_from(sorted(self.notified))))

    def reuse(self, pod: str) -> None:
        current = self.pods[pod] == self.ver or not self.configured
        registered = self.run(
            self.state.register_pod(self.sid, pod, url(pod), f"v{self.pods[pod]}")
        )
        assert registered is current
        if current:
            self.notified.discard(pod)
            self.candidates.append(pod)

    @precondition(lambda self: self.pods)
    @rule()
    def idle_notify(self) -> None:
        """The sweeper's empty-pod pass: every empty pod not yet notified, and only those."""
        empty = {p for p in self.pods if self.on_pod(p) == 0 and p not in self.notified}
        swept = self.run(self.state.sweep_idle(0))
        assert {pod for sid, pod in swept if sid == self.sid} == empty
        for pod in empty:
            self.notified.add(pod)
            if pod in self.candidates:
                self.candidates.remove(pod)

    @precondition(lambda self: self.pods)
    @rule(data=st.data(), replay=st.booleans())
    def pod_dies(self, data: st.DataObject, replay: bool) -> None:
        """What notify_pod_dead does: leave the candidates, evict with tombstones, clean up."""
        busy = sorted(set(self.sessions.values()))
        pods = busy if busy and data.draw(st.booleans()) else sorted(self.pods)
        pod = data.draw(st.sampled_from(pods))
        on_pod = sorted(s for s, p in self.sessions.items() if p == pod)
        assert self.run(self.state.cleanup_pod(self.sid, pod)) == (-1 if on_pod else 1)
        if pod in self.candidates:
            self.candidates.remove(pod)
        if on_pod:
            for session in on_pod:
                left = self.run(self.state.evict(session, pod_died=True))
                self.drop(session)
                self.tombstones[session] = pod
                assert left == (self.sid, pod, self.on_pod(pod))
                if replay:
                    assert self.run(self.scripts["evict"].again()) == []
            assert self.run(self.state.cleanup_pod(self.sid, pod)) == 1
        if replay:
            assert self.run(self.scripts["cleanup_pod"].again()) == 0
        del self.pods[pod]
        self.notified.discard(pod)
        self.dead.add(pod)

    # --- sessions ---

    def new_session(self) -> str:
        session = self.next_id("s")
        self.known.append(session)
        return session

    def known_session(self, data: st.DataObject) -> str:
        """Mostly a live or tombstoned session (where things happen), sometimes any."""
        interesting = sorted(set(self.sessions) | set(self.tombstones))
        if interesting and data.draw(st.integers(0, 3)):
            return data.draw(st.sampled_from(interesting))
        return data.draw(st.sampled_from(self.known))

    def expect_route(
        self, session: str, request_id: str, token: str, slow: bool = False
    ) -> list[Any]:
        """The model's answer; it changes the model as the script changes Redis."""
        pod = self.sessions.get(session)
        if pod is not None:
            if session not in self.expired:
                assert pod in self.pods
                return placed(pod, "refresh")
            self.drop(session)  # lazy eviction of the expired binding
        if not self.configured:
            return ["need_config"]
        mine = request_id in self.reserved
        others = len(self.reserved) - mine
        full = ["scope_full", "1" if mine else ""]
        if len(self.sessions) + others >= self.scope_concurrency:
            return full
        chosen = next((p for p in self.candidates if self.on_pod(p) < self.pod_concurrency), None)
        if chosen is None:
            room = min(self.scope_concurrency, self.max_pods * self.pod_concurrency)
            if len(self.candidates) < self.max_pods and len(self.sessions) + others < room:
                self.reserved[request_id] = token
                return ["need_acquire"]
            return full
        self.reserved.pop(request_id, None)  # placing gives the reservation back
        self.sessions[session] = chosen
        self.ttls[session] = self.ttl
        previous = self.tombstones.pop(session, None)
        return placed(chosen, "rebound", previous) if previous else placed(chosen)

    @rule(replay=st.sampled_from(["no", "same", "other"]), acquire=st.booleans())
    def route_new(self, replay: str, acquire: bool) -> None:
        self.route(self.new_session(), replay, acquire)

    @precondition(lambda self: self.known)
    @rule(data=st.data(), replay=st.sampled_from(["no", "same", "other"]), acquire=st.booleans())
    def route_again(self, data: st.DataObject, replay: str, acquire: bool) -> None:
        self.route(self.known_session(data), replay, acquire)

    def route(self, session: str, replay: str, acquire: bool) -> None:
        """One route_place; with ``acquire``, a ``need_acquire`` is followed as the orchestrator
        does: a pod (a warm one again, else a new one) is registered and the same request runs
        again with its own token."""
        request_id, token = self.next_id("r"), self.next_id("t")
        reply = self.run(
            place(
                self.state,
                request_id=request_id,
                session_id=session,
                scope_id=self.sid,
                token=token,
            )
        )
        assert reply == self.expect_route(session, request_id, token), (session, reply)
        if reply[0] == "rebound":
            assert reply[3] in self.dead, "a rebound names the pod that died"
        placing = reply[0] in ("placed", "refresh", "rebound")
        if replay == "same":  # the identical EVALSHA again (a client retry)
            again = self.run(self.scripts["route_place"].again())
            if placing:
                assert again[0] == "replay" and answer_of(again) == answer_of(reply)
            else:  # (a need_acquire's reply also says its reservation's deadline)
                assert again[: len(reply)] == reply
        elif replay == "other":  # the same request on another replica, with its own token
            again = self.run(
                place(
                    self.state,
                    request_id=request_id,
                    session_id=session,
                    scope_id=self.sid,
                    token="x",
                )
            )
            if placing:
                assert again[0] == "replay" and answer_of(again) == answer_of(reply)
            else:
                assert again == ["in_flight"]
        if reply == ["need_acquire"] and acquire:
            warm = sorted(p for p in self.notified if self.pods[p] == self.ver)
            if warm:
                self.reuse(warm[0])
            elif len(self.pods) < self.max_pods:
                self.add_new_pod(replay=False, stale=False)
            else:
                return  # max_pods held by sunset pods: the resource manager says no
            reply = self.run(
                place(
                    self.state,
                    request_id=request_id,
                    session_id=session,
                    scope_id=self.sid,
                    token=token,
                    slow=True,
                )
            )
            assert reply == self.expect_route(session, request_id, token, slow=True), (
                session,
                reply,
            )
            assert reply[0] in ("placed", "rebound"), reply
            assert request_id not in self.reserved
            if reply[0] == "rebound":
                assert reply[3] in self.dead, "a rebound names the pod that died"

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), owner=st.booleans())
    def release_reservation(self, data: st.DataObject, owner: bool) -> None:
        """A route that held a reservation fails: it gives it back (only the owner can)."""
        request_id = data.draw(st.sampled_from(sorted(self.reserved)))
        token = self.reserved[request_id] if owner else "not-the-owner"
        released = self.run(self.state.release_route(self.sid, request_id, token))
        assert released is owner
        if owner:
            del self.reserved[request_id]

    @precondition(lambda self: self.known)
    @rule(data=st.data(), eos=st.booleans(), replay=st.booleans())
    def touch(self, data: st.DataObject, eos: bool, replay: bool) -> None:
        session = self.known_session(data)
        request_id = self.next_id("q")
        touched, released = self.run(
            self.state.touch(session, eos=eos, request_id=request_id, scope_id=self.sid)
        )
        ended: tuple[bool, bool] | None = None  # what this eos did, if it ended the session
        if session not in self.sessions:
            assert (touched, released) == (False, False)
        elif session in self.expired:
            assert (touched, released) == (False, True)
            self.drop(session)
            ended = (False, True) if eos else None
        elif eos:
            assert (touched, released) == (True, True)
            self.drop(session)
            ended = (True, True)
        else:
            assert (touched, released) == (True, False)
        if replay:  # the same request re-sent: an eos that ended its session answers alike
            alive = session in self.sessions
            again = [int(v) for v in ended] if ended else [1 if alive else 0, 0]
            again.append(0)  # the index was written for 2 ttl at placement: not due again
            assert self.run(self.scripts["touch"].again()) == again

    @precondition(lambda self: set(self.sessions) - self.expired)
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """Time passes for one session: its expiry (both places) moves into the past."""
        session = data.draw(st.sampled_from(sorted(set(self.sessions) - self.expired)))
        self.run(expire(self.redis, session, self.sid))
        self.expired.add(session)

    @precondition(lambda self: self.expired)
    @rule()
    def sweep_expired(self) -> None:
        """The sweeper's expiry pass: every expired session evicted, nothing else."""
        mine = self.run(self.state.expire_scope_sessions(self.sid, 1000)).evicted
        assert sorted(mine) == sorted(self.expired)
        for session in mine:
            self.drop(session)

    # --- after every step ---

    @invariant()
    def redis_agrees_with_the_model(self) -> None:
        self.run(self.check())

    async def check(self) -> None:
        sid = self.sid
        pods = sorted(set(self.pods) | self.dead)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(K.scope_sessions(sid))
            pipe.zrange(K.candidates(sid), 0, -1)
            pipe.smembers(K.registered(sid))
            pipe.zrange(K.reserved(sid), 0, -1)
            for pod in pods:
                pipe.smembers(K.pod_sessions(sid, pod))
                pipe.exists(K.idle_notified(sid, pod))
            for session in self.known:
                pipe.hgetall(K.session(session, sid))
                pipe.zscore(K.expiry(sid), session)
                pipe.get(K.tombstone(session, sid))
            replies = await pipe.execute()
        # TIME right after the reads, no longer in their pipeline (a cluster client refuses
        # TIME there): the clock of the scope's server, which its scripts read; the one round
        # trip between is far inside the bounds below (30 s wide)
        now = await rnow(self.redis, K.scope_sessions(sid))
        scope_sessions, candidates, registered, reserved = replies[:4]
        i = 4
        assert len(scope_sessions) <= self.scope_concurrency
        assert set(reserved) == set(self.reserved)
        # sessions and reservations together stay within the scope (none is ever promised
        # a slot the scope does not have; a config change can only lower what is live)
        assert len(scope_sessions) + len(reserved) <= self.scope_concurrency
        assert scope_sessions == set(self.sessions)
        assert candidates == self.candidates
        mine = set(registered)
        assert mine == set(self.pods)
        assert set(candidates) <= mine
        for pod in pods:
            on_pod, notified = replies[i], replies[i + 1]
            i += 2
            assert len(on_pod) <= self.pod_concurrency
            assert on_pod == {s for s, p in self.sessions.items() if p == pod}, pod
            assert bool(notified) == (pod in self.notified), pod
        for session in self.known:
            binding, score, tombstone = replies[i], replies[i + 1], replies[i + 2]
            i += 3
            pod = self.sessions.get(session)
            places = [
                bool(binding),
                score is not None,
                session in scope_sessions,
                any(session in replies[4 + 2 * j] for j in range(len(pods))),
            ]
            assert places == [pod is not None] * 4, (session, places)
            if pod is not None:
                assert binding["scope_id"] == sid and binding["pod_id"] == pod
                assert abs(float(binding["expiry"]) - score) < 1e-5
                ttl = self.ttls[session]
                assert binding["session_ttl"] == str(ttl)
                if session in self.expired:
                    assert score <= now, session
                else:  # placed, refreshed or touched within this run: by its own ttl
                    assert now + ttl - 30 < score <= now + ttl, session
            assert tombstone == self.tombstones.get(session), session

    def teardown(self) -> None:
        self.run(self.forget())

    async def forget(self) -> None:
        """Delete this run's keys and members (and nothing else)."""
        keys = [k async for k in self.redis.scan_iter(match=f"*{self.sid}*", count=500)]
        if keys:
            await self.redis.delete(*keys)
        # the indexes of no scope: the sessions' index entries, the scope's marks
        index = [K.session_scope(s) for s in self.known]
        if index:
            await self.redis.delete(*index)
        for name in ("expiry_due", "leased_scopes"):
            async for key in self.redis.scan_iter(match=f"{P}{name}:*", count=500):
                await self.redis.zrem(key, self.sid)
        for name in ("scope_registry", "scope_idle"):
            async for key in self.redis.scan_iter(match=f"{P}{name}:*", count=500):
                await (self.redis.hdel if name == "scope_registry" else self.redis.zrem)(
                    key, self.sid
                )


@pytest.mark.parametrize("backend", ["fake", "real", "sentinel", "cluster"])
def test_session_state_machine(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # reservations and markers must not lapse while an example runs (leases are tested alone)
    monkeypatch.setattr("agent_runtime.session_manager.state.ROUTE_LEASE", 600.0)
    run_redis_state_machine(backend, SessionMachine, steps=50)


async def test_a_newcomer_does_not_take_the_slot_a_waiter_is_queued_for(
    state: SessionState, redis: Redis
) -> None:
    await configure(redis, scope_concurrency=3, pod_concurrency=3)
    await add_pod(state, "p1")
    for i in range(3):
        await route(state, f"s{i}")
    await state.take_waiter_seat(SID, "r-w1", 30, 6)
    await state.take_waiter_seat(SID, "r-w2", 30, 6)
    await state.evict("s0")  # one slot frees: it is the queue's
    assert await route(state, "s-new", request_id="r-new") == ["scope_full", ""]
    assert (await route(state, "s-w1", request_id="r-w1", slow=True))[0] == "placed"
    assert await redis.zrange(K.waiters(SID), 0, -1) == ["r-w2"]
    # more free slots than waiters: a newcomer places in what the queue does not need
    await state.evict("s1")
    await state.evict("s2")
    assert (await route(state, "s-new2", request_id="r-new2"))[0] == "placed"
    assert await route(state, "s-new3", request_id="r-new3") == ["scope_full", ""]
    # a waiter whose seat lapsed (its replica died) no longer holds a slot back
    await redis.zadd(K.waiters(SID), {"r-w2": 1.0})
    assert (await route(state, "s-new3", request_id="r-new3b"))[0] == "placed"
