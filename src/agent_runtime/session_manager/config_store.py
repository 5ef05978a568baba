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
import logging
from typing import Any

from sqlalchemy import Connection

from agent_runtime import logs
from agent_runtime.db.engine import Database
from agent_runtime.errors import ConfigNotFound, ConfigSyncBusy, ValidationFailed
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.session_manager import config_plan
from agent_runtime.session_manager import config_repo as repo
from agent_runtime.session_manager.config_plan import Plan, ScopeChange
from agent_runtime.session_manager.config_repo import Snapshot
from agent_runtime.session_manager.items import RoutingRuleItem, TemplateItem
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.session_manager.scope_cache import ScopeConfig
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState
from agent_runtime.single_flight import SingleFlight
from agent_runtime.spec_fields import clear_env_values
from agent_runtime.tracing import SCOPE_ID, Tracing
from agent_runtime.util import rule_id_of, scope_id_of

log = logging.getLogger(__name__)

PROPAGATION_CONCURRENCY = 8  # scopes written at once by one propagation (a few calls each)
RESOLVED_FROM = "agent_runtime.resolve.from"  # the resolve span's: cache or db
MAX_REPLANS = 20  # fresh snapshots one scope's write may need while later syncs keep coming

LOCAL_DEFAULT_TEMPLATE = TemplateItem(template_id="default", image="agentserver:local")
LOCAL_DEFAULT_RULE = RoutingRuleItem(group_id="*", bot_id="*", template_id="default")


class ConfigStore:
    def __init__(
        self,
        *,
        db: Database,
        state: SessionState,
        scopes: ScopeState,
        resources: ResourceManagerFacade,
        clusters: frozenset[str] = frozenset(),
        namespaces: frozenset[str] | None = None,
        default_namespace: str = "default",
        wildcard_rule_pod_budget: int = 100,
        default_session_ttl: int = 60,
        tracing: Tracing | None = None,
    ) -> None:
        """``clusters``: the names a template's ``kubeconfig`` may hold; ``namespaces``: where a
        template may deploy (None: anywhere; the wiring passes the settings' allow-list).
        ``state``: the pods (a version change sunsets candidates); ``scopes``: the cache, the
        registry and its indexes, the lock. ``tracing``: the resolve's span (off unless given)."""
        self._tracing = tracing or Tracing()
        self._db = db
        self._state = state
        self._scopes = scopes
        self._resources = resources
        self._clusters = clusters
        self._namespaces = namespaces
        self._default_namespace = default_namespace
        self._wildcard_budget = wildcard_rule_pod_budget
        self._default_session_ttl = default_session_ttl  # a new template without session_ttl
        # scope → the DB load running for it: a cold burst of one scope reads the DB once
        self._loading: SingleFlight[str, ScopeConfig] = SingleFlight()

    # --- resolve -------------------------------------------------------------------------------

    async def resolve(self, scope_id: str, group_id: str, bot_id: str) -> ScopeConfig:
        """The scope's configuration: the Redis cache, else the DB (then cached)."""
        with self._tracing.span("resolve", attributes={SCOPE_ID: scope_id}) as span:
            cached = await self._scopes.get_scope_config(scope_id)  # None: absent or malformed
            if cached is not None and cached.rule_id is not None:
                span.set_attribute(RESOLVED_FROM, "cache")
                logs.add_secret_values(clear_env_values(cached.pod_spec))  # masked in logs
                return cached
            # none, or written without the scope → rule link (config_sync's version change, an
            # older replica): the DB says which rule, and so which pod budget
            span.set_attribute(RESOLVED_FROM, "db")
            config = await self._loading.run(
                scope_id, lambda: self._load(scope_id, group_id, bot_id)
            )
            logs.add_secret_values(clear_env_values(config.pod_spec))  # masked in log lines
            return config

    async def _load(self, scope_id: str, group_id: str, bot_id: str) -> ScopeConfig:
        """One DB read for the scope, then the cache filled (unless a config change came)."""
        generation = await self._scopes.config_generation()
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
        await self._scopes.fill_scope_config(
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
        parsed = config_plan.parse(request, default_session_ttl=self._default_session_ttl)
        if request.kind == "template" and request.op != "delete":
            fields = parsed if isinstance(parsed, dict) else parsed.as_dict()
            logs.add_secret_values(clear_env_values(fields))
            self.check_bounds(fields)
        async with self._scopes.config_sync_lock() as taken:
            if not taken:
                raise ConfigSyncBusy("another config_sync is running; retry shortly")
            snapshot = await self._db.read(repo.load_snapshot)
            plan = config_plan.make_plan(
                request.kind, request.op, parsed, snapshot, check=self.check_bounds
            )
            if plan.kind == "routing_rule" or plan.change_class == "deploy":
                # the sunset check (and a rule's change class) needs the scopes before the
                # write; a template's policy change reads them only after the lock
                reach = await self._reach(plan)
                plan = config_plan.with_scopes(plan, await self._scopes.registry_entries(reach))
                await self._check_sunset(plan)
            await self._db.write(plan.write)
            # from here on a resolve that read the DB before the write cannot fill its cache
            generation = await self._scopes.bump_config_generation()
        # the lock is released: the walk below holds nothing another config_sync needs.
        # Scopes registered between the plan and the bump are found by reading again.
        reach = await self._reach(plan)
        plan = config_plan.with_scopes(plan, await self._scopes.registry_entries(reach))
        if plan.kind == "routing_rule":
            # contract: "a routing-rule change drops every cached scope resolution" (SCAN
            # slices, outside the lock; the scopes that change are written below)
            await self._scopes.drop_all_scope_configs()
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
            return await self._scopes.scopes_in_template(plan.id)
        group_id, bot_id = config_plan.rule_key_of(plan)
        if group_id != repo.WILDCARD and bot_id != repo.WILDCARD:
            return {scope_id_of(group_id, bot_id)}
        if group_id != repo.WILDCARD:
            return await self._scopes.scopes_in_group(group_id)
        if bot_id != repo.WILDCARD:
            return await self._scopes.scopes_of_bot(bot_id)
        return set(await self._scopes.known_scopes())

    async def _check_sunset(self, plan: Plan) -> None:
        """A version change is refused while the scope still has pods of an older version."""
        changing = {c.scope_id: c for c in plan.scopes if c.version_changes}
        if not changing:
            return
        registered = await self._scopes.registered_pods_by_scope(set(changing))
        for scope_id, pod_ids in registered.items():
            current = changing[scope_id].before
            assert current is not None
            versions = await self._scopes.pod_versions(scope_id, pod_ids)
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
            await fresh.refresh(self._scopes, self._db)
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
            return await self._scopes.apply_scope(
                sid, change.group_id, change.bot_id, template_id, generation, None
            )
        version = template.deploy_ver()
        candidates = await self._state.candidate_pods(sid)
        versions = await self._scopes.pod_versions(sid, candidates)
        config = ScopeConfig.of(sid, change.group_id, change.bot_id, template)
        # a deploy change writes the cache (register_pod checks deploy_ver against it); any
        # other change drops it and the next route resolves from the DB
        moves = change.before is not None and change.before.deploy_ver() != version
        if not await self._scopes.apply_scope(
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

    async def refresh(self, scopes: ScopeState, db: Database) -> None:
        seen = self.generation
        async with self._lock:
            if self.generation != seen:
                return  # another scope write of this propagation refreshed it already
            generation = await scopes.config_generation()
            snapshot = await db.read(repo.load_snapshot)
            self.generation, self.snapshot = generation, snapshot
