"""A gateway's report of a failed pod (route's ``rawdata.failed_pod_id``), through the app,
and ``pod_report.lua``'s window on its own.

The apps here run no jobs (no stream, no pass): only the report can clean a pod. A dead
pod's session is ``rebound`` in the very call that reports it; a healthy pod is never
touched, and a pod costs one probe per second however often it is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.report_state import ReportState
from agent_runtime.resource_manager.state import ResourceState
from contract_keys import rm_pod, rm_pod_known
from helpers import envelope, other_client, running_app, session_hashes
from test_pod_watch import App, eventually

SQLITE = pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)  # the app tests'

WINDOW = 1.0  # one probe per pod per this (pod_reports.REPORT_WINDOW, as documented)


@contextlib.asynccontextmanager
async def app(
    redis: Redis, db: Database, k8s: FakeK8sPodClient, **settings: Any
) -> AsyncIterator[App]:
    async with running_app(redis, db, k8s=k8s, **settings) as client:
        a = App(client)
        await a.configure()
        yield a


async def window_over(redis: Redis, pod: str) -> None:
    """Until the pod's report window has ended (a next report probes again)."""

    async def ended() -> bool:
        return not [k async for k in redis.scan_iter(match=rm_pod("*", pod, "reported"))]

    await eventually(ended, "the report window ends", within=10 * WINDOW)


async def reported(a: App, session_id: str, pod_id: Any) -> dict[str, Any]:
    data = await a.routed(session_id, failed_pod_id=pod_id)
    return data


@SQLITE
async def test_a_dead_pod_reported_is_rebound_in_the_same_call(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        pod = (await a.routed("s1"))["pod_id"]
        assert (await a.routed("s2"))["pod_id"] == pod
        k8s.kill(pod)  # Failed: /health does not answer, Kubernetes says dead
        assert (await a.routed("s1"))["pod_id"] == pod, "nobody else noticed (no jobs)"
        again = await reported(a, "s1", pod)
        assert again["placement"] == "rebound" and again["previous_pod_id"] == pod, again
        assert pod not in k8s.pods and not await rm_pod_known(redis, pod)
        # the pod's other session: rebound at its next route, with no report of its own
        assert await a.routed("s2") == {**again, "placement": "rebound"}
        assert await a.metric("agent_runtime_pod_reports_total", outcome="dead") == 1
        assert await a.metric("agent_runtime_dead_pods_cleaned_total", by="report") == 1


@SQLITE
async def test_a_pod_gone_from_kubernetes_is_rebound_in_the_same_call(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        pod = (await a.routed("s1"))["pod_id"]
        k8s.remove(pod)
        again = await reported(a, "s1", pod)
        assert again["placement"] == "rebound" and again["previous_pod_id"] == pod, again


@SQLITE
async def test_a_false_report_never_harms_a_healthy_pod_and_costs_one_probe_a_second(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        pod = (await a.routed("s1"))["pod_id"]
        probes = k8s.health_probes
        started = time.monotonic()
        first = await reported(a, "s1", pod)
        assert first["placement"] == "refresh" and first["pod_id"] == pod
        assert k8s.health_probes == probes + 1
        for _ in range(5):  # within the same second: the window's verdict, no probe
            assert (await reported(a, "s1", pod))["placement"] == "refresh"
        # one probe a second at most, however slow the machine made the six reports
        windows = 1 + int((time.monotonic() - started) / WINDOW)
        assert 1 <= k8s.health_probes - probes <= windows
        assert pod in k8s.pods and not k8s.deleted
        assert await a.metric("agent_runtime_pod_reports_total", outcome="healthy") == 6
        assert await a.metric("agent_runtime_k8s_calls_total", verb="get") == 0
        probes = k8s.health_probes

        await window_over(redis, pod)
        assert (await reported(a, "s1", pod))["placement"] == "refresh"
        assert k8s.health_probes == probes + 1, "a new window: one new probe"


@SQLITE
async def test_a_half_dead_pod_needs_two_failed_probes_in_a_row(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        pod = (await a.routed("s1"))["pod_id"]
        k8s.unhealthy.add(pod)  # Running and Ready in Kubernetes, /health fails
        first = await reported(a, "s1", pod)
        assert first["placement"] == "refresh", "one failed probe is no proof"
        assert await a.metric("agent_runtime_pod_reports_total", outcome="suspect") == 1
        assert pod in k8s.pods

        await window_over(redis, pod)
        again = await reported(a, "s1", pod)
        assert again["placement"] == "rebound" and again["previous_pod_id"] == pod, again
        assert pod not in k8s.pods


@SQLITE
async def test_a_report_of_a_pod_the_session_is_not_on_is_ignored(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        pod = (await a.routed("s1"))["pod_id"]
        k8s.kill(pod)
        probes = k8s.health_probes
        # another session's report, and a report naming a pod nobody is on
        new = await reported(a, "s-new", pod)
        assert new["placement"] == "placed"
        elsewhere = await reported(a, "s1", "agent-some-other-pod")
        assert elsewhere == {**elsewhere, "placement": "refresh", "pod_id": pod}
        assert k8s.health_probes == probes and pod in k8s.pods
        assert await a.metric("agent_runtime_pod_reports_total", outcome="ignored") == 2


@SQLITE
@pytest.mark.parametrize("bad", ["", "x" * 257, "pod\nid", 7, ["agent-a"], {"pod": "agent-a"}])
async def test_a_malformed_failed_pod_id_is_refused(redis: Redis, db: Database, bad: Any) -> None:
    async with app(redis, db, FakeK8sPodClient()) as a:
        body = envelope(
            {"failed_pod_id": bad},
            session_id="s1",
            bot_id="bot-1",
            extra={"group_id": "grp-watch"},
        )
        resp = await a.client.post("/api/session/route", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error_code"] == "VALIDATION"
        assert "failed_pod_id" in resp.text
        assert not await session_hashes(redis, "s1")


@SQLITE
async def test_replicas_share_one_probe_of_a_reported_pod(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    first, second = other_client(redis), other_client(redis)
    try:
        async with (
            app(first, db, k8s, instance_id="replica-a") as a,
            app(second, db, k8s, instance_id="replica-b") as b,
        ):
            pods = {(await a.routed(f"s{i}"))["pod_id"] for i in range(2)}
            pod = pods.pop()
            assert not pods, "both sessions on one pod"
            probes = k8s.health_probes
            started = time.monotonic()
            answers = await asyncio.gather(
                *(reported(r, f"s{i % 2}", pod) for i, r in enumerate([a, b, a, b, a, b]))
            )
            assert {x["placement"] for x in answers} == {"refresh"}
            windows = 1 + int((time.monotonic() - started) / WINDOW)
            assert 1 <= k8s.health_probes - probes <= windows, "one probe a second, all told"
    finally:
        await first.aclose()
        await second.aclose()


# --- pod_report.lua ----------------------------------------------------------------------------


async def test_the_report_window_gives_one_probe_and_shares_its_verdict(redis: Redis) -> None:
    reports = ReportState(ResourceState(redis))
    pod, sid = f"agent-{uuid.uuid4().hex[:8]}", "s-report"
    claim = await reports.claim(sid, pod, 5.0)
    assert claim.probe and claim.seen == "probing"
    again = await reports.claim(sid, pod, 5.0)
    assert not again.probe and again.seen == "probing", "one probe per window"
    await reports.answer(sid, pod, "healthy")
    assert await reports.claim(sid, pod, 5.0) == (False, "healthy")
    assert await reports.seen(sid, pod) == "healthy"
    ttl = await redis.pttl(rm_pod(sid, pod, "reported"))
    assert 0 < ttl <= 5000, "the answer keeps the window's end"


async def test_the_report_window_ends_and_a_late_answer_writes_nothing(redis: Redis) -> None:
    reports = ReportState(ResourceState(redis))
    pod, sid = f"agent-{uuid.uuid4().hex[:8]}", "s-report"
    assert (await reports.claim(sid, pod, 0.05)).probe

    async def ended() -> bool:
        return await reports.seen(sid, pod) is None

    await eventually(ended, "a 50 ms window ends")
    await reports.answer(sid, pod, "dead")  # the probe outlived its window
    assert await reports.seen(sid, pod) is None, "no key outlives its window"
    assert (await reports.claim(sid, pod, 5.0)).probe, "a new window: a new probe"


@SQLITE
async def test_no_report_touches_a_pod_the_service_does_not_know(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        services = a.svc
        probes = k8s.health_probes
        verdict = await services.resources.check_reported_pod("agent-nobody-knows")
        assert verdict.value == "unknown" and k8s.health_probes == probes


@SQLITE
async def test_a_report_that_cannot_be_checked_leaves_the_route_as_without_it(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        pod = (await a.routed("s1"))["pod_id"]

        asked: list[str] = []

        async def broken(pod_id: str) -> Any:
            asked.append(pod_id)
            raise RuntimeError("the check broke")

        monkeypatch.setattr(a.svc.resources, "check_reported_pod", broken)
        answer = await reported(a, "s1", pod)
        assert asked == [pod], "the report was checked, and the check broke"
        assert answer["placement"] == "refresh" and answer["pod_id"] == pod
        assert pod in k8s.pods
