"""Moving an installation from one Redis server to a Redis Cluster, the way docs/operations.md
("Moving an installation") tells an operator to: the replicas stopped, every key copied with
its TTL by ``redis-cli --cluster import … --cluster-copy --cluster-replace`` (which MIGRATEs each
key to the master of its slot), the replicas started on ``redis+cluster://``. The key layout is
the same on both, so the live sessions keep their pods: their next route is a ``refresh`` on
the same pod, an ``eos`` frees the seat, a new session is placed beside them.

Real servers: a private ``redis-server`` (the source, on a free loopback port, stopped by PID)
and the tests' cluster (scripts/redis_topologies.sh), owned by this run and emptied before and
after."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from redis.asyncio import Redis

import helpers
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.util import scope_id_of
from contract_keys import sm_session
from helpers import IN_CI, PrivateRedis, running_app
from test_faults import BOT, GROUP, configure, pod_of, route, touch

pytestmark = [
    pytest.mark.real_backend,
    pytest.mark.timeout(240),
    pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True),
]

SESSION_TTL = 600  # the sessions must outlive the copy on a slow machine
LASTING = 30  # seconds of TTL a key must have left to be sure to outlive the copy


def _redis_cli() -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        message = "redis-cli is not installed (scripts/services.sh installs it)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return binary


async def _keys(client: Redis) -> set[str]:
    markers = {helpers.CLUSTER_CLAIM, helpers.CLUSTER_OWNER}
    return {key async for key in client.scan_iter(count=1000) if key not in markers}


async def test_sessions_keep_their_pods_when_the_keys_move_to_a_cluster(
    private_redis: type[PrivateRedis], db: Database
) -> None:
    redis_cli = _redis_cli()
    source = private_redis()
    k8s = FakeK8sPodClient()  # the installation's Kubernetes: the same before and after
    sessions = [f"s-move-{i}" for i in range(8)]
    scope = scope_id_of(GROUP, BOT)

    server = source.client()
    try:
        async with running_app(server, db, k8s=k8s) as app:
            await configure(app, scope_concurrency=50, pod_concurrency=3, session_ttl=SESSION_TTL)
            pods = {s: pod_of(await route(app, s)) for s in sessions}
        assert len(set(pods.values())) == 3  # 8 sessions on pods of 3
        ttls_before = {key: await server.ttl(key) for key in await _keys(server)}
    finally:
        await server.aclose()

    cluster = await helpers.claim_cluster_whole()
    try:
        first_node = helpers.CLUSTER_URL.split("://", 1)[1].split(",", 1)[0]
        proc = await asyncio.create_subprocess_exec(
            redis_cli,
            "--cluster",
            "import",
            first_node,
            "--cluster-from",
            f"127.0.0.1:{source.port}",
            "--cluster-copy",
            "--cluster-replace",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, output.decode(errors="replace")[-2000:]

        # every key arrives under its own name, but those that lapse meanwhile: a deploy's
        # record lives one deploy lease (5 s), and a loaded machine takes longer than that
        lasting = {k: ttl for k, ttl in ttls_before.items() if ttl == -1 or ttl >= LASTING}
        arrived = await _keys(cluster)
        assert set(lasting) <= arrived <= set(ttls_before), set(lasting) ^ arrived
        assert await cluster.exists(sm_session(scope, sessions[0]))
        for key, before in lasting.items():  # the copy kept every TTL (MIGRATE carries it)
            after = await cluster.ttl(key)
            assert (0 < after <= before) if before > 0 else after == before, (key, before, after)
        assert any(ttl > 0 for ttl in lasting.values())  # some did have one

        async with running_app(cluster, db, k8s=k8s) as app:
            for session in sessions:
                resp = await route(app, session)
                assert pod_of(resp) == pods[session], session
                assert resp.json()["data"]["placement"] == "refresh", resp.text
            ended = await touch(app, sessions[0], eos=True)
            assert ended == {"touched": True, "released": True}
            # the freed seat is usable: a new session goes to a pod with room
            resp = await route(app, "s-move-new")
            assert pod_of(resp) in set(pods.values())
            assert resp.json()["data"]["placement"] == "placed", resp.text
    finally:
        await helpers.release_cluster_whole(cluster)
        await cluster.aclose()
