"""Traces (tracing.py) through the app's public HTTP interface: the server span per request and
its attributes, the slow path's child spans under it, a caller's ``traceparent`` continued,
the trace id in the request's log lines, error answers; off: no middleware, no spans, no
export thread. Then a real ``agent-runtime serve --mode local`` exporting over OTLP/HTTP to a
receiver in the test, which decodes what arrives."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agent_runtime import logs
from agent_runtime.main import create_app
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.tracing import OtelTracing, ServerSpans, Tracing, from_environment
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import build_backends
from helpers import envelope, make_settings, sync_body
from test_local_mode import local_server

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def traceparent(trace_id: str = CALLER_TRACE, span_id: str = CALLER_SPAN) -> str:
    return f"00-{trace_id}-{span_id}-01"


class LogLines(logging.Handler):
    """Every record formatted at emit time, as the service writes it (JSON)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logs.JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@contextmanager
def captured_logs() -> Iterator[LogLines]:
    handler = LogLines()
    root = logging.getLogger("agent_runtime")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@asynccontextmanager
async def local_app(
    tmp_path: Path, tracing: Tracing | None, *, ready_delay: float = 0.0
) -> AsyncIterator[httpx.AsyncClient]:
    """Local mode as a developer runs it (fakeredis, SQLite, the fake Kubernetes — its pods
    Ready after ``ready_delay`` s —, the seeded default template), lifespan started, through
    httpx's ASGI transport."""
    settings = make_settings(
        local_seed=True, database_url=f"sqlite:///{tmp_path / f'{uuid.uuid4().hex[:6]}.db'}"
    )
    backends = build_backends(settings)
    backends.k8s = FakeK8sPodClient(ready_delay=ready_delay)
    app = create_app(settings, backends=backends, owns_backends=True, tracing=tracing)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def traced() -> tuple[OtelTracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return OtelTracing(exporter=exporter, instance_id="test-1", batch=False), exporter


class Started(SpanProcessor):
    """The names of the spans started so far: a test waits for a step to be under way."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.more = asyncio.Event()  # spans start on the event loop's thread

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.names.append(span.name)
        self.more.set()

    async def reached(self, name: str, within: float = 20.0) -> None:
        async with asyncio.timeout(within):
            while name not in self.names:
                self.more.clear()
                await self.more.wait()


async def configure(
    client: httpx.AsyncClient, group: str, *, scope_concurrency: int, pod_concurrency: int
) -> None:
    template = {
        "template_id": f"t-{group}",
        "image": "agent:1",
        "scope_concurrency": scope_concurrency,
        "pod_concurrency": pod_concurrency,
        "min_idle_pods": 0,
    }
    rule = {"group_id": group, "bot_id": "*", "template_id": f"t-{group}"}
    for kind, item in (("template", template), ("routing_rule", rule)):
        resp = await client.post("/api/session/config_sync", json=sync_body(kind, "sync", item))
        assert resp.status_code == 200, resp.text


def route_body(session_id: str, group_id: str = "g-1") -> dict[str, Any]:
    return envelope(
        request_id=f"r-{uuid.uuid4().hex[:8]}",
        session_id=session_id,
        bot_id="bot-1",
        extra={"group_id": group_id},
    )


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def ancestors(span: ReadableSpan, spans: list[ReadableSpan]) -> list[str]:
    """Names from ``span``'s parent up to the root (within ``spans``)."""
    index = {s.context.span_id: s for s in spans if s.context is not None}
    names: list[str] = []
    current = index.get(parent_id(span) or 0)
    while current is not None:
        names.append(current.name)
        current = index.get(parent_id(current) or 0)
    return names


async def test_placed_route_continues_the_callers_trace_with_the_slow_path_under_it(
    tmp_path: Path,
) -> None:
    tracing, exporter = traced()
    with captured_logs() as captured:
        async with local_app(tmp_path, tracing) as client:
            exporter.clear()  # startup's own spans (none expected: jobs are off)
            resp = await client.post(
                ROUTE, json=route_body("s-placed"), headers={"traceparent": traceparent()}
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["data"]["placement"] == "placed"
            spans = list(exporter.get_finished_spans())
    named = by_name(spans)
    [server] = named["POST /api/session/route"]
    assert server.kind is SpanKind.SERVER
    assert server.context is not None and server.parent is not None
    assert f"{server.context.trace_id:032x}" == CALLER_TRACE  # the gateway's trace goes on
    assert f"{server.parent.span_id:016x}" == CALLER_SPAN and server.parent.is_remote
    attributes = dict(server.attributes or {})
    assert attributes["http.request.method"] == "POST"
    assert attributes["url.path"] == ROUTE
    assert attributes["http.response.status_code"] == 200
    assert attributes["agent_runtime.session_id"] == "s-placed"
    assert attributes["agent_runtime.scope_id"] == scope_id_of("g-1", "bot-1")
    assert attributes["agent_runtime.placement"] == "placed"
    assert "agent_runtime.error_code" not in attributes
    assert server.status.status_code is StatusCode.UNSET
    # every span of the request is in the caller's trace, under the server span
    assert {s.context.trace_id for s in spans if s.context} == {int(CALLER_TRACE, 16)}
    for name in ("resolve", "acquire", "deploy"):
        assert name in named, f"no {name} span among {sorted(named)}"
    [resolve] = named["resolve"]
    assert parent_id(resolve) == server.context.span_id
    assert dict(resolve.attributes or {})["agent_runtime.resolve.from"] == "db"
    [acquire] = named["acquire"]
    assert parent_id(acquire) == server.context.span_id
    assert dict(acquire.attributes or {})["agent_runtime.acquire.source"] == "deploy"
    [deploy] = named["deploy"]
    assert ancestors(deploy, spans)[:1] == ["acquire"]
    assert dict(deploy.attributes or {})["agent_runtime.deploy.kind"] == "cold"
    k8s = [s for s in spans if s.name.startswith("k8s ")]
    assert k8s, f"no Kubernetes call span among {sorted(named)}"
    for call in k8s:
        assert call.kind is SpanKind.CLIENT
        assert ancestors(call, spans)[:2] == ["deploy", "acquire"], call.name
        assert dict(call.attributes or {})["agent_runtime.k8s.outcome"] == "ok"
    # the request's log lines carry its trace id (and the span they were written under)
    lines = [line for line in captured.lines if line.get("session_id") == "s-placed"]
    assert lines, "no log line of the request"
    for line in lines:
        assert line["trace_id"] == CALLER_TRACE, line
        assert len(line["span_id"]) == 16, line
    span_ids = {f"{s.context.span_id:016x}" for s in spans if s.context}
    assert {line["span_id"] for line in lines} <= span_ids


async def test_refresh_is_one_span_and_a_new_trace_without_traceparent(tmp_path: Path) -> None:
    tracing, exporter = traced()
    async with local_app(tmp_path, tracing) as client:
        assert (await client.post(ROUTE, json=route_body("s-refresh"))).status_code == 200
        exporter.clear()
        resp = await client.post(ROUTE, json=route_body("s-refresh"))
        assert resp.json()["data"]["placement"] == "refresh"
        spans = exporter.get_finished_spans()
    [server] = spans  # the hot path: one EVALSHA, no child span
    assert server.name == "POST /api/session/route" and server.parent is None
    attributes = dict(server.attributes or {})
    assert attributes["agent_runtime.placement"] == "refresh"
    assert attributes["agent_runtime.session_id"] == "s-refresh"


async def test_error_answers_carry_their_code_and_status_error(tmp_path: Path) -> None:
    tracing, exporter = traced()
    async with local_app(tmp_path, tracing) as client:
        exporter.clear()
        bad = await client.post(ROUTE, json={"metadata": {"request_id": "r-1"}})
        assert bad.status_code == 400
        unknown = await client.post("/api/session/nowhere", json={})
        assert unknown.status_code == 404
        long = await client.post("/x" * 2000, json={})
        assert long.status_code == 404
        gone = await client.post(TOUCH, json=envelope(session_id="s-none"))
        assert gone.status_code == 200
        for probe in ("/healthz", "/metrics"):  # probes and scrapes make no trace
            assert (await client.get(probe)).status_code == 200
        spans = list(exporter.get_finished_spans())
    names = [s.name for s in spans]
    assert names == ["POST /api/session/route", "POST", "POST", "POST /api/session/touch"]
    route, nowhere, long_path, touch = spans
    assert dict(long_path.attributes or {})["url.path"] == ("/x" * 2000)[:256]  # bounded
    for span, code, status in ((route, "VALIDATION", 400), (nowhere, "NOT_FOUND", 404)):
        attributes = dict(span.attributes or {})
        assert attributes["agent_runtime.error_code"] == code
        assert attributes["error.type"] == code
        assert attributes["http.response.status_code"] == status
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == code
    assert dict(nowhere.attributes or {})["url.path"] == "/api/session/nowhere"  # name bounded
    assert dict(touch.attributes or {})["agent_runtime.session_id"] == "s-none"
    assert touch.status.status_code is StatusCode.UNSET


async def test_a_route_waiting_for_a_slot_has_its_queue_wait_span(tmp_path: Path) -> None:
    tracing, exporter = traced()
    started = Started()
    tracing.provider.add_span_processor(started)
    async with local_app(tmp_path, tracing) as client:
        await configure(client, "g-q", scope_concurrency=1, pod_concurrency=1)
        first = await client.post(ROUTE, json=route_body("s-q1", "g-q"))
        assert first.json()["data"]["placement"] == "placed"
        exporter.clear()
        waiting = asyncio.create_task(client.post(ROUTE, json=route_body("s-q2", "g-q")))
        await started.reached("queue wait")  # the scope is full: the second route waits
        ended = await client.post(TOUCH, json=envelope(session_id="s-q1", rawdata={"eos": True}))
        assert ended.json()["data"]["released"] is True
        second = await waiting
        assert second.json()["data"]["placement"] in ("placed", "rebound"), second.text
        spans = list(exporter.get_finished_spans())
    named = by_name(spans)
    servers = [
        s
        for s in named["POST /api/session/route"]
        if dict(s.attributes or {})["agent_runtime.session_id"] == "s-q2"
    ]
    [server] = servers
    [wait] = named["queue wait"]
    assert server.context is not None and parent_id(wait) == server.context.span_id
    assert dict(wait.attributes or {})["agent_runtime.scope_id"] == scope_id_of("g-q", "bot-1")
    assert wait.end_time is not None and server.end_time is not None
    assert wait.end_time <= server.end_time


async def test_a_follower_waits_under_its_own_span(tmp_path: Path) -> None:
    tracing, exporter = traced()
    started = Started()
    tracing.provider.add_span_processor(started)
    # one pod for two sessions (max_pods 1), Ready after a second: the second route follows
    async with local_app(tmp_path, tracing, ready_delay=1.0) as client:
        await configure(client, "g-f", scope_concurrency=2, pod_concurrency=2)
        exporter.clear()
        leader = asyncio.create_task(client.post(ROUTE, json=route_body("s-f1", "g-f")))
        await started.reached("k8s deploy")  # the leader's deploy is under way
        follower = await client.post(ROUTE, json=route_body("s-f2", "g-f"))
        answers = [await leader, follower]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert answers[0].json()["data"]["pod_id"] == answers[1].json()["data"]["pod_id"]
        spans = list(exporter.get_finished_spans())
    named = by_name(spans)
    [wait] = named["follower wait"]
    assert ancestors(wait, spans) == ["acquire", "POST /api/session/route"]
    [server] = [s for s in named["POST /api/session/route"] if s.context and wait.context
                and s.context.trace_id == wait.context.trace_id]  # fmt: skip
    assert dict(server.attributes or {})["agent_runtime.session_id"] == "s-f2"
    sources = {dict(s.attributes or {})["agent_runtime.acquire.source"] for s in named["acquire"]}
    assert sources == {"deploy", "follower"}
    assert len(named["deploy"]) == 1


async def test_a_failed_deploy_marks_its_spans_without_the_error_text(tmp_path: Path) -> None:
    tracing, exporter = traced()
    async with local_app(tmp_path, tracing) as client:
        k8s = client.app.state.services.backends.k8s  # type: ignore[attr-defined]
        k8s.fail_next_deploys = 1  # DeployFailed("fake: injected deploy failure")
        exporter.clear()
        resp = await client.post(ROUTE, json=route_body("s-fail"))
        assert resp.json()["error_code"] == "NO_POD_AVAILABLE", resp.text
        spans = list(exporter.get_finished_spans())
    named = by_name(spans)
    for name in ("k8s deploy", "deploy", "acquire"):
        [span] = named[name]
        assert span.status.status_code is StatusCode.ERROR, name
        assert span.status.description == "DeployFailed", name
        assert dict(span.attributes or {})["error.type"] == "DeployFailed", name
    for span in spans:  # an API server's refusal may echo a manifest: no span holds the text
        assert not span.events, (span.name, span.events)
        assert "injected" not in (span.status.description or ""), span.name
    [server] = named["POST /api/session/route"]
    assert dict(server.attributes or {})["agent_runtime.error_code"] == "NO_POD_AVAILABLE"


async def test_two_concurrent_routes_keep_their_own_traces(tmp_path: Path) -> None:
    tracing, exporter = traced()
    traces = [uuid.uuid4().hex for _ in range(2)]
    async with local_app(tmp_path, tracing) as client:
        exporter.clear()
        answers = await asyncio.gather(
            *(
                client.post(
                    ROUTE,
                    json=route_body(f"s-c{i}"),
                    headers={"traceparent": traceparent(trace, CALLER_SPAN)},
                )
                for i, trace in enumerate(traces)
            )
        )
        assert [a.status_code for a in answers] == [200, 200]
        spans = list(exporter.get_finished_spans())
    servers = by_name(spans)["POST /api/session/route"]
    seen = {
        f"{s.context.trace_id:032x}": dict(s.attributes or {})["agent_runtime.session_id"]
        for s in servers
        if s.context
    }
    assert seen == {traces[0]: "s-c0", traces[1]: "s-c1"}
    for span in spans:  # each child is in the trace of the request that opened it
        assert span.context is not None
        root = [s for s in servers if s.context and s.context.trace_id == span.context.trace_id]
        assert len(root) == 1, span.name


async def test_a_job_tick_is_a_span_with_its_kubernetes_calls_under_it(tmp_path: Path) -> None:
    tracing, exporter = traced()
    async with local_app(tmp_path, tracing) as client:
        assert (await client.post(ROUTE, json=route_body("s-job"))).status_code == 200
        exporter.clear()
        jobs = client.app.state.services.jobs  # type: ignore[attr-defined]
        with captured_logs():
            assert await jobs.run_once("rm_reconcile")
        spans = list(exporter.get_finished_spans())
    named = by_name(spans)
    [tick] = named["job rm_reconcile"]
    assert (
        tick.parent is None and dict(tick.attributes or {})["agent_runtime.job"] == "rm_reconcile"
    )
    calls = [s for s in spans if s.name.startswith("k8s ")]
    assert calls, sorted(named)
    assert all(ancestors(call, spans)[-1] == "job rm_reconcile" for call in calls)


class Stuck(InMemorySpanExporter):
    """An exporter whose export hangs until released (a collector that stopped answering)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def export(self, spans: Any) -> Any:
        self.release.wait(30)
        return super().export(spans)


def test_the_stop_does_not_wait_past_its_bound_for_a_stuck_export() -> None:
    exporter = Stuck()
    tracing = OtelTracing(exporter=exporter, instance_id="test-1")  # batched, as served
    with tracing.span("before the stop"):
        pass
    started = time.monotonic()
    try:
        asyncio.run(tracing.shutdown(0.5))  # its own loop, closed when it returns
        waited = time.monotonic() - started
    finally:
        exporter.release.set()  # the export ends: the shutdown thread goes on
    assert waited < 5.0, waited  # the bound, with room for a loaded machine
    # the shutdown thread ends after its loop closed: quietly (pytest fails the test on an
    # exception in a thread)
    for thread in [t for t in threading.enumerate() if t.name == "tracing-shutdown"]:
        thread.join(30)
        assert not thread.is_alive()
    assert [s.name for s in exporter.get_finished_spans()] == ["before the stop"]


def middleware_chain(app: FastAPI) -> list[Any]:
    chain, current = [], app.middleware_stack
    while current is not None:
        chain.append(current)
        current = getattr(current, "app", None)
    return chain


async def test_off_installs_nothing_and_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with captured_logs() as captured:
        async with local_app(tmp_path, None) as client:  # from the (empty) environment
            resp = await client.post(
                ROUTE, json=route_body("s-off"), headers={"traceparent": traceparent()}
            )
            assert resp.status_code == 200
            chain = middleware_chain(client.app)  # type: ignore[attr-defined]
    assert chain and not any(isinstance(layer, ServerSpans) for layer in chain)
    assert not [t for t in threading.enumerate() if t.name.startswith("OtelBatch")]
    lines = [line for line in captured.lines if line.get("session_id") == "s-off"]
    assert lines and not any("trace_id" in line or "span_id" in line for line in lines)


def test_the_standard_variables_turn_it_on_and_off() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    assert not from_environment({}, instance_id="i").enabled
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert not from_environment({**endpoint, **off}, instance_id="i").enabled
    with pytest.raises(ValueError, match="http/protobuf"):
        from_environment({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, instance_id="i")
    for env in (endpoint, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/t"}):
        tracing = from_environment(env, instance_id="i")
        assert isinstance(tracing, OtelTracing)
        asyncio.run(tracing.shutdown(5.0))  # its export thread ends with it


def test_a_start_with_another_otlp_protocol_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_RUNTIME_", "OTEL_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    done = subprocess.run(
        [sys.executable, "-m", "agent_runtime.cli", "serve", "--mode", "local", "--port", "9"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "agent-runtime: error: OTEL_EXPORTER_OTLP_PROTOCOL=grpc: only http/protobuf is built in "
        "(point it at the collector's OTLP/HTTP port, usually 4318)"
    ]


# --- a real process exporting to a receiver -------------------------------------------------


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP receiver: POST /v1/traces, protobuf bodies decoded and kept."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.requests: list[ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) of every span received so far."""
        out = []
        with self.lock:
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    resource = {
                        a.key: a.value.string_value for a in resource_spans.resource.attributes
                    }
                    for scope_spans in resource_spans.scope_spans:
                        out.extend((resource, span) for span in scope_spans.spans)
        return out


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(min(length, 16 * 1024 * 1024))
        if self.path != "/v1/traces" or self.headers.get("content-type") != (
            "application/x-protobuf"
        ):
            self.send_response(404)
            self.end_headers()
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.server.lock:
            self.server.requests.append(request)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return None


def test_a_served_process_exports_its_spans_over_otlp_http(tmp_path: Path) -> None:
    receiver = Receiver()
    serving = threading.Thread(target=receiver.serve_forever, name="otlp-receiver", daemon=True)
    serving.start()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the batch goes out soon
            "OTEL_SERVICE_NAME": "",  # the default service name
        }
        with local_server(tmp_path, env=env) as server, server.client() as client:
            headers = {"traceparent": traceparent()}
            placed = client.post(ROUTE, json=route_body("s-otlp"), headers=headers)
            assert placed.status_code == 200, placed.text
            refresh = client.post(ROUTE, json=route_body("s-otlp"))
            assert refresh.json()["data"]["placement"] == "refresh"
            assert server.stop(25.0) == 0  # the stop flushes what is queued
            log = server.log()
        spans = receiver.spans()
        assert spans, f"nothing received; log:\n{log}"
        resources = {tuple(sorted(r.items())) for r, _ in spans}
        assert len(resources) == 1
        [resource] = [dict(r) for r in resources]
        assert resource["service.name"] == "agent-runtime"
        assert resource["service.instance.id"] == server.instance_id
        routes = [s for _, s in spans if s.name == "POST /api/session/route"]
        assert len(routes) == 2
        continued = [s for s in routes if s.trace_id.hex() == CALLER_TRACE]
        assert len(continued) == 1 and continued[0].parent_span_id.hex() == CALLER_SPAN
        names = {s.name for _, s in spans if s.trace_id.hex() == CALLER_TRACE}
        assert {"resolve", "acquire", "deploy"} <= names, names
        assert "tracing on" in log
    finally:
        receiver.shutdown()
        receiver.server_close()
