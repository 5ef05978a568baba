"""SingleFlight: concurrent callers of one key share one call (resolve and acquire use it)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from agent_runtime.single_flight import SingleFlight


async def test_concurrent_callers_of_a_key_share_one_call_and_the_key_frees_after() -> None:
    flight: SingleFlight[str, int] = SingleFlight()
    calls = 0
    gate = asyncio.Event()

    async def work() -> int:
        nonlocal calls
        calls += 1
        mine = calls  # which call this is
        await gate.wait()
        return mine

    waiters = [asyncio.create_task(flight.run("a", work)) for _ in range(5)]
    other = asyncio.create_task(flight.run("b", work))
    await asyncio.sleep(0.01)
    gate.set()
    assert await asyncio.gather(*waiters) == [1] * 5, "every caller of a key: the one call"
    assert await other == 2, "another key: its own call"
    assert calls == 2
    assert await flight.run("a", work) == 3, "a later caller starts afresh"


async def test_an_exception_reaches_every_caller() -> None:
    flight: SingleFlight[str, int] = SingleFlight()

    async def fail() -> int:
        await asyncio.sleep(0.01)
        raise ValueError("boom")

    results = await asyncio.gather(
        *(flight.run("k", fail) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, ValueError) for r in results)


async def test_the_first_caller_going_away_does_not_cancel_the_call_for_the_others() -> None:
    flight: SingleFlight[str, str] = SingleFlight()
    gate = asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "done"

    first = asyncio.create_task(flight.run("k", work))
    await asyncio.sleep(0)
    second = asyncio.create_task(flight.run("k", work))
    await asyncio.sleep(0)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    gate.set()
    assert await second == "done"
    with pytest.raises(asyncio.CancelledError):
        await first
