"""Traces (OpenTelemetry): on when the standard ``OTEL_*`` environment names an OTLP endpoint,
off and free otherwise.

``Tracing`` is what every floor holds (the wiring hands it down, like ``Metrics``). Off (the
base class) every method is a no-op that makes no OpenTelemetry call: ``span()`` gives one
shared do-nothing object, and the app installs no server-span middleware, so the refresh hot
path runs exactly as without tracing. On (``OtelTracing``) it owns a ``TracerProvider`` of
its own (never the process-global one: two apps in one process keep their spans apart), a
``BatchSpanProcessor`` with the OTLP/HTTP exporter (the SDK's bounded queue: spans beyond
it are dropped, never buffered without bound; exported from the SDK's thread, never the
event loop), and ``ServerSpans``, the pure ASGI middleware that opens a request's SERVER
span, continuing the caller's W3C ``traceparent``.

The request's scope, session and placement reach the server span through ``annotate``
(a per-request slot in a context variable the middleware sets); its error code is read from
the answer's ``X-Error-Code`` header. While a span is current, every log line carries its
``trace_id`` and ``span_id`` (``logs.bound``).

Hazard: ``provider.shutdown`` blocks (it joins the export thread, which may be in an HTTP
call); it runs on a daemon thread of its own, awaited within the stop bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Span as OtelSpan
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime import logs

if TYPE_CHECKING:  # the SDK (and its exporter: ~0.1 s of imports) only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

AttributeValue = str | int | float | bool
Kind = Literal["internal", "client"]
SERVICE_NAME = "agent-runtime"  # service.name unless OTEL_SERVICE_NAME or the resource says
# what the request annotates on its server span (attribute names, agent_runtime.*)
SCOPE_ID = "agent_runtime.scope_id"
SESSION_ID = "agent_runtime.session_id"
PLACEMENT = "agent_runtime.placement"
ERROR_CODE = "agent_runtime.error_code"
_ERROR_CODE_HEADER = b"x-error-code"  # answers.ERROR_CODE_HEADER, as ASGI gives header names
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
MAX_PATH_ATTRIBUTE = 256  # characters of an unknown path kept in url.path
_TRUE = frozenset({"true", "1", "yes", "on"})
_KINDS: dict[Kind, SpanKind] = {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT}


class Span(Protocol):
    """What a caller may do with the span it opened."""

    def set_attribute(self, key: str, value: AttributeValue) -> None: ...


class OpenSpan(Span, Protocol):
    """A span that is not current (``open_span``): its owner ends it, once."""

    def end(self) -> None: ...


class _NoSpan:
    """The one span of tracing off: a context manager and a span that do nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        return None

    def end(self) -> None:
        return None


NO_SPAN = _NoSpan()


class Tracing:
    """Tracing off: nothing is recorded, and nothing of OpenTelemetry is called."""

    enabled = False

    def span(
        self, name: str, *, kind: Kind = "internal", attributes: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Span]:
        """A child span of the current one for the ``with`` block, current inside it."""
        return NO_SPAN

    def open_span(
        self, name: str, *, kind: Kind = "internal", attributes: Mapping[str, Any] | None = None
    ) -> OpenSpan:
        """A span under the current one that is never made current (a wait that spans several
        calls, a stream read by another task): its owner calls ``end()`` once."""
        return NO_SPAN

    def annotate(
        self,
        *,
        scope_id: str | None = None,
        session_id: str | None = None,
        placement: str | None = None,
    ) -> None:
        """Attributes of the current request's server span (none outside a request)."""
        return None

    def middleware(
        self, app: ASGIApp, known_paths: frozenset[str], untraced: frozenset[str] = frozenset()
    ) -> ASGIApp:
        """The app as served: off, the app itself (no middleware at all). On: ``ServerSpans``
        (``untraced``: paths that get no span, e.g. probes and scrapes)."""
        return app

    async def shutdown(self, within: float) -> None:
        """Export what is queued and stop, within ``within`` seconds."""
        return None


class OtelTracing(Tracing):
    """Tracing on: spans go to ``exporter`` through a ``BatchSpanProcessor`` (tests may pass
    ``batch=False`` to export each span as it ends, e.g. into the SDK's in-memory exporter)."""

    enabled = True

    def __init__(
        self,
        *,
        exporter: SpanExporter,
        instance_id: str,
        batch: bool = True,
    ) -> None:
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # ours are defaults: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
        defaults = Resource({"service.name": SERVICE_NAME, "service.instance.id": instance_id})
        detected = OTELResourceDetector().detect()
        resource = Resource.create(dict(defaults.merge(detected).attributes))
        # sampler=None: the SDK reads OTEL_TRACES_SAMPLER / _ARG itself (parentbased_always_on
        # by default: a caller's sampled flag is followed)
        self.provider: TracerProvider = TracerProvider(resource=resource)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer: Tracer = self.provider.get_tracer("agent_runtime")
        self.propagator = TraceContextTextMapPropagator()
        # the request's server span, for annotate (per Tracing: two apps never share one)
        self.request_span: ContextVar[OtelSpan | None] = ContextVar(
            f"agent_runtime_request_span_{id(self)}", default=None
        )

    @contextmanager
    def _current(
        self,
        name: str,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        *,
        context: Context | None = None,
    ) -> Iterator[OtelSpan]:
        """The span, current and in the log fields for the block; an exception marks it
        (``failed``). ``context``: the parent (a caller's, from ``traceparent``)."""
        # not the SDK's exception handling: it puts the exception's text on the span
        starting = self.tracer.start_as_current_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        with starting as span, logs.bound(**ids_of(span)):
            try:
                yield span
            except Exception as exc:
                failed(span, exc)
                raise

    def span(
        self, name: str, *, kind: Kind = "internal", attributes: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Span]:
        return self._current(name, _KINDS[kind], attributes)

    def open_span(
        self, name: str, *, kind: Kind = "internal", attributes: Mapping[str, Any] | None = None
    ) -> OpenSpan:
        return self.tracer.start_span(name, kind=_KINDS[kind], attributes=attributes)

    def annotate(
        self,
        *,
        scope_id: str | None = None,
        session_id: str | None = None,
        placement: str | None = None,
    ) -> None:
        span = self.request_span.get()
        if span is None:
            return
        if scope_id is not None:
            span.set_attribute(SCOPE_ID, scope_id)
        if session_id is not None:
            span.set_attribute(SESSION_ID, session_id)
        if placement is not None:
            span.set_attribute(PLACEMENT, placement)

    def middleware(
        self, app: ASGIApp, known_paths: frozenset[str], untraced: frozenset[str] = frozenset()
    ) -> ASGIApp:
        return ServerSpans(app, tracing=self, known_paths=known_paths, untraced=untraced)

    async def shutdown(self, within: float) -> None:
        """Flush and stop on a daemon thread (the export may sit in an HTTP call); waited for
        at most ``within`` seconds — beyond it the spans still queued are lost, the stop is
        not held up."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        timeout_ms = max(int(within * 1000), 1)

        def stop() -> None:
            try:
                self.provider.force_flush(timeout_ms)
                self.provider.shutdown()
            except Exception:
                log.warning("tracing: shutdown failed", exc_info=True)
            finally:
                # the stop may have stopped waiting, and its loop be closed by now
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=stop, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done.wait(), within)
        except TimeoutError:
            log.warning("tracing: spans not exported within %.1f s of the stop: dropped", within)


def failed(span: OtelSpan, exc: Exception) -> None:
    """Status ERROR and ``error.type``, named by the exception's class alone: its text may
    echo what the logs redact (a manifest's env values in an API server's refusal), and a
    span leaves the process unredacted, so it never carries the text."""
    kind = type(exc).__name__
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, kind))


def ids_of(span: OtelSpan) -> dict[str, str]:
    """``trace_id`` and ``span_id`` as W3C hex, for the log lines written under ``span``."""
    context = span.get_span_context()
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


class ServerSpans:
    """Pure ASGI, installed only when tracing is on: one SERVER span per HTTP request, under
    the caller's ``traceparent`` when it sent one (W3C Trace Context; an invalid one starts a
    new trace). Named ``METHOD /path`` for the app's known paths, ``METHOD`` alone otherwise
    (bounded names). Attributes: ``http.request.method``, ``url.path``,
    ``http.response.status_code``; ``agent_runtime.error_code`` and status ERROR on a failure
    answer; what the handlers ``annotate``. Paths in ``untraced`` (the probes' /healthz, the
    scrapes' /metrics: a trace every few seconds that nobody reads) pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracing: OtelTracing,
        known_paths: frozenset[str],
        untraced: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.tracing = tracing
        self.known_paths = known_paths
        self.untraced = untraced

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.untraced:
            await self.app(scope, receive, send)
            return
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in _TRACE_HEADERS
        }
        parent = self.tracing.propagator.extract(carrier) if carrier else None
        method, path = scope["method"], scope["path"]
        name = f"{method} {path}" if path in self.known_paths else method
        attributes: dict[str, AttributeValue] = {
            "http.request.method": method,
            "url.path": path[
                :MAX_PATH_ATTRIBUTE
            ],  # the caller's: bounded here, not only by the edge
        }
        if path in self.known_paths:
            attributes["http.route"] = path
        # an exception past the guard (the server's own 500) marks it, as any span's
        with self.tracing._current(name, SpanKind.SERVER, attributes, context=parent) as span:
            slot = self.tracing.request_span.set(span)

            async def record(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    for header, value in message.get("headers", ()):
                        if header.lower() == _ERROR_CODE_HEADER:  # answers.failure: a fixed set
                            code = value.decode("latin-1")
                            span.set_attribute(ERROR_CODE, code)
                            span.set_attribute("error.type", code)
                            span.set_status(Status(StatusCode.ERROR, code))
                await send(message)

            try:
                await self.app(scope, receive, record)
            finally:
                self.tracing.request_span.reset(slot)


def from_environment(environ: Mapping[str, str], *, instance_id: str) -> Tracing:
    """Tracing as the standard variables say: on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, unless ``OTEL_SDK_DISABLED`` is true or
    ``OTEL_TRACES_EXPORTER`` is ``none``. The exporter is OTLP/HTTP (protobuf) to the endpoint
    read here; the SDK reads the rest (headers, timeout, compression, the sampler, the
    resource, the batch queue: ``OTEL_*``) from the process environment itself.
    Raises ValueError for a protocol other than http/protobuf (gRPC is not built in)."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return Tracing()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return Tracing()
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return Tracing()
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol.strip().lower() != "http/protobuf":
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: only http/protobuf is built in "
            "(point it at the collector's OTLP/HTTP port, usually 4318)"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if not environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):  # the base URL: the SDK's path
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    exporter = OTLPSpanExporter(endpoint=endpoint)
    tracing = OtelTracing(exporter=exporter, instance_id=instance_id)
    log.info("tracing on: spans go to %s (OTLP/HTTP)", logs.redact(endpoint))
    return tracing
