"""kubesim, the Kubernetes API simulator, through plain HTTP: the core/v1 shapes and Status
errors, label selectors as the API server parses them, the simulated kubelet and its
AgentServers, every fault of the control endpoint, token auth, the CLI, and a clean stop.

RealK8sPodClient against the simulator is ``test_k8s_real_sim.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from kubesim import KubeSim
from kubesim.agentserver import reserve_ports
from kubesim.kubeconfig import render_kubeconfig
from kubesim.labels import SelectorError, parse_field_selector, parse_selector
from kubesim.paging import Pager, decode_token, encode_token
from kubesim.runner import add_arguments, build_sim

PODS = "/api/v1/namespaces/default/pods"
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def pod_body(
    name: str | None = "p1",
    *,
    labels: dict[str, str] | None = None,
    image: str = "registry.local/agent:1.0",
    port: int = 8080,
    **metadata: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels or {"app": "x"}, **metadata}
    if name is not None:
        meta["name"] = name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [
                {
                    "name": "agentserver",
                    "image": image,
                    "ports": [{"name": "sse", "containerPort": port}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": port}},
                }
            ]
        },
    }


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(
        ready_delay=0.05,
        grace_period=0.3,
        probe_period=0.05,
        sse_interval=0.05,
        namespaces=("default", "team"),
        seed=7,
    ) as s:
        yield s


@pytest.fixture
async def http(sim: KubeSim) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as client:
        yield client


async def eventually(
    check: Callable[[], Awaitable[bool]], within: float = 3.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def get_pod(http: httpx.AsyncClient, name: str, ns: str = "default") -> dict[str, Any]:
    resp = await http.get(f"/api/v1/namespaces/{ns}/pods/{name}")
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def running_pod(http: httpx.AsyncClient, name: str) -> dict[str, Any]:
    """Wait until the pod is Running and Ready; return it."""
    found: dict[str, Any] = {}

    async def ready() -> bool:
        found.update(await get_pod(http, name))
        return found["status"]["phase"] == "Running" and is_ready(found)

    await eventually(ready, what=f"pod {name} Ready")
    return found


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod["status"].get("conditions") or []
    )


def waiting_reason(pod: dict[str, Any]) -> str | None:
    statuses = pod["status"].get("containerStatuses") or []
    waiting = statuses[0]["state"].get("waiting") if statuses else None
    return waiting.get("reason") if waiting else None


def assert_status(resp: httpx.Response, code: int, reason: str) -> dict[str, Any]:
    assert resp.status_code == code, resp.text
    body: dict[str, Any] = resp.json()
    assert body["kind"] == "Status" and body["apiVersion"] == "v1", body
    assert body["status"] == "Failure" and body["code"] == code and body["reason"] == reason
    assert body["message"]
    return body


def port_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


async def add_fault(http: httpx.AsyncClient, **fault: Any) -> dict[str, Any]:
    resp = await http.post("/_sim/faults", json=fault)
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


# --- label selectors, as the API server parses them ----------------------------------------------

LABELS = {"app": "a", "tier": "web", "n": "5", "empty": ""}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", True),
        ("app=a", True),
        ("app==a", True),
        ("app=b", False),
        ("app!=b", True),
        ("app!=a", False),
        ("missing!=x", True),  # != matches an object without the key
        ("app in (a,b)", True),
        ("app in (b, c)", False),
        ("missing in (a)", False),
        ("app notin (b)", True),
        ("app notin (a,b)", False),
        ("missing notin (a)", True),  # so does notin
        ("app", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("app=a,tier=web", True),
        ("app=a,tier=db", False),
        ("  app = a ,  tier in ( web )  ", True),
        ("n>4", True),
        ("n<5", False),
        ("app>1", False),  # not an integer: no match
        ("empty=", True),
        ("empty in ()", True),  # "()" is the set of the empty value
        ("in=x", False),  # "in" is a plain key where an identifier is expected
        ("example.com/app!=z", True),
    ],
)
def test_selector_semantics(selector: str, matches: bool) -> None:
    assert parse_selector(selector).matches(LABELS) is matches


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("app in", "found '' expected: '('"),
        ("app in (a", "found '', expected: ',' or ')'"),
        ("app in (a b)", "found 'b', expected: ',' or ')'"),
        ("!app=a", "found '=', expected: ',' or 'end of string'"),
        ("app=a=b", "found '=', expected: ',' or 'end of string'"),
        ("app=a,", "found '', expected: identifier after ','"),
        (",app", "found ',', expected: !, identifier, or 'end of string'"),
        ("app b", "found 'b', expected: in, notin, =, ==, !=, gt, lt"),
        ("-app=a", 'key: Invalid value: "-app"'),
        ("a/b/c", 'key: Invalid value: "a/b/c"'),
        ("app=-a", 'values[0][app]: Invalid value: "-a"'),
        ("app=" + "x" * 64, "must be no more than 63 characters"),
        ("n>x", "the value must be an integer"),
    ],
)
def test_selector_errors(selector: str, message: str) -> None:
    with pytest.raises(SelectorError) as info:
        parse_selector(selector)
    assert message in str(info.value)


def test_field_selector() -> None:
    pod = {"metadata": {"name": "p1"}, "status": {"phase": "Running"}}
    terms = parse_field_selector("metadata.name=p1,status.phase!=Failed")
    assert [(t.field, t.negate, t.value) for t in terms] == [
        ("metadata.name", False, "p1"),
        ("status.phase", True, "Failed"),
    ]
    with pytest.raises(SelectorError, match="field label not supported"):
        parse_field_selector("spec.bogus=1")
    with pytest.raises(SelectorError, match="can't understand"):
        parse_field_selector("metadata.name")
    assert parse_selector(None).matches(pod["metadata"])


# --- pods: shapes and lifecycle ------------------------------------------------------------------


async def test_create_get_list_shapes_and_lifecycle(sim: KubeSim, http: httpx.AsyncClient) -> None:
    resp = await http.post(PODS, json=pod_body("p1", labels={"app": "x"}))
    assert resp.status_code == 201, resp.text
    created = resp.json()
    meta = created["metadata"]
    assert created["kind"] == "Pod" and created["apiVersion"] == "v1"
    assert meta["name"] == "p1" and meta["namespace"] == "default"
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"])
    assert TIMESTAMP.match(meta["creationTimestamp"])
    assert "deletionTimestamp" not in meta
    assert created["status"] == {"phase": "Pending", "qosClass": "BestEffort"}
    assert created["spec"]["restartPolicy"] == "Always"
    assert created["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    first_rv = int(meta["resourceVersion"])

    pod = await running_pod(http, "p1")
    status = pod["status"]
    assert int(pod["metadata"]["resourceVersion"]) > first_rv
    assert pod["metadata"]["uid"] == meta["uid"]
    assert pod["spec"]["nodeName"] == "kubesim-node"
    assert status["podIP"] == "127.0.0.2" and status["podIPs"] == [{"ip": "127.0.0.2"}]
    assert status["hostIP"] == "127.0.0.1"
    types = {c["type"]: c["status"] for c in status["conditions"]}
    assert types == {
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "Ready": "True",
        "ContainersReady": "True",
        "PodScheduled": "True",
    }
    (cs,) = status["containerStatuses"]
    assert cs["name"] == "agentserver" and cs["ready"] is True and cs["restartCount"] == 0
    assert TIMESTAMP.match(cs["state"]["running"]["startedAt"])
    assert cs["containerID"].startswith("containerd://")

    resp = await http.get(PODS)
    listing = resp.json()
    assert listing["kind"] == "PodList" and listing["apiVersion"] == "v1"
    assert int(listing["metadata"]["resourceVersion"]) >= int(pod["metadata"]["resourceVersion"])
    (item,) = listing["items"]
    assert item["metadata"]["name"] == "p1" and "kind" not in item  # as the API server lists

    everywhere = (await http.get("/api/v1/pods")).json()
    assert [i["metadata"]["name"] for i in everywhere["items"]] == ["p1"]
    assert (await http.get("/api/v1/namespaces/team/pods")).json()["items"] == []


async def test_each_pod_has_its_own_loopback_ip_and_a_real_agentserver(
    http: httpx.AsyncClient,
) -> None:
    for name in ("p1", "p2"):
        assert (await http.post(PODS, json=pod_body(name, port=9000))).status_code == 201
    ips = [(await running_pod(http, name))["status"]["podIP"] for name in ("p1", "p2")]
    assert ips == ["127.0.0.2", "127.0.0.3"]

    async with httpx.AsyncClient(trust_env=False, timeout=3) as plain:
        for name, ip in zip(("p1", "p2"), ips, strict=True):
            health = await plain.get(f"http://{ip}:9000/health")
            assert health.status_code == 200 and health.json()["pod"] == name

    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{ips[1]}:9000/some/sse") as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        hello = (await resp.content.readuntil(b"\n\n")).decode()
        ping = (await resp.content.readuntil(b"\n\n")).decode()
    assert "event: hello" in hello
    data = json.loads(hello.split("data: ", 1)[1])
    assert data == {"pod": "p2", "namespace": "default", "ip": ips[1], "path": "/some/sse"}
    assert "event: ping" in ping


async def test_an_address_another_program_listens_on_is_skipped() -> None:
    """Two simulators on one machine start at the same address; the second one's pod takes
    the next address instead of crash-looping on ``address already in use``."""
    first = f"127.{64 + os.getpid() % 128}.11.2"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind((first, 9000))
        other.listen()
        async with (
            KubeSim(ready_delay=0.01, probe_period=0.05, first_pod_ip=first, seed=3) as sim,
            httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as http,
        ):
            for name in ("p1", "p2"):
                assert (await http.post(PODS, json=pod_body(name, port=9000))).status_code == 201
                pod = await running_pod(http, name)
                assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
            ips = [(await get_pod(http, name))["status"]["podIP"] for name in ("p1", "p2")]
            base = first.rsplit(".", 1)[0]
            assert ips == [f"{base}.3", f"{base}.4"]  # .2 is the other program's
            async with httpx.AsyncClient(trust_env=False, timeout=3) as plain:
                health = await plain.get(f"http://{ips[0]}:9000/health")
                assert health.json()["pod"] == "p1"


async def test_a_port_taken_on_every_address_crash_loops_the_pod_without_a_long_search() -> None:
    """A listener on 0.0.0.0 takes its port on every loopback address: the kubelet gives up
    after MAX_SKIPPED addresses and the pod crash-loops on the bind, as it did before."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as everywhere:
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        taken = everywhere.getsockname()[1]
        first = f"127.{64 + os.getpid() % 128}.13.2"
        async with (
            KubeSim(ready_delay=0.01, probe_period=0.05, first_pod_ip=first) as sim,
            httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as http,
        ):
            assert (await http.post(PODS, json=pod_body("p1", port=taken))).status_code == 201

            async def crashing() -> bool:
                return waiting_reason(await get_pod(http, "p1")) == "CrashLoopBackOff"

            await eventually(crashing, what="p1 CrashLoopBackOff")
            pod = await get_pod(http, "p1")
            message = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["message"]
            assert "address already in use" in message
            assert (await http.post(PODS, json=pod_body("p2", port=9000))).status_code == 201
            await running_pod(http, "p2")  # other ports still find an address


async def test_a_pod_holds_its_address_from_allocation_and_frees_it_if_it_never_serves() -> None:
    """The ports are bound when the IP is given (nothing can take them during the pull), and
    closed again when the pod crash-loops or is deleted before its server starts."""
    first = f"127.{64 + os.getpid() % 128}.12.2"
    async with (
        KubeSim(ready_delay=0.5, grace_period=0.1, probe_period=0.05, first_pod_ip=first) as sim,
        httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as http,
    ):
        await add_fault(http, kind="crash_loop", labels="app=crash")
        for name, app in (("p1", "crash"), ("p2", "x")):
            body = pod_body(name, labels={"app": app})
            assert (await http.post(PODS, json=body)).status_code == 201
        ips: dict[str, str] = {}

        async def sandboxes() -> bool:
            for name in ("p1", "p2"):
                ips[name] = (await get_pod(http, name))["status"].get("podIP", "")
            return all(ips.values())

        await eventually(sandboxes, what="both pods given an IP")
        assert reserve_ports(ips["p2"], [8080]) is None, "the pulling pod's port is held"
        assert not port_open(ips["p2"], 8080), "and refuses connections, as a pod's before it runs"
        gone = await http.delete(f"{PODS}/p2", params={"gracePeriodSeconds": 0})
        assert gone.status_code == 200

        async def crashing() -> bool:
            return waiting_reason(await get_pod(http, "p1")) == "CrashLoopBackOff"

        await eventually(crashing, what="p1 CrashLoopBackOff")
        for ip in ips.values():
            assert not port_open(ip, 8080)
            mine = reserve_ports(ip, [8080])
            assert mine is not None, f"{ip}:8080 left held"
            for sock in mine:
                sock.close()


async def test_generate_name(sim: KubeSim, http: httpx.AsyncClient) -> None:
    resp = await http.post(PODS, json=pod_body(None, generateName="agent-"))
    assert resp.status_code == 201, resp.text
    name = resp.json()["metadata"]["name"]
    assert re.fullmatch(r"agent-[bcdfghjklmnpqrstvwxz2456789]{5}", name)
    assert resp.json()["metadata"]["generateName"] == "agent-"
    resp = await http.post(PODS, json=pod_body(None))
    body = assert_status(resp, 422, "Invalid")
    assert "name or generateName is required" in body["message"]


async def test_errors_are_status_objects(http: httpx.AsyncClient) -> None:
    resp = await http.get(f"{PODS}/nope")
    body = assert_status(resp, 404, "NotFound")
    assert body["message"] == 'pods "nope" not found'
    assert body["details"] == {"name": "nope", "kind": "pods"}

    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    body = assert_status(await http.post(PODS, json=pod_body("p1")), 409, "AlreadyExists")
    assert body["message"] == 'pods "p1" already exists'
    assert body["details"] == {"name": "p1", "kind": "pods"}

    body = assert_status(await http.post(PODS, json=pod_body("Bad_Name")), 422, "Invalid")
    assert body["message"].startswith('Pod "Bad_Name" is invalid: metadata.name: Invalid value')
    assert "RFC 1123 subdomain" in body["message"]
    assert body["details"]["causes"][0]["field"] == "metadata.name"
    assert body["details"]["causes"][0]["reason"] == "FieldValueInvalid"

    body = assert_status(await http.post(PODS, json=pod_body("p2", image="")), 422, "Invalid")
    assert "spec.containers[0].image: Required value" in body["message"]
    bad_label = pod_body("p3", labels={"app": "-x-"})
    assert_status(await http.post(PODS, json=bad_label), 422, "Invalid")

    wrong_ns = pod_body("p4", namespace="team")
    body = assert_status(await http.post(PODS, json=wrong_ns), 400, "BadRequest")
    assert "does not match the namespace" in body["message"]
    not_json = await http.post(PODS, content=b"{nope", headers={"Content-Type": "application/json"})
    assert_status(not_json, 400, "BadRequest")

    body = assert_status(
        await http.post("/api/v1/namespaces/ghost/pods", json=pod_body("p5")), 404, "NotFound"
    )
    assert body["message"] == 'namespaces "ghost" not found'

    assert_status(await http.get("/api/v1/services"), 404, "NotFound")
    assert_status(await http.put(f"{PODS}/p1", json={}), 405, "MethodNotAllowed")
    bad_watch = {"watch": "true", "timeoutSeconds": "soon"}
    assert_status(await http.get(PODS, params=bad_watch), 400, "BadRequest")


async def test_list_with_label_and_field_selectors(http: httpx.AsyncClient) -> None:
    for name, labels in (
        ("a1", {"app": "a", "tier": "web"}),
        ("a2", {"app": "a"}),
        ("b1", {"app": "b", "tier": "db"}),
    ):
        assert (await http.post(PODS, json=pod_body(name, labels=labels))).status_code == 201

    async def names(**params: str) -> list[str]:
        resp = await http.get(PODS, params=params)
        assert resp.status_code == 200, resp.text
        return [i["metadata"]["name"] for i in resp.json()["items"]]

    assert await names(labelSelector="app=a") == ["a1", "a2"]
    assert await names(labelSelector="app!=a") == ["b1"]
    assert await names(labelSelector="tier notin (web)") == ["a2", "b1"]
    assert await names(labelSelector="app in (a,b),tier") == ["a1", "b1"]
    assert await names(labelSelector="!tier") == ["a2"]
    assert await names(fieldSelector="metadata.name=b1") == ["b1"]
    assert await names(fieldSelector="metadata.name!=b1", labelSelector="app") == ["a1", "a2"]

    body = assert_status(
        await http.get(PODS, params={"labelSelector": "app in (a"}), 400, "BadRequest"
    )
    assert "unable to parse requirement" in body["message"]
    assert_status(await http.get(PODS, params={"fieldSelector": "spec.x=1"}), 400, "BadRequest")


# --- LIST paging: limit and continue ------------------------------------------------------------


def token_of(body: dict[str, Any]) -> dict[str, Any]:
    """The continue token of a list (or a 410 Status), decoded as the API server encodes it."""
    token = body["metadata"]["continue"]
    assert "=" not in token, "unpadded base64url"
    decoded: dict[str, Any] = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    return decoded


async def pages(
    http: httpx.AsyncClient, path: str = PODS, **params: str
) -> tuple[list[str], list[dict[str, Any]]]:
    """Follow continue tokens to the end: every name listed, and each page's metadata."""
    names: list[str] = []
    metas: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        resp = await http.get(path, params={**params, **({"continue": token} if token else {})})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        names += [f"{i['metadata']['namespace']}/{i['metadata']['name']}" for i in body["items"]]
        metas.append(body["metadata"])
        token = body["metadata"].get("continue")
        if not token:
            return names, metas


async def test_list_pages_with_limit_and_continue(sim: KubeSim, http: httpx.AsyncClient) -> None:
    for name in ("e", "c", "a", "d", "b"):
        labels = {"app": "x" if name in "ace" else "y"}
        assert (await http.post(PODS, json=pod_body(name, labels=labels))).status_code == 201
    assert (await http.post("/api/v1/namespaces/team/pods", json=pod_body("t"))).status_code == 201

    names, metas = await pages(http, limit="2")
    assert names == ["default/a", "default/b", "default/c", "default/d", "default/e"]
    assert [m.get("remainingItemCount") for m in metas] == [3, 1, None]
    assert "continue" not in metas[-1]
    first = token_of({"metadata": metas[0]})
    assert first == {
        "v": "meta.k8s.io/v1",
        "rv": int(metas[0]["resourceVersion"]),
        "start": "b\x00",
    }
    assert {m["resourceVersion"] for m in metas} == {metas[0]["resourceVersion"]}, "one snapshot"
    assert sim.requests["list pods"] == 3
    assert len(sim.pager) == 0, "a list served to its end leaves no snapshot behind"

    names, metas = await pages(http, limit="2", labelSelector="app=x")
    assert names == ["default/a", "default/c", "default/e"]
    assert all("remainingItemCount" not in m for m in metas), "not counted for a selector"
    names, metas = await pages(http, "/api/v1/pods", limit="3")
    assert names == ["default/a", "default/b", "default/c", "default/d", "default/e", "team/t"]
    assert token_of({"metadata": metas[0]})["start"] == "default/c\x00", "keys across namespaces"
    # all five fit: one page, no continue, no count (its resourceVersion is the store's now:
    # the kubelet may have written a status since the lists above)
    (only,) = (await pages(http, limit="5"))[1]
    assert set(only) == {"resourceVersion"}
    assert int(only["resourceVersion"]) >= int(metas[0]["resourceVersion"])
    assert len((await pages(http, limit="0"))[0]) == 5, "0: no limit"
    assert_status(await http.get(PODS, params={"limit": "many"}), 400, "BadRequest")


async def test_continued_pages_read_the_first_pages_snapshot(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    for name in ("a", "b", "c", "d"):
        assert (await http.post(PODS, json=pod_body(name))).status_code == 201
    first = (await http.get(PODS, params={"limit": "2"})).json()
    assert [i["metadata"]["name"] for i in first["items"]] == ["a", "b"]
    # meanwhile: a pod created, one deleted, the kubelet writes statuses
    assert (await http.post(PODS, json=pod_body("zz"))).status_code == 201
    assert (await http.delete(f"{PODS}/d", params={"gracePeriodSeconds": "0"})).status_code == 200
    await running_pod(http, "c")
    rest = (await http.get(PODS, params={"continue": first["metadata"]["continue"]})).json()
    assert [i["metadata"]["name"] for i in rest["items"]] == ["c", "d"], "as at the first page"
    assert rest["items"][0]["status"]["phase"] == "Pending", "c as it was then"
    assert rest["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    names, _ = await pages(http, limit="2")
    assert names == ["default/a", "default/b", "default/c", "default/zz"], "a new list: now"


async def test_invalid_continue_tokens_are_400(http: httpx.AsyncClient) -> None:
    for token in (
        "%%%",
        "bm90IGpzb24",  # "not json"
        encode_token(5, "a\x00").replace("eyJ2", "eyJ3"),  # another key: no "v"
        base64.urlsafe_b64encode(b'{"v":"meta.k8s.io/v2","rv":5,"start":"a"}').decode(),
        encode_token(0, "a\x00"),
        encode_token(5, ""),
        encode_token(5, "../other/a"),
    ):
        body = assert_status(await http.get(PODS, params={"continue": token}), 400, "BadRequest")
        assert body["message"].startswith("invalid continue token: continue key is not valid")


async def test_expired_continue_token_is_410_with_an_inconsistent_token(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    for name in ("a", "b", "c", "d", "e"):
        assert (await http.post(PODS, json=pod_body(name))).status_code == 201
    first = (await http.get(PODS, params={"limit": "2"})).json()
    token = first["metadata"]["continue"]
    fault = await add_fault(http, kind="continue_expired", count=1)
    assert fault["kind"] == "continue_expired"
    resp = await http.get(PODS, params={"limit": "2", "continue": token})
    body = assert_status(resp, 410, "Expired")
    assert body["message"].startswith("The provided continue parameter is too old")
    assert token_of(body) == {"v": "meta.k8s.io/v1", "rv": -1, "start": "b\x00"}
    assert sim.injected["continue_expired"] == 1

    # the Status's token goes on from the current state; the old one works again (count 1)
    assert (await http.delete(f"{PODS}/c", params={"gracePeriodSeconds": "0"})).status_code == 200
    names, _ = await pages(http, limit="2", **{"continue": body["metadata"]["continue"]})
    assert names == ["default/d", "default/e"]
    resp = await http.get(PODS, params={"limit": "2", "continue": token})
    assert [i["metadata"]["name"] for i in resp.json()["items"]] == ["c", "d"]

    # snapshots gone (as after a compaction): a token of the current resourceVersion still
    # reads (nothing changed since), one of an older resourceVersion is 410
    for name in ("a", "b", "d", "e"):
        await running_pod(http, name)  # the kubelet has nothing left to write
    second = (await http.get(PODS, params={"limit": "2"})).json()
    sim.pager.clear()
    assert second["metadata"]["resourceVersion"] == sim.store.resource_version
    resp = await http.get(PODS, params={"continue": second["metadata"]["continue"]})
    assert [i["metadata"]["name"] for i in resp.json()["items"]] == ["d", "e"]
    third = (await http.get(PODS, params={"limit": "2"})).json()
    sim.pager.clear()
    assert (await http.post(PODS, json=pod_body("f"))).status_code == 201
    resp = await http.get(PODS, params={"continue": third["metadata"]["continue"]})
    assert_status(resp, 410, "Expired")


def test_pager_snapshots_expire_and_are_bounded() -> None:
    now = [0.0]
    pager = Pager(ttl=10.0, keep=2, clock=lambda: now[0])
    items = [("a", {"n": 1}), ("b", {"n": 2}), ("c", {"n": 3})]

    def page(query: str, rv: int, token: str | None = None) -> Any:
        return pager.page(
            (query, "", ""), limit=1, token=token, resource_version=rv, listing=lambda: items
        )

    first = page("q1", 7)
    assert first.items == ['{"n": 1}'] and first.remaining == 2 and len(pager) == 1
    assert decode_token(first.continue_token) == (7, "a\x00")
    now[0] = 10.5
    with pytest.raises(Exception, match="too old") as info:
        page("q1", 8, first.continue_token)
    assert getattr(info.value, "code", None) == 410
    assert page("q1", 7, first.continue_token).items == ['{"n": 2}'], "its rv is current: read"
    page("q2", 8)
    page("q3", 8)
    assert len(pager) == 2, "at most keep snapshots"


async def test_graceful_delete_then_gone_and_agentserver_closed(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    ip = (await running_pod(http, "p1"))["status"]["podIP"]
    assert port_open(ip, 8080)

    resp = await http.delete(f"{PODS}/p1")
    assert resp.status_code == 200, resp.text
    meta = resp.json()["metadata"]
    assert TIMESTAMP.match(meta["deletionTimestamp"])
    assert meta["deletionGracePeriodSeconds"] == 30  # the pod's own grace, echoed
    during = await get_pod(http, "p1")
    assert during["metadata"]["deletionTimestamp"] and not is_ready(during)
    again = await http.delete(f"{PODS}/p1")
    assert again.status_code == 200 and again.json()["metadata"]["deletionTimestamp"]

    async def gone() -> bool:
        return (await http.get(f"{PODS}/p1")).status_code == 404

    started = time.monotonic()
    await eventually(gone, what="pod gone after its grace period")
    assert time.monotonic() - started <= 1.0  # the simulator's grace_period is 0.3 s
    assert not port_open(ip, 8080), "the AgentServer must stop with its pod"
    assert_status(await http.delete(f"{PODS}/p1"), 404, "NotFound")


async def test_delete_with_grace_zero_is_immediate(http: httpx.AsyncClient) -> None:
    for name in ("p1", "p2"):
        assert (await http.post(PODS, json=pod_body(name))).status_code == 201
        await running_pod(http, name)
    resp = await http.delete(f"{PODS}/p1", params={"gracePeriodSeconds": "0"})
    assert resp.status_code == 200 and resp.json()["metadata"]["name"] == "p1"
    assert_status(await http.get(f"{PODS}/p1"), 404, "NotFound")
    # DeleteOptions in the body, as kubectl sends it
    resp = await http.request(
        "DELETE", f"{PODS}/p2", json={"kind": "DeleteOptions", "gracePeriodSeconds": 0}
    )
    assert resp.status_code == 200
    assert_status(await http.get(f"{PODS}/p2"), 404, "NotFound")
    bad = await http.delete(f"{PODS}/p3", params={"gracePeriodSeconds": "soon"})
    assert_status(bad, 400, "BadRequest")


# --- namespaces ----------------------------------------------------------------------------------


async def test_namespaces_missing_and_forbidden(sim: KubeSim, http: httpx.AsyncClient) -> None:
    resp = await http.get("/api/v1/namespaces/team")
    assert resp.status_code == 200
    ns = resp.json()
    assert ns["kind"] == "Namespace" and ns["status"]["phase"] == "Active"
    assert ns["metadata"]["name"] == "team"
    body = assert_status(await http.get("/api/v1/namespaces/ghost"), 404, "NotFound")
    assert body["message"] == 'namespaces "ghost" not found'
    assert (await http.get("/api/v1/namespaces/ghost/pods")).json()["items"] == []  # as real

    team = "/api/v1/namespaces/team/pods"
    assert (await http.post(team, json=pod_body("t1"))).status_code == 201

    missing = await add_fault(http, kind="namespace_missing", namespace="team")
    assert_status(await http.get("/api/v1/namespaces/team"), 404, "NotFound")
    assert (await http.get(team)).json()["items"] == []
    assert_status(await http.get(f"{team}/t1"), 404, "NotFound")
    assert_status(await http.post(team, json=pod_body("t2")), 404, "NotFound")
    listed = (await http.get("/api/v1/namespaces")).json()
    assert [n["metadata"]["name"] for n in listed["items"]] == ["default"]
    assert (await http.delete(f"/_sim/faults/{missing['id']}")).status_code == 200
    assert (await http.get(f"{team}/t1")).status_code == 200, "the fault hid it, no more"

    await add_fault(http, kind="namespace_forbidden", namespace="team")
    body = assert_status(await http.get(team), 403, "Forbidden")
    assert body["message"] == (
        'pods is forbidden: User "system:anonymous" cannot list resource "pods" in API group "" '
        'in the namespace "team"'
    )
    body = assert_status(await http.get(f"{team}/t1"), 403, "Forbidden")
    assert body["message"].startswith('pods "t1" is forbidden: User "system:anonymous" cannot get')
    assert_status(await http.delete(f"{team}/t1"), 403, "Forbidden")
    assert_status(await http.post(team, json=pod_body("t3")), 403, "Forbidden")
    assert_status(await http.get("/api/v1/namespaces/team"), 403, "Forbidden")
    assert (await http.get(PODS)).status_code == 200, "other namespaces are not affected"
    assert sim.pod("team", "t1") is not None, "a refused delete deleted nothing"


# --- API faults ----------------------------------------------------------------------------------


async def test_429_has_retry_after_and_counts_down(sim: KubeSim, http: httpx.AsyncClient) -> None:
    await add_fault(http, kind="api_error", status=429, verb="create", count=1, retry_after=2)
    resp = await http.post(PODS, json=pod_body("p1"))
    body = assert_status(resp, 429, "TooManyRequests")
    assert resp.headers["Retry-After"] == "2"
    assert body["details"] == {"retryAfterSeconds": 2}
    assert sim.pod("default", "p1") is None, "a refused create stores nothing"
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201  # count used up
    assert (await http.get("/_sim/faults")).json() == []
    state = (await http.get("/_sim/state")).json()
    assert state["requests"]["create pods"] == 2 and state["injected"] == {"api_error 429": 1}


async def test_5xx_per_verb(http: httpx.AsyncClient) -> None:
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    await add_fault(http, kind="api_error", status=503, verb="list")
    await add_fault(http, kind="api_error", status=500, verb="delete", resource="pods")
    body = assert_status(await http.get(PODS), 503, "ServiceUnavailable")
    assert body["details"]["causes"]
    assert (await http.get(f"{PODS}/p1")).status_code == 200, "get is another verb"
    body = assert_status(await http.delete(f"{PODS}/p1"), 500, "InternalError")
    assert body["message"].startswith("Internal error occurred:")
    assert (await http.get(f"{PODS}/p1")).status_code == 200, "a refused delete deleted nothing"


async def test_error_ratio_is_a_share(sim: KubeSim, http: httpx.AsyncClient) -> None:
    await add_fault(http, kind="api_error", status=500, verb="get", ratio=0.5)
    codes = [(await http.get(f"{PODS}/nope")).status_code for _ in range(60)]
    failed = codes.count(500)
    assert codes.count(404) + failed == 60
    assert 10 <= failed <= 50, failed
    assert sim.injected["api_error 500"] == failed


async def test_latency_per_verb(http: httpx.AsyncClient) -> None:
    await add_fault(http, kind="latency", seconds=0.3, verb="get")
    started = time.monotonic()
    assert (await http.get(f"{PODS}/nope")).status_code == 404
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    assert (await http.get(PODS)).status_code == 200
    assert time.monotonic() - started < 0.3, "list is not slowed"


async def test_a_client_that_gives_up_during_latency_changes_nothing(
    sim: KubeSim, http: httpx.AsyncClient
) -> None:
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    await add_fault(http, kind="latency", seconds=0.4, verb="delete")
    await add_fault(http, kind="latency", seconds=0.4, verb="create")
    with pytest.raises(httpx.ReadTimeout):
        await http.delete(f"{PODS}/p1", params={"gracePeriodSeconds": "0"}, timeout=0.1)
    with pytest.raises(httpx.ReadTimeout):
        await http.post(PODS, json=pod_body("p2"), timeout=0.1)
    await asyncio.sleep(0.5)  # past the latency
    assert sim.pod("default", "p1") is not None, "the request was dropped with its client"
    assert sim.pod("default", "p2") is None


async def test_reply_lost_create_is_applied(sim: KubeSim, http: httpx.AsyncClient) -> None:
    await add_fault(http, kind="reply_lost", mode="drop", count=1)
    with pytest.raises(httpx.RemoteProtocolError):
        await http.post(PODS, json=pod_body("p1"))
    assert (await http.get(f"{PODS}/p1")).status_code == 200, "stored all the same"

    await add_fault(http, kind="reply_lost", mode="500", name="p2")
    assert (await http.post(PODS, json=pod_body("p3"))).status_code == 201, "another name"
    body = assert_status(await http.post(PODS, json=pod_body("p2")), 500, "InternalError")
    assert "applied but its reply was lost" in body["message"]
    assert (await http.get(f"{PODS}/p2")).status_code == 200
    assert sim.injected == {"reply_lost drop": 1, "reply_lost 500": 1}

    await add_fault(http, kind="reply_lost", mode="500", verb="delete", count=1)
    assert_status(
        await http.delete(f"{PODS}/p3", params={"gracePeriodSeconds": "0"}), 500, "InternalError"
    )
    assert (await http.get(f"{PODS}/p3")).status_code == 404, "the delete was applied"


# --- pod faults ----------------------------------------------------------------------------------


async def test_image_pull_failure(sim: KubeSim, http: httpx.AsyncClient) -> None:
    sim.kubelet.ready_delay = 0.3  # ErrImagePull shows this long before the back-off
    await add_fault(http, kind="image_pull", count=1)
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    reasons: list[str | None] = []

    async def backing_off() -> bool:
        pod = await get_pod(http, "p1")
        reasons.append(waiting_reason(pod))
        assert pod["status"]["phase"] == "Pending" and not is_ready(pod)
        return reasons[-1] == "ImagePullBackOff"

    await eventually(backing_off, what="ImagePullBackOff")
    assert "ErrImagePull" in reasons
    assert reasons.index("ErrImagePull") < reasons.index("ImagePullBackOff")
    pod = await get_pod(http, "p1")
    assert (
        "Back-off pulling image"
        in pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    )
    assert sim.kubelet.server("default", "p1") is None, "nothing runs"
    assert (await http.post(PODS, json=pod_body("p2"))).status_code == 201
    await running_pod(http, "p2")  # count=1: the next pod is fine


async def test_crash_loop(sim: KubeSim, http: httpx.AsyncClient) -> None:
    await add_fault(http, kind="crash_loop", labels="app=x")
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201

    async def crashing() -> bool:
        return waiting_reason(await get_pod(http, "p1")) == "CrashLoopBackOff"

    await eventually(crashing, what="CrashLoopBackOff")
    pod = await get_pod(http, "p1")
    (cs,) = pod["status"]["containerStatuses"]
    assert pod["status"]["phase"] == "Running" and not is_ready(pod)
    assert cs["restartCount"] >= 1 and cs["lastState"]["terminated"]["exitCode"] == 1
    # only pods whose labels match
    assert (await http.post(PODS, json=pod_body("p2", labels={"app": "y"}))).status_code == 201
    await running_pod(http, "p2")


async def test_never_ready_running_and_pending(sim: KubeSim, http: httpx.AsyncClient) -> None:
    await add_fault(http, kind="never_ready", name="run-*")
    await add_fault(http, kind="never_ready", mode="pending", name="wait-*")
    for name in ("run-1", "wait-1"):
        assert (await http.post(PODS, json=pod_body(name))).status_code == 201

    async def running() -> bool:
        return (await get_pod(http, "run-1"))["status"]["phase"] == "Running"

    await eventually(running, what="run-1 Running")
    await asyncio.sleep(0.2)  # several readiness periods
    pod = await get_pod(http, "run-1")
    assert not is_ready(pod) and pod["status"]["podIP"]
    async with httpx.AsyncClient(trust_env=False, timeout=3) as plain:
        health = await plain.get(f"http://{pod['status']['podIP']}:8080/health")
    assert health.status_code == 500

    waiting = await get_pod(http, "wait-1")
    assert waiting["status"]["phase"] == "Pending" and "podIP" not in waiting["status"]
    (scheduled,) = waiting["status"]["conditions"]
    assert scheduled["type"] == "PodScheduled" and scheduled["status"] == "False"
    assert scheduled["reason"] == "Unschedulable"
    # an unscheduled pod is deleted at once, whatever the grace period
    resp = await http.delete(f"{PODS}/wait-1")
    assert resp.status_code == 200
    assert_status(await http.get(f"{PODS}/wait-1"), 404, "NotFound")


async def test_health_fault_500_and_hang(sim: KubeSim, http: httpx.AsyncClient) -> None:
    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    ip = (await running_pod(http, "p1"))["status"]["podIP"]
    url = f"http://{ip}:8080/health"
    async with httpx.AsyncClient(trust_env=False, timeout=3) as plain:
        fault = await add_fault(http, kind="health", mode="500", name="p1")
        assert (await plain.get(url)).status_code == 500

        async def not_ready() -> bool:
            return not is_ready(await get_pod(http, "p1"))

        await eventually(not_ready, what="Ready False under a /health fault")
        pod = await get_pod(http, "p1")
        assert pod["status"]["phase"] == "Running", "half-dead: Running, /health failing"

        assert (await http.delete(f"/_sim/faults/{fault['id']}")).status_code == 200
        assert (await plain.get(url)).status_code == 200
        await running_pod(http, "p1")  # Ready again

        await add_fault(http, kind="health", mode="hang", labels="app=x", count=1)
        with pytest.raises(httpx.ReadTimeout):
            await plain.get(url, timeout=0.3)
        assert (await plain.get(url)).status_code == 200, "count=1: one answer hung"


async def test_kill_modes(sim: KubeSim, http: httpx.AsyncClient) -> None:
    for name in ("v", "f", "c"):
        assert (await http.post(PODS, json=pod_body(name))).status_code == 201
    ips = {name: (await running_pod(http, name))["status"]["podIP"] for name in ("v", "f", "c")}

    resp = await http.post("/_sim/pods/default/v/kill", json={"mode": "vanish"})
    assert resp.status_code == 200 and resp.json()["pod"] is None
    assert_status(await http.get(f"{PODS}/v"), 404, "NotFound")

    resp = await http.post("/_sim/pods/default/f/kill", json={"mode": "fail"})
    assert resp.status_code == 200
    failed = await get_pod(http, "f")
    assert failed["status"]["phase"] == "Failed" and failed["status"]["reason"] == "Evicted"
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
    assert not is_ready(failed)

    assert (await http.post("/_sim/pods/default/c/kill", json={"mode": "crash"})).status_code == 200
    assert waiting_reason(await get_pod(http, "c")) == "CrashLoopBackOff"

    for ip in ips.values():
        assert not port_open(ip, 8080), "a killed pod's AgentServer is gone"
    # a Failed pod is deleted at once (nothing left to stop)
    await http.delete(f"{PODS}/f")
    assert_status(await http.get(f"{PODS}/f"), 404, "NotFound")

    assert (await http.post("/_sim/pods/default/nope/kill")).status_code == 404
    assert (await http.post("/_sim/pods/default/c/kill", json={"mode": "x"})).status_code == 400


# --- control endpoint ----------------------------------------------------------------------------


async def test_control_endpoint(sim: KubeSim, http: httpx.AsyncClient) -> None:
    for bad, message in (
        ({"kind": "meteor"}, "unknown fault kind"),
        ({}, "kind is required"),
        ({"kind": "health", "mode": "slow"}, "health.mode must be one of"),
        ({"kind": "api_error", "status": 200}, "api_error.status must be in"),
        ({"kind": "api_error", "verb": "update"}, "api_error.verb must be one of"),
        ({"kind": "latency", "seconds": -1}, "latency.seconds must be in"),
        ({"kind": "image_pull", "ratio": 0}, "ratio must be above 0"),
        ({"kind": "image_pull", "count": 0}, "count must be in"),
        ({"kind": "image_pull", "colour": "red"}, "unknown field(s) colour"),
        ({"kind": "image_pull", "labels": "a in ("}, "labels: unable to parse"),
        ({"kind": "namespace_missing"}, "needs a namespace"),
        ({"kind": "namespace_missing", "namespace": "x", "count": 1}, "takes only a namespace"),
        ({"kind": "continue_expired", "status": 410}, "unknown field(s) status"),
    ):
        resp = await http.post("/_sim/faults", json=bad)
        assert resp.status_code == 400, (bad, resp.text)
        assert message in resp.json()["error"], (bad, resp.text)
    assert (await http.post("/_sim/faults", content=b"[1]")).status_code == 400

    one = await add_fault(http, kind="latency", seconds=0.01, verb="list", count=5)
    assert one == {
        "id": one["id"],
        "kind": "latency",
        "seconds": 0.01,
        "verb": "list",
        "resource": "*",
        "count": 5,
        "hits": 0,
    }
    two = await add_fault(http, kind="api_error", status=429)
    assert [f["id"] for f in (await http.get("/_sim/faults")).json()] == [one["id"], two["id"]]
    assert (await http.delete(f"/_sim/faults/{two['id']}")).status_code == 200
    assert (await http.delete(f"/_sim/faults/{two['id']}")).status_code == 404
    assert (await http.delete("/_sim/faults")).json() == {"faults": []}
    assert sim.faults.rules() == []

    resp = await http.post("/_sim/settings", json={"ready_delay": 0.01, "grace_period": 0.1})
    assert resp.status_code == 200 and resp.json()["ready_delay"] == 0.01
    assert (await http.post("/_sim/settings", json={"bogus": 1})).status_code == 400
    assert (await http.post("/_sim/settings", json={"jitter": -1})).status_code == 400

    assert (await http.post("/_sim/namespaces/extra")).status_code == 201
    assert (await http.post("/_sim/namespaces/Not_Valid")).status_code == 400
    assert (
        await http.post("/api/v1/namespaces/extra/pods", json=pod_body("e1"))
    ).status_code == 201
    assert (await http.delete("/_sim/namespaces/extra")).status_code == 200
    assert sim.pod("extra", "e1") is None
    assert (await http.delete("/_sim/namespaces/extra")).status_code == 404

    assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
    state = (await http.get("/_sim/state")).json()
    assert state["url"] == sim.url and state["namespaces"] == {
        "default": "active",
        "team": "active",
    }
    assert [p["name"] for p in state["pods"]] == ["p1"]
    assert state["requests"]["create pods"] == 2
    assert (await http.post("/_sim/reset")).status_code == 200
    state = (await http.get("/_sim/state")).json()
    assert state["pods"] == [] and state["requests"] == {} and state["faults"] == []


async def test_token_auth_and_kubeconfig(tmp_path: Path) -> None:
    from kubernetes_asyncio import client, config

    path = tmp_path / "kc" / "config"
    async with (
        KubeSim(token="s3cret", kubeconfig_path=path) as sim,
        httpx.AsyncClient(base_url=sim.url, trust_env=False) as http,
    ):
        assert sim.kubeconfig_path == path and path.stat().st_mode & 0o077 == 0
        assert_status(await http.get(PODS), 401, "Unauthorized")
        bad = {"Authorization": "Bearer nope"}
        assert_status(await http.get(PODS, headers=bad), 401, "Unauthorized")
        good = {"Authorization": "Bearer s3cret"}
        assert (await http.get(PODS, headers=good)).status_code == 200
        assert (await http.get("/_sim/state")).status_code == 200, "control needs no token"
        await add_fault(http, kind="namespace_forbidden", namespace="default")
        body = assert_status(await http.get(PODS, headers=good), 403, "Forbidden")
        assert 'User "kubesim"' in body["message"]

        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(path), client_configuration=configuration)
        assert configuration.host == sim.url
        assert configuration.api_key == {"BearerToken": "Bearer s3cret"}
    assert path.exists(), "a kubeconfig path the caller chose is left in place"
    assert "token" not in render_kubeconfig("http://127.0.0.1:1")


async def test_discovery() -> None:
    async with (
        KubeSim() as sim,
        httpx.AsyncClient(base_url=sim.url, trust_env=False) as http,
    ):
        assert (await http.get("/version")).json()["major"] == "1"
        assert (await http.get("/api")).json()["versions"] == ["v1"]
        kinds = {r["name"] for r in (await http.get("/api/v1")).json()["resources"]}
        assert kinds == {"pods", "namespaces", "nodes", "events"}
        assert (await http.get("/healthz")).text == "ok"


async def test_stop_leaves_no_socket_no_task_no_file() -> None:
    sim = KubeSim(ready_delay=0.01, grace_period=5.0, probe_period=0.05)
    async with sim, httpx.AsyncClient(base_url=sim.url, trust_env=False) as http:
        url, port, kubeconfig = sim.url, sim.port, sim.kubeconfig_path
        assert kubeconfig is not None and kubeconfig.exists()
        for name in ("p1", "p2", "p3"):
            assert (await http.post(PODS, json=pod_body(name))).status_code == 201
        ips = [(await running_pod(http, n))["status"]["podIP"] for n in ("p1", "p2", "p3")]
        await add_fault(http, kind="health", mode="hang", name="p1")

        async def hang() -> httpx.Response:
            async with httpx.AsyncClient(trust_env=False, timeout=10) as plain:
                return await plain.get(f"http://{ips[0]}:8080/health")

        hanging = asyncio.create_task(hang())
        await asyncio.sleep(0.1)
        assert (await http.delete(f"{PODS}/p2")).status_code == 200  # in its grace period
        async with aiohttp.ClientSession() as session:
            stream = await session.get(f"http://{ips[2]}:8080/sse")
            await stream.content.readuntil(b"\n\n")
            started = time.monotonic()
            await sim.stop()
            assert time.monotonic() - started < 3.0
            stream.close()
    with pytest.raises(Exception):  # noqa: B017 - any refusal: nothing listens any more
        async with httpx.AsyncClient(trust_env=False, timeout=1) as again:
            await again.get(f"{url}/version")
    assert not port_open("127.0.0.1", port)
    for ip in ips:
        assert not port_open(ip, 8080)
    assert not kubeconfig.exists() and not kubeconfig.parent.exists()
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kubesim")] == []
    answered = await hanging
    assert answered.status_code == 503, "a hung /health answers when its pod stops"


def test_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback"):
        KubeSim(host="0.0.0.0")
    with pytest.raises(ValueError, match="loopback"):
        KubeSim(first_pod_ip="10.0.0.2")


# --- the CLI -------------------------------------------------------------------------------------


async def start_cli(tmp_path: Path, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    kubeconfig = tmp_path / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent_runtime.cli",
        "kubesim",
        "--port",
        "0",
        "--kubeconfig-out",
        str(kubeconfig),
        "--ready-delay",
        "0.05",
        "--jitter",
        "0.01",
        "--log-level",
        "WARNING",
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
    match = re.match(r"kubesim: listening on (http://127\.0\.0\.1:\d+), kubeconfig (.+)$", line)
    assert match, line
    assert Path(match[2].strip()) == kubeconfig
    assert match[1] in kubeconfig.read_text()
    return proc, match[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_cli_runs_until_signal_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    proc, url = await start_cli(tmp_path)
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=5) as http:
            assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
            ip = (await running_pod(http, "p1"))["status"]["podIP"]
            assert (await http.get(f"http://{ip}:8080/health")).status_code == 200
    finally:
        proc.send_signal(sig)
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0, stderr.decode()
    assert not port_open(ip, 8080)


async def test_cli_first_pod_ip_sets_where_pod_ips_start(tmp_path: Path) -> None:
    """Two simulators at once (a default and a named cluster) need distinct pod IP ranges:
    their AgentServers would otherwise want the same loopback address and port."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--first-pod-ip",
            "127.0.62.2",
            "--ready-delay",
            "0",
            "--kubeconfig-out",
            str(tmp_path / "k"),
        ]
    )
    async with (
        build_sim(args) as sim,
        httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=5) as http,
    ):
        assert (await http.post(PODS, json=pod_body("p1"))).status_code == 201
        assert (await running_pod(http, "p1"))["status"]["podIP"] == "127.0.62.2"
    with pytest.raises(ValueError, match="loopback"):
        build_sim(parser.parse_args(["--first-pod-ip", "10.0.0.2"]))


async def test_cli_refuses_a_non_loopback_host(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent_runtime.cli",
        "kubesim",
        "--host",
        "0.0.0.0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 2
    assert stderr.decode().strip() == (
        "kubesim: error: kubesim binds to loopback addresses only, not '0.0.0.0'"
    )


# --- annotations and PATCH (the pod identity's signature is patched on after the create) ------

MERGE = {"Content-Type": "application/merge-patch+json"}
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}


async def test_annotations_are_stored_and_returned_as_the_api_server_does(
    http: httpx.AsyncClient,
) -> None:
    notes = {"agent-runtime/identity": "v1:abc", "example.com/free-text": "any thing: /x\n"}
    created = await http.post(PODS, json=pod_body("p1", annotations=notes))
    assert created.status_code == 201, created.text
    assert created.json()["metadata"]["annotations"] == notes
    assert (await get_pod(http, "p1"))["metadata"]["annotations"] == notes
    listed = (await http.get(PODS, params={"labelSelector": "app"})).json()["items"]
    assert [p["metadata"]["annotations"] for p in listed] == [notes]

    bad_key = pod_body("p2", annotations={"bad key": "x"})
    body = assert_status(await http.post(PODS, json=bad_key), 422, "Invalid")
    assert body["details"]["causes"][0]["field"] == "metadata.annotations"
    not_text = pod_body("p3", annotations={"a": 1})
    assert_status(await http.post(PODS, json=not_text), 422, "Invalid")
    huge = pod_body("p4", annotations={"a": "x" * (256 * 1024)})
    body = assert_status(await http.post(PODS, json=huge), 422, "Invalid")
    assert "Too long: must have at most 262144 bytes" in body["message"]
    assert (await http.get(f"{PODS}/p2")).status_code == 404


async def test_patch_merges_labels_and_annotations(sim: KubeSim, http: httpx.AsyncClient) -> None:
    created = (await http.post(PODS, json=pod_body("p1", annotations={"keep": "1"}))).json()
    uid, version = created["metadata"]["uid"], created["metadata"]["resourceVersion"]
    patch = {"metadata": {"uid": uid, "annotations": {"signed": "v1:x"}, "labels": {"tier": "a"}}}
    resp = await http.patch(f"{PODS}/p1", json=patch, headers=MERGE)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["metadata"]
    assert meta["annotations"] == {"keep": "1", "signed": "v1:x"}
    assert meta["labels"] == {"app": "x", "tier": "a"}
    assert meta["uid"] == uid and int(meta["resourceVersion"]) > int(version)
    assert (await get_pod(http, "p1"))["metadata"] == meta
    # the same patch again (a retry after a lost reply) changes nothing
    again = await http.patch(f"{PODS}/p1", json=patch, headers=STRATEGIC)
    assert again.status_code == 200 and again.json()["metadata"] == meta
    # null removes a key; an emptied map goes
    drop = {"metadata": {"annotations": {"keep": None, "signed": None}}}
    gone = (await http.patch(f"{PODS}/p1", json=drop, headers=MERGE)).json()["metadata"]
    assert "annotations" not in gone
    assert sim.requests["patch pods"] == 3


async def test_patch_refusals(http: httpx.AsyncClient) -> None:
    created = (await http.post(PODS, json=pod_body("p1"))).json()
    uid = created["metadata"]["uid"]
    other_uid = {"metadata": {"uid": "another-incarnation", "annotations": {"a": "b"}}}
    body = assert_status(
        await http.patch(f"{PODS}/p1", json=other_uid, headers=MERGE), 422, "Invalid"
    )
    assert (
        "metadata.uid: Invalid value" in body["message"] and "field is immutable" in body["message"]
    )
    stale = {"metadata": {"resourceVersion": "1", "annotations": {"a": "b"}}}
    assert_status(await http.patch(f"{PODS}/p1", json=stale, headers=MERGE), 409, "Conflict")
    image = {"spec": {"containers": [{"name": "agentserver", "image": "attacker/agent"}]}}
    assert_status(await http.patch(f"{PODS}/p1", json=image, headers=MERGE), 422, "Invalid")
    bad = {"metadata": {"annotations": {"bad key": "x"}}}
    assert_status(await http.patch(f"{PODS}/p1", json=bad, headers=MERGE), 422, "Invalid")
    json_patch = [{"op": "add", "path": "/metadata/annotations", "value": {}}]
    resp = await http.patch(
        f"{PODS}/p1", json=json_patch, headers={"Content-Type": "application/json-patch+json"}
    )
    assert_status(resp, 415, "UnsupportedMediaType")
    missing = await http.patch(f"{PODS}/nope", json={"metadata": {}}, headers=MERGE)
    assert_status(missing, 404, "NotFound")
    meta = (await get_pod(http, "p1"))["metadata"]
    assert (meta["labels"], meta["uid"]) == ({"app": "x"}, uid)
    assert "annotations" not in meta, "nothing changed"


async def test_patch_faults_and_rbac(sim: KubeSim, http: httpx.AsyncClient) -> None:
    await http.post(PODS, json=pod_body("p1"))
    patch = {"metadata": {"annotations": {"a": "b"}}}
    await add_fault(http, kind="api_error", verb="patch", status=503, count=1)
    assert_status(
        await http.patch(f"{PODS}/p1", json=patch, headers=MERGE), 503, "ServiceUnavailable"
    )
    assert "annotations" not in (await get_pod(http, "p1"))["metadata"]
    await add_fault(http, kind="reply_lost", verb="patch", mode="500", count=1)
    assert_status(await http.patch(f"{PODS}/p1", json=patch, headers=MERGE), 500, "InternalError")
    assert (await get_pod(http, "p1"))["metadata"]["annotations"] == {"a": "b"}, "applied"
    await add_fault(http, kind="namespace_forbidden", namespace="default")
    body = assert_status(
        await http.patch(f"{PODS}/p1", json=patch, headers=MERGE), 403, "Forbidden"
    )
    assert 'cannot patch resource "pods"' in body["message"]
