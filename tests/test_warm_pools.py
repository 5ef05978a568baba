"""Predictive warm pools (issue 16, section 2): the policy (pure), its measurements in Redis
(the arrival rates route_place keeps, the deploy times the deployer records), the template
field ``warm_pool`` from config_sync to the resource manager's pool config, and autoscale and
reclaim sizing a predictive scope by its demand — through the public interface, on fakeredis
and the real Redis. Key names are the reference's, spelled out (contract_keys).
"""

from __future__ import annotations

import asyncio
import math
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from sqlalchemy import create_engine, inspect, select

from agent_runtime.db import schema
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import service_config_template
from agent_runtime.resource_manager.pool_jobs import PoolJobs
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.warm_policy import (
    DEFAULT_DEPLOY_TIME,
    WarmInputs,
    arrival_rate,
    base_stock,
    counted_arrival,
    deploy_time_of,
    plan,
    poisson_lower,
    poisson_upper,
    predictive_plan,
    reclaimable,
    static_plan,
)
from agent_runtime.session_manager import config_repo
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.state import SessionState
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import Services
from contract_keys import rm_scope, sm_scope
from helpers import make_sql_backend, running_app, sync_body

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the bench's simulation (bench/ is not a package of the wheel)
    sys.path.insert(0, str(ROOT))

from bench.warm_pool_sim import Simulation, Template, Trace  # noqa: E402

SYNC = "/api/session/config_sync"
ROUTE = "/api/session/route"
GROUP, BOT = "grp-warm", "bot-warm"
SID = scope_id_of(GROUP, BOT)

# --- the policy, pure ----------------------------------------------------------------------------


def inputs(**overrides: Any) -> WarmInputs:
    base: dict[str, Any] = {
        "pod_concurrency": 1, "pods": 0, "idle_pods": 0, "sessions": 0, "in_flight": 0,
        "warm_in_flight": 0, "queued": 0, "min_idle_pods": 0, "max_pods": 1000,
    }  # fmt: skip
    base.update(overrides)
    return WarmInputs(**base)


def test_poisson_upper_quantile() -> None:
    assert poisson_upper(0.0, 0.05) == 0
    assert poisson_upper(0.15, 0.05) == 1  # P(0) = 0.86 < 0.95: one slot
    assert poisson_upper(0.04, 0.05) == 0  # P(0) = 0.96: none needed
    assert poisson_upper(1.0, 0.05) == 3  # P(≤2) = 0.920, P(≤3) = 0.981
    assert poisson_upper(10.0, 0.05) == 15  # P(≤14) = 0.917, P(≤15) = 0.951
    big = poisson_upper(10_000.0, 0.05)  # the normal approximation: mean + 1.645 sd
    assert 10_150 <= big <= 10_170


def test_static_plan_is_the_min_idle_floor() -> None:
    assert static_plan(inputs(min_idle_pods=3, idle_pods=1, warm_in_flight=1)).deploy == 1
    assert static_plan(inputs(min_idle_pods=3, idle_pods=1)).keep_idle == 3
    assert static_plan(inputs(min_idle_pods=3, idle_pods=5)).deploy == 0
    # a rate means nothing to a static pool
    assert static_plan(inputs(min_idle_pods=0, rate=50.0, deploy_time=20.0)).deploy == 0
    assert plan("unknown", inputs(min_idle_pods=2)) == static_plan(inputs(min_idle_pods=2))


def test_predictive_plan_covers_one_deploy_time_of_arrivals() -> None:
    # 1 new session/s, deploys take 10 s: the base stock is the 95 % quantile (15) + 1: an
    # arrival finds a slot when fewer than 16 arrived in the deploy time before it
    bare = predictive_plan(inputs(rate=1.0, deploy_time=10.0))
    assert (bare.need_slots, bare.deploy, bare.keep_idle) == (16, 16, 16)
    # free slots count: 5 warm pods and 2 deploys in flight
    some = predictive_plan(
        inputs(rate=1.0, deploy_time=10.0, pods=5, idle_pods=5, in_flight=2, warm_in_flight=2)
    )
    assert some.deploy == 9 and some.keep_idle == 16
    # routes waiting need slots on top
    assert predictive_plan(inputs(rate=1.0, deploy_time=10.0, queued=4)).deploy == 20
    # pod_concurrency: slots, then pods; free slots on pods in use lower the warm target
    shared = predictive_plan(
        inputs(rate=1.0, deploy_time=10.0, pod_concurrency=5, pods=2, idle_pods=0, sessions=6)
    )
    assert shared.deploy == math.ceil((16 - 4) / 5) and shared.keep_idle == 3
    # never below the static floor
    quiet = predictive_plan(inputs(min_idle_pods=2))
    assert (quiet.deploy, quiet.keep_idle) == (2, 2)


def test_sessions_ending_meanwhile_give_slots_back() -> None:
    # 1/s arriving and (steady state) 1/s ending among 100 live sessions: over 10 s the
    # base stock (16) less the endings counted on (P(N >= 5) >= 95 %: 5)
    steady = predictive_plan(
        inputs(rate=1.0, departure_rate=1.0, deploy_time=10.0, pods=100, sessions=100)
    )
    assert steady.need_slots == 16 - 5 and steady.deploy == 11
    # no session lives: nothing can end
    assert predictive_plan(inputs(rate=1.0, departure_rate=1.0, deploy_time=10.0)).deploy == 16
    assert poisson_lower(0.1, 0.05) == 0 and poisson_lower(10.0, 0.05) == 5


def test_predictive_plan_is_clamped_by_max_pods_and_the_budget() -> None:
    busy = {"rate": 5.0, "deploy_time": 20.0}
    assert predictive_plan(inputs(**busy, max_pods=10, pods=3, in_flight=2)).deploy == 5
    assert predictive_plan(inputs(**busy, budget_room=4)).deploy == 4
    assert predictive_plan(inputs(**busy, budget_room=0)).deploy == 0
    assert predictive_plan(inputs(**busy, max_pods=3, pods=3)).deploy == 0


def test_a_small_tenant_is_covered_by_the_quantile_not_the_mean() -> None:
    # 0.01 new sessions/s, deploys of 15 s: a mean of 0.15, yet two slots (one for the next
    # arrival, one for an arrival before the slot that replaces it is Ready)
    small = predictive_plan(inputs(rate=0.01, deploy_time=15.0))
    assert small.keep_idle == 2 and small.deploy == 2
    assert predictive_plan(inputs(rate=0.01, deploy_time=15.0, pods=2, idle_pods=2)).deploy == 0
    # a tenant quiet for long (its 300 s EWMA decayed far): nothing of its own
    assert predictive_plan(inputs(rate=0.0005, deploy_time=15.0)).keep_idle == 0
    assert base_stock(0.009, 0.05) == 0 and base_stock(0.15, 0.05) == 2


def test_reclaimable_keeps_the_target_and_the_young() -> None:
    idle = {"old": 0.0, "mid": 50.0, "young": 95.0}
    assert reclaimable(1, idle, now=100.0, after=30.0) == ["mid"]  # "old" is kept, "young" young
    assert reclaimable(0, idle, now=100.0, after=30.0) == ["old", "mid"]
    assert reclaimable(3, idle, now=1000.0, after=30.0) == []


def test_a_predictive_pool_lets_unneeded_pods_go_after_one_deploy_time() -> None:
    assert static_plan(inputs(pod_ttl=300.0)).reclaim_after == 300.0
    assert predictive_plan(inputs(pod_ttl=300.0, deploy_time=12.0)).reclaim_after == 12.0
    assert predictive_plan(inputs(pod_ttl=5.0, deploy_time=12.0)).reclaim_after == 5.0


def test_arrival_rate_believes_a_crowd_not_one_arrival() -> None:
    one = counted_arrival(0.0, 0.0, 0.0, 15.0)
    assert arrival_rate(one, 1 / 300) == pytest.approx(1 / 300)
    crowd = 0.0
    for t in range(30):  # 10 new sessions a second for 3 s
        crowd = counted_arrival(crowd, t / 10, (t + 1) / 10, 15.0)
    assert arrival_rate(crowd, 0.01) > 1.0


def test_deploy_time_is_a_high_percentile() -> None:
    assert deploy_time_of([]) == DEFAULT_DEPLOY_TIME
    assert deploy_time_of([float(s) for s in range(1, 11)]) == 9.0
    assert deploy_time_of([3.0]) == 3.0


# --- the measurements in Redis -----------------------------------------------------------------


async def test_deploy_times_are_capped_newest_first_and_expire(redis: Redis) -> None:
    state = ResourceState(redis)
    for n in range(40):
        await state.record_deploy_time(SID, float(n))
    key = rm_scope(SID, "deploy_times")
    stored = await redis.lrange(key, 0, -1)
    assert len(stored) == 32 and float(stored[0]) == 39.0 and float(stored[-1]) == 8.0
    assert 0 < await redis.ttl(key) <= 86400
    with pytest.raises(Exception, match="not a duration"):
        await state.record_deploy_time(SID, -1.0)
    assert await redis.llen(key) == 32, "a refused record changes nothing"
    jobs_state = PoolJobsState(state)
    times = await jobs_state.deploy_times_of([SID, "scope-none"])
    assert times["scope-none"] == [] and times[SID][0] == 39.0
    assert await jobs_state.pod_counts_of([SID]) == {SID: 0}


# --- through the app ---------------------------------------------------------------------------


def services(client: httpx.AsyncClient) -> Services:
    found: Services = client.app.state.services  # type: ignore[attr-defined]
    return found


async def sync(client: httpx.AsyncClient, kind: str, op: str, item: dict[str, Any]) -> Any:
    resp = await client.post(SYNC, json=sync_body(kind, op, item))
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


async def setup(client: httpx.AsyncClient, **template: Any) -> None:
    fields = {"scope_concurrency": 40, "pod_concurrency": 1, "pod_ttl": 1, **template}
    await sync(client, "template", "create", {"template_id": "t", "image": "img:1", **fields})
    await sync(
        client, "routing_rule", "create", {"group_id": "*", "bot_id": "*", "template_id": "t"}
    )


async def route(
    client: httpx.AsyncClient, session_id: str | None = None, request_id: str | None = None
) -> httpx.Response:
    body = {
        "metadata": {
            "request_id": request_id or f"r-{uuid.uuid4().hex[:10]}",
            "session_id": session_id or f"s-{uuid.uuid4().hex[:10]}",
            "bot_id": BOT,
            "extra": {"group_id": GROUP},
        }
    }
    return await client.post(ROUTE, json=body)


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_placements_count_arrivals_in_the_same_call(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        await setup(client, pod_concurrency=5)
        first = await route(client, "s-1", "r-1")
        assert first.json()["data"]["placement"] == "placed"
        for n in (2, 3):
            assert (await route(client, f"s-{n}")).status_code == 200
        arrivals = await redis.hgetall(sm_scope(SID, "arrivals"))
        assert set(arrivals) == {"fast", "slow", "at"}
        assert 0.1 < float(arrivals["fast"]) <= 3 / 15 and 0.009 < float(arrivals["slow"]) <= 0.01
        assert 0 < await redis.ttl(sm_scope(SID, "arrivals")) <= 3000
        # a refresh and a replay are no new sessions
        assert (await route(client, "s-1")).json()["data"]["placement"] == "refresh"
        assert (await route(client, "s-1", "r-1")).json()["data"]["placement"] == "placed"
        assert await redis.hget(sm_scope(SID, "arrivals"), "slow") == arrivals["slow"]
        demand = (await services(client).sessions.scope_demand([SID, "scope-none"]))[SID]
        assert demand.sessions == 3 and demand.queued == 0
        assert 0.009 < demand.arrivals_slow <= 0.01 and 0 < demand.arrivals_fast <= 0.2
        none = (await services(client).sessions.scope_demand(["scope-none"]))["scope-none"]
        assert (none.arrivals_fast, none.arrivals_slow, none.sessions) == (0.0, 0.0, 0)
        # the pod dies: the session's next route is a rebound, which needs a slot: counted
        await services(client).sessions.notify_pod_dead(SID, first.json()["data"]["pod_id"])
        again = await route(client, "s-1")
        assert again.json()["data"]["placement"] == "rebound"
        slow = float(await redis.hget(sm_scope(SID, "arrivals"), "slow"))
        assert slow > float(arrivals["slow"]) * 0.99 + 0.9 / 300


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("bad", ["dynamic", "", 1, None, True])
async def test_config_sync_refuses_an_unknown_warm_pool(
    redis: Redis, db: Database, bad: Any
) -> None:
    async with running_app(redis, db) as client:
        item = {"template_id": "t", "image": "img:1", "warm_pool": bad}
        resp = await client.post(SYNC, json=sync_body("template", "create", item))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error_code"] == "VALIDATION"
        assert "item.warm_pool" in resp.json()["error_message"]
        assert await db.read(lambda c: config_repo.get_template(c, "t")) is None


async def test_warm_pool_flows_from_config_sync_to_the_pool_config(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        await setup(client, warm_pool="predictive")
        stored = await db.read(lambda c: config_repo.get_template(c, "t"))
        assert stored is not None and stored.warm_pool == "predictive"
        assert (await route(client)).status_code == 200
        assert await redis.hget(sm_scope(SID, "config"), "warm_pool") == "predictive"
        assert await redis.hget(rm_scope(SID, "config"), "warm_pool") == "predictive"
        changed = await sync(
            client, "template", "update", {"template_id": "t", "warm_pool": "static"}
        )
        assert changed["change_class"] == "policy"
        assert await redis.hget(rm_scope(SID, "config"), "warm_pool") == "static"
        assert (await route(client)).status_code == 200
        assert await redis.hget(sm_scope(SID, "config"), "warm_pool") == "static"
        await sync(client, "template", "create", {"template_id": "plain", "image": "img:1"})
        plain = await db.read(lambda c: config_repo.get_template(c, "plain"))
        assert plain is not None and plain.warm_pool == "static", "the default"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend_name", ["sqlite", "mariadb", "postgresql"])
def test_migration_0004_makes_existing_templates_static(backend_name: str, tmp_path: Path) -> None:
    backend = make_sql_backend(backend_name, tmp_path)
    engine = create_engine(backend.url)
    try:
        schema.upgrade(engine, "0003")
        with engine.begin() as conn:  # a template of the version before warm_pool
            conn.exec_driver_sql(
                "INSERT INTO service_config_template (template_id, enabled, image, pod_name,"
                " container_port, sse_port, sse_path, env, ready_timeout, ready_poll_interval,"
                " session_concurrency, service_concurrency, session_ttl, service_ttl,"
                " min_idle_services) VALUES ('t', 1, 'img:1', 'agent', 8080, 8080, '/sse', '{}',"
                " 300, 2, 10, 5, 60, 300, 0)"
                if backend_name != "postgresql"
                else "INSERT INTO service_config_template (template_id, enabled, image, pod_name,"
                " container_port, sse_port, sse_path, env, ready_timeout, ready_poll_interval,"
                " session_concurrency, service_concurrency, session_ttl, service_ttl,"
                " min_idle_services) VALUES ('t', true, 'img:1', 'agent', 8080, 8080, '/sse',"
                " '{}', 300, 2, 10, 5, 60, 300, 0)"
            )
        schema.upgrade(engine)
        assert schema.status(engine).up_to_date
        column = {c["name"]: c for c in inspect(engine).get_columns("service_config_template")}
        assert not column["warm_pool"]["nullable"]
        with engine.connect() as conn:
            rows = conn.execute(select(service_config_template.c.warm_pool)).scalars().all()
            assert rows == ["static"]
        schema.downgrade(engine, "0003")
        assert "warm_pool" not in {
            c["name"] for c in inspect(engine).get_columns("service_config_template")
        }
        schema.upgrade(engine)
        assert schema.status(engine).up_to_date
    finally:
        engine.dispose()
        backend.cleanup()


# --- autoscale and reclaim ---------------------------------------------------------------------


async def measured(client: httpx.AsyncClient, redis: Redis, *, new_sessions: int) -> None:
    """The scope saw ``new_sessions`` placed just now, and deploys of about 20 s."""
    before = await redis.llen(rm_scope(SID, "deploy_times"))
    for _ in range(new_sessions):
        assert (await route(client)).status_code == 200
    # each was a cold deploy (pod_concurrency 1): the deployer recorded its duration
    assert await redis.llen(rm_scope(SID, "deploy_times")) == before + new_sessions
    state = services(client).resource_state
    for seconds in (18.0, 19.0, 20.0, 20.0, 20.0):
        await state.record_deploy_time(SID, seconds)


async def fill(jobs: PoolJobs) -> int:
    """Autoscale ticks until the plan is met (a tick starts a bounded number of deploys);
    the deploys started."""
    started = 0
    for _ in range(10):
        now = await jobs.autoscale_once()
        await jobs.wait_for_warm_deploys()
        if now == 0:
            return started
        started += now
    raise AssertionError(f"autoscale still deploying after {started} pods")


async def warm_count(redis: Redis) -> int:
    return int(await redis.scard(rm_scope(SID, "idle")))


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_predictive_scope_keeps_what_its_demand_needs_then_falls_back(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        await setup(client, warm_pool="predictive", min_idle_pods=1)
        await measured(client, redis, new_sessions=10)
        jobs = services(client).pool_jobs
        warm = await fill(jobs)
        assert warm > 1, "more than the floor: the demand of one deploy time"
        assert await warm_count(redis) == warm
        await asyncio.sleep(1.2)  # every warm pod is idle longer than pod_ttl (1 s) now
        # the demand is still there (its rates decay a little meanwhile): the target stays
        kept = warm - await jobs.reclaim_once()
        assert kept > 1 and await warm_count(redis) == kept
        # demand fell: the last arrival an hour ago (the rates decay as the EWMAs say)
        await redis.hset(
            sm_scope(SID, "arrivals"), "at", str(float((await redis.time())[0]) - 3600)
        )
        assert await jobs.reclaim_once() == kept - 1
        assert await warm_count(redis) == 1, "back to min_idle_pods"
        assert await jobs.autoscale_once() == 0


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_static_scope_ignores_the_demand(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        await setup(client, min_idle_pods=1)
        await measured(client, redis, new_sessions=10)
        assert await fill(services(client).pool_jobs) == 1
        assert await warm_count(redis) == 1


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_predictive_scope_stays_within_max_pods(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        await setup(client, warm_pool="predictive", scope_concurrency=12)  # max_pods 12
        await measured(client, redis, new_sessions=10)
        assert await fill(services(client).pool_jobs) == 2
        assert await redis.zcard(rm_scope(SID, "pods")) == 12


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_predictive_scope_stays_within_the_pod_budget(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, pod_budget=13) as client:
        await setup(client, warm_pool="predictive", scope_concurrency=40)
        await measured(client, redis, new_sessions=10)
        assert await fill(services(client).pool_jobs) == 3, "the installation's budget: 13"
        assert await redis.zcard(rm_scope(SID, "pods")) == 13


# --- the simulation drives the same policy ------------------------------------------------------


def test_the_simulation_is_deterministic_and_drives_the_policy() -> None:
    trace = Trace(
        "steady", 240.0, [Template(pod_ttl=60.0)], lambda s, t: 0.5, lambda s: 0.5, (0,),
        warmup=60.0, session_median=20.0,
    )  # fmt: skip

    def run(mode: str, floor: int) -> tuple[int, int, float, int]:
        r = Simulation(trace, mode, margin=0.05, min_idle=floor, seed=7).run()
        return r.arrivals, r.cold, round(r.idle_seconds, 6), r.deploys

    assert run("predictive", 0) == run("predictive", 0), "one seed, one outcome"
    cold_static, warm_static = run("static", 0), run("static", 8)
    assert cold_static[0] == warm_static[0] > 50, "every policy sees the same arrivals"
    assert warm_static[1] < cold_static[1] and warm_static[2] > cold_static[2]
    predictive = run("predictive", 0)
    assert predictive[1] < cold_static[1], "the measured demand keeps pods ready"


async def test_scope_demand_counts_live_waiters_and_reservations(redis: Redis) -> None:
    sessions = SessionManagerFacade(state=SessionState(redis))
    now = float((await redis.time())[0])
    await redis.zadd(sm_scope(SID, "waiters"), {"w-live": now + 30, "w-gone": now - 5})
    await redis.zadd(sm_scope(SID, "reserved"), {"r-live": now + 3, "r-gone": now - 1})
    await redis.sadd(sm_scope(SID, "sessions"), "s-1", "s-2")
    # rates written 300 s ago: read back decayed by the EWMAs' own windows
    at = now - 300
    await redis.hset(sm_scope(SID, "arrivals"), mapping={"fast": "2", "slow": "1", "at": str(at)})
    demand = (await sessions.scope_demand([SID]))[SID]
    assert demand.sessions == 2 and demand.queued == 2
    assert demand.arrivals_slow == pytest.approx(math.exp(-1), rel=0.02)
    assert demand.arrivals_fast == pytest.approx(2 * math.exp(-20), rel=0.1)
    many = await sessions.scope_demand([f"scope-{n}" for n in range(450)])
    assert len(many) == 450 and all(d.sessions == 0 for d in many.values()), "in slices"
