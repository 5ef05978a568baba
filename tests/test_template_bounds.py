"""Templates stay inside the operator's bounds (issue 13, section 2), through the public
interface: config_sync and route over HTTP on the real kubernetes_asyncio client against
kubesim, and ``agent-runtime serve`` as a process for the startup refusals.

- ``kubeconfig`` names a cluster of AGENT_RUNTIME_CLUSTERS, never a path; an ``exec`` plugin
  in a cluster's kubeconfig is refused at startup (and never run) unless allowed.
- ``namespace`` is one of the default namespace and AGENT_RUNTIME_NAMESPACES, for templates,
  deploys and cleanup.
- ``env`` values may come from a Secret (``valueFrom.secretKeyRef``); plain values are
  redacted in the admin views and masked in log lines.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from agent_runtime import logs
from agent_runtime.config import ConfigError
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.clusters import read_clusters
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.session_manager import config_repo as repo
from agent_runtime.session_manager.items import TemplateItem
from agent_runtime.util import scope_id_of
from helpers import IDENTITY, envelope, running_app, sync_body
from kubesim import KubeSim
from kubesim.kubeconfig import render_kubeconfig

SYNC = "/api/session/config_sync"
ROUTE = "/api/session/route"
CLEANUP = "/api/session/cleanup"
GROUP, BOT = "grp-bounds", "bot-bounds"
SID = scope_id_of(GROUP, BOT)
SECRET_VALUE = "sk-live-0123456789abcdef"  # a plain env value: must never be shown
CLI_TIMEOUT = 30.0


def template(template_id: str = "tpl-bounds", **fields: Any) -> dict[str, Any]:
    return {
        "template_id": template_id,
        "image": "registry.local/agent:1.0",
        "sse_port": 8080,
        "ready_timeout": 10,
        "ready_poll_interval": 0.03,
        "scope_concurrency": 2,
        "pod_concurrency": 1,
        **fields,
    }


def exec_kubeconfig(server: str, marker: Path) -> str:
    """The simulator's kubeconfig whose user is an ``exec`` plugin that touches ``marker``
    and hands out a token (a valid ExecCredential, so an allowed one works)."""
    credential = json.dumps(
        {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "kind": "ExecCredential",
            "status": {"token": "t"},
        }
    )
    script = f"touch {marker} && echo '{credential}'"
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": "/bin/sh",
            "args": ["-c", script],
        }
    }
    text = render_kubeconfig(server).replace("  user:\n    {}\n", "")
    return text + "  user:\n" + f"    {json.dumps(user)}\n"


@dataclass
class Stack:
    app: httpx.AsyncClient
    sim: KubeSim
    db: Database
    redis: Redis


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)  # kubernetes_asyncio honours them (trust_env)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never in-cluster here


@pytest.fixture
async def stack(redis: Redis, db: Database, tmp_path: Path, no_proxy: None) -> AsyncIterator[Stack]:
    """The app on RealK8sPodClient over kubesim; cluster ``east`` is the simulator too (its
    own kubeconfig file); namespaces: default and ``team`` (kube-system exists, not allowed)."""
    async with KubeSim(
        ready_delay=0.05,
        grace_period=0.3,
        probe_period=0.05,
        namespaces=("default", "team", "kube-system"),
        seed=13,
    ) as sim:
        east = tmp_path / "east.kubeconfig"
        east.write_text(render_kubeconfig(sim.url))
        clusters = {"east": str(east)}
        client = RealK8sPodClient(
            kubeconfig=str(sim.kubeconfig_path),
            default_namespace="default",
            clusters=read_clusters(clusters, ()),
        )
        try:
            async with running_app(
                redis,
                db,
                k8s=client,  # type: ignore[arg-type]
                clusters=clusters,
                namespaces=["team"],
            ) as app:
                yield Stack(app, sim, db, redis)
        finally:
            await client.close()


async def sync(app: httpx.AsyncClient, kind: str, op: str, item: dict[str, Any]) -> httpx.Response:
    return await app.post(SYNC, json=sync_body(kind, op, item))


async def route(app: httpx.AsyncClient, session_id: str) -> httpx.Response:
    body = envelope(session_id=session_id, bot_id=BOT, extra={"group_id": GROUP})
    return await app.post(ROUTE, json=body)


async def bind(app: httpx.AsyncClient, template_id: str) -> None:
    rule = {"group_id": GROUP, "bot_id": BOT, "template_id": template_id}
    resp = await sync(app, "routing_rule", "sync", rule)
    assert resp.status_code == 200, resp.text


def failure(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["ok"] is False and body["error_code"] == code, body
    return dict(body)


# --- clusters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("/etc/shadow", "a path"),
        ("/tmp", "a folder"),
        ("west", "an unknown cluster"),
        ("../east", "a relative path"),
    ],
)
async def test_kubeconfig_must_name_a_configured_cluster(
    redis: Redis, db: Database, value: str, why: str
) -> None:
    async with running_app(redis, db, clusters={"east": "/etc/ar/east.kubeconfig"}) as app:
        resp = await sync(app, "template", "sync", template(kubeconfig=value))
        body = failure(resp, 400, "VALIDATION")
        assert body["error_message"].startswith("item.kubeconfig:"), why
        assert "east" in body["error_message"]  # what may be named instead
        ok = await sync(app, "template", "sync", template(kubeconfig="east"))
        assert ok.status_code == 200, ok.text
        # a partial update is held to the same rule
        patch = {"template_id": "tpl-bounds", "kubeconfig": value}
        failure(await sync(app, "template", "update", patch), 400, "VALIDATION")


async def test_a_stored_path_or_unknown_cluster_fails_deploys_without_reading_it(
    stack: Stack,
) -> None:
    """A row written before the bounds (a path) or naming a cluster since removed: route gets
    NO_POD_AVAILABLE with a message that names no path and reads no file (the old answers
    were ``Is a directory: '/tmp'`` and ``Expected key current-context in /etc/passwd``)."""
    for n, value in enumerate(("/tmp", "/etc/passwd", "west")):
        item = TemplateItem.model_validate(template(f"tpl-old-{n}", kubeconfig=value))
        await stack.db.write(lambda conn, item=item: repo.put_template(conn, item, exists=False))
        await bind(stack.app, item.template_id)
        body = failure(await route(stack.app, f"s-old-{n}"), 503, "NO_POD_AVAILABLE")
        message = body["error_message"]
        for leak in (value, "Is a directory", "current-context", "Errno"):
            assert leak not in message, message
    assert stack.sim.pods() == []
    assert stack.sim.requests["create pods"] == 0


async def test_a_configured_cluster_deploys_through_its_own_kubeconfig(stack: Stack) -> None:
    resp = await sync(stack.app, "template", "sync", template(kubeconfig="east"))
    assert resp.status_code == 200, resp.text
    await bind(stack.app, "tpl-bounds")
    resp = await route(stack.app, "s-east")
    assert resp.status_code == 200, resp.text
    assert [p["metadata"]["name"] for p in stack.sim.pods("default")] == [
        resp.json()["data"]["pod_id"]
    ]


def test_exec_in_a_cluster_kubeconfig_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "east.kubeconfig"
    path.write_text(exec_kubeconfig("http://127.0.0.1:1", marker))
    with pytest.raises(ConfigError, match="exec") as refused:
        read_clusters({"east": str(path)}, ())
    assert "AGENT_RUNTIME_CLUSTERS_ALLOW_EXEC=east" in str(refused.value)
    provider = tmp_path / "gcp.kubeconfig"
    provider.write_text(
        render_kubeconfig("http://127.0.0.1:1").replace(
            "    {}\n",
            '    {"auth-provider": {"name": "gcp", "config": {"cmd-path": "/bin/id"}}}\n',
        )
    )
    with pytest.raises(ConfigError, match="auth-provider"):
        read_clusters({"gcp": str(provider)}, ())
    with pytest.raises(ConfigError, match="does not configure"):
        read_clusters({"east": str(path)}, ("west",))
    for broken, why in ((tmp_path, "is a folder"), (tmp_path / "none", "is missing")):
        with pytest.raises(ConfigError, match="cannot be read"):
            read_clusters({"east": str(broken)}, ())
        del why
    assert not marker.exists()


async def test_an_allowed_exec_cluster_runs_its_plugin_at_start_only(
    tmp_path: Path, no_proxy: None
) -> None:
    """Allowed: the plugin runs once, when the client starts, and the cluster deploys."""
    marker = tmp_path / "ran"
    async with KubeSim(ready_delay=0.05, grace_period=0.3, probe_period=0.05, seed=3) as sim:
        path = tmp_path / "east.kubeconfig"
        path.write_text(exec_kubeconfig(sim.url, marker))
        clusters = read_clusters({"east": str(path)}, ("east",))
        assert not marker.exists(), "reading and checking never runs it"
        client = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path), clusters=clusters)
        await client.start()
        try:
            assert marker.exists()
            marker.unlink()
            spec = template(kubeconfig="east", namespace=None)
            info = await client.deploy(
                scope_id=SID, deploy_ver="v1", pod_spec=spec, identity=IDENTITY
            )
            assert sim.pod("default", info.pod_id) is not None
            assert not marker.exists(), "a deploy reads no kubeconfig"
        finally:
            await client.close()


def _serve(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``agent-runtime serve --mode local`` with only ``env`` as AGENT_RUNTIME_* settings."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RUNTIME_")}
    full.update({"AGENT_RUNTIME_SQLITE_PATH": str(tmp_path / "local.db"), **env})
    return subprocess.run(
        [sys.executable, "-m", "agent_runtime.cli", "serve", "--mode", "local", "--port", "1"],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def test_serve_refuses_an_exec_cluster_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "east.kubeconfig"
    path.write_text(exec_kubeconfig("http://127.0.0.1:1", marker))
    run = _serve(tmp_path, {"AGENT_RUNTIME_CLUSTERS": f"east={path}"})
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agent-runtime: error: "), run.stderr
    assert "'exec'" in lines[0] and "AGENT_RUNTIME_CLUSTERS_ALLOW_EXEC=east" in lines[0]
    assert not marker.exists()
    for bad in ("east", "east=relative.kubeconfig", "East=/x", f"east={path},east={path}"):
        run = _serve(tmp_path, {"AGENT_RUNTIME_CLUSTERS": bad})
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, (bad, run.stderr)
        assert "AGENT_RUNTIME_CLUSTERS" in run.stderr, run.stderr


# --- namespaces ------------------------------------------------------------------------------


async def test_a_namespace_off_the_allow_list_is_refused_at_config_sync(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db, namespaces=["team"]) as app:
        for namespace in ("kube-system", "other"):
            resp = await sync(app, "template", "sync", template(namespace=namespace))
            body = failure(resp, 400, "VALIDATION")
            assert body["error_message"].startswith("item.namespace:"), body
        for namespace in ("team", "default", None):
            resp = await sync(app, "template", "sync", template(namespace=namespace))
            assert resp.status_code == 200, resp.text
        patch = {"template_id": "tpl-bounds", "namespace": "kube-system"}
        failure(await sync(app, "template", "update", patch), 400, "VALIDATION")


async def test_kube_system_is_neither_deployed_to_nor_cleaned(stack: Stack) -> None:
    """A row naming kube-system (written before the allow-list) gets no pod there, and cleanup
    of kube-system answers 0 without asking Kubernetes: the foreign pod there stays."""
    foreign = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "theirs", "labels": {"jiuwenclaw-component": "agentserver"}},
        "spec": {"containers": [{"name": "c", "image": "their/agent:1"}]},
    }
    async with httpx.AsyncClient(base_url=stack.sim.url) as sim_http:
        created = await sim_http.post("/api/v1/namespaces/kube-system/pods", json=foreign)
        assert created.status_code == 201, created.text
    creates = stack.sim.requests["create pods"]  # the foreign pod's
    item = TemplateItem.model_validate(template("tpl-kube", namespace="kube-system"))
    await stack.db.write(lambda conn: repo.put_template(conn, item, exists=False))
    await bind(stack.app, "tpl-kube")
    body = failure(await route(stack.app, "s-kube"), 503, "NO_POD_AVAILABLE")
    assert "kube-system" not in body["error_message"]
    assert stack.sim.requests["create pods"] == creates, "no deploy was tried"
    lists = stack.sim.requests["list pods"]

    resp = await stack.app.post(CLEANUP, json=envelope({"namespace": "kube-system"}))
    assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}, resp.text
    assert stack.sim.requests["list pods"] == lists, "Kubernetes was not asked"
    assert [p["metadata"]["name"] for p in stack.sim.pods("kube-system")] == ["theirs"]
    # an allowed namespace is cleaned as before
    resp = await stack.app.post(CLEANUP, json=envelope({"namespace": "team"}))
    assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}, resp.text
    assert stack.sim.requests["list pods"] == lists + 1


# --- env from Secrets, redaction -------------------------------------------------------------

SECRET_REF = {"valueFrom": {"secretKeyRef": {"name": "agent-keys", "key": "openai.key"}}}


@pytest.mark.parametrize(
    "bad",
    [
        {"valueFrom": {"secretKeyRef": {"name": "Agent_Keys", "key": "k"}}},
        {"valueFrom": {"secretKeyRef": {"name": "agent-keys", "key": "a/b"}}},
        {"valueFrom": {"secretKeyRef": {"name": "agent-keys"}}},
        {"valueFrom": {"secretKeyRef": {"name": "a" * 254, "key": "k"}}},
        {"valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": "yes"}}},
        {"valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}, "fieldRef": {}}},
        {"valueFrom": {"configMapKeyRef": {"name": "s", "key": "k"}}},
        {"valueFrom": {}},
        {"value": "x"},
        5,
    ],
)
async def test_env_refs_are_validated_strictly(redis: Redis, db: Database, bad: Any) -> None:
    async with running_app(redis, db) as app:
        resp = await sync(app, "template", "sync", template(env={"API_KEY": bad}))
        body = failure(resp, 400, "VALIDATION")
        assert body["error_message"].startswith("item.env.API_KEY:"), body


async def test_env_count_is_bounded(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as app:
        env = {f"V{i}": "x" for i in range(257)}
        failure(await sync(app, "template", "sync", template(env=env)), 400, "VALIDATION")
        env.pop("V0")
        assert (await sync(app, "template", "sync", template(env=env))).status_code == 200


async def test_a_secret_ref_reaches_the_pod_and_no_clear_value_is_shown(stack: Stack) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        env = {"API_KEY": SECRET_REF, "OPENAI_KEY": SECRET_VALUE, "MODE": "prod"}
        resp = await sync(stack.app, "template", "sync", template(env=env))
        assert resp.status_code == 200, resp.text
        await bind(stack.app, "tpl-bounds")
        resp = await route(stack.app, "s-secret")
        assert resp.status_code == 200, resp.text
        pod_id = resp.json()["data"]["pod_id"]
        # a line that carries the spec, as a failed create's echoed manifest would
        logging.getLogger("agent_runtime.test").warning("spec env %s", env)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)

    pod = stack.sim.pod("default", pod_id)
    assert pod is not None
    (container,) = pod["spec"]["containers"]
    ref = {"name": "agent-keys", "key": "openai.key", "optional": False}
    assert container["env"] == [
        {"name": "API_KEY", "valueFrom": {"secretKeyRef": ref}},
        {"name": "MODE", "value": "prod"},
        {"name": "OPENAI_KEY", "value": SECRET_VALUE},
    ]

    resp = await stack.app.get(f"/api/session/admin/scopes/{SID}")
    assert resp.status_code == 200, resp.text
    view = resp.text
    assert SECRET_VALUE not in view
    data = resp.json()["data"]
    for config in (data["config"], data["pool"]["pool_config"]):
        shown = json.loads(config["pod_spec_json"])["env"]
        assert shown["OPENAI_KEY"] == "<redacted>" and shown["MODE"] == "<redacted>"
        assert shown["API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "agent-keys"
    resp = await stack.app.get("/api/session/admin/scopes")
    assert resp.status_code == 200 and SECRET_VALUE not in resp.text

    lines = stream.getvalue()
    assert "spec env" in lines and SECRET_VALUE not in lines


async def test_reconcile_never_hunts_orphans_off_the_allow_list(redis: Redis, db: Database) -> None:
    """A pool config from before the allow-list names kube-system: reconcile does not list
    there, so a pod of ours (signed) in kube-system is not deleted as an orphan; the same pod
    in an allowed namespace is (reconcile's normal duty: an old version)."""
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s, namespaces=["team"]) as app:
        svc = app.app.state.services  # type: ignore[attr-defined]
        pool = {"min_idle_pods": 0, "max_pods": 1, "pod_ttl": 60, "pod_concurrency": 1}
        for sid, namespace in ((SID, "kube-system"), (scope_id_of("g2", "b2"), "team")):
            spec = {"image": "registry.local/agent:1.0", "namespace": namespace}
            await svc.resources.update_pool_config(sid, pool, pod_spec=spec)
        signed = {"identity": svc.identity}
        theirs = k8s.add_pod(
            scope_id=SID, deploy_ver="other", namespace="kube-system", **signed
        ).pod_id
        orphan = k8s.add_pod(
            scope_id=scope_id_of("g2", "b2"), deploy_ver="other", namespace="team", **signed
        ).pod_id
        counts = await svc.pool_jobs.reconcile_once()
        assert theirs in k8s.pods
        assert orphan not in k8s.pods and counts["deleted"] == 1


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ([{"name": "A", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}], "name"),
        ([{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a/b"}}}], "key"),
        ([{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}], "key"),
        (
            [{"name": "A", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "",
        ),
        ([{"name": "1A", "value": "x"}], "name"),
    ],
)
async def test_kubesim_checks_env_as_the_api_server(env: list[Any], field: str) -> None:
    """The simulator refuses a bad env (422 naming the field), so a pod it runs had a valid one."""
    async with KubeSim(seed=5) as sim, httpx.AsyncClient(base_url=sim.url) as http:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "i:1", "env": env}]},
        }
        resp = await http.post("/api/v1/namespaces/default/pods", json=pod)
        assert resp.status_code == 422, resp.text
        assert "spec.containers[0].env[0]" in resp.text and field in resp.text
        pod["spec"]["containers"][0]["env"] = [  # type: ignore[index]
            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
        ]
        assert (await http.post("/api/v1/namespaces/default/pods", json=pod)).status_code == 201
