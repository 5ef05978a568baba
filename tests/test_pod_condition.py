"""The one reading of a pod's state (``pod_reading.pod_condition``): alive, draining (a
graceful deletion with time left, a cordoned node) or dead — pure, as the watch pass and the
watch stream call it — and the deletion time and node read alike from JSON and a ``V1Pod``.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
from kubernetes_asyncio.client import models as m

from agent_runtime.resource_manager.models import PodStatus
from agent_runtime.resource_manager.pod_reading import (
    pod_condition,
    pod_status,
    pod_status_from_json,
)


def _pod(**meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "n", **meta},
        "spec": {"nodeName": "node-a", "containers": [{"image": "i"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }


def test_pod_condition_reads_deletions_and_cordons() -> None:
    now = time.time()
    at = datetime.datetime.fromtimestamp(now + 30, tz=datetime.UTC)
    deleting = pod_status_from_json(_pod(deletionTimestamp=at.strftime("%Y-%m-%dT%H:%M:%SZ")))
    assert deleting.phase == "Terminating" and deleting.node == "node-a"
    assert deleting.deletion_at is not None and abs(deleting.deletion_at - (now + 30)) < 1.0
    condition = pod_condition(deleting, now, margin=2.0)
    assert condition.state == "draining" and condition.trigger == "graceful_delete"
    assert condition.deadline == deleting.deletion_at - 2.0
    assert pod_condition(deleting, now + 29, margin=2.0).state == "dead"
    unreadable = pod_status_from_json(_pod(deletionTimestamp="yesterday"))
    assert unreadable.deletion_at is None
    assert pod_condition(unreadable, now, margin=2.0).state == "dead"
    running = pod_status_from_json(_pod())
    assert pod_condition(running, now, margin=2.0).state == "alive"
    cordoned = pod_condition(running, now, margin=2.0, cordoned_nodes={"node-a"})
    assert cordoned.state == "draining" and cordoned.trigger == "cordon"
    assert cordoned.deadline is None
    assert pod_condition(None, now, margin=2.0).state == "dead"
    failed = PodStatus("p", "n", "Failed", False, None, node="node-a")
    assert pod_condition(failed, now, margin=2.0, cordoned_nodes={"node-a"}).state == "dead"


def test_a_v1pod_reads_deletion_and_node_alike() -> None:
    at = datetime.datetime.fromtimestamp(time.time() + 30, tz=datetime.UTC)
    v1pod = m.V1Pod(
        metadata=m.V1ObjectMeta(name="p", namespace="n", deletion_timestamp=at),
        spec=m.V1PodSpec(node_name="node-a", containers=[m.V1Container(name="c", image="i")]),
        status=m.V1PodStatus(phase="Running", pod_ip="10.0.0.1"),
    )
    read = pod_status(v1pod)
    as_json = pod_status_from_json(_pod(deletionTimestamp=at.isoformat().replace("+00:00", "Z")))
    assert read.node == as_json.node == "node-a"
    assert read.deletion_at == pytest.approx(as_json.deletion_at)
    assert read.phase == as_json.phase == "Terminating"
