"""The protocol's early answer (``http_server.EarlyAnswer``), over real sockets: uvicorn runs
in this process with ``EdgeProtocol`` and a small ASGI app, and an ``early`` door the test
turns on and off. What it must keep: keep-alive (the connection serves the next request), the
order of answers on a pipelined connection, ``Connection: close`` and HTTP/1.0, a body that is
dropped as it comes (never buffered), clients that wait for ``100 Continue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from agent_runtime.admission import Admission, EdgeShed
from agent_runtime.http_server import EdgeLimits, protocol_class

SHED = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nshed"


@dataclass
class Door:
    """An ``EarlyAnswer`` the test drives: answers while ``on``; records what it was asked."""

    on: bool = False
    asked: list[tuple[bytes, bool]] = field(default_factory=list)

    def answer_now(self, url: bytes, *, keep_alive: bool) -> bytes | None:
        self.asked.append((url, keep_alive))
        if not self.on:
            return None
        return SHED if keep_alive else SHED.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")


@dataclass
class App:
    """Answers 200 with the body it read; ``/slow`` waits for ``release`` first."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[str] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.seen.append(scope["path"])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow":
            await asyncio.wait_for(self.release.wait(), 20)
        answer = json.dumps({"path": scope["path"], "body": len(body)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def serving(app: App, door: Door) -> AsyncIterator[int]:
    limits = EdgeLimits(
        max_header_bytes=16384,
        max_header_line_bytes=8192,
        max_headers=100,
        header_timeout=5,
        body_timeout=5,
        max_connections=64,
    )
    port = _free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=protocol_class(limits, early=door),
        ws="none",
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        assert server.started
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    while head.startswith(b"HTTP/1.1 100 "):  # an interim answer: the final one follows
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(lines[0].split()[1]), headers, body


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def post(path: str, body: bytes = b"{}", extra: str = "", version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


async def test_an_early_answer_keeps_the_connection_alive_and_drops_the_body() -> None:
    app, door = App(), Door(on=True)
    async with serving(app, door) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        big = b"x" * 300_000  # dropped as it comes: never a buffer of it
        writer.write(post("/api/a?q=1", big))
        status, _, body = await read_answer(reader)
        assert (status, body) == (503, b"shed")
        door.on = False  # the same connection: the next request reaches the app whole
        writer.write(post("/api/b", b"12345"))
        status, _, body = await read_answer(reader)
        assert status == 200 and json.loads(body) == {"path": "/api/b", "body": 5}
        assert app.seen == ["/api/b"]  # the shed request never became an app call
        assert door.asked == [(b"/api/a?q=1", True), (b"/api/b", True)]
        await close(writer)


async def test_connection_close_and_http_1_0_get_their_early_answer_and_the_close() -> None:
    app, door = App(), Door(on=True)
    async with serving(app, door) as port:
        for request in (post("/x", extra="Connection: close\r\n"), post("/x", version="1.0")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            status, headers, _ = await read_answer(reader)
            assert status == 503 and headers["connection"] == "close"
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
            await close(writer)
        assert door.asked == [(b"/x", False), (b"/x", False)]
        assert app.seen == []


async def test_a_pipelined_request_is_never_answered_before_the_one_in_front_of_it() -> None:
    app, door = App(), Door(on=True)
    async with serving(app, door) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        door.on = False
        writer.write(post("/slow"))
        for _ in range(100):
            if app.seen:
                break
            await asyncio.sleep(0.02)
        door.on = True  # it would shed the next one, but the first has no answer yet
        writer.write(post("/after"))
        await asyncio.sleep(0.2)
        app.release.set()
        first = await read_answer(reader)
        second = await read_answer(reader)
        assert json.loads(first[2])["path"] == "/slow"
        assert second[0] == 200 and json.loads(second[2])["path"] == "/after"  # went the app's way
        # once the line is clear, the door is asked again
        writer.write(post("/third"))
        assert (await read_answer(reader))[0] == 503
        await close(writer)


async def test_a_client_waiting_for_100_continue_is_never_answered_early() -> None:
    app, door = App(), Door(on=True)
    async with serving(app, door) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/x", b"", extra="Expect: 100-continue\r\n"))
        status, _, _ = await read_answer(reader)
        assert status == 200 and app.seen == ["/x"] and door.asked == []
        await close(writer)


# --- the real door: admission's EdgeShed -------------------------------------------------------


def _door(adm: Admission) -> tuple[EdgeShed, list[str]]:
    counted: list[str] = []
    door = EdgeShed(
        adm,
        prefix="/api/session/",
        reserve_paths=frozenset({"/api/session/touch"}),
        on_shed=counted.append,
    )
    return door, counted


async def test_edge_shed_answers_only_what_the_middleware_would_shed() -> None:
    adm = Admission(2, queue=6, burst_wait=0.05)
    door, counted = _door(adm)
    route = b"/api/session/route"
    assert door.answer_now(route, keep_alive=True) is None  # places free
    held = [await adm.enter(reserve=False) for _ in range(2)]
    assert all(held)
    # every place taken, but no overload yet (a burst): the newcomer waits, not shed early
    assert door.answer_now(route, keep_alive=True) is None
    waiters = [asyncio.create_task(adm.enter(reserve=False)) for _ in range(6)]
    await asyncio.sleep(0)
    assert adm.waiting == 6
    answer = door.answer_now(route + b"?x=1", keep_alive=False)  # the stack is full: shed
    assert answer is not None and b"503" in answer and b"OVERLOADED" in answer
    assert b"connection: close" in answer and b"retry-after: 1" in answer
    assert counted == ["/api/session/route"]
    # a touch is never shed at the door; another prefix is none of its business
    assert door.answer_now(b"/api/session/touch", keep_alive=True) is None
    assert door.answer_now(b"/healthz", keep_alive=True) is None
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    for ticket in held:
        assert ticket is not None
        adm.leave(ticket)
    assert adm.active == 0 and adm.waiting == 0


@pytest.mark.parametrize("depth", [1, 4])
async def test_under_overload_the_door_sheds_once_enough_waiters_stand_ready(depth: int) -> None:
    from agent_runtime.admission import EARLY_SHED_DEPTH

    adm = Admission(1, queue=100, burst_wait=0.05)
    door, _ = _door(adm)
    holder = await adm.enter(reserve=False)
    assert holder is not None
    first = asyncio.create_task(adm.enter(reserve=False))
    await asyncio.sleep(0.1)  # the backlog has stood past burst_wait: overload
    assert first.done() and first.result() is None  # shed by its own (burst) wait
    # shedding emptied the stack but no place went spare: still overload
    standing = [asyncio.create_task(adm.enter(reserve=False)) for _ in range(depth)]
    await asyncio.sleep(0)
    shed = door.answer_now(b"/api/session/route", keep_alive=True)
    assert (shed is not None) == (depth >= EARLY_SHED_DEPTH)
    await asyncio.gather(*standing)
    adm.leave(holder)
    assert adm.active == 0 and adm.waiting == 0
