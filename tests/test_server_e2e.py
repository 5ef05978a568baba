"""Server mode end to end, as production runs it: ``agent-runtime serve --mode server`` as a
real uvicorn process on the real Redis and a real SQL database (MariaDB, then PostgreSQL), its
Kubernetes the API simulator, driven over real HTTP through scenarios A–N of
``docs/design/hld.md`` §4 (``test_scenarios.py`` runs the same scenarios in process).

One stack per SQL backend (module scope): a database of its own, brought up by
``agent-runtime db upgrade`` as an operator would (server mode refuses an old schema), the
claimed real-Redis db, ``agent-runtime kubesim``, then ``agent-runtime serve``, configured
through ``AGENT_RUNTIME_*`` with short job intervals. The simulator runs as a process of its
own, not in the test's event loop: the service talks to a separate API server as in
production, the stack's fixtures need no event loop (each test keeps its own), and it is the
command ``scripts/demo_server.sh`` runs; tests steer it through its control endpoint
(``/_sim/...``). Both processes are stopped (SIGTERM, then SIGKILL) whatever happens; the
server must exit 0 on SIGTERM. A failed test gets the server's log of that test in its report.

Scenarios keep apart by their own template, routing rule and so scope; each ends by deleting
its scope's pods through ``cleanup``. The jobs run by themselves, so every check that waits
is a poll with a deadline. Redis keys are read by their contract names (``test_scenarios``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.scope_buckets import bucket_of
from agent_runtime_client import AsyncGatewayClient, Placement, RetryPolicy
from contract_keys import rm_deploy_lock, rm_pod_known, rm_pods_index
from helpers import (
    CLAIM_KEY,
    claim_real_redis,
    envelope,
    make_sql_backend,
    real_redis_url,
    sync_body,
)
from test_admin_cli import run_cli
from test_local_mode import LocalServer, _wait_healthy, free_port
from test_scenarios import (
    assert_failure,
    assert_retry_after,
    rm_pod,
    rm_scope,
    scope_of,
    sm_bucket,
    sm_expiry,
    sm_pod,
    sm_pods_registered,
    sm_scope,
    sm_session,
)

# a stack start (db upgrade, simulator, server) and the stop of the last one land on one test
pytestmark = pytest.mark.timeout(120)

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
CLEANUP = "/api/session/cleanup"
ADMIN_TOKEN = "e2e-admin"
GATEWAY_TOKEN = "e2e-gateway"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
GATEWAY = {"authorization": f"Bearer {GATEWAY_TOKEN}"}

SCOPE_FULL_TIMEOUT = 3.0
# set, so that a test can sign a pod as the service does (scenario L); scripts/e2e_acceptance.py
# gives an external deployment the same SETTINGS
E2E_POD_SECRET = "e2e-pod-identity-secret-0001"
E2E_IDENTITY = PodIdentity(E2E_POD_SECRET)
SETTINGS = {
    "AGENT_RUNTIME_POD_IDENTITY_SECRET": E2E_POD_SECRET,
    "AGENT_RUNTIME_ADMIN_TOKENS": ADMIN_TOKEN,
    "AGENT_RUNTIME_GATEWAY_TOKENS": GATEWAY_TOKEN,
    "AGENT_RUNTIME_DEFAULT_NAMESPACE": "default",
    "AGENT_RUNTIME_NAMESPACES": "ghost,locked",  # the cleanup scenario's templates name them
    "AGENT_RUNTIME_SCOPE_FULL_TIMEOUT": str(SCOPE_FULL_TIMEOUT),
    "AGENT_RUNTIME_SWEEP_INTERVAL": "0.2",
    "AGENT_RUNTIME_AUTOSCALE_INTERVAL": "0.2",
    "AGENT_RUNTIME_RECLAIM_INTERVAL": "0.2",
    "AGENT_RUNTIME_WATCH_INTERVAL": "0.25",
    "AGENT_RUNTIME_RECONCILE_INTERVAL": "0.5",
    "AGENT_RUNTIME_SHUTDOWN_TIMEOUT": "10",
    "AGENT_RUNTIME_LOG_LEVEL": "INFO",
}
SIM_ARGS = [
    *("--ready-delay", "0.2", "--jitter", "0.05", "--grace-period", "0.3"),
    *("--probe-period", "0.05", "--sse-interval", "0.1", "--log-level", "WARNING"),
]
# never in-cluster, never through a proxy: the simulator and its pods are on loopback
DROPPED_ENV = {
    *("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"),
    *("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"),
}

START_TIMEOUT = 40.0  # seconds for a process to answer (the machine may be busy)
STOP_TIMEOUT = 15.0  # SIGTERM → exit, before SIGKILL
DEADLINE = 20.0  # any poll
POLL = 0.05
LOG_TAIL = 60_000  # characters of the server log attached to a failed test

SCOPE_LABEL = "agent-runtime/scope"
VERSION_LABEL = "agent-runtime/deploy-ver"


# --- processes -----------------------------------------------------------------------------------


def agent_runtime(*args: str) -> list[str]:
    """The venv's ``agent-runtime`` entry point (``python -m agent_runtime.cli`` without one)."""
    exe = Path(sys.executable).with_name("agent-runtime")
    if exe.exists():
        return [str(exe), *args]
    return [sys.executable, "-m", "agent_runtime.cli", *args]


def child_env(settings: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AGENT_RUNTIME_") and k.upper() not in DROPPED_ENV
    }
    return {**env, **settings}


class Child:
    """A process of the stack; its output goes to a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.killed = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(
                f"{self.name} exited with {self.proc.returncode}; its log:\n{self.log()}",
                pytrace=False,
            )

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it is still there after STOP_TIMEOUT; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)
        return self.proc.returncode


def wait_for_sim(sim: Child) -> str:
    """The simulator's URL, from the line it prints once it listens."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        match = re.search(r"kubesim: listening on (http://\S+), kubeconfig", sim.log())
        if match:
            return match[1]
        sim.check_alive()
        if time.monotonic() > deadline:
            pytest.fail(f"kubesim not listening within {START_TIMEOUT:g}s:\n{sim.log()}")
        time.sleep(POLL)


async def _claim_redis() -> str:
    """The real-Redis db this test process claimed (conftest's mechanism), flushed, ours."""
    client = await claim_real_redis()
    await client.aclose()
    return real_redis_url()


def release_redis(url: str) -> None:
    """Remove every key the stack wrote; the db stays ours (flushed and marked at once)."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    client = SyncRedis.from_url(url, decode_responses=True, socket_connect_timeout=2)
    try:
        if client.get(CLAIM_KEY) == me:  # never flush a db that is not ours
            with client.pipeline(transaction=True) as pipe:
                pipe.flushdb()
                pipe.set(CLAIM_KEY, me)
                pipe.execute()
    finally:
        client.close()


# --- the stack -----------------------------------------------------------------------------------


@dataclass
class Stack:
    base_url: str
    sim_url: str
    redis_url: str
    instance_id: str
    sse_port: int  # of every template: the simulated AgentServers listen there
    server: Child | None  # None: a deployment someone else runs (scripts/e2e_acceptance.py)


# scripts/e2e_acceptance.py points the scenarios at a running deployment (configured with
# SETTINGS) instead of starting one: its URL, its Redis and its simulator
EXTERNAL = {
    "base_url": os.environ.get("AGENT_RUNTIME_E2E_BASE_URL"),
    "redis_url": os.environ.get("AGENT_RUNTIME_E2E_REDIS_URL"),
    "sim_url": os.environ.get("AGENT_RUNTIME_E2E_KUBESIM_URL"),
}


def external_stack(backend: str) -> Stack:
    if backend != "mariadb":
        pytest.skip("an external deployment runs the scenarios once")
    missing = [k for k, v in EXTERNAL.items() if not v]
    if missing:
        pytest.fail(f"external deployment: set AGENT_RUNTIME_E2E_{missing[0].upper()}")
    base_url = str(EXTERNAL["base_url"]).rstrip("/")
    health = httpx.get(f"{base_url}/healthz", timeout=5, trust_env=False)
    assert health.status_code == 200, f"{base_url}/healthz: {health.status_code} {health.text}"
    return Stack(
        base_url,
        str(EXTERNAL["sim_url"]).rstrip("/"),
        str(EXTERNAL["redis_url"]),
        str(health.json()["instance_id"]),
        free_port(),
        None,
    )


_LOG_FROM = pytest.StashKey[tuple[Child, int]]()


class AttachServerLog:
    """A plugin, registered while a stack runs: the server's log written during a failed test
    goes into the test's report."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        start = item.stash.get(_LOG_FROM, None)
        if start is not None and report.failed:
            server, offset = start
            text = server.log_path.read_bytes()[offset:].decode(errors="replace")
            report.sections.append((f"{server.name} log during this test", text[-LOG_TAIL:]))
        return report


@dataclass
class Backing:
    """What the servers of a stack share: the claimed Redis db, a SQL database, the simulator."""

    redis_url: str
    sql_url: str
    kubeconfig: Path
    sim_url: str


def backing(workdir: Path, backend: str, undo: contextlib.ExitStack) -> Backing:
    """The claimed real-Redis db, a database of ``backend`` brought up by ``db upgrade`` and
    the simulator; ``undo`` stops and releases them (in reverse: simulator, SQL, Redis)."""
    redis_url = asyncio.run(_claim_redis())
    undo.callback(release_redis, redis_url)
    sql = make_sql_backend(backend, workdir)
    undo.callback(sql.cleanup)
    env = child_env({"AGENT_RUNTIME_DATABASE_URL": sql.url})
    upgrade = subprocess.run(
        agent_runtime("db", "upgrade"),
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    kubeconfig = workdir / "kubeconfig"
    sim_args = agent_runtime("kubesim", "--kubeconfig-out", str(kubeconfig), *SIM_ARGS)
    sim = Child("kubesim", sim_args, env, workdir / "kubesim.log")
    undo.callback(sim.stop)
    return Backing(redis_url, sql.url, kubeconfig, wait_for_sim(sim))


def serve_on(
    workdir: Path,
    shared: Backing,
    settings: dict[str, str],
    undo: contextlib.ExitStack,
    *,
    name: str,
) -> tuple[Child, str, str]:
    """``serve --mode server`` over ``shared`` with ``settings``, up and healthy (``undo``
    stops it): the process, its URL and its instance id."""
    port, instance_id = free_port(), f"e2e-{name}-{uuid.uuid4().hex[:6]}"
    env = {
        **settings,
        "AGENT_RUNTIME_REDIS_URL": shared.redis_url,
        "AGENT_RUNTIME_DATABASE_URL": shared.sql_url,
        "AGENT_RUNTIME_KUBECONFIG": str(shared.kubeconfig),
        "AGENT_RUNTIME_INSTANCE_ID": instance_id,
    }
    serve = agent_runtime("serve", "--mode", "server", "--port", str(port))
    log = workdir / f"server-{name}.log"
    server = Child(f"agent-runtime serve {name}", serve, child_env(env), log)
    undo.callback(server.stop)
    base_url = f"http://127.0.0.1:{port}"
    _wait_healthy(LocalServer(server.proc, base_url, server.log_path, instance_id), START_TIMEOUT)
    return server, base_url, instance_id


def serving(
    workdir: Path, backend: str, settings: dict[str, str], undo: contextlib.ExitStack
) -> Stack:
    """``backing`` and one server with ``settings`` over it; ``undo`` stops and releases them
    (in reverse: server, simulator, SQL, Redis)."""
    shared = backing(workdir, backend, undo)
    server, base_url, instance_id = serve_on(workdir, shared, settings, undo, name=backend)
    return Stack(base_url, shared.sim_url, shared.redis_url, instance_id, free_port(), server)


def stack_with(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    backend: str,
    settings: dict[str, str],
) -> Iterator[Stack]:
    """A module's stack: ``serving`` with ``settings``, its server's log attached to a failed
    test's report; the server must exit 0 on SIGTERM."""
    workdir = tmp_path_factory.mktemp(f"e2e-{backend}")
    with contextlib.ExitStack() as undo:
        plugin = AttachServerLog()
        request.config.pluginmanager.register(plugin, f"e2e-server-log-{workdir.name}")
        undo.callback(request.config.pluginmanager.unregister, plugin)
        running = serving(workdir, backend, settings, undo)
        yield running
        assert running.server is not None
        server = running.server
        stopped = server.stop(), server.killed
    if stopped != (0, False):
        pytest.fail(f"SIGTERM: (exit status, killed) {stopped}; its log:\n{server.log()}")


@pytest.fixture(scope="module", params=["mariadb", "postgresql"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    backend = str(request.param)
    if EXTERNAL["base_url"]:
        yield external_stack(backend)
        return
    yield from stack_with(request, tmp_path_factory, backend, SETTINGS)


# --- one scenario: its own template, rule and scope ----------------------------------------------


@dataclass
class Scenario:
    stack: Stack
    http: httpx.AsyncClient
    sim: httpx.AsyncClient
    redis: Redis
    letter: str
    gateway: AsyncGatewayClient  # the gateway's client, retries off: what the service answered
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    configured: bool = False

    bot: str = "bot-1"

    @property
    def group(self) -> str:
        return f"grp-{self.letter}-{self.tag}"

    @property
    def template_id(self) -> str:
        return f"tpl-{self.letter}-{self.tag}"

    @property
    def scope(self) -> str:
        return scope_of(self.group, self.bot)

    def rid(self, name: str) -> str:
        """A request id of this scenario (the replay cache is shared by the whole stack)."""
        return f"r-{self.tag}-{name}"

    async def eventually(self, check: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not await check():
            if time.monotonic() > deadline:
                pytest.fail(f"not within {DEADLINE:g} s: {what}")
            await asyncio.sleep(POLL)

    # --- the service over HTTP ---

    async def sync(
        self, kind: str, op: str, item: dict[str, Any], *, status: int = 200
    ) -> dict[str, Any]:
        resp = await self.http.post(SYNC, json=sync_body(kind, op, item), headers=ADMIN)
        assert resp.status_code == status, resp.text
        body: dict[str, Any] = resp.json()
        return body["data"] if status == 200 else body

    async def configure(self, **fields: Any) -> None:
        """The scenario's template and an exact rule for its (group, bot)."""
        template = {
            "template_id": self.template_id,
            "image": "agentserver:1",
            "pod_name": f"e2e-{self.letter}",
            "container_port": self.stack.sse_port,
            "sse_port": self.stack.sse_port,
            "sse_path": "/sse",
            "scope_concurrency": 4,
            "pod_concurrency": 2,
            "session_ttl": 60,
            "pod_ttl": 300,
            "min_idle_pods": 0,
            "ready_timeout": 10,
            "ready_poll_interval": 0.05,
            **fields,
        }
        await self.sync("template", "sync", template)
        rule = {"group_id": self.group, "bot_id": self.bot, "template_id": self.template_id}
        await self.sync("routing_rule", "sync", rule)
        self.configured = True

    async def update(self, *, status: int = 200, **fields: Any) -> dict[str, Any]:
        item = {"template_id": self.template_id, **fields}
        return await self.sync("template", "update", item, status=status)

    async def route(self, session_id: str, request_id: str | None = None) -> httpx.Response:
        body = envelope(
            request_id=request_id or self.rid(uuid.uuid4().hex[:8]),
            session_id=self.sid(session_id),
            bot_id=self.bot,
            extra={"group_id": self.group},
        )
        return await self.http.post(ROUTE, json=body, headers=GATEWAY)

    async def routed(self, session_id: str, request_id: str | None = None) -> dict[str, Any]:
        """A route through the gateway's client that must succeed; its data as a dict."""
        rid = request_id or self.rid(uuid.uuid4().hex[:8])
        route = await self.gateway.route(self.sid(session_id), self.bot, self.group, request_id=rid)
        assert route.request_id == rid
        data: dict[str, Any] = {
            "pod_id": route.pod_id,
            "pod_sse_url": route.pod_sse_url,
            "placement": route.placement.value,
        }
        assert (route.previous_pod_id is not None) == (route.placement is Placement.REBOUND)
        if route.previous_pod_id is not None:
            data["previous_pod_id"] = route.previous_pod_id
        return data

    async def touch(self, session_id: str, *, eos: bool = False) -> dict[str, Any]:
        """A touch (without the scope's ids: the index path) through the gateway's client."""
        if eos:
            ended = await self.gateway.end(self.sid(session_id))
            return {"touched": ended.touched, "released": ended.released}
        return {"touched": await self.gateway.touch(self.sid(session_id))}

    async def cleanup(self, **rawdata: str) -> httpx.Response:
        return await self.http.post(CLEANUP, json=envelope(rawdata), headers=ADMIN)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of ``name`` on /metrics that carry ``labels``."""
        total = 0.0
        for line in (await self.http.get("/metrics")).text.splitlines():
            series, _, value = line.rpartition(" ")
            wanted = (f'{k}="{v}"' in series for k, v in labels.items())
            if series.startswith(f"{name}{{") and all(wanted):
                total += float(value)
        return total

    def sid(self, session_id: str) -> str:
        """Session ids are per scenario too: ``session:{id}`` is not per scope."""
        return f"{session_id}-{self.tag}"

    # --- the simulator ---

    async def sim_pods(self) -> dict[str, dict[str, Any]]:
        """The scope's pods in Kubernetes, by name (those being deleted included)."""
        resp = await self.sim.get("/_sim/state")
        assert resp.status_code == 200, resp.text
        pods = resp.json()["pods"]
        return {p["name"]: p for p in pods if p["labels"].get(SCOPE_LABEL) == self.scope}

    async def live_pods(self) -> set[str]:
        return {name for name, pod in (await self.sim_pods()).items() if not pod["deleting"]}

    async def api_pod(self, name: str) -> dict[str, Any]:
        """The Pod object as the Kubernetes API answers it."""
        resp = await self.sim.get(f"/api/v1/namespaces/default/pods/{name}")
        assert resp.status_code == 200, resp.text
        pod: dict[str, Any] = resp.json()
        return pod

    async def create_pod(self, name: str, deploy_ver: str, *, image: str, signed: bool) -> None:
        """A pod created behind the service's back with the scope's labels; ``signed``: with
        the annotations the service would give it (create, then the uid-bound patch)."""
        labels = {"jiuwenclaw-component": "agentserver", "app": name}
        labels |= {SCOPE_LABEL: self.scope, VERSION_LABEL: deploy_ver}
        port = {"name": "sse", "containerPort": self.stack.sse_port, "protocol": "TCP"}
        spec = {"sse_port": self.stack.sse_port, "sse_path": "/sse"}
        notes = (
            E2E_IDENTITY.create_annotations(
                pod_id=name, namespace="default", scope_id=self.scope, deploy_ver=deploy_ver,
                pod_spec=spec,
            )
            if signed
            else {}
        )  # fmt: skip
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": notes},
            "spec": {"containers": [{"name": "agentserver", "image": image, "ports": [port]}]},
        }
        resp = await self.sim.post("/api/v1/namespaces/default/pods", json=body)
        assert resp.status_code == 201, resp.text
        if signed:
            uid = resp.json()["metadata"]["uid"]
            incarnation = E2E_IDENTITY.incarnation_annotations(
                uid=uid, identity=notes["agent-runtime/identity"]
            )
            patch = {"metadata": {"uid": uid, "annotations": incarnation}}
            resp = await self.sim.patch(
                f"/api/v1/namespaces/default/pods/{name}",
                json=patch,
                headers={"Content-Type": "application/merge-patch+json"},
            )
            assert resp.status_code == 200, resp.text

    async def kill(self, pod_id: str, mode: str) -> None:
        resp = await self.sim.post(f"/_sim/pods/default/{pod_id}/kill", json={"mode": mode})
        assert resp.status_code == 200, resp.text

    async def add_fault(self, **rule: Any) -> int:
        resp = await self.sim.post("/_sim/faults", json=rule)
        assert resp.status_code == 201, resp.text
        return int(resp.json()["id"])

    async def remove_fault(self, fault_id: int) -> None:
        assert (await self.sim.delete(f"/_sim/faults/{fault_id}")).status_code == 200

    async def sim_settings(self, **values: float) -> dict[str, Any]:
        resp = await self.sim.post("/_sim/settings", json=values)
        assert resp.status_code == 200, resp.text
        settings: dict[str, Any] = resp.json()
        return settings

    # --- Redis (contract §4 keys) ---

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1_000_000

    async def expiry(self, session_id: str) -> float:
        value = await self.redis.hget(sm_session(self.scope, self.sid(session_id)), "expiry")
        assert value is not None, f"session {session_id} has no binding"
        return float(value)

    async def set_expiry(self, session_id: str, expiry: float) -> None:
        """Move a session's expiry (hash and ZSET together) instead of waiting for it."""
        key = self.sid(session_id)
        await self.redis.hset(sm_session(self.scope, key), "expiry", f"{expiry:.6f}")
        await self.redis.zadd(sm_expiry(self.scope), {key: expiry})
        # as time passing would: the scope's expiry mark is due by then at the latest
        due = sm_bucket("expiry_due", bucket_of(self.scope))
        await self.redis.zadd(due, {self.scope: expiry}, lt=True)

    async def places(self, session_id: str, pod_id: str) -> list[bool]:
        """The four places of a live session (contract §4 invariant)."""
        key = self.sid(session_id)
        return [
            bool(await self.redis.exists(sm_session(self.scope, key))),
            await self.redis.zscore(sm_expiry(self.scope), key) is not None,
            bool(await self.redis.sismember(sm_scope(self.scope, "sessions"), key)),
            bool(await self.redis.sismember(sm_pod(self.scope, pod_id, "sessions"), key)),
        ]

    async def assert_live(self, session_id: str, pod_id: str) -> None:
        assert await self.places(session_id, pod_id) == [True] * 4, session_id
        binding = await self.redis.hgetall(sm_session(self.scope, self.sid(session_id)))
        assert binding["scope_id"] == self.scope and binding["pod_id"] == pod_id, binding

    def gone(self, session_id: str, pod_id: str) -> Callable[[], Awaitable[bool]]:
        """A check: the session left all four places."""

        async def check() -> bool:
            return await self.places(session_id, pod_id) == [False] * 4

        return check

    async def candidates(self) -> list[str]:
        return [str(p) for p in await self.redis.zrange(sm_scope(self.scope, "pods"), 0, -1)]

    async def warm(self) -> set[str]:
        return {str(p) for p in await self.redis.smembers(rm_scope(self.scope, "idle"))}

    async def live_sessions(self) -> set[str]:
        members = await self.redis.smembers(sm_scope(self.scope, "sessions"))
        return {str(s).removesuffix(f"-{self.tag}") for s in members}

    def waiting(self, n: int) -> Callable[[], Awaitable[bool]]:
        """A check: n routes hold a seat in the scope's queue."""

        async def check() -> bool:
            return int(await self.redis.zcard(sm_scope(self.scope, "waiters"))) == n

        return check

    async def pod_info(self, pod_id: str) -> dict[str, str]:
        return dict(await self.redis.hgetall(rm_pod(self.scope, pod_id, "info")))

    async def pod_known(self, pod_id: str) -> bool:
        """Registered on both sides."""
        return all(
            [
                await self.redis.sismember(sm_pods_registered(self.scope), pod_id),
                await self.redis.exists(sm_pod(self.scope, pod_id, "info")),
                await rm_pod_known(self.redis, pod_id),
                await self.redis.zscore(rm_scope(self.scope, "pods"), pod_id) is not None,
                (await self.pod_info(pod_id)).get("scope_id") == self.scope,
            ]
        )

    def forgotten(self, pod_id: str) -> Callable[[], Awaitable[bool]]:
        """A check: no key of either module names the pod any more."""

        async def check() -> bool:
            named = [
                await self.redis.sismember(sm_pods_registered(self.scope), pod_id),
                await self.redis.zscore(sm_scope(self.scope, "pods"), pod_id) is not None,
                await rm_pod_known(self.redis, pod_id),
                await self.redis.zscore(rm_scope(self.scope, "pods"), pod_id) is not None,
                await self.redis.sismember(rm_scope(self.scope, "idle"), pod_id),
            ]
            keys = [sm_pod(self.scope, pod_id, w) for w in ("info", "sessions", "idle_notified")]
            keys += [rm_pod(self.scope, pod_id, w) for w in ("info", "idle_since", "health_fails")]
            return not any(named) and not await self.redis.exists(*keys)

        return check

    async def assert_consistent(self) -> None:
        """The scope's live sessions are in their four places, each registered pod holds
        exactly its sessions, no limit is exceeded, and every pod Redis counts runs in
        Kubernetes."""
        config = await self.redis.hgetall(sm_scope(self.scope, "config"))
        sessions = await self.redis.smembers(sm_scope(self.scope, "sessions"))
        if config:
            assert len(sessions) <= int(config["scope_concurrency"])
        per_pod: dict[str, set[str]] = {}
        for key in sessions:
            pod_id = str(await self.redis.hget(sm_session(self.scope, key), "pod_id"))
            session_id = str(key).removesuffix(f"-{self.tag}")
            assert await self.places(session_id, pod_id) == [True] * 4, session_id
            per_pod.setdefault(pod_id, set()).add(key)
        for pod_id in await self.redis.smembers(sm_pods_registered(self.scope)):
            on_pod = await self.redis.smembers(sm_pod(self.scope, pod_id, "sessions"))
            assert on_pod == per_pod.pop(pod_id, set()), pod_id
            if config:
                assert len(on_pod) <= int(config["pod_concurrency"])
        assert per_pod == {}, f"sessions on unregistered pods: {per_pod}"
        pods = set(await self.redis.zrange(rm_scope(self.scope, "pods"), 0, -1))
        rm_config = await self.redis.hgetall(rm_scope(self.scope, "config"))
        deploying = await self.redis.scard(rm_scope(self.scope, "deploying"))
        assert len(pods) + deploying <= int(rm_config["max_pods"]), (pods, rm_config)
        assert pods <= await self.live_pods(), "Redis counts a pod Kubernetes does not run"

    async def forget_rm(self, pod_id: str) -> None:
        """Redis loses the resource manager's keys of one pod (the session side keeps its own)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(
                *(rm_pod(self.scope, pod_id, w) for w in ("info", "idle_since", "health_fails"))
            )
            pipe.hdel(rm_pods_index(pod_id), pod_id)
            pipe.zrem(rm_scope(self.scope, "pods"), pod_id)
            pipe.srem(rm_scope(self.scope, "idle"), pod_id)
            await pipe.execute()


@pytest.fixture
async def w(stack: Stack, request: pytest.FixtureRequest) -> AsyncIterator[Scenario]:
    if stack.server is not None:
        request.node.stash[_LOG_FROM] = (stack.server, stack.server.log_path.stat().st_size)
    letter = request.node.name.removeprefix("test_")[0]
    gateway = AsyncGatewayClient(
        stack.base_url,
        token=GATEWAY_TOKEN,
        deadline=DEADLINE,
        retry=RetryPolicy(max_attempts=1),
        trust_env=False,
    )
    async with (
        httpx.AsyncClient(base_url=stack.base_url, timeout=DEADLINE, trust_env=False) as http,
        httpx.AsyncClient(base_url=stack.sim_url, timeout=DEADLINE, trust_env=False) as sim,
        gateway,
    ):
        redis = Redis.from_url(stack.redis_url, decode_responses=True)
        scenario = Scenario(stack, http, sim, redis, letter, gateway)
        try:
            yield scenario
            if scenario.configured:  # no warm floor to refill, then the scope's pods go
                await scenario.update(min_idle_pods=0)
                resp = await scenario.cleanup(label_selector=f"{SCOPE_LABEL}={scenario.scope}")
                assert resp.status_code == 200, resp.text
        finally:
            await redis.aclose()


async def sse_events(url: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    """The first ``n`` events of an SSE stream, as the gateway would read them."""
    events: list[tuple[str, dict[str, Any]]] = []
    async with (
        asyncio.timeout(DEADLINE),
        httpx.AsyncClient(timeout=DEADLINE, trust_env=False) as client,
        client.stream("GET", url, headers={"accept": "text/event-stream"}) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = ""
        async for line in resp.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((event, json.loads(line.removeprefix("data: "))))
                if len(events) == n:
                    break
    return events


# ================================================================================================
# the process
# ================================================================================================


async def test_the_process_is_healthy_guarded_and_runs_its_jobs(w: Scenario) -> None:
    resp = await w.http.get("/healthz")
    assert resp.json() == {"ok": True, "instance_id": w.stack.instance_id}
    body = sync_body("template", "sync", {"template_id": "x", "image": "i"})
    for headers in ({}, GATEWAY):  # admin calls want the admin token
        assert_failure(await w.http.post(SYNC, json=body, headers=headers), 401, "UNAUTHORIZED")
    route = envelope(session_id="s", bot_id="b", extra={"group_id": "g"})
    for headers in ({}, ADMIN):  # the gateway's calls want a gateway token
        assert_failure(await w.http.post(ROUTE, json=route, headers=headers), 401, "UNAUTHORIZED")

    async def every_job_ticked() -> bool:
        jobs = ("sm_sweep", "rm_autoscale", "rm_reclaim", "rm_watch", "rm_reconcile")
        return all([await w.metric("agent_runtime_job_runs_total", job=j) >= 1 for j in jobs])

    await w.eventually(every_job_ticked, "every background job ticks in the server")


# ================================================================================================
# A — cold start
# ================================================================================================


async def test_a_cold_start_deploys_one_pod_whose_sse_url_streams(w: Scenario) -> None:
    await w.configure()
    assert await w.sim_pods() == {}

    data = await w.routed("s1")

    assert data["placement"] == "placed"
    pod_id = data["pod_id"]
    assert re.fullmatch(r"e2e-a-[a-z0-9]{10}-[a-z0-9]{5}", pod_id), pod_id
    pods = await w.sim_pods()
    assert list(pods) == [pod_id]
    pod = pods[pod_id]
    assert pod["phase"] == "Running" and pod["ready"] and not pod["deleting"]
    assert data["pod_sse_url"] == f"http://{pod['podIP']}:{w.stack.sse_port}/sse"
    version = await w.redis.hget(rm_scope(w.scope, "config"), "deploy_ver")
    assert pod["labels"] == {
        "jiuwenclaw-component": "agentserver",
        "app": pod_id,
        SCOPE_LABEL: w.scope,
        VERSION_LABEL: version,
    }
    spec = (await w.api_pod(pod_id))["spec"]
    assert spec["restartPolicy"] == "Always"
    probe = spec["containers"][0]["readinessProbe"]["httpGet"]
    assert probe == {"path": "/health", "port": w.stack.sse_port, "scheme": "HTTP"}
    await w.assert_live("s1", pod_id)
    assert await w.candidates() == [pod_id]
    info = await w.pod_info(pod_id)
    assert info["phase"] == "in_use" and info["pod_ip"] == pod["podIP"]
    assert info["pod_sse_url"] == data["pod_sse_url"] and info["namespace"] == "default"
    assert info["deploy_ver"] == version

    # the gateway's next hop: the pod's SSE stream answers and streams
    (hello, ping) = await sse_events(data["pod_sse_url"], 2)
    assert hello[0] == "hello" and hello[1]["pod"] == pod_id and hello[1]["path"] == "/sse"
    assert ping[0] == "ping"
    await w.assert_consistent()


async def test_a_a_cold_burst_fills_two_pods_and_never_more(w: Scenario) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)  # max_pods 2

    resps = await asyncio.gather(*(w.route(f"s{i}") for i in range(4)))

    assert [r.status_code for r in resps] == [200] * 4, [r.text for r in resps]
    placed = [r.json()["data"] for r in resps]
    assert {d["placement"] for d in placed} == {"placed"}
    pods = {d["pod_id"] for d in placed}
    assert len(pods) == 2 and await w.live_pods() == pods
    for pod_id in pods:
        assert await w.redis.scard(sm_pod(w.scope, pod_id, "sessions")) == 2
    assert await w.redis.scard(rm_scope(w.scope, "deploying")) == 0
    await w.assert_consistent()


async def test_a_b_a_failed_deploy_is_503_and_leaves_nothing_behind(w: Scenario) -> None:
    await w.configure()
    fault = await w.add_fault(kind="image_pull", labels=f"{SCOPE_LABEL}={w.scope}")
    try:
        resp = await w.route("s1")
        assert_failure(resp, 503, "NO_POD_AVAILABLE")
        assert_retry_after(resp)

        async def discarded() -> bool:
            return await w.sim_pods() == {}

        await w.eventually(discarded, "the pod that could not pull its image is deleted")
    finally:
        await w.remove_fault(fault)
    assert not await w.redis.exists(sm_session(w.scope, w.sid("s1")))
    assert await w.redis.scard(rm_scope(w.scope, "deploying")) == 0
    assert not [k async for k in w.redis.scan_iter(rm_deploy_lock(w.scope, "*"))]
    assert await w.waiting(0)() and await w.live_sessions() == set()
    # the image pulls again: the gateway's retry is served
    assert (await w.routed("s1"))["placement"] == "placed"
    await w.assert_consistent()


# ================================================================================================
# B — affinity
# ================================================================================================


async def test_b_same_session_same_pod_and_expiry_extended(w: Scenario) -> None:
    await w.configure(session_ttl=60)
    first = await w.routed("s1", w.rid("b1"))
    await w.set_expiry("s1", await w.now() + 5)

    again = await w.routed("s1")

    assert again == {**first, "placement": "refresh"}
    now = await w.now()
    assert now + 59 <= await w.expiry("s1") <= now + 60.5
    # the same request id within 60 s: the first answer again, nothing done
    assert await w.routed("s1", w.rid("b1")) == first
    assert await w.live_pods() == {first["pod_id"]}
    await w.assert_live("s1", first["pod_id"])
    await w.assert_consistent()


# ================================================================================================
# C — first-fit packing
# ================================================================================================


async def test_c_first_fit_fills_pod_one_then_deploys_pod_two(w: Scenario) -> None:
    await w.configure(scope_concurrency=6, pod_concurrency=2)  # max_pods 3
    pod1 = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == pod1
    pod2 = (await w.routed("s3"))["pod_id"]
    assert pod2 != pod1 and await w.live_pods() == {pod1, pod2}
    assert await w.candidates() == [pod1, pod2]  # arrival order

    # both have room: the first one in arrival order is filled first
    assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
    assert (await w.routed("s4"))["pod_id"] == pod1
    assert (await w.routed("s5"))["pod_id"] == pod2
    pod3 = (await w.routed("s6"))["pod_id"]
    assert pod3 not in (pod1, pod2) and await w.candidates() == [pod1, pod2, pod3]
    # slots free on pod 2, then on pod 1: still the first pod first
    for session_id in ("s3", "s2"):
        assert await w.touch(session_id, eos=True) == {"touched": True, "released": True}
    assert (await w.routed("s7"))["pod_id"] == pod1
    assert (await w.routed("s8"))["pod_id"] == pod2
    assert await w.live_pods() == {pod1, pod2, pod3}
    await w.assert_consistent()


# ================================================================================================
# D — expiry
# ================================================================================================


async def test_d_an_untouched_session_is_evicted_by_the_sweeper(w: Scenario) -> None:
    await w.configure(scope_concurrency=1, pod_concurrency=1, session_ttl=1)
    pod = (await w.routed("s1"))["pod_id"]

    # nobody touches s1: only the sweeper can evict it, a second after its last route
    await w.eventually(w.gone("s1", pod), "the sweeper evicts s1 after its session_ttl")

    assert await w.live_sessions() == set()
    s2 = await w.routed("s2")  # the slot is free again; the same pod, no deploy
    assert s2["placement"] == "placed" and s2["pod_id"] == pod
    assert await w.live_pods() == {pod}


# ================================================================================================
# E — touch
# ================================================================================================


async def test_e_touch_extends_ends_and_wakes_a_waiter(w: Scenario) -> None:
    await w.configure(scope_concurrency=2, pod_concurrency=2, session_ttl=60)
    pod = (await w.routed("s1"))["pod_id"]
    await w.set_expiry("s1", await w.now() + 5)
    assert await w.touch("s1") == {"touched": True}
    now = await w.now()
    assert now + 59 <= await w.expiry("s1") <= now + 60.5
    assert await w.touch("nobody") == {"touched": False}

    # expired: false (swept already, or lazily now), and gone
    await w.routed("s2")
    await w.set_expiry("s2", await w.now() - 1)
    assert await w.touch("s2") == {"touched": False}
    assert await w.gone("s2", pod)()

    # eos frees the slot and wakes a route waiting in the full scope
    await w.routed("s3")
    waiter = asyncio.create_task(w.route("s4"))
    await w.eventually(w.waiting(1), "s4 waits in the scope's queue")
    assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
    resp = await asyncio.wait_for(waiter, DEADLINE)
    assert resp.status_code == 200, resp.text
    assert resp.json()["data"]["placement"] == "placed"
    assert resp.json()["data"]["pod_id"] == pod
    assert await w.touch("s1", eos=True) == {"touched": False, "released": False}
    assert await w.live_sessions() == {"s3", "s4"}
    await w.assert_consistent()


# ================================================================================================
# F — scope full
# ================================================================================================


async def test_f_a_full_scope_queues_refuses_times_out_and_drops_the_disconnected(
    w: Scenario,
) -> None:
    await w.configure(scope_concurrency=1, pod_concurrency=1)  # queue: 2 × 1 seats
    await w.routed("s1")
    waiters = [asyncio.create_task(w.route(f"w{i}")) for i in (1, 2)]
    await w.eventually(w.waiting(2), "two routes wait")

    resp = await w.route("w3", w.rid("w3"))
    body = assert_failure(resp, 503, "SCOPE_QUEUE_FULL")
    assert body["request_id"] == w.rid("w3")
    assert_retry_after(resp)
    assert await w.waiting(2)(), "the refused route keeps no seat"

    # the waiters are served one by one as slots free
    for served in (1, 2):
        (session,) = await w.live_sessions()
        assert await w.touch(session, eos=True) == {"touched": True, "released": True}

        async def done(n: int = served) -> bool:
            return sum(t.done() for t in waiters) == n

        await w.eventually(done, f"{served} waiter(s) took a freed slot")
    for task in waiters:
        assert task.result().status_code == 200, task.result().text

    # no slot within scope_full_timeout: 504, and the seat is given back
    resp = await w.route("s4")
    assert_failure(resp, 504, "SCOPE_FULL_TIMEOUT")
    assert_retry_after(resp)
    assert await w.waiting(0)()
    assert not await w.redis.exists(sm_session(w.scope, w.sid("s4")))

    # a caller that goes away leaves the queue (the server answers it 499, nobody reads it)
    answered_499 = {"endpoint": ROUTE, "status": "499"}
    disconnected = await w.metric("agent_runtime_http_requests_total", **answered_499)
    gone = asyncio.create_task(w.route("s5"))
    await w.eventually(w.waiting(1), "s5 waits")
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone

    async def left() -> bool:
        return await w.metric("agent_runtime_http_requests_total", **answered_499) > disconnected

    await w.eventually(left, "the server notices the disconnect")
    assert await w.waiting(0)()
    await w.assert_consistent()


# ================================================================================================
# G — pod death
# ================================================================================================


async def test_g_a_pod_killed_in_kubernetes_is_cleaned_and_its_sessions_rebound(
    w: Scenario,
) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)
    dead = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == dead

    await w.kill(dead, "fail")  # phase Failed (evicted)

    await w.eventually(w.forgotten(dead), "watch forgets the dead pod")
    for session_id in ("s1", "s2"):
        assert await w.gone(session_id, dead)()

    async def deleted() -> bool:
        return dead not in await w.sim_pods()

    await w.eventually(deleted, "watch deletes the failed pod")
    r1 = await w.routed("s1")
    assert r1["placement"] == "rebound" and r1["previous_pod_id"] == dead
    new = r1["pod_id"]
    pods = await w.sim_pods()
    assert set(pods) == {new}
    assert r1["pod_sse_url"] == f"http://{pods[new]['podIP']}:{w.stack.sse_port}/sse"
    assert await w.routed("s2") == {**r1, "placement": "rebound"}
    assert (await w.routed("s1"))["placement"] == "refresh"
    await w.assert_consistent()


# ================================================================================================
# H — warm pool
# ================================================================================================


async def test_h_a_new_pod_is_taken_from_the_warm_pool(w: Scenario) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2, min_idle_pods=1)
    pod1 = (await w.routed("s1"))["pod_id"]

    async def floor_met() -> bool:
        return len(await w.warm()) == 1

    await w.eventually(floor_met, "autoscale deploys one warm pod")
    (warm,) = await w.warm()
    assert warm != pod1
    assert (await w.sim_pods())[warm]["ready"]
    assert (await w.pod_info(warm))["phase"] == "idle"
    assert await w.redis.exists(rm_pod(w.scope, warm, "idle_since"))
    assert await w.candidates() == [pod1], "a warm pod is no placement candidate"

    assert (await w.routed("s2"))["pod_id"] == pod1  # room on pod 1 first
    s3 = await w.routed("s3")  # a new pod is needed: the warm one

    assert s3["placement"] == "placed" and s3["pod_id"] == warm
    assert await w.live_pods() == {pod1, warm}, "no deploy"
    assert not await w.redis.exists(rm_pod(w.scope, warm, "idle_since"))
    assert (await w.pod_info(warm))["phase"] == "in_use"
    assert await w.candidates() == [pod1, warm]
    await w.assert_live("s3", warm)
    await w.assert_consistent()


async def test_h_a_route_that_needs_a_pod_while_the_warm_one_deploys_gets_it(
    w: Scenario,
) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)  # max_pods 2
    pod1 = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == pod1  # full
    await w.sim_settings(ready_delay=2.0)  # the warm pod takes a while to come up
    try:
        await w.update(min_idle_pods=1)

        async def warm_deploying() -> bool:
            return bool(await w.redis.scard(rm_scope(w.scope, "deploying")))

        await w.eventually(warm_deploying, "autoscale deploys a warm pod")
        # at max_pods (pod 1 + the warm deploy): the route waits for that pod, not 503
        s3 = await w.routed("s3")
    finally:
        await w.sim_settings(ready_delay=0.2)
    assert s3["placement"] == "placed" and s3["pod_id"] != pod1
    assert await w.live_pods() == {pod1, s3["pod_id"]}
    await w.assert_consistent()


# ================================================================================================
# I — idle transition
# ================================================================================================


async def test_i_an_empty_pod_goes_to_the_warm_pool_and_is_reused(w: Scenario) -> None:
    await w.configure(scope_concurrency=2, pod_concurrency=1)
    pod = (await w.routed("s1"))["pod_id"]
    assert await w.touch("s1", eos=True) == {"touched": True, "released": True}

    async def handed_back() -> bool:
        return await w.warm() == {pod}

    await w.eventually(handed_back, "the empty pod joins the warm pool")
    assert await w.candidates() == []
    assert await w.redis.exists(sm_pod(w.scope, pod, "idle_notified"))
    assert (await w.pod_info(pod))["phase"] == "idle"
    assert await w.live_pods() == {pod}

    s2 = await w.routed("s2")

    assert s2["placement"] == "placed" and s2["pod_id"] == pod
    assert await w.live_pods() == {pod}, "reused, not deployed"
    assert await w.candidates() == [pod] and await w.warm() == set()
    assert (await w.pod_info(pod))["phase"] == "in_use"
    await w.assert_live("s2", pod)
    await w.assert_consistent()


# ================================================================================================
# J — watch
# ================================================================================================


async def test_j_pods_deleted_behind_our_back_or_crash_looping_are_cleaned(w: Scenario) -> None:
    await w.configure(scope_concurrency=3, pod_concurrency=1)  # a pod per session
    removed = (await w.routed("s1"))["pod_id"]
    looping = (await w.routed("s2"))["pod_id"]
    healthy = (await w.routed("s3"))["pod_id"]

    await w.kill(removed, "vanish")  # someone else deleted it
    await w.kill(looping, "crash")  # CrashLoopBackOff

    for session_id, pod_id in (("s1", removed), ("s2", looping)):
        await w.eventually(w.forgotten(pod_id), f"watch forgets {pod_id}")
        assert await w.gone(session_id, pod_id)()

    async def deleted() -> bool:
        return looping not in await w.sim_pods()

    await w.eventually(deleted, "watch deletes the crash-looping pod")
    await w.assert_live("s3", healthy)
    assert await w.pod_known(healthy)
    assert await w.candidates() == [healthy]
    r1 = await w.routed("s1")
    assert r1["placement"] == "rebound" and r1["previous_pod_id"] == removed
    assert r1["pod_id"] not in (removed, looping, healthy)
    await w.assert_consistent()


async def test_j_cleanup_deletes_pods_in_kubernetes_and_watch_forgets_them(w: Scenario) -> None:
    await w.configure(scope_concurrency=2, pod_concurrency=1)
    first = (await w.routed("s1"))["pod_id"]
    second = (await w.routed("s2"))["pod_id"]
    # the operators' CLI first: its dry run lists exactly that pod and deletes nothing
    dry = await asyncio.to_thread(
        run_cli, "cleanup", "--dry-run", "--json", "-l", f"app={first}",
        url=w.stack.base_url, token=ADMIN_TOKEN,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout)
    assert listed["matched"] == 1 and [p["pod_id"] for p in listed["pods"]] == [first]
    assert listed["pods"][0]["scope_id"] == w.scope and listed["pods"][0]["phase"] == "Running"
    assert first in await w.sim_pods() and await w.live_pods() == {first, second}

    resp = await w.cleanup(label_selector=f"app={first}")

    assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 1}, resp.text
    await w.eventually(w.forgotten(first), "watch forgets the deleted pod")
    assert await w.gone("s1", first)()
    assert await w.live_pods() == {second}
    await w.assert_live("s2", second)
    for namespace in ("ghost", "locked"):  # allowed (AGENT_RUNTIME_NAMESPACES)
        item = {"template_id": f"{w.template_id}-{namespace}", "image": "agentserver:1"}
        await w.sync("template", "create", {**item, "namespace": namespace})
    resp = await w.cleanup(namespace="ghost")  # does not exist: nothing to delete
    assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}, resp.text
    fault = await w.add_fault(kind="namespace_forbidden", namespace="locked")
    try:
        body = assert_failure(await w.cleanup(namespace="locked"), 502, "K8S_ERROR")
        assert "403" in body["error_message"]
    finally:
        await w.remove_fault(fault)


# ================================================================================================
# K — reclaim
# ================================================================================================


async def test_k_warm_pods_above_the_floor_are_deleted_after_pod_ttl(w: Scenario) -> None:
    await w.configure(scope_concurrency=3, pod_concurrency=1)
    pods = {(await w.routed(f"s{i}"))["pod_id"] for i in (1, 2, 3)}
    change = await w.update(min_idle_pods=1, pod_ttl=1)
    assert change["change_class"] == "policy" and change["affected_scopes"] == 1
    for i in (1, 2, 3):
        assert await w.touch(f"s{i}", eos=True) == {"touched": True, "released": True}

    async def reclaimed() -> bool:  # idle for pod_ttl: all but the floor of one deleted
        return len(await w.live_pods()) == 1 and len(await w.warm()) == 1

    await w.eventually(reclaimed, "reclaim deletes the idle pods above the floor")
    (kept,) = await w.warm()
    assert kept in pods and await w.live_pods() == {kept}
    for pod_id in pods - {kept}:
        await w.eventually(w.forgotten(pod_id), f"{pod_id} is forgotten")
    assert await w.pod_known(kept)

    s4 = await w.routed("s4")
    assert s4["pod_id"] == kept and s4["placement"] == "placed"
    await w.assert_consistent()


# ================================================================================================
# L — reconcile
# ================================================================================================


async def test_l_reconcile_adopts_what_redis_lost_and_deletes_orphans(w: Scenario) -> None:
    await w.configure(scope_concurrency=2, pod_concurrency=1)  # max_pods 2
    busy = (await w.routed("s1"))["pod_id"]
    spare = (await w.routed("s2"))["pod_id"]
    assert await w.touch("s2", eos=True) == {"touched": True, "released": True}

    async def spare_warm() -> bool:
        return await w.warm() == {spare}

    await w.eventually(spare_warm, "the empty pod joins the warm pool")
    urls = {p: (await w.pod_info(p))["pod_sse_url"] for p in (busy, spare)}

    # Redis loses the resource manager's keys of both pods; Kubernetes still runs them
    for pod_id in (busy, spare):
        await w.forget_rm(pod_id)

    async def adopted() -> bool:
        return (await w.pod_info(busy)).get("phase") == "in_use" and await w.warm() == {spare}

    await w.eventually(adopted, "reconcile adopts the busy pod in use and the spare one warm")
    for pod_id in (busy, spare):
        assert await w.pod_known(pod_id)
        assert (await w.pod_info(pod_id))["pod_sse_url"] == urls[pod_id]
    assert await w.live_pods() == {busy, spare}
    assert (await w.routed("s1"))["placement"] == "refresh"

    # an orphan of ours in Kubernetes (signed as the service signs, the stack's secret), of a
    # version that is not current: deleted. A pod with the same labels that is not provably
    # ours (no identity, another image): left alone, and reported.
    orphan = f"e2e-l-{uuid.uuid4().hex[:10]}-orphn"
    await w.create_pod(orphan, "0000000000000000", image="old", signed=True)
    foreign = f"e2e-l-{uuid.uuid4().hex[:10]}-frgn0"
    await w.create_pod(foreign, "0000000000000000", image="attacker/agent", signed=False)

    async def orphan_deleted() -> bool:
        return orphan not in await w.sim_pods()

    await w.eventually(orphan_deleted, "reconcile deletes the orphan")
    assert not await rm_pod_known(w.redis, orphan)

    async def reported() -> bool:
        resp = await w.http.get("/api/session/admin/foreign_pods", headers=ADMIN)
        return foreign in {p["pod_id"] for p in resp.json()["data"]["pods"]}

    await w.eventually(reported, "the foreign pod in the admin view")
    assert foreign in await w.live_pods() and not await rm_pod_known(w.redis, foreign)

    # and the other way round: a pod Redis knows that Kubernetes lost is purged
    await w.kill(spare, "vanish")
    await w.eventually(w.forgotten(spare), "the vanished pod is purged")
    s2 = await w.routed("s2")
    assert s2["placement"] == "placed" and s2["pod_id"] not in (busy, spare)
    await w.assert_consistent()


# ================================================================================================
# M — config hot update
# ================================================================================================


async def test_m_deploy_change_sunsets_old_pods_policy_change_applies_next(w: Scenario) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)
    old = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == old
    old_ver = (await w.pod_info(old))["deploy_ver"]

    change = await w.update(image="agentserver:2")

    assert change["change_class"] == "deploy" and change["affected_scopes"] == 1
    assert await w.candidates() == [], "the old pod leaves the candidates at once"
    new_ver = await w.redis.hget(sm_scope(w.scope, "config"), "deploy_ver")
    assert new_ver and new_ver != old_ver
    assert await w.redis.hget(rm_scope(w.scope, "config"), "deploy_ver") == new_ver
    assert (await w.routed("s1"))["pod_id"] == old, "its sessions stay"
    s3 = await w.routed("s3")
    new = s3["pod_id"]
    assert s3["placement"] == "placed" and new != old
    assert (await w.sim_pods())[new]["labels"][VERSION_LABEL] == new_ver
    assert (await w.api_pod(new))["spec"]["containers"][0]["image"] == "agentserver:2"

    # another deploy change while the old pod still serves: refused, nothing changed
    busy = await w.update(image="agentserver:3", status=409)
    assert busy["error_code"] == "CONFIG_SYNC_BUSY"
    assert await w.redis.hget(sm_scope(w.scope, "config"), "deploy_ver") == new_ver

    # a policy change takes effect for the next route
    assert (await w.update(session_ttl=30))["change_class"] == "policy"
    assert (await w.routed("s4"))["pod_id"] == new
    assert await w.redis.hget(sm_session(w.scope, w.sid("s4")), "session_ttl") == "30"

    # the old pod's sessions end: it is handed back and, of an old version, deleted
    for session_id in ("s1", "s2"):
        assert await w.touch(session_id, eos=True) == {"touched": True, "released": True}
    await w.eventually(w.forgotten(old), "the sunset pod is reclaimed")
    assert old not in await w.live_pods()
    assert (await w.update(image="agentserver:3"))["change_class"] == "deploy"
    assert await w.candidates() == [], "now the version-2 pod is the sunset one"
    assert (await w.routed("s3"))["placement"] == "refresh"
    await w.assert_consistent()


# ================================================================================================
# N — half-dead pod
# ================================================================================================


async def test_n_a_pod_failing_health_is_cleaned_and_its_sessions_rebound(w: Scenario) -> None:
    await w.configure(scope_concurrency=4, pod_concurrency=2)
    sick = (await w.routed("s1"))["pod_id"]
    assert (await w.routed("s2"))["pod_id"] == sick

    fault = await w.add_fault(kind="health", mode="500", name=sick)  # Running, /health 500
    try:
        await w.eventually(w.forgotten(sick), "watch cleans the half-dead pod")

        async def deleted() -> bool:
            return sick not in await w.sim_pods()

        await w.eventually(deleted, "watch deletes it in Kubernetes")
    finally:
        await w.remove_fault(fault)
    for session_id in ("s1", "s2"):
        assert await w.gone(session_id, sick)()
        data = await w.routed(session_id)
        assert data["placement"] == "rebound" and data["previous_pod_id"] == sick
        assert data["pod_id"] != sick
    await w.assert_consistent()
