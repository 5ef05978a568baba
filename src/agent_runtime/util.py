"""Small pure helpers shared by both modules."""

from __future__ import annotations

import hashlib
import math


def scope_id_of(group_id: str, bot_id: str) -> str:
    """``md5(group_id + "\\x00" + bot_id)``: the NUL keeps ("ab", "c") apart from ("a", "bc")."""
    return hashlib.md5(f"{group_id}\x00{bot_id}".encode()).hexdigest()


def rule_id_of(group_id: str, bot_id: str) -> str:
    """A routing rule's id in Redis keys: the same hash over its own fields (``*`` included),
    so any id a rule may hold gives a short, key-safe name."""
    return scope_id_of(group_id, bot_id)


def max_pods(scope_concurrency: int, pod_concurrency: int) -> int:
    """Derived, never stored as configuration: enough pods for a full scope."""
    return math.ceil(scope_concurrency / pod_concurrency)
