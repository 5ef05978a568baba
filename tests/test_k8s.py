"""The Kubernetes adapter without a cluster: pod body, phase rules, the real client's error
handling over a scripted CoreV1Api, health probes on loopback, and the fake's faults.

The real client against a Kubernetes API server is a later issue.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import socket
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes_asyncio.client import (
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodStatus,
)
from kubernetes_asyncio.client.exceptions import ApiException

from agent_runtime import label_selector as selectors
from agent_runtime.label_selector import Requirement
from agent_runtime.resource_manager import k8s_real as k8s_module
from agent_runtime.resource_manager import pod_reading
from agent_runtime.resource_manager.clusters import ClusterConfig
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import (
    APP_LABEL,
    COMPONENT_LABEL,
    COMPONENT_SELECTOR,
    DEPLOY_VER_LABEL,
    SCOPE_LABEL,
    DeployFailed,
    K8sApiError,
    normalize_phase,
)
from agent_runtime.resource_manager.pod_manifest import build_pod_body, new_pod_name
from agent_runtime.resource_manager.pod_reading import (
    iter_json_object,
    pod_status,
    pod_status_from_json,
    read_pod_list,
)
from helpers import IDENTITY

SCOPE = "0123456789abcdef0123456789abcdef"
VER = "feedfacecafebeef"
NAME_RE = re.compile(r"^agent-[a-z0-9]{10}-[a-z0-9]{5}$")


def spec(**overrides: Any) -> dict[str, Any]:
    """A complete pod spec as a template gives it, with short timeouts."""
    base: dict[str, Any] = {
        "image": "registry.local/agent:1.0",
        "pod_name": "agent",
        "namespace": None,
        "container_port": 8080,
        "sse_port": 8080,
        "sse_path": "/sse",
        "cpu_request": None,
        "cpu_limit": None,
        "memory_request": None,
        "memory_limit": None,
        "env": {},
        "nfs_server": None,
        "nfs_path": None,
        "nfs_mount_path": None,
        "ready_timeout": 1.0,
        "ready_poll_interval": 0.02,
        "kubeconfig": None,
    }
    return {**base, **overrides}


def container(body: dict[str, Any]) -> dict[str, Any]:
    [only] = body["spec"]["containers"]
    return only


def v1pod(
    name: str = "agent-x",
    *,
    namespace: str = "ns",
    phase: str | None = "Running",
    ready: bool = True,
    ip: str | None = "10.1.2.3",
    waiting: str | None = None,
    deleting: bool = False,
    labels: dict[str, str] | None = None,
    uid: str | None = None,
    annotations: dict[str, str] | None = None,
) -> V1Pod:
    state = (
        V1ContainerState(waiting=V1ContainerStateWaiting(reason=waiting))
        if waiting
        else V1ContainerState(running=V1ContainerStateRunning())
    )
    return V1Pod(
        metadata=V1ObjectMeta(
            name=name,
            namespace=namespace,
            labels=labels,
            uid=uid,
            annotations=annotations,
            deletion_timestamp=datetime.now(UTC) if deleting else None,
        ),
        status=V1PodStatus(
            phase=phase,
            pod_ip=ip,
            conditions=[V1PodCondition(type="Ready", status="True" if ready else "False")],
            container_statuses=[
                V1ContainerStatus(
                    name="agentserver",
                    image="registry.local/agent:1.0",
                    image_id="",
                    ready=ready,
                    restart_count=0,
                    state=state,
                )
            ],
        ),
    )


def pending(**fields: Any) -> V1Pod:
    return v1pod(phase="Pending", ready=False, ip=None, **fields)


def api_error(status: int, reason: str, message: str = "", **headers: str) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"message": message}).encode() if message else None
    exc.headers = {k.replace("_", "-"): v for k, v in headers.items()} or None
    return exc


# --- build_pod_body ----------------------------------------------------------------------------


def test_pod_name_shape_and_uniqueness() -> None:
    names = {new_pod_name("agent") for _ in range(1000)}
    assert len(names) == 1000
    assert all(NAME_RE.fullmatch(n) for n in names)
    assert NAME_RE.fullmatch(new_pod_name(None))
    assert re.fullmatch(r"bot-a-[a-z0-9]{10}-[a-z0-9]{5}", new_pod_name("bot-a"))


def test_body_labels_and_shape() -> None:
    body = build_pod_body("agent-abc", SCOPE, VER, spec())
    assert body["apiVersion"] == "v1" and body["kind"] == "Pod"
    assert body["metadata"]["name"] == "agent-abc"
    assert body["metadata"]["labels"] == {
        COMPONENT_LABEL: "agentserver",
        APP_LABEL: "agent-abc",
        SCOPE_LABEL: SCOPE,
        DEPLOY_VER_LABEL: VER,
    }
    assert body["spec"]["restartPolicy"] == "Always"
    c = container(body)
    assert c["name"] == "agentserver"
    assert c["image"] == "registry.local/agent:1.0"


def test_body_has_only_sse_port_when_ports_match() -> None:
    c = container(build_pod_body("p", SCOPE, VER, spec(sse_port=9000, container_port=9000)))
    assert c["ports"] == [{"name": "sse", "containerPort": 9000, "protocol": "TCP"}]


def test_body_adds_http_port_when_ports_differ() -> None:
    c = container(build_pod_body("p", SCOPE, VER, spec(sse_port=9000, container_port=8080)))
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("sse", 9000), ("http", 8080)]


def test_body_env_sorted() -> None:
    c = container(build_pod_body("p", SCOPE, VER, spec(env={"ZED": "1", "ALPHA": "2", "MID": ""})))
    assert c["env"] == [
        {"name": "ALPHA", "value": "2"},
        {"name": "MID", "value": ""},
        {"name": "ZED", "value": "1"},
    ]


def test_body_resources_only_when_set() -> None:
    assert "resources" not in container(build_pod_body("p", SCOPE, VER, spec()))
    c = container(build_pod_body("p", SCOPE, VER, spec(cpu_request="500m")))
    assert c["resources"] == {"requests": {"cpu": "500m"}}
    c = container(
        build_pod_body(
            "p",
            SCOPE,
            VER,
            spec(cpu_request="1", cpu_limit="2", memory_request="256Mi", memory_limit="1Gi"),
        )
    )
    assert c["resources"] == {
        "requests": {"cpu": "1", "memory": "256Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }


def test_body_readiness_probe_on_sse_port() -> None:
    c = container(build_pod_body("p", SCOPE, VER, spec(sse_port=9000, container_port=8080)))
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9000}


def test_body_nfs_on_and_off() -> None:
    plain = build_pod_body("p", SCOPE, VER, spec())
    assert "volumes" not in plain["spec"]
    assert "volumeMounts" not in container(plain)
    body = build_pod_body(
        "p", SCOPE, VER, spec(nfs_server="nfs.local", nfs_path="/export", nfs_mount_path="/data")
    )
    [volume] = body["spec"]["volumes"]
    assert volume["nfs"] == {"server": "nfs.local", "path": "/export"}
    assert container(body)["volumeMounts"] == [{"name": volume["name"], "mountPath": "/data"}]


def test_body_without_image_is_a_deploy_failure() -> None:
    with pytest.raises(DeployFailed, match="image"):
        build_pod_body("p", SCOPE, VER, spec(image=None))


# --- pod_status / normalize_phase ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "phase", "ready", "dead"),
    [
        (v1pod(), "Running", True, False),
        (pending(), "Pending", False, False),
        (v1pod(ready=False, waiting="CrashLoopBackOff"), "CrashLoopBackOff", False, True),
        (pending(waiting="ImagePullBackOff"), "ImagePullBackOff", False, True),
        (pending(waiting="ErrImagePull"), "ErrImagePull", False, True),
        (pending(waiting="ContainerCreating"), "Pending", False, False),
        (v1pod(deleting=True), "Terminating", True, True),
        (v1pod(phase="Failed", ready=False), "Failed", False, True),
        (v1pod(phase="Succeeded", ready=False), "Succeeded", False, True),
        (v1pod(phase=None, ready=False), "Unknown", False, False),
    ],
    ids=[
        "running-ready",
        "pending",
        "crashloop-on-running",
        "imagepull-on-pending",
        "errimagepull",
        "creating",
        "deleting",
        "failed",
        "succeeded",
        "no-phase",
    ],
)
def test_pod_status(pod: V1Pod, phase: str, ready: bool, dead: bool) -> None:
    status = pod_status(pod)
    assert (status.phase, status.ready, status.dead) == (phase, ready, dead)
    assert pod_status_from_json(as_json(pod)) == status, "a LIST page reads it the same"


def as_json(pod: V1Pod) -> dict[str, Any]:
    """The Pod as the API server sends it: camelCase JSON (times as strings)."""
    loaded: dict[str, Any] = json.loads(json.dumps(pod.to_dict(serialize=True), default=str))
    return loaded


def test_pod_status_fields() -> None:
    labels = {SCOPE_LABEL: SCOPE, DEPLOY_VER_LABEL: VER}
    status = pod_status(v1pod("agent-q", namespace="team", ip="10.9.9.9", labels=labels))
    assert (status.pod_id, status.namespace, status.pod_ip) == ("agent-q", "team", "10.9.9.9")
    assert (status.scope_id, status.deploy_ver) == (SCOPE, VER)
    assert pod_status(v1pod(phase="Pending", ip=None)).pod_ip is None


def test_pod_status_reads_init_containers_as_the_json_path() -> None:
    pod = pending()
    pod.status.init_container_statuses = [
        V1ContainerStatus(
            name="init",
            image="busybox",
            image_id="",
            ready=False,
            restart_count=0,
            state=V1ContainerState(waiting=V1ContainerStateWaiting(reason="ErrImagePull")),
        ),
        V1ContainerStatus(
            name="init2", image="busybox", image_id="", ready=False, restart_count=0, state=None
        ),
    ]
    status = pod_status(pod)
    assert status.phase == "ErrImagePull" and status.dead
    assert pod_status_from_json(as_json(pod)) == status


def test_pod_status_without_status_block() -> None:
    status = pod_status(V1Pod(metadata=V1ObjectMeta(name="p", namespace="ns")))
    assert (status.phase, status.ready, status.pod_ip, status.labels) == (
        "Unknown",
        False,
        None,
        {},
    )
    assert pod_status_from_json({"metadata": {"name": "p", "namespace": "ns"}}) == status


def test_pod_status_from_json_as_the_api_sends_it() -> None:
    """Only the fields the rules read matter; absent, null or empty blocks are tolerated."""
    pod = {
        "metadata": {
            "name": "agent-q",
            "namespace": "team",
            "labels": {SCOPE_LABEL: SCOPE, DEPLOY_VER_LABEL: VER},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"containers": [{"name": "agentserver", "image": "x:1"}]},
        "status": {
            "phase": "Running",
            "podIP": "10.9.9.9",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True", "lastProbeTime": None},
            ],
            "initContainerStatuses": [{"name": "init", "state": {"terminated": {"exitCode": 0}}}],
            "containerStatuses": [{"name": "agentserver", "state": {"running": {}}}],
        },
    }
    status = pod_status_from_json(pod)
    assert (status.pod_id, status.namespace, status.phase, status.ready, status.pod_ip) == (
        "agent-q",
        "team",
        "Running",
        True,
        "10.9.9.9",
    )
    assert (status.scope_id, status.deploy_ver, status.dead) == (SCOPE, VER, False)

    pod["status"]["initContainerStatuses"] = [
        {"name": "init", "state": {"waiting": {"reason": "ImagePullBackOff"}}}
    ]
    assert pod_status_from_json(pod).phase == "ImagePullBackOff", "init containers count"
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_status_from_json(pod).phase == "Terminating"
    bare = {"metadata": {"name": "p", "labels": None}, "status": {"podIP": "", "conditions": None}}
    assert pod_status_from_json(bare) == pod_status_from_json({"metadata": {"name": "p"}})
    assert pod_status_from_json(bare).pod_ip is None and pod_status_from_json(bare).namespace == ""


def test_normalize_phase_order() -> None:
    assert normalize_phase("Running", deleting=True, waiting_reasons=["CrashLoopBackOff"]) == (
        "Terminating"
    )
    assert normalize_phase("Running", deleting=False, waiting_reasons=["ImagePullBackOff"]) == (
        "ImagePullBackOff"
    )
    assert normalize_phase(None, deleting=False) == "Unknown"


# --- a LIST page read a piece at a time -----------------------------------------------------------


def walked(text: str) -> dict[str, Any]:
    """``iter_json_object`` put back together: it must equal ``json.loads`` (an empty
    ``items`` array gives no element, so it is put back as one)."""
    out: dict[str, Any] = {}
    for key, value in iter_json_object(text):
        if key == "items[]":
            out.setdefault("items", []).append(value)
        else:
            out[key] = value
    if re.search(r'"items"\s*:\s*\[', text) and "items" not in out:
        out["items"] = []
    return out


@pytest.mark.parametrize(
    "text",
    [
        "{}",
        " { } ",
        '{"items": []}',
        '{"items":[ ]}',
        '{"items": null, "metadata": {}}',
        '{"kind":"PodList","metadata":{"continue":"x","remainingItemCount":3},"items":[{"a":1}]}',
        '\n{\n "items" : [ {"a": [1, 2]} ,\t{"b": "]}"} ] ,\r\n "z": [1] }\n',
        '{"a": {"items": [1]}, "items": [[1], "s", 2.5, true, null]}',
    ],
)
def test_iter_json_object_matches_json_loads(text: str) -> None:
    assert walked(text) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "{",
        '{"items": [1,]}',
        '{"items": [1}',
        '{"a": 1,}',
        '{"a" 1}',
        "{1: 2}",
        '{"a": 1} x',
        '{"items": [{"a": 1} {"b": 2}]}',
        '{"a": tru}',
    ],
)
def test_iter_json_object_refuses_malformed_json(text: str) -> None:
    with pytest.raises(ValueError):
        walked(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(
    st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    st.lists(json_values, max_size=5),
    st.sampled_from([None, 0, 2]),
)
def test_iter_json_object_any_object(
    members: dict[str, Any], items: list[Any], indent: int | None
) -> None:
    document = {**members, "items": items}
    assert walked(json.dumps(document, indent=indent)) == document


async def test_read_pod_list_yields_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    pods = [as_json(v1pod(f"agent-{i}", ip=f"10.0.0.{i}")) for i in range(50)]
    text = json.dumps({"kind": "PodList", "metadata": {"continue": "next"}, "items": pods})
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    monkeypatch.setattr(pod_reading, "LIST_PARSE_SLICE", 0.0)  # yield after every item
    found: list[Any] = []
    try:
        assert await read_pod_list(text, found) == "next"
        assert ticks >= 50, "the loop ran between the items"
    finally:
        task.cancel()
    assert [p.pod_id for p in found] == [f"agent-{i}" for i in range(50)]
    assert found[7].pod_ip == "10.0.0.7" and found[7].ready

    last: list[Any] = []
    assert await read_pod_list('{"metadata": {"continue": ""}, "items": []}', last) is None
    with pytest.raises(ValueError, match="item is an object"):
        await read_pod_list('{"items": [1]}', last)


# --- label selectors ---------------------------------------------------------------------------


def test_parse_label_selector() -> None:
    assert selectors.parse(" a=b, c==d ,e!=f,g,!h, i in (1,2), j notin (3)") == [
        Requirement("a", "=", ("b",)),
        Requirement("c", "=", ("d",)),
        Requirement("e", "!=", ("f",)),
        Requirement("g", "exists"),
        Requirement("h", "!exists"),
        Requirement("i", "in", ("1", "2")),
        Requirement("j", "notin", ("3",)),
    ]
    assert selectors.parse("") == []
    for refused in ("a=b,", ",", "a gt 1"):
        with pytest.raises(ValueError):
            selectors.parse(refused)


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", True),
        ("a=1", True),
        ("a=1,b=2", True),
        ("a=1,b=3", False),
        ("a!=2", True),
        ("a!=1", False),
        ("z!=1", True),
        ("b", True),
        ("z", False),
        ("!z", True),
        ("!a", False),
        ("a in (1,3)", True),
        ("a in (3)", False),
        ("z in (1)", False),
        ("a notin (2)", True),
        ("a notin (1)", False),
        ("z notin (1)", True),
    ],
)
def test_label_selector_matches(selector: str, matches: bool) -> None:
    assert selectors.matches(selectors.parse(selector), {"a": "1", "b": "2"}) is matches


# --- RealK8sPodClient over a scripted CoreV1Api ------------------------------------------------


class ScriptedCoreApi:
    """A CoreV1Api stand-in: pods in a dict, faults scripted per call.

    ``create_faults`` items: an exception to raise without creating, ``"lost"`` (create, then
    the reply is lost), ``"landed-504"`` (create, then answer 504) or ``"hang"`` (create,
    then never answer). ``patch_faults`` items: an exception to raise without patching, or
    ``"lost"`` (patch, then the reply is lost). ``pod_state`` is what a
    created pod reports: ``ready``, ``pending`` or a container waiting reason. A created pod
    gets a uid; a patch naming another uid is refused as the API server does (422).
    """

    def __init__(self, pod_state: str = "ready") -> None:
        self.pod_state = pod_state
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.create_faults: list[BaseException | str] = []
        self.list_fault: BaseException | None = None
        self.list_faults: list[BaseException | str | None] = []  # one per LIST, in order
        self.delete_fault: BaseException | None = None
        self.patch_faults: list[BaseException | str] = []
        self.patches: list[tuple[str, dict[str, Any], str | None]] = []
        self.uids = 0
        self.creates: list[str] = []
        self.reads: list[str] = []
        self.lists: list[tuple[str, str, int | None, str | None]] = []
        self.raw_replies: list[RawReply] = []
        self.deletes: list[tuple[str, int | None]] = []
        self.closed = False
        self.api_client = self
        self.created = asyncio.Event()

    async def close(self) -> None:
        self.closed = True

    def _v1pod(self, namespace: str, name: str) -> V1Pod:
        meta = self.pods[(namespace, name)]["metadata"]
        known = {k: meta.get(k) for k in ("labels", "uid", "annotations")}
        if self.pod_state == "ready":
            return v1pod(name, namespace=namespace, **known)
        waiting = None if self.pod_state == "pending" else self.pod_state
        return v1pod(
            name, namespace=namespace, phase="Pending", ready=False, ip=None, waiting=waiting,
            **known,
        )  # fmt: skip

    async def create_namespaced_pod(self, namespace: str, body: dict[str, Any]) -> V1Pod:
        name = body["metadata"]["name"]
        self.creates.append(name)
        fault = self.create_faults.pop(0) if self.create_faults else None
        if isinstance(fault, BaseException):
            raise fault
        if (namespace, name) in self.pods:
            raise api_error(409, "Conflict", f'pods "{name}" already exists')
        self.uids += 1
        body = {**body, "metadata": {**body["metadata"], "uid": f"uid-{self.uids}"}}
        self.pods[(namespace, name)] = body
        self.created.set()
        if fault == "lost":
            raise aiohttp.ServerDisconnectedError()
        if fault == "landed-504":
            raise api_error(504, "Gateway Timeout")
        if fault == "hang":
            await asyncio.Event().wait()
        return self._v1pod(namespace, name)

    async def read_namespaced_pod(self, name: str, namespace: str) -> V1Pod:
        self.reads.append(name)
        if (namespace, name) not in self.pods:
            raise api_error(404, "Not Found")
        return self._v1pod(namespace, name)

    async def list_namespaced_pod(
        self,
        namespace: str,
        *,
        label_selector: str,
        limit: int | None = None,
        _continue: str | None = None,
        _preload_content: bool = True,
    ) -> RawReply:
        """Pages of ``limit`` pods by name, ``continue`` = the offset; always raw (the client
        reads LISTs with ``_preload_content=False``). A scripted ``ApiException`` is answered
        as the server would (that status and body); any other exception is raised."""
        assert _preload_content is False
        self.lists.append((namespace, label_selector, limit, _continue))
        fault = self.list_faults.pop(0) if self.list_faults else self.list_fault
        if isinstance(fault, ApiException):
            reply = RawReply(fault.status, fault.body or b"", fault.reason, fault.headers)
        elif isinstance(fault, BaseException):
            raise fault
        elif fault == "garbage":
            reply = RawReply(200, b'{"items": [')
        else:
            names = sorted(name for (ns, name) in self.pods if ns == namespace)
            start = int(_continue or 0)
            end = len(names) if not limit else min(len(names), start + limit)
            meta = {"resourceVersion": "7", "continue": str(end) if end < len(names) else None}
            items = [as_json(self._v1pod(namespace, name)) for name in names[start:end]]
            body = {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}
            reply = RawReply(200, json.dumps(body).encode())
        self.raw_replies.append(reply)
        return reply

    async def patch_namespaced_pod(
        self, name: str, namespace: str, body: dict[str, Any], _content_type: str | None = None
    ) -> V1Pod:
        self.patches.append((name, body, _content_type))
        fault = self.patch_faults.pop(0) if self.patch_faults else None
        if isinstance(fault, BaseException):
            raise fault
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise api_error(404, "Not Found")
        if body["metadata"].get("uid") != pod["metadata"].get("uid"):
            raise api_error(422, "Unprocessable Entity", "metadata.uid: field is immutable")
        notes = {**(pod["metadata"].get("annotations") or {}), **body["metadata"]["annotations"]}
        pod["metadata"] = {**pod["metadata"], "annotations": notes}
        if fault == "lost":
            raise aiohttp.ServerDisconnectedError()
        return self._v1pod(namespace, name)

    async def delete_namespaced_pod(
        self, name: str, namespace: str, grace_period_seconds: int | None = None
    ) -> None:
        self.deletes.append((name, grace_period_seconds))
        if self.delete_fault is not None:
            raise self.delete_fault
        if self.pods.pop((namespace, name), None) is None:
            raise api_error(404, "Not Found")


class RawReply:
    """What ``_preload_content=False`` hands back: an unread aiohttp response."""

    def __init__(
        self,
        status: int,
        body: bytes,
        reason: str | None = "OK",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status, self.reason, self.headers = status, reason, headers or {}
        self._body = body
        self.released = False

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        self.released = True


class Opened:
    """An ``api_factory`` that records which kubeconfigs were opened."""

    def __init__(self, *apis: ScriptedCoreApi) -> None:
        self.apis = list(apis)
        self.opened: list[str | None] = []
        self.by_kubeconfig: dict[str | None, ScriptedCoreApi] = {}

    async def __call__(self, kubeconfig: str | None) -> ScriptedCoreApi:
        self.opened.append(kubeconfig)
        api = self.apis.pop(0) if self.apis else ScriptedCoreApi()
        self.by_kubeconfig[kubeconfig] = api
        return api


@pytest.fixture
async def api() -> ScriptedCoreApi:
    return ScriptedCoreApi()


@pytest.fixture
async def real(api: ScriptedCoreApi) -> AsyncIterator[RealK8sPodClient]:
    client = RealK8sPodClient(default_namespace="ns", api_factory=Opened(api))
    await client.start()
    yield client
    await client.close()


async def deploy(client: RealK8sPodClient, **overrides: Any) -> Any:
    return await client.deploy(
        scope_id=SCOPE, deploy_ver=VER, pod_spec=spec(**overrides), identity=IDENTITY
    )


async def test_deploy_ready(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    info = await deploy(real, sse_port=9000, sse_path="/events")
    assert NAME_RE.fullmatch(info.pod_id)
    assert (info.namespace, info.pod_ip) == ("ns", "10.1.2.3")
    assert info.pod_sse_url == "http://10.1.2.3:9000/events"
    assert api.creates == [info.pod_id]
    assert api.pods[("ns", info.pod_id)]["metadata"]["labels"][SCOPE_LABEL] == SCOPE
    assert api.deletes == []


async def test_deploy_uses_spec_namespace(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    info = await deploy(real, namespace="team-a")
    assert info.namespace == "team-a"
    assert ("team-a", info.pod_id) in api.pods


async def test_deploy_409_then_new_name(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.create_faults = [api_error(409, "Conflict", "AlreadyExists")]
    info = await deploy(real)
    assert len(api.creates) == 2 and api.creates[0] != api.creates[1]
    assert info.pod_id == api.creates[1]
    assert api.deletes == []  # the taken name is someone else's pod: never deleted


async def test_deploy_409_three_times_fails(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.create_faults = [api_error(409, "Conflict") for _ in range(3)]
    with pytest.raises(DeployFailed, match="taken 3 times"):
        await deploy(real)
    assert len(set(api.creates)) == 3
    assert api.deletes == []


async def test_deploy_429_honours_retry_after(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.create_faults = [api_error(429, "Too Many Requests", Retry_After="0.3")]
    loop = asyncio.get_running_loop()
    started = loop.time()
    info = await deploy(real)
    assert loop.time() - started >= 0.3
    assert api.creates == [info.pod_id, info.pod_id]  # a 429 created nothing: same name again


async def test_deploy_429_retry_after_past_deadline_fails_now(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.create_faults = [api_error(429, "Too Many Requests", Retry_After="30")]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeployFailed, match="429"):
        await deploy(real, ready_timeout=2.0)
    assert loop.time() - started < 0.5
    assert len(api.creates) == 1


async def test_deploy_500_retried_then_ok(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.create_faults = [api_error(500, "Internal Server Error"), api_error(503, "Unavailable")]
    info = await deploy(real, ready_timeout=3.0)
    assert api.creates == [info.pod_id] * 3
    assert len(api.pods) == 1


async def test_deploy_5xx_until_deadline_fails_in_time(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.create_faults = [api_error(500, "Internal Server Error") for _ in range(100)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeployFailed, match="500"):
        await deploy(real, ready_timeout=0.8)
    assert loop.time() - started <= 0.9
    assert 2 <= len(api.creates) < 10
    assert api.pods == {}


@pytest.mark.parametrize(
    ("status", "reason"),
    [(403, "Forbidden"), (400, "Bad Request"), (422, "Unprocessable Entity"), (404, "Not Found")],
)
async def test_deploy_refusal_fails_at_once(
    real: RealK8sPodClient, api: ScriptedCoreApi, status: int, reason: str
) -> None:
    api.create_faults = [api_error(status, reason, "pods is forbidden: quota")]
    with pytest.raises(DeployFailed) as info:
        await deploy(real)
    assert f"{status} {reason}" in str(info.value)
    assert "pods is forbidden: quota" in str(info.value)
    assert len(api.creates) == 1
    assert api.deletes == []


@pytest.mark.parametrize("fault", ["lost", "landed-504"])
async def test_deploy_create_that_landed_is_adopted(
    real: RealK8sPodClient, api: ScriptedCoreApi, fault: str
) -> None:
    api.create_faults = [fault]
    info = await deploy(real)
    assert api.creates == [info.pod_id]  # found by GET: no second create, no second pod
    assert list(api.pods) == [("ns", info.pod_id)]
    assert api.deletes == []


async def test_deploy_hanging_create_fails_at_deadline_and_deletes_landed_pod(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.create_faults = ["hang"]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeployFailed):
        await deploy(real, ready_timeout=0.5)
    assert loop.time() - started < 1.0
    assert api.pods == {}
    assert api.deletes == [(api.creates[0], 0)]


async def test_deploy_never_ready_times_out_and_deletes(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.pod_state = "pending"
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeployFailed, match=r"not Ready within 0.5s \(last: Pending\)"):
        await deploy(real, ready_timeout=0.5, ready_poll_interval=0.1)
    assert 0.5 <= loop.time() - started < 0.8
    assert api.pods == {}
    assert api.deletes == [(api.creates[0], 0)]


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff"])
async def test_deploy_dead_pod_fails_fast_and_deletes(
    real: RealK8sPodClient, api: ScriptedCoreApi, reason: str
) -> None:
    api.pod_state = reason
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeployFailed, match=reason):
        await deploy(real, ready_timeout=2.0)
    assert loop.time() - started < 0.5
    assert api.pods == {}
    assert api.deletes == [(api.creates[0], 0)]


async def test_deploy_pod_disappearing_fails(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.pod_state = "pending"
    task = asyncio.create_task(deploy(real, ready_timeout=2.0))
    await api.created.wait()
    api.pods.clear()
    with pytest.raises(DeployFailed, match="disappeared"):
        await task


async def test_deploy_cancelled_deletes_pod(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.pod_state = "pending"
    task = asyncio.create_task(deploy(real, ready_timeout=2.0))
    await api.created.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert api.pods == {}


async def test_deploy_template_cluster_gets_own_client_opened_at_start() -> None:
    other, default = ScriptedCoreApi(), ScriptedCoreApi()
    opened = Opened(other, default)
    east = ClusterConfig("east", "/etc/ar/east.kubeconfig", {"current-context": "c"})
    client = RealK8sPodClient(api_factory=opened, clusters={"east": east})
    await client.start()
    assert opened.opened == ["east", None]  # every configured cluster, once, at start
    first = await deploy(client, kubeconfig="east")
    await deploy(client, kubeconfig="east")
    await deploy(client)
    assert opened.opened == ["east", None]
    assert len(other.pods) == 2 and len(default.pods) == 1
    # a name that is not configured (or a path from an old row) opens nothing, says nothing
    for unknown in ("west", "/etc/shadow"):
        with pytest.raises(DeployFailed) as refused:
            await deploy(client, kubeconfig=unknown)
        assert unknown not in str(refused.value)
    assert opened.opened == ["east", None]
    # delete/get/list use the default client only (documented limitation)
    assert await client.delete(first.pod_id, "default") is False
    await client.close()
    assert default.closed and other.closed


async def test_client_unavailable() -> None:
    async def broken(kubeconfig: str | None) -> Any:
        raise OSError("no credentials")

    client = RealK8sPodClient(api_factory=broken)
    with pytest.raises(K8sApiError, match="no credentials"):
        await client.start()
    with pytest.raises(DeployFailed, match="is down") as refused:
        await deploy(client)
    assert "no credentials" not in str(refused.value)  # details go to the log only
    with pytest.raises(K8sApiError):
        await client.list_pods("default", COMPONENT_SELECTOR)
    await client.close()


async def test_closed_client_refuses() -> None:
    client = RealK8sPodClient(api_factory=Opened())
    await client.start()
    await client.close()
    with pytest.raises(K8sApiError, match="closed"):
        await client.get_pod("p", "default")


# list / get / delete


async def test_list_pods_one_page(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    info = await deploy(real)
    pods = await real.list_pods("ns", COMPONENT_SELECTOR)
    assert [(p.pod_id, p.phase, p.ready, p.scope_id) for p in pods] == [
        (info.pod_id, "Running", True, SCOPE)
    ]
    assert api.lists == [("ns", COMPONENT_SELECTOR, 500, None)]
    assert all(reply.released for reply in api.raw_replies)


def add_pods(api: ScriptedCoreApi, n: int, namespace: str = "ns") -> list[str]:
    names = [f"agent-{i:03d}" for i in range(n)]
    for name in names:
        api.pods[(namespace, name)] = build_pod_body(name, SCOPE, VER, spec())
    return names


async def test_list_pods_pages_until_no_continue_token(
    real: RealK8sPodClient, api: ScriptedCoreApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(k8s_module, "LIST_PAGE_SIZE", 2)
    names = add_pods(api, 5)
    pods = await real.list_pods("ns", COMPONENT_SELECTOR)
    assert [p.pod_id for p in pods] == names, "every pod once, in order"
    assert all(p.ready and p.pod_ip == "10.1.2.3" and p.scope_id == SCOPE for p in pods)
    assert [(limit, token) for _, _, limit, token in api.lists] == [
        (2, None),
        (2, "2"),
        (2, "4"),
    ]


async def test_list_pods_missing_namespace(
    real: RealK8sPodClient, api: ScriptedCoreApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.list_fault = api_error(404, "Not Found")
    assert await real.list_pods("gone", COMPONENT_SELECTOR) == []
    api.list_fault = None
    monkeypatch.setattr(k8s_module, "LIST_PAGE_SIZE", 2)
    add_pods(api, 3)
    api.list_faults = [None, api_error(404, "Not Found")]  # gone between two pages
    assert await real.list_pods("ns", COMPONENT_SELECTOR) == []


async def test_list_pods_expired_token_restarts_once(
    real: RealK8sPodClient, api: ScriptedCoreApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(k8s_module, "LIST_PAGE_SIZE", 2)
    names = add_pods(api, 5)
    gone = api_error(410, "Gone", "The provided continue parameter is too old")
    api.list_faults = [None, gone]
    pods = await real.list_pods("ns", COMPONENT_SELECTOR)
    assert [p.pod_id for p in pods] == names, "the first page is not kept twice"
    assert [token for *_, token in api.lists] == [None, "2", None, "2", "4"]

    api.lists.clear()
    api.list_faults = [None, gone, None, gone]
    with pytest.raises(K8sApiError, match="410 Gone: The provided continue") as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status == 410 and len(api.lists) == 4, "restarted once only"

    api.lists.clear()
    api.list_faults = [gone]
    with pytest.raises(K8sApiError) as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status == 410 and len(api.lists) == 1, "a first page has no token to renew"


async def test_list_pods_429_is_a_k8s_error_with_its_text(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.list_fault = api_error(429, "Too Many Requests", "slow down", Retry_After="2")
    with pytest.raises(K8sApiError, match="429 Too Many Requests: slow down") as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status == 429 and len(api.lists) == 1


async def test_list_pods_reply_that_is_not_a_pod_list(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.list_faults = ["garbage"]
    with pytest.raises(K8sApiError, match="not a PodList") as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status is None


@pytest.mark.parametrize("status", [403, 401, 500])
async def test_list_pods_refused(
    real: RealK8sPodClient, api: ScriptedCoreApi, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.list_fault = api_error(status, "Nope", "pods is forbidden")
    with pytest.raises(K8sApiError) as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status == status
    assert "pods is forbidden" in str(info.value)
    assert all(reply.released for reply in api.raw_replies)

    api.list_fault = None  # refused on a later page: the same, nothing half-listed
    monkeypatch.setattr(k8s_module, "LIST_PAGE_SIZE", 2)
    add_pods(api, 5)
    api.list_faults = [None, api_error(status, "Nope", "pods is forbidden")]
    with pytest.raises(K8sApiError) as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status == status and len(api.lists) == 3


async def test_list_pods_transport_error(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    api.list_fault = aiohttp.ClientConnectionError("refused")
    with pytest.raises(K8sApiError) as info:
        await real.list_pods("ns", COMPONENT_SELECTOR)
    assert info.value.status is None


async def test_get_and_delete(real: RealK8sPodClient, api: ScriptedCoreApi) -> None:
    info = await deploy(real)
    found = await real.get_pod(info.pod_id, "ns")
    assert found is not None and found.pod_ip == "10.1.2.3"
    assert await real.get_pod("agent-nope", "ns") is None
    assert await real.delete(info.pod_id, "ns") is True
    assert await real.delete(info.pod_id, "ns") is False
    api.delete_fault = api_error(403, "Forbidden")
    with pytest.raises(K8sApiError) as refused:
        await real.delete(info.pod_id, "ns")
    assert refused.value.status == 403


# start() with the real kubernetes_asyncio config loaders


async def test_start_in_cluster_is_a_plain_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes_asyncio import config

    def fake_incluster(client_configuration: Any, **_: Any) -> None:
        client_configuration.host = "https://127.0.0.1:1"

    monkeypatch.setattr(config, "load_incluster_config", fake_incluster)
    client = RealK8sPodClient(kubeconfig="/nonexistent")
    await client.start()
    assert client.source == "in-cluster"
    await client.close()


async def test_start_kubeconfig_fallback_and_transport_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    port = closed_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    client = RealK8sPodClient(kubeconfig=str(kubeconfig))
    await client.start()
    assert client.source == f"kubeconfig {kubeconfig}"
    with pytest.raises(K8sApiError) as info:
        await client.list_pods("default", COMPONENT_SELECTOR)
    assert info.value.status is None
    await client.close()


# --- probe_health on loopback ------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@contextlib.asynccontextmanager
async def health_server(status: int | None) -> AsyncIterator[int]:
    """A tiny HTTP server on 127.0.0.1 answering ``status``, or never answering (None)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            if status is None:
                await reader.read()  # until the client gives up
            else:
                await reader.readuntil(b"\r\n\r\n")
                head = f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                writer.write(head.encode())
                await writer.drain()
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (500, False), (204, False)])
async def test_probe_health_status(real: RealK8sPodClient, status: int, healthy: bool) -> None:
    async with health_server(status) as port:
        assert await real.probe_health("127.0.0.1", port) is healthy
        assert await real.probe_health("127.0.0.1", port) is healthy  # shared session reused


async def test_probe_health_closed_port(real: RealK8sPodClient) -> None:
    assert await real.probe_health("127.0.0.1", closed_port()) is False


async def test_probe_health_silent_server_times_out(real: RealK8sPodClient) -> None:
    async with health_server(None) as port:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await real.probe_health("127.0.0.1", port) is False
        assert 2.5 <= loop.time() - started < 4.0


# --- FakeK8sPodClient -------------------------------------------------------------------------


async def fake_deploy(fake: FakeK8sPodClient, **overrides: Any) -> Any:
    return await fake.deploy(
        scope_id=SCOPE, deploy_ver=VER, pod_spec=spec(**overrides), identity=IDENTITY
    )


async def test_fake_deploy() -> None:
    fake = FakeK8sPodClient(default_namespace="ns")
    info = await fake_deploy(fake, sse_port=9000)
    assert NAME_RE.fullmatch(info.pod_id)
    assert info.pod_ip.startswith("127.0.1.")
    assert info.pod_sse_url == f"http://{info.pod_ip}:9000/sse"
    pod = fake.pods[info.pod_id]
    assert (pod.namespace, pod.phase, pod.ready, pod.scope_id, pod.deploy_ver) == (
        "ns",
        "Running",
        True,
        SCOPE,
        VER,
    )
    assert pod.labels[COMPONENT_LABEL] == "agentserver" and pod.labels[APP_LABEL] == info.pod_id
    assert fake.deploy_calls == 1
    assert await fake.probe_health(info.pod_ip, 9000) is True


async def test_fake_ips_are_loopback_and_unique() -> None:
    fake = FakeK8sPodClient()
    ips = [fake.add_pod(scope_id=SCOPE, deploy_ver=VER).pod_ip for _ in range(300)]
    assert len(set(ips)) == 300
    assert all(ip is not None and ipaddress.ip_address(ip).is_loopback for ip in ips)
    assert ips[0] == "127.0.1.1" and ips[253] == "127.0.1.254" and ips[254] == "127.0.2.1"


async def test_fake_ready_delay() -> None:
    fake = FakeK8sPodClient(ready_delay=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    task = asyncio.create_task(fake_deploy(fake))
    await asyncio.sleep(0.05)
    [pending] = fake.pods.values()
    assert (pending.phase, pending.ready, pending.pod_ip) == ("Pending", False, None)
    await task
    assert loop.time() - started >= 0.2


async def test_fake_fail_next_deploys() -> None:
    fake = FakeK8sPodClient()
    fake.fail_next_deploys = 2
    for _ in range(2):
        with pytest.raises(DeployFailed):
            await fake_deploy(fake)
    await fake_deploy(fake)
    assert fake.deploy_calls == 3
    assert len(fake.pods) == 1


@pytest.mark.parametrize("how", ["never_ready", "slow"])
async def test_fake_never_ready_times_out_and_deletes(how: str) -> None:
    fake = FakeK8sPodClient()
    if how == "never_ready":
        fake.never_ready = True
    else:
        fake.ready_delay = 5.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeployFailed, match=r"not Ready within 0\.3s"):
        await fake_deploy(fake, ready_timeout=0.3, ready_poll_interval=0.1)
    assert 0.3 <= loop.time() - started < 0.6
    assert fake.pods == {}
    assert len(fake.deleted) == 1


@pytest.mark.parametrize("fault", ["kill", "crashloop", "remove"])
async def test_fake_pod_dying_while_deploying_fails_fast(fault: str) -> None:
    fake = FakeK8sPodClient(ready_delay=5.0)
    task = asyncio.create_task(fake_deploy(fake, ready_timeout=5.0, ready_poll_interval=0.05))
    await asyncio.sleep(0.02)
    [pod_id] = fake.pods
    if fault == "kill":
        fake.kill(pod_id)
    elif fault == "crashloop":
        fake.set_phase(pod_id, "Running", "CrashLoopBackOff")
    else:
        fake.remove(pod_id)
    with pytest.raises(DeployFailed):
        await asyncio.wait_for(task, 1.0)
    assert fake.pods == {}


async def test_fake_unhealthy_and_dead_pods_fail_probe() -> None:
    fake = FakeK8sPodClient()
    a, b = await fake_deploy(fake), await fake_deploy(fake)
    fake.unhealthy.add(a.pod_id)
    assert await fake.probe_health(a.pod_ip, 8080) is False
    assert await fake.probe_health(b.pod_ip, 8080) is True
    fake.kill(b.pod_id)
    assert fake.pods[b.pod_id].phase == "Failed" and fake.pods[b.pod_id].dead
    assert await fake.probe_health(b.pod_ip, 8080) is False
    assert await fake.probe_health("127.0.9.9", 8080) is False


async def test_fake_set_phase() -> None:
    fake = FakeK8sPodClient()
    pod = fake.add_pod(scope_id=SCOPE, deploy_ver=VER, phase="Pending")
    assert (pod.ready, pod.pod_ip, pod.dead) == (False, None, False)
    fake.set_phase(pod.pod_id, "Pending", "ImagePullBackOff")
    assert fake.pods[pod.pod_id].phase == "ImagePullBackOff" and fake.pods[pod.pod_id].dead
    fake.set_phase(pod.pod_id, "Running")
    now = fake.pods[pod.pod_id]
    assert (now.phase, now.ready, now.dead) == ("Running", True, False) and now.pod_ip
    fake.set_phase(pod.pod_id, "Running", ready=False)
    assert fake.pods[pod.pod_id].ready is False


async def test_fake_delete_get_remove() -> None:
    fake = FakeK8sPodClient()
    info = await fake_deploy(fake)
    assert await fake.get_pod(info.pod_id, "default") == fake.pods[info.pod_id]
    assert await fake.get_pod(info.pod_id, "other") is None
    assert await fake.delete(info.pod_id, "other") is False
    assert await fake.delete(info.pod_id, "default") is True
    assert await fake.delete(info.pod_id, "default") is False
    assert fake.deleted == [info.pod_id]
    other = await fake_deploy(fake)
    fake.remove(other.pod_id)
    assert await fake.get_pod(other.pod_id, "default") is None
    assert fake.deleted == [info.pod_id]  # vanished behind our back: not our delete


async def test_fake_namespaces_missing_and_forbidden() -> None:
    fake = FakeK8sPodClient()
    fake.missing_namespaces.add("gone")
    fake.forbidden_namespaces.add("locked")
    assert await fake.list_pods("gone", COMPONENT_SELECTOR) == []
    with pytest.raises(DeployFailed, match="404"):
        await fake_deploy(fake, namespace="gone")
    with pytest.raises(DeployFailed, match="403"):
        await fake_deploy(fake, namespace="locked")
    for call in (
        fake.list_pods("locked", COMPONENT_SELECTOR),
        fake.get_pod("p", "locked"),
        fake.delete("p", "locked"),
    ):
        with pytest.raises(K8sApiError) as info:
            await call
        assert info.value.status == 403
    assert fake.pods == {}


async def test_fake_add_pod_and_list_selectors() -> None:
    fake = FakeK8sPodClient()
    old = fake.add_pod(scope_id=SCOPE, deploy_ver="old", pod_id="agent-old")
    new = fake.add_pod(scope_id=SCOPE, deploy_ver=VER, pod_id="agent-new")
    fake.add_pod(scope_id="s2", deploy_ver=VER, pod_id="agent-s2", namespace="other")
    fake.add_pod(scope_id=SCOPE, deploy_ver=VER, pod_id="web", labels={COMPONENT_LABEL: "web"})

    async def ids(selector: str, namespace: str = "default") -> set[str]:
        return {p.pod_id for p in await fake.list_pods(namespace, selector)}

    assert await ids(COMPONENT_SELECTOR) == {old.pod_id, new.pod_id}
    assert await ids(f"{COMPONENT_SELECTOR},{SCOPE_LABEL}={SCOPE},{DEPLOY_VER_LABEL}={VER}") == {
        new.pod_id
    }
    assert await ids(f"{COMPONENT_SELECTOR},{DEPLOY_VER_LABEL}!={VER}") == {old.pod_id}
    assert await ids(SCOPE_LABEL) == {old.pod_id, new.pod_id, "web"}
    assert await ids(COMPONENT_SELECTOR, "other") == {"agent-s2"}
    assert fake.pods["agent-old"].deploy_ver == "old"
