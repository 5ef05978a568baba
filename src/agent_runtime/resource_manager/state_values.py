"""The typed values the state modules give: every script reply and every hash they read is
decoded once, where it is read (``state.py``, ``deploy_state.py``, ``pool_scan.py``), into one
of these. No caller sees a raw reply, decodes one by position, or names a hash field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from agent_runtime.resource_manager.models import AcquiredPod

# --- the pools (state.py) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AcquireOutcome:
    """What the ``acquire`` script decided."""

    action: Literal[
        "cached", "reuse", "no_config", "max_reached", "budget_reached", "need_deploy", "cold"
    ]
    pod_id: str | None = None
    pod_sse_url: str | None = None
    deploy_ver: str | None = None
    placeholder: str | None = None
    budget: str | None = None  # budget_reached: "global" or "rule"

    @property
    def pod(self) -> AcquiredPod | None:
        """The pod of a ``cached`` or ``reuse`` outcome."""
        if self.pod_id is None or self.pod_sse_url is None:
            return None
        return AcquiredPod(self.pod_id, self.pod_sse_url, self.deploy_ver or "")


@dataclass(frozen=True, slots=True)
class AdoptOutcome:
    """What the ``adopt`` script decided."""

    action: Literal["adopted", "known", "old_version", "max_reached", "budget_reached"]
    detail: str | None = None  # adopted: configured | unconfigured; budget_reached: which

    @property
    def kept(self) -> bool:
        """The pod is registered now (adopted, or already was)."""
        return self.action in ("adopted", "known")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A scope's pool config hash."""

    min_idle_pods: int
    max_pods: int
    pod_ttl: int
    pod_concurrency: int
    deploy_ver: str | None
    pod_spec: dict[str, Any] | None
    budget_rule: str = ""  # the rule whose pod budget the scope's pods count against
    warm_pool: str = "static"  # the template's warm_pool (warm_policy.py)


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A registered pod's info hash (register.lua, adopt.lua)."""

    scope_id: str
    pod_sse_url: str
    pod_ip: str
    namespace: str | None  # None: an info without one (the default namespace)
    phase: str  # in_use | idle
    deploy_ver: str
    cluster: str | None  # None: the process default (the field absent, as before clusters)


# --- deploys: placeholders, leases, follower seats (deploy_state.py) ---------------------------


@dataclass(frozen=True, slots=True)
class OrphanPod:
    """A pod a deploy leader created under a lease that lapsed: inherited by the next leader."""

    pod_id: str
    namespace: str
    created: float  # Redis seconds
    uid: str  # the incarnation the leader created ("" from a record that names none)
    cluster: str | None = None  # where it was created (None: the process default)


@dataclass(frozen=True, slots=True)
class LeaseTake:
    """What ``deploy_lease_take`` decided."""

    leader: bool
    holder: str | None = None  # a follower: the live leader's token
    orphan: OrphanPod | None = None
    # when the live leader's acquire started (Redis seconds, from its token): every pod it
    # brings is registered at or after that; inf when unknown
    holder_started: float = math.inf


@dataclass(frozen=True, slots=True)
class DeployClaim:
    """What ``deploy_claim`` decided for a cold acquire: ``lead`` (a new deploy, or a lapsed
    one with its ``orphan`` pod; ``placeholder`` its slot), ``follow`` (seated in
    ``deploy_id``'s room, ``holder`` its leader's token), ``busy`` (the scope runs its deploy
    concurrency), ``coming`` (no room for a pod, but a deploy is in flight), ``max_reached``
    or ``budget_reached`` (``budget``: "global" or "rule"), with nothing on its way."""

    action: str
    deploy_id: str = ""
    holder: str | None = None
    orphan: OrphanPod | None = None
    placeholder: str | None = None
    budget: str | None = None
    coming: bool = False  # reserve: a placeholder is live (a refused unit means "coming")


@dataclass(frozen=True, slots=True)
class DeployView:
    """One cold deploy as its followers see it: the leader (its lock token), a failure notice,
    and the pod its leader recorded (registered once the deploy is done)."""

    leader: str | None
    failed: bool
    pod_id: str | None


@dataclass(frozen=True, slots=True)
class PlaceholderOutcome:
    """What the ``placeholder`` script decided: a member, or why not."""

    member: str | None
    refused: str | None = None  # no_config | max_reached | budget_reached
    budget: str | None = None  # budget_reached: "global" or "rule"


@dataclass(frozen=True, slots=True)
class LeaseRenewal:
    """What ``deploy_lease`` decided: the placeholder's new member, or why the claim is lost
    ("taken": another leader holds or held it; "no_room": nobody does, no slot for it)."""

    member: str | None
    lost: str | None = None


@dataclass(frozen=True, slots=True)
class LeasePrune:
    """What ``lease_prune`` dropped: expired follower seats and placeholders."""

    seats: int
    placeholders: int


# --- the jobs' reads and reconcile's repairs (pool_scan.py) ------------------------------------


@dataclass(frozen=True, slots=True)
class PodPlace:
    """Where a registered pod runs, from its info."""

    cluster: str | None  # None: the process default (the field absent or empty)
    namespace: str | None  # None: an info without one


@dataclass(frozen=True, slots=True)
class PodPhase:
    """A registered pod's phase and scope, from its info (None: the field is absent)."""

    phase: str | None
    scope_id: str | None


@dataclass(frozen=True, slots=True)
class InFlight:
    """A scope's live placeholders (deploys in flight): the warm pool's and the routes'."""

    warm: int
    cold: int

    @property
    def total(self) -> int:
        return self.warm + self.cold


@dataclass(frozen=True, slots=True)
class BudgetRepair:
    """Reconcile's repair of the pod budgets: units added and dropped."""

    added: int
    dropped: int


# --- drains (drain_state.py) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Drain:
    """One pod's drain (``pod:{pod}:drain``)."""

    pod_id: str
    scope_id: str
    state: Literal["pending", "draining"]  # pending: its replacement is being warmed first
    trigger: str  # admin | graceful_delete | cordon
    deadline: float  # Redis seconds: its sessions are rebound from then on, the pod deleted
    since: float


@dataclass(frozen=True, slots=True)
class DrainBegun:
    """What ``drain_begin`` did: ``started`` False when a drain was already under way (its
    deadline may have come forward)."""

    started: bool
    state: Literal["pending", "draining"]
    deadline: float
    trigger: str
