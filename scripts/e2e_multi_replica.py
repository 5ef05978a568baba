#!/usr/bin/env python3
"""Several replicas over one Redis, one DB and one (simulated) Kubernetes, end to end.

Starts the Kubernetes API simulator (``agent-runtime kubesim``) and N replicas of
``agent-runtime serve --mode server`` (real processes, real uvicorn), then checks what only a
multi-replica deployment can get wrong:

  cold_burst_one_deploy    a cold burst spread over the replicas deploys exactly one pod
  no_over_admission        1,000 concurrent routes never exceed scope/pod concurrency
  replay_across_replicas   a request_id answered by one replica is replayed by another
  config_propagation       a config change made on one replica is seen by the other's route
  jobs_single_leader       every job ticks on exactly one replica
  failover                 SIGKILL a replica: its jobs are taken over within two ticks, its
                           waiting client's seat is removed, nothing is leaked
  leader_killed            SIGKILL the replica leading a scope's cold deploy between its pod's
                           create and Ready: the scope serves again within the deploy time + the
                           lease, the dead leader's pod is adopted (or deleted), no pod, lock,
                           placeholder or seat is left once the load ends (--kill-runs times)
  drain                    SIGTERM a replica mid-load: every waiting route (queue, follower
                           room, shared acquire, own deploy) answered 503 + Retry-After at once,
                           exit 0 within shutdown_timeout, its job locks given back

Prints one line per check and ``N passed, M failed``; exits 1 if any failed, 2 if it could
not start. Redis is read to check invariants; a Redis db that holds keys other than this
service's is refused unless ``--allow-foreign-keys``. Every scope it uses is new (a run id),
so earlier runs do not matter; it deletes nothing but its own scopes' pods.

  .venv/bin/python scripts/e2e_multi_replica.py --env-file server.env --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from agent_runtime_client import (
    AgentRuntimeError,
    AsyncGatewayClient,
    GatewayClientError,
    RetryPolicy,
    Route,
    Unavailable,
    UnexpectedAnswer,
)

OUR_PREFIXES = ("session_manager:", "resource_manager:", "agent_runtime:")
SM, RM = "session_manager:", "resource_manager:resource:"


def deploy_locks(sid: str) -> str:
    """The pattern of a scope's cold deploys' locks (one per deploy: many at once)."""
    return f"resource_manager:lock:rm:deploy:{{{sid}}}:*"


JOBS = (
    "sm_sweep", "scope_expiry", "rm_autoscale", "rm_reclaim", "rm_watch", "rm_reconcile",
    "rm_drains",
)  # fmt: skip
JOB_INTERVAL = 1.0  # every job's tick in this run: "two ticks" below means 2 s
SHUTDOWN_TIMEOUT = 8.0
SCOPE_FULL_TIMEOUT = 2.0
KILL_READY_DELAY = 4.0  # kubesim's create → Ready while a deploy leader is killed
DRAIN_READY_DELAY = 3.0  # ... while a replica is stopped with deploys in flight
RESTING_READY_DELAY = 0.2
BIN = Path(sys.executable).parent


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


# --- processes -------------------------------------------------------------------------------


@dataclass
class Replica:
    index: int
    port: int
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def instance_id(self) -> str:
        return self.env["AGENT_RUNTIME_INSTANCE_ID"]

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(BIN / "agent-runtime"), "serve", "--mode", "server"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self, sig: int = signal.SIGTERM, wait: float = SHUTDOWN_TIMEOUT + 5) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


async def wait_healthy(client: httpx.AsyncClient, replica: Replica, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if replica.proc is not None and replica.proc.poll() is not None:
            tail = replica.log.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"replica {replica.index} exited:\n" + "\n".join(tail))
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(f"{replica.url}/healthz", timeout=1)).status_code == 200:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"replica {replica.index} not healthy within {within:g} s")


@contextlib.contextmanager
def kubesim(port: int, workdir: Path) -> Any:
    kubeconfig = workdir / "kubesim.kubeconfig"
    log = (workdir / "kubesim.log").open("wb")
    proc = subprocess.Popen(
        [str(BIN / "agent-runtime"), "kubesim", "--port", str(port),
         "--kubeconfig-out", str(kubeconfig), "--ready-delay", "0.2", "--grace-period", "0.3"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not kubeconfig.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "kubesim did not start: " + (workdir / "kubesim.log").read_text()
                )
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", kubeconfig
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# --- the service's API, as the gateway and the claw manager call it --------------------------


@dataclass(frozen=True)
class Answer:
    """A gateway call's outcome through the gateway's client: ``code`` is "OK", the error
    code (``HTTP_<status>`` for an answer that is no envelope) or, when no answer came, the
    transport error's class name."""

    code: str
    route: Route | None = None
    retry_after: float | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"


@dataclass
class Api:
    """The claw manager's calls over ``http``; the gateway's (route, eos) through the gateway's
    client, one per replica, retries off: each check sees what the replica answered."""

    http: httpx.AsyncClient
    admin_token: str | None
    gateway_token: str | None
    limits: httpx.Limits
    prefix: str = ""  # of every session and request id: runs never meet
    gateways: dict[str, AsyncGatewayClient] = field(default_factory=dict)

    def gateway(self, url: str) -> AsyncGatewayClient:
        if url not in self.gateways:
            self.gateways[url] = AsyncGatewayClient(
                url,
                token=self.gateway_token or "",
                deadline=SCOPE_FULL_TIMEOUT + 30,
                retry=RetryPolicy(max_attempts=1),
                limits=self.limits,
                trust_env=False,
            )
        return self.gateways[url]

    async def aclose(self) -> None:
        for client in self.gateways.values():
            await client.aclose()

    def rid(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def _auth(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def sync(self, url: str, kind: str, op: str, item: dict[str, Any]) -> httpx.Response:
        body = {"metadata": {"request_id": uuid.uuid4().hex}, "rawdata": {"kind": kind, "op": op,
                "item": item}}  # fmt: skip
        return await self.http.post(
            f"{url}/api/session/config_sync", json=body, headers=self._auth(self.admin_token)
        )

    async def route(
        self, url: str, scope: tuple[str, str], session_id: str, request_id: str | None = None
    ) -> Answer:
        try:
            route = await self.gateway(url).route(
                self.rid(session_id),
                scope[1],
                scope[0],
                request_id=self.rid(request_id or uuid.uuid4().hex),
            )
        except GatewayClientError as exc:  # every outcome is an answer the check judges
            return failed(exc)
        return Answer("OK", route)

    async def eos(self, url: str, session_id: str) -> Answer:
        try:
            ended = await self.gateway(url).end(self.rid(session_id))
        except GatewayClientError as exc:
            return failed(exc)
        return Answer("OK", text=f"touched={ended.touched} released={ended.released}")


def failed(exc: GatewayClientError) -> Answer:
    if isinstance(exc, AgentRuntimeError):
        return Answer(exc.code, retry_after=exc.retry_after, text=str(exc))
    if isinstance(exc, UnexpectedAnswer):
        return Answer(exc.code, text=f"{exc}: {exc.excerpt}")
    if isinstance(exc, Unavailable) and exc.cause is not None:
        return Answer(type(exc.cause).__name__, text=str(exc))
    return Answer(type(exc).__name__, text=str(exc))


def scope_id(scope: tuple[str, str]) -> str:
    """Contract: md5(group_id NUL bot_id)."""
    return hashlib.md5(f"{scope[0]}\x00{scope[1]}".encode()).hexdigest()


def code(answer: Answer | BaseException) -> str:
    return answer.code if isinstance(answer, Answer) else type(answer).__name__


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Run:
    api: Api
    redis: Redis
    replicas: list[Replica]
    sim_url: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    scopes: list[str] = field(default_factory=list)
    kill_runs: int = 1
    kill_ready_delay: float = KILL_READY_DELAY

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]

    async def scope(self, name: str, **limits: Any) -> tuple[str, str]:
        """A new template + rule for (group, bot) of this run, through the first replica."""
        group, bot = f"e2e-{self.run_id}", name
        tpl = {"template_id": f"e2e-{self.run_id}-{name}", "image": "agentserver:e2e",
               "ready_timeout": 20, "ready_poll_interval": 0.05, **limits}  # fmt: skip
        url = self.live()[0].url
        resp = await self.api.sync(url, "template", "create", tpl)
        expect(resp.status_code == 200, f"template create: {resp.text}")
        rule = {"group_id": group, "bot_id": bot, "template_id": tpl["template_id"]}
        resp = await self.api.sync(url, "routing_rule", "create", rule)
        expect(resp.status_code == 200, f"rule create: {resp.text}")
        self.scopes.append(scope_id((group, bot)))
        return group, bot

    async def creates(self) -> int:
        state = (await self.api.http.get(f"{self.sim_url}/_sim/state")).json()
        return int(state.get("requests", {}).get("create pods", 0))

    async def held(self, sid: str) -> dict[str, int]:
        """What a scope holds that must be given back: seats, reservations, followers,
        placeholders, the deploy lock."""
        r = self.redis
        seconds, micros = await r.time()
        now = seconds + micros / 1e6  # seats of a dead replica expire by score (lazily dropped)
        return {
            "waiters": int(await r.zcount(f"{SM}scope:{{{sid}}}:waiters", now, "+inf")),
            "reserved": int(await r.zcount(f"{SM}scope:{{{sid}}}:reserved", now, "+inf")),
            "followers": sum(
                [int(await r.zcount(room, now, "+inf")) for room in await self.rooms(sid)]
            ),
            "deploying": int(await r.scard(f"{RM}scope:{{{sid}}}:deploying")),
            "deploy_lock": len(await self.keys_like(deploy_locks(sid))),
        }

    async def keys_like(self, pattern: str) -> list[str]:
        return [k async for k in self.redis.scan_iter(match=pattern, count=1000)]

    async def rooms(self, sid: str) -> list[str]:
        """The scope's follower rooms: one per cold deploy."""
        return await self.keys_like(f"{RM}scope:{{{sid}}}:deploy_followers:*")

    async def leftovers(self, sid: str) -> dict[str, int]:
        """Every member a scope still holds, live or past its lease (the prune job removes
        those of a dead replica), the deploy lock and the dead leader's pod record."""
        r = self.redis
        return {
            "waiters": int(await r.zcard(f"{SM}scope:{{{sid}}}:waiters")),
            "reserved": int(await r.zcard(f"{SM}scope:{{{sid}}}:reserved")),
            "followers": sum([int(await r.zcard(room)) for room in await self.rooms(sid)]),
            "deploying": int(await r.scard(f"{RM}scope:{{{sid}}}:deploying")),
            "deploy_lock": len(await self.keys_like(deploy_locks(sid))),
            # an ended deploy's record names its pod for one lease, then lapses
            "deploy_pod": len(await self.keys_like(f"{RM}scope:{{{sid}}}:deploy_pod:*")),
            "cold_deploys": int(await r.zcard(f"{RM}scope:{{{sid}}}:cold_deploys")),
        }

    async def nothing_left(self, sid: str, within: float) -> None:
        deadline = time.monotonic() + within
        while any((left := await self.leftovers(sid)).values()):
            if time.monotonic() > deadline:
                raise CheckFailed(f"scope {sid} still holds {left} after {within:g} s")
            await asyncio.sleep(0.2)

    async def sim_pods(self, sid: str) -> list[dict[str, Any]]:
        """The scope's pods in the simulated cluster (not being deleted)."""
        state = (await self.api.http.get(f"{self.sim_url}/_sim/state")).json()
        return [
            p for p in state.get("pods", [])
            if p.get("labels", {}).get("agent-runtime/scope") == sid and not p.get("deleting")
        ]  # fmt: skip

    async def sim_ready_delay(self, seconds: float) -> None:
        resp = await self.api.http.post(
            f"{self.sim_url}/_sim/settings", json={"ready_delay": seconds}
        )
        expect(resp.status_code == 200, f"kubesim settings: {resp.text}")

    async def untracked_pods(self, sid: str) -> list[str]:
        # the scope's registered pods: its pool (redis-keys.md, resource:scope:{sid}:pods)
        known = set(await self.redis.zrange(f"{RM}scope:{{{sid}}}:pods", 0, -1))
        return [p["name"] for p in await self.sim_pods(sid) if p["name"] not in known]

    async def nothing_held(self, sid: str, within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            held = await self.held(sid)
            if not any(held.values()):
                return
            if time.monotonic() > deadline:
                raise CheckFailed(f"scope {sid} still holds {held} after {within:g} s")
            await asyncio.sleep(0.2)

    async def job_metrics(self, replica: Replica) -> dict[str, dict[str, float]]:
        text = (await self.api.http.get(f"{replica.url}/metrics")).text
        found: dict[str, dict[str, float]] = collections.defaultdict(dict)
        for line in text.splitlines():
            if line.startswith("agent_runtime_job_") and 'job="' in line:
                name, _, rest = line.partition("{")
                job = rest.split('job="', 1)[1].split('"', 1)[0]
                found[name][job] = float(line.rsplit(" ", 1)[1])
        return found

    async def leaders(self) -> dict[str, list[int]]:
        """job → indexes of the live replicas that lead it."""
        led: dict[str, list[int]] = {job: [] for job in JOBS}
        for replica in self.live():
            metrics = await self.job_metrics(replica)
            for job, value in metrics.get("agent_runtime_job_leader", {}).items():
                if value == 1.0:
                    led[job].append(replica.index)
        return led


async def check_cold_burst_one_deploy(run: Run) -> str:
    scope = await run.scope("cold", scope_concurrency=24, pod_concurrency=12)
    before = await run.creates()
    urls = [r.url for r in run.live()]
    answers = await asyncio.gather(
        *(run.api.route(urls[i % len(urls)], scope, f"cold-{i}") for i in range(12))
    )
    codes = collections.Counter(code(a) for a in answers)
    expect(codes == {"OK": 12}, f"cold burst: {codes}")
    pods = {a.route.pod_id for a in answers if a.route is not None}
    deploys = await run.creates() - before
    expect(len(pods) == 1 and deploys == 1, f"pods {pods}, creates {deploys}")
    await run.nothing_held(scope_id(scope), 5)
    return f"12 routes over {len(urls)} replicas → 1 deploy, 1 pod"


async def check_no_over_admission(run: Run) -> str:
    sc, pc, n = 20, 5, 1000
    scope = await run.scope("crowd", scope_concurrency=sc, pod_concurrency=pc)
    sid = scope_id(scope)
    urls = [r.url for r in run.live()]
    peaks = {"scope": 0, "pod": 0, "waiters": 0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            async with run.redis.pipeline(transaction=True) as pipe:
                pipe.scard(f"{SM}scope:{{{sid}}}:sessions")
                pipe.zcard(f"{SM}scope:{{{sid}}}:waiters")
                pipe.zrange(f"{SM}scope:{{{sid}}}:pods", 0, -1)
                scope_n, waiters, pods = await pipe.execute()
            peaks["scope"] = max(peaks["scope"], scope_n)
            peaks["waiters"] = max(peaks["waiters"], waiters)
            for pod in pods:
                on_pod = int(await run.redis.scard(f"{SM}pod:{{{sid}}}:{pod}:sessions"))
                peaks["pod"] = max(peaks["pod"], on_pod)
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    try:
        answers = await asyncio.gather(
            *(run.api.route(urls[i % len(urls)], scope, f"crowd-{i}") for i in range(n)),
            return_exceptions=True,
        )
    finally:
        done.set()
        await sampler
    codes = collections.Counter(code(a) for a in answers)
    expect(peaks["scope"] <= sc and peaks["pod"] <= pc, f"over the limits: {peaks}")
    expect(peaks["waiters"] <= 2 * sc, f"queue over 2 × scope_concurrency: {peaks}")
    expect(codes["OK"] == sc, f"the scope did not fill exactly: {codes}")
    # a thousand at once is past any replica's in-flight bound: the excess may be shed (OVERLOADED)
    allowed = {"OK", "SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT", "OVERLOADED"}
    expect(set(codes) <= allowed, f"unexpected outcomes: {codes}")
    expect(int(await run.redis.scard(f"{SM}scope:{{{sid}}}:sessions")) == sc, "sessions drifted")
    await run.nothing_held(sid, 8)
    return f"{n} routes: {dict(codes)}, peaks {peaks}"


async def check_replay_across_replicas(run: Run) -> str:
    live = run.live()
    expect(len(live) >= 2, "needs two replicas")
    scope = await run.scope("replay", scope_concurrency=4, pod_concurrency=4)
    first = await run.api.route(live[0].url, scope, "replay-s", "replay-r")
    again = await run.api.route(live[1].url, scope, "replay-s", "replay-r")
    expect(first.ok and first.route is not None, f"first: {first}")
    expect(again == first, f"{first} != {again}")
    expect(first.route is not None and first.route.placement == "placed", str(first))
    return "identical answer from the other replica"


async def check_config_propagation(run: Run) -> str:
    live = run.live()
    scope = await run.scope("conf", scope_concurrency=4, pod_concurrency=4, session_ttl=60)
    sid = scope_id(scope)
    expect((await run.api.route(live[1].url, scope, "conf-1")).ok, "route")
    tpl = {"template_id": f"e2e-{run.run_id}-conf", "session_ttl": 123}
    resp = await run.api.sync(live[0].url, "template", "update", tpl)
    expect(resp.status_code == 200, f"update: {resp.text}")
    expect((await run.api.route(live[1].url, scope, "conf-2")).ok, "route 2")
    ttl = str(await run.redis.hget(f"{SM}session:{{{sid}}}:{run.api.rid('conf-2')}", "session_ttl"))
    expect(ttl == "123", f"new session_ttl not seen: {ttl}")
    await run.nothing_held(sid, 5)
    return "session_ttl 60 → 123 on replica 0, used by replica 1's next route"


async def check_jobs_single_leader(run: Run) -> str:
    live = run.live()
    before = {r.index: await run.job_metrics(r) for r in live}
    await asyncio.sleep(3 * JOB_INTERVAL)
    after = {r.index: await run.job_metrics(r) for r in live}
    for job in JOBS:
        grew = [
            i for i in before
            if after[i]["agent_runtime_job_runs_total"].get(job, 0)
            > before[i]["agent_runtime_job_runs_total"].get(job, 0)
        ]  # fmt: skip
        expect(len(grew) == 1, f"{job} ticked on replicas {grew}")
    return f"each of {len(JOBS)} jobs ticked on one replica only"


async def check_failover(run: Run) -> str:
    """SIGKILL the replica that leads the most jobs while one of its clients waits."""
    led = await run.leaders()
    live = run.live()
    expect(len(live) >= 2, "needs two replicas")
    victim = max(live, key=lambda r: sum(r.index in v for v in led.values()))
    its_jobs = [job for job, who in led.items() if victim.index in who]
    scope = await run.scope("failover", scope_concurrency=1, pod_concurrency=1)
    sid = scope_id(scope)
    expect((await run.api.route(victim.url, scope, "fo-held")).ok, "held")
    waiting = asyncio.create_task(run.api.route(victim.url, scope, "fo-wait", "fo-wait-r"))
    deadline = time.monotonic() + 5
    while await run.redis.zscore(f"{SM}scope:{{{sid}}}:waiters", run.api.rid("fo-wait-r")) is None:
        expect(time.monotonic() < deadline, "the waiter never took its seat")
        await asyncio.sleep(0.05)
    killed_at = time.monotonic()
    victim.stop(signal.SIGKILL)
    with contextlib.suppress(Exception):
        await waiting  # the connection dies with the process
    # its jobs: taken over within two ticks after the lock's TTL (2 × interval)
    taken: dict[str, float] = {}
    while len(taken) < len(its_jobs) and time.monotonic() - killed_at < 4 * JOB_INTERVAL + 3:
        led = await run.leaders()
        for job in its_jobs:
            if job not in taken and led[job]:
                taken[job] = time.monotonic() - killed_at
        await asyncio.sleep(0.1)
    expect(len(taken) == len(its_jobs), f"jobs not taken over: {set(its_jobs) - set(taken)}")
    # its client's seat and marker lapse with the route lease; the prune job removes them
    await run.nothing_left(sid, 6)
    marker = str(await run.redis.get(f"{SM}route:{{{sid}}}:{run.api.rid('fo-wait-r')}") or "")
    expect(not marker.startswith("pending:"), f"pending marker left: {marker}")
    # the others carry on
    other = run.live()[0]
    expect((await run.api.eos(other.url, "fo-held")).ok, "eos on survivor")
    expect((await run.api.route(other.url, scope, "fo-next")).ok, "route")
    victim.start()  # as Kubernetes would restart it
    await wait_healthy(run.api.http, victim)
    slowest = max(taken.values(), default=0.0)
    return f"killed replica {victim.index}: {len(its_jobs)} jobs taken over ≤ {slowest:.1f} s"


async def check_leader_killed(run: Run) -> str:
    """SIGKILL the replica leading a scope's cold deploy between its pod's create and Ready,
    while the other replicas' routes of the scope wait on that deploy and more keep coming."""
    live = run.live()
    expect(len(live) >= 2, "needs two replicas")
    victim, others = live[-1], live[:-1]
    took: list[float] = []
    fates: collections.Counter[str] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    for n in range(run.kill_runs):
        await run.sim_ready_delay(run.kill_ready_delay)
        try:
            seconds, fate, answered = await kill_the_leader_once(run, victim, others, n)
        finally:
            await run.sim_ready_delay(RESTING_READY_DELAY)
            victim.start()  # as Kubernetes would restart it
            await wait_healthy(run.api.http, victim)
        took.append(seconds)
        fates[fate] += 1
        codes.update(answered)
    times = ", ".join(f"{t:.1f}" for t in took)
    return (
        f"served again {times} s after the kill (create→Ready {run.kill_ready_delay:g} s); "
        f"dead leader's pod {dict(fates)}; answers {dict(codes)}; nothing left"
    )


async def kill_the_leader_once(
    run: Run, victim: Replica, others: list[Replica], n: int
) -> tuple[float, str, collections.Counter[str]]:
    scope = await run.scope(f"killed{n}", scope_concurrency=8, pod_concurrency=4)
    sid = scope_id(scope)
    lead = asyncio.create_task(run.api.route(victim.url, scope, f"k{n}-lead"))
    deadline = time.monotonic() + 15
    while not ((locks := await run.keys_like(deploy_locks(sid))) and await run.sim_pods(sid)):
        expect(time.monotonic() < deadline, "the victim never created its pod")
        await asyncio.sleep(0.02)
    token = str(await run.redis.get(locks[0]))
    expect(token.startswith(f"{victim.instance_id}/"), f"the deploy is led by {token}")
    created = (await run.sim_pods(sid))[0]
    expect(not created["ready"], "the pod was Ready before the kill")
    sessions: list[str] = []
    waiting: list[asyncio.Task[Answer]] = []

    def route_on(replica: Replica, session: str) -> None:
        sessions.append(session)
        waiting.append(asyncio.create_task(run.api.route(replica.url, scope, session)))

    for i, replica in enumerate(others):
        route_on(replica, f"k{n}-wait-{i}")
    while not await run.rooms(sid):
        expect(time.monotonic() < deadline, "no route followed the victim's deploy")
        await asyncio.sleep(0.02)
    killed_at = time.monotonic()
    victim.stop(signal.SIGKILL)
    with contextlib.suppress(Exception):
        await lead  # its connection dies with the process
    # the load goes on on the other replicas (the gateway retries there): a new session every
    # 0.3 s, until one is served
    served_at: float | None = None
    i = 0
    while served_at is None:
        for task in waiting:
            if task.done() and not task.exception() and task.result().ok:
                served_at = time.monotonic()
        expect(time.monotonic() - killed_at < 40, "the scope never served again")
        if served_at is None and time.monotonic() - killed_at >= 0.3 * i:
            route_on(others[i % len(others)], f"k{n}-load-{i}")
            i += 1
        await asyncio.sleep(0.02)
    answers = await asyncio.gather(*waiting, return_exceptions=True)
    codes = collections.Counter(code(a) for a in answers)
    expect(not any(c.startswith("HTTP_") for c in codes), f"answers without an envelope: {codes}")
    placed = {
        session: a.route.pod_id
        for session, a in zip(sessions, answers, strict=True)
        if isinstance(a, Answer) and a.route is not None
    }
    fate = "adopted" if created["name"] in placed.values() else "replaced"
    if fate == "adopted":  # signed for its incarnation (by its leader, or by the taker)
        pods = {p["name"]: p for p in await run.sim_pods(sid)}
        adopted = pods.get(created["name"], {})
        expect(adopted.get("uid") == created["uid"], "the adopted pod is the one created")
        notes = adopted.get("annotations", {})
        expect(
            "agent-runtime/identity" in notes and "agent-runtime/incarnation" in notes,
            f"the adopted pod is not signed for its incarnation: {sorted(notes)}",
        )
    # the load ends: every session ends; nothing of the deploy, of the dead replica or of the
    # load may be left, and every pod of the scope is one Redis knows
    for session in placed:
        await run.api.eos(others[0].url, session)
    await run.nothing_left(sid, 8)
    untracked = await run.untracked_pods(sid)
    expect(not untracked, f"pods nobody tracks: {untracked}")
    return served_at - killed_at, fate, codes


async def check_drain(run: Run) -> str:
    """SIGTERM a replica while its routes wait in every way a route can wait: in the queue,
    in the follower room of another replica's deploy, sharing an acquire, on its own deploy.
    Each is answered 503 + Retry-After at once; the deploys finish (their pods kept) or clean
    up; exit 0 within shutdown_timeout; nothing held."""
    live = run.live()
    expect(len(live) >= 2, "needs two replicas")
    victim, other = live[-1], live[0]
    scope = await run.scope("drain", scope_concurrency=2, pod_concurrency=2)
    sid = scope_id(scope)
    for i in range(2):
        expect((await run.api.route(victim.url, scope, f"dr-held-{i}")).ok, "h")
    waiting: dict[str, asyncio.Task[Answer]] = {}

    def start(replica: Replica, target: tuple[str, str], name: str) -> None:
        waiting[name] = asyncio.create_task(run.api.route(replica.url, target, name, f"{name}-r"))

    for i in range(3):
        start(victim, scope, f"dr-queued-{i}")
    deadline = time.monotonic() + 5
    while int(await run.redis.zcard(f"{SM}scope:{{{sid}}}:waiters")) < 3:
        expect(time.monotonic() < deadline, "the waiters never took their seats")
        await asyncio.sleep(0.05)
    # deploys in flight: the other replica leads one the victim follows; the victim leads one
    await run.sim_ready_delay(DRAIN_READY_DELAY)
    try:
        follow = await run.scope("drain-follow", scope_concurrency=4, pod_concurrency=2)
        own = await run.scope("drain-own", scope_concurrency=4, pod_concurrency=2)
        deploy_of = {s: deploy_locks(scope_id(s)) for s in (follow, own)}
        start(other, follow, "dr-leader-elsewhere")
        start(victim, own, "dr-own-deploy")
        await wait_for_keys(run, list(deploy_of.values()), "the two deploys never started")
        start(victim, follow, "dr-follower")
        await wait_for_keys(
            run, [f"{RM}scope:{{{scope_id(follow)}}}:deploy_followers:*"], "nobody followed"
        )
        start(victim, follow, "dr-shared-follow")
        start(victim, own, "dr-shared-own")
        await asyncio.sleep(0.3)  # they reach their acquires (shared in process, no key)
        assert victim.proc is not None
        signalled = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        on_victim = [n for n in waiting if n != "dr-leader-elsewhere"]
        answered: dict[str, float] = {}

        async def timed(name: str) -> Answer:
            answer = await waiting[name]
            answered[name] = time.monotonic() - signalled
            return answer

        answers = await asyncio.gather(*(timed(n) for n in on_victim), return_exceptions=True)
    finally:
        await run.sim_ready_delay(RESTING_READY_DELAY)
    codes = collections.Counter(code(a) for a in answers)
    expect(codes == {"BACKEND_UNAVAILABLE": len(on_victim)}, f"waiting routes got {codes}")
    for answer in answers:
        assert isinstance(answer, Answer)
        expect(answer.retry_after == 1, f"no Retry-After: {answer}")
    slowest = max(answered.values())
    expect(slowest < 2.0, f"answered {slowest:.2f} s after the signal: {answered}")
    try:
        status = await asyncio.to_thread(victim.proc.wait, SHUTDOWN_TIMEOUT + 3)
    except subprocess.TimeoutExpired:
        raise CheckFailed("not stopped within shutdown_timeout") from None
    took = time.monotonic() - signalled
    expect(status == 0, f"exit status {status}")
    elsewhere = await waiting["dr-leader-elsewhere"]
    expect(elsewhere.ok, f"the other replica's deploy: {elsewhere}")
    for target in (scope, follow, own):
        await run.nothing_held(scope_id(target), 6)
        untracked = await run.untracked_pods(scope_id(target))
        expect(not untracked, f"a pod of an interrupted deploy leaked: {untracked}")
    locks = [j for j in JOBS if await run.redis.exists(f"agent_runtime:job:{j}")]
    led = await run.leaders()
    expect(all(led[j] for j in locks), f"job locks left behind: {locks} (leaders {led})")
    return (
        f"{len(on_victim)} waiting routes (queue, follower room, shared acquires, own deploy) "
        f"answered 503 within {slowest * 1000:.0f} ms of SIGTERM, exit 0 after {took:.1f} s"
    )


async def wait_for_keys(run: Run, patterns: list[str], what: str, within: float = 10) -> None:
    """Until a key matches each pattern."""
    deadline = time.monotonic() + within
    while not all([await run.keys_like(p) for p in patterns]):
        expect(time.monotonic() < deadline, what)
        await asyncio.sleep(0.02)


CHECKS: list[tuple[str, Callable[[Run], Awaitable[str]]]] = [
    ("cold_burst_one_deploy", check_cold_burst_one_deploy),
    ("no_over_admission", check_no_over_admission),
    ("replay_across_replicas", check_replay_across_replicas),
    ("config_propagation", check_config_propagation),
    ("jobs_single_leader", check_jobs_single_leader),
    ("failover", check_failover),
    ("leader_killed", check_leader_killed),
    ("drain", check_drain),
]


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip("'\"")
    return values


async def foreign_keys(redis: Redis) -> list[str]:
    found = []
    async for key in redis.scan_iter(count=1000):
        if not key.startswith(OUR_PREFIXES):
            found.append(key)
            if len(found) >= 5:
                break
    return found


@contextlib.asynccontextmanager
async def deployment(args: argparse.Namespace, workdir: Path) -> AsyncIterator[Run]:
    settings = read_env_file(Path(args.env_file))
    redis_url = settings.get("AGENT_RUNTIME_REDIS_URL")
    if not redis_url:
        raise RuntimeError("the env file sets no AGENT_RUNTIME_REDIS_URL")
    redis: Redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        foreign = await foreign_keys(redis)
        if foreign and not args.allow_foreign_keys:
            raise RuntimeError(
                f"Redis {redis_url} holds keys that are not this service's ({foreign[:3]}…); "
                "use a db of its own or --allow-foreign-keys"
            )
        upgrade = await asyncio.to_thread(
            subprocess.run,
            [str(BIN / "agent-runtime"), "db", "upgrade", "--env-file", args.env_file],
            capture_output=True,
            text=True,
        )
        if upgrade.returncode != 0:
            raise RuntimeError(f"db upgrade failed: {upgrade.stderr.strip()}")
        with kubesim(args.kubesim_port, workdir) as (sim_url, kubeconfig):
            base = {**os.environ, **settings}
            base.update({
                "AGENT_RUNTIME_MODE": "server",
                "AGENT_RUNTIME_KUBECONFIG": str(kubeconfig),
                "AGENT_RUNTIME_SCOPE_FULL_TIMEOUT": str(SCOPE_FULL_TIMEOUT),
                "AGENT_RUNTIME_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT),
                "AGENT_RUNTIME_JOBS_ENABLED": "true",
                **{f"AGENT_RUNTIME_{j}_INTERVAL": str(JOB_INTERVAL) for j in (
                    "SWEEP", "SCOPE_EXPIRY", "AUTOSCALE", "RECLAIM", "WATCH", "RECONCILE")},
            })  # fmt: skip
            replicas = []
            for i in range(args.replicas):
                env = dict(base, AGENT_RUNTIME_PORT=str(args.first_port + i),
                           AGENT_RUNTIME_INSTANCE_ID=f"e2e-replica-{i}",
                           AGENT_RUNTIME_HOST="127.0.0.1")  # fmt: skip
                replicas.append(Replica(i, args.first_port + i, env, workdir / f"replica-{i}.log"))
            # idle connections expire before the server's keep-alive timeout (5 s): one reused
            # just as the server closed it was a ReadError (a gateway must do the same)
            limits = httpx.Limits(
                max_connections=1200, max_keepalive_connections=200, keepalive_expiry=2.0
            )
            async with httpx.AsyncClient(limits=limits, timeout=30) as http:
                tokens = settings.get("AGENT_RUNTIME_ADMIN_TOKENS", "").split(",")
                gateway = settings.get("AGENT_RUNTIME_GATEWAY_TOKENS", "").split(",")
                api = Api(http, tokens[0] or None, gateway[0] or None, limits)
                try:
                    for replica in replicas:
                        replica.start()
                    for replica in replicas:
                        await wait_healthy(http, replica)
                    run = Run(
                        api,
                        redis,
                        replicas,
                        sim_url,
                        kill_runs=args.kill_runs,
                        kill_ready_delay=args.kill_ready_delay,
                    )
                    api.prefix = f"e2e-{run.run_id}-"
                    yield run
                finally:
                    await api.aclose()
                    for replica in replicas:
                        replica.stop()
    finally:
        await redis.aclose()


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="e2e-multi-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            async with deployment(args, workdir) as run:
                passed = failed = 0
                for name, check in CHECKS:
                    if args.only and name not in args.only:
                        continue
                    started = time.monotonic()
                    try:
                        detail = await check(run)
                    except Exception as exc:  # a check that breaks is a failed check
                        failed += 1
                        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                    else:
                        passed += 1
                        took = time.monotonic() - started
                        print(f"ok   {name} ({took:.1f} s): {detail}", flush=True)
                print(f"{passed} passed, {failed} failed")
                if failed:
                    print(f"logs: {workdir}" if args.workdir else "(--workdir keeps the logs)")
                return 1 if failed else 0
        except RuntimeError as exc:
            print(f"e2e_multi_replica: cannot start: {exc}", file=sys.stderr)
            return 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-file", required=True, help="server-mode settings (Redis, DB)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--first-port", type=int, default=18091)
    parser.add_argument("--kubesim-port", type=int, default=18001)
    parser.add_argument("--workdir", help="keep logs and the kubeconfig here")
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument(
        "--kill-runs", type=int, default=1, help="how often leader_killed kills a leader"
    )
    parser.add_argument(
        "--kill-ready-delay",
        type=float,
        default=KILL_READY_DELAY,
        help="kubesim's create → Ready (s) while leader_killed kills the leader",
    )
    parser.add_argument("--allow-foreign-keys", action="store_true")
    args = parser.parse_args()
    if args.replicas < 2:
        parser.error("--replicas must be at least 2")
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
