"""Pod budgets (issue 13, bounded growth): the installation's and a routing rule's.

Through the public interface: config_sync carries the rule's ``pod_budget`` (validated, in
the DB on every backend, migrated by revision 0002), a route past a budget is answered 503
``NO_POD_AVAILABLE`` at once and without a deploy, two replicas over one Redis never pass the
budget together, the warm pool stops at it, and every unit comes back (failed deploys, dead
pods). Redis keys are read by their names (docs/spec/resource-manager.md "Pod budgets").
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from sqlalchemy import create_engine, insert, inspect, select

from agent_runtime.db import schema
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import routing_rule
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.models import PodDeployInfo
from agent_runtime.session_manager import config_repo
from agent_runtime.session_manager.items import RoutingRuleItem, TemplateItem
from agent_runtime.util import rule_id_of, scope_id_of
from agent_runtime.wiring import Services
from contract_keys import rm_pod, rm_pod_scope
from helpers import make_sql_backend, running_app, sync_body

ROUTE = "/api/session/route"
SYNC = "/api/session/config_sync"
TOUCH = "/api/session/touch"
BUDGET = "resource_manager:budget:{budget}:pods"


def rule_budget_key(group_id: str, bot_id: str) -> str:
    return f"resource_manager:budget:{{budget}}:rule:{rule_id_of(group_id, bot_id)}:pods"


def services(client: httpx.AsyncClient) -> Services:
    found: Services = client.app.state.services  # type: ignore[attr-defined]
    return found


async def sync(client: httpx.AsyncClient, kind: str, op: str, item: dict[str, Any]) -> Any:
    resp = await client.post(SYNC, json=sync_body(kind, op, item))
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


async def setup_config(
    client: httpx.AsyncClient, *, pod_budget: int | None = None, **template: Any
) -> None:
    fields = {"scope_concurrency": 1, "pod_concurrency": 1, **template}
    await sync(client, "template", "create", {"template_id": "t", "image": "img:1", **fields})
    rule: dict[str, Any] = {"group_id": "*", "bot_id": "*", "template_id": "t"}
    if pod_budget is not None:
        rule["pod_budget"] = pod_budget
    await sync(client, "routing_rule", "create", rule)


def exact_rule(group_id: str) -> dict[str, Any]:
    return {"group_id": group_id, "bot_id": "b", "template_id": "t"}


async def route(client: httpx.AsyncClient, group_id: str, bot_id: str = "b") -> httpx.Response:
    body = {
        "metadata": {
            "request_id": f"r-{uuid.uuid4().hex[:10]}",
            "session_id": f"s-{uuid.uuid4().hex[:10]}",
            "bot_id": bot_id,
            "extra": {"group_id": group_id},
        }
    }
    return await client.post(ROUTE, json=body)


def assert_budget_refusal(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["error_code"] == "NO_POD_AVAILABLE"
    assert body["retry_after"] == 1 and resp.headers["Retry-After"] == "1"
    # generic for the gateway: no scope, rule or count in it
    assert body["error_message"] == "no pod can be had now: a pod budget is reached"


class GatedK8s(FakeK8sPodClient):
    """Deploys wait for ``gate``: a test sees the budget full of deploys in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0

    async def deploy(self, **kwargs: Any) -> PodDeployInfo:
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        return await super().deploy(**kwargs)


# --- the rule field: validation, DB, migration -----------------------------------------------


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("bad", [0, -1, "5", True, 1.5, 1_000_001])
async def test_config_sync_refuses_a_bad_pod_budget(redis: Redis, db: Database, bad: Any) -> None:
    async with running_app(redis, db) as client:
        await sync(client, "template", "create", {"template_id": "t", "image": "img:1"})
        item = {"group_id": "*", "bot_id": "*", "template_id": "t", "pod_budget": bad}
        resp = await client.post(SYNC, json=sync_body("routing_rule", "create", item))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error_code"] == "VALIDATION"
        assert "item.pod_budget" in resp.json()["error_message"]
        assert await db.read(lambda c: config_repo.get_rule(c, "*", "*")) is None


async def test_pod_budget_is_stored_on_every_db(db: Database) -> None:
    template = TemplateItem(template_id="t", image="img:1")
    await db.write(lambda c: config_repo.put_template(c, template, exists=False))
    rule = RoutingRuleItem(group_id="*", bot_id="b", template_id="t", pod_budget=7)
    await db.write(lambda c: config_repo.put_rule(c, rule, exists=False))
    assert await db.read(lambda c: config_repo.get_rule(c, "*", "b")) == rule
    found = await db.read(lambda c: config_repo.match(c, "g", "b"))
    assert found is not None and found.rule == rule and found.template == template
    snapshot = await db.read(config_repo.load_snapshot)
    assert snapshot.pod_budgets == {("*", "b"): 7}
    unbounded = rule.model_copy(update={"pod_budget": None})
    await db.write(lambda c: config_repo.put_rule(c, unbounded, exists=True))
    assert await db.read(lambda c: config_repo.get_rule(c, "*", "b")) == unbounded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend_name", ["sqlite", "mariadb", "postgresql"])
def test_migration_0002_adds_a_nullable_pod_budget(backend_name: str, tmp_path: Path) -> None:
    backend = make_sql_backend(backend_name, tmp_path)
    engine = create_engine(backend.url)
    try:
        schema.upgrade(engine, "0001")
        with engine.begin() as conn:  # a rule of the version before budgets
            conn.exec_driver_sql(
                "INSERT INTO routing_rule (group_id, bot_id, template_id) VALUES ('*', '*', 't')"
            )
        assert "pod_budget" not in {c["name"] for c in inspect(engine).get_columns("routing_rule")}
        schema.upgrade(engine)
        assert schema.status(engine).up_to_date
        columns = {c["name"]: c for c in inspect(engine).get_columns("routing_rule")}
        assert columns["pod_budget"]["nullable"]
        with engine.begin() as conn:
            assert conn.execute(select(routing_rule.c.pod_budget)).scalars().all() == [None]
            conn.execute(
                insert(routing_rule).values(group_id="g", bot_id="*", template_id="t", pod_budget=3)
            )
        schema.downgrade(engine, "0001")  # drops the column, the rules stay
        columns = {c["name"]: c for c in inspect(engine).get_columns("routing_rule")}
        assert "pod_budget" not in columns
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT COUNT(*) FROM routing_rule").scalar_one() == 2
        schema.upgrade(engine)
        assert schema.status(engine).up_to_date
    finally:
        engine.dispose()
        backend.cleanup()


# --- routes against the budgets --------------------------------------------------------------


async def test_rule_budget_through_config_sync_and_route(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s, pod_budget=100) as client:
        await setup_config(client, pod_budget=3)
        answers = [await route(client, f"g{i}") for i in range(5)]
        assert [r.status_code for r in answers] == [200, 200, 200, 503, 503]
        for refused in answers[3:]:
            assert_budget_refusal(refused)
        assert k8s.deploy_calls == 3  # the refused routes deployed nothing
        assert await redis.zcard(rule_budget_key("*", "*")) == 3
        # an exact rule is not bounded by the wildcard's budget
        await sync(client, "routing_rule", "create", exact_rule("gx"))
        assert (await route(client, "gx")).status_code == 200
        assert_budget_refusal(await route(client, "g5"))
        # raising the budget is a policy change, effective for the next route
        item = {"group_id": "*", "bot_id": "*", "template_id": "t", "pod_budget": 4}
        assert (await sync(client, "routing_rule", "update", item))["change_class"] == "policy"
        assert (await route(client, "g6")).status_code == 200
        assert_budget_refusal(await route(client, "g7"))
        assert k8s.deploy_calls == 5
        assert await redis.zcard(BUDGET) == 5
        assert (
            await redis.hget("resource_manager:budget:{budget}:rule_limits", rule_id_of("*", "*"))
            == "4"
        )


async def test_wildcard_rules_default_to_the_setting_and_exact_ones_are_unbounded(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db, wildcard_rule_pod_budget=2) as client:
        await setup_config(client)  # (*, *) without a pod_budget of its own
        assert [(await route(client, f"g{i}")).status_code for i in range(2)] == [200, 200]
        assert_budget_refusal(await route(client, "g2"))
        for i in range(3):
            await sync(client, "routing_rule", "create", exact_rule(f"e{i}"))
            assert (await route(client, f"e{i}")).status_code == 200


async def test_global_budget_over_two_replicas_is_exact_refuses_at_once_and_leaks_nothing(
    redis: Redis, db: Database
) -> None:
    """40 routes with fresh group ids under (*, *), over two replicas of one Redis, DB and
    cluster, with a budget of 8: 8 deploys, the other 32 refused while those 8 are still
    deploying (nothing waited for a pod), and every unit back once the pods are gone."""
    k8s = GatedK8s()
    budget = 8
    settings: dict[str, Any] = {"pod_budget": budget, "wildcard_rule_pod_budget": 0}
    async with (
        running_app(redis, db, k8s=k8s, instance_id="a", **settings) as one,
        running_app(redis, db, k8s=k8s, instance_id="b", **settings) as two,
    ):
        try:
            await _two_replicas(redis, k8s, one, two, budget)
        finally:
            k8s.gate.set()  # never leave a deploy hanging into the shutdown


async def _two_replicas(
    redis: Redis, k8s: GatedK8s, one: httpx.AsyncClient, two: httpx.AsyncClient, budget: int
) -> None:
    await setup_config(one)
    peak = 0
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, await redis.zcard(BUDGET), len(k8s.pods) + k8s.waiting)
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    calls = [asyncio.create_task(route(one if i % 2 else two, f"fresh-{i}")) for i in range(40)]
    # the gate is closed: only routes that were refused can finish
    refused: list[httpx.Response] = []
    async with asyncio.timeout(30):  # without a budget all 40 wait at the gate: fails here
        while len(refused) < 40 - budget:
            done = [c for c in calls if c.done()]
            refused = [c.result() for c in done]
            await asyncio.sleep(0.01)
    assert len(refused) == 40 - budget
    for resp in refused:
        assert_budget_refusal(resp)
    assert k8s.waiting == budget  # the deploys in flight: the refused ones started none
    assert await redis.zcard(BUDGET) == budget
    k8s.gate.set()
    async with asyncio.timeout(60):
        placed = await asyncio.gather(*calls)
    sampling = False
    await sampler
    assert sorted(r.status_code for r in placed) == [200] * budget + [503] * (40 - budget)
    assert peak <= budget
    assert k8s.deploy_calls == len(k8s.pods) == budget
    assert set(await redis.zrange(BUDGET, 0, -1)) == set(k8s.pods)
    # the pods die: watch purges them and their units come back
    for pod_id in list(k8s.pods):
        k8s.kill(pod_id)
    await services(one).pool_jobs.watch_once()
    assert await redis.zcard(BUDGET) == 0
    # failed deploys give their units back as well
    k8s.fail_next_deploys = 3
    for i in range(3):
        resp = await route(two, f"failing-{i}")
        assert resp.status_code == 503 and resp.json()["error_code"] == "NO_POD_AVAILABLE"
    assert await redis.zcard(BUDGET) == 0
    ok = [await route(one if i % 2 else two, f"again-{i}") for i in range(budget)]
    assert [r.status_code for r in ok] == [200] * budget
    assert_budget_refusal(await route(one, "one-too-many"))


async def test_autoscale_stops_at_the_global_budget(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s, pod_budget=5) as client:
        # max_pods 4, a warm floor of 2 per scope
        await setup_config(client, scope_concurrency=4, min_idle_pods=2)
        for i in range(3):
            assert (await route(client, f"g{i}")).status_code == 200  # 3 pods in use
        pool_jobs = services(client).pool_jobs
        started = await pool_jobs.autoscale_once()  # 3 scopes want 2 warm pods each: 2 fit
        assert started == 2
        await pool_jobs.wait_for_warm_deploys()
        assert len(k8s.pods) == 5 and await redis.zcard(BUDGET) == 5
        assert await pool_jobs.autoscale_once() == 0
        assert_budget_refusal(await route(client, "g3"))
        # reclaim of a warm pod gives its unit back: the next route may deploy
        for pod_id in list(k8s.pods):
            sid = await rm_pod_scope(redis, pod_id)
            if await redis.hget(rm_pod(str(sid), pod_id, "info"), "phase") == "idle":
                await redis.set(rm_pod(str(sid), pod_id, "idle_since"), 1)
        for group_id in ("g0", "g1", "g2"):  # no floor any more: the warm pods may go
            key = f"resource_manager:resource:scope:{{{_scope(group_id)}}}:config"
            await redis.hset(key, "min_idle_pods", 0)
        assert await pool_jobs.reclaim_once() == 2
        assert await redis.zcard(BUDGET) == 3
        assert (await route(client, "g3")).status_code == 200


def _scope(group_id: str, bot_id: str = "b") -> str:
    return scope_id_of(group_id, bot_id)


async def test_reconcile_rebuilds_the_budget_after_redis_lost_it(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s, pod_budget=3, wildcard_rule_pod_budget=0) as c:
        await setup_config(c)
        assert [(await route(c, f"g{i}")).status_code for i in range(3)] == [200] * 3
        await redis.delete(BUDGET)  # drift: the counter lost, the pods still there
        assert (await route(c, "g3")).status_code == 200  # the budget cannot see them...
        await services(c).pool_jobs.reconcile_once()  # ...until reconcile repairs it
        assert set(await redis.zrange(BUDGET, 0, -1)) == set(k8s.pods)
        assert len(k8s.pods) == 4
        assert_budget_refusal(await route(c, "g4"))


async def test_config_sync_writes_the_rule_limit_for_autoscale_at_once(
    redis: Redis, db: Database
) -> None:
    limits = "resource_manager:budget:{budget}:rule_limits"
    async with running_app(redis, db, wildcard_rule_pod_budget=7) as client:
        await setup_config(client)  # (*, *): the wildcard default, before any route
        assert await redis.hget(limits, rule_id_of("*", "*")) == "7"
        item = {"group_id": "*", "bot_id": "*", "template_id": "t", "pod_budget": 3}
        await sync(client, "routing_rule", "sync", item)
        assert await redis.hget(limits, rule_id_of("*", "*")) == "3"
        await sync(client, "routing_rule", "create", {**exact_rule("gx"), "pod_budget": 2})
        assert await redis.hget(limits, rule_id_of("gx", "b")) == "2"
        await sync(client, "routing_rule", "create", exact_rule("gy"))  # unbounded: no limit
        assert not await redis.hexists(limits, rule_id_of("gy", "b"))
        await sync(client, "routing_rule", "delete", {"group_id": "gx", "bot_id": "b"})
        assert not await redis.hexists(limits, rule_id_of("gx", "b"))
