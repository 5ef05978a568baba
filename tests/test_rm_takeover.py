"""A deploy leader that dies mid-deploy (issue 14 §2), with two resource managers over one
Redis and one fake cluster, on fakeredis and the real Redis.

The dying replica is simulated as a process death looks from outside: its Redis connection
fails every command from one moment on and its deploy never goes on, while its pod, once
created, comes up by itself (as a kubelet brings it up). Its lease then lapses; a follower on
the other replica takes over within a lease and adopts the pod, or deletes it when it fails,
or deploys anew when there was none; a leader that lost its lease registers nothing; with no
route at all, reconcile adopts the pod. Nothing is left held in any case.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.facade import (
    AcquiredPod,
    DeployFailed,
    DeployInProgress,
    DeployTimedOut,
    ResourceManagerFacade,
)
from agent_runtime.resource_manager.identity import Ownership
from agent_runtime.resource_manager.k8s import OnCreated
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.models import PodDeployInfo
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.pool_jobs import PoolJobs
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.state import SessionState
from contract_keys import rm_leased_scopes, rm_pod_known
from helpers import (
    IDENTITY,
    GatedK8s,
    deploy_locks,
    follower_seats,
    other_client,
    redis_keys,
)

SCOPE = "scope-t"
LEASE = 1.0
READY_TIMEOUT = 20.0


def spec(**overrides: Any) -> dict[str, Any]:
    return {
        "image": "agentserver:1",
        "pod_name": "agent",
        "sse_port": 8080,
        "sse_path": "/sse",
        "ready_timeout": READY_TIMEOUT,
        "ready_poll_interval": 0.05,
        **overrides,
    }


POOL = {"min_idle_pods": 0, "max_pods": 2, "pod_ttl": 60, "pod_concurrency": 4}


def rm(what: str) -> str:
    return f"resource_manager:resource:scope:{{{SCOPE}}}:{what}"


# the deploy "r-a" leads (a cold deploy is keyed by its demand: the caller's request id), and
# keeps when another caller takes it over
LOCK = f"resource_manager:lock:rm:deploy:{{{SCOPE}}}:r-a"
RECORD = rm("deploy_pod:r-a")


class ReplicaGone(Exception):
    """What the dead replica's deploy raises once the test ends it."""


class Killable:
    """A replica's own Redis client; ``dead``: every command fails as with the network gone."""

    def __init__(self, redis: Redis) -> None:
        self.client = other_client(redis)
        self.dead = False
        send = self.client.execute_command

        async def execute_command(*args: Any, **kwargs: Any) -> Any:
            if self.dead:
                raise RedisConnectionError("the replica is dead")
            return await send(*args, **kwargs)

        self.client.execute_command = execute_command  # type: ignore[method-assign]


class Dying:
    """The dying replica's view of the shared cluster: its create lands and its pod is
    recorded (or, ``before_create``, nothing is created), then the replica dies: its Redis is
    gone and its deploy waits forever — until ``gone`` ends it at the test's end."""

    def __init__(self, inner: FakeK8sPodClient, redis: Killable, *, before_create: bool = False):
        self.inner = inner
        self.redis = redis
        self.before_create = before_create
        self.died = asyncio.Event()
        self.gone = asyncio.Event()

    async def _die(self) -> None:
        self.redis.dead = True
        self.died.set()
        await self.gone.wait()
        raise ReplicaGone()

    async def deploy(self, *, on_created: OnCreated | None = None, **kw: Any) -> PodDeployInfo:
        if self.before_create:
            await self._die()

        async def created(name: str, namespace: str, uid: str) -> None:
            if on_created is not None:
                await on_created(name, namespace, uid)  # recorded under the dying leader's lease
            await self._die()  # before the incarnation patch: the pod has the first MAC only

        return await self.inner.deploy(on_created=created, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Replica:
    state: ResourceState
    orchestrator: ResourceOrchestrator
    facade: ResourceManagerFacade
    notifier: Notifier
    client: Redis

    async def acquire(self, request_id: str, **kw: Any) -> AcquiredPod:
        pool = kw.pop("pool", POOL)
        return await self.facade.acquire(SCOPE, kw.pop("pod_spec", spec()), pool, request_id, **kw)


@contextlib.asynccontextmanager
async def replica(client: Redis, k8s: Any) -> AsyncIterator[Replica]:
    state = ResourceState(client)
    notifier = Notifier(client)
    await notifier.start()
    orchestrator = ResourceOrchestrator(
        state=state,
        k8s=k8s,
        notifier=notifier,
        default_namespace="default",
        deploy_lease=LEASE,
        identity=IDENTITY,
    )
    try:
        yield Replica(
            state, orchestrator, ResourceManagerFacade(orchestrator=orchestrator), notifier, client
        )
    finally:
        await orchestrator.close()
        await notifier.stop()


@contextlib.asynccontextmanager
async def dying_and_healthy(
    redis: Redis, k8s: FakeK8sPodClient, *, before_create: bool = False
) -> AsyncIterator[tuple[Replica, Dying, Replica]]:
    killable = Killable(redis)
    dying = Dying(k8s, killable, before_create=before_create)
    healthy_client = other_client(redis)
    try:
        async with replica(killable.client, dying) as a, replica(healthy_client, k8s) as b:
            try:
                yield a, dying, b
            finally:
                dying.gone.set()  # the dead replica's tasks end (its process is gone)
    finally:
        await killable.client.aclose()
        await healthy_client.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"not within {within:g} s: {what}"
        await asyncio.sleep(0.02)


async def live_placeholders(redis: Redis) -> list[str]:
    seconds, _ = await redis.time()
    members = await redis.smembers(rm("deploying"))
    return [m for m in members if float(m.rpartition("@")[2]) >= int(seconds)]


async def assert_nothing_held(redis: Redis) -> None:
    assert await deploy_locks(redis, SCOPE) == {}, "deploy lock left"

    async def no_live_placeholder() -> bool:
        return await live_placeholders(redis) == []

    # a dead leader's placeholder is a lease of whole seconds: it may outlive its lock (which
    # the taker waited for) by up to a second, then lapses
    await eventually(no_live_placeholder, "placeholder left", within=LEASE + 3)
    assert await follower_seats(redis, SCOPE) == [], "follower seat left"
    for record in await redis_keys(redis, rm("deploy_pod:*")):
        # an ended deploy's record names its registered pod for a moment (its followers')
        pod_id = await redis.hget(record, "pod_id")
        assert pod_id is None or await rm_pod_known(redis, pod_id), "pod record left"


async def lapsed(redis: Redis) -> bool:
    """The dead leader's lock and placeholder are past their lease."""
    return not await redis.exists(LOCK) and not await live_placeholders(redis)


def pool_jobs_of(replica: Replica, k8s: Any) -> PoolJobs:
    """The jobs of a replica (ticked by hand)."""
    return PoolJobs(
        state=replica.state,
        k8s=k8s,
        orchestrator=replica.orchestrator,
        sessions=SessionManagerFacade(state=SessionState(replica.client)),
        default_namespace="default",
        identity=IDENTITY,
    )


def ownership(k8s: FakeK8sPodClient, pod_id: str) -> Ownership:
    return IDENTITY.verify(k8s.pods[pod_id]).ownership


async def started_leading(dying: Dying, redis: Redis) -> str:
    """The dying leader's pod, once it has died (its pod recorded)."""
    await asyncio.wait_for(dying.died.wait(), 15)
    recorded = await redis.hget(RECORD, "pod_id")
    assert recorded is not None
    return str(recorded)


async def finished(task: asyncio.Task[Any]) -> None:
    with contextlib.suppress(BaseException):
        task.cancel()
        await task


# --- takeover ----------------------------------------------------------------------------------


async def test_a_follower_takes_over_and_adopts_the_dead_leader_s_pod(redis: Redis) -> None:
    k8s = FakeK8sPodClient(ready_delay=1.0)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)
        assert ownership(k8s, orphan) is Ownership.UNFINISHED, "died before the patch"
        loop = asyncio.get_running_loop()
        asked = loop.time()
        got = await b.acquire("r-b")
        waited = loop.time() - asked
        await finished(leading)
        assert got.pod_id == orphan, "the dead leader's pod, adopted"
        assert ownership(k8s, orphan) is Ownership.OURS, "the taker signed its incarnation"
        assert k8s.deploy_calls == 1, "nothing deployed anew"
        assert waited < READY_TIMEOUT, f"waited {waited:.1f} s: to its deadline, not a lease"
        assert await redis.hget(
            f"resource_manager:resource:pod:{{{SCOPE}}}:{orphan}:info", "phase"
        ) == ("in_use")
        assert await redis.zrange(rm("pods"), 0, -1) == [orphan]
        await assert_nothing_held(redis)


async def test_a_dead_leader_s_pod_that_never_gets_ready_is_deleted_by_the_taker(
    redis: Redis,
) -> None:
    k8s = FakeK8sPodClient()
    k8s.never_ready = True
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a", pod_spec=spec(ready_timeout=2)))
        orphan = await started_leading(dying, redis)
        with pytest.raises(DeployFailed):
            await b.acquire("r-b", pod_spec=spec(ready_timeout=2))
        await finished(leading)
        assert orphan not in k8s.pods and orphan in k8s.deleted, "deleted, never left"
        assert k8s.deploy_calls == 1, "same image, same failure: not deployed again"
        assert await redis.zcard(rm("pods")) == 0
        assert not await redis.exists(LOCK)
        assert await live_placeholders(redis) == []
        assert await follower_seats(redis, SCOPE) == []


async def test_beside_deploys_in_parallel_a_dead_leader_s_deploy_is_taken_over_alone(
    redis: Redis,
) -> None:
    """pod_concurrency 1: the dying replica leads "r-a", the healthy one leads "r-b" beside it.
    A third route ("r-c", no seat anywhere) is told the deploys are under way until "r-a"'s
    lease lapses, then takes that deploy over with its pod; "r-b" goes on untouched; two
    creates in all, nothing held."""
    pool = {**POOL, "pod_concurrency": 1, "max_pods": 2}  # r-a and r-b: the scope is full
    k8s = FakeK8sPodClient(ready_delay=1.0)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a", pool=pool))
        orphan = await started_leading(dying, redis)
        beside = asyncio.create_task(b.acquire("r-b", pool=pool))
        lock_b = f"resource_manager:lock:rm:deploy:{{{SCOPE}}}:r-b"
        await eventually(lambda: redis.exists(lock_b), "r-b leading beside r-a")
        deadline = time.monotonic() + 15
        while True:  # as a route does: wait, and ask again
            try:
                taken = await b.acquire("r-c", pool=pool)
                break
            except DeployInProgress:
                assert time.monotonic() < deadline, "r-a's deploy was never taken over"
                await asyncio.sleep(0.1)
        own = await beside
        await finished(leading)
        assert taken.pod_id == orphan, "the dead leader's pod, adopted by the taker"
        assert own.pod_id != orphan and own.pod_id in k8s.pods
        assert k8s.deploy_calls == 2, "r-a's create and r-b's: nothing deployed anew"
        assert await redis.zcard(rm("pods")) == 2
        await assert_nothing_held(redis)


async def test_a_leader_that_died_before_its_create_is_replaced_by_a_new_deploy(
    redis: Redis,
) -> None:
    k8s = FakeK8sPodClient(ready_delay=0.2)
    async with dying_and_healthy(redis, k8s, before_create=True) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        await asyncio.wait_for(dying.died.wait(), 15)
        got = await b.acquire("r-b")
        await finished(leading)
        assert list(k8s.pods) == [got.pod_id]
        assert k8s.deploy_calls == 1, "the dead one never reached the cluster"
        await assert_nothing_held(redis)


async def test_a_leader_that_lost_its_lease_registers_nothing_of_its_own(redis: Redis) -> None:
    """Its Redis is away for longer than the lease while its pod starts: the other replica
    takes over with the pod. Back, the first leader neither registers the pod a second time
    nor deletes it: its caller follows the taker's deploy (the same pod), or — when the taker
    already registered it and ended — acquires anew (its renewal never takes the deploy
    back: deploy_lease.lua) and gets a pod of its own."""
    k8s = FakeK8sPodClient()
    k8s.never_ready = True  # until the takeover is done
    killable = Killable(redis)
    other = other_client(redis)
    try:
        async with replica(killable.client, k8s) as a, replica(other, k8s) as b:
            first = asyncio.create_task(a.acquire("r-a"))
            await eventually(lambda: redis.exists(RECORD), "the pod recorded")
            token_a = await redis.hget(RECORD, "token")
            recorded = await redis.hget(RECORD, "pod_id")
            killable.dead = True
            second = asyncio.create_task(b.acquire("r-b"))

            async def taken_over() -> bool:
                return await redis.hget(RECORD, "token") not in (None, token_a)

            await eventually(taken_over, "the other replica took the lease over")
            killable.dead = False
            k8s.never_ready = False
            got_a, got_b = await asyncio.gather(first, second)
            assert got_b.pod_id == recorded, "the taker adopted the pod"
            pods = sorted({got_a.pod_id, got_b.pod_id})
            assert k8s.deploy_calls == len(pods) and sorted(k8s.pods) == pods, "none deleted"
            assert sorted(await redis.zrange(rm("pods"), 0, -1)) == pods
            await assert_nothing_held(redis)
    finally:
        await killable.client.aclose()
        await other.aclose()


async def test_reconcile_adopts_a_dead_leader_s_pod_when_no_route_comes(redis: Redis) -> None:
    """Nobody routes to the scope again: its expired placeholder no longer makes reconcile
    wait for a deploy in flight, so the pod is adopted (warm), and the prune job removes what
    the dead replica left in Redis."""
    k8s = FakeK8sPodClient(ready_delay=0.2)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)

        await eventually(lambda: lapsed(redis), "the dead leader's lease lapsed")
        pool_jobs = pool_jobs_of(b, k8s)
        assert ownership(k8s, orphan) is Ownership.UNFINISHED
        counts = await pool_jobs.reconcile_once()
        assert counts["adopted"] == 1
        assert await redis.sismember(rm("idle"), orphan), "adopted into the warm pool"
        assert ownership(k8s, orphan) is Ownership.OURS, "signed under the deploy's lease"
        await pool_jobs.prune_once()  # what the dead replica left (adopting swept some)
        assert await redis.scard(rm("deploying")) == 0
        assert not await redis.exists(RECORD), "its pod is registered: the record is done"
        assert SCOPE not in await rm_leased_scopes(redis), "nothing left: out of the index"
        # the next route takes the adopted pod, and the stale record is no orphan any more
        assert (await b.acquire("r-b")).pod_id == orphan
        assert k8s.deploy_calls == 1
        await finished(leading)
        await assert_nothing_held(redis)


async def test_reconcile_leaves_a_pod_a_route_took_over_while_it_signed(redis: Redis) -> None:
    """Nobody renews reconcile's takeover lease: it takes the deploy again before it adopts.
    Here its lease lapsed while it signed and a route took the deploy over: reconcile
    neither adopts nor deletes the pod, and the route's lock and record stay untouched."""
    k8s = FakeK8sPodClient(ready_delay=0.2)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)
        await eventually(lambda: lapsed(redis), "the dead leader's lease lapsed")
        signed = k8s.sign

        async def sign_then_lose(*args: Any, **kwargs: Any) -> Any:
            result = await signed(*args, **kwargs)
            # reconcile's lease lapsed meanwhile, and a route took the deploy over
            await redis.set(LOCK, "replica-c/r-c/x@9", px=10_000)
            await redis.hset(RECORD, "token", "replica-c/r-c/x@9")
            return result

        k8s.sign = sign_then_lose  # type: ignore[method-assign]
        counts = await pool_jobs_of(b, k8s).reconcile_once()
        assert counts["adopted"] == 0 and orphan in k8s.pods, "neither adopted nor deleted"
        assert not await redis.sismember(rm("idle"), orphan)
        assert await redis.get(LOCK) == "replica-c/r-c/x@9"
        assert await redis.hget(RECORD, "token") == "replica-c/r-c/x@9"
        await redis.delete(LOCK)
        await finished(leading)


async def test_reconcile_leaves_a_dead_leader_s_starting_pod_to_a_takeover(
    redis: Redis,
) -> None:
    """Pending is not dead: while the dead leader's record names its pod, reconcile does not
    delete it as an orphan (a route's takeover would find it gone); once it is Ready,
    reconcile adopts it under the deploy's lease."""
    k8s = FakeK8sPodClient()
    k8s.never_ready = True
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)

        await eventually(lambda: lapsed(redis), "the dead leader's lease lapsed")
        pool_jobs = pool_jobs_of(b, k8s)
        counts = await pool_jobs.reconcile_once()
        assert counts["adopted"] == counts["deleted"] == 0
        assert orphan in k8s.pods and await redis.hget(RECORD, "pod_id") == orphan
        assert ownership(k8s, orphan) is Ownership.UNFINISHED, "unfinished, yet left alone"
        k8s.never_ready = False  # it comes up
        assert (await pool_jobs.reconcile_once())["adopted"] == 1
        assert await redis.sismember(rm("idle"), orphan)
        assert ownership(k8s, orphan) is Ownership.OURS
        await finished(leading)
        await assert_nothing_held(redis)


# --- a caller's own deadline -------------------------------------------------------------------


async def test_a_follower_waits_its_own_deadline_once_and_says_how_long(redis: Redis) -> None:
    """The deadline counts from when the caller first asked (``asked_at``), not per call: a
    route that asked 29.6 s ago (ready_timeout 20 + 10) is told after ~0.4 s more, with the
    time it really waited; its seat is given back, the leader's deploy goes on."""
    k8s = GatedK8s()
    other = other_client(redis)
    try:
        async with replica(redis, k8s) as a, replica(other, k8s) as b:
            leading = asyncio.create_task(a.acquire("r-a"))
            await eventually(lambda: redis.exists(LOCK), "a leader")
            asked = asyncio.get_running_loop().time() - (READY_TIMEOUT + 10 - 0.4)
            with pytest.raises(DeployTimedOut) as refused:
                await b.acquire("r-b", asked_at=asked)
            assert refused.value.waited >= READY_TIMEOUT + 10
            assert f"no pod within {refused.value.waited:.1f} s" in str(refused.value)
            assert await follower_seats(redis, SCOPE) == []
            with pytest.raises(DeployTimedOut):  # past it: at once, nothing taken
                await b.acquire("r-b2", asked_at=asked)
            assert await redis.exists(LOCK), "the leader goes on"
            k8s.gate.set()
            assert (await leading).pod_id in k8s.pods
            await assert_nothing_held(redis)
    finally:
        await other.aclose()
