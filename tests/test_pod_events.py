"""The pods' Events recorder (``pod_events.py`` + ``pod_event_correlator.py``) on the fake
Kubernetes and a turned clock: an identical event is counted up by PATCH of the one written,
ten similar ones are combined, the per-pod token bucket drops a storm and refills, the queue is
bounded, a failure is counted and never raised, a patch of an expired event creates it anew,
the sender finds a uid the caller did not know, and ``stop`` keeps its bound.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.pod_event_correlator import COMBINED_PREFIX
from agent_runtime.resource_manager.pod_events import (
    MESSAGE_LIMIT,
    REASONS,
    PodEventReason,
    PodEvents,
    PodRef,
)

POD = PodRef("p-1", "default", "uid-1")
WAIT = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_790_000_000.0

    def __call__(self) -> float:
        return self.now


def recorder(k8s: FakeK8sPodClient, clock: Clock, metrics: Metrics, **kwargs: Any) -> PodEvents:
    return PodEvents(k8s=k8s, instance_id="replica-a", clock=clock, metrics=metrics, **kwargs)


def counted(metrics: Metrics, reason: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "agent_runtime_pod_events_total", {"reason": reason, "outcome": outcome}
    )
    return value or 0.0


async def settle(events: PodEvents) -> None:
    assert await events.wait_sent(WAIT), "the sender did not catch up"


async def test_an_identical_event_is_counted_up_on_the_one_written() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics)
    events.record(POD, PodEventReason.FOREIGN_POD_IGNORED, "not provably ours")
    await settle(events)
    (first,) = k8s.kube_events.of_pod("p-1")
    assert first["involvedObject"] == {
        "kind": "Pod", "namespace": "default", "name": "p-1", "uid": "uid-1", "apiVersion": "v1",
    }  # fmt: skip
    assert (first["type"], first["reason"], first["count"]) == ("Warning", "ForeignPodIgnored", 1)
    assert first["source"] == {"component": "agent-runtime", "host": "replica-a"}
    assert (first["reportingComponent"], first["reportingInstance"]) == (
        "agent-runtime", "replica-a",
    )  # fmt: skip
    assert first["metadata"]["name"].startswith("p-1.")
    for _ in range(3):
        clock.now += 30
        events.record(POD, PodEventReason.FOREIGN_POD_IGNORED, "not provably ours")
    await settle(events)
    (after,) = k8s.kube_events.of_pod("p-1")
    assert after["metadata"]["name"] == first["metadata"]["name"]
    assert after["count"] == 4
    assert after["firstTimestamp"] == first["firstTimestamp"]
    assert after["lastTimestamp"] > first["lastTimestamp"]
    assert counted(metrics, "ForeignPodIgnored", "sent") == 1
    assert counted(metrics, "ForeignPodIgnored", "aggregated") == 3
    # another incarnation under the name is another object: an event of its own
    events.record(PodRef("p-1", "default", "uid-2"), PodEventReason.DEPLOYED, "deployed")
    await settle(events)
    assert len(k8s.kube_events.of_pod("p-1")) == 2
    await events.stop()


async def test_ten_similar_events_are_combined() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics)
    for i in range(12):
        clock.now += 1
        events.record(POD, PodEventReason.DRAIN_STARTED, f"drain {i}")
    await settle(events)
    written = k8s.kube_events.of_pod("p-1")
    plain = [e for e in written if not e["message"].startswith(COMBINED_PREFIX)]
    combined = [e for e in written if e["message"].startswith(COMBINED_PREFIX)]
    assert sorted(e["message"] for e in plain) == sorted(f"drain {i}" for i in range(9))
    assert len(combined) == 1, "from the tenth similar one on: one event stands for them"
    assert combined[0]["count"] == 3
    assert combined[0]["message"] == COMBINED_PREFIX + "drain 11"
    # past the window the messages are counted afresh
    clock.now += 601
    events.record(POD, PodEventReason.DRAIN_STARTED, "drain late")
    await settle(events)
    assert any(e["message"] == "drain late" for e in k8s.kube_events.of_pod("p-1"))
    await events.stop()


async def test_the_spam_filter_drops_a_storm_and_refills() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics)
    for _ in range(30):
        events.record(POD, PodEventReason.DELETED_HALF_DEAD, "failing")
    await settle(events)
    assert counted(metrics, "DeletedHalfDead", "dropped_spam") == 5
    (event,) = k8s.kube_events.of_pod("p-1")
    assert event["count"] == 25
    other = PodRef("p-2", "default", "uid-9")  # a bucket per pod
    events.record(other, PodEventReason.DELETED_HALF_DEAD, "failing")
    clock.now += 300  # one token back
    events.record(POD, PodEventReason.DELETED_HALF_DEAD, "failing")
    events.record(POD, PodEventReason.DELETED_HALF_DEAD, "failing")
    await settle(events)
    assert len(k8s.kube_events.of_pod("p-2")) == 1
    assert counted(metrics, "DeletedHalfDead", "dropped_spam") == 6
    (event,) = k8s.kube_events.of_pod("p-1")
    assert event["count"] == 31, "the five dropped before were observed: counted in"
    await events.stop()


async def test_a_storm_about_one_pod_does_not_crowd_out_the_others() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics, queue_size=30)
    for _ in range(100):  # no await in between: the sender has not run
        events.record(POD, PodEventReason.DELETED_HALF_DEAD, "failing")
    events.record(PodRef("p-2", "default", "u-2"), PodEventReason.DEPLOYED, "deployed")
    assert counted(metrics, "DeletedHalfDead", "dropped_spam") == 75, "filtered before the queue"
    assert counted(metrics, "DeletedHalfDead", "dropped_full") == 0
    await settle(events)
    assert counted(metrics, "Deployed", "sent") == 1
    await events.stop()


async def test_the_queue_is_bounded_and_record_never_blocks() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics, queue_size=3)
    for i in range(5):  # no await in between: the sender has not run
        events.record(PodRef(f"q-{i}", "default", "u"), PodEventReason.RECLAIMED, "idle")
    assert counted(metrics, "Reclaimed", "dropped_full") == 2
    await settle(events)
    assert counted(metrics, "Reclaimed", "sent") == 3
    await events.stop()


async def test_failures_are_counted_never_raised_and_an_expired_event_is_created_anew() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics)
    k8s.forbidden_namespaces.add("locked")
    events.record(PodRef("p-9", "locked", "u"), PodEventReason.DEPLOYED, "deployed")
    events.record(POD, PodEventReason.RECLAIMED, "idle")
    await settle(events)
    assert counted(metrics, "Deployed", "failed") == 1
    (event,) = k8s.kube_events.of_pod("p-1")
    k8s.kube_events.forget(None, "default", event["metadata"]["name"])  # its TTL ran out
    clock.now += 5
    events.record(POD, PodEventReason.RECLAIMED, "idle")
    await settle(events)
    (again,) = k8s.kube_events.of_pod("p-1")
    assert again["count"] == 2 and again["metadata"]["name"] == event["metadata"]["name"]
    assert counted(metrics, "Reclaimed", "sent") == 2
    await events.stop()


async def test_the_sender_finds_a_uid_the_caller_did_not_know() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    pod = k8s.add_pod(scope_id="s", deploy_ver="v1")
    events = recorder(k8s, clock, metrics)
    events.record(PodRef(pod.pod_id, pod.namespace), PodEventReason.DRAIN_STARTED, "drain")
    events.record(PodRef("gone", "default"), PodEventReason.DRAINED, "drained")
    await settle(events)
    (found,) = k8s.kube_events.of_pod(pod.pod_id)
    assert found["involvedObject"]["uid"] == pod.uid
    (without,) = k8s.kube_events.of_pod("gone")
    assert "uid" not in without["involvedObject"]
    await events.stop()


async def test_messages_are_bounded_and_every_reason_has_a_type() -> None:
    assert {kind for kind, _ in REASONS.values()} == {"Normal", "Warning"}
    assert set(REASONS) == set(PodEventReason)
    reference = (Path(__file__).parents[1] / "docs/reference/kubernetes.md").read_text()
    for reason, (kind, _) in REASONS.items():  # the reference's table lists each, typed
        assert f"| `{reason}` | {kind} |" in reference, reason
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics)
    events.record(POD, PodEventReason.DEPLOYED, "é" * 5000)
    await settle(events)
    (event,) = k8s.kube_events.of_pod("p-1")
    assert len(event["message"].encode()) <= MESSAGE_LIMIT and event["message"].endswith("...")
    await events.stop()


async def test_turned_off_it_records_nothing() -> None:
    k8s, clock, metrics = FakeK8sPodClient(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics, enabled=False)
    events.record(POD, PodEventReason.DEPLOYED, "deployed")
    await asyncio.sleep(0)
    assert k8s.kube_events.all() == []
    await events.stop()


class StuckEvents(FakeK8sPodClient):
    """Every event write hangs (an API server that stopped answering)."""

    async def create_event(
        self, namespace: str, body: dict[str, Any], *, cluster: str | None = None
    ) -> None:
        await asyncio.Event().wait()


@pytest.mark.parametrize("send_timeout", [0.2, 60.0])
async def test_stop_keeps_its_bound(send_timeout: float) -> None:
    k8s, clock, metrics = StuckEvents(), Clock(), Metrics()
    events = recorder(k8s, clock, metrics, send_timeout=send_timeout)
    for i in range(4):
        events.record(PodRef(f"s-{i}", "default", "u"), PodEventReason.DEPLOYED, "deployed")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await events.stop(within=0.5)
    assert loop.time() - started < WAIT
    handled = sum(counted(metrics, "Deployed", o) for o in ("failed", "dropped_stop"))
    assert handled == 4, "each event either failed at its deadline or was dropped at the stop"
    events.record(POD, PodEventReason.DEPLOYED, "after the stop")
    assert counted(metrics, "Deployed", "dropped_stop") >= 1
