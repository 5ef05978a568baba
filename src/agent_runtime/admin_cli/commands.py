"""What each ``agent-runtime admin`` command asks the service and shows: a ``Shown`` (the
answer's ``data`` for ``--json``, a table or key/value block for people, notes for stderr).
The arguments and the run are ``program.py``'s.

A command reads only what the admin API documents (docs/reference/api.md); a success whose
``data`` lacks a field it reads is ``UnexpectedAnswer`` (another version of the service), not
a traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_runtime.admin_cli import output
from agent_runtime.admin_cli.client import AdminClient, path_id

MAX_PAGE = 200  # the admin API's largest page (scopes, drains)
WALK_MAX_SCOPES = 10_000  # ``scopes`` without --limit/--cursor stops after this many
WALK_MAX_PAGES = 1_000  # and after this many pages (an HSCAN page may come back empty)
MAX_DRAIN_SECONDS = 86_400  # the drain API's bound
DETAIL_LIST_MAX = 100  # a scope's view lists its first 100 waiters and reservations


@dataclass(frozen=True, slots=True)
class Shown:
    """A command's outcome: ``data`` for ``--json``, ``text`` for people (stdout), ``notes``
    for people too but on stderr (nothing found, more pages), so a table pipes cleanly."""

    data: Any
    text: str
    notes: tuple[str, ...] = field(default=())


Command = Callable[[AdminClient, argparse.Namespace, float], Shown]


class UnexpectedAnswer(Exception):
    """A success whose ``data`` lacks what the command reads (another version's API)."""


def _read(data: Any, *keys: str) -> Any:
    """``data[k1][k2]…``, or ``UnexpectedAnswer`` naming the missing field."""
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            raise UnexpectedAnswer(f"no field {'.'.join(keys)!r}")
        data = data[key]
    return data


def _list(data: Any, *keys: str) -> list[dict[str, Any]]:
    items = _read(data, *keys)
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise UnexpectedAnswer(f"{'.'.join(keys)!r} is not a list of objects")
    return items


# --- the commands ------------------------------------------------------------------------------


def scopes(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    if args.limit is not None or args.cursor is not None:  # one page, as the API gives it
        params = {
            k: v for k, v in (("limit", args.limit), ("cursor", args.cursor)) if v is not None
        }
        data = client.get("/admin/scopes", params)
        found, cursor = _list(data, "scopes"), _read(data, "next_cursor")
    else:  # every page, as kubectl lists in chunks; a scope seen twice (HSCAN may) once
        seen: dict[str, dict[str, Any]] = {}
        cursor = 0
        for _ in range(WALK_MAX_PAGES):
            page = client.get("/admin/scopes", {"cursor": cursor, "limit": MAX_PAGE})
            for entry in _list(page, "scopes"):
                seen.setdefault(str(_read(entry, "scope_id")), entry)
            cursor = _read(page, "next_cursor")
            if cursor == 0 or len(seen) >= WALK_MAX_SCOPES:
                break
        found = list(seen.values())
        data = {"scopes": found, "next_cursor": cursor}
    notes = [] if found else ["No scopes found."]
    if cursor:
        notes.append(f"More scopes: --cursor {cursor}")
    order = sorted(found, key=lambda s: (str(s.get("group_id")), str(s.get("bot_id"))))
    rows = [_scope_row(entry) for entry in order]
    headers = ["scope", "group", "bot", "template", "sessions", "waiters"]
    headers += ["in-use", "idle", "deploying", "retiring"]
    return Shown(data, output.table(headers, rows) if rows else "", tuple(notes))


def _scope_row(scope: dict[str, Any]) -> list[Any]:
    pods = scope["pods"]
    template = (scope.get("config") or {}).get("template_id")
    return [
        scope["scope_id"], scope["group_id"], scope["bot_id"], template, scope["live_sessions"],
        scope["waiters"], pods["in_use"], pods["idle"], pods["deploying"], pods["retiring"],
    ]  # fmt: skip


POLICY_FIELDS = (
    "pod_concurrency", "scope_concurrency", "max_pods", "min_idle_pods", "warm_pool",
    "session_ttl", "pod_ttl", "rule_pod_budget",
)  # fmt: skip


def _first_hundred(items: Any) -> str:
    """A count of a list the view cuts at its first 100 (waiters, reservations)."""
    count = len(items) if isinstance(items, list) else 0
    return "100 or more" if count >= DETAIL_LIST_MAX else str(count)


def scope(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    data = client.get(f"/admin/scopes/{path_id(args.scope_id)}")
    config = _read(data, "config") or {}
    pool = _read(data, "pool")
    policy = " ".join(f"{f}={config[f]}" for f in POLICY_FIELDS if f in config)
    leader = pool.get("deploy_leader")
    pairs = [
        ("Scope", data.get("scope_id")),
        ("Group", config.get("group_id")),
        ("Bot", config.get("bot_id")),
        ("Template", config.get("template_id")),
        ("Deploy version", config.get("deploy_ver")),
        ("Policy", policy or None),
        ("Live sessions", data.get("live_sessions")),
        ("Waiting routes", _first_hundred(data.get("waiters"))),
        ("Reserved", _first_hundred(data.get("reserved"))),
        ("Candidate pods", data.get("candidate_pods")),
        ("Deploys", f"{pool.get('deploys_in_flight', 0)} in flight, "
                    f"{pool.get('followers', 0)} followers, leader {output.cell(leader)}"),
    ]  # fmt: skip
    placed = {p["pod_id"]: p for p in _list(data, "pods")}
    pooled = {p["pod_id"]: p for p in _list(pool, "pods")}
    rows = []
    for pod_id in [*placed, *(p for p in pooled if p not in placed)]:
        session_side, resource_side = placed.get(pod_id, {}), pooled.get(pod_id, {})
        rows.append([
            pod_id, session_side.get("candidate", False), session_side.get("sessions", 0),
            resource_side.get("phase"), resource_side.get("deploy_ver"),
            resource_side.get("pod_ip"),
        ])  # fmt: skip
    text = output.block(pairs)
    if rows:
        pods = output.table(["pod", "candidate", "sessions", "phase", "deploy-ver", "ip"], rows)
        text += "\n\nPods:\n" + "\n".join(f"  {line}" for line in pods.splitlines())
    else:
        text += "\n\nPods:  " + output.NONE
    return Shown(data, text)


POD_RECORD_SHOWN = frozenset(
    ("scope_id", "namespace", "cluster", "phase", "pod_ip", "pod_sse_url", "deploy_ver")
) | {"created_ts"}


def pod(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    data = client.get(f"/admin/pods/{path_id(args.pod_id)}")
    info = _read(data, "info") or {}
    pairs: list[tuple[str, Any]] = [
        ("Pod", data.get("pod_id")),
        ("Owned", data.get("owned")),
        ("Scope", info.get("scope_id")),
        ("Namespace", info.get("namespace")),
        ("Cluster", info.get("cluster") or ("<default>" if info else None)),
        ("Phase", info.get("phase")),
        ("IP", info.get("pod_ip")),
        ("SSE URL", info.get("pod_sse_url")),
        ("Deploy version", info.get("deploy_ver")),
        ("Created", output.moment(info["created_ts"], now) if "created_ts" in info else None),
    ]
    for registration in _list(data, "scopes"):
        pairs.append(
            (
                "Sessions",
                f"{output.cell(registration.get('sessions'))} in scope "
                f"{output.cell(registration.get('scope_id'))} "
                f"(candidate: {output.cell(registration.get('candidate'))})",
            )
        )
    drain = data.get("drain")
    if isinstance(drain, dict):
        pairs.append(
            (
                "Drain",
                f"{output.cell(drain.get('state'))} ({output.cell(drain.get('trigger'))}), "
                f"deadline {output.moment(drain.get('deadline'), now)}",
            )
        )
    for report in data.get("foreign") or []:
        pairs.append(("Foreign", f"{output.cell(report.get('reason'))}"))
    others = {k: v for k, v in info.items() if k not in POD_RECORD_SHOWN}
    if others:  # a field this version does not name: shown as the record holds it
        pairs.append(("Other fields", others))
    return Shown(data, output.block(pairs))


def session(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    params = {"scope_id": args.scope_id} if args.scope_id else None
    data = client.get(f"/admin/sessions/{path_id(args.session_id)}", params)
    binding = _read(data, "binding")
    pairs: list[tuple[str, Any]] = [("Session", data.get("session_id"))]
    if isinstance(binding, dict):
        ttl = binding.get("session_ttl")
        pairs += [
            ("Scope", binding.get("scope_id")),
            ("Pod", binding.get("pod_id")),
            ("Expires", output.moment(binding.get("expiry"), now)),
            ("Session TTL", f"{ttl}s" if ttl is not None else None),
        ]
    else:
        pairs.append(("Binding", None))
    pairs.append(("Previous pod", data.get("previous_pod_id")))
    return Shown(data, output.block(pairs))


def foreign_pods(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    data = client.get("/admin/foreign_pods")
    pods = _list(data, "pods")
    rows = [
        [p.get("cluster") or "<default>", p.get("namespace"), p.get("pod_id"), p.get("scope_id"),
         p.get("phase"), p.get("image"), p.get("reason")]
        for p in pods
    ]  # fmt: skip
    headers = ["cluster", "namespace", "pod", "scope", "phase", "image", "reason"]
    return _counted(
        data, headers, rows,
        empty="No foreign pods found (as of reconcile's last pass).",
        more="Reconcile saw {count} foreign pods; {shown} shown.",
    )  # fmt: skip


def drains(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    data = client.get("/admin/drains", {"limit": args.limit})
    pods = _list(data, "pods")
    rows = [
        [p.get("pod_id"), p.get("scope_id"), p.get("state"), p.get("trigger"),
         output.span(p.get("deadline_in")), p.get("sessions"), output.age(p.get("since"), now)]
        for p in pods
    ]  # fmt: skip
    headers = ["pod", "scope", "state", "trigger", "deadline-in", "sessions", "age"]
    return _counted(
        data, headers, rows,
        empty="No pods under a drain.",
        more="{count} pods under a drain; {shown} shown (--limit).",
    )  # fmt: skip


def _counted(
    data: Any, headers: list[str], rows: list[list[Any]], *, empty: str, more: str
) -> Shown:
    """A list the API answers with its full ``count`` beside the first pods: a table, and a
    note when it is empty or when the count says more than the list holds."""
    notes = [] if rows else [empty]
    count = _read(data, "count")
    if isinstance(count, int) and count > len(rows):
        notes.append(more.format(count=count, shown=len(rows)))
    return Shown(data, output.table(headers, rows) if rows else "", tuple(notes))


def drain(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    body = None if args.seconds is None else {"deadline_seconds": args.seconds}
    data = client.post(f"/admin/{args.kind}s/{path_id(args.name)}/drain", body)
    pods = [data] if args.kind == "pod" else _list(data, "pods")
    lines = [_drained(p) for p in pods]
    if args.kind == "node" and not pods:
        lines = [f"node/{output.printable(args.name)}: no pod of ours on it"]
    return Shown(data, "\n".join(lines))


def _drained(pod: dict[str, Any]) -> str:
    kept = "" if pod.get("started") else " (a drain was under way: kept)"
    return (
        f"pod/{output.cell(pod.get('pod_id'))} {output.cell(pod.get('state'))}: deadline in "
        f"{output.span(pod.get('deadline_in'))}, sessions left: {output.cell(pod.get('sessions'))}"
        f"{kept}"
    )


def cleanup(client: AdminClient, args: argparse.Namespace, now: float) -> Shown:
    rawdata: dict[str, Any] = {"dry_run": bool(args.dry_run)}
    if args.namespace:
        rawdata["namespace"] = args.namespace
    if args.selector:
        rawdata["label_selector"] = args.selector
    data = client.call("/cleanup", rawdata)
    if not args.dry_run:
        return Shown(data, f"cleaned {output.cell(_read(data, 'cleaned'))}")
    pods = _list(data, "pods")
    rows = [
        [p.get("namespace"), p.get("pod_id"), p.get("scope_id"), p.get("phase"), p.get("ready"),
         p.get("node"), output.age(p.get("created"), now)]
        for p in pods
    ]  # fmt: skip
    matched = _read(data, "matched")
    pods_word = "pod" if matched == 1 else "pods"
    notes = [f"{matched} {pods_word} would be deleted (dry run: none was)."]
    if _read(data, "truncated"):
        notes.append(f"The first {len(pods)} by name are shown.")
    headers = ["namespace", "pod", "scope", "phase", "ready", "node", "age"]
    return Shown(data, output.table(headers, rows) if rows else "", tuple(notes))
