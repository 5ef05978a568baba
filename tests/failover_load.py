"""A Sentinel failover under a gateway's load, measured: what ``test_sentinel_failover.py``
asserts on and ``bench/failover.py`` counts over many failovers.

The service: ``replicas`` apps (``helpers.running_app``), each over a Redis client of its own
built as the service builds it from a ``redis+sentinel://`` URL, one SQLite config database
and one fake Kubernetes. The load: ``gateways`` tasks, each a gateway's view of one
conversation at a time — route a new session, then refresh routes and touches on it, then
``eos`` — on a replica taken at random per call, over ``scopes`` scopes whose
``scope_concurrency`` / ``pod_concurrency`` are small, so the queue and the caps are in play.
Each task keeps what the service told it (the session's pod) and judges every answer.

The failover: ``SENTINEL FAILOVER <master>`` on a sentinel. The sentinels promote the replica,
then turn the old master into a replica of it; writes the old master took after the last byte
its replica received, and until it was turned, are gone (asynchronous replication). Such a
lost write can make an answer the gateway already has untrue: a placement forgotten (the next
route answers ``placed`` again, a touch ``touched: false``), an ``eos`` undone (the session is
back), a pod's registration gone. They are counted, never asserted. What Redis holds must still
be consistent (each script is atomic and a replica holds a prefix of the master's writes:
caps hold, every session is in its four places), every answer is a contract answer, no answer
names a pod that does not exist, and a session that had no call in flight while the failover
ran (its *exposure*: from ``EXPOSURE_MARGIN`` s before the command to the old master's
demotion) keeps its binding: those are asserted by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.asyncio import Redis
from sqlalchemy import create_engine

import invariants
from agent_runtime import redis_client
from agent_runtime.db import schema
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import Services, build_redis
from contract_keys import sm_scope
from helpers import envelope, make_settings, running_app, sync_body

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
# a write may be lost if it reached the old master after the last byte its replica got: the
# replica lags by far less than this on loopback, even on a loaded machine
EXPOSURE_MARGIN = 1.0
# contract refusals (docs/reference/api.md): each carries retry_after and its header
REFUSALS = {
    "BACKEND_UNAVAILABLE": 503,
    "SCOPE_QUEUE_FULL": 503,
    "NO_POD_AVAILABLE": 503,
    "OVERLOADED": 503,
    "SCOPE_FULL_TIMEOUT": 504,
}


@dataclass(frozen=True)
class Shape:
    replicas: int = 2
    gateways: int = 30
    scopes: int = 3
    scope_concurrency: int = 4
    pod_concurrency: int = 2
    scope_full_timeout: float = 5.0
    redis_timeout: float = 2.0
    # short, so that a seat a lost eos left (the session is back) frees within seconds; the
    # gateway refreshes or touches its session every few tens of milliseconds
    session_ttl: int = 10
    # AGENT_RUNTIME_REDIS_WAIT_REPLICAS / _TIMEOUT_MS: WAIT after a binding and a registration
    wait_replicas: int = 0
    wait_timeout_ms: int = 50


# --- the Sentinel set ------------------------------------------------------------------------


@dataclass
class Failover:
    """One forced failover, times in ``time.monotonic()``."""

    old: tuple[str, int]
    new: tuple[str, int] | None = None
    commanded: float = 0.0
    promoted: float = 0.0  # the new master answers ROLE master
    named: float = 0.0  # every sentinel names it
    demoted: float = 0.0  # the old master answers ROLE slave
    promoted_at_offset: int = 0  # the replication offset the new master took over at
    old_last_offset: int = 0  # the old master's offset when last seen a master

    @property
    def lost_bytes(self) -> int:
        """The replication stream the old master wrote after the promotion: lost (writes,
        and the sentinels' hello messages, a few hundred bytes every 2 s)."""
        return max(0, self.old_last_offset - self.promoted_at_offset)


class SentinelSet:
    """The sentinels of a ``redis+sentinel://`` URL, and the data servers they name."""

    def __init__(self, url: str) -> None:
        target = redis_client.parse(url)
        self.master = target.master
        self.errors: list[str] = []  # what the sentinels answered instead of an address
        self.sentinels = [
            Redis(host=h, port=p, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)
            for h, p in target.nodes
        ]

    async def aclose(self) -> None:
        for s in self.sentinels:
            await s.aclose()

    async def named(self) -> set[tuple[str, int]]:
        """The master each answering sentinel names."""
        out = set()
        for s in self.sentinels:
            try:
                reply = await s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master)
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if reply:
                out.add((str(reply[0]), int(reply[1])))
        return out

    async def ready(self, within: float = 60.0) -> tuple[str, int]:
        """Wait until the sentinels agree on a master whose replica is in sync and known to
        them (a forced failover has somewhere to go); its address."""
        deadline = time.monotonic() + within
        last = ""
        while time.monotonic() < deadline:
            named = await self.named()
            if len(named) == 1:
                addr = next(iter(named))
                if await self._replica_ready(addr):
                    return addr
                last = f"master {addr}: no replica in sync known to every sentinel"
            else:
                last = f"the sentinels name {named}"
            await asyncio.sleep(0.1)
        raise TimeoutError(f"sentinel set {self.master} not ready within {within} s: {last}")

    async def _replica_ready(self, addr: tuple[str, int]) -> bool:
        client = Redis(host=addr[0], port=addr[1], decode_responses=True, socket_timeout=2)
        try:
            info = await client.info("replication")
        except Exception:
            return False
        finally:
            await client.aclose()
        if info.get("role") != "master" or not int(info.get("connected_slaves", 0)):
            return False
        replica = info.get("slave0", {})
        if not isinstance(replica, dict) or replica.get("state") != "online":
            return False
        for s in self.sentinels:
            try:
                replicas = await s.execute_command("SENTINEL", "REPLICAS", self.master)
            except Exception:
                return False
            good = [
                r
                for r in replicas
                if _flags(r) == {"slave"} and _field(r, "master-link-status") == "ok"
            ]
            if not good:
                return False
        return True

    async def failover(self, within: float = 30.0) -> Failover:
        """Force one failover and follow it to its end (old master demoted), reading both
        servers' replication offsets: what the old master took after the promotion is lost."""
        old = await self.ready()
        old_client = _direct(old)
        try:
            replica = (await old_client.info("replication"))["slave0"]
            fo = Failover(old, (str(replica["ip"]), int(replica["port"])))
            new_client = _direct(fo.new)
            try:
                await self._force(fo, old_client, new_client, within)
            finally:
                await new_client.aclose()
        finally:
            await old_client.aclose()
        return fo

    async def _force(self, fo: Failover, old: Redis, new: Redis, within: float) -> None:
        deadline = time.monotonic() + within
        fo.commanded = time.monotonic()
        while True:
            try:
                await self.sentinels[0].execute_command("SENTINEL", "FAILOVER", self.master)
                break
            except Exception as exc:  # INPROG, NOGOODSLAVE: the set is not there yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SENTINEL FAILOVER refused: {exc}") from exc
                await asyncio.sleep(0.1)
                fo.commanded = time.monotonic()
        while not (fo.promoted and fo.named and fo.demoted):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"failover of {self.master} not done within {within} s: {fo} "
                    f"(sentinel errors: {self.errors[-3:]})"
                )
            now = time.monotonic()
            with contextlib.suppress(Exception):
                info = await new.info("replication")
                if not fo.promoted and info.get("role") == "master":
                    fo.promoted = now
                    fo.promoted_at_offset = int(info.get("second_repl_offset", 0))
            with contextlib.suppress(Exception):
                info = await old.info("replication")
                if info.get("role") == "master":
                    fo.old_last_offset = int(info.get("master_repl_offset", 0))
                elif not fo.demoted:
                    fo.demoted = now
            if not fo.named and await self.named() == {fo.new}:
                fo.named = now
            await asyncio.sleep(0.01)


def _direct(addr: tuple[str, int] | None) -> Redis:
    assert addr is not None
    return Redis(host=addr[0], port=addr[1], decode_responses=True, socket_timeout=2)


def _pairs(row: Any) -> dict[str, str]:
    if isinstance(row, dict):
        return {str(k): str(v) for k, v in row.items()}
    return {str(row[i]): str(row[i + 1]) for i in range(0, len(row) - 1, 2)}


def _flags(row: Any) -> set[str]:
    return set(_pairs(row).get("flags", "").split(","))


def _field(row: Any, name: str) -> str:
    return _pairs(row).get(name, "")


# --- the gateway's record --------------------------------------------------------------------


@dataclass
class Call:
    kind: str  # route_new | route | touch | eos
    session_id: str
    scope_id: str
    replica: int
    started: float
    ended: float
    status: int
    code: str  # OK or the error_code
    placement: str = ""
    pod_id: str = ""
    note: str = ""  # what the answer says about the gateway's knowledge (see ``Gateway``)


@dataclass
class Session:
    session_id: str
    scope_id: str
    pod_id: str = ""  # the pod the last answer named
    certain: bool = False  # the last answer about the binding was a success
    ended: bool = False  # an eos answered released (or found nothing)
    calls: list[Call] = field(default_factory=list)


@dataclass
class Record:
    calls: list[Call] = field(default_factory=list)
    sessions: dict[str, Session] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)  # answers outside the contract, phantom pods
    anomalies: list[tuple[Session, Call]] = field(default_factory=list)


class Gateway:
    """The load: tasks that each carry one conversation at a time and judge the answers.

    Notes on a success that contradicts what the gateway was told before (``Call.note``):
    ``binding_lost`` (a refresh route answered ``placed``/``rebound``, a touch ``touched:
    false``, an eos ``released: false``), ``wrong_pod`` (``refresh`` on another pod). After a
    failed call the gateway is no longer sure (``certain`` False) and judges nothing until the
    next success."""

    def __init__(
        self, apps: list[httpx.AsyncClient], k8s: FakeK8sPodClient, scopes: list[tuple[str, str]]
    ) -> None:
        self.apps = apps
        self.k8s = k8s
        self.scopes = scopes  # (group_id, bot_id)
        self.record = Record()
        self.stop = asyncio.Event()
        self._rng = random.Random(1234)

    async def run(self, tasks: int) -> None:
        await asyncio.gather(*(self._task(i) for i in range(tasks)))

    async def _task(self, index: int) -> None:
        group, bot = self.scopes[index % len(self.scopes)]
        while not self.stop.is_set():
            session = Session(f"gw{index}-{uuid.uuid4().hex[:10]}", scope_id_of(group, bot))
            self.record.sessions[session.session_id] = session
            # a refused route is tried again for the same conversation (a new request id),
            # and so is a refused eos: the gateway never leaves a session it may hold behind
            while (await self.call(session, "route_new", group, bot)).code != "OK":
                if self.stop.is_set():
                    return
                await asyncio.sleep(0.05)  # a gateway's pause before it tries again (load only)
            for _ in range(self._rng.randint(4, 30)):
                if self.stop.is_set():
                    break
                kind = self._rng.choice(("route", "touch"))
                await self.call(session, kind, group, bot)
                await asyncio.sleep(self._rng.uniform(0.005, 0.03))
            while (await self.call(session, "eos", group, bot)).code != "OK":
                if self.stop.is_set():
                    return
                await asyncio.sleep(0.05)

    async def call(self, session: Session, kind: str, group: str, bot: str) -> Call:
        replica = self._rng.randrange(len(self.apps))
        app = self.apps[replica]
        if kind in ("route_new", "route"):
            body = envelope(
                request_id=f"r-{uuid.uuid4().hex}",
                session_id=session.session_id,
                bot_id=bot,
                extra={"group_id": group},
            )
            path = ROUTE
        else:
            # as the API reference tells a gateway: the ids on touch too (one EVALSHA on the
            # scope's node; a touch without them reads the session-scope index, written after
            # the route's reply and delayed with the rest of those writes through a fault)
            body = envelope(
                {"eos": True} if kind == "eos" else {},
                request_id=f"t-{uuid.uuid4().hex}",
                session_id=session.session_id,
                bot_id=bot,
                extra={"group_id": group},
            )
            path = TOUCH
        started = time.monotonic()
        resp = await app.post(path, json=body)
        call = Call(
            kind,
            session.session_id,
            session.scope_id,
            replica,
            started,
            time.monotonic(),
            resp.status_code,
            "OK",
        )
        self._judge(session, call, resp)
        session.calls.append(call)
        self.record.calls.append(call)
        return call

    def _judge(self, session: Session, call: Call, resp: httpx.Response) -> None:
        try:
            body = resp.json()
        except ValueError:
            self.record.bad.append(f"{call.kind} {resp.status_code}: not JSON: {resp.text[:200]}")
            call.code = "NOT_JSON"
            return
        if resp.status_code != 200:
            call.code = str(body.get("error_code"))
            retry = body.get("retry_after")
            if REFUSALS.get(call.code) != resp.status_code or not (
                isinstance(retry, int)
                and retry >= 1
                and resp.headers.get("retry-after") == str(retry)
            ):
                self.record.bad.append(f"{call.kind} {resp.status_code}: {resp.text[:300]}")
            session.certain = False
            return
        data = body.get("data") or {}
        was_certain, known = session.certain, session.pod_id
        if call.kind in ("route_new", "route"):
            call.placement, call.pod_id = str(data.get("placement")), str(data.get("pod_id"))
            pod = self.k8s.pods.get(call.pod_id)
            if pod is None or f"//{pod.pod_ip}:" not in str(data.get("pod_sse_url")):
                self.record.bad.append(f"route names a pod that does not exist: {body}")
            if (
                call.kind == "route_new"
                and call.placement != "placed"
                and was_certain is False
                and not session.calls
            ):
                call.note = f"new_{call.placement}"  # a fresh session id must be placed
            elif was_certain and call.placement in ("placed", "rebound"):
                call.note = "binding_lost"
            elif was_certain and call.pod_id != known:
                call.note = "wrong_pod"
            session.pod_id, session.certain = call.pod_id, True
        elif call.kind == "touch":
            if was_certain and data.get("touched") is not True:
                call.note = "binding_lost"
                session.certain, session.pod_id = False, ""
        else:  # eos
            if was_certain and data.get("released") is not True:
                call.note = "binding_lost"
            session.ended, session.certain = True, True
        if call.note:
            self.record.anomalies.append((session, call))


# --- the service ------------------------------------------------------------------------------


@dataclass
class Service:
    apps: list[httpx.AsyncClient]
    k8s: FakeK8sPodClient
    clients: list[Redis]
    scopes: list[tuple[str, str]]

    def services(self, i: int) -> Services:
        svc: Services = self.apps[i].app.state.services  # type: ignore[attr-defined]
        return svc

    @property
    def scope_ids(self) -> list[str]:
        return [scope_id_of(g, b) for g, b in self.scopes]


@asynccontextmanager
async def service(url: str, db: Database, shape: Shape) -> AsyncIterator[Service]:
    """``shape.replicas`` replicas over the Sentinel URL, configured with the shape's scopes."""
    k8s = FakeK8sPodClient(ready_delay=0.02)
    settings = make_settings(redis_url=url, redis_timeout=shape.redis_timeout)
    clients = [build_redis(settings) for _ in range(shape.replicas)]
    scopes = [(f"grp-fo{i}", f"bot-fo{i}") for i in range(shape.scopes)]
    async with AsyncExitStack() as stack:
        for c in clients:
            stack.push_async_callback(c.aclose)
        apps = [
            await stack.enter_async_context(
                running_app(
                    c,
                    db,
                    k8s=k8s,
                    instance_id=f"replica-{i}",
                    scope_full_timeout=shape.scope_full_timeout,
                    # the load, not the edge, is under test: no refusal at a replica's door
                    max_in_flight=256,
                    redis_url=url,  # (a server's Redis: the WAIT setting applies)
                    redis_wait_replicas=shape.wait_replicas,
                    redis_wait_timeout_ms=shape.wait_timeout_ms,
                )
            )
            for i, c in enumerate(clients)
        ]
        template = {
            "template_id": "tpl-fo",
            "image": "agentserver:1",
            "scope_concurrency": shape.scope_concurrency,
            "pod_concurrency": shape.pod_concurrency,
            "ready_poll_interval": 0.02,
            "session_ttl": shape.session_ttl,
        }
        resp = await apps[0].post(SYNC, json=sync_body("template", "create", template))
        assert resp.status_code == 200, resp.text
        for group, bot in scopes:
            rule = {"group_id": group, "bot_id": bot, "template_id": "tpl-fo"}
            resp = await apps[0].post(SYNC, json=sync_body("routing_rule", "create", rule))
            assert resp.status_code == 200, resp.text
        svc = Service(apps, k8s, clients, scopes)
        sweeper = asyncio.create_task(_sweep(svc))
        try:
            yield svc
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper


@asynccontextmanager
async def sqlite_service(url: str, shape: Shape) -> AsyncIterator[Service]:
    """``service`` over a config database of its own: a temporary SQLite file, its schema
    upgraded, gone after (the benches': bench/failover.py, bench/redis_wait.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{tmp}/config.db"
        engine = create_engine(db_url)
        schema.upgrade(engine)
        engine.dispose()
        db = Database.from_url(db_url, pool_size=4)
        try:
            async with service(url, db, shape) as svc:
                yield svc
        finally:
            await db.close()


async def _sweep(svc: Service) -> None:
    """The ``sm_sweep`` job's expiry pass and seat prune, every 0.5 s on the first replica
    (the jobs are off in ``running_app``; the other jobs would act on the pods)."""
    sweeper = svc.services(0).session_sweeper
    while True:
        with contextlib.suppress(Exception):  # Redis fails over under it
            await sweeper.expire_once()
            await sweeper.prune_once()
        await asyncio.sleep(0.5)


# --- one failover under load, judged ----------------------------------------------------------


@dataclass
class Outcome:
    """What one failover under load showed. Times are seconds from the FAILOVER command."""

    failover: Failover
    calls: int = 0
    codes: Counter[str] = field(default_factory=Counter)  # every answer, by code
    window_s: float = 0.0  # first failed answer -> first success after the last failed one
    first_fail_s: float | None = None
    gap_s: float = 0.0  # the longest stretch around the failover without any success
    slowest_s: float = 0.0  # the slowest call in flight during the failover
    placed_again_s: float | None = None  # the first new placement that started after it
    refused_in_window: Counter[str] = field(default_factory=Counter)  # route refusals in it
    bad: list[str] = field(default_factory=list)
    anomalies: Counter[str] = field(default_factory=Counter)  # exposed sessions' notes
    unexposed_anomalies: list[str] = field(default_factory=list)
    # what the state lost, measured after the load (gateway's view vs Redis)
    bindings_lost: int = 0  # sessions the gateway holds that Redis no longer binds (or elsewhere)
    eos_undone: int = 0  # sessions ended by an eos that Redis holds again
    unacknowledged: int = 0  # sessions Redis holds whose last answer was a failure
    seats_over_cap: int = 0  # sessions beyond a cap when the forgotten ones count too
    pods_unregistered: int = 0  # pods in Kubernetes whose registration vanished
    over_cap_seen: list[invariants.OverCap] = field(default_factory=list)  # sampled mid-load
    state: invariants.StateReport | None = None  # after the load, before the cleanup
    after: invariants.StateReport | None = None  # after the cleanup and the leases' end

    def summary(self) -> str:
        fo = self.failover
        return (
            f"failover {fo.old[1]}->{fo.new[1] if fo.new else '?'}: "
            f"promoted +{fo.promoted - fo.commanded:.2f}s "
            f"demoted +{fo.demoted - fo.commanded:.2f}s, old master wrote {fo.lost_bytes} B "
            f"after the promotion | calls {self.calls} "
            f"{dict(self.codes)} | window {self.window_s:.2f}s (first failure "
            f"{'-' if self.first_fail_s is None else f'+{self.first_fail_s:.2f}s'}) "
            f"gap {self.gap_s:.2f}s slowest {self.slowest_s:.2f}s placed again "
            f"{'-' if self.placed_again_s is None else f'+{self.placed_again_s:.2f}s'} | "
            f"route refusals in window "
            f"{dict(self.refused_in_window)} | lost: bindings {self.bindings_lost} eos_undone "
            f"{self.eos_undone} seats_over_cap {self.seats_over_cap} pods_unregistered "
            f"{self.pods_unregistered} (unacknowledged placements {self.unacknowledged}) | "
            f"anomalies {dict(self.anomalies)}"
        )


async def _sample_caps(
    observer: Redis, scopes: list[str], seen: list[invariants.OverCap], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):  # the observer meets the failover too
            seen += await invariants.check_caps(observer, scopes)
        await asyncio.sleep(0.02)


async def _answering(record: Record, since: float, replicas: int, within: float) -> None:
    """Wait (bounded) until every replica answered routes and touches with successes that
    started after ``since``: the service answers again."""
    deadline = time.monotonic() + within
    while True:
        ok = Counter(
            (c.replica, "route" if c.kind.startswith("route") else c.kind)
            for c in record.calls
            if c.code == "OK" and c.started > since
        )
        if all(ok[(r, "route")] >= 10 and ok[(r, "touch")] >= 2 for r in range(replicas)):
            return
        if time.monotonic() > deadline:
            codes = Counter((c.kind, c.code) for c in record.calls if c.started > since)
            raise TimeoutError(
                f"the service did not answer again within {within} s: successes {dict(ok)}, "
                f"every answer since {dict(codes)}"
            )
        await asyncio.sleep(0.05)


async def one_failover(
    svc: Service,
    fault: Callable[[], Awaitable[Failover]],
    observer: Redis,
    shape: Shape,
    *,
    warm: int = 60,
    recover_within: float | None = None,
) -> Outcome:
    """Load on, warm up (``warm`` successes), bring the ``fault`` (a forced Sentinel
    failover, a cluster master killed, a slot moved: ``cluster_faults.py``), keep the load
    until every replica answers again, load off; then judge and measure (the state is
    cleaned after)."""
    gw = Gateway(svc.apps, svc.k8s, svc.scopes)
    stop_sampling = asyncio.Event()
    seen: list[invariants.OverCap] = []
    sampler = asyncio.create_task(_sample_caps(observer, svc.scope_ids, seen, stop_sampling))
    load = asyncio.create_task(gw.run(shape.gateways))
    try:
        deadline = time.monotonic() + 60
        while sum(c.code == "OK" for c in gw.record.calls) < warm:
            if load.done() or time.monotonic() > deadline:
                raise TimeoutError(f"warm-up: {Counter(c.code for c in gw.record.calls)}")
            await asyncio.sleep(0.05)
        fo = await fault()
        # a lost eos holds its seat until the session expires: placements may wait that long
        within = recover_within or shape.session_ttl + shape.scope_full_timeout + 20
        await _answering(gw.record, max(fo.named, fo.promoted), shape.replicas, within)
    finally:
        gw.stop.set()
        await asyncio.wait_for(load, shape.scope_full_timeout + 30)
        stop_sampling.set()
        await sampler
    out = Outcome(fo, over_cap_seen=seen)
    await _judge(out, gw.record, svc, observer)
    await _clean(out, gw.record, svc, observer)
    return out


async def _judge(out: Outcome, record: Record, svc: Service, observer: Redis) -> None:
    fo = out.failover
    t0 = fo.commanded
    calls = sorted(record.calls, key=lambda c: c.ended)
    out.calls = len(calls)
    out.codes = Counter(c.code for c in calls)
    out.bad = list(record.bad)
    fails = [c for c in calls if c.code == "BACKEND_UNAVAILABLE"]
    if fails:
        first, last = fails[0].ended, fails[-1].ended
        after = [c.ended for c in calls if c.code == "OK" and c.ended > last]
        recovered = after[0] if after else calls[-1].ended
        out.first_fail_s = first - t0
        out.window_s = recovered - first
        out.refused_in_window = Counter(
            c.code
            for c in calls
            if c.kind.startswith("route") and c.code != "OK" and first <= c.ended <= recovered
        )
    # the longest stretch without a success, from a second before the command to recovery
    oks = [t0 - EXPOSURE_MARGIN] + [
        c.ended for c in calls if c.code == "OK" and c.ended > t0 - EXPOSURE_MARGIN
    ]
    out.gap_s = max((b - a for a, b in itertools.pairwise(oks)), default=0.0)
    exposed_from, exposed_to = t0 - EXPOSURE_MARGIN, fo.demoted
    placed = [c.ended for c in calls if c.placement == "placed" and c.started > fo.named]
    out.placed_again_s = placed[0] - t0 if placed else None
    out.slowest_s = max(
        (c.ended - c.started for c in calls if c.started <= exposed_to and c.ended >= t0),
        default=0.0,
    )

    def exposed(session: Session, before: Call | None = None) -> bool:
        return any(
            c.started <= exposed_to and c.ended >= exposed_from
            for c in session.calls
            if before is None or c.started <= before.started
        )

    for session, call in record.anomalies:
        if exposed(session, call):
            out.anomalies[call.note] += 1
        else:
            out.unexposed_anomalies.append(f"{call.note}: {call} (session calls {session.calls})")

    # the state after the load, against the gateway's view
    state = await invariants.check(observer, svc.scope_ids)
    out.state = state
    held: dict[str, tuple[str, str]] = {}  # session -> (scope, pod): what the gateway holds
    for s in record.sessions.values():
        if s.certain and not s.ended and s.pod_id:
            held[s.session_id] = (s.scope_id, s.pod_id)
    for session_id, where in held.items():
        if state.bindings.get(session_id) != where:
            out.bindings_lost += 1
            if not exposed(record.sessions[session_id]):
                out.unexposed_anomalies.append(f"binding gone: {record.sessions[session_id]}")
    for session_id in state.bindings:
        s = record.sessions.get(session_id)
        if s is not None and s.ended and s.certain:
            out.eos_undone += 1
            if not exposed(s):
                out.unexposed_anomalies.append(f"ended session back: {s}")
        elif s is not None and not s.certain:
            out.unacknowledged += 1
    # seats beyond a cap: the conversations each pod carries by what the gateway was told (a
    # session leaves its pod when its eos or its move is sent, joins one when the answer
    # arrives: never more than it really carries), against the caps
    out.seats_over_cap = _peak_over_cap(calls, state.caps)
    registered = await invariants.registered_pod_ids(observer)
    out.pods_unregistered = len(set(svc.k8s.pods) - registered)


def _peak_over_cap(calls: list[Call], caps: dict[str, invariants.Caps]) -> int:
    """The most sessions beyond their caps (pods' and scopes' excess summed) at any moment of
    the gateway's view; 0 when no lost write made the service overfill a pod or a scope."""
    events: list[tuple[float, int, Call]] = []
    for c in calls:
        if c.code != "OK":
            continue
        if c.kind in ("route_new", "route"):
            events += [(c.started, 0, c), (c.ended, 1, c)]  # leave the old pod, join the new
        elif c.kind == "eos" or c.note == "binding_lost":
            events.append((c.started, 0, c))
    where: dict[str, tuple[str, str]] = {}
    pods: Counter[tuple[str, str]] = Counter()
    scopes: Counter[str] = Counter()
    peak = 0
    for _, joins, c in sorted(events, key=lambda e: (e[0], e[1])):
        if not joins:
            left = where.get(c.session_id)
            moves = c.kind == "eos" or bool(c.note) or left != (c.scope_id, c.pod_id)
            if left is not None and moves:  # a refresh stays put
                del where[c.session_id]
                pods[left] -= 1
                scopes[left[0]] -= 1
            continue
        if where.get(c.session_id) == (c.scope_id, c.pod_id):
            continue  # a refresh: still where it was
        where[c.session_id] = (c.scope_id, c.pod_id)
        pods[(c.scope_id, c.pod_id)] += 1
        scopes[c.scope_id] += 1
        excess = sum(
            max(0, n - caps[sid].pod_concurrency) for (sid, _), n in pods.items() if sid in caps
        ) + sum(max(0, n - caps[sid].scope_concurrency) for sid, n in scopes.items() if sid in caps)
        peak = max(peak, excess)
    return peak


async def _clean(out: Outcome, record: Record, svc: Service, observer: Redis) -> None:
    """End every session the load may have left (an eos is harmless on one that is gone),
    then wait until every lease ran out and the prunes took what they left."""
    pending = [s for s in record.sessions.values() if not (s.ended and s.certain)]
    pending += [
        record.sessions.get(sid) or Session(sid, scope)
        for sid, (scope, _) in (out.state.bindings if out.state else {}).items()
    ]
    for s in {s.session_id: s for s in pending}.values():
        body = envelope({"eos": True}, request_id=f"t-{uuid.uuid4().hex}", session_id=s.session_id)
        deadline = time.monotonic() + 10
        while (resp := await svc.apps[0].post(TOUCH, json=body)).status_code != 200:
            assert time.monotonic() < deadline, resp.text
            await asyncio.sleep(0.1)

    async def prune() -> None:
        for i in range(len(svc.apps)):
            with contextlib.suppress(Exception):
                await svc.services(i).session_sweeper.prune_once()
                await svc.services(i).pool_jobs.prune_once()

    out.after = await invariants.settle(observer, svc.scope_ids, within=30.0, tick=prune)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def free_channel(scope_id: str) -> str:
    """The scope's wake-up channel (a slot may have freed)."""
    return sm_scope(scope_id, "free")
