"""A route is one Redis round trip on its latency path (issue 17): what a placement's reply asks
of keys outside its script's slot — the session-scope index ``session_scope:{id}``, the scope's
expiry mark, a moved session's eviction in its old scope — is written after the reply
(``SessionState.index_writes``, ``jobs.DetachedWrites``): soon, in order, bounded, drained at
shutdown. Through HTTP, on fakeredis and the real Redis; the commands a request sends are
counted on its own path (a context variable the detached writer does not inherit).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

import contract_keys as K
from agent_runtime.db.engine import Database
from agent_runtime.jobs import DetachedWrites
from agent_runtime.session_manager.state import SessionState
from helpers import envelope, running_app, sync_body

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
GROUP = "g-idx"

ON_PATH: contextvars.ContextVar[bool] = contextvars.ContextVar("on_path", default=False)


class Sent:
    """Redis commands and round trips sent while ``ON_PATH`` is set: a plain command is one
    round trip, a pipeline one."""

    def __init__(self) -> None:
        self.commands: Counter[str] = Counter()
        self.round_trips = 0

    def reset(self) -> None:
        self.commands.clear()
        self.round_trips = 0


@pytest.fixture
def sent(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sent]:
    counted = Sent()
    command = redis.execute_command
    pipeline_execute = Pipeline.execute

    async def execute_command(*args: Any, **options: Any) -> Any:
        if ON_PATH.get():
            counted.commands[str(args[0]).upper()] += 1
            counted.round_trips += 1
        return await command(*args, **options)

    async def execute(self: Pipeline, raise_on_error: bool = True) -> Any:
        if ON_PATH.get():
            counted.commands["PIPELINE"] += 1
            counted.round_trips += 1
        return await pipeline_execute(self, raise_on_error)

    monkeypatch.setattr(redis, "execute_command", execute_command)
    monkeypatch.setattr(Pipeline, "execute", execute)
    yield counted


async def on_path(sent: Sent, call: Awaitable[httpx.Response]) -> httpx.Response:
    """The call with its Redis commands counted (from zero)."""
    sent.reset()
    token = ON_PATH.set(True)
    try:
        return await call
    finally:
        ON_PATH.reset(token)


async def configure(app: httpx.AsyncClient, bot: str) -> None:
    item = {
        "template_id": f"tpl-{bot}",
        "image": "agentserver:1",
        "ready_poll_interval": 0.02,
        "scope_concurrency": 20,
        "pod_concurrency": 20,
    }
    resp = await app.post(SYNC, json=sync_body("template", "create", item))
    assert resp.status_code == 200, resp.text
    rule = {"group_id": GROUP, "bot_id": bot, "template_id": item["template_id"]}
    resp = await app.post(SYNC, json=sync_body("routing_rule", "create", rule))
    assert resp.status_code == 200, resp.text


def route_body(session_id: str, bot: str = "b1", request_id: str | None = None) -> dict[str, Any]:
    ids = {"request_id": request_id} if request_id else {}
    return envelope(session_id=session_id, bot_id=bot, extra={"group_id": GROUP}, **ids)


def touch_body(session_id: str, bot: str | None = None) -> dict[str, Any]:
    if bot is None:
        return envelope(session_id=session_id)
    return envelope(session_id=session_id, bot_id=bot, extra={"group_id": GROUP})


def placement(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["data"]["placement"])


def state_of(app: httpx.AsyncClient) -> SessionState:
    state: SessionState = app.app.state.services.session_state  # type: ignore[attr-defined]
    return state


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    """A bounded poll (never a fixed sleep)."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"not reached within {within} s"
        await asyncio.sleep(0.01)


async def scope_id(redis: Redis, session_id: str) -> str | None:
    return await redis.get(K.sm_session_scope(session_id))


async def test_each_hot_path_call_is_one_round_trip_and_the_index_follows(
    redis: Redis, db: Database, sent: Sent
) -> None:
    async with running_app(redis, db) as app:
        await configure(app, "b1")
        assert placement(await app.post(ROUTE, json=route_body("s0"))) == "placed"  # a pod
        await state_of(app).index_writes.flush()
        assert (await app.post(TOUCH, json=touch_body("s0"))).json()["data"] == {"touched": True}
        # (the scripts are loaded: what is counted below is the steady state)

        placed = await on_path(sent, app.post(ROUTE, json=route_body("s1", request_id="r-1")))
        assert placement(placed) == "placed"
        assert (sent.round_trips, dict(sent.commands)) == (1, {"EVALSHA": 1}), "placed"
        scope = placed.json()["data"]

        # the index comes soon after (bounded), then touch without ids finds the session
        await eventually(lambda: _is(scope_id(redis, "s1"), lambda s: s is not None))
        touched = await on_path(sent, app.post(TOUCH, json=touch_body("s1")))
        assert touched.json()["data"] == {"touched": True}
        assert (sent.round_trips, dict(sent.commands)) == (2, {"GET": 1, "EVALSHA": 1})

        refresh = await on_path(sent, app.post(ROUTE, json=route_body("s1")))
        assert placement(refresh) == "refresh"
        assert (sent.round_trips, dict(sent.commands)) == (1, {"EVALSHA": 1}), "refresh"

        replay = await on_path(sent, app.post(ROUTE, json=route_body("s1", request_id="r-1")))
        assert replay.json()["data"] == scope
        assert (sent.round_trips, dict(sent.commands)) == (1, {"EVALSHA": 1}), "replay"

        named = await on_path(sent, app.post(TOUCH, json=touch_body("s1", "b1")))
        assert named.json()["data"] == {"touched": True}
        assert (sent.round_trips, dict(sent.commands)) == (1, {"EVALSHA": 1}), "touch, ids"

        # a refresh whose index is due (less than one ttl of it left) still answers in one
        # round trip: the index is rewritten after the reply
        sid = str(await scope_id(redis, "s1"))
        await redis.hset(K.sm_session(sid, "s1"), "index_until", "0")
        await redis.delete(K.sm_session_scope("s1"))
        due = await on_path(sent, app.post(ROUTE, json=route_body("s1")))
        assert placement(due) == "refresh"
        assert (sent.round_trips, dict(sent.commands)) == (1, {"EVALSHA": 1}), "refresh, due"
        await eventually(lambda: _is(scope_id(redis, "s1"), lambda s: s == sid))


async def _is(value: Awaitable[Any], test: Callable[[Any], bool]) -> bool:
    return test(await value)


async def test_a_session_routed_under_another_scope_is_evicted_from_the_old_one(
    redis: Redis, db: Database, sent: Sent
) -> None:
    async with running_app(redis, db) as app:
        await configure(app, "b1")
        await configure(app, "b2")
        assert placement(await app.post(ROUTE, json=route_body("m1", "b1"))) == "placed"
        assert placement(await app.post(ROUTE, json=route_body("m0", "b2"))) == "placed"  # a pod
        await eventually(lambda: _is(scope_id(redis, "m1"), lambda s: s is not None))
        old = str(await scope_id(redis, "m1"))
        assert await redis.sismember(K.sm_scope(old, "sessions"), "m1")

        moved = await on_path(sent, app.post(ROUTE, json=route_body("m1", "b2")))
        assert placement(moved) == "placed"
        assert (sent.round_trips, dict(sent.commands)) == (1, {"EVALSHA": 1})
        # after the reply: the index names the new scope, the old scope holds no seat
        await eventually(lambda: _is(scope_id(redis, "m1"), lambda s: s not in (None, old)))
        await eventually(
            lambda: _is(redis.sismember(K.sm_scope(old, "sessions"), "m1"), lambda x: not x)
        )
        assert not await redis.exists(K.sm_session(old, "m1"))
        assert (await app.post(TOUCH, json=touch_body("m1", "b1"))).json()["data"] == {
            "touched": False
        }
        assert (await app.post(TOUCH, json=touch_body("m1"))).json()["data"] == {"touched": True}


async def test_shutdown_writes_the_pending_index_writes(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as app:
        await configure(app, "b1")
        assert placement(await app.post(ROUTE, json=route_body("d0"))) == "placed"
        state = state_of(app)
        await state.index_writes.flush()
        write = state.write_indexes
        gate = asyncio.Event()

        async def held(writes: Any) -> None:  # the writer is slow: the stop must wait for it
            await gate.wait()
            await write(writes)

        state.index_writes._write = held  # the writer calls what it was given
        answers = await asyncio.gather(
            *(app.post(ROUTE, json=route_body(f"d{i}")) for i in range(1, 6))
        )
        assert [placement(a) for a in answers] == ["placed"] * 5
        assert [await scope_id(redis, f"d{i}") for i in range(1, 6)] == [None] * 5
        asyncio.get_running_loop().call_later(0.05, gate.set)
    # the lifespan's stop drained them before it closed
    assert None not in [await scope_id(redis, f"d{i}") for i in range(1, 6)]


# --- DetachedWrites on its own ----------------------------------------------------------------


async def test_detached_writes_keep_order_bound_and_count() -> None:
    written: list[list[int]] = []
    counts: Counter[str] = Counter()
    gate = asyncio.Event()

    async def write(batch: list[int]) -> None:
        await gate.wait()
        if -1 in batch:
            raise RuntimeError("refused")
        written.append(batch)

    writes = DetachedWrites[int](
        write, name="t", pending=2, batch=2, timeout=2.0,
        counted=lambda outcome, n: counts.update({outcome: n}),
    )  # fmt: skip
    await writes.put(0)
    await writes.put(1)
    await asyncio.sleep(0)  # the worker took [0, 1] and waits at the gate
    await writes.put(2)
    await writes.put(3)  # 2 pending: the bound
    beyond = asyncio.create_task(writes.put(4))
    await asyncio.sleep(0)
    assert not beyond.done()  # waits for room
    gate.set()
    await asyncio.wait_for(beyond, 2.0)
    await writes.flush()
    assert written == [[0, 1], [2, 3], [4]]
    await writes.put(-1)
    await writes.drain()
    assert counts == {"written": 5, "waited": 1, "failed": 1}
    await writes.put(7)  # after the drain: written at once
    assert written[-1] == [7] and counts["inline"] == 1


async def test_detached_writes_drop_a_write_that_finds_no_room_in_time() -> None:
    counts: Counter[str] = Counter()
    stuck = asyncio.Event()

    async def write(batch: list[int]) -> None:
        while not stuck.is_set():  # a write that outlives its deadline (ignores the cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await stuck.wait()

    writes = DetachedWrites[int](
        write, name="t", pending=1, batch=1, timeout=0.1,
        counted=lambda outcome, n: counts.update({outcome: n}),
    )  # fmt: skip
    await writes.put(1)
    await asyncio.sleep(0)  # the worker took it: stuck
    await writes.put(2)  # pending: the bound
    await writes.put(3)  # no room within 0.1 s: dropped, counted
    assert counts == {"waited": 1, "dropped": 1}
    stuck.set()
    await asyncio.wait_for(writes.drain(), 2.0)
    assert counts == {"waited": 1, "dropped": 1, "written": 2}


async def test_an_index_write_the_server_refuses_is_sent_again_and_keeps_its_before(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot moving or a master failing over refuses a command of the batch (TRYAGAIN, a
    connection lost): the refused ones are sent again after a pause, each with its own
    ``GET`` reply, so the index survives a failover's window and a moved session's old
    binding is still seen."""
    from redis.exceptions import ResponseError

    from agent_runtime.session_manager.state import IndexWrite

    state = SessionState(redis)
    await redis.set(K.sm_session_scope("s-moved"), "old-scope")
    refusals = iter([ResponseError("TRYAGAIN Multiple keys request during rehashing of slot")])
    pipeline_execute = Pipeline.execute

    async def execute(self: Pipeline, raise_on_error: bool = True) -> Any:
        results = await pipeline_execute(self, raise_on_error)
        refusal = next(refusals, None)
        if refusal is not None:  # the first command refused, as a node in the middle of a move
            await redis.set(K.sm_session_scope("s-moved"), "old-scope")  # (not applied)
            results[0] = refusal
        return results

    monkeypatch.setattr(Pipeline, "execute", execute)
    evicted: list[tuple[str, str]] = []

    async def evict(session_id: str, *, scope_id: str) -> None:
        evicted.append((session_id, scope_id))

    monkeypatch.setattr(state, "evict", evict)
    writes = [IndexWrite("s-moved", "new-scope", 60, moved=True), IndexWrite("s-2", "b", 60)]
    await state.write_indexes(writes)
    assert await redis.get(K.sm_session_scope("s-moved")) == "new-scope"
    assert await redis.get(K.sm_session_scope("s-2")) == "b"
    assert evicted == [("s-moved", "old-scope")], "the retried SET … GET's own reply counts"
