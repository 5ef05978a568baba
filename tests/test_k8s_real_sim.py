"""RealK8sPodClient against kubesim, through the real kubernetes_asyncio client loading the
simulator's kubeconfig: deploys, name clashes, readiness timeouts, dead containers, label
lists, dead and half-dead pods, cleanup in missing and forbidden namespaces, retried 429/5xx
and creates whose reply was lost. The resource manager's own jobs (watch, reconcile) and the
cleanup route run on top where the issue asks for them (fakeredis, SQLite).

kubesim's own API semantics: ``test_kubesim.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import fakeredis
import httpx
import pytest

from agent_runtime.db.engine import Database
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager import k8s_deploy
from agent_runtime.resource_manager import k8s_real as k8s_module
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import (
    APP_LABEL,
    COMPONENT_LABEL,
    COMPONENT_SELECTOR,
    COMPONENT_VALUE,
    DEPLOY_VER_LABEL,
    SCOPE_LABEL,
    DeployFailed,
    K8sApiError,
)
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.pod_manifest import build_pod_body
from agent_runtime.resource_manager.pool_jobs import PoolJobs
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.state import SessionState
from helpers import IDENTITY, envelope, running_app, sync_body
from kubesim import KubeSim
from kubesim import pod_status as sim_pod_status
from kubesim import pods as sim_pods
from kubesim.kubeconfig import render_kubeconfig
from test_local_mode import free_port

SCOPE = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"
VER = "feedfacecafebeef"


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "image": "registry.local/agent:1.0",
        "pod_name": "agent",
        "namespace": None,
        "container_port": 8080,
        "sse_port": 8080,
        "sse_path": "/sse",
        "env": {"MODE": "test"},
        "ready_timeout": 5.0,
        "ready_poll_interval": 0.03,
    }
    base.update(overrides)
    return base


@pytest.fixture(autouse=True)
def _direct(_no_proxy: None) -> None:
    """Every test here talks to the local simulator through the real client (no proxy)."""


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(
        ready_delay=0.1,
        jitter=0.05,
        grace_period=0.3,
        probe_period=0.05,
        sse_interval=0.05,
        namespaces=("default", "team"),
        seed=11,
    ) as s:
        yield s


@pytest.fixture
async def client(sim: KubeSim) -> AsyncIterator[RealK8sPodClient]:
    real = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path), default_namespace="default")
    await real.start()
    try:
        yield real
    finally:
        await real.close()


async def deploy(client: RealK8sPodClient, scope: str = SCOPE, **overrides: Any) -> Any:
    return await client.deploy(
        scope_id=scope, deploy_ver=VER, pod_spec=spec(**overrides), identity=IDENTITY
    )


def ours(sim: KubeSim, scope: str = SCOPE, namespace: str | None = None) -> list[str]:
    """Names of the pods in the simulator that carry the scope's label."""
    return [
        p["metadata"]["name"]
        for p in sim.pods(namespace)
        if (p["metadata"].get("labels") or {}).get(SCOPE_LABEL) == scope
    ]


def port_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


async def first_sse_event(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        frame = (await resp.content.readuntil(b"\n\n")).decode()
    fields = dict(line.split(": ", 1) for line in frame.strip().splitlines())
    assert fields["event"] == "hello", frame
    data: dict[str, Any] = json.loads(fields["data"])
    return data


async def post_pod(sim: KubeSim, name: str, labels: dict[str, str], ns: str = "default") -> None:
    """A pod someone else created (plain HTTP, as kubectl would)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "other", "image": "other:1"}]},
    }
    async with httpx.AsyncClient(base_url=sim.url, trust_env=False) as http:
        resp = await http.post(f"/api/v1/namespaces/{ns}/pods", json=body)
    assert resp.status_code == 201, resp.text


async def until(check: Any, what: str, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# --- deploy --------------------------------------------------------------------------------------


async def test_deploy_ready_with_ip_and_a_streaming_sse_url(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    assert client.source == f"kubeconfig {sim.kubeconfig_path}"
    first, second = await asyncio.gather(deploy(client), deploy(client, sse_path="/events"))

    assert first.namespace == "default"
    assert {first.pod_ip, second.pod_ip} == {"127.0.0.2", "127.0.0.3"}
    assert first.pod_sse_url == f"http://{first.pod_ip}:8080/sse"
    assert second.pod_sse_url == f"http://{second.pod_ip}:8080/events"
    pod = sim.pod("default", first.pod_id)
    assert pod is not None
    assert pod["metadata"]["labels"] == {
        COMPONENT_LABEL: COMPONENT_VALUE,
        APP_LABEL: first.pod_id,
        SCOPE_LABEL: SCOPE,
        DEPLOY_VER_LABEL: VER,
    }
    assert pod["status"]["phase"] == "Running" and pod["status"]["podIP"] == first.pod_ip
    container = pod["spec"]["containers"][0]
    assert container["env"] == [{"name": "MODE", "value": "test"}]

    for info in (first, second):
        hello = await first_sse_event(info.pod_sse_url)
        assert hello["pod"] == info.pod_id and hello["ip"] == info.pod_ip
        assert await client.probe_health(info.pod_ip, 8080)
    status = await client.get_pod(first.pod_id, "default")
    assert status is not None and status.ready and status.phase == "Running"
    assert status.scope_id == SCOPE and status.deploy_ver == VER and not status.dead
    assert sim.requests["create pods"] == 2


async def test_deploy_into_another_namespace_with_jitter(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    info = await deploy(client, namespace="team")
    assert info.namespace == "team" and ours(sim, namespace="team") == [info.pod_id]
    assert await client.get_pod(info.pod_id, "default") is None


async def test_name_clash_409_takes_a_new_name(
    sim: KubeSim, client: RealK8sPodClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = "agent-taken00000-aaaaa"
    await post_pod(sim, taken, {COMPONENT_LABEL: COMPONENT_VALUE, SCOPE_LABEL: OTHER})
    foreign = sim.pod("default", taken)
    assert foreign is not None
    names = iter([taken, "agent-fresh00000-bbbbb"])
    monkeypatch.setattr(k8s_deploy, "new_pod_name", lambda _: next(names))

    info = await deploy(client)

    assert info.pod_id == "agent-fresh00000-bbbbb"
    assert sim.requests["create pods"] == 3  # the foreign pod, the clash, the new name
    after = sim.pod("default", taken)
    assert after is not None, "another scope's pod is never deleted"
    assert after["metadata"]["uid"] == foreign["metadata"]["uid"]
    assert "deletionTimestamp" not in after["metadata"]
    assert ours(sim) == [info.pod_id]


async def test_name_clash_three_times_fails(
    sim: KubeSim, client: RealK8sPodClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = "agent-taken00000-aaaaa"
    await post_pod(sim, taken, {SCOPE_LABEL: OTHER})
    monkeypatch.setattr(k8s_deploy, "new_pod_name", lambda _: taken)
    with pytest.raises(DeployFailed, match="pod name taken 3 times"):
        await deploy(client)
    assert sim.pod("default", taken) is not None and ours(sim) == []


async def test_never_ready_times_out_and_the_pod_is_deleted(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    sim.faults.add("never_ready")
    seen: list[str] = []

    def running() -> bool:
        seen[:] = [p["status"]["podIP"] for p in sim.pods() if p["status"]["phase"] == "Running"]
        return bool(seen)

    started = time.monotonic()
    task = asyncio.create_task(deploy(client, ready_timeout=0.8))
    await until(running, "the pod Running")
    assert port_open(seen[0], 8080), "its AgentServer runs, but /health fails"
    with pytest.raises(DeployFailed, match=r"not Ready within 0.8s"):
        await task
    assert 0.8 <= time.monotonic() - started < 2.0
    assert sim.pods() == [], "deleted at once (grace 0)"
    assert sim.requests["delete pods"] == 1
    assert not port_open(seen[0], 8080)


async def test_unschedulable_pod_times_out_pending(sim: KubeSim, client: RealK8sPodClient) -> None:
    sim.faults.add("never_ready", mode="pending")
    task = asyncio.create_task(deploy(client, ready_timeout=0.5))
    await until(lambda: bool(sim.pods()), "the pod created")
    await asyncio.sleep(0.2)  # past the ready delay
    (pod,) = sim.pods()
    assert pod["status"]["phase"] == "Pending" and "nodeName" not in pod["spec"]
    with pytest.raises(DeployFailed, match=r"not Ready within 0.5s"):
        await task
    assert sim.pods() == []


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("image_pull", "ErrImagePull"), ("crash_loop", "CrashLoopBackOff")],
)
async def test_dead_container_fails_fast_and_is_deleted(
    sim: KubeSim, client: RealK8sPodClient, kind: str, reason: str
) -> None:
    sim.faults.add(kind, count=1)
    started = time.monotonic()
    with pytest.raises(DeployFailed, match=reason):
        await deploy(client, ready_timeout=20)
    assert time.monotonic() - started < 2.0, "a dead waiting reason does not wait for Ready"
    assert sim.pods() == []
    assert (await deploy(client)).pod_ip  # the fault was for one pod


async def test_refusals_fail_at_once(sim: KubeSim, client: RealK8sPodClient) -> None:
    with pytest.raises(DeployFailed, match=r"refused: 422 Unprocessable Entity: Pod .* is invalid"):
        await deploy(client, pod_name="Agent_X")
    with pytest.raises(DeployFailed, match=r'refused: 404 Not Found: namespaces "ghost" not found'):
        await deploy(client, namespace="ghost")
    sim.faults.add("namespace_forbidden", namespace="team")
    with pytest.raises(DeployFailed, match=r"refused: 403 Forbidden: pods .*is forbidden"):
        await deploy(client, namespace="team")
    assert sim.requests["create pods"] == 3, "none of them retried"
    assert sim.pods() == []


async def test_token_kubeconfig(tmp_path: Path) -> None:
    async with KubeSim(ready_delay=0.05, token="s3cret") as sim:
        real = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path))
        await real.start()
        try:
            assert (await deploy(real)).pod_ip
        finally:
            await real.close()
        anonymous = tmp_path / "anonymous"
        anonymous.write_text(render_kubeconfig(sim.url))
        real = RealK8sPodClient(kubeconfig=str(anonymous))
        await real.start()
        try:
            with pytest.raises(K8sApiError) as info:
                await real.list_pods("default", "")
        finally:
            await real.close()
    assert info.value.status == 401


# --- lists, dead and half-dead pods --------------------------------------------------------------


async def test_list_by_label(sim: KubeSim, client: RealK8sPodClient) -> None:
    a1, a2, b1 = await asyncio.gather(deploy(client), deploy(client), deploy(client, OTHER))
    await post_pod(sim, "not-an-agent", {COMPONENT_LABEL: "other"})

    async def listed(selector: str, ns: str = "default") -> set[str]:
        return {p.pod_id for p in await client.list_pods(ns, selector)}

    assert await listed(f"{SCOPE_LABEL}={SCOPE}") == {a1.pod_id, a2.pod_id}
    assert await listed(f"{COMPONENT_LABEL}={COMPONENT_VALUE},{SCOPE_LABEL}") == {
        a1.pod_id,
        a2.pod_id,
        b1.pod_id,
    }
    assert await listed(f"{SCOPE_LABEL} in ({SCOPE},{OTHER})") == {a1.pod_id, a2.pod_id, b1.pod_id}
    assert await listed(f"{SCOPE_LABEL} notin ({SCOPE})") == {b1.pod_id, "not-an-agent"}
    assert await listed(f"{SCOPE_LABEL}!={SCOPE}") == {b1.pod_id, "not-an-agent"}
    assert await listed(f"!{SCOPE_LABEL}") == {"not-an-agent"}
    assert await listed(f"{APP_LABEL}={a2.pod_id}") == {a2.pod_id}
    assert await listed("", "team") == set()
    assert await listed("", "ghost") == set(), "a missing namespace lists empty"
    (status,) = await client.list_pods("default", f"{APP_LABEL}={b1.pod_id}")
    assert status.ready and status.pod_ip == b1.pod_ip and status.scope_id == OTHER
    with pytest.raises(K8sApiError) as info:
        await client.list_pods("default", "app in (x")
    assert info.value.status == 400
    assert sim.requests["list pods"] == 11


async def test_dead_pods_are_seen_dead(sim: KubeSim, client: RealK8sPodClient) -> None:
    failed, crashed, vanished, deleted = await asyncio.gather(*(deploy(client) for _ in range(4)))
    await sim.kill("default", failed.pod_id, "fail")
    await sim.kill("default", crashed.pod_id, "crash")
    await sim.kill("default", vanished.pod_id, "vanish")
    assert await client.delete(deleted.pod_id, "default") is True  # graceful

    status = await client.get_pod(failed.pod_id, "default")
    assert status is not None and status.phase == "Failed" and status.dead and not status.ready
    status = await client.get_pod(crashed.pod_id, "default")
    assert status is not None and status.phase == "CrashLoopBackOff" and status.dead
    assert await client.get_pod(vanished.pod_id, "default") is None
    status = await client.get_pod(deleted.pod_id, "default")
    assert status is not None and status.phase == "Terminating" and status.dead
    for info in (failed, crashed, vanished):
        assert not await client.probe_health(info.pod_ip, 8080)

    listed = {p.pod_id: p.phase for p in await client.list_pods("default", SCOPE_LABEL)}
    assert listed == {
        failed.pod_id: "Failed",
        crashed.pod_id: "CrashLoopBackOff",
        deleted.pod_id: "Terminating",
    }
    await asyncio.sleep(0.5)  # past the simulator's grace period
    assert await client.get_pod(deleted.pod_id, "default") is None
    assert await client.delete(deleted.pod_id, "default") is False, "404 → False"
    assert await client.delete(failed.pod_id, "default") is True


async def test_half_dead_pod_is_running_but_fails_its_probe(
    sim: KubeSim, client: RealK8sPodClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(k8s_module, "PROBE_TIMEOUT", 0.3)  # read when the probe session opens
    info = await deploy(client)
    assert await client.probe_health(info.pod_ip, 8080)

    fault = sim.faults.add("health", mode="500", name=info.pod_id)
    assert not await client.probe_health(info.pod_ip, 8080)
    status = await client.get_pod(info.pod_id, "default")
    assert status is not None and status.phase == "Running" and not status.dead
    sim.faults.remove(fault.id)
    assert await client.probe_health(info.pod_ip, 8080)

    sim.faults.add("health", mode="hang", name=info.pod_id)
    started = time.monotonic()
    assert not await client.probe_health(info.pod_ip, 8080)
    assert 0.25 <= time.monotonic() - started < 2.0, "a hung /health fails at the probe timeout"
    assert not await client.probe_health("127.0.0.250", 8080), "nothing listens there"


# --- paged lists ----------------------------------------------------------------------------------


def stock(sim: KubeSim, n: int, namespace: str = "default") -> dict[str, tuple[str, bool, str]]:
    """``n`` pods of ours written straight into the simulator's store (no kubelet, no
    AgentServer: cheap enough for thousands), most Running and Ready, every 97th Failed, every
    89th crash-looping, every 101st Terminating. Returns name → (phase, ready, pod IP) as
    ``PodStatus`` should read them."""
    expected: dict[str, tuple[str, bool, str]] = {}
    for i in range(n):
        name = f"agent-{i:05d}-stock"
        ip = f"10.0.{i // 250}.{i % 250 + 1}"
        body = build_pod_body(name, SCOPE if i % 2 else OTHER, VER, spec())
        sim.store.create_pod(sim_pods.admit(namespace, body, sim.rng))

        def start(pod: dict[str, Any], i: int = i, ip: str = ip) -> None:
            sim_pod_status.scheduled(pod)
            sim_pod_status.sandbox_ready(pod, ip)
            sim_pod_status.running(pod, True)
            if i % 97 == 5:
                sim_pod_status.failed(pod, "Evicted", "low on memory")
            elif i % 89 == 3:
                sim_pod_status.crash_loop(pod, 1)
            elif i % 101 == 7:
                sim_pod_status.mark_deleting(pod, 30, 30.0)

        sim.store.update_pod(namespace, name, start)
        phase, ready = "Running", True
        if i % 97 == 5:
            phase, ready = "Failed", False
        elif i % 89 == 3:
            phase, ready = "CrashLoopBackOff", False
        elif i % 101 == 7:
            phase, ready = "Terminating", False
        expected[name] = (phase, ready, ip)
    return expected


async def test_a_list_of_more_pods_than_a_page(
    sim: KubeSim, client: RealK8sPodClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = stock(sim, 1200)
    await post_pod(sim, "not-an-agent", {COMPONENT_LABEL: "other"})
    assert k8s_module.LIST_PAGE_SIZE == 500

    listed = await client.list_pods("default", COMPONENT_SELECTOR)
    assert sim.requests["list pods"] == 3, "500 + 500 + 200"
    assert len(listed) == 1200 and len({p.pod_id for p in listed}) == 1200, "each pod once"
    assert {p.pod_id: (p.phase, p.ready, p.pod_ip) for p in listed} == expected
    assert {p.namespace for p in listed} == {"default"}
    assert {p.pod_id for p in listed if p.dead} == {
        name for name, (phase, _, _) in expected.items() if phase != "Running"
    }
    by_name = {p.pod_id: p for p in listed}
    assert by_name["agent-00001-stock"].scope_id == SCOPE
    assert by_name["agent-00002-stock"].scope_id == OTHER
    assert by_name["agent-00002-stock"].deploy_ver == VER

    # a selector the server filters by, and pages smaller than it
    monkeypatch.setattr(k8s_module, "LIST_PAGE_SIZE", 7)
    ours_only = await client.list_pods("default", f"{SCOPE_LABEL}={SCOPE}")
    assert sorted(p.pod_id for p in ours_only) == sorted(
        name for i, name in enumerate(expected) if i % 2
    )
    assert sim.requests["list pods"] == 3 + 86, "600 pods in pages of 7"
    assert await client.list_pods("team", "") == []


async def test_paged_list_404_and_403_as_before(sim: KubeSim, client: RealK8sPodClient) -> None:
    stock(sim, 600, namespace="team")
    assert await client.list_pods("ghost", COMPONENT_SELECTOR) == [], "no such namespace"
    missing = sim.faults.add("namespace_missing", namespace="team")
    assert await client.list_pods("team", COMPONENT_SELECTOR) == []
    sim.faults.remove(missing.id)
    sim.faults.add("namespace_forbidden", namespace="team")
    with pytest.raises(K8sApiError, match="403 Forbidden: pods is forbidden") as info:
        await client.list_pods("team", COMPONENT_SELECTOR)
    assert info.value.status == 403
    assert sim.requests["list pods"] == 3, "one request each: nothing retried"
    sim.faults.clear()
    sim.faults.add("api_error", status=503, verb="list", count=1)
    with pytest.raises(K8sApiError) as info:
        await client.list_pods("team", COMPONENT_SELECTOR)
    assert info.value.status == 503, "a failed page fails the list (the job tries next tick)"
    assert len(await client.list_pods("team", COMPONENT_SELECTOR)) == 600


async def test_an_expired_continue_token_restarts_the_list_once(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    expected = stock(sim, 1200)
    sim.faults.add("continue_expired", count=1)
    listed = await client.list_pods("default", COMPONENT_SELECTOR)
    assert sorted(p.pod_id for p in listed) == sorted(expected), "each pod once"
    assert sim.injected["continue_expired"] == 1
    assert sim.requests["list pods"] == 5, "page 1, page 2 (410), then pages 1 to 3 again"

    sim.requests.clear()
    sim.faults.add("continue_expired", count=2)
    with pytest.raises(K8sApiError, match="410 Gone: The provided continue parameter") as info:
        await client.list_pods("default", COMPONENT_SELECTOR)
    assert info.value.status == 410
    assert sim.requests["list pods"] == 4, "restarted once, not twice"


# --- the resource manager on top (fakeredis) -----------------------------------------------------


@dataclass
class Rm:
    state: ResourceState
    facade: ResourceManagerFacade
    pool_jobs: PoolJobs


@pytest.fixture
async def rm(client: RealK8sPodClient) -> AsyncIterator[Rm]:
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    state = ResourceState(redis)
    notifier = Notifier(redis)
    await notifier.start()
    orchestrator = ResourceOrchestrator(
        state=state, k8s=client, notifier=notifier, default_namespace="default", identity=IDENTITY
    )
    pool_jobs = PoolJobs(
        state=state,
        k8s=client,
        orchestrator=orchestrator,
        sessions=SessionManagerFacade(state=SessionState(redis)),
        default_namespace="default",
        identity=IDENTITY,
    )
    try:
        yield Rm(state, ResourceManagerFacade(orchestrator=orchestrator), pool_jobs)
    finally:
        await pool_jobs.wait_for_warm_deploys()
        await orchestrator.close()
        await notifier.stop()
        await redis.aclose()


def pool(*, min_idle: int = 0, max_pods: int = 4) -> dict[str, int]:
    return {"min_idle_pods": min_idle, "max_pods": max_pods, "pod_ttl": 60, "pod_concurrency": 1}


async def test_watch_cleans_dead_and_half_dead_pods(sim: KubeSim, rm: Rm) -> None:
    pod_spec = spec()
    await rm.facade.update_pool_config(SCOPE, pool(min_idle=3), pod_spec)
    assert await rm.pool_jobs.autoscale_once() == 3
    await rm.pool_jobs.wait_for_warm_deploys()
    dead, half, healthy = sorted(await PoolJobsState(rm.state).all_pods())
    assert sorted(ours(sim)) == [dead, half, healthy]

    await sim.kill("default", dead, "fail")
    sim.faults.add("health", mode="500", name=half)
    assert await rm.pool_jobs.watch_once() == 1, "dead at once; half-dead after two failures"
    assert await rm.pool_jobs.watch_once() == 1
    assert await rm.pool_jobs.watch_once() == 0
    assert sorted(await PoolJobsState(rm.state).all_pods()) == [healthy]
    await until(lambda: ours(sim) == [healthy], "the cleaned pods deleted in Kubernetes")


async def test_cleanup_missing_namespace_is_0_forbidden_is_k8s_error(
    sim: KubeSim, client: RealK8sPodClient, rm: Rm, tmp_path: Path
) -> None:
    kept = await deploy(client, namespace="team")
    assert await rm.facade.cleanup(namespace="ghost") == 0
    missing = sim.faults.add("namespace_missing", namespace="team")
    assert await rm.facade.cleanup(namespace="team") == 0
    sim.faults.remove(missing.id)
    assert ours(sim, namespace="team") == [kept.pod_id], "a missing namespace deleted nothing"

    sim.faults.add("namespace_forbidden", namespace="team")
    with pytest.raises(K8sApiError) as info:
        await rm.facade.cleanup(namespace="team")
    assert info.value.status == 403

    # the same through the admin route: 502 K8S_ERROR
    db = Database.from_url(f"sqlite:///{tmp_path / 'config.db'}")
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    try:
        async with running_app(
            redis,
            db,
            k8s=client,  # type: ignore[arg-type]
            admin_tokens=["adm"],
            namespaces=["team", "ghost"],
        ) as app:
            headers = {"Authorization": "Bearer adm"}
            for namespace in ("team", "ghost"):  # allowed (AGENT_RUNTIME_NAMESPACES)
                item = {"template_id": f"t-{namespace}", "image": "agentserver:1"}
                body = sync_body("template", "create", {**item, "namespace": namespace})
                synced = await app.post("/api/session/config_sync", json=body, headers=headers)
                assert synced.status_code == 200, synced.text
            resp = await app.post(
                "/api/session/cleanup", json=envelope({"namespace": "team"}), headers=headers
            )
            assert resp.status_code == 502, resp.text
            assert resp.json()["error_code"] == "K8S_ERROR"
            assert "403" in resp.json()["error_message"]
            resp = await app.post(
                "/api/session/cleanup", json=envelope({"namespace": "ghost"}), headers=headers
            )
            assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}
            resp = await app.post("/api/session/cleanup", json=envelope({}), headers=headers)
            assert resp.json()["data"] == {"cleaned": 0}, "nothing of ours in default"
    finally:
        await redis.aclose()
        await db.close()
    assert ours(sim, namespace="team") == [kept.pod_id]


# --- 429 / 5xx and lost replies ------------------------------------------------------------------


async def test_429_is_retried_after_retry_after(sim: KubeSim, client: RealK8sPodClient) -> None:
    sim.faults.add("api_error", status=429, verb="create", count=1, retry_after=1)
    started = time.monotonic()
    info = await deploy(client, ready_timeout=4)
    assert time.monotonic() - started >= 1.0, "Retry-After honoured"
    assert sim.requests["create pods"] == 2 and sim.injected["api_error 429"] == 1
    assert ours(sim) == [info.pod_id]


async def test_5xx_on_create_and_get_are_retried(sim: KubeSim, client: RealK8sPodClient) -> None:
    sim.faults.add("api_error", status=503, verb="create", count=2)
    sim.faults.add("api_error", status=500, verb="get", count=3)
    info = await deploy(client, ready_timeout=4)
    assert sim.requests["create pods"] == 3
    assert sim.injected == {"api_error 503": 2, "api_error 500": 3}
    assert ours(sim) == [info.pod_id], "no second pod"


async def test_5xx_until_the_deadline_fails_in_time(sim: KubeSim, client: RealK8sPodClient) -> None:
    sim.faults.add("api_error", status=500, verb="create")
    started = time.monotonic()
    with pytest.raises(DeployFailed, match="500"):
        await deploy(client, ready_timeout=1.0)
    assert time.monotonic() - started < 1.5
    assert sim.requests["create pods"] >= 2 and sim.pods() == []


async def test_429_whose_retry_after_passes_the_deadline_fails_now(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    sim.faults.add("api_error", status=429, verb="create", retry_after=30)
    started = time.monotonic()
    with pytest.raises(DeployFailed, match="no time left to retry"):
        await deploy(client, ready_timeout=2.0)
    assert time.monotonic() - started < 0.5
    assert sim.requests["create pods"] == 1


async def test_slow_api_within_the_deadline(sim: KubeSim, client: RealK8sPodClient) -> None:
    sim.faults.add("latency", seconds=0.2, verb="get")
    info = await deploy(client, ready_timeout=3)
    assert ours(sim) == [info.pod_id] and sim.injected["latency"] >= 1


async def test_create_cut_at_the_deadline_leaves_nothing(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    sim.faults.add("latency", seconds=1.0, verb="create")
    started = time.monotonic()
    with pytest.raises(DeployFailed, match="no time left"):
        await deploy(client, ready_timeout=0.5)
    assert time.monotonic() - started < 1.0, "a hanging create is cut at the deadline"
    await asyncio.sleep(1.2 - (time.monotonic() - started))  # past the injected latency
    assert sim.pods() == [], "the API server drops a request whose client went away"
    assert sim.requests["delete pods"] == 1, "and the failed deploy tried to delete it"


@pytest.mark.parametrize("mode", ["drop", "500"])
async def test_create_whose_reply_is_lost_is_adopted(
    sim: KubeSim, client: RealK8sPodClient, mode: str
) -> None:
    sim.faults.add("reply_lost", mode=mode, count=1)
    info = await deploy(client)
    assert sim.injected[f"reply_lost {mode}"] == 1
    assert sim.requests["create pods"] == 1, "found by GET, not created again"
    assert ours(sim) == [info.pod_id]


async def test_lost_reply_and_failing_gets_leave_no_orphan(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    """The create landed, its reply was lost, and the GETs that would recognise it fail too:
    the retry of the same name answers 409, which must not pass for another's pod."""
    sim.faults.add("reply_lost", mode="drop", count=1)
    sim.faults.add("api_error", status=500, verb="get", count=2)
    info = await deploy(client, ready_timeout=5)
    assert sim.requests["create pods"] >= 2
    assert ours(sim) == [info.pod_id], "one pod: the first create's"


async def test_lost_reply_orphan_is_found_by_reconcile(sim: KubeSim, rm: Rm) -> None:
    """Worst case: the create landed, every GET and DELETE fails until the deadline, so the
    failed deploy cannot delete its pod, nor sign it for its incarnation (it never learnt the
    uid). Reconcile finds it by label once Kubernetes answers: ours by its create signature,
    unproven for this incarnation (a copy of our annotations on a pod re-created under a
    freed name looks the same), so deleted, never adopted."""
    pod_spec = spec(ready_timeout=1.0)
    sim.faults.add("reply_lost", mode="drop", count=1)
    sim.faults.add("api_error", status=500, verb="get")
    sim.faults.add("api_error", status=500, verb="delete")
    with pytest.raises(DeployFailed):
        await rm.facade.acquire(SCOPE, pod_spec, pool(), "r-1")
    (orphan,) = ours(sim)
    assert await PoolJobsState(rm.state).all_pods() == {}
    assert "agent-runtime/incarnation" not in sim.pod("default", orphan)["metadata"]["annotations"]
    await until(
        lambda: bool((sim.pod("default", orphan) or {}).get("status", {}).get("podIP")), "ip"
    )

    sim.faults.clear()
    counts = await rm.pool_jobs.reconcile_once()
    assert counts == {
        "purged": 0,
        "released": 0,
        "adopted": 0,
        "deleted": 1,
        "expired": 0,
        "foreign": 0,
    }
    assert await PoolJobsState(rm.state).all_pods() == {}
    await until(lambda: not ours(sim), "the unfinished orphan gone")


# --- the watch stream's calls: list_pods_versioned, watch_pods ---------------------------------


async def test_a_watch_from_a_list_sees_a_pod_die_and_be_deleted(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    port = free_port()  # another test run's simulated pods may hold 8080 on 127.0.0.x
    info = await deploy(client, container_port=port, sse_port=port)
    listing = await client.list_pods_versioned("default", COMPONENT_SELECTOR)
    assert [p.pod_id for p in listing.pods] == [info.pod_id] and listing.resource_version
    events = client.watch_pods(
        "default", COMPONENT_SELECTOR, resource_version=listing.resource_version,
        timeout_seconds=30,
    )  # fmt: skip
    seen: list[tuple[str, str]] = []
    async with asyncio.timeout(20), contextlib.aclosing(events) as stream:
        await sim.kill("default", info.pod_id, "fail")
        async for event in stream:
            assert event.pod is not None and event.pod.pod_id == info.pod_id
            assert int(event.resource_version) > int(listing.resource_version)
            seen.append((event.kind, event.pod.phase))
            if event.pod.dead:
                break
    assert seen[-1] == ("MODIFIED", "Failed"), seen
    # resumed from the last version: the delete that follows, and nothing before it again
    await client.delete(info.pod_id, "default")
    resumed = client.watch_pods(
        "default", COMPONENT_SELECTOR, resource_version=event.resource_version,
        timeout_seconds=30,
    )  # fmt: skip
    async with asyncio.timeout(20), contextlib.aclosing(resumed) as stream:
        async for event in stream:
            if event.kind == "DELETED":
                break
            assert event.pod is not None and event.pod.phase == "Terminating", event
    assert event.pod is not None and event.pod.pod_id == info.pod_id


async def test_a_watch_from_a_compacted_version_is_a_410(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    listing = await client.list_pods_versioned("default", COMPONENT_SELECTOR)
    port = free_port()
    await deploy(client, container_port=port, sse_port=port)  # changes after the list...
    sim.watches.compact()  # ...that the history forgets
    events = client.watch_pods(
        "default", COMPONENT_SELECTOR, resource_version=listing.resource_version,
        timeout_seconds=30,
    )  # fmt: skip
    with pytest.raises(K8sApiError) as refused:
        async with asyncio.timeout(20), contextlib.aclosing(events) as stream:
            async for _ in stream:
                pass
    assert refused.value.status == 410


async def test_a_watch_ends_at_its_timeout_and_when_dropped(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    listing = await client.list_pods_versioned("default", COMPONENT_SELECTOR)
    quiet = client.watch_pods(
        "default", COMPONENT_SELECTOR, resource_version=listing.resource_version,
        timeout_seconds=1,
    )  # fmt: skip
    async with asyncio.timeout(20), contextlib.aclosing(quiet) as stream:
        assert [e async for e in stream if e.kind != "BOOKMARK"] == []
    dropped = client.watch_pods(
        "default", COMPONENT_SELECTOR, resource_version=listing.resource_version,
        timeout_seconds=60,
    )  # fmt: skip

    async def drop_soon() -> None:
        for _ in range(2000):  # 20 s at most
            if sim.watches.open_watches:
                break
            await asyncio.sleep(0.01)
        sim.watches.close_all()

    dropping = asyncio.create_task(drop_soon())
    async with asyncio.timeout(20), contextlib.aclosing(dropped) as stream:
        assert [e async for e in stream if e.kind != "BOOKMARK"] == []
    await dropping


async def test_a_watch_of_a_forbidden_namespace_is_refused(
    sim: KubeSim, client: RealK8sPodClient
) -> None:
    sim.faults.add("namespace_forbidden", namespace="team")
    events = client.watch_pods("team", COMPONENT_SELECTOR, resource_version="0", timeout_seconds=5)
    with pytest.raises(K8sApiError) as refused:
        async with asyncio.timeout(20), contextlib.aclosing(events) as stream:
            async for _ in stream:
                pass
    assert refused.value.status == 403
