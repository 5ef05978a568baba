"""Lua scripts: read once from a module's ``lua/`` folder, registered once per client.

``redis.register_script`` gives an ``AsyncScript`` that calls EVALSHA and reloads the script
on NOSCRIPT (e.g. after a Redis restart). Files starting with ``_`` are preludes: shared local
functions prepended to the scripts that name them.

One idea that more than one use needs is one script in the shared ground, ``lua_shared/``
next to this file (package ``SHARED``): each use registers it under its own name (``label``),
so its metrics and its callers keep speaking of that use (``waiter_gate``) while the source,
and so the SHA, is one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import AskError, MovedError, NoScriptError, SlotNotCoveredError, TryAgainError

# script name → an observer of each call: (seconds, ok) — metrics.Metrics.redis_call
ScriptObserver = Callable[[str], Callable[[float, bool], None]]
# the package whose scripts are the shared ground: src/agent_runtime/lua_shared/*.lua
SHARED = "agent_runtime"


@cache
def source(package: str, name: str, *, prelude: str | tuple[str, ...] | None = None) -> str:
    """The script's text, its preludes first: ``{package}/lua/{name}.lua``, or for ``SHARED``
    ``agent_runtime/lua_shared/{name}.lua`` (its preludes from the same folder)."""
    folder = resources.files(package).joinpath("lua_shared" if package == SHARED else "lua")
    text = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    preludes = (prelude,) if isinstance(prelude, str) else prelude or ()
    for part in reversed(preludes):  # in the order given, each before the script
        text = folder.joinpath(f"{part}.lua").read_text(encoding="utf-8") + "\n" + text
    return text


def register(
    redis: Redis,
    package: str,
    name: str,
    *,
    prelude: str | tuple[str, ...] | None = None,
    observe: ScriptObserver | None = None,
    label: str | None = None,
) -> Any:
    """The script as an awaitable ``(keys=, args=)`` call; timed when ``observe`` is given,
    under ``label`` (the use a shared script is put to; default: its name)."""
    script = redis.register_script(source(package, name, prelude=prelude))
    return script if observe is None else _Observed(script, observe(label or name))


class _Observed:
    """An ``AsyncScript`` whose calls are timed (a failure is counted, then re-raised)."""

    __slots__ = ("_observe", "_script")

    def __init__(self, script: AsyncScript, observe: Callable[[float, bool], None]) -> None:
        self._script = script
        self._observe = observe

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        started = time.perf_counter()
        try:
            reply = await self._script(keys=keys, args=args, client=client)
        except BaseException:
            self._observe(time.perf_counter() - started, False)
            raise
        self._observe(time.perf_counter() - started, True)
        return reply


# --- WAIT after an admission script ------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaWait:
    """``WAIT replicas timeout_ms`` after an admission script whose outcome binds (a placement,
    a pod's registration), on the connection that ran it: the write is then on ``replicas``
    replicas (or the timeout passed) before the caller is answered, so a failover right after
    loses it less often. Fewer acks than asked are reported to ``short(use, acked)`` (a
    metric and a log line), never an error: the write is on the master either way."""

    replicas: int
    timeout_ms: int
    short: Callable[[str, int], None]


async def run_acked(
    redis: Redis,
    script: Any,
    *,
    keys: list[str],
    args: list[Any],
    wait: ReplicaWait | None,
    use: str,
    binds: Callable[[Any], bool] = lambda _reply: True,
) -> Any:
    """``script(keys=, args=)``, and when ``wait`` is on and ``binds(reply)``, WAIT on the same
    connection (WAIT counts the replicas that acked this connection's last write; another
    connection's WAIT proves nothing). On a cluster that connection is one of the node's that
    owns ``keys[0]``; a redirection (the slot moving) runs the script the usual way, unwaited."""
    if wait is None or wait.replicas <= 0:
        return await script(keys=keys, args=args)
    inner, observe = (
        (script._script, script._observe)
        if isinstance(script, _Observed)
        else (
            script,
            None,
        )
    )
    started = time.perf_counter()
    ok = False
    try:
        async with _one_connection(redis, keys[0]) as run:
            call = ("EVALSHA", inner.sha, len(keys), *keys, *args)
            try:
                reply = await run(*call)
            except NoScriptError:
                await run("SCRIPT", "LOAD", inner.script)
                reply = await run(*call)
            if binds(reply):
                acked = int(await run("WAIT", wait.replicas, wait.timeout_ms))
                if acked < wait.replicas:
                    wait.short(use, acked)
        ok = True
        return reply
    except (MovedError, AskError, TryAgainError):
        ok = True
        return await script(keys=keys, args=args)  # (not run: a redirection is a refusal)
    finally:
        if observe is not None:
            observe(time.perf_counter() - started, ok)


@contextlib.asynccontextmanager
async def _one_connection(redis: Redis, key: str) -> AsyncIterator[Callable[..., Any]]:
    """A ``run(*command)`` whose commands all go over one connection, held meanwhile: one of
    the client's pool (one server, the Sentinel set's master), or of the node that owns
    ``key`` (a cluster)."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        node = redis.get_node_from_key(key)
        if node is None:
            raise SlotNotCoveredError(f"no node owns the slot of {key}")
        connection = node.acquire_connection()
        try:

            async def run_on_node(*command: Any) -> Any:
                await connection.send_command(*command)
                return await node.parse_response(connection, command[0])

            yield run_on_node
        finally:
            await node.disconnect_if_needed(connection)
            node.release(connection)
        return
    single = Redis(connection_pool=redis.connection_pool, single_connection_client=True)
    try:
        yield single.execute_command
    finally:
        await single.aclose()
