"""Acquire: warm reuse, one deploy per scope with a follower room, and every error path
giving back what it took — with real concurrency, also over two instances on one Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime import spec_fields
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.facade import (
    AcquiredPod,
    DeployFailed,
    DeployInProgress,
    IdleTransition,
    K8sApiError,
    MaxPodsReached,
    ResourceManagerFacade,
)
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.state import (
    ResourceState,
    idem_key,
    pod_idle_since_key,
    pod_info_key,
    scope_deploying_key,
    scope_idle_key,
    scope_pods_key,
)
from contract_keys import rm_pod_known
from helpers import IDENTITY, deploy_locks, follower_seats, other_client

SCOPE = "scope-a"


def spec(**overrides: Any) -> dict[str, Any]:
    base = {
        "image": "agentserver:1",
        "pod_name": "agent",
        "namespace": None,
        "container_port": 8080,
        "sse_port": 8080,
        "sse_path": "/sse",
        "ready_timeout": 5.0,
        "ready_poll_interval": 0.05,
        "env": {},
    }
    base.update(overrides)
    return base


def pool(*, max_pods: int = 2, pod_concurrency: int = 5, min_idle: int = 0) -> dict[str, int]:
    return {
        "min_idle_pods": min_idle,
        "max_pods": max_pods,
        "pod_ttl": 60,
        "pod_concurrency": pod_concurrency,
    }


@dataclass
class Instance:
    """One replica's resource manager over a shared Redis and a shared fake Kubernetes."""

    state: ResourceState
    orchestrator: ResourceOrchestrator
    facade: ResourceManagerFacade
    notifier: Notifier


@pytest.fixture
def k8s() -> FakeK8sPodClient:
    return FakeK8sPodClient(ready_delay=0.2)


async def make_instance(redis: Redis, k8s: FakeK8sPodClient) -> Instance:
    state = ResourceState(redis)
    notifier = Notifier(redis)
    await notifier.start()
    orchestrator = ResourceOrchestrator(
        state=state, k8s=k8s, notifier=notifier, default_namespace="default", identity=IDENTITY
    )
    return Instance(state, orchestrator, ResourceManagerFacade(orchestrator=orchestrator), notifier)


@pytest.fixture
async def rm(redis: Redis, k8s: FakeK8sPodClient) -> AsyncIterator[Instance]:
    instance = await make_instance(redis, k8s)
    yield instance
    await instance.orchestrator.close()
    await instance.notifier.stop()


@pytest.fixture
async def rm2(redis: Redis, k8s: FakeK8sPodClient) -> AsyncIterator[Instance]:
    """A second replica: its own Redis connection and notifier, same server, same cluster."""
    client = other_client(redis)
    instance = await make_instance(client, k8s)
    yield instance
    await instance.orchestrator.close()
    await instance.notifier.stop()
    await client.aclose()


async def assert_nothing_held(redis: Redis, scope: str = SCOPE) -> None:
    assert await redis.scard(scope_deploying_key(scope)) == 0, "placeholder leaked"
    assert await follower_seats(redis, scope) == [], "follower seat leaked"
    assert await deploy_locks(redis, scope) == {}, "deploy lock leaked"


async def acquire(inst: Instance, request_id: str, **kw: Any) -> AcquiredPod:
    return await inst.facade.acquire(
        SCOPE, kw.get("pod_spec", spec()), kw.get("pool", pool()), request_id
    )


# --- single caller -----------------------------------------------------------------------------


async def test_cold_acquire_deploys_and_registers_one_pod(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    result = await acquire(rm, "r1")
    pod_id = result.pod_id
    assert k8s.deploy_calls == 1 and pod_id.startswith("agent-")
    info = await redis.hgetall(pod_info_key(SCOPE, pod_id))
    assert info["scope_id"] == SCOPE and info["phase"] == "in_use"
    assert info["deploy_ver"] == spec_fields.deploy_ver(spec())
    assert result.pod_sse_url == info["pod_sse_url"] == f"http://{info['pod_ip']}:8080/sse"
    assert info["namespace"] == "default" and float(info["created_ts"]) > 0
    assert await redis.zrange(scope_pods_key(SCOPE), 0, -1) == [pod_id]
    assert await rm_pod_known(redis, pod_id)
    assert await redis.ttl(idem_key(SCOPE, "r1")) > 0
    await assert_nothing_held(redis)


async def test_the_leader_calls_on_ready_with_its_pod_while_it_holds_the_deploy_lock(
    rm: Instance, redis: Redis
) -> None:
    seen: list[tuple[AcquiredPod, bool, str]] = []

    async def on_ready(pod: AcquiredPod) -> None:
        info = await redis.hgetall(pod_info_key(SCOPE, pod.pod_id))
        seen.append((pod, bool(await deploy_locks(redis, SCOPE)), info["phase"]))

    result = await rm.facade.acquire(SCOPE, spec(), pool(), "r1", on_ready=on_ready)
    assert seen == [(result, True, "in_use")], "registered, and still under the lock"
    assert await deploy_locks(redis, SCOPE) == {}
    # warm reuse and a replayed answer have no deploy to announce
    await rm.facade.idle_consider(result.pod_id, SCOPE)
    assert await rm.facade.acquire(SCOPE, spec(), pool(), "r2", on_ready=on_ready) == result
    assert await rm.facade.acquire(SCOPE, spec(), pool(), "r1", on_ready=on_ready) == result
    assert len(seen) == 1


async def test_a_failing_on_ready_still_hands_out_the_pod_and_releases_everything(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    async def on_ready(pod: AcquiredPod) -> None:
        raise ConnectionError("the session side lost Redis")

    result = await rm.facade.acquire(SCOPE, spec(), pool(), "r1", on_ready=on_ready)
    assert result.pod_id in k8s.pods
    await assert_nothing_held(redis)


async def test_same_request_id_replays_the_first_answer(
    rm: Instance, k8s: FakeK8sPodClient
) -> None:
    first = await acquire(rm, "r1")
    assert await acquire(rm, "r1") == first
    assert k8s.deploy_calls == 1


async def test_a_request_id_of_another_scope_never_gets_a_pod_of_the_first(
    rm: Instance, rm2: Instance, k8s: FakeK8sPodClient
) -> None:
    """A deployed pod's cached result (idem:{sid}:{request_id}) is its scope's: the same id
    from another scope, on any replica, is another request's, served with a pod of its own
    scope (one, replayed on either replica), never the first scope's pod."""
    first = await acquire(rm, "r1")
    other = "fedcba9876543210fedcba9876543210"
    theirs = await rm.facade.acquire(other, spec(), pool(), "r1")
    assert theirs.pod_id != first.pod_id
    assert await rm2.facade.acquire(other, spec(), pool(), "r1") == theirs
    assert k8s.deploy_calls == 2
    assert await acquire(rm2, "r1") == first, "the first scope still replays"


async def test_first_acquire_writes_the_pool_config(rm: Instance, redis: Redis) -> None:
    await acquire(rm, "r1", pool=pool(max_pods=3, pod_concurrency=4))
    config = await rm.state.pool_config(SCOPE)
    assert config is not None and config.max_pods == 3 and config.pod_concurrency == 4
    assert config.deploy_ver == spec_fields.deploy_ver(spec())


async def test_warm_pod_of_the_current_version_is_reused(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    await rm.facade.update_pool_config(SCOPE, pool(), spec())
    member = await DeployState(rm.state).add_placeholder(SCOPE, "warm:1", 60)
    assert member is not None
    warm = await rm.orchestrator.deploy_and_register(SCOPE, spec(), member, warm=True)
    assert await redis.sismember(scope_idle_key(SCOPE), warm.pod_id)
    calls = k8s.deploy_calls

    assert await acquire(rm, "r1") == warm
    assert k8s.deploy_calls == calls, "a warm pod must be reused, not a new one deployed"
    assert not await redis.sismember(scope_idle_key(SCOPE), warm.pod_id)
    assert not await redis.exists(pod_idle_since_key(SCOPE, warm.pod_id))
    assert await redis.hget(pod_info_key(SCOPE, warm.pod_id), "phase") == "in_use"


async def test_a_warm_pod_of_an_old_version_is_not_handed_out(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    await rm.facade.update_pool_config(SCOPE, pool(), spec())
    member = await DeployState(rm.state).add_placeholder(SCOPE, "warm:1", 60)
    assert member is not None
    old = await rm.orchestrator.deploy_and_register(SCOPE, spec(), member, warm=True)
    new_spec = spec(image="agentserver:2")
    await rm.facade.update_pool_config(SCOPE, pool(), new_spec)

    got = await acquire(rm, "r1", pod_spec=new_spec)
    assert got.pod_id != old.pod_id
    assert await redis.hget(
        pod_info_key(SCOPE, got.pod_id), "deploy_ver"
    ) == spec_fields.deploy_ver(new_spec)
    assert await redis.sismember(scope_idle_key(SCOPE), old.pod_id), "old one stays idle"


async def test_max_pods_reached(rm: Instance, redis: Redis, k8s: FakeK8sPodClient) -> None:
    await acquire(rm, "r1", pool=pool(max_pods=1))
    with pytest.raises(MaxPodsReached):
        await acquire(rm, "r2", pool=pool(max_pods=1))
    assert k8s.deploy_calls == 1
    await assert_nothing_held(redis)


async def test_deploy_failure_gives_everything_back(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    k8s.fail_next_deploys = 1
    with pytest.raises(DeployFailed):
        await acquire(rm, "r1")
    await assert_nothing_held(redis)
    assert await redis.zcard(scope_pods_key(SCOPE)) == 0
    assert not await redis.exists(idem_key(SCOPE, "r1"))
    # the scope is not stuck: the next acquire deploys
    assert (await acquire(rm, "r2")).pod_id


async def test_never_ready_times_out_and_deletes_the_pod(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    k8s.never_ready = True
    started = time.monotonic()
    with pytest.raises(DeployFailed):
        await acquire(rm, "r1", pod_spec=spec(ready_timeout=0.4))
    assert time.monotonic() - started < 3
    assert k8s.pods == {} and len(k8s.deleted) == 1
    await assert_nothing_held(redis)


async def test_a_cancelled_caller_does_not_abort_the_deploy(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    k8s.ready_delay = 0.3
    task = asyncio.create_task(acquire(rm, "r1"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await rm.orchestrator.close()  # waits for the deploy it detached
    pods = await redis.zrange(scope_pods_key(SCOPE), 0, -1)
    assert len(pods) == 1, "the pod is tracked, not leaked"
    assert await redis.sismember(scope_idle_key(SCOPE), pods[0]), "nobody waits: warm pool"
    await assert_nothing_held(redis)


# --- concurrency -------------------------------------------------------------------------------


async def burst(
    instances: list[Instance], n: int, *, again_while_in_progress: bool = False, **kw: Any
) -> list[Any]:
    async def one(inst: Instance, request_id: str) -> AcquiredPod:
        for _ in range(400):  # a route asks again on the scope's signal, or every 0.5 s
            try:
                return await acquire(inst, request_id, **kw)
            except DeployInProgress:
                if not again_while_in_progress:
                    raise
                await asyncio.sleep(0.05)
        raise AssertionError(f"{request_id}: deploys under way for 20 s")

    calls = [one(instances[i % len(instances)], f"burst-{i}") for i in range(n)]
    return await asyncio.gather(*calls, return_exceptions=True)


@pytest.mark.parametrize("replicas", [1, 2])
async def test_cold_burst_deploys_up_to_max_pods_and_fills_their_slots(
    rm: Instance, rm2: Instance, redis: Redis, k8s: FakeK8sPodClient, replicas: int
) -> None:
    """20 callers, pods of 5, max_pods 2: two deploys, each pod handed to its leader and 4
    followers. A caller told the scope's deploys are under way asks again (as a route does):
    once both pods are registered the scope is at max_pods with nothing on its way."""
    instances = [rm, rm2][:replicas]
    results = await burst(
        instances, 20, pool=pool(max_pods=2, pod_concurrency=5), again_while_in_progress=True
    )
    pods = [r.pod_id for r in results if isinstance(r, AcquiredPod)]
    failures = [r for r in results if isinstance(r, Exception)]
    assert k8s.deploy_calls == len(set(pods)) == 2, "max_pods deploys"
    assert sorted(Counter(pods).values()) == [5, 5], "leader + pod_concurrency - 1 followers"
    assert [type(f) for f in failures] == [MaxPodsReached] * 10
    await assert_nothing_held(redis)


async def test_a_deploy_s_pod_goes_to_pod_concurrency_callers_even_while_its_leader_finishes(
    rm: Instance, k8s: FakeK8sPodClient
) -> None:
    """The leader holds its lease past its pod's registration (its on_ready here; a slow Redis
    call on a loaded machine made the cold-burst test hand one pod to 9): its 4 followers take
    the pod and leave; callers that claim meanwhile are not seated in the room they left."""
    cfg = pool(max_pods=1, pod_concurrency=5)
    registered = asyncio.Event()

    async def slow_on_ready(pod: AcquiredPod) -> None:
        registered.set()
        await asyncio.sleep(1.0)

    leader = asyncio.create_task(
        rm.facade.acquire(SCOPE, spec(), cfg, "leader", on_ready=slow_on_ready)
    )
    for _ in range(200):  # the leader's claim first (bounded: 10 s)
        if k8s.deploy_calls:
            break
        await asyncio.sleep(0.05)
    followers = [rm.facade.acquire(SCOPE, spec(), cfg, f"follower-{i}") for i in range(4)]
    seated = await asyncio.gather(*followers)
    assert registered.is_set()
    late = await asyncio.wait_for(
        asyncio.gather(
            *(rm.facade.acquire(SCOPE, spec(), cfg, f"late-{i}") for i in range(4)),
            return_exceptions=True,
        ),
        0.9,  # while the leader's on_ready runs
    )
    pods = [(await leader).pod_id, *(p.pod_id for p in seated)]
    pods += [r.pod_id for r in late if isinstance(r, AcquiredPod)]
    assert k8s.deploy_calls == 1
    assert max(Counter(pods).values()) <= 5, f"one pod handed to {Counter(pods)}"


@pytest.mark.parametrize("replicas", [1, 2])
async def test_duplicates_of_one_demand_make_one_deploy_even_with_no_seat(
    rm: Instance, rm2: Instance, k8s: FakeK8sPodClient, replicas: int
) -> None:
    """pod_concurrency 1 (no follower seat): two acquires for the same demand (a route's
    duplicate whose pending marker lapsed, on either replica) share its one deploy."""
    instances = [rm, rm2][:replicas]
    calls = [
        instances[i % replicas].facade.acquire(
            SCOPE, spec(), pool(pod_concurrency=1), f"dup:{i}", demand_id="the-route"
        )
        for i in range(4)
    ]
    got = await asyncio.gather(*calls)
    assert k8s.deploy_calls == 1
    assert len({p.pod_id for p in got}) == 1


async def test_leader_failure_fails_the_followers_fast(
    rm: Instance, rm2: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    k8s.never_ready = True
    started = time.monotonic()
    results = await burst([rm, rm2], 6, pod_spec=spec(ready_timeout=0.8), pool=pool(max_pods=1))
    elapsed = time.monotonic() - started
    assert k8s.deploy_calls == 1, "followers never take over a failed deploy"
    assert sum(isinstance(r, DeployFailed) for r in results) == 5  # leader + 4 followers
    assert sum(isinstance(r, DeployInProgress) for r in results) == 1  # the room was full
    assert elapsed < 3, f"followers waited {elapsed:.1f}s after the leader failed"
    await assert_nothing_held(redis)


async def test_followers_get_the_pod_within_milliseconds_of_registration(
    rm: Instance, rm2: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    k8s.ready_delay = 0.5
    done: list[float] = []

    async def timed(inst: Instance, i: int) -> None:
        await acquire(inst, f"t-{i}")
        done.append(time.monotonic())

    await asyncio.gather(*(timed([rm, rm2][i % 2], i) for i in range(4)))
    spread = max(done) - min(done)
    # followers wake on the registration signal; the poll (250 ms) is only a safety net
    assert spread < 0.2, f"followers answered {spread * 1000:.0f} ms apart"


async def test_thirty_acquires_on_a_warm_pool_take_distinct_pods(
    rm: Instance, redis: Redis, k8s: FakeK8sPodClient
) -> None:
    await rm.facade.update_pool_config(SCOPE, pool(max_pods=3), spec())
    for i in range(2):
        member = await DeployState(rm.state).add_placeholder(SCOPE, f"warm:{i}", 60)
        assert member is not None
        await rm.orchestrator.deploy_and_register(SCOPE, spec(), member, warm=True)
    results = await burst([rm], 30, pool=pool(max_pods=3, pod_concurrency=1))
    pods = [r.pod_id for r in results if isinstance(r, AcquiredPod)]
    assert len(pods) == len(set(pods)) == 3, "two warm pods, then one deploy (max_pods 3)"
    assert k8s.deploy_calls == 3
    await assert_nothing_held(redis)


# --- idle_consider and cleanup -----------------------------------------------------------------


async def test_idle_consider_is_idempotent(rm: Instance, redis: Redis) -> None:
    pod_id = (await acquire(rm, "r1")).pod_id
    assert await rm.facade.idle_consider(pod_id, SCOPE) == IdleTransition(transitioned_to_idle=True)
    since = await redis.get(pod_idle_since_key(SCOPE, pod_id))
    assert await rm.facade.idle_consider(pod_id, SCOPE) == IdleTransition(
        transitioned_to_idle=False
    )
    assert await redis.get(pod_idle_since_key(SCOPE, pod_id)) == since
    assert await rm.facade.idle_consider("unknown", SCOPE) == IdleTransition(
        transitioned_to_idle=False
    )


async def test_cleanup_deletes_only_agentservers_matching_the_selector(
    rm: Instance, k8s: FakeK8sPodClient
) -> None:
    a = k8s.add_pod(scope_id="s1", deploy_ver="v", labels={"team": "x"})
    b = k8s.add_pod(scope_id="s2", deploy_ver="v")
    other = k8s.add_pod(
        scope_id="s3", deploy_ver="v", labels={"jiuwenclaw-component": "gateway", "team": "x"}
    )
    elsewhere = k8s.add_pod(scope_id="s4", deploy_ver="v", namespace="other")
    # another tool's AgentServer: the component label, no scope label of ours
    unscoped = k8s.add_pod(scope_id="s5", deploy_ver="v", labels={"team": "x"})
    labels = {k: v for k, v in unscoped.labels.items() if k != "agent-runtime/scope"}
    k8s.pods[unscoped.pod_id] = dataclasses.replace(unscoped, labels=labels)
    assert await rm.facade.cleanup(label_selector="team=x") == 1
    assert a.pod_id not in k8s.pods and other.pod_id in k8s.pods, "component label is forced"
    assert unscoped.pod_id in k8s.pods, "the scope label is forced too"
    assert await rm.facade.cleanup() == 1
    assert b.pod_id not in k8s.pods and elsewhere.pod_id in k8s.pods
    assert unscoped.pod_id in k8s.pods and unscoped.pod_id not in k8s.deleted
    k8s.missing_namespaces.add("gone")
    assert await rm.facade.cleanup(namespace="gone") == 0
    k8s.forbidden_namespaces.add("secret")
    with pytest.raises(K8sApiError) as refused:
        await rm.facade.cleanup(namespace="secret")
    assert refused.value.status == 403
