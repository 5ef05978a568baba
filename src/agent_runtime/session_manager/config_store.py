"""The config layer: ``resolve`` (cache first, then the DB) and ``config_sync``.

config_sync order, and why (contract §2.3): validate → take the cluster-wide lock → plan
against the current DB (404/409/sunset checks) → write the DB → propagate to Redis and the
resource manager. Every refusal happens before the write, so a refused call changes nothing;
a failed write happens before any cache or pool change, so it changes nothing either.

Propagation is idempotent and driven by the target state, not by the diff: a sync retried
after a Redis failure mid-propagation brings every affected scope to the template it should
run, even though the DB write already happened and the retry sees no change.

Propagation is proportional to the scopes the item can reach (the scope indexes: by
template, by group and by bot; a ``(*, *)`` rule reaches every scope) and runs after the
lock is released: the lock covers plan → checks → DB write → ``config_gen`` bump only. Two
propagations may then overlap; each scope write carries the generation its content was
resolved at and is refused once a later config_sync has bumped ``config_gen`` (scope_put.lua,
pool_config.lua): the refused scope is re-resolved from a fresh snapshot of the DB at the
current generation and written again, so the last config_sync's state wins everywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection

from agent_runtime import logs
from agent_runtime.db.engine import Database
from agent_runtime.errors import (
    ConfigNotFound,
    ConfigSyncBusy,
    Conflict,
    NotFound,
    ValidationFailed,
)
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.session_manager import config_repo as repo
from agent_runtime.session_manager.config_repo import Snapshot
from agent_runtime.session_manager.models import (
    ConfigSyncRequest,
    RoutingRuleItem,
    RoutingRuleKey,
    ScopeConfig,
    TemplateItem,
    TemplateKey,
    parse_item,
)
from agent_runtime.session_manager.state import SessionState
from agent_runtime.single_flight import SingleFlight
from agent_runtime.spec_fields import classify_change, clear_env_values
from agent_runtime.util import rule_id_of, scope_id_of

log = logging.getLogger(__name__)

_CLASS_RANK = {"none": 0, "policy": 1, "deploy": 2}
PROPAGATION_CONCURRENCY = 8  # scopes written at once by one propagation (a few calls each)
MAX_REPLANS = 20  # fresh snapshots one scope's write may need while later syncs keep coming

LOCAL_DEFAULT_TEMPLATE = TemplateItem(template_id="default", image="agentserver:local")
LOCAL_DEFAULT_RULE = RoutingRuleItem(group_id="*", bot_id="*", template_id="default")


@dataclass(frozen=True)
class ScopeChange:
    """One known scope, the template it runs on now and the one it will run on."""

    scope_id: str
    group_id: str
    bot_id: str
    before: TemplateItem | None
    after: TemplateItem | None
    template_id: str | None = None  # what the scope's best rule names after (None: no rule)

    @property
    def version_changes(self) -> bool:
        return (
            self.before is not None
            and self.after is not None
            and self.before.deploy_ver() != self.after.deploy_ver()
        )


@dataclass(frozen=True)
class Plan:
    kind: str
    op: str
    id: str
    change_class: str
    write: Any  # Callable[[Connection], None]
    scopes: list[ScopeChange]
    before: Snapshot
    after: Snapshot
    reach: Any  # (group_id, bot_id) -> bool: the scopes the item serves (a retry heals them)
    rule_key: tuple[str, str] | None = None  # a routing-rule plan's (group_id, bot_id)
    # a routing-rule plan's item after the write (None: deleted), for its pod budget
    rule_after: RoutingRuleItem | None = None


class ConfigStore:
    def __init__(
        self,
        *,
        db: Database,
        state: SessionState,
        resources: ResourceManagerFacade,
        clusters: frozenset[str] = frozenset(),
        namespaces: frozenset[str] | None = None,
        default_namespace: str = "default",
        wildcard_rule_pod_budget: int = 100,
    ) -> None:
        """``clusters``: the names a template's ``kubeconfig`` may hold; ``namespaces``: where a
        template may deploy (None: anywhere; the wiring passes the settings' allow-list)."""
        self._db = db
        self._state = state
        self._resources = resources
        self._clusters = clusters
        self._namespaces = namespaces
        self._default_namespace = default_namespace
        self._wildcard_budget = wildcard_rule_pod_budget
        # scope → the DB load running for it: a cold burst of one scope reads the DB once
        self._loading: SingleFlight[str, ScopeConfig] = SingleFlight()

    # --- resolve -------------------------------------------------------------------------------

    async def resolve(self, scope_id: str, group_id: str, bot_id: str) -> ScopeConfig:
        """The scope's configuration: the Redis cache, else the DB (then cached)."""
        cached = await self._state.get_scope_config(scope_id)
        config: ScopeConfig | None = None
        if cached:
            try:
                config = ScopeConfig.from_hash(scope_id, cached)
            except (KeyError, ValueError):
                log.warning("resolve cache of scope %s is malformed; reloading", scope_id)
            else:
                if config.rule_id is not None:
                    logs.add_secret_values(clear_env_values(config.pod_spec))  # masked in logs
                    return config
                # written without the scope → rule link (config_sync's version change, an
                # older replica): the DB says which rule, and so which pod budget
        config = await self._loading.run(scope_id, lambda: self._load(scope_id, group_id, bot_id))
        logs.add_secret_values(clear_env_values(config.pod_spec))  # masked in log lines
        return config

    async def _load(self, scope_id: str, group_id: str, bot_id: str) -> ScopeConfig:
        """One DB read for the scope, then the cache filled (unless a config change came)."""
        generation = await self._state.config_generation()
        found = await self._db.read(lambda conn: repo.match(conn, group_id, bot_id))
        if found is None:
            raise ConfigNotFound(f"no enabled template for group_id={group_id!r} bot_id={bot_id!r}")
        rule = found.rule
        config = ScopeConfig.of(
            scope_id,
            group_id,
            bot_id,
            found.template,
            rule_id=rule_id_of(rule.group_id, rule.bot_id),
            rule_pod_budget=rule.effective_pod_budget(self._wildcard_budget),
        )
        await self._state.fill_scope_config(
            scope_id, group_id, bot_id, config.to_hash(), generation, found.template.template_id
        )
        return config

    async def seed_local_defaults(self) -> bool:
        """Local mode, first start: a ``default`` template and a ``(*, *)`` rule, so a route
        answers at once. Does nothing when either table already has rows."""

        def seed(conn: Connection) -> bool:
            if repo.count_rows(conn) != (0, 0):
                return False
            repo.put_template(conn, LOCAL_DEFAULT_TEMPLATE, exists=False)
            repo.put_rule(conn, LOCAL_DEFAULT_RULE, exists=False)
            return True

        seeded = await self._db.write(seed)
        if seeded:
            log.info("seeded the local default template and (*, *) rule")
        return seeded

    # --- config_sync ---------------------------------------------------------------------------

    async def config_sync(self, request: ConfigSyncRequest) -> dict[str, Any]:
        parsed = _parse(request)
        if request.kind == "template" and request.op != "delete":
            fields = parsed if isinstance(parsed, dict) else parsed.as_dict()
            logs.add_secret_values(clear_env_values(fields))
            self.check_bounds(fields)
        async with self._state.config_sync_lock() as taken:
            if not taken:
                raise ConfigSyncBusy("another config_sync is running; retry shortly")
            snapshot = await self._db.read(repo.load_snapshot)
            plan = _plan(request.kind, request.op, parsed, snapshot, check=self.check_bounds)
            if plan.kind == "routing_rule" or plan.change_class == "deploy":
                # the sunset check (and a rule's change class) needs the scopes before the
                # write; a template's policy change reads them only after the lock
                reach = await self._reach(plan)
                plan = _with_scopes(plan, await self._state.registry_entries(reach))
                await self._check_sunset(plan)
            await self._db.write(plan.write)
            # from here on a resolve that read the DB before the write cannot fill its cache
            generation = await self._state.bump_config_generation()
        # the lock is released: the walk below holds nothing another config_sync needs.
        # Scopes registered between the plan and the bump are found by reading again.
        reach = await self._reach(plan)
        plan = _with_scopes(plan, await self._state.registry_entries(reach))
        if plan.kind == "routing_rule":
            # contract: "a routing-rule change drops every cached scope resolution" (SCAN
            # slices, outside the lock; the scopes that change are written below)
            await self._state.drop_all_scope_configs()
        if plan.rule_key is not None:  # the rule's pod budget, for scopes that do not route
            after = plan.rule_after  # None: deleted, its limit goes
            limit = after.effective_pod_budget(self._wildcard_budget) if after else 0
            await self._resources.set_rule_pod_budget(rule_id_of(*plan.rule_key), limit)
        affected = await self._propagate(plan, generation)
        return {
            "kind": plan.kind,
            "op": plan.op,
            "id": plan.id,
            "change_class": plan.change_class,
            "affected_scopes": affected,
        }

    def check_bounds(self, fields: dict[str, Any]) -> None:
        """400 for a template outside the operator's bounds: a ``kubeconfig`` that is not a
        configured cluster name (a path never is one), a namespace off the allow-list. Checks
        the fields given (a partial update: those it sets; the merged item is checked too)."""
        cluster = fields.get("kubeconfig")
        if cluster is not None and cluster not in self._clusters:
            configured = ", ".join(sorted(self._clusters)) or "none"
            raise ValidationFailed(
                "item.kubeconfig: must name a cluster of AGENT_RUNTIME_CLUSTERS "
                f"(configured: {configured}), never a path"
            )
        if self._namespaces is None or "namespace" not in fields:
            return
        if (fields["namespace"] or self._default_namespace) not in self._namespaces:
            allowed = ", ".join(sorted(self._namespaces))
            raise ValidationFailed(
                f"item.namespace: not an allowed namespace (allowed: {allowed}; "
                "AGENT_RUNTIME_NAMESPACES adds to the default namespace)"
            )

    async def _reach(self, plan: Plan) -> set[str]:
        """The scopes the changed item can reach, from the indexes (never the whole registry
        unless the item is the ``(*, *)`` rule, which does reach every scope)."""
        if plan.kind == "template":
            if plan.op == "delete":
                return set()  # a template in use by a rule cannot be deleted
            return await self._state.scopes_in_template(plan.id)
        group_id, bot_id = _rule_key(plan)
        if group_id != repo.WILDCARD and bot_id != repo.WILDCARD:
            return {scope_id_of(group_id, bot_id)}
        if group_id != repo.WILDCARD:
            return await self._state.scopes_in_group(group_id)
        if bot_id != repo.WILDCARD:
            return await self._state.scopes_of_bot(bot_id)
        return set(await self._state.known_scopes())

    async def _check_sunset(self, plan: Plan) -> None:
        """A version change is refused while the scope still has pods of an older version."""
        changing = {c.scope_id: c for c in plan.scopes if c.version_changes}
        if not changing:
            return
        registered = await self._state.registered_pods_by_scope(set(changing))
        for scope_id, pod_ids in registered.items():
            current = changing[scope_id].before
            assert current is not None
            versions = await self._state.pod_versions(scope_id, pod_ids)
            sunset = [p for p, v in versions.items() if v is not None and v != current.deploy_ver()]
            if sunset:
                raise ConfigSyncBusy(
                    f"scope {scope_id} still has {len(sunset)} sunset pod(s) from the previous "
                    "deploy change; retry when they are reclaimed"
                )

    async def _propagate(self, plan: Plan, generation: int) -> int:
        """Bring Redis and the resource manager to the new configuration (idempotent), a few
        scopes at a time; a scope a later config_sync reached first is re-resolved."""
        fresh = _Fresh(generation, plan.after)
        pending = iter(plan.scopes)

        async def worker() -> None:  # a few workers, not a task per scope (10k tasks stall)
            for change in pending:
                await self._apply(change, fresh)

        await asyncio.gather(*(worker() for _ in range(PROPAGATION_CONCURRENCY)))
        return len(plan.scopes)

    async def _apply(self, change: ScopeChange, fresh: _Fresh) -> None:
        generation, snapshot = fresh.generation, fresh.snapshot
        for _ in range(MAX_REPLANS):
            if generation != fresh.generation:
                generation, snapshot = fresh.generation, fresh.snapshot
            template = snapshot.resolve(change.group_id, change.bot_id)
            template_id = repo.best_rule(snapshot.rules, change.group_id, change.bot_id)
            if await self._write_scope(change, template, template_id, generation):
                return
            # a later config_sync bumped config_gen: resolve again from the DB as it is now
            await fresh.refresh(self._state, self._db)
        raise ConfigSyncBusy(f"scope {change.scope_id}: config keeps changing; retry")

    async def _write_scope(
        self,
        change: ScopeChange,
        template: TemplateItem | None,
        template_id: str | None,
        generation: int,
    ) -> bool:
        sid = change.scope_id
        if template is None:
            return await self._state.apply_scope(
                sid, change.group_id, change.bot_id, template_id, generation, None
            )
        version = template.deploy_ver()
        candidates = await self._state.candidate_pods(sid)
        versions = await self._state.pod_versions(sid, candidates)
        config = ScopeConfig.of(sid, change.group_id, change.bot_id, template)
        # a deploy change writes the cache (register_pod checks deploy_ver against it); any
        # other change drops it and the next route resolves from the DB
        moves = change.before is not None and change.before.deploy_ver() != version
        if not await self._state.apply_scope(
            sid, change.group_id, change.bot_id, template_id, generation,
            config.to_hash() if moves else None,
        ):  # fmt: skip
            return False
        await self._state.remove_candidates(
            sid, [p for p, v in versions.items() if v is not None and v != version]
        )
        await self._resources.update_pool_config(
            sid, config.pool_config(), pod_spec=config.pod_spec, generation=generation
        )
        return True


class _Fresh:
    """The newest (generation, snapshot) a propagation knows: shared by its scope writes,
    re-read once when a later config_sync is seen (the generation read before the DB)."""

    def __init__(self, generation: int, snapshot: Snapshot) -> None:
        self.generation = generation
        self.snapshot = snapshot
        self._lock = asyncio.Lock()

    async def refresh(self, state: SessionState, db: Database) -> None:
        seen = self.generation
        async with self._lock:
            if self.generation != seen:
                return  # another scope write of this propagation refreshed it already
            generation = await state.config_generation()
            snapshot = await db.read(repo.load_snapshot)
            self.generation, self.snapshot = generation, snapshot


# --- planning (pure) ---------------------------------------------------------------------------


def _parse(request: ConfigSyncRequest) -> Any:
    """Validate the item for its kind and op; update is partial (validated after merging)."""
    full: type[BaseModel] = TemplateItem if request.kind == "template" else RoutingRuleItem
    key: type[BaseModel] = TemplateKey if request.kind == "template" else RoutingRuleKey
    if request.op in ("create", "sync") or (request.op == "update" and full is RoutingRuleItem):
        return parse_item(full, request.item)
    unknown = sorted(set(request.item) - set(full.model_fields))
    if unknown:
        raise ValidationFailed("; ".join(f"item.{f}: unknown field" for f in unknown))
    ids = parse_item(key, {f: request.item[f] for f in key.model_fields if f in request.item})
    # delete needs only the id fields; a partial template update keeps the rest for merging
    return ids if request.op == "delete" else request.item


def _plan(
    kind: str, op: str, parsed: Any, snapshot: Snapshot, *, check: Callable[[dict[str, Any]], None]
) -> Plan:
    if kind == "template":
        return _plan_template(op, parsed, snapshot, check=check)
    return _plan_rule(op, parsed, snapshot)


def _rule_key(plan: Plan) -> tuple[str, str]:
    assert plan.rule_key is not None
    return plan.rule_key


def _with_scopes(plan: Plan, known: dict[str, tuple[str, str]]) -> Plan:
    """The plan with its scope changes: of the scopes the item can reach, those whose
    template changes, plus those the item itself serves (``reach``: a retry heals them)."""
    changes = []
    for scope_id, (group_id, bot_id) in sorted(known.items()):
        old, new = plan.before.resolve(group_id, bot_id), plan.after.resolve(group_id, bot_id)
        if old != new or plan.reach(group_id, bot_id):
            tid = repo.best_rule(plan.after.rules, group_id, bot_id)
            changes.append(ScopeChange(scope_id, group_id, bot_id, old, new, tid))
    change_class = plan.change_class
    if plan.kind == "routing_rule":
        rule_key = _rule_key(plan)
        after = plan.rule_after
        same = plan.before.rules.get(rule_key) == plan.after.rules.get(rule_key) and (
            after is None or plan.before.pod_budgets.get(rule_key) == after.pod_budget
        )
        change_class = max(
            (_scope_class(c) for c in changes),
            key=_CLASS_RANK.__getitem__,
            default="none" if same else "policy",
        )
    return dataclasses.replace(plan, scopes=changes, change_class=change_class)


def _plan_template(
    op: str, parsed: Any, snap: Snapshot, *, check: Callable[[dict[str, Any]], None]
) -> Plan:
    template_id = parsed["template_id"] if op == "update" else parsed.template_id
    current = snap.templates.get(template_id)
    after = Snapshot(templates=dict(snap.templates), rules=snap.rules)
    if op == "delete":
        if current is None:
            raise NotFound(f"template {template_id!r} does not exist")
        in_use = sorted(k for k, tid in snap.rules.items() if tid == template_id)
        if in_use:
            raise Conflict(
                f"template {template_id!r} is used by {len(in_use)} routing rule(s), "
                f"e.g. group_id={in_use[0][0]!r} bot_id={in_use[0][1]!r}"
            )
        del after.templates[template_id]
        return Plan(
            "template", op, template_id, "none",
            lambda conn: repo.delete_template(conn, template_id), [], snap, after,
            lambda g, b: False,
        )  # fmt: skip
    if op == "create" and current is not None:
        raise Conflict(f"template {template_id!r} already exists")
    if op == "update":
        if current is None:
            raise NotFound(f"template {template_id!r} does not exist")
        new = parse_item(TemplateItem, {**current.as_dict(), **parsed})
        check(new.as_dict())  # the stored fields too: a row from before the bounds
    else:
        new = parsed
    after.templates[template_id] = new
    change_class = classify_change(current.as_dict(), new.as_dict()) if current else "none"
    exists = current is not None
    return Plan(
        "template", op, template_id, change_class,
        lambda conn: repo.put_template(conn, new, exists=exists), [], snap, after,
        lambda g, b: repo.best_rule(after.rules, g, b) == template_id,
    )  # fmt: skip


def _plan_rule(op: str, parsed: Any, snap: Snapshot) -> Plan:
    key = (parsed.group_id, parsed.bot_id)
    rule_id = f"{parsed.group_id}/{parsed.bot_id}"
    current = snap.rules.get(key)
    after = Snapshot(templates=snap.templates, rules=dict(snap.rules))
    if op == "delete":
        if current is None:
            raise NotFound(f"routing rule ({key[0]!r}, {key[1]!r}) does not exist")
        del after.rules[key]
        write: Any = lambda conn: repo.delete_rule(conn, *key)  # noqa: E731
    else:
        if op == "create" and current is not None:
            raise Conflict(f"routing rule ({key[0]!r}, {key[1]!r}) already exists")
        if op == "update" and current is None:
            raise NotFound(f"routing rule ({key[0]!r}, {key[1]!r}) does not exist")
        if parsed.template_id not in snap.templates:
            missing = parsed.template_id
            raise ValidationFailed(f"item.template_id: template {missing!r} does not exist")
        after.rules[key] = parsed.template_id
        exists = current is not None
        write = lambda conn: repo.put_rule(conn, parsed, exists=exists)  # noqa: E731

    rule_after = None if op == "delete" else parsed
    return Plan(
        "routing_rule", op, rule_id, "none", write, [], snap, after, _nothing, key, rule_after
    )


def _nothing(group_id: str, bot_id: str) -> bool:
    return False


def _scope_class(change: ScopeChange) -> str:
    if change.before is None or change.after is None:
        return "policy"
    return classify_change(change.before.as_dict(), change.after.as_dict())
