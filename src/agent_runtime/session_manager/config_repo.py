"""SQL for the two configuration tables. Plain blocking functions over a ``Connection``.

Hazard: blocking. Call them only through ``Database.read`` / ``Database.write`` (thread pool).
Rule priority lives in ``best_rule`` and is used both for a single resolve and for a whole
snapshot, so the two can never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Connection, and_, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from agent_runtime.db.tables import COLUMN_OF, FIELD_OF, routing_rule, service_config_template
from agent_runtime.errors import Conflict
from agent_runtime.session_manager.items import RoutingRuleItem, TemplateItem

WILDCARD = "*"

RuleKey = tuple[str, str]  # (group_id, bot_id)
T = TypeVar("T")


def best_rule(rules: Mapping[RuleKey, T], group_id: str, bot_id: str) -> T | None:
    """The value of the most specific matching rule: exact > (g, *) > (*, b) > (*, *)."""
    for key in ((group_id, bot_id), (group_id, WILDCARD), (WILDCARD, bot_id), (WILDCARD, WILDCARD)):
        if key in rules:
            return rules[key]
    return None


@dataclass
class Snapshot:
    """All templates and rules: small tables, read whole when a config change is planned."""

    templates: dict[str, TemplateItem] = field(default_factory=dict)
    rules: dict[RuleKey, str] = field(default_factory=dict)
    pod_budgets: dict[RuleKey, int | None] = field(default_factory=dict)  # each rule's own

    def resolve(self, group_id: str, bot_id: str) -> TemplateItem | None:
        """The template a scope runs on, or None (no rule, or its template is disabled)."""
        template_id = best_rule(self.rules, group_id, bot_id)
        template = self.templates.get(template_id) if template_id is not None else None
        return template if template is not None and template.enabled else None


# --- rows ↔ items ------------------------------------------------------------------------------


def _template_from_row(row: Mapping[Any, Any]) -> TemplateItem:
    data = {FIELD_OF.get(col, col): row[col] for col in row.keys()}  # noqa: SIM118
    data.pop("created_at", None)
    data.pop("updated_at", None)
    data["env"] = json.loads(data["env"] or "{}")
    return TemplateItem.model_validate(data, strict=False)


def _template_to_row(item: TemplateItem) -> dict[str, Any]:
    row = {COLUMN_OF.get(k, k): v for k, v in item.as_dict().items()}
    row["env"] = json.dumps(row["env"], sort_keys=True)  # strings and {"valueFrom": …} refs
    return row


# --- reads -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    """What a scope resolves to: the template, and the rule that chose it."""

    template: TemplateItem
    rule: RoutingRuleItem


def match(conn: Connection, group_id: str, bot_id: str) -> Match | None:
    """Resolve one scope with one query: the up-to-4 candidate rules joined with templates."""
    t, r = service_config_template, routing_rule
    rows = (
        conn.execute(
            select(r.c.group_id, r.c.bot_id, r.c.pod_budget, t)
            .select_from(r.join(t, r.c.template_id == t.c.template_id, isouter=True))
            .where(r.c.group_id.in_((group_id, WILDCARD)), r.c.bot_id.in_((bot_id, WILDCARD)))
        )
        .mappings()
        .all()
    )
    row = best_rule({(row["group_id"], row["bot_id"]): row for row in rows}, group_id, bot_id)
    if row is None or row["template_id"] is None:  # no rule, or it names a missing template
        return None
    template = _template_from_row({k: row[k] for k in t.c.keys()})  # noqa: SIM118
    if not template.enabled:
        return None
    rule = RoutingRuleItem(
        group_id=row["group_id"],
        bot_id=row["bot_id"],
        template_id=template.template_id,
        pod_budget=row["pod_budget"],
    )
    return Match(template, rule)


def load_snapshot(conn: Connection) -> Snapshot:
    snap = Snapshot()
    for row in conn.execute(select(service_config_template)).mappings():
        item = _template_from_row(row)
        snap.templates[item.template_id] = item
    r = routing_rule
    for g, b, tid, budget in conn.execute(
        select(r.c.group_id, r.c.bot_id, r.c.template_id, r.c.pod_budget)
    ):
        snap.rules[(g, b)] = tid
        snap.pod_budgets[(g, b)] = budget
    return snap


def get_template(conn: Connection, template_id: str) -> TemplateItem | None:
    row = (
        conn.execute(
            select(service_config_template).where(
                service_config_template.c.template_id == template_id
            )
        )
        .mappings()
        .first()
    )
    return _template_from_row(row) if row is not None else None


def get_rule(conn: Connection, group_id: str, bot_id: str) -> RoutingRuleItem | None:
    r = routing_rule
    row = conn.execute(
        select(r.c.group_id, r.c.bot_id, r.c.template_id, r.c.pod_budget).where(
            and_(r.c.group_id == group_id, r.c.bot_id == bot_id)
        )
    ).first()
    if row is None:
        return None
    return RoutingRuleItem(group_id=row[0], bot_id=row[1], template_id=row[2], pod_budget=row[3])


def count_rows(conn: Connection) -> tuple[int, int]:
    templates = conn.execute(select(func.count()).select_from(service_config_template)).scalar_one()
    rules = conn.execute(select(func.count()).select_from(routing_rule)).scalar_one()
    return int(templates), int(rules)


# --- writes (each inside the caller's transaction) ---------------------------------------------


def put_template(conn: Connection, item: TemplateItem, *, exists: bool) -> None:
    row = _template_to_row(item)
    t = service_config_template
    if exists:
        row.pop("template_id")
        where = t.c.template_id == item.template_id
        conn.execute(update(t).where(where).values(**row, updated_at=func.now()))
    else:
        _insert(conn, insert(t).values(**row), f"template {item.template_id!r} already exists")


def delete_template(conn: Connection, template_id: str) -> None:
    t = service_config_template
    conn.execute(delete(t).where(t.c.template_id == template_id))


def put_rule(conn: Connection, item: RoutingRuleItem, *, exists: bool) -> None:
    r = routing_rule
    if exists:
        conn.execute(
            update(r)
            .where(and_(r.c.group_id == item.group_id, r.c.bot_id == item.bot_id))
            .values(template_id=item.template_id, pod_budget=item.pod_budget, updated_at=func.now())
        )
    else:
        _insert(
            conn,
            insert(r).values(
                group_id=item.group_id,
                bot_id=item.bot_id,
                template_id=item.template_id,
                pod_budget=item.pod_budget,
            ),
            f"routing rule ({item.group_id!r}, {item.bot_id!r}) already exists",
        )


def delete_rule(conn: Connection, group_id: str, bot_id: str) -> None:
    r = routing_rule
    conn.execute(delete(r).where(and_(r.c.group_id == group_id, r.c.bot_id == bot_id)))


def _insert(conn: Connection, stmt: Any, conflict_message: str) -> None:
    # The config lock serialises writers; this only fires if a row appeared behind its back.
    try:
        with conn.begin_nested():
            conn.execute(stmt)
    except IntegrityError:
        raise Conflict(conflict_message) from None
