"""Fault injection: rules that make the simulated cluster misbehave on purpose.

A rule has a ``kind``, optional matchers (``namespace``, ``name`` as a glob, ``labels`` as a
label selector) and optional dosing: ``count`` (fires that many times, then is gone) and
``ratio`` (fires for that share of matching events, drawn from the simulator's seeded random).
Without either it fires every time until removed.

Kinds and when they are looked at:

==================== ===========================================================================
``image_pull``       pod start: the image never pulls (ErrImagePull, then ImagePullBackOff)
``crash_loop``       pod start: the container exits at once (CrashLoopBackOff)
``never_ready``      pod start: ``mode`` ``running`` (Running, never Ready) or ``pending``
                     (stays Pending: Unschedulable)
``health``           each ``GET /health`` of an AgentServer: ``mode`` ``500`` or ``hang``
``api_error``        each API request of ``verb`` on ``resource``: answers ``status``
                     (429 carries ``Retry-After: retry_after``) instead of doing it
``latency``          each API request of ``verb`` on ``resource``: waits ``seconds`` first
                     (``events`` requests only by a rule that names ``resource: events``:
                     a ``*`` rule aimed at pods never lands on a background event write)
``reply_lost``       a ``create`` / ``delete`` / ``patch`` that was applied: ``mode``
                     ``drop`` (the connection closes without an answer) or ``500``
``continue_expired`` each LIST page asked with a continue token: the token has expired
                     (410 Expired, as after etcd compacted its revision)
``namespace_missing``   the namespace does not exist (until the rule is removed)
``namespace_forbidden`` every request in the namespace is 403 Forbidden
==================== ===========================================================================
"""

from __future__ import annotations

import fnmatch
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from kubesim.labels import Selector, SelectorError, parse_selector

POD_KINDS = ("image_pull", "crash_loop", "never_ready")
API_KINDS = ("api_error", "latency", "reply_lost", "continue_expired")
NAMESPACE_KINDS = ("namespace_missing", "namespace_forbidden")
KINDS = (*POD_KINDS, "health", *API_KINDS, *NAMESPACE_KINDS)
VERBS = ("create", "get", "list", "watch", "delete", "patch", "*")
RESOURCES = ("pods", "namespaces", "nodes", "events", "*")

_COMMON = ("kind", "namespace", "name", "labels", "count", "ratio")
_PARAMS: dict[str, dict[str, Any]] = {
    "image_pull": {"reason": "ErrImagePull"},
    "crash_loop": {"exit_code": 1},
    "never_ready": {"mode": "running"},
    "health": {"mode": "500"},
    "api_error": {"status": 500, "verb": "*", "resource": "pods", "retry_after": 1},
    "latency": {"seconds": 0.5, "verb": "*", "resource": "*"},
    "reply_lost": {"mode": "drop", "verb": "create"},
    "continue_expired": {},
    "namespace_missing": {},
    "namespace_forbidden": {},
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "never_ready.mode": ("running", "pending"),
    "health.mode": ("500", "hang"),
    "reply_lost.mode": ("drop", "500"),
    "reply_lost.verb": ("create", "delete", "patch"),
    "api_error.verb": VERBS,
    "api_error.resource": RESOURCES,
    "latency.verb": VERBS,
    "latency.resource": RESOURCES,
    "image_pull.reason": ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"),
}


@dataclass
class Fault:
    id: int
    kind: str
    params: dict[str, Any]
    namespace: str | None = None
    name: str | None = None
    labels: str | None = None
    count: int | None = None  # fires left; None: unlimited
    ratio: float | None = None
    hits: int = 0
    _selector: Selector = field(default_factory=Selector, repr=False)

    def matches(
        self, namespace: str | None, name: str | None, labels: dict[str, str] | None
    ) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        if self.name is not None and (name is None or not fnmatch.fnmatchcase(name, self.name)):
            return False
        return self.labels is None or (labels is not None and self._selector.matches(labels))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, **self.params, "hits": self.hits}
        for key in ("namespace", "name", "labels", "count", "ratio"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class Faults:
    """The simulator's fault rules. Use ``add`` from tests, or ``POST /_sim/faults``."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._rules: dict[int, Fault] = {}
        self._ids = itertools.count(1)

    def add(self, kind: str, **fields: Any) -> Fault:
        """A new rule; ``ValueError`` names a bad kind, field or value."""
        fault = self._build({"kind": kind, **fields})
        self._rules[fault.id] = fault
        return fault

    def add_json(self, body: Any) -> Fault:
        if not isinstance(body, dict):
            raise ValueError("a fault is a JSON object")
        if "kind" not in body:
            raise ValueError(f"kind is required (one of {', '.join(KINDS)})")
        return self.add(**body)

    def remove(self, fault_id: int) -> bool:
        return self._rules.pop(fault_id, None) is not None

    def clear(self) -> None:
        self._rules.clear()

    def rules(self) -> list[Fault]:
        return list(self._rules.values())

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self._rules.values()]

    # --- lookups ----------------------------------------------------------------------------

    def take(
        self,
        kind: str,
        *,
        namespace: str | None = None,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        verb: str | None = None,
        resource: str | None = None,
        exact: bool = False,
    ) -> Fault | None:
        """The first rule of ``kind`` that matches and fires now (its count is used up).
        ``exact``: only a rule that names ``resource`` itself (not ``*``) matches."""
        for fault in list(self._rules.values()):
            if fault.kind != kind or not fault.matches(namespace, name, labels):
                continue
            if verb is not None and fault.params.get("verb") not in ("*", verb):
                continue
            named = fault.params.get("resource", "*")
            if resource is not None and named != resource and (exact or named != "*"):
                continue
            if fault.ratio is not None and self._rng.random() >= fault.ratio:
                continue
            fault.hits += 1
            if fault.count is not None:
                fault.count -= 1
                if fault.count <= 0:
                    del self._rules[fault.id]
            return fault
        return None

    def active(
        self, kind: str, *, namespace: str, name: str, labels: dict[str, str] | None
    ) -> Fault | None:
        """A matching rule of ``kind``, without firing it (readiness looks, never doses)."""
        return next(
            (
                f
                for f in self._rules.values()
                if f.kind == kind and f.matches(namespace, name, labels)
            ),
            None,
        )

    def namespace_state(self, namespace: str) -> str | None:
        """``"forbidden"``, ``"missing"`` or None (forbidden wins: RBAC is checked first)."""
        states = {f.kind for f in self._rules.values() if f.namespace == namespace}
        if "namespace_forbidden" in states:
            return "forbidden"
        if "namespace_missing" in states:
            return "missing"
        return None

    # --- validation -------------------------------------------------------------------------

    def _build(self, body: dict[str, Any]) -> Fault:
        kind = body["kind"]
        if kind not in _PARAMS:
            raise ValueError(f"unknown fault kind {kind!r} (one of {', '.join(KINDS)})")
        defaults = _PARAMS[kind]
        unknown = set(body) - set(_COMMON) - set(defaults)
        if unknown:
            raise ValueError(f"{kind}: unknown field(s) {', '.join(sorted(unknown))}")
        params = {key: body.get(key, default) for key, default in defaults.items()}
        for key, value in params.items():
            choices = _CHOICES.get(f"{kind}.{key}")
            if choices is not None:
                value = str(value)
                params[key] = value
                if value not in choices:
                    raise ValueError(f"{kind}.{key} must be one of {', '.join(choices)}")
        if kind == "api_error":
            params["status"] = _int(params["status"], "api_error.status", 400, 599)
            params["retry_after"] = _int(params["retry_after"], "api_error.retry_after", 0, 3600)
        if kind == "latency":
            params["seconds"] = _number(params["seconds"], "latency.seconds", 0.0, 600.0)
        if kind == "crash_loop":
            params["exit_code"] = _int(params["exit_code"], "crash_loop.exit_code", 1, 255)
        namespace = _optional_str(body.get("namespace"), "namespace")
        if kind in NAMESPACE_KINDS:
            if namespace is None:
                raise ValueError(f"{kind} needs a namespace")
            if any(body.get(k) is not None for k in ("name", "labels", "count", "ratio")):
                raise ValueError(f"{kind} takes only a namespace")
        labels = _optional_str(body.get("labels"), "labels")
        selector = Selector()
        if labels is not None:
            try:
                selector = parse_selector(labels)
            except SelectorError as exc:
                raise ValueError(f"labels: {exc}") from None
        count = body.get("count")
        if count is not None:
            count = _int(count, "count", 1, 1_000_000)
        ratio = body.get("ratio")
        if ratio is not None:
            ratio = _number(ratio, "ratio", 0.0, 1.0)
            if ratio <= 0:
                raise ValueError("ratio must be above 0")
        return Fault(
            id=next(self._ids),
            kind=kind,
            params=params,
            namespace=namespace,
            name=_optional_str(body.get("name"), "name"),
            labels=labels,
            count=count,
            ratio=ratio,
            _selector=selector,
        )


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} must be an integer")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{what} must be an integer") from None
    if not low <= number <= high:
        raise ValueError(f"{what} must be in {low}..{high}")
    return number


def _number(value: Any, what: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{what} must be a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{what} must be a number") from None
    if not low <= number <= high:  # also refuses NaN
        raise ValueError(f"{what} must be in {low:g}..{high:g}")
    return number


def _optional_str(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    return value
