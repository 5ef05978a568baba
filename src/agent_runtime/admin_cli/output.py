"""What the admin CLI prints for people: aligned columns under upper-case headers (as
``kubectl get``), key/value blocks (as ``kubectl describe``), ages and time spans; and the
stable JSON it prints for scripts.

Every value the service sends is made printable before it reaches a terminal: control and
format characters (an escape sequence in a label, a name) are shown escaped, never sent.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

NONE = "<none>"
GAP = "   "  # between columns, as kubectl's


def as_json(data: Any) -> str:
    """Stable for scripts: keys sorted, two-space indent, ASCII only (escapes included)."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=True)


def cell(value: Any) -> str:
    """One value as a table cell or a block's value: None → ``<none>``, booleans lower case,
    whole floats without ``.0``, anything unprintable escaped."""
    if value is None or value == "":
        return NONE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)  # exact below 2**53; beyond it the float's own form is shorter
    return printable(str(value))


def printable(text: str) -> str:
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def _escaped(char: str) -> str:
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns as wide as their widest cell, ``GAP`` apart; the last one not padded."""
    lines = [[h.upper() for h in headers], *([cell(v) for v in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    out = []
    for line in lines:
        padded = [text.ljust(width) for text, width in zip(line[:-1], widths, strict=False)]
        out.append(GAP.join([*padded, line[-1]]).rstrip())
    return "\n".join(out)


def block(pairs: Sequence[tuple[str, Any]], indent: int = 0) -> str:
    """``Key:  value`` lines, the values aligned. A value that is a mapping is shown as a
    block of its own under its key, indented."""
    if not pairs:
        return ""
    width = max(len(key) for key, _ in pairs) + 2
    pad = " " * indent
    lines = []
    for key, value in pairs:
        if isinstance(value, Mapping):
            lines.append(f"{pad}{key}:")
            inner = block([(printable(str(k)), v) for k, v in sorted(value.items())], indent + 2)
            lines.append(inner if inner else f"{pad}  {NONE}")
        else:
            lines.append(f"{pad}{(key + ':').ljust(width)}{cell(value)}")
    return "\n".join(lines)


def span(seconds: float | None) -> str:
    """A duration as kubectl writes ages: ``45s``, ``3m20s``, ``25m``, ``5h10m``, ``3d4h``,
    ``12d``; None → ``<unknown>``."""
    if seconds is None or not math.isfinite(seconds):
        return "<unknown>"
    total = max(int(seconds), 0)
    minutes, hours, days = total // 60, total // 3600, total // 86400
    if total < 120:
        return f"{total}s"
    if minutes < 10:
        return f"{minutes}m{total % 60}s" if total % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    return f"{days}d"


def age(unix_seconds: float | None, now: float) -> str:
    """How long ago a Unix time was (``created``, ``since``)."""
    return "<unknown>" if unix_seconds is None else span(now - unix_seconds)


def moment(value: Any, now: float) -> str:
    """A Unix time (number or decimal string) as UTC and relative to ``now``:
    ``2026-12-04T08:39:01Z (in 58s)``, ``… (5m ago)``. Anything else: shown as it is."""
    try:
        when = float(value)
    except (TypeError, ValueError):
        return cell(value)
    if not math.isfinite(when):
        return cell(value)
    try:
        stamp = datetime.datetime.fromtimestamp(when, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return cell(value)
    text = stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
    relative = f"in {span(when - now)}" if when >= now else f"{span(now - when)} ago"
    return f"{text} ({relative})"
