"""Resource manager data: pod views, labels, the dead-pod rules (contract §5), the values its
facade gives (``AcquiredPod``, ``IdleTransition``, ``PoolConfigUpdate``), and its errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

COMPONENT_LABEL = "jiuwenclaw-component"
COMPONENT_VALUE = "agentserver"
APP_LABEL = "app"
SCOPE_LABEL = "agent-runtime/scope"
DEPLOY_VER_LABEL = "agent-runtime/deploy-ver"
COMPONENT_SELECTOR = f"{COMPONENT_LABEL}={COMPONENT_VALUE}"
# what cleanup may delete: AgentServers that carry our scope label (an existence term)
OWN_PODS_SELECTOR = f"{COMPONENT_SELECTOR},{SCOPE_LABEL}"

# Waiting reasons after which a container will not come up by itself.
DEAD_WAITING_REASONS = frozenset(
    {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName"}
)
# Normalised phases that mean dead (Pending is not: a deploy has its own ready_timeout).
DEAD_PHASES = frozenset({"Terminating", "Failed", "Succeeded", *DEAD_WAITING_REASONS})


@dataclass(frozen=True, slots=True)
class CleanupCandidate:
    """A pod a cleanup would delete, as its dry run shows it (Kubernetes' view, not Redis')."""

    pod_id: str
    namespace: str
    scope_id: str  # its scope label
    deploy_ver: str  # its deploy-ver label ("" when it has none)
    phase: str  # normalised, as ``PodStatus.phase``
    ready: bool
    node: str  # "" until scheduled
    created: float | None  # Unix seconds; None when Kubernetes did not say


@dataclass(frozen=True, slots=True)
class CleanupPreview:
    """A cleanup's dry run: how many pods the same call would delete, and the first of them
    by name (at most the preview's bound)."""

    matched: int
    pods: tuple[CleanupCandidate, ...]

    @property
    def truncated(self) -> bool:
        return self.matched > len(self.pods)


@dataclass(frozen=True, slots=True)
class PodDeployInfo:
    """A pod that a deploy brought to Ready."""

    pod_id: str
    namespace: str
    pod_ip: str
    pod_sse_url: str
    cluster: str | None = None  # where it runs (None: the process default)


@dataclass(frozen=True, slots=True)
class AcquiredPod:
    """A pod handed to a caller: by acquire (warm, deployed, followed or replayed), and to
    ``on_ready`` by a deploy leader before it lets go of the scope's deploy lock."""

    pod_id: str
    pod_sse_url: str
    deploy_ver: str = ""  # "" only in a replay of a result cached before versions were


@dataclass(frozen=True, slots=True)
class IdleTransition:
    """``idle_consider``: whether the pod went into the warm pool now (False: it already was,
    or it is not known)."""

    transitioned_to_idle: bool


@dataclass(frozen=True, slots=True)
class PoolConfigUpdate:
    """``update_pool_config``: False when a later config_sync already wrote the scope's pool
    config (overlapping propagations converge to the later one)."""

    updated: bool


# placeholders of the warm pool's own deploys (autoscale): their pods register as idle, so a
# caller never follows them; it waits and takes the pod from the warm pool (reconcile's
# adoptions take no placeholder: adopt.lua registers in one step)
WARM_TOKEN_PREFIX = "warm:"


@dataclass(frozen=True, slots=True)
class PodStatus:
    """Kubernetes' view of one pod, normalised.

    ``phase`` is the pod phase unless something says more: ``Terminating`` while a deletion
    timestamp is set, else a container's waiting reason (CrashLoopBackOff, …) wins over
    ``Running``/``Pending``.
    """

    pod_id: str
    namespace: str
    phase: str
    ready: bool
    pod_ip: str | None
    labels: dict[str, str] = field(default_factory=dict)
    # what ``identity.verify`` reads: the object's incarnation and our signed annotations
    uid: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    image: str = ""  # the first container's (reported for a foreign pod)
    # a graceful deletion began: when Kubernetes will kill the pod (Unix seconds, from
    # ``deletionTimestamp``); None when none began or its time cannot be read
    deletion_at: float | None = None
    node: str = ""  # spec.nodeName ("" until scheduled)
    # ``metadata.creationTimestamp`` (Unix seconds); None when absent or unreadable
    created: float | None = None

    @property
    def dead(self) -> bool:
        """Dead by its phase alone (a deploy's poll reads this: a pod being deleted will not
        serve it). Whether a pod of ours is dead, draining or alive in the watch is
        ``pod_reading.pod_condition``: a graceful deletion with time left is a drain."""
        return self.phase in DEAD_PHASES

    @property
    def scope_id(self) -> str | None:
        return self.labels.get(SCOPE_LABEL)

    @property
    def deploy_ver(self) -> str | None:
        return self.labels.get(DEPLOY_VER_LABEL)


@dataclass(frozen=True, slots=True)
class PodListing:
    """A LIST of pods and the ``resourceVersion`` of its snapshot: a watch from it sees every
    change after the LIST."""

    pods: list[PodStatus]
    resource_version: str


# watch event types (a Kubernetes watch's ``type``); BOOKMARK carries no pod
WATCH_EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})


@dataclass(frozen=True, slots=True)
class PodEvent:
    """One event of a pod watch: its type, the pod as it is now (as it was last, for DELETED;
    None for a BOOKMARK) and the ``resourceVersion`` to resume from after it."""

    kind: str
    pod: PodStatus | None
    resource_version: str


class PodVerdict(StrEnum):
    """What a reported pod was found to be (``ResourceManagerFacade.check_reported_pod``)."""

    HEALTHY = "healthy"  # its /health answered: untouched
    SUSPECT = "suspect"  # /health failed once, Kubernetes does not say dead: untouched yet
    DEAD = "dead"  # cleaned: its sessions were evicted (their next route is `rebound`)
    UNKNOWN = "unknown"  # not a pod the resource manager knows (already cleaned, or never)


def normalize_phase(
    phase: str | None, *, deleting: bool, waiting_reasons: list[str] | tuple[str, ...] = ()
) -> str:
    """The phase the dead/alive rules look at (see ``PodStatus``)."""
    if deleting:
        return "Terminating"
    for reason in waiting_reasons:
        if reason in DEAD_WAITING_REASONS:
            return reason
    return phase or "Unknown"


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """Kubernetes' view of one node: its name and whether it is cordoned."""

    name: str
    unschedulable: bool


@dataclass(frozen=True, slots=True)
class DeployBounds:
    """Where the operator lets templates deploy: the configured cluster names and the allowed
    namespaces. A stored template outside them (written before the bounds, or since narrowed)
    gets no pod; the reason given names no value of the template."""

    clusters: frozenset[str]
    namespaces: frozenset[str]

    def refusal(self, pod_spec: dict[str, Any], default_namespace: str) -> str | None:
        cluster = pod_spec.get("kubeconfig")
        if cluster is not None and cluster not in self.clusters:
            return "the template names a cluster this service does not configure"
        if (pod_spec.get("namespace") or default_namespace) not in self.namespaces:
            return "the template names a namespace this service may not deploy to"
        return None


class ResourceError(Exception):
    """Base of the resource manager's own failures (the session side maps them)."""


class MaxPodsReached(ResourceError):
    """No pod can be had now: the scope is at max_pods, or the follower room is full."""


class DeployInProgress(MaxPodsReached):
    """No pod now, but one is being deployed for the scope (its slots may be for us): the
    caller may wait for the registration instead of failing."""


class PodBudgetReached(ResourceError):
    """No new pod may be deployed: the installation's pod budget or the scope's rule's budget
    is used up (``budget``: "global" or "rule"). Not a MaxPodsReached: nothing is on its way,
    so the caller answers at once instead of waiting for a pod."""

    def __init__(self, message: str, *, budget: str) -> None:
        super().__init__(message)
        self.budget = budget


class DeployFailed(ResourceError):
    """A deploy did not give a Ready pod (timeout, image pull, crash loop, API refusal)."""


class PodGone(DeployFailed):
    """The pod waited for does not exist (any more): nothing is left to delete."""


class DeployTimedOut(ResourceError):
    """The caller's own deadline passed before a pod could be had (a deploy of the scope may
    still be on its way: its pod then serves later routes). ``waited``: seconds it waited."""

    def __init__(self, message: str, *, waited: float) -> None:
        super().__init__(message)
        self.waited = waited


class LeaseLost(ResourceError):
    """A deploy's lease lapsed and the deploy stops claiming; its caller acquires again.
    ``taken``: another leader took it over (with the pod, if one was created: it is theirs);
    else nobody holds it but the scope had no room for its placeholder again (a recorded pod
    is nobody's: its record stays, for the next taker or reconcile)."""

    def __init__(self, message: str, *, taken: bool = True) -> None:
        super().__init__(message)
        self.taken = taken


class K8sApiError(ResourceError):
    """Kubernetes refused an operator call; ``status`` is the HTTP status it answered."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
