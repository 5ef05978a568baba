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

import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

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
