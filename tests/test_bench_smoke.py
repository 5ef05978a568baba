"""The benches still run: ``bench/run.py --quick`` on its cheapest subset that starts real
bench servers (redis_cost: a server counting its Redis commands; queue_wake: the shared one)
over the real local Redis, as a subprocess. Checks the JSON it writes is well formed, with the
keys the docs describe. No timing is asserted: benches measure, they do not judge."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import CLUSTER_URL, IN_CI, SENTINEL_URL, drop_cluster_lease

ROOT = Path(__file__).resolve().parent.parent
# a db index of its own: not the tests' (13 down to 9), not a developer's bench run (4)
BENCH_REDIS_URL = os.environ.get("AGENT_RUNTIME_TEST_BENCH_REDIS_URL", "redis://127.0.0.1:6379/3")
EXIT_REFUSED = 2


def number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_bench(command: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run a bench to its end; its stdout. A bench that refused to run (exit 2: a backend it
    needs is missing) fails under CI=true and is skipped elsewhere; any other failure fails."""
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode == EXIT_REFUSED:
        message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "refused"
        if IN_CI:
            pytest.fail(f"CI=true and the bench refused to run: {message}", pytrace=False)
        pytest.skip(message)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.real_backend
@pytest.mark.timeout(90)
def test_quick_bench_writes_wellformed_results(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {**os.environ, "AGENT_RUNTIME_BENCH_REDIS_URL": BENCH_REDIS_URL}
    only = ["--only", "redis_cost", "queue_wake"]
    files = ["--json", str(out), "--out-dir", str(tmp_path)]
    run_bench([sys.executable, "bench/run.py", "--quick", *only, *files], timeout=80, env=env)
    report = json.loads(out.read_text())
    assert (tmp_path / "latest.json").is_file() and (tmp_path / "latest.txt").is_file()

    meta = report["meta"]
    assert meta["quick"] is True
    assert meta["selected"] == ["redis_cost", "queue_wake"]
    machine = meta["machine"]
    assert number(machine["nproc"]) and machine["cpu_model"] and machine["date"]
    assert len(machine["loadavg_start"]) == 3 and len(machine["loadavg_end"]) == 3
    assert meta["loadgen"].startswith(("wrk", "python-httpx"))

    results = report["results"]
    for name in ("redis_cost", "queue_wake"):
        assert "error" not in results[name], results[name]
        assert len(results[name]["loadavg_start"]) == 3
        assert number(results[name]["elapsed_s"])

    cost = results["redis_cost"]
    assert number(cost["requests_per_phase"]) and number(cost["idle_noise"]["commands_per_s"])
    for phase in ("noop", "refresh", "placed", "touch", "touch_no_ids"):
        for side in ("client", "server"):
            numbers = cost[phase][side]
            assert number(numbers["commands_per_request"])
            assert number(numbers["evalsha_per_request"])
            assert isinstance(numbers["by_command"], dict)
        assert number(cost[phase]["client"]["round_trips_per_request"])
        assert number(cost[phase]["client"]["detached_round_trips_per_request"])
        assert sum(cost[phase]["answers"].values()) == cost["requests_per_phase"]

    wake = results["queue_wake"]
    assert number(wake["repetitions"])
    for series in ("wake_ms", "eos_touch_ms", "after_eos_answer_ms", "plain_touch_ms"):
        assert {"p50", "p99", "max", "mean"} <= set(wake[series])
        assert all(number(v) for v in wake[series].values())

    targets = {t["target"]: t for t in report["targets"]}
    assert "queue wake p99" in targets
    assert "refresh: Redis round trips per request" in targets
    for row in report["targets"]:
        assert set(row) == {"target", "value", "bound", "met"}
        assert row["met"] in (True, False, None)


@pytest.mark.real_backend
@pytest.mark.timeout(120)
def test_the_dead_pod_bench_prints_its_table(tmp_path: Path) -> None:
    """``bench/dead_pod.py``, one trial of its two fast rows (kubesim in process, a bench
    server with the real Kubernetes client): the table printed, the JSON well formed."""
    out = tmp_path / "dead.json"
    rows = ["--rows", "stream:kill", "report:kill", "--trials", "1"]
    bench = [sys.executable, "-m", "bench.dead_pod", *rows, "--json", str(out)]
    printed = run_bench([*bench, "--redis-url", BENCH_REDIS_URL], timeout=110)
    assert "dead_pod: kill → next route `rebound`" in printed
    report = json.loads(out.read_text())
    assert report["trials"] == 1
    assert [(r["mode"], r["death"]) for r in report["rows"]] == [
        ("stream", "kill"),
        ("report", "kill"),
    ]
    for row in report["rows"]:
        assert row["n"] == 1 and all(number(row[k]) for k in ("p50_s", "p99_s", "max_s"))


@pytest.mark.real_backend
@pytest.mark.timeout(240)
def test_the_failover_bench_prints_its_table(tmp_path: Path) -> None:
    """``bench/failover.py``, one forced failover of the tests' Sentinel set (db 3 of its
    master, as the other benches' db here): the table printed, the JSON well formed, and
    the answers it saw within the contract."""
    url = SENTINEL_URL.rstrip("/").rpartition("/")[0] + "/3"
    out = tmp_path / "failover.json"
    bench = [sys.executable, "-m", "bench.failover", "--failovers", "1", "--json", str(out)]
    printed = run_bench([*bench, "--sentinel-url", url], timeout=220)
    assert "failover: 1 x SENTINEL FAILOVER mid-load" in printed
    report = json.loads(out.read_text())
    [row] = report["rows"]
    assert all(number(row[k]) for k in ("promoted_s", "named_s", "demoted_s", "window_s"))
    assert row["bad_answers"] == 0 and row["redis_consistent"] is True, row


@pytest.mark.real_backend
@pytest.mark.timeout(240)
def test_the_cluster_bench_measures_both_targets(tmp_path: Path) -> None:
    """``bench/cluster.py --quick --scopes 10``: the single server (the benches' db here) and
    the tests' Redis Cluster (the bench takes the tests' lease on it, so this run's is given
    back first): every phase on both, every master found and read (the single server as one),
    the table and the JSON well formed. No number is judged."""
    asyncio.run(drop_cluster_lease())
    out = tmp_path / "cluster.json"
    urls = ["--redis-url", CLUSTER_URL, "--single-redis-url", BENCH_REDIS_URL]
    bench = [sys.executable, "-m", "bench.cluster", "--quick", "--scopes", "10", *urls]
    printed = run_bench([*bench, "--json", str(out)], timeout=220)
    assert "cluster: 10 scopes (20 sessions), single server vs Redis Cluster" in printed
    report = json.loads(out.read_text())
    assert "error" not in report, report.get("error")
    for target, masters in (("single", 1), ("cluster", 3)):
        result = report[target]
        assert len(result["masters"]) == masters, result["masters"]
        assert result["setup"]["placements"], result["setup"]
        assert number(result["noop"]["ok_per_s"]) and result["noop"]["requests"] > 0
        for phase in ("refresh", "placed", "touch_ids", "touch"):
            p = result[phase]
            assert p["requests"] == sum(p["answers"].values()) > 0
            assert isinstance(p["valid"], bool) and number(p["ratio_to_noop"])
            assert number(p["client"]["round_trips_per_request"])
            assert {m["node"] for m in p["masters"]} == set(result["masters"])
            assert all(number(m["commands"]) and number(m["cpu_us"]) for m in p["masters"])
            assert all(set(p["idle"][m]) == {"cpu_us_per_s", "commands_per_s"} for m in p["idle"])
    single = report["ceiling"]["single"]
    assert single["masters_measured"] == 1
    for model in single["phases"].values():
        assert sorted(model["routes_per_s"]) == ["1", "2", "3", "4", "5", "6"]
