"""The admission stack's order and its overload rule, driven directly (the HTTP tests in
test_http_edge_requests.py cover the edge through the app)."""

from __future__ import annotations

import asyncio

from agent_runtime.admission import Admission


async def test_newest_waiter_first_and_a_standing_backlog_sheds_the_old_ones() -> None:
    adm = Admission(1, queue=10, burst_wait=0.2)
    holder = await adm.enter(reserve=False)
    assert holder is not None
    order: list[str] = []

    async def wait(name: str) -> None:
        ticket = await adm.enter(reserve=False)
        order.append(name if ticket is not None else f"{name}:shed")
        if ticket is not None:
            adm.leave(ticket)

    old = asyncio.create_task(wait("old"))
    await asyncio.sleep(0.01)
    new = asyncio.create_task(wait("new"))
    await asyncio.sleep(0.01)
    adm.leave(holder)  # a burst (backlog younger than burst_wait): newest first, all served
    await asyncio.gather(old, new)
    assert order == ["new", "old"]
    assert adm.active == 0 and adm.waiting == 0

    # a backlog that outlives burst_wait is overload: a waiter older than 5 ms is shed when
    # a place frees, the newcomer is served
    order.clear()
    holder = await adm.enter(reserve=False)
    assert holder is not None
    stale = asyncio.create_task(wait("stale"))
    await asyncio.sleep(0.3)  # past burst_wait: the stale one's own wait ran out
    assert order == ["stale:shed"]
    await stale
    assert adm.waiting == 0 and adm.shed == 1
    adm.leave(holder)
    assert adm.active == 0


async def test_a_cancelled_waiter_passes_a_handed_place_on() -> None:
    adm = Admission(1, queue=10, burst_wait=5)
    holder = await adm.enter(reserve=False)
    assert holder is not None
    first = asyncio.create_task(adm.enter(reserve=False))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(adm.enter(reserve=False))
    await asyncio.sleep(0.01)
    second.cancel()  # goes away before any place frees: it leaves the stack
    await asyncio.gather(second, return_exceptions=True)
    assert adm.waiting == 1
    adm.leave(holder)
    ticket = await first
    assert ticket is not None and adm.active == 1
    adm.leave(ticket)
    assert adm.active == 0 and adm.waiting == 0


async def test_touch_passes_waiting_routes_and_has_its_own_room() -> None:
    adm = Admission(1, queue=10, burst_wait=5)
    route = await adm.enter(reserve=False)
    assert route is not None
    waiting_route = asyncio.create_task(adm.enter(reserve=False))
    await asyncio.sleep(0.01)
    touch = await adm.enter(reserve=True)  # past the waiting route, in the touch's room
    assert touch is not None and adm.active == 2
    adm.leave(touch)
    adm.leave(route)
    ticket = await waiting_route
    assert ticket is not None
    adm.leave(ticket)
    assert adm.active == 0
