"""The HTTP edge at the connection level: uvicorn's httptools protocol with the bounds it lacks.

uvicorn's ``HttpToolsProtocol`` buffers a request head without limit (httptools concatenates a
header value chunk by chunk: four connections streaming 100 MiB values took the process from
235 to 746 MB and starved the loop), arms no timer on a connection until its first response is
sent (an idle socket, a head or a body dripped byte by byte stays open for ever) and accepts
every connection until the process runs out of file descriptors (then /healthz fails too).
``EdgeProtocol`` adds, per connection:

- the head (request line + header lines) is fed to the parser in slices that never take it
  past ``http_max_header_bytes``; a head not complete at the bound gets 431 and the connection is
  closed, before the parser has buffered more. A line over ``http_max_header_line_bytes`` or
  more than ``http_max_headers`` headers: the same 431;
- a head must be complete within ``http_header_timeout`` of the connection's start (first
  request) or of its first byte (later requests of a keep-alive connection); a body within
  ``http_body_timeout`` of its head (a deadline for the whole body, so a byte now and then
  does not keep it open). Then 408 (nothing if not one byte of the head came) and close;
- between requests uvicorn's keep-alive timer (``http_keepalive_timeout``) closes an idle one;
- a connection over ``http_max_connections`` open ones is answered 503 and closed at once in
  ``connection_made``: it costs one accept and one write, never a parser or a timer, and the
  connections already open (a gateway's keep-alive pool) go on being served.

Hazard: the counting is per slice fed to the parser. A head that starts inside a slice is
charged the whole slice (it may be refused a few bytes under the bound, never admitted over it),
except a pipelined head that starts in the same read as the previous request's body: of that
read only what the parser handed over is counted (not its partial line), so its bound holds to
within one read; later reads count exactly. WebSocket upgrades are off (``ws="none"``): the
service has none, and an upgraded connection would leave these bounds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agent_runtime.api.answers import ERROR_CODE_HEADER
from agent_runtime.config import ConfigError, Settings
from agent_runtime.errors import (
    AgentRuntimeError,
    HeadersTooLarge,
    RequestTimeout,
    TooManyConnections,
)

log = logging.getLogger(__name__)

FD_RESERVE = 512  # descriptors kept for Redis (100) and DB pools, Kubernetes, files, the loop
MIN_CONNECTIONS = 64  # a clamp below this is a refusal: the replica could not serve a gateway
CAP_WARNING_EVERY = 10.0  # seconds between two "connection cap reached" warnings


class EarlyAnswer(Protocol):
    """Asked once a request's head is in, before the request becomes an ASGI task: the whole
    answer to write at once (admission's shed under overload: ``admission.EdgeShed``), or None."""

    def answer_now(self, url: bytes, *, keep_alive: bool) -> bytes | None: ...


@dataclass(frozen=True)
class EdgeLimits:
    max_header_bytes: int
    max_header_line_bytes: int
    max_headers: int
    header_timeout: float
    body_timeout: float
    max_connections: int

    @classmethod
    def of(cls, settings: Settings, *, max_connections: int | None = None) -> EdgeLimits:
        return cls(
            max_header_bytes=settings.http_max_header_bytes,
            max_header_line_bytes=settings.http_max_header_line_bytes,
            max_headers=settings.http_max_headers,
            header_timeout=settings.http_header_timeout,
            body_timeout=settings.http_body_timeout,
            max_connections=max_connections or settings.http_max_connections,
        )


@dataclass
class EdgeStats:
    """What the edge refused or closed, by reason (process-wide: one server per process)."""

    closed: Counter[str] = field(default_factory=Counter)
    _cap_warned_at: float = -CAP_WARNING_EVERY
    _cap_refused_since: int = 0

    def note(self, reason: str) -> None:
        self.closed[reason] += 1
        log.debug("http edge: connection closed: %s", reason)

    def over_cap(self, cap: int) -> None:
        self.closed["over_cap"] += 1
        self._cap_refused_since += 1
        now = time.monotonic()
        if now - self._cap_warned_at >= CAP_WARNING_EVERY:
            log.warning(
                "http edge: %d connections open (AGENT_RUNTIME_HTTP_MAX_CONNECTIONS): refused %d "
                "new connection(s) since the last warning",
                cap,
                self._cap_refused_since,
            )
            self._cap_warned_at, self._cap_refused_since = now, 0


def _answer(error: type[AgentRuntimeError], message: str) -> bytes:
    """A whole HTTP/1.1 response with the failure envelope (no request id: none was read)."""
    body: dict[str, Any] = {
        "ok": False,
        "request_id": None,
        "error_code": error.code.value,
        "error_message": message,
    }
    headers = [f"{ERROR_CODE_HEADER.lower()}: {error.code.value}"]
    if error.default_retry_after is not None:
        seconds = max(1, int(error.default_retry_after))
        body["retry_after"] = seconds
        headers.append(f"retry-after: {seconds}")
    payload = json.dumps(body, separators=(",", ":")).encode()
    phrase = {408: "Request Timeout", 431: "Request Header Fields Too Large"}.get(
        error.http_status, "Service Unavailable"
    )
    head = [
        f"HTTP/1.1 {error.http_status} {phrase}",
        "content-type: application/json",
        f"content-length: {len(payload)}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded heads, head and body deadlines and a cap on
    open connections. Made per server by ``protocol_class`` (the limits are class data)."""

    limits: ClassVar[EdgeLimits]
    stats: ClassVar[EdgeStats]
    early: ClassVar[EarlyAnswer | None] = None
    too_large: ClassVar[bytes]
    timed_out: ClassVar[bytes]
    over_cap: ClassVar[bytes]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._head_open = False  # a request's first byte came, its head is not complete
        self._in_body = False  # head complete, body not
        self._head_bytes = 0
        self._header_count = 0
        self._head_seen = 0  # bytes of the head the parser has handed over (line + headers)
        self._head_refusal: str | None = None
        self._early: bytes | None = None  # this request's answer, written at its body's end
        self._early_close = False

    # --- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.transport = transport
            transport.write(self.over_cap)
            transport.close()
            self.stats.over_cap(self.limits.max_connections)
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self.parser is None:
            return
        self._unset_keepalive_if_required()
        limit = self.limits.max_header_bytes
        while data:
            body_chunk = self._in_body
            if body_chunk:
                chunk, data = data, b""
            else:  # never a byte past the head's bound into the parser
                room = limit - self._head_bytes
                chunk, data = data[:room], data[room:]
            try:
                self.parser.feed_data(chunk)
            except httptools.HttpParserUpgrade:
                self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError:
                if self._head_refusal is None:
                    self.logger.warning("Invalid HTTP request received.")
                    self.send_400_response("Invalid HTTP request received.")
                    return
            if self._head_open and body_chunk:
                # a pipelined head begun after a body in this chunk: only what the parser
                # handed over is known (its partial line is not); later slices count exactly
                self._head_bytes = max(self._head_bytes, self._head_seen)
            elif self._head_open:
                self._head_bytes += len(chunk)  # a head begun inside the chunk pays all of it
                if self._head_bytes >= limit and self._head_refusal is None:  # not done at it
                    self._head_refusal = f"request head over {limit} bytes"
            if self._head_refusal is not None:
                self._close_with(self.too_large, "headers_too_large")
                return
            if self.transport.is_closing():
                return

    # --- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open, self._head_bytes, self._header_count, self._head_seen = True, 0, 0, 0
        if self._deadline is None:  # a keep-alive connection's next request
            self._arm(self.limits.header_timeout, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_seen += len(url)
        if len(self.url) > self.limits.max_header_line_bytes:
            self._head_refusal = f"request line over {self.limits.max_header_line_bytes} bytes"

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_seen += len(name) + len(value) + 4
        if self._header_count > self.limits.max_headers:
            self._head_refusal = f"more than {self.limits.max_headers} header lines"
        elif len(name) + len(value) + 4 > self.limits.max_header_line_bytes:
            self._head_refusal = f"a header line over {self.limits.max_header_line_bytes} bytes"
        if self._head_refusal is None:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._disarm()
        if self._head_refusal is not None:
            return  # never handed to the app; data_received answers 431
        self._in_body = True
        if self._answer_early():
            self._arm(self.limits.body_timeout, self._body_timed_out)
            return
        super().on_headers_complete()
        if not self.pipeline:  # queued behind a running request, its body is not read yet
            self._arm(self.limits.body_timeout, self._body_timed_out)

    def _answer_early(self) -> bool:
        """Take the early answer for this request, if there is one and it may go now: never
        behind a request still being answered (answers keep their order), never to a client
        waiting for ``100 Continue`` (it would not send the body we wait for)."""
        if self.early is None or self.expect_100_continue:
            return False
        if self.cycle is not None and not self.cycle.response_complete:
            return False
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        self._early = self.early.answer_now(self.url, keep_alive=keep_alive)
        self._early_close = not keep_alive
        return self._early is not None

    def on_body(self, body: bytes) -> None:
        if self._early is not None:
            return  # answered without reading it: dropped as it comes, never buffered
        if self.cycle is not None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        if self._early is not None:
            answer, self._early = self._early, None
            self.transport.write(answer)
            if self._early_close:
                self.transport.close()
                return
            self.on_response_complete()  # keep-alive timer, or the next pipelined request
            return
        if self.cycle is not None:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a pipelined request just started: its body's deadline runs from now
        if self._in_body and self._deadline is None and not self.transport.is_closing():
            self._arm(self.limits.body_timeout, self._body_timed_out)

    # --- deadlines
    def _arm(self, seconds: float, then: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        if self._head_open:
            self._close_with(self.timed_out, "header_timeout")
        else:  # not one byte of a request: nothing to answer
            self.stats.note("idle_timeout")
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._deadline = None
        cycle = self.cycle
        started = cycle is not None and cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's next receive() is http.disconnect
            cycle.message_event.set()
        self._close_with(None if started else self.timed_out, "body_timeout")

    def _close_with(self, answer: bytes | None, reason: str) -> None:
        self.stats.note(reason)
        self._disarm()
        if self.transport.is_closing():
            return
        if answer is not None:
            self.transport.write(answer)
        self.transport.close()


def protocol_class(
    limits: EdgeLimits, stats: EdgeStats | None = None, early: EarlyAnswer | None = None
) -> type[EdgeProtocol]:
    """An ``EdgeProtocol`` bound to these limits, for ``uvicorn.Config(http=...)``."""
    attrs = {
        "limits": limits,
        "stats": stats or EdgeStats(),
        "early": early,
        "too_large": _answer(
            HeadersTooLarge,
            f"request head over the bounds ({limits.max_header_bytes} bytes, "
            f"{limits.max_header_line_bytes} a line, {limits.max_headers} headers)",
        ),
        "timed_out": _answer(RequestTimeout, "request not received in time"),
        "over_cap": _answer(TooManyConnections, "too many open connections; retry"),
    }
    return type("BoundEdgeProtocol", (EdgeProtocol,), attrs)


def fit_descriptors(settings: Settings) -> tuple[int, str | None]:
    """The connection cap this process can hold, and a warning to log if it was lowered.

    Each connection is a file descriptor; past ``RLIMIT_NOFILE`` accept fails and /healthz with
    it. The soft limit is raised (up to the hard one) to the cap + ``FD_RESERVE``. If the hard
    limit is too low: an explicit ``AGENT_RUNTIME_HTTP_MAX_CONNECTIONS`` is refused (ConfigError,
    exit 2); the default is lowered to fit, with a warning."""
    cap = settings.http_max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    want = cap + FD_RESERVE
    note = None
    if hard != infinite and want > hard:
        fits = hard - FD_RESERVE
        if "http_max_connections" in settings.model_fields_set or fits < MIN_CONNECTIONS:
            raise ConfigError(
                f"AGENT_RUNTIME_HTTP_MAX_CONNECTIONS={cap} needs {want} file descriptors "
                f"(+{FD_RESERVE} for the backends) but the hard limit is {hard} (ulimit -Hn): "
                "lower the setting or raise the limit"
            )
        note = (
            f"http edge: AGENT_RUNTIME_HTTP_MAX_CONNECTIONS lowered from {cap} to {fits} "
            f"to fit the file descriptor limit {hard} (ulimit -Hn)"
        )
        cap, want = fits, hard
    if soft != infinite and want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return cap, note


def uvicorn_options(
    settings: Settings, max_connections: int, early: EarlyAnswer | None = None
) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments of the edge (serve and the bench server use these);
    ``early``: the app's admission door (``app.state.edge_shed``)."""
    return {
        "http": protocol_class(
            EdgeLimits.of(settings, max_connections=max_connections), early=early
        ),
        "ws": "none",
        "timeout_keep_alive": settings.http_keepalive_timeout,
    }
