"""The pod budgets in Redis: the installation's and each routing rule's (docs/spec/
resource-manager.md "Pod budgets").

Every budget key is of one slot of its own (hash tag ``{budget}``), never a scope's: on a Redis
Cluster a scope's script cannot count a budget, so the budget is a step of its own around the
scope's scripts:

- ``reserve`` a unit (``"{sid}:{placeholder token}"``) BEFORE the scope's script adds the
  deploy's placeholder (which the script then does only with ``reserved=True``); ``release``
  it when the script does not (the caller follows, the scope is busy or at max_pods) or the
  deploy fails;
- ``renew`` it with each renewal of the deploy's lease (it lapses with the lease: a crashed
  deployer's unit stops counting seconds later, as its placeholder does);
- ``confirm`` it when the pod registers: the pod's unit (score +inf) takes its place;
- ``release`` a purged pod's unit.

Pods + live reservations <= each budget under any concurrency: every new pod takes its unit
first, in one script over one slot. A reservation taken by a caller that then follows only
makes a concurrent caller see the budget full a moment early. Reconcile's ``repair`` makes the
units match the pools after a crash between two steps or a data loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio import Redis

from agent_runtime.config import RM_KEY_PREFIX as P

# Not in the contract beyond the four names it lists: the budget keys, one literal hash tag.
BUDGET_TAG = "{budget}"
BUDGET_PODS_KEY = f"{P}budget:{BUDGET_TAG}:pods"  # ZSET: every unit of the installation
BUDGET_RULE_PREFIX = f"{P}budget:{BUDGET_TAG}:rule:"  # + <rule>:pods  ZSET: a rule's units
BUDGET_RULES_KEY = f"{P}budget:{BUDGET_TAG}:rules"  # SET: rule ids with a units ZSET
BUDGET_LIMITS_KEY = f"{P}budget:{BUDGET_TAG}:rule_limits"  # HASH: rule id -> its budget (>= 1)
BUDGET_LINKS_KEY = f"{P}budget:{BUDGET_TAG}:links"  # HASH: scope id -> the rule it counts in
BUDGET_SCOPE_PREFIX = f"{P}budget:{BUDGET_TAG}:scope:"  # + <sid>:units  ZSET: a scope's units
DEFAULT_POD_BUDGET = 1000
# a reservation outlives its placeholder by this much: the two deadlines are taken from the
# clocks of two Redis nodes (on a cluster), and the unit must not lapse first
RESERVATION_MARGIN = 1
REPAIR_BATCH = (
    50  # entries (scopes, rules) per budget_repair call (each ~4 commands + 2 per unit it changes)
)

_KEYS = [BUDGET_PODS_KEY, BUDGET_RULES_KEY, BUDGET_LIMITS_KEY, BUDGET_LINKS_KEY]
_HEAD = [BUDGET_RULE_PREFIX, BUDGET_SCOPE_PREFIX]


def budget_rule_pods_key(rule_id: str) -> str:
    return f"{BUDGET_RULE_PREFIX}{rule_id}:pods"


def budget_scope_units_key(scope: str) -> str:
    """A scope's units: its id inside the budget's slot, not a tag of its own."""
    return f"{BUDGET_SCOPE_PREFIX}{scope}:units"


def reservation_unit(scope_id: str, placeholder_token: str) -> str:
    """The budget unit of a deploy's placeholder (pod ids never hold ':')."""
    return f"{scope_id}:{placeholder_token}"


def token_of(member: str) -> str:
    """A placeholder member's token (``{token}@{deadline}``)."""
    return member.rpartition("@")[0] or member


@dataclass(frozen=True, slots=True)
class BudgetFix:
    """What reconcile found (budget_repair.lua): ``kind`` "scope" (``id`` a scope: units to
    drop, and those that must be counted, unit → score: "+inf" for a pod, a live
    placeholder's deadline), "rule" (``id`` a rule: units to drop from its ZSET only) or
    "stray" (units of no scope: dropped everywhere)."""

    kind: str
    id: str
    drop: Sequence[str] = ()
    add: Mapping[str, str] = field(default_factory=dict)


class BudgetState:
    """The budget scripts (lua/budget_*.lua, prelude _budget.lua) over one client; ``script``
    registers a script of the resource manager's ``lua/`` folder."""

    def __init__(self, redis: Redis, script: Callable[..., Any], pod_budget: int) -> None:
        self.redis = redis
        self.pod_budget = pod_budget
        self._reserve = script("budget_reserve", "_budget")
        self._renew = script("budget_renew", "_budget")
        self._confirm = script("budget_confirm", "_budget")
        self._release = script("budget_release", "_budget")
        self._link = script("budget_link", "_budget")
        self._repair = script("budget_repair", "_budget")

    async def reserve(
        self,
        scope_id: str,
        unit: str,
        seconds: float,
        *,
        rule: tuple[str, int] | None = None,
    ) -> str | None:
        """Reserve ``unit`` for ``seconds`` (+ RESERVATION_MARGIN); None when reserved, else
        the budget that refused it ("global" or "rule"). ``rule``: (rule id, its budget) the
        scope resolves through now (a route's acquire: the link follows it); None keeps the
        scope's link and the limits as they are."""
        link = ["1", *rule] if rule is not None else ["0", "", 0]
        reply = await self._reserve(
            keys=_KEYS,
            args=[*_HEAD, scope_id, unit, math.ceil(seconds) + RESERVATION_MARGIN, *link,
                  self.pod_budget],
        )  # fmt: skip
        return None if reply[0] == "ok" else str(reply[1])

    async def renew(self, scope_id: str, unit: str, seconds: float) -> bool:
        """Move the reservation's deadline to now + ``seconds`` (+ the margin); False when it
        had lapsed (it is taken again: its deploy holds a placeholder again)."""
        live = await self._renew(
            keys=_KEYS, args=[*_HEAD, scope_id, unit, math.ceil(seconds) + RESERVATION_MARGIN]
        )
        return bool(live)

    async def confirm(self, scope_id: str, pod_id: str, reservation: str | None) -> bool:
        """The pod's unit (+inf) in place of ``reservation`` (None: none); True when the
        reservation was still there."""
        held = await self._confirm(keys=_KEYS, args=[*_HEAD, scope_id, pod_id, reservation or ""])
        return bool(held)

    async def release(self, scope_id: str, *units: str) -> int:
        """Give back units of the scope (idempotent); how many were there."""
        if not units:
            return 0
        return int(await self._release(keys=_KEYS, args=[*_HEAD, scope_id, *units]))

    async def link(self, scope_id: str, rule_id: str, rule_pod_budget: int) -> int:
        """The scope counts in ``rule_id`` now ("" = none): its units move there; how many."""
        args = [*_HEAD, scope_id, rule_id, rule_pod_budget, ""]
        return int(await self._link(keys=_KEYS, args=args))

    async def forget(self, scope_id: str) -> bool:
        """The scope's pool keys expired: its link leaves the budget if it holds no unit."""
        return bool(await self._link(keys=_KEYS, args=[*_HEAD, scope_id, "", 0, "forget"]))

    async def set_rule_limit(self, rule_id: str, limit: int) -> None:
        """A rule's pod budget as config_sync wrote it (0 = unbounded: the limit is dropped)."""
        if limit > 0:
            await self.redis.hset(BUDGET_LIMITS_KEY, rule_id, str(limit))
        else:
            await self.redis.hdel(BUDGET_LIMITS_KEY, rule_id)

    # --- reads ---------------------------------------------------------------------------------

    async def used(self, rule_id: str | None = None) -> int:
        """Live units of the global budget (or of a rule's): pods + unexpired reservations."""
        key = BUDGET_PODS_KEY if rule_id is None else budget_rule_pods_key(rule_id)
        seconds, micros = await self.redis.time()
        return int(await self.redis.zcount(key, seconds + micros / 1e6, "+inf"))

    async def room(self) -> int:
        """Pods the installation's budget still allows: its limit less the live units."""
        return max(self.pod_budget - await self.used(), 0)

    async def links(self) -> dict[str, str]:
        """Every scope the budget holds units for or links to a rule, with its rule ("" =
        none) (the links' HSCAN)."""
        return {str(s): str(r) async for s, r in self.redis.hscan_iter(BUDGET_LINKS_KEY, count=500)}

    async def rule_units(self) -> dict[str, set[str]]:
        """Each rule's units (the rules' index, then a ZSCAN of each rule's ZSET)."""
        rules = [str(r) async for r in self.redis.sscan_iter(BUDGET_RULES_KEY, count=500)]
        return {
            rule: {str(u) async for u, _ in self.redis.zscan_iter(budget_rule_pods_key(rule))}
            for rule in rules
        }

    async def units_of(self, scope_ids: Sequence[str]) -> dict[str, dict[str, float]]:
        """Each scope's units with their scores (pipelined ZRANGEs, one slot)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in scope_ids:
                pipe.zrange(budget_scope_units_key(scope_id), 0, -1, withscores=True)
            rows = cast(list[list[tuple[str, float]]], await pipe.execute())
        return {s: dict(row) for s, row in zip(scope_ids, rows, strict=True)}

    async def global_units(self) -> dict[str, float]:
        """Every unit of the installation's budget (ZSCAN)."""
        units = self.redis.zscan_iter(BUDGET_PODS_KEY, count=500)
        return {str(u): float(s) async for u, s in units}

    async def repair(self, fixes: Iterable[BudgetFix]) -> tuple[int, int]:
        """Apply reconcile's findings (budget_repair.lua), REPAIR_BATCH scopes a call;
        (added, dropped)."""
        added = dropped = 0
        batch: list[BudgetFix] = []

        async def flush() -> None:
            nonlocal added, dropped
            args: list[Any] = [*_HEAD]
            for fix in batch:
                args += [fix.kind, fix.id, len(fix.drop), *fix.drop, len(fix.add)]
                args += [x for unit, score in fix.add.items() for x in (unit, score)]
            a, d = await self._repair(keys=_KEYS, args=args)
            added, dropped = added + int(a), dropped + int(d)
            batch.clear()

        for fix in fixes:
            if fix.drop or fix.add:
                batch.append(fix)
            if len(batch) >= REPAIR_BATCH:
                await flush()
        if batch:
            await flush()
        return added, dropped
