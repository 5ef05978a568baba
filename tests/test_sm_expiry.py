"""Session expiry with one expiry set per scope (issue 17): a placement that moves its scope's
earliest expiry earlier marks the scope in ``expiry_due`` (a bucket per ``{bNN}``), the sweeper
walks the buckets, evicts what is due and settles each scope with its next expiry; a mark lost
with a replica that died between the script and the mark is made again by the safety walk, so
no session is left behind. On fakeredis, the real Redis, the Sentinel set and the cluster.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime.scope_buckets import bucket_of
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState, _placement, _route_call
from agent_runtime.session_manager.sweeper import SessionSweeper

pytestmark = pytest.mark.topologies

P = "session_manager:"
SID = "scope-exp"
TTL = 60


def due_key(sid: str = SID) -> str:
    return f"{P}expiry_due:{{b{bucket_of(sid):02d}}}"


def expiry_key(sid: str = SID) -> str:
    return f"{P}scope:{{{sid}}}:session_expiry"


def session_key(session_id: str, sid: str = SID) -> str:
    return f"{P}session:{{{sid}}}:{session_id}"


class Resources:
    async def idle_consider(self, pod_id: str, scope_id: str) -> None:
        return None

    async def expire_scope(self, scope_id: str) -> bool:
        return False


@pytest.fixture
async def state(redis: Redis) -> SessionState:
    policy = {"scope_concurrency": "10", "pod_concurrency": "10", "max_pods": "1"}
    await redis.hset(f"{P}scope:{{{SID}}}:config", mapping={**policy, "session_ttl": str(TTL)})
    await redis.hset(f"{P}scope_registry:{{b{bucket_of(SID):02d}}}", SID, json.dumps(["g", "b"]))
    state = SessionState(redis)
    await state.register_pod(SID, "p1", "http://p1", "")
    return state


def sweeper(state: SessionState) -> SessionSweeper:
    resources: Any = Resources()
    return SessionSweeper(state=state, scopes=ScopeState(state.redis), resources=resources)


async def route(state: SessionState, session_id: str) -> str:
    placement = await state.route_place(
        request_id=uuid.uuid4().hex, session_id=session_id, scope_id=SID, token="t"
    )
    await state.index_writes.flush()  # the expiry mark is written after the reply
    return placement.action.value


async def expire(redis: Redis, session_id: str, when: float = 1.0) -> None:
    """Time passes for the session: its expiry (hash and set) moves to ``when``."""
    await redis.hset(session_key(session_id), "expiry", f"{when:.6f}")
    await redis.zadd(expiry_key(), {session_id: when})


async def gone(redis: Redis, session_id: str) -> bool:
    return not (
        await redis.exists(session_key(session_id))
        or await redis.zscore(expiry_key(), session_id) is not None
        or await redis.sismember(f"{P}scope:{{{SID}}}:sessions", session_id)
        or await redis.sismember(f"{P}pod:{{{SID}}}:p1:sessions", session_id)
    )


async def test_the_first_placement_marks_the_scope_at_its_expiry(
    state: SessionState, redis: Redis
) -> None:
    assert await route(state, "s1") == "placed"
    first = await redis.zscore(expiry_key(), "s1")
    assert await redis.zscore(due_key(), SID) == pytest.approx(first, abs=1e-5)
    assert await route(state, "s2") == "placed"  # later: the mark stays where it was
    assert await redis.zscore(due_key(), SID) == pytest.approx(first, abs=1e-5)
    assert await route(state, "s1") == "refresh"  # a refresh only moves later: no mark
    assert await redis.zscore(due_key(), SID) == pytest.approx(first, abs=1e-5)


async def test_the_sweeper_expires_what_is_due_and_settles_the_scope_with_its_next(
    state: SessionState, redis: Redis
) -> None:
    for session_id in ("s1", "s2", "s3"):
        assert await route(state, session_id) == "placed"
    await expire(redis, "s1")
    await expire(redis, "s2", 2.0)
    await redis.zadd(due_key(), {SID: 1.0})  # its time has come (instead of waiting TTL s)
    assert await sweeper(state).expire_once() == 2
    assert await gone(redis, "s1") and await gone(redis, "s2")
    s3 = await redis.zscore(expiry_key(), "s3")
    assert await redis.zscore(due_key(), SID) == pytest.approx(s3, abs=1e-5), "settled: next"
    assert await sweeper(state).expire_once() == 0, "nothing more due"
    await expire(redis, "s3")
    await redis.zadd(due_key(), {SID: 1.0})
    assert await sweeper(state).expire_once() == 1
    assert await redis.zscore(due_key(), SID) is None, "no session left: out of the index"


async def test_a_session_not_due_is_not_evicted_and_the_mark_moves_on(
    state: SessionState, redis: Redis
) -> None:
    assert await route(state, "s1") == "placed"
    await redis.zadd(due_key(), {SID: 1.0})  # due (a stale mark), but s1 is not
    assert await sweeper(state).expire_once() == 0
    assert not await gone(redis, "s1")
    expiry = await redis.zscore(expiry_key(), "s1")
    assert await redis.zscore(due_key(), SID) == pytest.approx(expiry, abs=1e-5)


async def test_a_mark_lost_between_script_and_mark_is_found_by_the_safety_walk(
    state: SessionState, redis: Redis
) -> None:
    """The replica placed the session (the script ran) and died before it marked the scope:
    the expiry pass cannot see it until the safety walk, which walks the registry, marks it."""
    keys, args = _route_call("r-lost", "lost", SID, "t", False)
    raw = _placement(await state._route_place(keys=keys, args=args))  # no mark after it
    assert raw.action.value == "placed" and raw.due is not None
    assert await redis.zscore(due_key(), SID) is None
    await expire(redis, "lost")
    jobs = sweeper(state)
    assert await jobs.expire_once() == 0, "unmarked: not seen"
    # a pass of the safety walk over the registry's buckets (8 bucket pages a tick)
    assert sum([await jobs.safety_once() for _ in range(8)]) == 1
    assert await redis.zscore(due_key(), SID) == 1.0
    assert await jobs.expire_once() == 1
    assert await gone(redis, "lost")
    assert sum([await jobs.safety_once() for _ in range(8)]) == 0, "nothing left to mark"
