"""The Grafana dashboard in deploy/ only queries series the service really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from helpers import running_app

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/grafana/agent-runtime-dashboard.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def family(sample_name: str) -> str:
    for suffix in SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name.removesuffix(suffix)
    return sample_name


@pytest.mark.parametrize(("redis", "sql_backend"), [("fake", "sqlite")], indirect=True)
async def test_every_dashboard_query_names_an_exported_family(redis: Redis, db: Database) -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len(exprs) >= 18
    wanted = {family(n) for e in exprs for n in re.findall(r"agent_runtime_[a-z0-9_]+", e)}
    async with running_app(redis, db) as client:
        page = (await client.get("/metrics")).text
    exported = {family(n) for n in re.findall(r"^# TYPE (agent_runtime_[a-z0-9_]+) ", page, re.M)}
    assert wanted <= exported, sorted(wanted - exported)
    # and every panel has a datasource variable, unique ids, a title
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(p["title"] for p in board["panels"])
