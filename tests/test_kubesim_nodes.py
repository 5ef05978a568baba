"""kubesim's nodes: several of them, listed, read and patched as core/v1 Nodes (``kubectl
cordon``'s patch), watched, cordoned through the control endpoint; the scheduler spreads pods
over schedulable nodes and never onto a cordoned one; a control delete with a long grace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import pytest
from kubernetes_asyncio import client, config, watch

from kubesim import KubeSim
from kubesim.runner import add_arguments, build_sim

PODS = "/api/v1/namespaces/default/pods"
NODES = "/api/v1/nodes"
WAIT = 10.0
NAMES = ["kubesim-node", "kubesim-node-2", "kubesim-node-3"]
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}


def pod_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "n"}},
        "spec": {"containers": [{"name": "agent", "image": "registry.local/agent:1"}]},
    }


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(ready_delay=0.05, grace_period=0.3, probe_period=0.05, nodes=3, seed=5) as s:
        yield s


@pytest.fixture
async def http(sim: KubeSim) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=WAIT) as c:
        yield c


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def create(http: httpx.AsyncClient, name: str) -> None:
    assert (await http.post(PODS, json=pod_body(name))).status_code == 201


async def node_of(http: httpx.AsyncClient, name: str) -> str:
    """The node the scheduler put pod ``name`` on (waits until it is scheduled)."""
    found: list[str] = []

    async def scheduled() -> bool:
        pod = (await http.get(f"{PODS}/{name}")).json()
        if pod["spec"].get("nodeName"):
            found.append(pod["spec"]["nodeName"])
        return bool(found)

    await eventually(scheduled, f"{name} scheduled")
    return found[0]


async def test_one_node_by_default_keeps_its_name() -> None:
    async with KubeSim(ready_delay=0.05) as sim:
        http = httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=WAIT)
        async with http:
            listed = (await http.get(NODES)).json()
            assert listed["kind"] == "NodeList"
            assert [n["metadata"]["name"] for n in listed["items"]] == ["kubesim-node"]
            await create(http, "solo")
            assert await node_of(http, "solo") == "kubesim-node"


async def test_nodes_list_get_and_shapes(sim: KubeSim, http: httpx.AsyncClient) -> None:
    listed = (await http.get(NODES)).json()
    assert listed["metadata"]["resourceVersion"] == sim.store.resource_version
    assert [n["metadata"]["name"] for n in listed["items"]] == NAMES
    node = (await http.get(f"{NODES}/kubesim-node-2")).json()
    assert node["kind"] == "Node" and node["metadata"]["uid"]
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "kubesim-node-2"
    assert node["status"]["conditions"][0]["type"] == "Ready"
    assert node["status"]["conditions"][0]["status"] == "True"
    assert "unschedulable" not in node["spec"]
    missing = await http.get(f"{NODES}/nope")
    assert missing.status_code == 404 and missing.json()["message"] == 'nodes "nope" not found'
    by_name = await http.get(NODES, params={"fieldSelector": "metadata.name=kubesim-node-3"})
    assert [n["metadata"]["name"] for n in by_name.json()["items"]] == ["kubesim-node-3"]
    bad = await http.get(NODES, params={"fieldSelector": "status.phase=Running"})
    assert bad.status_code == 400


async def test_pods_spread_over_nodes_and_a_cordoned_node_gets_none(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    placed = {}
    for i in range(3):
        await create(http, f"s{i}")
        placed[await node_of(http, f"s{i}")] = f"s{i}"
    assert sorted(placed) == NAMES, "the fewest-pods node first: one each"
    # kubectl cordon: a strategic merge patch of spec.unschedulable
    before = (await http.get(f"{NODES}/kubesim-node-2")).json()["metadata"]["resourceVersion"]
    cordoned = await http.patch(
        f"{NODES}/kubesim-node-2", json={"spec": {"unschedulable": True}}, headers=STRATEGIC
    )
    assert cordoned.status_code == 200, cordoned.text
    node = cordoned.json()
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"][0]["key"] == "node.kubernetes.io/unschedulable"
    assert int(node["metadata"]["resourceVersion"]) > int(before)
    selected = await http.get(NODES, params={"fieldSelector": "spec.unschedulable=true"})
    assert [n["metadata"]["name"] for n in selected.json()["items"]] == ["kubesim-node-2"]
    unselected = await http.get(NODES, params={"fieldSelector": "spec.unschedulable=false"})
    assert len(unselected.json()["items"]) == 2
    for i in range(4):
        await create(http, f"t{i}")
        assert await node_of(http, f"t{i}") != "kubesim-node-2"
    on_two = await http.get(PODS, params={"fieldSelector": "spec.nodeName=kubesim-node-2"})
    assert [p["metadata"]["name"] for p in on_two.json()["items"]] == [placed["kubesim-node-2"]], (
        "cordoning moves nothing that runs"
    )
    state = (await http.get("/_sim/state")).json()
    nodes = {n["name"]: n for n in state["nodes"]}
    assert nodes["kubesim-node-2"]["unschedulable"] and nodes["kubesim-node-2"]["pods"] == 1
    assert sum(n["pods"] for n in nodes.values()) == 7
    assert {p["node"] for p in state["pods"]} == set(NAMES)
    # uncordon as kubectl does: unschedulable null
    back = await http.patch(
        f"{NODES}/kubesim-node-2", json={"spec": {"unschedulable": None}}, headers=STRATEGIC
    )
    assert back.status_code == 200 and "unschedulable" not in back.json()["spec"]
    assert "taints" not in back.json()["spec"]


async def test_every_node_cordoned_leaves_a_pod_pending_until_one_is_uncordoned(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    for name in NAMES:
        resp = await http.post(f"/_sim/nodes/{name}/cordon")
        assert resp.status_code == 200 and resp.json()["spec"]["unschedulable"] is True
    await create(http, "waiting")

    async def unschedulable() -> bool:
        pod = (await http.get(f"{PODS}/waiting")).json()
        conditions = {c["type"]: c for c in pod["status"].get("conditions") or []}
        scheduled = conditions.get("PodScheduled")
        return scheduled is not None and scheduled.get("reason") == "Unschedulable"

    await eventually(unschedulable, "Unschedulable")
    pod = (await http.get(f"{PODS}/waiting")).json()
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    assert "0/3 nodes are available" in pod["status"]["conditions"][0]["message"]
    assert (await http.post("/_sim/nodes/kubesim-node-3/uncordon")).status_code == 200
    assert await node_of(http, "waiting") == "kubesim-node-3"

    async def running() -> bool:
        return bool((await http.get(f"{PODS}/waiting")).json()["status"].get("phase") == "Running")

    await eventually(running, "Running after the uncordon")
    assert (await http.post("/_sim/nodes/ghost/cordon")).status_code == 404
    await http.post("/_sim/reset")
    assert not any(n["unschedulable"] for n in (await http.get("/_sim/state")).json()["nodes"])


async def test_node_patch_refusals(sim: KubeSim, http: httpx.AsyncClient) -> None:
    url = f"{NODES}/kubesim-node"
    merge = {"Content-Type": "application/merge-patch+json"}
    json_patch = await http.patch(
        url, content=b"[]", headers={"Content-Type": "application/json-patch+json"}
    )
    assert json_patch.status_code == 415
    other = await http.patch(url, json={"spec": {"podCIDR": "10.0.0.0/24"}}, headers=merge)
    assert other.status_code == 422 and other.json()["reason"] == "Invalid"
    not_bool = await http.patch(url, json={"spec": {"unschedulable": "yes"}}, headers=merge)
    assert not_bool.status_code == 422
    stale = await http.patch(
        url, json={"metadata": {"resourceVersion": "1"}, "spec": {}}, headers=merge
    )
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"
    bad_label = await http.patch(url, json={"metadata": {"labels": {"a": "b c"}}}, headers=merge)
    assert bad_label.status_code == 422
    labelled = await http.patch(url, json={"metadata": {"labels": {"pool": "a"}}}, headers=merge)
    assert labelled.status_code == 200
    assert labelled.json()["metadata"]["labels"]["pool"] == "a"
    assert labelled.json()["metadata"]["labels"]["kubernetes.io/hostname"] == "kubesim-node"
    gone = await http.patch(f"{NODES}/nope", json={"spec": {}}, headers=merge)
    assert gone.status_code == 404
    sim.faults.add("api_error", status=500, verb="patch", resource="nodes", count=1)
    assert (await http.patch(url, json={"spec": {}}, headers=merge)).status_code == 500
    assert sim.requests["patch nodes"] == 8


async def test_node_watch_sees_a_cordon(sim: KubeSim, http: httpx.AsyncClient) -> None:
    version = (await http.get(NODES)).json()["metadata"]["resourceVersion"]
    async with aiohttp.ClientSession(trust_env=False) as session:
        response = await session.get(
            f"{sim.url}{NODES}", params={"watch": "true", "resourceVersion": version}
        )
        assert response.status == 200
        await http.post("/_sim/nodes/kubesim-node-3/cordon")
        async with asyncio.timeout(WAIT):
            event = json.loads(await response.content.readline())
        assert event["type"] == "MODIFIED"
        assert event["object"]["metadata"]["name"] == "kubesim-node-3"
        assert event["object"]["spec"]["unschedulable"] is True
        initial = await session.get(f"{sim.url}{NODES}", params={"watch": "1"})
        async with asyncio.timeout(WAIT):
            added = [json.loads(await initial.content.readline()) for _ in NAMES]
        assert [e["object"]["metadata"]["name"] for e in added] == NAMES
        assert {e["type"] for e in added} == {"ADDED"}
        response.close()
        initial.close()


async def test_control_delete_waits_the_grace_it_is_given(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    await create(http, "slow")

    async def running() -> bool:
        return bool((await http.get(f"{PODS}/slow")).json()["status"].get("phase") == "Running")

    await eventually(running, "Running")
    version = sim.store.resource_version
    async with aiohttp.ClientSession(trust_env=False) as session:
        watch = await session.get(
            f"{sim.url}{PODS}",
            params={
                "watch": "1",
                "resourceVersion": version,
                "fieldSelector": "metadata.name=slow",
            },
        )
        started = await http.post("/_sim/pods/default/slow/delete", json={"grace_seconds": 2})
        assert started.status_code == 200, started.text
        pod = started.json()["pod"]
        assert pod["metadata"]["deletionGracePeriodSeconds"] == 2
        await asyncio.sleep(0.6)  # beyond grace_period (0.3 s): the control delete is not capped
        assert (await http.get(f"{PODS}/slow")).status_code == 200
        events: list[dict[str, Any]] = []
        async with asyncio.timeout(WAIT):
            while not events or events[-1]["type"] != "DELETED":
                events.append(json.loads(await watch.content.readline()))
        assert events[0]["type"] == "MODIFIED"
        assert events[0]["object"]["metadata"]["deletionTimestamp"]
        watch.close()
    assert (await http.get(f"{PODS}/slow")).status_code == 404
    refused = await http.post("/_sim/pods/default/slow/delete", json={"grace_seconds": 1})
    assert refused.status_code == 404
    too_long = await http.post("/_sim/pods/default/x/delete", json={"grace_seconds": 99999})
    assert too_long.status_code == 400


async def test_kubernetes_asyncio_reads_and_cordons_nodes(sim: KubeSim, _no_proxy: None) -> None:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(sim.kubeconfig_path), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api:
        v1 = client.CoreV1Api(api)
        nodes = await v1.list_node()
        assert [n.metadata.name for n in nodes.items] == NAMES
        assert nodes.items[0].status.node_info.kubelet_version.startswith("v1.31")
        patched = await v1.patch_node("kubesim-node-2", {"spec": {"unschedulable": True}})
        assert patched.spec.unschedulable is True
        node = await v1.read_node("kubesim-node-2")
        assert node.spec.taints[0].effect == "NoSchedule"


def test_cli_nodes_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sim = build_sim(parser.parse_args(["--nodes", "4"]))
    assert sim.nodes.names[-1] == "kubesim-node-4"
    with pytest.raises(ValueError):
        build_sim(parser.parse_args(["--nodes", "0"]))


async def test_kubernetes_asyncio_watches_nodes(
    sim: KubeSim, http: httpx.AsyncClient, _no_proxy: None
) -> None:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(sim.kubeconfig_path), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api:
        v1 = client.CoreV1Api(api)
        version = (await v1.list_node()).metadata.resource_version
        await http.post("/_sim/nodes/kubesim-node/cordon")
        w = watch.Watch()
        async with asyncio.timeout(WAIT):
            async for event in w.stream(v1.list_node, resource_version=version, timeout_seconds=5):
                assert event["type"] == "MODIFIED"
                assert event["object"].metadata.name == "kubesim-node"
                assert event["object"].spec.unschedulable is True
                w.stop()
        await w.close()
