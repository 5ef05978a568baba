"""WAIT after an admission script (AGENT_RUNTIME_REDIS_WAIT_REPLICAS): on the connection that
wrote, counted when short, never an error; real Redis without a replica (short: counted), the
Sentinel set (master + 1 replica: acknowledged) and the cluster (the key's master and its
replica). fakeredis has no WAIT: the embedded Redis never waits."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from agent_runtime import lua
from agent_runtime.config import Settings
from agent_runtime.metrics import Metrics
from agent_runtime.wiring import replica_wait

# a write, as an admission script makes one; its reply says whether it "binds"
SCRIPT = "redis.call('SET', KEYS[1], ARGV[1], 'EX', 60) return ARGV[1]"


class Shorts:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, use: str, acked: int) -> None:
        self.seen.append((use, acked))


async def run(redis: Redis, key: str, value: str, wait: lua.ReplicaWait | None) -> str:
    script = redis.register_script(SCRIPT)
    return str(
        await lua.run_acked(
            redis, script, keys=[key], args=[value], wait=wait, use="test",
            binds=lambda reply: reply == "binds",
        )
    )  # fmt: skip


@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_no_replica_the_wait_times_out_and_is_counted_not_failed(redis: Redis) -> None:
    shorts = Shorts()
    wait = lua.ReplicaWait(replicas=1, timeout_ms=20, short=shorts)
    # (the first call meets NOSCRIPT on a fresh server: loaded on the same connection)
    assert await run(redis, "agent_runtime_test:w", "binds", wait) == "binds"
    assert await redis.get("agent_runtime_test:w") == "binds"  # written all the same
    assert shorts.seen == [("test", 0)]
    # an outcome that does not bind sends no WAIT: nothing counted
    assert await run(redis, "agent_runtime_test:w", "refresh", wait) == "refresh"
    assert shorts.seen == [("test", 0)]


async def test_off_runs_the_script_alone(redis: Redis) -> None:
    """Off (and on fakeredis, which has no WAIT): the script as it always ran."""
    assert await run(redis, "agent_runtime_test:w", "binds", None) == "binds"
    assert await redis.get("agent_runtime_test:w") == "binds"


@pytest.mark.real_backend
async def test_sentinel_master_with_its_replica_acknowledges(redis_sentinel: Redis) -> None:
    shorts = Shorts()
    wait = lua.ReplicaWait(replicas=1, timeout_ms=2000, short=shorts)
    key = f"agent_runtime_test:{uuid.uuid4().hex[:8]}:w"
    # the set healthy first (its replica online and in sync: a failover just before leaves it
    # resyncing for a moment)
    await redis_sentinel.set(key, "0", ex=60)
    for _ in range(100):
        if await redis_sentinel.wait(1, 100) == 1:
            break
    else:
        pytest.fail("the Sentinel set's replica never acknowledged within 10 s")
    for _ in range(5):
        assert await run(redis_sentinel, key, "binds", wait) == "binds"
    assert shorts.seen == []  # WAIT 1 answered 1 each time


@pytest.mark.real_backend
async def test_cluster_waits_on_the_keys_master(redis_cluster: Redis, cluster_tag: str) -> None:
    shorts = Shorts()
    wait = lua.ReplicaWait(replicas=1, timeout_ms=2000, short=shorts)
    for i in range(6):  # keys on several masters
        key = f"agent_runtime_test:{{{cluster_tag}-{i}}}:w"
        assert await run(redis_cluster, key, "binds", wait) == "binds"
        assert await redis_cluster.get(key) == "binds"
    assert shorts.seen == []  # each master's replica acknowledged its write
    # more replicas than a master has: short, counted
    wait = lua.ReplicaWait(replicas=2, timeout_ms=20, short=shorts)
    assert await run(redis_cluster, f"agent_runtime_test:{{{cluster_tag}}}:w", "binds", wait)
    assert shorts.seen == [("test", 1)]


def test_the_settings_turn_it_on_and_a_short_wait_is_a_metric() -> None:
    metrics = Metrics()
    assert replica_wait(Settings(redis_wait_replicas=0), metrics) is None
    # the embedded fakeredis (no URL) has no replica to wait for
    assert replica_wait(Settings(redis_wait_replicas=1), metrics) is None
    wait = replica_wait(
        Settings(redis_url="redis://127.0.0.1:6379/0", redis_wait_replicas=2), metrics
    )
    assert wait is not None and (wait.replicas, wait.timeout_ms) == (2, 50)
    wait.short("route_place", 0)
    wait.short("route_place", 1)
    sample = metrics.registry.get_sample_value(
        "agent_runtime_redis_wait_short_total", {"script": "route_place"}
    )
    assert sample == 2
