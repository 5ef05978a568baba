"""Which layout of key names a Redis holds, and the one-shot move from an earlier one.

Layout 2 (issue 17) writes every key of one scope under the scope id's hash tag (``{sid}``),
so that a Redis Cluster keeps a scope in one slot. A replica refuses to start on a Redis whose
keys an earlier version wrote in layout 1, as it refuses an outdated database schema: reading
half the keys under the old names would strand live sessions silently. The operator stops
every replica of the older version and runs ``agent-runtime redis migrate``, which renames
the keys in place (``RENAMENX``: a key keeps its value and its TTL) and records the layout in
``agent_runtime:key_layout``. It refuses while job leader locks show replicas still running.

Layout 1 only ever existed on a single server (its scripts cannot run on a cluster), so the
renames never cross a node. Each module's ``legacy_keys.py`` says what its old names were
(``LegacyKeys``: the heads a bare scope id followed — the tag is put around it here — and its
other renames), which of them are retired (deleted: ``pods:{pod_id}:scopes``, nothing reads
it any more), and which carry content that moves to other keys (converted, one at a time,
after the renames: a session hash goes under its scope's tag, a global index is split by scope
or bucket, a resource-manager pod's keys go under the scope its info names).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis

from agent_runtime.config import ConfigError
from agent_runtime.jobs import JOB_LOCK_PREFIX
from agent_runtime.resource_manager import legacy_keys as rm_legacy
from agent_runtime.session_manager import legacy_keys as sm_legacy

LAYOUT_KEY = "agent_runtime:key_layout"
LAYOUT = 2
SCAN_COUNT = 1000
RENAME_BATCH = 500  # renames per pipeline: ~0.5 ms of Redis each


class LegacyKeys(Protocol):
    """What a module's ``legacy_keys.py`` says of its own keys (the mechanics are here)."""

    PREFIX: str  # every key of the module starts with it (what SCAN looks at)
    # "<PREFIX><head>:<sid>:…" with a bare scope id → "<PREFIX><head>:{<sid>}:…" (a rename)
    SCOPE_HEADS: tuple[str, ...]

    # its other renames (old name → layout-2 name, or None); names no version uses (deleted);
    # keys whose content moves (convert, after the renames; False: nothing moved, or a clash)
    def renamed(self, key: str) -> str | None: ...
    def retired(self, key: str) -> bool: ...
    def convertible(self, key: str) -> bool: ...
    async def convert(self, redis: Redis, key: str) -> bool: ...


@dataclass(frozen=True)
class _Module:
    keys: LegacyKeys
    scope_bare: re.Pattern[str]  # a key of a scope head with the scope id bare: head, sid, rest

    @classmethod
    def of(cls, keys: LegacyKeys) -> _Module:
        heads = "|".join(re.escape(head) for head in keys.SCOPE_HEADS)
        return cls(keys, re.compile(rf"^({re.escape(keys.PREFIX)}(?:{heads}):)([^:{{}}]+)(:.+)$"))

    def current_name(self, key: str) -> str | None:
        """The layout-2 name of a layout-1 key, or None when ``key`` is not one (already
        current, or a key whose name did not change)."""
        if (new := self.keys.renamed(key)) is not None:
            return new
        if (match := self.scope_bare.match(key)) is None:
            return None
        head, scope_id, rest = match.groups()
        return f"{head}{{{scope_id}}}{rest}"


MODULES = (_Module.of(sm_legacy), _Module.of(rm_legacy))
CONVERTED = ""  # the "current name" _legacy_keys gives a key to convert


async def _legacy_keys(redis: Redis) -> AsyncIterator[tuple[str, str | None, _Module]]:
    """(old name, current name, its module) of every key still in an earlier layout; current
    name None: a retired key, to be deleted; CONVERTED: a key whose content moves."""
    for module in MODULES:
        async for key in redis.scan_iter(match=f"{module.keys.PREFIX}*", count=SCAN_COUNT):
            if module.keys.retired(key):
                yield key, None, module
            elif (new := module.current_name(key)) is not None:
                yield key, new, module
            elif module.keys.convertible(key):
                yield key, CONVERTED, module


async def check(redis: Redis) -> None:
    """At startup: go on only over keys of this version's layout (recording it on a Redis that
    holds none of ours yet). ConfigError with the way out otherwise."""
    if await check_only(redis):
        await redis.set(LAYOUT_KEY, LAYOUT)


async def check_only(redis: Redis) -> bool:
    """ConfigError unless the keys are in this version's layout; True when no layout is
    recorded yet (a Redis without keys of an earlier one: ``check`` records it)."""
    marker = await redis.get(LAYOUT_KEY)
    if marker is not None and str(marker) == str(LAYOUT):
        return False
    number = None if marker is None else _layout_number(marker)
    if number is not None and number > LAYOUT:
        raise ConfigError(
            f"redis keys are in key layout {number}, newer than this version's ({LAYOUT}):"
            " a newer version wrote them; run that version"
        )
    async for old, _, _ in _legacy_keys(redis):
        raise ConfigError(
            f"redis holds keys of an earlier key layout (e.g. {old!r}): stop every replica of"
            " the older version, then run `agent-runtime redis migrate` (same environment)"
        )
    return True


def _layout_number(marker: Any) -> int:
    try:
        return int(marker)
    except (TypeError, ValueError):
        raise ConfigError(f"{LAYOUT_KEY} holds {marker!r}, not a layout number") from None


@dataclass
class Migration:
    """What ``migrate`` did (or, with ``dry_run``, would do)."""

    renamed: int = 0
    converted: int = 0  # keys whose content moved to their layout-2 keys
    deleted: int = 0  # retired keys (no current name)
    # the current name existed already (a replica of this version wrote it): the old key is
    # left where it is, named here (the first 20) for the operator to look at
    clashes: list[str] = field(default_factory=list)
    clash_count: int = 0
    dry_run: bool = False

    def clash(self, key: str) -> None:
        self.clash_count += 1
        if len(self.clashes) < 20:
            self.clashes.append(key)

    def describe(self) -> str:
        verb = "would rename" if self.dry_run else "renamed"
        line = f"key layout {LAYOUT}: {verb} {self.renamed} keys"
        if self.converted:
            line += f", {'would convert' if self.dry_run else 'converted'} {self.converted}"
        if self.deleted:
            line += f", {'would delete' if self.dry_run else 'deleted'} {self.deleted} retired ones"
        if self.clash_count:
            line += (
                f"; {self.clash_count} left under their old name (the new name exists),"
                f" e.g. {', '.join(self.clashes[:3])}"
            )
        return line


async def running_replicas(redis: Redis) -> list[str]:
    """Job leader locks held right now: some replica (of any version) is running."""
    return [key async for key in redis.scan_iter(match=f"{JOB_LOCK_PREFIX}*", count=SCAN_COUNT)]


async def migrate(redis: Redis, *, dry_run: bool = False, force: bool = False) -> Migration:
    """Rename every key of an earlier layout to its current name (delete a retired one), then
    record the layout.
    Idempotent: a second run (or one after a crash) renames what is left. Refuses while a
    replica runs (its writes would land under the names being moved) unless ``force``."""
    held = await running_replicas(redis)
    if held and not force:
        raise ConfigError(
            f"replicas are running (job locks held: {', '.join(sorted(held)[:3])}): stop every"
            " replica first (the locks lapse within seconds), or pass --force"
        )
    done = Migration(dry_run=dry_run)
    batch: list[tuple[str, str | None]] = []

    async def flush() -> None:
        if dry_run:
            done.deleted += sum(new is None for _, new in batch)
            done.renamed += sum(new is not None for _, new in batch)
        else:
            async with redis.pipeline(transaction=False) as pipe:
                for old, new in batch:
                    if new is None:
                        pipe.delete(old)
                    else:
                        pipe.renamenx(old, new)
                replies = await pipe.execute(raise_on_error=False)
            for (old, new), moved in zip(batch, replies, strict=True):
                if isinstance(moved, Exception):  # gone since the SCAN (its TTL ran out)
                    continue
                if new is None:
                    done.deleted += int(moved)
                elif moved:
                    done.renamed += 1
                elif await redis.exists(old):  # not renamed, and still there: a clash
                    done.clash(old)
        batch.clear()

    converts: list[tuple[str, _Module]] = []
    async for old, new, module in _legacy_keys(redis):
        if new == CONVERTED:
            converts.append((old, module))
            continue
        batch.append((old, new))
        if len(batch) >= RENAME_BATCH:
            await flush()
    if batch:
        await flush()
    for key, module in converts:  # after the renames; one at a time (each reads what it moves)
        if dry_run or await module.keys.convert(redis, key):
            done.converted += 1
        elif await redis.exists(key):  # not moved, and still there: a clash
            done.clash(key)
    if not dry_run:
        await redis.set(LAYOUT_KEY, LAYOUT)
    return done


__all__ = [
    "LAYOUT",
    "LAYOUT_KEY",
    "Migration",
    "check",
    "check_only",
    "migrate",
    "running_replicas",
]
