"""The app's lifespan with the background jobs on: ready only once jobs run, one leader per
job across two replicas, locks given back on shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.jobs import JOB_LOCK_PREFIX
from helpers import make_settings, other_client, running_app

JOBS = ("rm_autoscale", "rm_reclaim", "rm_watch", "rm_reconcile")


def job_samples(text: str) -> dict[str, dict[str, float]]:
    """sample name → job → value, from a Prometheus text page."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "job" in sample.labels:
                found.setdefault(sample.name, {})[sample.labels["job"]] = sample.value
    return found


async def wait_for(predicate, within: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_two_replicas_lead_each_job_once_and_give_locks_back(
    redis: Redis, db: Database
) -> None:
    second = other_client(redis)
    fast = {"jobs_enabled": True, "autoscale_interval": 0.1, "reclaim_interval": 0.1,
            "watch_interval": 0.1, "reconcile_interval": 0.1}  # fmt: skip
    async with (
        running_app(redis, db, instance_id="a", **fast) as a,
        running_app(second, db, instance_id="b", **fast) as b,
    ):
        assert (await a.get("/healthz")).json() == {"ok": True, "instance_id": "a"}
        assert (await b.get("/healthz")).json() == {"ok": True, "instance_id": "b"}

        async def all_led() -> bool:
            return all([await redis.exists(JOB_LOCK_PREFIX + j) for j in JOBS])

        await wait_for(all_led)
        runners = [a.app.state.services.jobs, b.app.state.services.jobs]  # type: ignore[attr-defined]
        for name in JOBS:
            leaders = [await r.is_leader(name) for r in runners]
            assert leaders.count(True) == 1, f"{name}: {leaders}"

        # each job runs a few ticks (a tick's length depends on the machine's load: wait for
        # them, bounded, rather than a fixed time)
        async def ticked() -> bool:
            return all(max(r.jobs[name].runs for r in runners) >= 3 for name in JOBS)

        await wait_for(ticked)
        for name in JOBS:
            runs = [r.jobs[name].runs for r in runners]
            assert min(runs) == 0 and max(runs) >= 3, f"{name} ran on both replicas: {runs}"
        # the same, as an operator sees it: each replica's /metrics
        scraped = [job_samples((await c.get("/metrics")).text) for c in (a, b)]
        for name in JOBS:
            leaders = [s["agent_runtime_job_leader"][name] for s in scraped]
            runs_seen = [s["agent_runtime_job_runs_total"][name] for s in scraped]
            assert sorted(leaders) == [0.0, 1.0], (name, leaders)
            leader = leaders.index(1.0)
            assert runs_seen[leader] >= 3 and runs_seen[1 - leader] == 0, (name, runs_seen)
            assert scraped[leader]["agent_runtime_job_last_success_timestamp_seconds"][name] > 0
            assert scraped[leader]["agent_runtime_job_failures_total"][name] == 0
    for name in JOBS:
        assert not await redis.exists(JOB_LOCK_PREFIX + name), f"{name} lock kept after stop"
    await second.aclose()


async def test_healthz_is_503_when_the_jobs_are_not_running(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, jobs_enabled=True) as client:
        assert (await client.get("/healthz")).status_code == 200
        await client.app.state.services.jobs.stop()  # type: ignore[attr-defined]
        response = await client.get("/healthz")
        assert response.status_code == 503 and response.json()["ok"] is False


class _ConfigRedis:
    """Just enough of a Redis client for ``warn_on_eviction``."""

    def __init__(self, reply: object) -> None:
        self.reply = reply

    async def config_get(self, name: str) -> object:
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


async def test_startup_warns_loudly_unless_redis_is_noeviction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from agent_runtime.wiring import warn_on_eviction

    caplog.set_level(logging.INFO, logger="agent_runtime.wiring")
    lru = _ConfigRedis({"maxmemory-policy": "allkeys-lru"})
    assert await warn_on_eviction(lru) == "allkeys-lru"  # type: ignore[arg-type]
    assert any(
        r.levelno == logging.WARNING and "REDIS MAY EVICT KEYS" in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    safe = _ConfigRedis({"maxmemory-policy": "noeviction"})
    assert await warn_on_eviction(safe) == "noeviction"  # type: ignore[arg-type]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    managed = _ConfigRedis(PermissionError("CONFIG is disabled"))
    assert await warn_on_eviction(managed) is None  # type: ignore[arg-type]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class _InfoRedis:
    """Just enough of a Redis client for ``check_redis_version``."""

    def __init__(self, reply: object) -> None:
        self.reply = reply

    async def info(self, section: str) -> object:
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


async def test_startup_refuses_a_redis_older_than_7(redis: Redis) -> None:
    from agent_runtime.config import ConfigError
    from agent_runtime.wiring import check_redis_version

    with pytest.raises(ConfigError, match=r"redis 6\.2\.14 is too old: .* 7\.0 or later"):
        await check_redis_version(_InfoRedis({"redis_version": "6.2.14"}))  # type: ignore[arg-type]
    assert await check_redis_version(_InfoRedis({"redis_version": "7.0.15"})) == "7.0.15"  # type: ignore[arg-type]
    assert await check_redis_version(_InfoRedis(PermissionError("INFO is disabled"))) is None  # type: ignore[arg-type]
    # the real server is new enough; fakeredis has no INFO (never checked: no URL, no check)
    seen = await check_redis_version(redis)
    if "server" not in redis.connection_pool.connection_kwargs:  # the real server
        assert seen is not None and int(seen.split(".")[0]) >= 7
    else:
        assert seen is None


@pytest.mark.real_backend
async def test_every_cluster_master_is_asked_its_version(redis_cluster: Redis) -> None:
    from agent_runtime.wiring import check_redis_version

    version = await check_redis_version(redis_cluster)
    assert version is not None and int(version.split(".")[0]) >= 7


async def test_the_real_redis_policy_is_read(redis: Redis) -> None:
    from agent_runtime.wiring import warn_on_eviction

    policy = await warn_on_eviction(redis)  # never fails startup, whatever the server says
    if "server" not in redis.connection_pool.connection_kwargs:  # the real server
        assert policy == (await redis.config_get("maxmemory-policy"))["maxmemory-policy"]


async def test_local_mode_with_the_embedded_fakeredis_says_nothing_about_eviction(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """fakeredis has no CONFIG: the "could not be read; make sure it is noeviction" line read
    like a problem to fix on a fresh local start, where there is nothing to fix."""
    from agent_runtime.wiring import build_backends, check_backends

    caplog.set_level(logging.INFO)
    settings = make_settings(sqlite_path=tmp_path / "local.db")
    backends = build_backends(settings)
    try:
        await check_backends(settings, backends)
    finally:
        await backends.redis.aclose()
        await backends.db.close()
    assert not [r for r in caplog.records if "maxmemory" in r.getMessage()]
