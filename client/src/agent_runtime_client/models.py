"""The typed results of the gateway's calls (docs/reference/api.md, route and touch)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Placement(StrEnum):
    """How a route placed its session."""

    REFRESH = "refresh"  # bound to a pod that is still registered: only its expiry moved
    PLACED = "placed"  # it had no binding: bound to a pod now
    REBOUND = "rebound"  # its pod died or was removed: bound to a new one, restore the context


@dataclass(frozen=True, slots=True)
class Route:
    """Which pod serves the session, and where the gateway opens its stream."""

    pod_id: str
    pod_sse_url: str
    placement: Placement
    previous_pod_id: str | None  # only with REBOUND: the pod the session was on
    request_id: str  # the id every attempt of this call carried


@dataclass(frozen=True, slots=True)
class Ended:
    """What an end (touch with ``eos``) did."""

    touched: bool  # the session was alive
    released: bool  # it ended now: its slot is free and a waiter is woken
