"""``scripts/load_test.py`` as an operator runs it: a subprocess (this venv's python) against a
real ``agent-runtime serve --mode local`` process, tiny bounds, the JSON summary checked."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "load_test.py"
START_TIMEOUT = 20.0
RUN_TIMEOUT = 30.0
SCOPE_FULL_TIMEOUT = "2"  # the service's queue wait, short so a queued run ends quickly
CONTRACT_CODES = {
    "VALIDATION", "UNAUTHORIZED", "NOT_FOUND", "CONFIG_SYNC_BUSY", "CONFLICT", "K8S_ERROR",
    "CONFIG_NOT_FOUND", "SCOPE_QUEUE_FULL", "NO_POD_AVAILABLE", "BACKEND_UNAVAILABLE",
    "SCOPE_FULL_TIMEOUT", "INTERNAL",
}  # fmt: skip
TRANSPORT_CODES = {"CONNECT_ERROR", "TIMEOUT", "TRANSPORT_ERROR"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AGENT_RUNTIME_", "LOAD_TEST_")) and "PROXY" not in k.upper()
    }


def _serve_command(port: int) -> list[str]:
    console = Path(sys.executable).parent / "agent-runtime"
    head = [str(console)] if console.exists() else [sys.executable, "-m", "agent_runtime.cli"]
    return [*head, "serve", "--mode", "local", "--port", str(port)]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local-mode service in a directory of its own (its SQLite file); always stopped."""
    workdir = tmp_path_factory.mktemp("load_test_service")
    port = free_port()
    env = {
        **_clean_env(),
        "AGENT_RUNTIME_SCOPE_FULL_TIMEOUT": SCOPE_FULL_TIMEOUT,
        "AGENT_RUNTIME_LOG_LEVEL": "WARNING",
    }
    log_path = workdir / "server.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            _serve_command(port),
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(base_url=base_url, timeout=1.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"service exited with {proc.returncode}:\n{log_path.read_text()}")
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"service not healthy in {START_TIMEOUT}s:\n{log_path.read_text()}")
                time.sleep(0.05)  # poll interval, bounded by the deadline
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def run_script(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_clean_env(),
        stdin=subprocess.DEVNULL,
    )


def run_ok(service: str, tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run the script against the service; the JSON summary, checked for consistency."""
    out = tmp_path / "summary.json"
    result = run_script("--base-url", service, "--json", str(out), *args)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "requests in" in result.stdout  # the printed summary
    summary: dict[str, Any] = json.loads(out.read_text())
    check_consistent(summary)
    return summary


def check_latency(latency: dict[str, float] | None, requests: int) -> None:
    if requests == 0:
        assert latency is None
        return
    assert latency is not None
    assert 0 <= latency["min"] <= latency["p50"] <= latency["p90"] <= latency["p99"]
    assert latency["p99"] <= latency["max"]
    assert latency["min"] <= latency["mean"] <= latency["max"]


def check_codes(codes: dict[str, int]) -> None:
    for code, n in codes.items():
        assert n > 0
        assert (
            code == "OK"
            or code in CONTRACT_CODES
            or code in TRANSPORT_CODES
            or re.fullmatch(r"HTTP_\d{3}", code)
        ), code


def check_consistent(s: dict[str, Any]) -> None:
    """Counts add up (total, steps, codes), percentiles are ordered, codes are known ones."""
    assert s["requests"] == sum(s["codes"].values()) == s["ok"] + s["errors"]
    assert s["ok"] == s["codes"].get("OK", 0)
    assert s["requests"] == sum(step["requests"] for step in s["steps"].values())
    for step in s["steps"].values():
        assert step["requests"] == sum(step["codes"].values()) == step["ok"] + step["errors"]
        assert sum(step["outcomes"].values()) == step["ok"]
        check_codes(step["codes"])
        check_latency(step["latency_ms"], step["requests"])
    check_codes(s["codes"])
    check_latency(s["latency_ms"], s["requests"])
    assert s["elapsed_s"] > 0
    assert s["throughput_rps"] == pytest.approx(s["requests"] / s["elapsed_s"], rel=0.01)
    assert s["interrupted"] is False


def test_route_places_new_sessions(service: str, tmp_path: Path) -> None:
    s = run_ok(
        service, tmp_path,
        "--scenario", "route", "--count", "50", "--concurrency", "5",
        "--group-id", "g-route", "--configure", "--scope-concurrency", "1000",
        "--pod-concurrency", "100",
    )  # fmt: skip
    assert s["iterations"] == 50
    assert s["codes"] == {"OK": 50}
    assert s["steps"]["route"]["outcomes"] == {"placed": 50}
    assert s["setup_teardown"]["template"] == s["setup_teardown"]["routing_rule"] == {"OK": 1}
    assert s["setup_teardown"]["cleanup"] == {"OK": 50}  # the sessions were ended after the run


def test_refresh_routes_the_same_sessions(service: str, tmp_path: Path) -> None:
    s = run_ok(
        service, tmp_path,
        "--scenario", "refresh", "--sessions", "5", "--count", "50", "--concurrency", "5",
        "--group-id", "g-refresh",
    )  # fmt: skip
    assert s["iterations"] == 50
    assert s["codes"] == {"OK": 50}
    assert s["steps"]["route"]["outcomes"] == {"refresh": 50}  # sticky: never placed again
    assert s["setup_teardown"]["precreate"] == {"OK": 5}
    assert s["setup_teardown"]["cleanup"] == {"OK": 5}


def test_route_touch_reports_each_step(service: str, tmp_path: Path) -> None:
    s = run_ok(
        service, tmp_path,
        "--scenario", "route_touch", "--touches", "2", "--count", "50", "--concurrency", "5",
        "--group-id", "g-route-touch",
    )  # fmt: skip
    steps = s["steps"]
    assert set(steps) == {"route", "touch", "eos"}
    assert (steps["route"]["requests"], steps["touch"]["requests"], steps["eos"]["requests"]) == (
        50,
        100,
        50,
    )
    assert s["requests"] == 200
    assert steps["route"]["outcomes"] == {"placed": 50}
    assert steps["touch"]["outcomes"] == {"touched": 100}
    assert steps["eos"]["outcomes"] == {"released": 50}


def test_queued_saturates_the_scope(service: str, tmp_path: Path) -> None:
    # 2 slots + a queue of 4 against 10 workers: some wait, some are refused at once
    s = run_ok(
        service, tmp_path,
        "--scenario", "queued", "--count", "50", "--concurrency", "10", "--hold", "0.05",
        "--group-id", "g-queued", "--configure", "--scope-concurrency", "2",
        "--pod-concurrency", "2",
    )  # fmt: skip
    route = s["steps"]["route"]
    assert route["requests"] == s["iterations"] == 50
    queue = s["queue_outcomes"]
    assert set(queue) == {"OK", "SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT", "other"}
    assert sum(queue.values()) == 50
    assert queue["other"] == 0
    assert queue["OK"] >= 2
    assert queue["SCOPE_QUEUE_FULL"] > 0
    assert s["steps"]["eos"]["requests"] == queue["OK"]  # every placed session was ended


def test_soak_reports_intervals_csv_and_progress(service: str, tmp_path: Path) -> None:
    rows_path = tmp_path / "rows.csv"
    out = tmp_path / "soak.json"
    result = run_script(
        "--base-url", service, "--scenario", "route_touch", "--duration", "2.5",
        "--concurrency", "3", "--group-id", "g-soak", "--soak", "--report-every", "1",
        "--progress", "--csv", str(rows_path), "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    s = json.loads(out.read_text())
    check_consistent(s)
    assert s["latency_method"].startswith("log histogram")
    assert len(s["intervals"]) >= 2
    assert sum(i["requests"] for i in s["intervals"]) == s["requests"]
    assert s["intervals"][-1]["total_requests"] == s["requests"]
    for interval in s["intervals"]:
        check_latency(interval["latency_ms"], interval["requests"])
    assert len(re.findall(r"^\[\s*\d+\.\d+s\] (last|tail) ", result.stdout, re.M)) == len(
        s["intervals"]
    )
    assert "load_test: progress" in result.stderr  # --progress without a terminal: plain lines

    with rows_path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["t_start", "step", "latency_ms", "status", "error_code"]
    assert len(rows) - 1 == s["requests"]
    assert {r[1] for r in rows[1:]} == {"route", "touch", "eos"}
    assert all(float(r[0]) >= 0 and float(r[2]) >= 0 and r[3] == "200" for r in rows[1:])
    assert {r[4] for r in rows[1:]} == {"OK"}


def test_plot_without_matplotlib_says_so(service: str, tmp_path: Path) -> None:
    png = tmp_path / "latency.png"
    result = run_script(
        "--base-url", service, "--scenario", "route_touch", "--count", "5",
        "--group-id", "g-plot", "--plot", str(png),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in result.stderr
        assert not png.exists()
    else:
        assert png.stat().st_size > 0


def test_refused_configuration_is_a_setup_failure(service: str) -> None:
    result = run_script(
        "--base-url", service, "--scenario", "route", "--count", "5", "--group-id", "g-bad",
        "--configure", "--scope-concurrency", "1000000",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "config_sync template refused: VALIDATION" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "a bound is required"),
        (["--count", "0"], "--count must be"),
        (["--duration", "-1"], "--duration must be"),
        (["--count", "5", "--concurrency", "0"], "--concurrency must be"),
        (["--count", "5", "--report-every", "5"], "--report-every goes with --soak"),
        (["--count", "5", "--scope-concurrency", "3"], "go with --configure"),
        (["--count", "5", "--scenario", "nope"], "invalid choice"),
        (["--count", "5", "--base-url", "localhost:8091"], "--base-url must start"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    result = run_script(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_unreachable_service_exits_2_with_one_line() -> None:
    port = free_port()  # nothing listens there
    result = run_script("--base-url", f"http://127.0.0.1:{port}", "--count", "5")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("load_test: error: service at ")
    assert "unreachable" in lines[0]
    assert result.stdout == ""


# --- the soak histogram, in process ---


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("load_test_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_log_histogram_stays_within_its_error_bound() -> None:
    script = _load_script()
    rng = random.Random(7)
    samples = [rng.lognormvariate(1.0, 1.5) for _ in range(20_000)] + [0.0, 0.0005, 9_999.0]
    exact, hist = script.ExactLatencies(), script.LogHistogram()
    for ms in samples:
        exact.add(ms)
        hist.add(ms)
    e, h = exact.summary(), hist.summary()
    assert h["max"] == e["max"] and h["min"] == e["min"]
    for key in ("p50", "p90", "p99"):
        # the bucket's upper end: never below the exact value, at most 1/128 (+1 µs) above
        assert e[key] <= h[key] + 0.001
        assert h[key] <= e[key] * (1 + 1 / 128) + 0.002
    assert math.isclose(h["mean"], e["mean"], abs_tol=0.002)
