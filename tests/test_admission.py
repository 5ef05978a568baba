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


async def test_overload_ends_when_a_place_goes_spare_not_when_shedding_empties_the_stack() -> None:
    """The old rule took a stack emptied by shedding for a drained burst, so every shed wave
    gave the next arrivals the long burst wait again (served p99 0.5-3 s at 2 x capacity)."""
    loop = asyncio.get_running_loop()
    adm = Admission(1, queue=10, burst_wait=1.0)
    holder = await adm.enter(reserve=False)
    assert holder is not None

    async def wait_once() -> tuple[bool, float]:
        started = loop.time()
        ticket = await adm.enter(reserve=False)
        if ticket is not None:
            adm.leave(ticket)
        return ticket is not None, loop.time() - started

    first = await wait_once()  # a burst: it waits the whole burst wait, then is shed
    assert first[0] is False and first[1] >= 1.0
    assert adm.waiting == 0  # shedding emptied the stack ...
    second = await wait_once()  # ... yet the backlog stands: overload, shed in milliseconds
    assert second[0] is False and second[1] < 1.0
    adm.leave(holder)  # nobody waits for this place: it goes spare, the backlog is gone
    again = await adm.enter(reserve=False)  # a spare place: taken at once
    assert again is not None
    third = asyncio.create_task(wait_once())  # a new backlog: a burst again, the long wait
    await asyncio.sleep(0.1)
    assert not third.done()
    adm.leave(again)
    assert (await third)[0] is True
    assert adm.active == 0 and adm.waiting == 0


async def test_under_overload_a_waiting_touch_is_served_however_long_it_waited() -> None:
    """A touch frees what a route took: under overload stale routes are shed when a place
    frees, a touch keeps its place on its own stack and is served first."""
    adm = Admission(1, queue=10, burst_wait=0.5)
    holders = [await adm.enter(reserve=True) for _ in range(2)]  # the touch room is full too
    assert all(holders)
    route = await adm.enter(reserve=False)
    assert route is None  # waited its burst wait: shed; the backlog stands
    touch = asyncio.create_task(adm.enter(reserve=True))
    stale_route = asyncio.create_task(adm.enter(reserve=False))
    assert await stale_route is None  # a route under overload: shed within OVERLOAD_WAIT
    assert not touch.done()  # a touch waits its own (burst) wait
    first = holders[0]
    assert first is not None
    adm.leave(first)
    ticket = await touch
    assert ticket is not None
    adm.leave(ticket)
    last = holders[1]
    assert last is not None
    adm.leave(last)
    assert adm.active == 0 and adm.waiting == 0
