"""``agent-runtime serve --mode local`` as a user runs it: a real process on a real port, a
SQLite file in its working directory, config_sync over HTTP, /metrics, and a clean SIGTERM or
Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import sync_body

ENV_PREFIX = "AGENT_RUNTIME_"
START_TIMEOUT = 20.0
STOP_TIMEOUT = 25.0
# the restart test runs two processes inside the 60 s test timeout
RESTART_START_TIMEOUT = 15.0
RESTART_STOP_TIMEOUT = 10.0
SQLITE_FILE = "agent_runtime_local.db"
JSON = {"content-type": "application/json"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalServer:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    instance_id: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=10.0)

    def stop(self, timeout: float, *signals: signal.Signals) -> int:
        """Send each signal (SIGTERM unless given) and wait; the exit status (fails the test if
        it does not stop in time)."""
        for sig in signals or (signal.SIGTERM,):
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within {timeout}s of {signals}; log:\n{self.log()}")


def _wait_healthy(server: LocalServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: str = "no answer"
    with httpx.Client(base_url=server.base_url, timeout=1.0) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                pytest.fail(f"server exited with {server.proc.returncode}; log:\n{server.log()}")
            try:
                resp = client.get("/healthz")
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    body = resp.json()
                    assert body == {"ok": True, "instance_id": server.instance_id}
                    return
                last = f"{resp.status_code} {resp.text}"
            time.sleep(0.05)  # poll interval, bounded by the deadline
    pytest.fail(f"/healthz not 200 within {timeout}s (last: {last}); log:\n{server.log()}")


@contextmanager
def local_server(
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    start_timeout: float = START_TIMEOUT,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[LocalServer]:
    """Run ``agent-runtime serve --mode local`` in ``workdir`` until healthy; always killed."""
    port = free_port()
    instance_id = f"local-{uuid.uuid4().hex[:6]}"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    full_env.update({"AGENT_RUNTIME_INSTANCE_ID": instance_id, **(env or {})})
    log_path = workdir / f"server-{port}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent_runtime.cli", "serve", "--mode", "local",
             "--port", str(port)],
            cwd=workdir,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )  # fmt: skip
    server = LocalServer(proc, f"http://127.0.0.1:{port}", log_path, instance_id)
    try:
        _wait_healthy(server, start_timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def template(template_id: str, **fields: Any) -> dict[str, Any]:
    return {"template_id": template_id, "image": "registry.local/agent:1.0", **fields}


def post_sync(client: httpx.Client, kind: str, op: str, item: dict[str, Any]) -> httpx.Response:
    body = sync_body(kind, op, item)
    resp = client.post("/api/session/config_sync", json=body, headers=JSON)
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["request_id"] == body["metadata"]["request_id"]
    return resp


def assert_ok(resp: httpx.Response, **data: Any) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["ok"] is True
    for key, value in data.items():
        assert body["data"][key] == value, (key, body)
    return dict(body["data"])


def assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["ok"] is False
    assert body["error_code"] == code
    assert body["error_message"]


@pytest.mark.timeout(60)
def test_local_mode_end_to_end(tmp_path: Path) -> None:
    with local_server(tmp_path) as server, server.client() as client:
        assert (tmp_path / SQLITE_FILE).is_file()  # the SQLite file lands in the working dir

        data = assert_ok(
            post_sync(client, "template", "create", template("t1")),
            kind="template", op="create", id="t1", change_class="none",
        )  # fmt: skip
        assert data["affected_scopes"] == 0
        rule = {"group_id": "grp-1", "bot_id": "bot-1", "template_id": "t1"}
        assert_ok(
            post_sync(client, "routing_rule", "create", rule),
            kind="routing_rule", op="create", id="grp-1/bot-1",
        )  # fmt: skip
        # both exist now
        assert_error(post_sync(client, "template", "create", template("t1")), 409, "CONFLICT")
        assert_error(post_sync(client, "routing_rule", "create", rule), 409, "CONFLICT")

        # the seeded default template (contract §7)
        assert_error(post_sync(client, "template", "create", template("default")), 409, "CONFLICT")
        assert_ok(
            post_sync(client, "template", "update", {"template_id": "default", "pod_ttl": 120}),
            kind="template", op="update", id="default", change_class="policy",
        )  # fmt: skip
        # and the (*, *) rule
        star = {"group_id": "*", "bot_id": "*", "template_id": "default"}
        assert_error(post_sync(client, "routing_rule", "create", star), 409, "CONFLICT")

        # a bad item is a 400 naming the field, not a 422
        resp = post_sync(client, "template", "create", template("t2", bogus=1))
        assert_error(resp, 400, "VALIDATION")
        assert "item.bogus" in resp.json()["error_message"]

        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "# TYPE agent_runtime_http_requests_total counter" in metrics.text
        assert 'endpoint="/api/session/config_sync"' in metrics.text
        assert 'endpoint="/healthz",status="200"' in metrics.text

        assert server.stop(STOP_TIMEOUT) == 0
        log = server.log()
        assert "Traceback" not in log


@pytest.mark.timeout(60)
def test_local_mode_without_seed(tmp_path: Path) -> None:
    env = {"AGENT_RUNTIME_LOCAL_SEED": "false"}
    with local_server(tmp_path, env=env) as server, server.client() as client:
        update = {"template_id": "default", "pod_ttl": 120}
        assert_error(post_sync(client, "template", "update", update), 404, "NOT_FOUND")
        star = {"group_id": "*", "bot_id": "*", "template_id": "default"}
        # no template: the rule is refused as naming a missing template
        assert_error(post_sync(client, "routing_rule", "create", star), 400, "VALIDATION")
        assert_ok(post_sync(client, "template", "create", template("default")), op="create")
        assert server.stop(STOP_TIMEOUT) == 0


@pytest.mark.timeout(60)
def test_local_mode_keeps_data_across_restart(tmp_path: Path) -> None:
    rule = {"group_id": "grp-r", "bot_id": "*", "template_id": "kept"}
    with local_server(tmp_path, start_timeout=RESTART_START_TIMEOUT) as first:
        with first.client() as client:
            assert_ok(post_sync(client, "template", "create", template("kept")), op="create")
            assert_ok(post_sync(client, "routing_rule", "create", rule), op="create")
            update = {"template_id": "default", "session_ttl": 33}
            assert_ok(post_sync(client, "template", "update", update), change_class="policy")
        assert first.stop(RESTART_STOP_TIMEOUT) == 0

    with local_server(tmp_path, start_timeout=RESTART_START_TIMEOUT) as second:
        with second.client() as client:
            assert_error(post_sync(client, "template", "create", template("kept")), 409, "CONFLICT")
            assert_error(post_sync(client, "routing_rule", "create", rule), 409, "CONFLICT")
            # the default was not re-seeded over the update: same value again → no change
            same = {"template_id": "default", "session_ttl": 33}
            assert_ok(post_sync(client, "template", "update", same), change_class="none")
        assert second.stop(RESTART_STOP_TIMEOUT) == 0


def _log_records(server: LocalServer) -> list[dict[str, Any]]:
    """Every line the process wrote, each a JSON log record (a traceback or a bare line of
    text would fail here: that is what a newcomer reads as an error)."""
    records = []
    for line in server.log().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a log record: {line!r}; log:\n{server.log()}")
    return records


@pytest.mark.timeout(60)
@pytest.mark.parametrize("presses", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_ctrl_c_stops_cleanly(tmp_path: Path, presses: int) -> None:
    """Ctrl-C at a terminal is SIGINT (to the whole foreground group; here to the process): the
    same drain as SIGTERM, exit 0, no traceback. A second press skips waiting for requests in
    flight, yet the services still stop. The start in local mode warns about nothing
    (fakeredis has no eviction policy to warn about)."""
    with local_server(tmp_path, start_timeout=RESTART_START_TIMEOUT) as server:
        assert server.stop(RESTART_STOP_TIMEOUT, *[signal.SIGINT] * presses) == 0
        records = _log_records(server)
    messages = [r["msg"] for r in records]
    assert "Application shutdown complete." in messages, messages
    loud = [r for r in records if r["level"] not in ("INFO", "DEBUG")]
    assert loud == []
