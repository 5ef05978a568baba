"""What the session manager's state calls answer: small typed values.

Each script reply is decoded once, where the script is called (``state.py``,
``scope_state.py``; its layout is in the script's header); callers read these by name, never
a reply by position.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, NamedTuple


class Placement(StrEnum):
    """What ``route_place`` decided (route_place.lua's first reply element)."""

    REPLAY = "replay"  # this request was answered already: the first answer again
    IN_FLIGHT = "in_flight"  # another call of this request is running: wait for its answer
    REUSED = "reused"  # the request_id belongs to another request: nothing done
    REFRESH = "refresh"  # binding kept, expiry extended
    PLACED = "placed"  # a new binding
    REBOUND = "rebound"  # a new binding after its pod died or left
    NEED_CONFIG = "need_config"  # no policy cached (the request is marked pending)
    NEED_ACQUIRE = "need_acquire"  # no room, the scope may grow: a slot of it is reserved
    SCOPE_FULL = "scope_full"  # no room: wait (on the reservation, or in the queue)


# the decisions that bind the session to a pod (the answer names it)
PLACING = frozenset({Placement.REFRESH, Placement.PLACED, Placement.REBOUND})


@dataclass(frozen=True, slots=True)
class RoutePlacement:
    """One ``route_place`` reply."""

    action: Placement
    pod_id: str = ""  # PLACING: the pod
    pod_sse_url: str = ""  # PLACING
    previous_pod_id: str = ""  # REBOUND: the pod that left
    reserved: bool = False  # SCOPE_FULL: the request still holds a reservation (wait on it)
    # PLACING: seconds to (re)write the session-scope index with (0: not due)
    index_ttl: int = 0
    # PLACING: the scope's earliest expiry moved to this (mark expiry_due); NEED_ACQUIRE: the
    # reservation's deadline (mark leased_scopes); None: nothing to mark
    due: float | None = None
    # REPLAY: the first answer as the gateway got it (the request's binding taken out)
    replayed: Mapping[str, Any] | None = None

    @property
    def answered(self) -> bool:
        """The route is done: a pod to answer with, or the first answer again."""
        return self.action in PLACING or self.action is Placement.REPLAY

    def answer(self) -> dict[str, Any]:
        """``{pod_id, pod_sse_url, placement[, previous_pod_id]}`` (only when ``answered``)."""
        if self.replayed is not None:
            return dict(self.replayed)
        answer: dict[str, Any] = {
            "pod_id": self.pod_id,
            "pod_sse_url": self.pod_sse_url,
            "placement": self.action.value,
        }
        if self.action is Placement.REBOUND:
            answer["previous_pod_id"] = self.previous_pod_id
        return answer


class TouchOutcome(NamedTuple):
    """A touch that did something (``None`` instead: an eos whose request_id ended another
    session)."""

    touched: bool  # the session was alive (eos: it was, and is now ended)
    released: bool  # eos: its slot was given back


class Eviction(NamedTuple):
    """Where an evicted session was."""

    scope_id: str
    pod_id: str
    sessions_left: int  # on that pod


class PodCleanup(IntEnum):
    """What ``cleanup_pod`` did with one registration of a pod."""

    SESSIONS_REMAIN = -1  # out of the candidates; evict its sessions, then call again
    NOT_REGISTERED = 0
    CLEANED = 1


class PodRef(NamedTuple):
    """A registered pod of a scope (a member of ``pods:{sid}:registered``)."""

    scope_id: str
    pod_id: str


class SeatsPruned(NamedTuple):
    seats: int  # queue seats past their lease
    reservations: int  # reservations past their lease


class ScopeExpired(NamedTuple):
    """One ``evict_expired`` slice of a scope."""

    evicted: list[str]  # the session ids evicted
    next_due: float | None  # the scope's earliest expiry left (None: no session left)


class IdleMarkPage(NamedTuple):
    """One ``scope_idle_mark`` page of the registry."""

    cursor: str  # where the next page starts; "0": the walk is done
    marked: int  # scopes seen empty
