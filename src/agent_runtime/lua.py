"""Lua scripts: read once from a module's ``lua/`` folder, registered once per client.

``redis.register_script`` gives an ``AsyncScript`` that calls EVALSHA and reloads the script
on NOSCRIPT (e.g. after a Redis restart). Files starting with ``_`` are preludes: shared local
functions prepended to the scripts that name them.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript


@cache
def source(package: str, name: str, *, prelude: str | None = None) -> str:
    folder = resources.files(package).joinpath("lua")
    text = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if prelude is not None:
        text = folder.joinpath(f"{prelude}.lua").read_text(encoding="utf-8") + "\n" + text
    return text


def register(redis: Redis, package: str, name: str, *, prelude: str | None = None) -> AsyncScript:
    return redis.register_script(source(package, name, prelude=prelude))
