"""Pods in a named cluster (a template's ``kubeconfig``): recorded with their cluster, and
looked for, deleted, adopted and taken over there — by watch, reclaim, reconcile and a
deploy's takeover. A cluster that cannot be asked (down, or removed from the settings) keeps
its pods: absence of evidence is not death.

On the multi-cluster fake (fakeredis and the real Redis), and once end to end on two
kubesim instances (default + named cluster) through the real client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.clusters import read_clusters
from agent_runtime.resource_manager.identity import Ownership
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import DeployFailed, K8sApiError
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state_values import PodPlace
from agent_runtime.resource_manager.views import ResourceViews
from agent_runtime.util import scope_id_of
from contract_keys import rm_pod_known, rm_pod_scope, rm_pods_known
from helpers import IDENTITY, envelope, running_app, sync_body
from kubesim import KubeSim
from kubesim.kubeconfig import render_kubeconfig
from test_local_mode import free_port
from test_rm_jobs import (
    OTHER_SCOPE,
    SCOPE,
    V1,
    VER1,
    Env,
    add_warm,
    assert_purged,
    configure,
    env,
    rm_pod,
    set_idle_age,
    spec,
    warm_set,
)
from test_rm_takeover import (
    dying_and_healthy,
    finished,
    lapsed,
    pool_jobs_of,
    started_leading,
)
from test_rm_takeover import spec as takeover_spec
from test_template_bounds import no_proxy

# fixtures of other modules: ``env`` (test_rm_jobs; it takes this module's ``k8s``), no_proxy
__all__ = ["env", "no_proxy"]

SCOPE_T = "scope-t"  # test_rm_takeover's scope
EAST = spec(kubeconfig="east")
WEST = spec(kubeconfig="west")


@pytest.fixture
def k8s() -> FakeK8sPodClient:
    """Two named clusters besides the default."""
    return FakeK8sPodClient(clusters={"east", "west"})


async def info(redis: Redis, pod_id: str) -> dict[str, str]:
    scope_id = str(await rm_pod_scope(redis, pod_id))
    return dict(await redis.hgetall(rm_pod(scope_id, pod_id, "info")))


# --- the fake: a pod set per cluster -----------------------------------------------------------


async def test_the_fake_keeps_one_pod_set_per_cluster() -> None:
    k8s = FakeK8sPodClient(clusters={"east"})
    east = await k8s.deploy(scope_id=SCOPE, deploy_ver=VER1, pod_spec=EAST, identity=IDENTITY)
    home = await k8s.deploy(scope_id=SCOPE, deploy_ver=VER1, pod_spec=V1, identity=IDENTITY)
    assert (east.cluster, home.cluster) == ("east", None)
    assert list(k8s.pods_in("east")) == [east.pod_id] and list(k8s.pods) == [home.pod_id]
    assert await k8s.get_pod(east.pod_id, "default") is None, "not in the default cluster"
    assert await k8s.get_pod(east.pod_id, "default", cluster="east") is not None
    listed = await k8s.list_pods("default", "", cluster="east")
    assert [p.pod_id for p in listed] == [east.pod_id]
    assert not await k8s.delete(east.pod_id, "default"), "no such pod in the default cluster"
    assert await k8s.delete(east.pod_id, "default", cluster="east")
    assert k8s.deleted_in == [("east", east.pod_id)] and list(k8s.pods) == [home.pod_id]

    with pytest.raises(K8sApiError, match="not configured"):
        await k8s.list_pods("default", "", cluster="west")
    with pytest.raises(DeployFailed, match="not configured"):
        await k8s.deploy(scope_id=SCOPE, deploy_ver=VER1, pod_spec=WEST, identity=IDENTITY)
    k8s.unreachable_clusters.add("east")
    with pytest.raises(K8sApiError, match="unreachable"):
        await k8s.get_pod(home.pod_id, "default", cluster="east")
    with pytest.raises(DeployFailed, match="unreachable"):
        await k8s.deploy(scope_id=SCOPE, deploy_ver=VER1, pod_spec=EAST, identity=IDENTITY)


# --- Redis: the cluster is recorded ------------------------------------------------------------


async def test_a_pod_s_info_names_its_cluster_and_a_default_one_has_no_field(env: Env) -> None:
    await configure(env, EAST)
    await configure(env, V1, scope=OTHER_SCOPE)
    east = await add_warm(env, EAST)
    home = await add_warm(env, V1, scope=OTHER_SCOPE)
    assert (await info(env.redis, east))["cluster"] == "east"
    assert "cluster" not in await info(env.redis, home), "absent: the default (as before)"
    assert await PoolJobsState(env.state).pod_places({east: SCOPE, home: OTHER_SCOPE}) == {
        east: PodPlace("east", "default"),
        home: PodPlace(None, "default"),
    }


# --- watch -------------------------------------------------------------------------------------


async def test_watch_keeps_a_named_cluster_s_pod_and_cleans_it_there_once_dead(env: Env) -> None:
    await configure(env, EAST)
    await configure(env, V1, scope=OTHER_SCOPE)
    east = await add_warm(env, EAST)
    home = await add_warm(env, V1, scope=OTHER_SCOPE)
    for _ in range(3):  # listed, probed healthy: never "missing"
        assert await env.pool_jobs.watch_once() == 0
    assert set(await rm_pods_known(env.redis)) == {east, home}
    assert env.sessions.dead == [] and env.k8s.deleted == []

    env.k8s.kill(east, cluster="east")
    assert await env.pool_jobs.watch_once() == 1
    assert env.k8s.deleted_in == [("east", east)], "deleted in its own cluster"
    await assert_purged(env.redis, east)
    assert env.sessions.dead == [east]
    assert home in env.k8s.pods and await rm_pod_known(env.redis, home)


@pytest.mark.parametrize("how", ["unreachable", "removed"])
async def test_a_cluster_that_cannot_be_asked_keeps_its_pods(
    env: Env, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Watch and reconcile skip the cluster for the pass (a warning), and neither forget nor
    delete its pods; reclaim's delete fails there, so the pod goes back to the pool. Once
    the cluster answers again, everything goes on as before."""
    await configure(env, EAST, pod_ttl=60)
    east = await add_warm(env, EAST)
    if how == "unreachable":
        env.k8s.unreachable_clusters.add("east")
    else:
        env.k8s.clusters = {"west"}  # the operator removed it from AGENT_RUNTIME_CLUSTERS
    with caplog.at_level(logging.WARNING, logger="agent_runtime.resource_manager.places"):
        assert await env.pool_jobs.watch_once() == 0
        counts = await env.pool_jobs.reconcile_once()
    assert counts["purged"] == counts["deleted"] == counts["adopted"] == 0, counts
    assert "cluster east, namespace default: list failed" in caplog.text
    await set_idle_age(env.redis, east, 3600)
    assert await env.pool_jobs.reclaim_once() == 0, "its delete failed: back to the pool"
    assert await rm_pod_known(env.redis, east) and east in await warm_set(env.redis)
    assert east in env.k8s.pods_in("east") and env.sessions.dead == []

    env.k8s.unreachable_clusters.clear()
    env.k8s.clusters = {"east", "west"}
    assert await env.pool_jobs.watch_once() == 0
    await set_idle_age(env.redis, east, 3600)
    assert await env.pool_jobs.reclaim_once() == 1
    assert env.k8s.deleted_in == [("east", east)]


# --- reclaim -----------------------------------------------------------------------------------


async def test_reclaim_deletes_in_the_pod_s_cluster_after_the_template_moved(env: Env) -> None:
    """``kubeconfig`` is no part of the version: the template moving to another cluster leaves
    the pod current, where it runs; reclaim deletes it there."""
    await configure(env, EAST, pod_ttl=60)
    east = await add_warm(env, EAST)
    await configure(env, WEST, pod_ttl=60)  # same deploy_ver
    assert await env.pool_jobs.watch_once() == 0
    assert (await env.pool_jobs.reconcile_once())["purged"] == 0
    await set_idle_age(env.redis, east, 3600)
    assert await env.pool_jobs.reclaim_once() == 1
    assert env.k8s.deleted_in == [("east", east)]
    assert env.k8s.pods_in("east") == {} and env.k8s.pods_in("west") == {}
    await assert_purged(env.redis, east)


# --- reconcile ---------------------------------------------------------------------------------


async def test_reconcile_adopts_and_deletes_orphans_in_their_own_cluster(env: Env) -> None:
    """Redis forgot them (a data loss): reconcile lists every cluster + namespace the pool
    configs name; ours is adopted with its cluster, a dead one of ours is deleted there, a
    foreign one is reported with its cluster and left alone."""
    await configure(env, EAST, max_pods=4)
    ours = env.k8s.add_pod(
        scope_id=SCOPE, deploy_ver=VER1, identity=IDENTITY, pod_spec=EAST, cluster="east"
    ).pod_id
    dead = env.k8s.add_pod(
        scope_id=SCOPE, deploy_ver=VER1, identity=IDENTITY, pod_spec=EAST, cluster="east",
        phase="Failed",
    ).pod_id  # fmt: skip
    theirs = env.k8s.add_pod(scope_id=SCOPE, deploy_ver=VER1, cluster="east").pod_id
    counts = await env.pool_jobs.reconcile_once()
    assert (counts["adopted"], counts["deleted"], counts["foreign"]) == (1, 1, 1), counts
    assert (await info(env.redis, ours))["cluster"] == "east"
    assert ours in await warm_set(env.redis)
    assert env.k8s.deleted_in == [("east", dead)]
    assert theirs in env.k8s.pods_in("east")
    _, report = await ResourceViews(env.state).foreign_pods()
    assert [(p["cluster"], p["pod_id"]) for p in report] == [("east", theirs)]
    # adopted with its cluster: the next pass lists it there, and reclaim deletes it there
    assert await env.pool_jobs.watch_once() == 0
    assert (await env.pool_jobs.reconcile_once())["purged"] == 0
    await set_idle_age(env.redis, ours, 3600)
    assert await env.pool_jobs.reclaim_once() == 1
    assert env.k8s.deleted_in == [("east", dead), ("east", ours)]


async def test_reconcile_purges_a_pod_gone_from_its_own_cluster_only(env: Env) -> None:
    await configure(env, EAST)
    await configure(env, V1, scope=OTHER_SCOPE)
    east = await add_warm(env, EAST)
    home = await add_warm(env, V1, scope=OTHER_SCOPE)
    env.k8s.remove(east, cluster="east")
    assert (await env.pool_jobs.reconcile_once())["purged"] == 1
    await assert_purged(env.redis, east)
    assert await rm_pod_known(env.redis, home)


# --- a dead deploy leader's pod ----------------------------------------------------------------


async def test_a_taker_adopts_a_dead_leader_s_pod_in_the_recorded_cluster(redis: Redis) -> None:
    """The leader died after its create in ``east``; the template has moved back to the
    default cluster since. The record names ``east``: the taker signs, awaits and registers
    the pod there instead of deploying anew."""
    k8s = FakeK8sPodClient(ready_delay=1.0, clusters={"east"})
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a", pod_spec=takeover_spec(kubeconfig="east")))
        orphan = await started_leading(dying, redis)
        record = f"resource_manager:resource:scope:{{{SCOPE_T}}}:deploy_pod:r-a"
        assert await redis.hget(record, "cluster") == "east"
        assert orphan in k8s.pods_in("east") and k8s.pods == {}
        got = await b.acquire("r-b", pod_spec=takeover_spec())
        await finished(leading)
        assert got.pod_id == orphan and k8s.deploy_calls == 1
        pod = k8s.pods_in("east")[orphan]
        assert IDENTITY.verify(pod).ownership is Ownership.OURS, "signed in its cluster"
        assert (await info(redis, orphan))["cluster"] == "east"


async def test_reconcile_settles_a_dead_leader_s_pod_in_the_recorded_cluster(
    redis: Redis,
) -> None:
    k8s = FakeK8sPodClient(ready_delay=0.2, clusters={"east"})
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        east = takeover_spec(kubeconfig="east")
        leading = asyncio.create_task(a.acquire("r-a", pod_spec=east))
        orphan = await started_leading(dying, redis)
        deadline = time.monotonic() + 15
        while not await lapsed(redis):
            assert time.monotonic() < deadline, "the dead leader's lease did not lapse"
            await asyncio.sleep(0.05)
        counts = await pool_jobs_of(b, k8s).reconcile_once()
        assert counts["adopted"] == 1, counts
        assert IDENTITY.verify(k8s.pods_in("east")[orphan]).ownership is Ownership.OURS
        assert (await info(redis, orphan))["cluster"] == "east"
        await finished(leading)


# --- end to end: two kubesim instances, the real client ----------------------------------------


@pytest.fixture
async def sims(no_proxy: None) -> AsyncIterator[tuple[KubeSim, KubeSim]]:
    """The process default cluster and ``east``: distinct pod IP ranges, so that their
    AgentServers never want the same loopback address and port."""
    common: dict[str, Any] = {"ready_delay": 0.05, "grace_period": 0.2, "probe_period": 0.05}
    async with (
        KubeSim(first_pod_ip="127.0.60.2", seed=1, **common) as home,
        KubeSim(first_pod_ip="127.0.61.2", seed=2, **common) as east,
    ):
        yield home, east


async def test_on_two_kubesims_a_named_cluster_s_pod_is_watched_and_reclaimed_there(
    sims: tuple[KubeSim, KubeSim], tmp_path: Path
) -> None:
    home, east = sims
    east_config = tmp_path / "east.kubeconfig"
    east_config.write_text(render_kubeconfig(east.url))
    clusters = {"east": str(east_config)}
    client = RealK8sPodClient(
        kubeconfig=str(home.kubeconfig_path),
        default_namespace="default",
        clusters=read_clusters(clusters, ()),
    )
    db = Database.from_url(f"sqlite:///{tmp_path / 'config.db'}")
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    group, bot = "g-east", "b-east"
    sid = scope_id_of(group, bot)
    port = free_port()
    template = {
        "template_id": "tpl-east", "image": "agentserver:1", "pod_name": "agent",
        "kubeconfig": "east", "sse_port": port, "container_port": port,
        "scope_concurrency": 4, "pod_concurrency": 1, "pod_ttl": 1, "min_idle_pods": 0,
        "ready_timeout": 10, "ready_poll_interval": 0.03,
    }  # fmt: skip
    rule = {"group_id": group, "bot_id": bot, "template_id": "tpl-east"}
    try:
        await client.start()
        async with running_app(redis, db, k8s=client, clusters=clusters) as app:  # type: ignore[arg-type]
            svc = app.app.state.services  # type: ignore[attr-defined]
            for kind, item in (("template", template), ("routing_rule", rule)):
                resp = await app.post(
                    "/api/session/config_sync", json=sync_body(kind, "sync", item)
                )
                assert resp.status_code == 200, resp.text

            async def route(session_id: str) -> dict[str, Any]:
                body = envelope(
                    request_id=f"r-{uuid.uuid4().hex[:10]}", session_id=session_id, bot_id=bot,
                    extra={"group_id": group},
                )  # fmt: skip
                resp = await app.post("/api/session/route", json=body)
                assert resp.status_code == 200, resp.text
                data: dict[str, Any] = resp.json()["data"]
                return data

            pod_id = (await route("s-1"))["pod_id"]
            assert [p["metadata"]["name"] for p in east.pods("default")] == [pod_id]
            assert home.pods("default") == [], "nothing in the default cluster"
            assert (await info(redis, pod_id)).get("cluster") == "east"

            for _ in range(3):  # listed in east, probed healthy: kept
                assert await svc.pool_jobs.watch_once() == 0
            counts = await svc.pool_jobs.reconcile_once()
            assert (counts["purged"], counts["adopted"], counts["deleted"]) == (0, 0, 0), counts
            again = await route("s-1")
            assert (again["pod_id"], again["placement"]) == (pod_id, "refresh"), "still its pod"
            assert home.requests["delete pods"] == east.requests["delete pods"] == 0

            # the session ends, the pod goes warm, and reclaim deletes it where it runs
            resp = await app.post(
                "/api/session/touch", json=envelope({"eos": True}, session_id="s-1")
            )
            assert resp.status_code == 200 and resp.json()["data"]["released"], resp.text
            deadline = time.monotonic() + 15
            idle = f"resource_manager:resource:scope:{{{sid}}}:idle"
            while pod_id not in await redis.smembers(idle):
                assert time.monotonic() < deadline, "the empty pod never went warm"
                await svc.session_sweeper.sweep_once()
                await svc.session_sweeper.wait_for_notices()
                await asyncio.sleep(0.1)
            while await svc.pool_jobs.reclaim_once() == 0:
                assert time.monotonic() < deadline, "the warm pod was never reclaimed"
                await asyncio.sleep(0.2)
            assert east.requests["delete pods"] == 1 and home.requests["delete pods"] == 0
            assert not await rm_pod_known(redis, pod_id)
            while east.pod("default", pod_id) is not None:  # its grace period
                assert time.monotonic() < deadline, "the pod is still in east"
                await asyncio.sleep(0.05)
    finally:
        await client.close()
        await db.close()
        await redis.aclose()
