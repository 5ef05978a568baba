"""A gateway's report of a failed pod end to end: ``agent-runtime serve --mode server`` over
the simulator, real Redis, MariaDB, with the watch stream off and the pass an hour away, so
only the report (route's ``rawdata.failed_pod_id``) can clean a pod: the route that carries
it answers ``rebound``. A healthy pod reported is never touched, and costs one probe a second.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from helpers import envelope
from test_pod_watch_e2e import STREAM_ONLY, metric
from test_server_e2e import _LOG_FROM, GATEWAY, ROUTE, Scenario, Stack, stack_with, w

__all__ = ["_LOG_FROM", "w"]  # the scenario fixture, over this module's stack

pytestmark = pytest.mark.timeout(120)

WINDOW = 1.0  # one probe per pod per window (api.md)
REPORT_ONLY = {**STREAM_ONLY, "AGENT_RUNTIME_POD_WATCH_STREAM": "false"}


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from stack_with(request, tmp_path_factory, "mariadb", REPORT_ONLY)


async def reported(s: Scenario, session_id: str, pod_id: str) -> dict[str, Any]:
    rid = s.rid(uuid.uuid4().hex[:8])
    body = envelope(
        {"failed_pod_id": pod_id},
        request_id=rid,
        session_id=s.sid(session_id),
        bot_id=s.bot,
        extra={"group_id": s.group},
    )
    resp = await s.http.post(ROUTE, json=body, headers=GATEWAY)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


async def probes(s: Scenario) -> float:
    return await metric(s, "agent_runtime_k8s_calls_total", verb="probe_health")


@pytest.mark.parametrize("mode", ["fail", "vanish", "crash"])
async def test_r_a_dead_pod_reported_is_rebound_in_that_call(w: Scenario, mode: str) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)
    dead = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == dead
    await w.kill(dead, mode)
    again = await reported(w, "s1", dead)
    assert again["placement"] == "rebound" and again["previous_pod_id"] == dead, again
    assert await w.forgotten(dead)()
    assert await w.routed("s2") == {**again, "placement": "rebound"}
    assert await metric(w, "agent_runtime_dead_pods_cleaned_total", by="pass") == 0
    await w.assert_consistent()


async def test_r_a_half_dead_pod_goes_at_its_second_failed_probe(w: Scenario) -> None:
    await w.configure()
    pod = (await w.routed("s1"))["pod_id"]
    fault = await w.add_fault(kind="health", mode="500", name=pod)
    try:
        first = await reported(w, "s1", pod)
        assert first["placement"] == "refresh" and first["pod_id"] == pod, "one failure is no proof"

        async def window_over() -> bool:
            pattern = f"resource_manager:resource:pod:{{*}}:{pod}:reported"  # under its scope
            return not [k async for k in w.redis.scan_iter(match=pattern)]

        await w.eventually(window_over, "the report's window ends")
        again = await reported(w, "s1", pod)
        assert again["placement"] == "rebound" and again["previous_pod_id"] == pod, again
    finally:
        await w.remove_fault(fault)


async def test_r_a_healthy_pod_reported_is_untouched_and_probed_once_a_second(
    w: Scenario,
) -> None:
    await w.configure()
    pod = (await w.routed("s1"))["pod_id"]
    before = await probes(w)
    started = time.monotonic()
    for _ in range(4):
        answer = await reported(w, "s1", pod)
        assert answer["placement"] == "refresh" and answer["pod_id"] == pod
    seconds = time.monotonic() - started
    # never more than one probe a second (however slow the machine made the four reports)
    assert 1 <= await probes(w) - before <= 1 + int(seconds / WINDOW)
    assert pod in await w.sim_pods() and await w.pod_known(pod)
    assert await metric(w, "agent_runtime_pod_reports_total", outcome="healthy") >= 4
