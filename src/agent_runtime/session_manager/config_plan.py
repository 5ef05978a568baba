"""config_sync's plan (pure): what an item changes, checked against a snapshot of the DB.

``make_plan`` validates the op against the snapshot (404 / 409 / 400) and returns the DB write and
the snapshot after it; ``with_scopes`` adds the known scopes the change reaches, with the
template each runs on before and after, and the change class. No Redis, no DB, no I/O:
``config_store`` runs it under the config_sync lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from agent_runtime.errors import Conflict, NotFound, ValidationFailed
from agent_runtime.session_manager import config_repo as repo
from agent_runtime.session_manager.config_repo import Snapshot
from agent_runtime.session_manager.items import (
    RoutingRuleItem,
    RoutingRuleKey,
    TemplateItem,
    TemplateKey,
    parse_item,
)
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.spec_fields import classify_change

_CLASS_RANK = {"none": 0, "policy": 1, "deploy": 2}


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


def parse(request: ConfigSyncRequest, *, default_session_ttl: int = 60) -> Any:
    """Validate the item for its kind and op; update is partial (validated after merging). A
    template created or synced without ``session_ttl`` gets ``default_session_ttl``
    (``AGENT_RUNTIME_DEFAULT_SESSION_TTL``); an update keeps the stored one."""
    full: type[BaseModel] = TemplateItem if request.kind == "template" else RoutingRuleItem
    key: type[BaseModel] = TemplateKey if request.kind == "template" else RoutingRuleKey
    if full is TemplateItem and request.op in ("create", "sync"):
        return parse_item(full, {"session_ttl": default_session_ttl, **request.item})
    if request.op in ("create", "sync") or (request.op == "update" and full is RoutingRuleItem):
        return parse_item(full, request.item)
    unknown = sorted(set(request.item) - set(full.model_fields))
    if unknown:
        raise ValidationFailed("; ".join(f"item.{f}: unknown field" for f in unknown))
    ids = parse_item(key, {f: request.item[f] for f in key.model_fields if f in request.item})
    # delete needs only the id fields; a partial template update keeps the rest for merging
    return ids if request.op == "delete" else request.item


def make_plan(
    kind: str, op: str, parsed: Any, snapshot: Snapshot, *, check: Callable[[dict[str, Any]], None]
) -> Plan:
    if kind == "template":
        return _plan_template(op, parsed, snapshot, check=check)
    return _plan_rule(op, parsed, snapshot)


def rule_key_of(plan: Plan) -> tuple[str, str]:
    assert plan.rule_key is not None
    return plan.rule_key


def with_scopes(plan: Plan, known: dict[str, tuple[str, str]]) -> Plan:
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
        rule_key = rule_key_of(plan)
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
