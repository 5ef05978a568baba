"""The shared seat gate (``lua_shared/seat_gate.lua``): one script for a bounded room of seats
with fractional lease deadlines: the session manager's wait queue (``waiter_gate``). On
fakeredis and real Redis.

Its atomic semantics, called as the shared ground registers it: ZCARD never above the limit
under many concurrent callers (one client and several: real concurrency on the real server),
deadlines to the microsecond (a seat held 0.5 s lapses after 0.5 s, not at the next whole
second; checked against Redis TIME read around each call, so a slow machine makes a try
inconclusive and it is tried again, never a false failure), a replay keeps its seat, a refused
member is not kept. Timing is only ever compared with Redis's own clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime import lua
from agent_runtime.session_manager.state import SessionState
from helpers import other_client

pytestmark = pytest.mark.topologies

ROOM = "seat_gate_test:room"


async def take(gate: Any, member: str, hold: float, limit: int) -> int:
    """1: seated (a new seat, or a renewal), 0: refused."""
    return 0 if await gate_reply(gate, member, hold, limit) == "0" else 1


async def gate_reply(gate: Any, member: str, hold: float, limit: int) -> str:
    """The script's reply as it is: "0" refused, "1" renewed, else the new seat's deadline."""
    return str(await gate(keys=[ROOM], args=[member, hold, limit]))


async def rnow(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1_000_000


async def seats(redis: Redis) -> set[str]:
    return set(await redis.zrange(ROOM, 0, -1))


@pytest.fixture
def gate(redis: Redis) -> Any:
    return lua.register(redis, lua.SHARED, "seat_gate")


async def test_seats_up_to_the_limit_and_a_refused_member_is_not_kept(
    gate: Any, redis: Redis
) -> None:
    taken = [await take(gate, f"m{i}", 30, 3) for i in range(5)]
    assert taken == [1, 1, 1, 0, 0]
    assert await seats(redis) == {"m0", "m1", "m2"}
    # a new seat's reply is its deadline (the caller marks its prune index with it); a renewal's 1
    deadline = await gate_reply(gate, "m9", 30, 4)
    assert float(deadline) == pytest.approx(await redis.zscore(ROOM, "m9"), abs=1e-6)
    assert await gate_reply(gate, "m9", 30, 4) == "1"
    await redis.zrem(ROOM, "m9")
    # a refused member asking again (its reply lost) is refused again, and still not kept
    assert await take(gate, "m3", 30, 3) == 0
    assert await seats(redis) == {"m0", "m1", "m2"}
    await redis.zrem(ROOM, "m0")  # a member leaves (what its caller does when done)
    assert await take(gate, "m3", 30, 3) == 1
    assert await seats(redis) == {"m1", "m2", "m3"}


async def test_limit_zero_refuses_everyone_and_indexes_nothing(gate: Any, redis: Redis) -> None:
    assert await take(gate, "m1", 30, 0) == 0
    assert await take(gate, "m1", 30, 0) == 0
    assert not await redis.exists(ROOM)


async def test_a_replay_keeps_the_seat_and_renews_its_deadline(gate: Any, redis: Redis) -> None:
    assert await take(gate, "m1", 30, 2) == 1
    assert await take(gate, "m2", 30, 2) == 1
    first = await redis.zscore(ROOM, "m1")
    assert await take(gate, "m1", 30, 2) == 1, "the same call again: the seat is kept"
    assert await take(gate, "m1", 30, 2) == 1, "and again (a renewal is this call too)"
    renewed = await redis.zscore(ROOM, "m1")
    assert first is not None and renewed is not None and renewed >= first
    assert await redis.zcard(ROOM) == 2
    assert await take(gate, "m3", 30, 2) == 0


async def test_seats_past_their_deadline_leave_at_the_next_call(gate: Any, redis: Redis) -> None:
    """A crashed caller's seat lapses by its score: the next caller finds the room free."""
    now = await rnow(redis)
    await redis.zadd(ROOM, {"crashed-1": now - 0.001, "crashed-2": now - 100, "alive": now + 100})
    assert await take(gate, "m1", 30, 2) == 1
    assert await seats(redis) == {"alive", "m1"}
    assert await take(gate, "m2", 30, 2) == 0


@pytest.mark.parametrize("hold", [0.5, 0.25, 1.75])
async def test_a_deadline_is_redis_time_to_the_microsecond_plus_the_hold(
    gate: Any, redis: Redis, hold: float
) -> None:
    """The seat's score lies between TIME read before and after the call, plus the hold. A
    gate on whole seconds would score floor(TIME) + hold: below that whenever the call falls
    within one second that has already begun (the tries where it does not are set aside)."""
    for _ in range(50):
        await redis.delete(ROOM)
        before = await rnow(redis)
        assert await take(gate, "m1", hold, 1) == 1
        after = await rnow(redis)
        score = await redis.zscore(ROOM, "m1")
        assert score is not None
        assert before + hold - 1e-6 <= score <= after + hold + 1e-6, (before, score, after)
        if math.floor(before) == math.floor(after) and before - math.floor(before) > 0.001:
            return  # a whole-second gate could not have passed this try
    pytest.fail("no try fell within one second of the Redis clock")


async def test_a_half_second_seat_lapses_after_half_a_second_not_a_whole_one(
    gate: Any, redis: Redis
) -> None:
    """Limit 1, a seat held 0.5 s: another member is refused while Redis TIME is before the
    seat's deadline, and seated once TIME has passed it — within the same whole second of the
    seat's start. A try the machine was too slow to judge (TIME past the deadline already at
    the first check, or a whole second gone by at the second) is set aside and made again."""
    for _ in range(20):
        await redis.delete(ROOM)
        started = await rnow(redis)
        assert await take(gate, "m1", 0.5, 1) == 1
        deadline = await redis.zscore(ROOM, "m1")
        assert deadline is not None and deadline >= started + 0.5 - 1e-6
        refused = await take(gate, "m2", 0.5, 1)
        if await rnow(redis) >= deadline:
            continue  # the refusal cannot be judged: the seat may have lapsed meanwhile
        assert refused == 0, "a seat is held until its deadline"
        while (now := await rnow(redis)) <= deadline:  # noqa: ASYNC110 (Redis clock)
            await asyncio.sleep(0.02)
        if now >= started + 1:
            continue  # too late to tell half a second from a whole one
        assert await take(gate, "m2", 0.5, 1) == 1, "the seat lapsed at its deadline"
        assert await seats(redis) == {"m2"}
        return
    pytest.fail("the machine was never quick enough to judge a try")


@pytest.mark.parametrize("clients", [1, 4])
async def test_the_limit_holds_under_many_concurrent_callers(redis: Redis, clients: int) -> None:
    """100 calls at once (some members twice: replays), while a watcher reads ZCARD on its own
    connection: never above the limit, and exactly the members told "seated" hold the seats."""
    extra = [other_client(redis) for _ in range(clients)]
    gates = [lua.register(c, lua.SHARED, "seat_gate") for c in [redis, *extra[1:]]]
    limit, observed = 7, [0]
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            observed.append(int(await extra[0].zcard(ROOM)))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        members = [f"m{i % 80}" for i in range(100)]  # ≤ 100: a client's pool
        taken = await asyncio.gather(
            *(take(gates[i % len(gates)], m, 30, limit) for i, m in enumerate(members))
        )
    finally:
        done.set()
        await watcher
        for client in extra:
            await client.aclose()
    assert max(observed) <= limit
    seated = {m for m, ok in zip(members, taken, strict=True) if ok}
    assert len(seated) == limit
    assert await seats(redis) == seated


@pytest.mark.parametrize("clients", [1, 3])
async def test_callers_that_come_and_go_never_hold_more_seats_than_the_limit(
    redis: Redis, clients: int
) -> None:
    """Workers take a seat, hold it a moment, leave (ZREM), again and again: the holders the
    callers believe in (counted from a "seated" reply to their leaving) never exceed the
    limit, nor does ZCARD; every seat is given back at the end."""
    extra = [other_client(redis) for _ in range(clients - 1)]
    clients_ = [redis, *extra]
    gates = [lua.register(c, lua.SHARED, "seat_gate") for c in clients_]
    limit = 3
    holders, most, refused = [0], [0], [0]

    async def worker(n: int) -> None:
        client, gate = clients_[n % len(clients_)], gates[n % len(gates)]
        for round_ in range(15):
            member = f"w{n}-{round_}"
            if await take(gate, member, 30, limit):
                holders[0] += 1
                most[0] = max(most[0], holders[0])
                assert await client.zcard(ROOM) <= limit
                await asyncio.sleep(0)
                holders[0] -= 1
                await client.zrem(ROOM, member)
            else:
                refused[0] += 1
                assert await client.zscore(ROOM, member) is None, "a refused seat is not kept"

    try:
        await asyncio.gather(*(worker(n) for n in range(12)))
    finally:
        for client in extra:
            await client.aclose()
    assert 1 <= most[0] <= limit
    assert await redis.zcard(ROOM) == 0


async def test_the_wait_queue_is_the_shared_script(redis: Redis) -> None:
    """SessionState's waiter_gate sends the shared gate's SHA (its keys and args as the
    script's header lists them are checked in test_sm_scripts)."""
    shared = hashlib.sha1(lua.source(lua.SHARED, "seat_gate").encode()).hexdigest()
    assert SessionState(redis)._waiter_gate.sha == shared
