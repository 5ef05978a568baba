"""The little AgentServer each simulated pod runs: ``GET /health`` and an SSE stream.

It is a real HTTP server (aiohttp) inside the simulator's process, serving on listening
sockets the kubelet bound on the pod's own loopback IP at each of the pod's container ports
(``reserve_ports``) when it gave the pod that IP: held from then on, the address cannot be
taken by another program between the IP's allocation and the server's start (which listens).

The SSE path is not part of a Pod (the template's ``sse_path`` lives in the URL the control
plane builds), so every path other than ``/health`` streams: one ``hello`` event naming the
pod at once, then a ``ping`` event every ``sse_interval`` seconds until the client leaves or
the pod stops (a last ``bye`` event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"
SHUTDOWN_TIMEOUT = 2.0

# returns None (healthy) or the failure mode: "500" or "hang"
HealthCheck = Callable[[], str | None]


class AgentServer:
    def __init__(
        self,
        *,
        namespace: str,
        name: str,
        sockets: list[socket.socket],
        health: HealthCheck,
        sse_interval: float = 1.0,
    ) -> None:
        """``sockets``: bound, from ``reserve_ports``; the server owns them from here on (its
        stop closes them, started or not)."""
        self.namespace = namespace
        self.name = name
        self.ip = str(sockets[0].getsockname()[0])
        self.ports = [int(sock.getsockname()[1]) for sock in sockets]
        self._sockets = sockets
        self._health = health
        self._sse_interval = sse_interval
        self._stopping = asyncio.Event()
        self._turn = asyncio.Lock()  # start() and stop() one at a time
        self._runner: web.AppRunner | None = None

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        """Serve on every socket (a start after a stop serves nothing)."""
        app = web.Application()
        app.router.add_get(HEALTH_PATH, self._handle_health)
        app.router.add_get("/{tail:.*}", self._handle_sse)
        # start and stop take turns: a stop() that came while a port was being bound used to
        # clean the runner up under the bind, and the listener bound a moment later was left
        # open for good (aiohttp registers the site before it binds). A stop now waits for the
        # binds (milliseconds); a start after a stop binds nothing.
        async with self._turn:
            if self._stopping.is_set():
                return
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT)
            await runner.setup()
            try:
                for sock in self._sockets:
                    await web.SockSite(runner, sock).start()
            except BaseException:
                await runner.cleanup()
                self._close_sockets()
                raise
            self._runner = runner

    async def stop(self) -> None:
        """Close the listeners; open /health hangs and SSE streams end at once."""
        self._stopping.set()
        async with self._turn:
            if self._runner is not None:
                await self._runner.cleanup()  # interrupted: the next stop() finishes it
                self._runner = None
            self._close_sockets()  # never started, or left open by a cleanup cut short

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close()  # closing twice is a no-op

    def _identity(self) -> dict[str, Any]:
        return {"pod": self.name, "namespace": self.namespace, "ip": self.ip}

    async def _handle_health(self, request: web.Request) -> web.StreamResponse:
        mode = self._health()
        if mode == "hang":  # answers only when the pod goes away
            await self._stopping.wait()
            return web.json_response({"status": "stopping"}, status=503)
        if mode is not None:
            return web.json_response({"status": "error", **self._identity()}, status=500)
        return web.json_response({"status": "ok", **self._identity()})

    async def _handle_sse(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        seq = 0
        try:
            await _event(response, "hello", {**self._identity(), "path": request.path}, seq)
            while not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self._sse_interval)
                seq += 1
                if self._stopping.is_set():
                    await _event(response, "bye", self._identity(), seq)
                    break
                await _event(response, "ping", {"seq": seq}, seq)
        except (ConnectionError, RuntimeError):  # the client went away
            return response
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response


async def _event(response: web.StreamResponse, event: str, data: dict[str, Any], seq: int) -> None:
    await response.write(f"id: {seq}\nevent: {event}\ndata: {json.dumps(data)}\n\n".encode())


def reserve_ports(ip: str, ports: list[int]) -> list[socket.socket] | None:
    """Sockets bound on ``ip`` at each port, not yet listening, or ``None`` (nothing left open)
    when one is taken. Bound without SO_REUSEADDR, so the reservation is exclusive: a second
    simulator's bind there fails, as does ours beside a listener of another program (on this
    address or on 0.0.0.0). Not listening, the address refuses connections until the server
    starts, as a pod's does before its container runs. Non-blocking syscalls on loopback."""
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((ip, port))
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        return None
    return sockets
