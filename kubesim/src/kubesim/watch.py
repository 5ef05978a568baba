"""Watches, as the API server's watch cache serves them: a bounded event history and the open
streams.

Every write of the store (``store.py``) publishes one event here — ``ADDED``, ``MODIFIED`` or
``DELETED`` with the object as it is after the write, carrying the write's ``resourceVersion``
(one counter for the whole store, as etcd's revision). The newest ``history`` events are kept;
a watch that starts from a ``resourceVersion`` replays the kept events after it, a watch from a
version older than the oldest kept one gets the API server's answer to a compacted revision: an
in-stream ``ERROR`` event carrying a ``Status`` 410 ``Expired`` ("too old resource version"),
then the end of the stream. A watch without a version (or ``"0"``) first gets a synthetic
``ADDED`` per matching object, then the live events.

Each open stream is a :class:`Watcher`. Publishing is synchronous (the store's writes run on the
event loop), so an event reaches every watcher in resourceVersion order and a new watcher's
backlog and its live events meet without a gap. Everything is bounded: at most ``max_watches``
streams at once (one more is 429), at most ``queue`` events waiting per stream (a consumer that
falls that far behind has its stream closed, as the API server closes an unresponsive watcher),
``timeoutSeconds`` (and a server maximum) ends each stream, and ``close_all`` ends them all (the
control endpoint's drop, the simulator's stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kubesim.errors import bad_request
from kubesim.labels import FieldRequirement, Selector, fields_match

Obj = dict[str, Any]

DEFAULT_HISTORY = 1000  # events kept for resuming watches
DEFAULT_MAX_WATCHES = 256  # streams open at once
DEFAULT_QUEUE = 1000  # events waiting per stream before it is closed
DEFAULT_TIMEOUT = 1800.0  # seconds: the API server's --min-request-timeout
DEFAULT_BOOKMARK_INTERVAL = 60.0  # seconds between BOOKMARK events (when asked for)

DROP_MODES = ("close", "reset")


class Expired(Exception):
    """The version asked for is older than the history: the watch answers 410 in-stream."""

    def __init__(self, asked: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {asked} ({oldest})")
        self.asked = asked
        self.oldest = oldest

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": str(self),
            "reason": "Expired",
            "code": 410,
        }


class TooManyWatches(Exception):
    """``max_watches`` streams are open already."""


@dataclass(slots=True)
class Event:
    resource_version: int
    resource: str  # "pods", "nodes"
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # the hub's own copy: never changed after publishing
    _line: bytes | None = None

    @property
    def namespace(self) -> str | None:
        namespace: str | None = self.obj["metadata"].get("namespace")
        return namespace

    def line(self) -> bytes:
        """The event as the stream carries it: one JSON object and a newline (serialised once,
        whatever the number of streams)."""
        if self._line is None:
            self._line = json.dumps({"type": self.type, "object": self.obj}).encode() + b"\n"
        return self._line


@dataclass(frozen=True, slots=True)
class Filter:
    """What one watch sees: a resource, optionally one namespace, label and field selectors."""

    resource: str
    namespace: str | None = None
    selector: Selector | None = None
    fields: list[FieldRequirement] = field(default_factory=list)

    def matches(self, event: Event) -> bool:
        return event.resource == self.resource and self.matches_object(event.obj)

    def matches_object(self, obj: Obj) -> bool:
        meta = obj["metadata"]
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if self.selector is not None and not self.selector.matches(meta.get("labels")):
            return False
        return not self.fields or fields_match(self.fields, obj)


class Watcher:
    """One open stream: the events waiting for it and why it ended."""

    def __init__(self, hub: WatchHub, what: Filter, queue: int) -> None:
        self.hub = hub
        self.filter = what
        self._limit = queue
        self._pending: deque[Event] = deque()
        self._wake = asyncio.Event()
        self.closed: str | None = None  # dropped, reset, overflow, stopped, timeout, gone
        self.seen = 0  # resourceVersion up to which this stream has taken every event
        self.abort: Callable[[], None] | None = None  # set while a write may block

    def offer(self, event: Event) -> None:
        if self.closed is not None or not self.filter.matches(event):
            return
        if len(self._pending) >= self._limit:
            self._pending.clear()  # a consumer this far behind is cut off, not buffered
            self.close("overflow")
            return
        self._pending.append(event)
        self._wake.set()

    def take(self) -> list[Event]:
        """Every event waiting, in order; afterwards the stream has seen the whole store."""
        events = list(self._pending)
        self._pending.clear()
        self._wake.clear()
        self.seen = self.hub.resource_version()
        return events

    async def wait(self, seconds: float) -> None:
        """Until an event arrives, the stream is closed, or ``seconds`` pass."""
        if self._pending or self.closed is not None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def close(self, reason: str) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        self.hub.discard(self)
        self._wake.set()
        if reason in ("reset", "overflow") and self.abort is not None:
            self.abort()  # a write blocked on a consumer that reads nothing ends now


class WatchHub:
    """The event history and the open watchers of one simulator."""

    def __init__(
        self,
        resource_version: Callable[[], int],
        *,
        history: int = DEFAULT_HISTORY,
        max_watches: int = DEFAULT_MAX_WATCHES,
        queue: int = DEFAULT_QUEUE,
    ) -> None:
        for value, what in ((history, "watch_history"), (max_watches, "max_watches")):
            if value < 1:
                raise ValueError(f"{what} must be >= 1")
        if queue < 1:
            raise ValueError("watch_queue must be >= 1")
        self.resource_version = resource_version
        self.max_watches = max_watches
        self.queue = queue
        self._history: deque[Event] = deque(maxlen=history)
        self._oldest = 0  # a watch from a version below this one has lost events: 410
        self._watchers: set[Watcher] = set()
        self.counts: dict[str, int] = {"opened": 0, "expired": 0, "refused": 0}
        self.closed: dict[str, int] = {}

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def publish(self, resource: str, type_: str, obj: Obj) -> None:
        """``obj`` is the hub's to keep (the store hands a copy)."""
        event = Event(int(obj["metadata"]["resourceVersion"]), resource, type_, obj)
        if len(self._history) == self._history.maxlen:
            self._oldest = self._history[0].resource_version
        self._history.append(event)
        for watcher in list(self._watchers):
            watcher.offer(event)

    def open(
        self, what: Filter, since: int | None, current: list[Obj]
    ) -> tuple[Watcher, list[Event]]:
        """A new watcher and its backlog: ``current`` as ADDED when ``since`` is None, else the
        kept events after ``since``. Raises :class:`TooManyWatches` or :class:`Expired`."""
        if len(self._watchers) >= self.max_watches:
            self.counts["refused"] += 1
            raise TooManyWatches()
        if since is not None and since < self._oldest:
            self.counts["expired"] += 1
            raise Expired(since, self._oldest)
        if since is None:
            rv = self.resource_version()
            backlog = [Event(rv, what.resource, "ADDED", obj) for obj in current]
        else:
            backlog = [e for e in self._history if e.resource_version > since and what.matches(e)]
        watcher = Watcher(self, what, self.queue)
        watcher.seen = self.resource_version()
        self._watchers.add(watcher)
        self.counts["opened"] += 1
        return watcher, backlog

    def discard(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.discard(watcher)
        if watcher.closed is not None:
            self.closed[watcher.closed] = self.closed.get(watcher.closed, 0) + 1

    def close_all(self, reason: str = "dropped") -> int:
        """End every open stream (``reset``: the connection is cut, not ended)."""
        watchers = list(self._watchers)
        for watcher in watchers:
            watcher.close(reason)
        return len(watchers)

    def compact(self) -> int:
        """Forget the history, as etcd compacting: any watch resumed from a version older than
        now gets 410. Returns the oldest version a watch can still start from."""
        self._history.clear()
        self._oldest = self.resource_version()
        return self._oldest

    def describe(self) -> dict[str, Any]:
        return {
            "open": len(self._watchers),
            "max_watches": self.max_watches,
            "queue": self.queue,
            "history": len(self._history),
            "history_max": self._history.maxlen,
            "oldest_resource_version": str(self._oldest),
            "counts": dict(self.counts),
            "closed": dict(self.closed),
        }


# --- the request's parameters -------------------------------------------------------------------


def is_flag(raw: str | None) -> bool:
    return raw in ("1", "true", "True")


def resource_version_param(raw: str | None) -> int | None:
    """A watch's ``resourceVersion``: absent or "0" is "from now, with the current state"."""
    if not raw or raw == "0":
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f'invalid resource version: "{raw}"') from None


def timeout_seconds(raw: str | None, server_max: float, rng: random.Random) -> float:
    """``timeoutSeconds`` as asked (never beyond twice the server's maximum); absent or 0, a
    random share of ``[max, 2 × max)`` as the API server spreads its watch timeouts."""
    if raw:
        try:
            asked = int(raw)
        except ValueError:
            raise bad_request(f'invalid value for timeoutSeconds: "{raw}"') from None
        if asked > 0:
            return min(float(asked), 2 * server_max)
    return server_max * (1 + rng.random())


# --- the HTTP stream ------------------------------------------------------------------------------


def bookmark(kind: str, resource_version: int) -> bytes:
    """A BOOKMARK: an object of the watched kind carrying only the version seen so far."""
    obj = {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": str(resource_version)}}
    return json.dumps({"type": "BOOKMARK", "object": obj}).encode() + b"\n"


def error_line(status: Obj) -> bytes:
    return json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"


async def stream(
    request: web.Request,
    *,
    kind: str,
    opened: tuple[Watcher, list[Event]] | Expired,
    seconds: float,
    bookmarks: float | None,
    visible: Callable[[Event], bool],
    stopping: asyncio.Event,
) -> web.StreamResponse:
    """Answer a watch: 200, chunked, one JSON event per line, until ``seconds`` pass,
    the watcher is closed or the client goes. ``bookmarks``: seconds between BOOKMARKs (None:
    not asked for). ``visible``: whether an event may be shown now (a namespace hidden by a
    fault is not)."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    if isinstance(opened, Expired):
        await response.write(error_line(opened.status()))
        await response.write_eof()
        return response
    watcher, backlog = opened
    transport = request.transport

    def abort() -> None:
        if transport is not None:
            transport.abort()

    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    next_bookmark = loop.time() + bookmarks if bookmarks is not None else None
    ended = "timeout"
    try:
        watcher.abort = abort
        await _write(response, [e.line() for e in backlog if visible(e)])
        while watcher.closed is None and not stopping.is_set():
            now = loop.time()
            if now >= deadline:
                break
            until = deadline if next_bookmark is None else min(deadline, next_bookmark)
            await watcher.wait(until - now)
            lines = [e.line() for e in watcher.take() if visible(e)]
            if next_bookmark is not None and loop.time() >= next_bookmark:
                lines.append(bookmark(kind, watcher.seen))
                next_bookmark = loop.time() + (bookmarks or 0.0)
            if lines and watcher.closed is None:
                await _write(response, lines)
        if stopping.is_set():
            ended = "stopped"
    except (ConnectionError, RuntimeError):
        ended = "gone"  # the client left (or the connection was cut on purpose)
    except asyncio.CancelledError:
        ended = "gone"  # the client closed the connection: aiohttp cancels its handler
        raise
    finally:
        watcher.abort = None
        watcher.close(watcher.closed or ended)
    if watcher.closed in ("reset", "overflow", "gone"):
        return response  # the transport is cut already: nothing more to send
    with contextlib.suppress(ConnectionError, RuntimeError):
        await response.write_eof()
    return response


async def _write(response: web.StreamResponse, lines: list[bytes]) -> None:
    if lines:
        await response.write(b"".join(lines))
