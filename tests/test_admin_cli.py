"""``agent-runtime admin …`` as an operator runs it: the venv's console script as a process,
against a real ``agent-runtime serve --mode local`` process with an admin token. Sessions are
routed over HTTP; the CLI's tables show what the service holds, ``--json`` is the admin API's
``data``, failures exit 1 with the error code (or why the service could not be reached), usage
errors exit 2, a drain and a cleanup's dry run and real run do what they say.

Then the CLI's pieces that need no service: tables, ages, escaping, the bounded client
against servers that misbehave (no answer, an oversized one, not an envelope).
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_runtime.admin_cli import output
from test_local_mode import LocalServer, free_port, local_server

CLI = Path(sys.executable).parent / "agent-runtime"  # the venv's console script
TOKEN = f"adm-{uuid.uuid4().hex[:8]}"
CLI_TIMEOUT = 30.0  # seconds one CLI process may take on a loaded machine
SESSION_TTL = 3600  # the sessions a test routes outlive the module
NOT_OURS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    workdir = tmp_path_factory.mktemp("admin-cli")
    with local_server(workdir, env={"AGENT_RUNTIME_ADMIN_TOKENS": f"other,{TOKEN}"}) as server:
        with server.client() as client:
            update = {"template_id": "default", "session_ttl": SESSION_TTL}
            body = {
                "metadata": {"request_id": "r-ttl"},
                "rawdata": {"kind": "template", "op": "update", "item": update},
            }
            resp = client.post("/api/session/config_sync", json=body, headers=admin_headers())
            assert resp.status_code == 200, resp.text
        yield server
        assert "Traceback" not in server.log()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def run_cli(
    *args: str, url: str | None = None, token: str | None = TOKEN, timeout: float = CLI_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """``agent-runtime admin ARGS`` with the service's URL and token in the environment (as
    an operator sets them), nothing else of ours, no proxy."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AGENT_RUNTIME_") and k not in NOT_OURS
    }
    if url is not None:
        env["AGENT_RUNTIME_URL"] = url
    if token is not None:
        env["AGENT_RUNTIME_ADMIN_TOKEN"] = token
    return subprocess.run(
        [str(CLI), "admin", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def table(text: str) -> list[dict[str, str]]:
    """A table's rows as {HEADER: cell}: columns start where their header starts."""
    header, *lines = text.splitlines()
    names = header.split()
    starts = [header.index(f" {n}") + 1 if i else 0 for i, n in enumerate(names)]
    ends = [*starts[1:], None]
    return [
        {n: line[s:e].strip() for n, s, e in zip(names, starts, ends, strict=True)}
        for line in lines
    ]


def block(text: str) -> dict[str, str]:
    """A key/value block's top-level lines as {key: value}."""
    pairs = {}
    for line in text.splitlines():
        if line and not line.startswith(" ") and ":" in line:
            key, value = line.split(":", 1)
            pairs[key] = value.strip()
    return pairs


def route(server: LocalServer, session_id: str, group_id: str, bot_id: str = "bot") -> str:
    body = {
        "metadata": {
            "request_id": f"r-{uuid.uuid4().hex[:8]}",
            "session_id": session_id,
            "bot_id": bot_id,
            "extra": {"group_id": group_id},
        },
        "rawdata": {},
    }
    with server.client() as client:
        resp = client.post("/api/session/route", json=body)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["data"]["pod_id"])


def api(server: LocalServer, path: str, **params: Any) -> Any:
    with server.client() as client:
        resp = client.get(f"/api/session/admin{path}", params=params, headers=admin_headers())
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


def scope_of(server: LocalServer, group_id: str) -> str:
    (scope,) = [s for s in api(server, "/scopes", limit=200)["scopes"] if s["group_id"] == group_id]
    return str(scope["scope_id"])


def fresh_group() -> str:
    return f"grp-{uuid.uuid4().hex[:8]}"


# --- against the running service ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_scopes_table_lists_each_scope_and_json_is_the_api_data(server: LocalServer) -> None:
    first, second = fresh_group(), fresh_group()
    route(server, "s-1", first)
    route(server, "s-2", first)
    route(server, "s-3", second)

    rows = {r["GROUP"]: r for r in table(ok(run_cli("scopes", url=server.base_url)))}
    assert rows[first]["SESSIONS"] == "2" and rows[second]["SESSIONS"] == "1"
    assert rows[first]["BOT"] == "bot" and rows[first]["TEMPLATE"] == "default"
    assert rows[first]["IN-USE"] == "1" and rows[first]["IDLE"] == "0"
    assert rows[first]["SCOPE"] == scope_of(server, first)

    # --json: every page walked, as the API's data (one page here); options after the command
    walked = json.loads(ok(run_cli("scopes", "--json", "--url", server.base_url)))
    assert walked == api(server, "/scopes", limit=200)
    one = json.loads(ok(run_cli("-o", "json", "scopes", "--limit", "1", url=server.base_url)))
    assert one == api(server, "/scopes", limit=1)
    more = run_cli("scopes", "--limit", "1", url=server.base_url)
    assert f"More scopes: --cursor {one['next_cursor']}" in ok(more) + more.stderr


@pytest.mark.timeout(120)
def test_scope_pod_and_session_show_what_the_service_holds(server: LocalServer) -> None:
    group = fresh_group()
    session = f"team/{group} ?#%"  # an id every path character of which must be escaped
    pod = route(server, session, group)
    assert route(server, "s-other", group) == pod
    sid = scope_of(server, group)

    text = ok(run_cli("scope", sid, url=server.base_url))
    shown = block(text)
    assert shown["Scope"] == sid and shown["Group"] == group and shown["Template"] == "default"
    assert shown["Live sessions"] == "2" and shown["Candidate pods"] == "1"
    assert f"session_ttl={SESSION_TTL}" in shown["Policy"]
    pods = table("\n".join(line[2:] for line in text.split("Pods:\n", 1)[1].splitlines()))
    assert pods == [
        {
            "POD": pod, "CANDIDATE": "true", "SESSIONS": "2", "PHASE": "in_use",
            "DEPLOY-VER": shown["Deploy version"], "IP": pods[0]["IP"],
        }
    ]  # fmt: skip
    as_json = json.loads(ok(run_cli("scope", sid, "--json", url=server.base_url)))
    assert as_json == api(server, f"/scopes/{sid}")

    shown = block(ok(run_cli("pod", pod, url=server.base_url)))
    assert shown["Pod"] == pod and shown["Owned"] == "true" and shown["Scope"] == sid
    assert shown["Phase"] == "in_use" and shown["Namespace"] == "default"
    assert shown["Sessions"] == f"2 in scope {sid} (candidate: true)"
    assert json.loads(ok(run_cli("pod", pod, "--json", url=server.base_url))) == api(
        server, f"/pods/{pod}"
    )

    shown = block(ok(run_cli("session", session, url=server.base_url)))
    assert shown["Session"] == session and shown["Scope"] == sid and shown["Pod"] == pod
    assert shown["Session TTL"] == f"{SESSION_TTL}s" and shown["Previous pod"] == "<none>"
    assert shown["Expires"].endswith("m)") or shown["Expires"].endswith("s)")
    data = json.loads(ok(run_cli("session", session, "--json", url=server.base_url)))
    assert data["session_id"] == session and data["binding"]["pod_id"] == pod


@pytest.mark.timeout(120)
def test_failures_exit_1_with_the_error_code_usage_errors_exit_2(server: LocalServer) -> None:
    wrong = run_cli("scopes", url=server.base_url, token="not-the-token")
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr.startswith("agent-runtime: error: UNAUTHORIZED: "), wrong.stderr
    missing = run_cli("pod", "agent-nobody", url=server.base_url)
    assert missing.returncode == 1
    assert missing.stderr == "agent-runtime: error: NOT_FOUND: pod agent-nobody is not known\n"

    unknown = run_cli("scope", "0" * 32, url=server.base_url)
    assert unknown.returncode == 1 and unknown.stderr.startswith("agent-runtime: error: NOT_FOUND")
    foreign = run_cli("foreign-pods", url=server.base_url)  # local mode: none
    assert ok(foreign) == "" and "No foreign pods found" in foreign.stderr
    foreign_json = json.loads(ok(run_cli("foreign-pods", "--json", url=server.base_url)))
    assert foreign_json == api(server, "/foreign_pods") == {"count": 0, "pods": []}

    port = free_port()  # nothing listens there
    gone = run_cli("scopes", url=f"http://127.0.0.1:{port}")
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.startswith(
        f"agent-runtime: error: cannot reach the service at http://127.0.0.1:{port}"
    ), gone.stderr

    for args in (
        ("scopes", "--limit", "0"),
        ("scopes", "--limit", "201"),
        ("drain", "pod", "p", "--seconds", "86401"),
        ("scopes", "--timeout", "0"),
        ("scopes", "--url", "ftp://127.0.0.1/"),
        ("scopes", "--url", "http://user:secret@127.0.0.1/"),
        ("scopes", "--token", "two words"),
        ("cleanup",),  # deletes: --dry-run first, or --yes
        ("nothing",),
    ):
        usage = run_cli(*args, url=server.base_url)
        assert usage.returncode == 2, (args, usage.stderr)
        assert "usage:" in usage.stderr and "secret" not in usage.stderr, usage.stderr

    # the token from a file (a Secret's mount), and with no token at all: 401
    token_file = Path(server.log_path.parent / "token")
    token_file.write_text(f"{TOKEN}\n")
    ok(run_cli("drains", "--token-file", str(token_file), url=server.base_url, token=None))
    anonymous = run_cli("drains", url=server.base_url, token=None)
    assert anonymous.returncode == 1 and "UNAUTHORIZED" in anonymous.stderr


@pytest.mark.timeout(120)
def test_drain_pod_then_drains_and_pod_show_it(server: LocalServer) -> None:
    group = fresh_group()
    pod = route(server, "s-drain", group)
    out = ok(run_cli("drain", "pod", pod, "--seconds", "600", url=server.base_url))
    assert out.startswith(f"pod/{pod} draining: deadline in ")
    assert out.rstrip().endswith("sessions left: 1")

    rows = {r["POD"]: r for r in table(ok(run_cli("drains", url=server.base_url)))}
    assert rows[pod]["STATE"] == "draining" and rows[pod]["TRIGGER"] == "admin"
    assert rows[pod]["SESSIONS"] == "1" and rows[pod]["SCOPE"] == scope_of(server, group)
    again = json.loads(ok(run_cli("drain", "pod", pod, "--json", url=server.base_url)))
    assert again["started"] is False and again["state"] == "draining"
    assert block(ok(run_cli("pod", pod, url=server.base_url)))["Drain"].startswith(
        "draining (admin), deadline "
    )
    node = ok(run_cli("drain", "node", "node-nobody", url=server.base_url))
    assert node == "node/node-nobody: no pod of ours on it\n"

    # its node: every pod of ours there, ours among them (its drain kept, not restarted)
    listed = json.loads(ok(run_cli("cleanup", "--dry-run", "--json", url=server.base_url)))
    (where,) = {p["node"] for p in listed["pods"] if p["pod_id"] == pod}
    lines = ok(run_cli("drain", "node", where, "--seconds", "600", url=server.base_url))
    ours = [line for line in lines.splitlines() if line.startswith(f"pod/{pod} ")]
    assert len(ours) == 1 and ours[0].endswith("(a drain was under way: kept)"), lines


@pytest.mark.timeout(120)
def test_cleanup_dry_run_lists_the_pods_and_deletes_nothing_then_cleanup_deletes_them(
    server: LocalServer,
) -> None:
    group = fresh_group()
    pod = route(server, "s-clean", group)
    sid = scope_of(server, group)
    selector = f"agent-runtime/scope={sid}"

    dry = run_cli("cleanup", "--dry-run", "-l", selector, url=server.base_url)
    assert table(ok(dry)) == [
        {"NAMESPACE": "default", "POD": pod, "SCOPE": sid, "PHASE": "Running", "READY": "true",
         "NODE": table(dry.stdout)[0]["NODE"], "AGE": table(dry.stdout)[0]["AGE"]}
    ]  # fmt: skip
    assert "1 pod would be deleted (dry run: none was)." in dry.stderr
    everything = json.loads(ok(run_cli("cleanup", "--dry-run", "--json", url=server.base_url)))
    assert everything["dry_run"] is True and everything["matched"] >= 1
    assert pod in [p["pod_id"] for p in everything["pods"]]
    # still there: its session refreshes on it, the service still knows it
    assert route(server, "s-clean", group) == pod
    assert block(ok(run_cli("pod", pod, url=server.base_url)))["Owned"] == "true"

    assert ok(run_cli("cleanup", "-l", selector, "--yes", url=server.base_url)) == "cleaned 1\n"
    after = run_cli("cleanup", "--dry-run", "-l", selector, url=server.base_url)
    assert ok(after) == "" and "0 pods would be deleted" in after.stderr
    again = json.loads(
        ok(run_cli("cleanup", "-l", selector, "--yes", "-o", "json", url=server.base_url))
    )
    assert again == {"cleaned": 0}
    refused = run_cli("cleanup", "--dry-run", "-l", "a in ()", url=server.base_url)
    assert refused.returncode == 1 and "VALIDATION: rawdata.label_selector" in refused.stderr


# --- the pieces, without a service ---------------------------------------------------------------


def test_tables_align_under_upper_case_headers_and_escape_what_a_terminal_would_run() -> None:
    text = output.table(
        ["pod", "ready", "sessions"], [["agent-1", True, 2], ["a\x1b[31mred", None, 10.0]]
    )
    assert text.splitlines() == [
        "POD            READY    SESSIONS",
        "agent-1        true     2",
        "a\\x1b[31mred   <none>   10",
    ]
    assert output.block([("Pod", "p"), ("Other fields", {"b": "2", "a": "\u202e"})]) == (
        "Pod:          p\nOther fields:\n  a: \\u202e\n  b: 2"
    )


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"), (59.9, "59s"), (119, "119s"), (125, "2m5s"), (600, "10m"), (3 * 3600, "3h"),
        (5 * 3600 + 600, "5h10m"), (47 * 3600, "47h"), (3 * 86400 + 4 * 3600, "3d4h"),
        (12 * 86400, "12d"), (-5, "0s"), (None, "<unknown>"), (float("nan"), "<unknown>"),
    ],
)  # fmt: skip
def test_spans_read_as_kubectl_ages(seconds: float | None, shown: str) -> None:
    assert output.span(seconds) == shown


def test_moments_are_utc_and_relative() -> None:
    now = 1_796_373_600.0  # 2026-12-04T08:40:00Z
    assert output.moment("1796373658.5", now) == "2026-12-04T08:40:58Z (in 58s)"
    assert output.moment(now - 300, now) == "2026-12-04T08:35:00Z (5m ago)"
    assert output.moment("soon", now) == "soon"
    assert output.moment(1e300, now) == "1e+300"


class OneShotServer:
    """A TCP listener on 127.0.0.1 that answers each connection with ``reply`` (None: reads
    and never answers) until closed."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.held: list[socket.socket] = []

    def __enter__(self) -> OneShotServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for conn in self.held:
            conn.close()
        self.sock.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.recv(65536)
            if self.reply is None:
                self.held.append(conn)  # silent until the test ends
                continue
            conn.sendall(self.reply)
            conn.close()


class FakeAdminApi:
    """An HTTP server on 127.0.0.1 whose ``GET /api/session/admin/scopes`` answers what
    ``pages(cursor)`` gives (the envelope around it); it counts the calls. A POST is
    recorded (its ``X-Request-Id`` and body) and answered ``{"cleaned": 0}``."""

    def __init__(self, pages: Callable[[int], dict[str, Any]]) -> None:
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.calls += 1
                query = dict(p.split("=", 1) for p in self.path.split("?", 1)[1].split("&"))
                body = json.dumps(
                    {"ok": True, "request_id": "x", "data": pages(int(query["cursor"]))}
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_POST(self) -> None:
                sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.posts.append((self.headers["X-Request-Id"], sent))
                body = json.dumps({"ok": True, "request_id": "x", "data": {"cleaned": 0}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.calls = 0
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeAdminApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def fake_scope(group: str) -> dict[str, Any]:
    pods = {"in_use": 1, "idle": 0, "deploying": 0, "retiring": 0}
    return {
        "scope_id": f"sid-{group}", "group_id": group, "bot_id": "b", "config": None,
        "live_sessions": 1, "waiters": 0, "reserved": 0, "candidate_pods": 1, "pods": pods,
    }  # fmt: skip


def test_a_cleanup_sends_one_request_id_in_the_envelope_and_the_header() -> None:
    with FakeAdminApi(lambda cursor: {}) as api:
        assert ok(run_cli("cleanup", "-l", "app=x", "--yes", url=api.url)) == "cleaned 0\n"
    ((header, sent),) = api.posts
    assert sent["metadata"]["request_id"] == header and len(header) >= 16
    assert sent["rawdata"] == {"dry_run": False, "label_selector": "app=x"}


def test_scopes_walks_every_page_once_per_scope_and_stops_at_its_bound() -> None:
    a, b, c = fake_scope("a"), fake_scope("b"), fake_scope("c")
    pages = {0: ([a, b], 7), 7: ([], 9), 9: ([b, c], 0)}  # an empty page, b seen twice

    with FakeAdminApi(
        lambda cursor: {"scopes": pages[cursor][0], "next_cursor": pages[cursor][1]}
    ) as fake:
        walked = json.loads(ok(run_cli("scopes", "--json", url=fake.url)))
        assert fake.calls == 3
        rows = table(ok(run_cli("scopes", url=fake.url)))
    assert walked == {"scopes": [a, b, c], "next_cursor": 0}
    assert [r["GROUP"] for r in rows] == ["a", "b", "c"] and rows[0]["TEMPLATE"] == "<none>"

    # a cursor that never comes back to 0: at most 1,000 pages, then a hint where to go on
    with FakeAdminApi(lambda cursor: {"scopes": [], "next_cursor": cursor + 1}) as endless:
        proc = run_cli("scopes", url=endless.url, timeout=120)
        assert endless.calls == 1000
    assert ok(proc) == "" and "More scopes: --cursor 1000" in proc.stderr


def test_no_answer_within_the_timeout_exits_1_saying_so() -> None:
    with OneShotServer(None) as silent:
        started = time.monotonic()
        proc = run_cli("scopes", "--timeout", "1", url=silent.url)
        took = time.monotonic() - started
    assert proc.returncode == 1
    assert (
        proc.stderr == f"agent-runtime: error: no answer from {silent.url} within 1 s (--timeout)\n"
    )
    assert took >= 1.0


def test_an_oversized_answer_is_refused_before_it_is_read() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40000000\r\n\r\n"
    with OneShotServer(head + b"{") as huge:
        proc = run_cli("scopes", url=huge.url)
    assert proc.returncode == 1
    assert "is larger than 32 MiB; ask for less (--limit)" in proc.stderr, proc.stderr


def test_an_answer_that_is_not_an_envelope_says_so() -> None:
    page = b"<html>proxy error</html>"
    head = f"HTTP/1.1 502 Bad Gateway\r\nContent-Length: {len(page)}\r\n\r\n".encode()
    with OneShotServer(head + page) as proxy:
        proc = run_cli("pod", "p", url=proxy.url)
    assert proc.returncode == 1
    assert proc.stderr == (
        f"agent-runtime: error: {proxy.url} answered HTTP 502 without an agent-runtime envelope "
        "(is it the service?): '<html>proxy error</html>'\n"
    )


def test_every_command_has_help() -> None:
    for command in (
        "scopes",
        "scope",
        "pod",
        "session",
        "foreign-pods",
        "drains",
        "drain",
        "cleanup",
    ):
        proc = run_cli(command, "--help")
        assert proc.returncode == 0 and f"agent-runtime admin {command}" in proc.stdout
    top = " ".join(ok(run_cli("--help")).split())
    assert "A token on the command line shows in `ps`" in top


def test_the_bounds_the_cli_copies_are_the_services() -> None:
    """The CLI keeps its own copies (it imports none of the service's floors, for a quick
    start); they must say what the service enforces."""
    from agent_runtime import admin
    from agent_runtime.admin_cli import commands
    from agent_runtime.resource_manager import drains

    assert commands.MAX_PAGE == admin.MAX_PAGE
    assert commands.MAX_DRAIN_SECONDS == drains.MAX_DRAIN_SECONDS
