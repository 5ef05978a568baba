"""The resolve cache: ``ScopeConfig``, a scope's resolved configuration, and its layout in
the ``scope:{sid}:config`` hash — the only place that names that hash's fields and how each is
encoded (the scripts read ``scope_concurrency``, ``pod_concurrency``, ``max_pods``,
``session_ttl`` and ``deploy_ver`` from it by these names). Owned by the state layer:
``ScopeState.get_scope_config`` hands out what ``from_hash`` reads, and what is written is
``to_hash``'s (config_store gives it to ``fill_scope_config`` / ``apply_scope``); the admin
view shows the hash as Redis holds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent_runtime.session_manager.items import TemplateItem


@dataclass(frozen=True, slots=True)
class ScopeConfig:
    """A scope's resolved configuration, as kept in the resolve cache ``scope:{sid}:config``."""

    scope_id: str
    group_id: str
    bot_id: str
    template_id: str
    scope_concurrency: int
    pod_concurrency: int
    max_pods: int
    session_ttl: int
    pod_ttl: int
    min_idle_pods: int
    deploy_ver: str
    pod_spec: dict[str, Any]
    # the scope → rule link: the rule it resolved through (md5 of its group_id NUL bot_id) and
    # that rule's pod budget (0 = unbounded); None = not known (a cache written by config_sync
    # or by a version without budgets: resolve reads the DB again)
    rule_id: str | None = None
    rule_pod_budget: int = 0
    warm_pool: str = "static"  # a cache written before the field: static

    @classmethod
    def of(
        cls,
        scope_id: str,
        group_id: str,
        bot_id: str,
        template: TemplateItem,
        *,
        rule_id: str | None = None,
        rule_pod_budget: int = 0,
    ) -> ScopeConfig:
        return cls(
            scope_id=scope_id,
            group_id=group_id,
            bot_id=bot_id,
            template_id=template.template_id,
            scope_concurrency=template.scope_concurrency,
            pod_concurrency=template.pod_concurrency,
            max_pods=template.max_pods,
            session_ttl=template.session_ttl,
            pod_ttl=template.pod_ttl,
            min_idle_pods=template.min_idle_pods,
            deploy_ver=template.deploy_ver(),
            pod_spec=template.pod_spec(),
            rule_id=rule_id,
            rule_pod_budget=rule_pod_budget,
            warm_pool=template.warm_pool,
        )

    def to_hash(self) -> dict[str, str]:
        rule = (
            {"rule_id": self.rule_id, "rule_pod_budget": str(self.rule_pod_budget)}
            if self.rule_id is not None
            else {}
        )
        return rule | {
            "group_id": self.group_id,
            "bot_id": self.bot_id,
            "template_id": self.template_id,
            "scope_concurrency": str(self.scope_concurrency),
            "pod_concurrency": str(self.pod_concurrency),
            "max_pods": str(self.max_pods),
            "session_ttl": str(self.session_ttl),
            "pod_ttl": str(self.pod_ttl),
            "min_idle_pods": str(self.min_idle_pods),
            "warm_pool": self.warm_pool,
            "deploy_ver": self.deploy_ver,
            "pod_spec_json": json.dumps(self.pod_spec, sort_keys=True, separators=(",", ":")),
        }

    @classmethod
    def from_hash(cls, scope_id: str, h: dict[str, str]) -> ScopeConfig:
        return cls(
            scope_id=scope_id,
            group_id=h["group_id"],
            bot_id=h["bot_id"],
            template_id=h["template_id"],
            scope_concurrency=int(h["scope_concurrency"]),
            pod_concurrency=int(h["pod_concurrency"]),
            max_pods=int(h["max_pods"]),
            session_ttl=int(h["session_ttl"]),
            pod_ttl=int(h["pod_ttl"]),
            min_idle_pods=int(h["min_idle_pods"]),
            deploy_ver=h["deploy_ver"],
            pod_spec=json.loads(h["pod_spec_json"]),
            rule_id=h.get("rule_id"),
            rule_pod_budget=int(h.get("rule_pod_budget") or 0),
            warm_pool=h.get("warm_pool") or "static",
        )

    def pool_config(self) -> dict[str, int | str]:
        return {
            "min_idle_pods": self.min_idle_pods,
            "max_pods": self.max_pods,
            "pod_ttl": self.pod_ttl,
            "pod_concurrency": self.pod_concurrency,
            "warm_pool": self.warm_pool,
        }
