"""The watch stream end to end: ``agent-runtime serve --mode server`` over the simulator's
watch API (kubernetes_asyncio's ``watch.Watch``), real Redis, MariaDB.

The watch pass and reconcile tick once at start and then an hour later, so only the stream
can clean a pod killed in the simulator in time. The stream is cut (``/_sim/watches/drop``,
closed cleanly or reset mid-stream) and compacted (``/_sim/watches/compact``) under it: it
resumes from its resourceVersion, or lists again on the 410 and still finds a death that
happened while it was away. The stack and scenarios are ``test_server_e2e``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from test_server_e2e import _LOG_FROM, SETTINGS, Scenario, Stack, stack_with, w

__all__ = ["_LOG_FROM", "w"]  # the scenario fixture, over this module's stack

pytestmark = pytest.mark.timeout(120)

# only the stream may notice: the pass and reconcile tick at start, then in an hour
STREAM_ONLY = {
    **SETTINGS,
    "AGENT_RUNTIME_WATCH_INTERVAL": "3600",
    "AGENT_RUNTIME_RECONCILE_INTERVAL": "3600",
}


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from stack_with(request, tmp_path_factory, "mariadb", STREAM_ONLY)


async def metric(s: Scenario, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` that carry ``labels`` (unlabelled ones too)."""
    total = 0.0
    for line in (await s.http.get("/metrics")).text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


async def streaming(s: Scenario) -> None:
    async def check() -> bool:
        return await metric(s, "agent_runtime_pod_watch_streams") >= 1

    await s.eventually(check, "the server streams")


async def cleaned_and_rebound(s: Scenario, session_id: str, dead: str) -> dict[str, Any]:
    await s.eventually(s.forgotten(dead), f"the stream cleans {dead}")
    await s.eventually(s.gone(session_id, dead), "its session is evicted")
    again = await s.routed(session_id)
    assert again["placement"] == "rebound" and again["previous_pod_id"] == dead, again
    return again


async def drop(s: Scenario, mode: str) -> None:
    resp = await s.sim.post("/_sim/watches/drop", json={"mode": mode})
    assert resp.status_code == 200, resp.text
    assert resp.json()["dropped"] >= 1, "the server had a stream open"


@pytest.mark.parametrize("mode", ["fail", "vanish", "crash"])
async def test_s_a_pod_killed_is_cleaned_by_the_stream(w: Scenario, mode: str) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)
    await streaming(w)
    dead = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == dead
    by_stream = await metric(w, "agent_runtime_dead_pods_cleaned_total", by="stream")
    await w.kill(dead, mode)
    again = await cleaned_and_rebound(w, "s1", dead)
    assert await w.routed("s2") == {**again, "placement": "rebound"}

    async def deleted() -> bool:
        return dead not in await w.sim_pods()

    await w.eventually(deleted, "a dead pod that still exists is deleted")
    assert await metric(w, "agent_runtime_dead_pods_cleaned_total", by="stream") == by_stream + 1
    assert await metric(w, "agent_runtime_dead_pods_cleaned_total", by="pass") == 0
    await w.assert_consistent()


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_t_a_dropped_stream_resumes(w: Scenario, how: str) -> None:
    await w.configure()
    await streaming(w)
    dead = (await w.routed("s1"))["pod_id"]
    restarts = await metric(w, "agent_runtime_pod_watch_restarts_total")
    await drop(w, how)

    async def restarted() -> bool:
        return await metric(w, "agent_runtime_pod_watch_restarts_total") > restarts

    await w.eventually(restarted, "the dropped stream is counted")
    await streaming(w)
    await w.kill(dead, "fail")
    await cleaned_and_rebound(w, "s1", dead)


async def test_u_a_410_lists_again_and_finds_the_death_it_missed(w: Scenario) -> None:
    await w.configure()
    await streaming(w)
    dead = (await w.routed("s1"))["pod_id"]
    expired = await metric(w, "agent_runtime_pod_watch_restarts_total", reason="expired")
    relists = await metric(w, "agent_runtime_pod_watch_relists_total")
    # the next WATCH request waits 2 s at the API server's door: the stream, cut now, is away
    # while the pod dies and the history that would tell it is compacted
    fault = await w.add_fault(kind="latency", seconds=2.0, verb="watch", count=1)
    try:
        await drop(w, "close")
        await w.kill(dead, "fail")
        compacted = await w.sim.post("/_sim/watches/compact")
        assert compacted.status_code == 200, compacted.text
        await cleaned_and_rebound(w, "s1", dead)
    finally:
        with contextlib.suppress(AssertionError):  # spent (count 1): gone already
            await w.remove_fault(fault)
    assert await metric(w, "agent_runtime_pod_watch_restarts_total", reason="expired") > expired
    assert await metric(w, "agent_runtime_pod_watch_relists_total") > relists
