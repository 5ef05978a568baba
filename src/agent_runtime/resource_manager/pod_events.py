"""``PodEvents``: every decision the resource manager takes about a pod, recorded as a
core/v1 Event on that pod, so ``kubectl describe pod`` tells an operator why it came or went.

The reasons are a fixed table (``REASONS``: reason → type and what it means; the reference
lists it). An event names the pod (kind Pod, apiVersion v1, namespace, name, uid: ``kubectl
describe pod`` selects by name, namespace and uid), its source (component ``agent-runtime``,
host: the replica's instance id; the same as ``reportingComponent`` / ``reportingInstance``),
``firstTimestamp`` / ``lastTimestamp`` / ``count``, and goes to the cluster the pod runs in.

Hazard: recording must never slow or fail a decision. ``record`` is synchronous and never
raises: it correlates the occurrence as client-go's recorder does (``pod_event_correlator.py``:
aggregated, counted up by PATCH, rate-limited per pod: what the filter drops never takes a
place in the queue, so a storm about some pods does not crowd out the others), puts what is
to be written on a bounded queue (``queue_size``; full → dropped and counted), and one sender
task (started with the first record) writes them one at a time, with a deadline per call. A
failure (403 without the RBAC, 404 a namespace gone, a timeout) is counted and logged (the
first of each kind at WARNING, then at DEBUG), never retried. An event whose caller did not
know the pod's uid gets it from one GET by the sender (``kubectl describe pod`` selects by
uid). ``stop`` gives the sender ``within`` seconds to write what is queued, then drops the
rest (counted).

Metric ``agent_runtime_pod_events_total{reason,outcome}``: ``sent`` (created), ``aggregated``
(an occurrence more, patched onto the one written), ``dropped_full``, ``dropped_spam``,
``dropped_stop``, ``failed``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

from agent_runtime import logs
from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import K8sApiError
from agent_runtime.resource_manager.pod_event_correlator import (
    Correlated,
    EventCorrelator,
    Occurrence,
)

log = logging.getLogger(__name__)

COMPONENT = "agent-runtime"
MESSAGE_LIMIT = 1024  # bytes of a message (the events API's note limit; client-go's too)
SEND_TIMEOUT = 5.0  # seconds one create or patch may take
STOP_WITHIN = 3.0  # seconds the sender has at shutdown to write what is queued
DEFAULT_QUEUE_SIZE = 1000
OUTCOMES = ("sent", "aggregated", "dropped_full", "dropped_spam", "dropped_stop", "failed")


class PodEventReason(StrEnum):
    DEPLOYED = "Deployed"
    DEPLOY_FAILED = "DeployFailed"
    ADOPTED = "Adopted"
    RECLAIMED = "Reclaimed"
    DELETED_DEAD = "DeletedDead"
    DELETED_HALF_DEAD = "DeletedHalfDead"
    DELETED_ORPHAN = "DeletedOrphan"
    DRAIN_STARTED = "DrainStarted"
    DRAINED = "Drained"
    FOREIGN_POD_IGNORED = "ForeignPodIgnored"


# reason → (type, when it is recorded): the reference (docs/reference/kubernetes.md) lists it
REASONS: dict[PodEventReason, tuple[str, str]] = {
    PodEventReason.DEPLOYED: ("Normal", "a deploy of ours created the pod and registered it"),
    PodEventReason.DEPLOY_FAILED: (
        "Warning",
        "a deploy of ours created the pod but it did not become Ready (dead, not Ready within "
        "ready_timeout, its signature refused) or could not be registered: deleted",
    ),
    PodEventReason.ADOPTED: (
        "Normal",
        "a pod of ours that Redis did not hold (a dead deploy leader's, or after a data loss) "
        "was registered",
    ),
    PodEventReason.RECLAIMED: (
        "Normal",
        "an idle warm pod was deleted (old version, idle past its plan, or no pool config)",
    ),
    PodEventReason.DELETED_DEAD: (
        "Warning",
        "Kubernetes says the pod is dead (failed, crash-looping, being deleted): deleted, "
        "its sessions evicted",
    ),
    PodEventReason.DELETED_HALF_DEAD: (
        "Warning",
        "the pod runs but failed its health checks (two passes, or a gateway's report): "
        "deleted, its sessions evicted",
    ),
    PodEventReason.DELETED_ORPHAN: (
        "Normal",
        "reconcile deleted a pod of ours that Redis did not hold and that could not be "
        "adopted (dead, not Ready, an old version, no room, never signed)",
    ),
    PodEventReason.DRAIN_STARTED: (
        "Normal",
        "the pod is being retired (an admin drain, its node cordoned, a graceful deletion): "
        "no new sessions",
    ),
    PodEventReason.DRAINED: ("Normal", "a drained pod's sessions are gone (or its time ran out)"),
    PodEventReason.FOREIGN_POD_IGNORED: (
        "Warning",
        "the pod carries our labels but is not provably ours: never adopted, routed to or "
        "deleted (counted up on every reconcile pass that sees it)",
    ),
}


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod an event is about: where it runs and which incarnation (``uid``; "" when the
    caller does not know it: the event is then listed by name, not by ``kubectl describe``)."""

    name: str
    namespace: str
    uid: str = ""
    cluster: str | None = None


class PodEventSink(Protocol):
    """What a decision's code holds: ``record`` returns at once and never raises."""

    def record(self, pod: PodRef, reason: PodEventReason, message: str) -> None: ...


class NoPodEvents:
    """Records nothing: the sink of a component built without a recorder (tests by hand)."""

    def record(self, pod: PodRef, reason: PodEventReason, message: str) -> None:
        return None


def event_name(event: Occurrence) -> str:
    """client-go's: ``<pod>.<nanoseconds in hex>``."""
    return f"{event.pod}.{int(event.at * 1e9):x}"


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bounded(message: str) -> str:
    data = message.encode()
    if len(data) <= MESSAGE_LIMIT:
        return message
    return data[: MESSAGE_LIMIT - 3].decode(errors="ignore") + "..."


class PodEvents:
    def __init__(
        self,
        *,
        k8s: K8sPodClient,
        instance_id: str,
        enabled: bool = True,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        send_timeout: float = SEND_TIMEOUT,
        correlator: EventCorrelator | None = None,
    ) -> None:
        """``clock``: wall seconds (timestamps, the aggregation window, the spam buckets)."""
        self._k8s = k8s
        self._host = instance_id
        self.enabled = enabled
        self._queue: asyncio.Queue[Correlated] = asyncio.Queue(maxsize=max(queue_size, 1))
        self._counter = (metrics or Metrics()).pod_events
        self._clock = clock
        self._send_timeout = send_timeout
        self._correlator = correlator or EventCorrelator(name_of=event_name)
        self._sender: asyncio.Task[None] | None = None
        self._stopped = False
        self._warned: set[str] = set()  # failure kinds logged at WARNING once

    def _count(self, reason: str, outcome: str) -> None:
        self._counter.labels(reason, outcome).inc()

    def record(self, pod: PodRef, reason: PodEventReason, message: str) -> None:
        """Queue one event about ``pod``; returns at once and never raises."""
        if not self.enabled:
            return
        if self._stopped:
            self._count(reason, "dropped_stop")
            return
        kind, _ = REASONS[reason]
        occurrence = Occurrence(
            pod.cluster, pod.namespace, pod.name, pod.uid, kind, reason.value,
            _bounded(message), self._clock(),
        )  # fmt: skip
        correlated = self._correlator.correlate(occurrence)
        if correlated is None:
            self._count(reason, "dropped_spam")
            return
        try:
            self._queue.put_nowait(correlated)
        except asyncio.QueueFull:
            self._count(reason, "dropped_full")
            return
        if self._sender is None or self._sender.done():  # first record, or a sender that died
            # the sender outlives the request or job whose record started it
            self._sender = logs.detached_task(self._send_all(), name="pod-events-sender")

    async def _send_all(self) -> None:
        while True:
            correlated = await self._queue.get()
            reason = correlated.occurrence.reason
            try:
                await self._send(correlated)
            except asyncio.CancelledError:  # the stop's bound ran out with this one in flight
                self._count(reason, "dropped_stop")
                raise
            except Exception:  # never the sender's end: the next event is sent
                log.exception("pod event %s not sent", reason)
            finally:
                self._queue.task_done()

    async def _send(self, correlated: Correlated) -> None:
        if not correlated.occurrence.uid:
            found = await self._with_uid(correlated.occurrence)
            correlated = dataclasses.replace(correlated, occurrence=found)
        try:
            async with asyncio.timeout(self._send_timeout):
                outcome = await self._write(correlated)
        except Exception as exc:  # a refusal, a timeout, a client that is closed: counted
            self._failed(correlated, exc)
            return
        self._count(correlated.occurrence.reason, outcome)

    async def _with_uid(self, occurrence: Occurrence) -> Occurrence:
        """The caller did not know the pod's uid (a reclaim, a drain: Redis keeps none): one
        GET finds it, so ``kubectl describe pod`` (which selects by uid) lists the event; a pod
        already gone, or a failed GET, leaves it without (listed by name only)."""
        try:
            async with asyncio.timeout(self._send_timeout):
                status = await self._k8s.get_pod(
                    occurrence.pod, occurrence.namespace, cluster=occurrence.cluster
                )
        except (K8sApiError, TimeoutError):
            return occurrence
        if status is None or not status.uid:
            return occurrence
        return dataclasses.replace(occurrence, uid=status.uid)

    async def _write(self, event: Correlated) -> str:
        """A patch of the Event already written, else (first, or it expired upstream: 404)
        the Event created whole, with the count so far (as client-go's recordEvent)."""
        at = event.occurrence
        if event.is_patch:
            patch = {
                "count": event.count,
                "lastTimestamp": rfc3339(at.at),
                "message": event.message,
            }
            try:
                await self._k8s.patch_event(at.namespace, event.name, patch, cluster=at.cluster)
                return "aggregated"
            except K8sApiError as exc:
                if exc.status != 404:
                    raise
        await self._k8s.create_event(at.namespace, self._body(event), cluster=at.cluster)
        return "sent"

    def _body(self, event: Correlated) -> dict[str, Any]:
        at = event.occurrence
        involved = {"kind": "Pod", "namespace": at.namespace, "name": at.pod, "apiVersion": "v1"}
        if at.uid:
            involved["uid"] = at.uid
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event.name, "namespace": at.namespace},
            "involvedObject": involved,
            "reason": at.reason,
            "message": event.message,
            "type": at.type,
            "source": {"component": COMPONENT, "host": self._host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._host,
            "firstTimestamp": rfc3339(event.first_at),
            "lastTimestamp": rfc3339(at.at),
            "count": event.count,
        }

    def _failed(self, event: Correlated, exc: BaseException) -> None:
        self._count(event.occurrence.reason, "failed")
        status = exc.status if isinstance(exc, K8sApiError) else None
        kind = str(status) if status else type(exc).__name__
        at = event.occurrence
        text = f"pod event {at.reason} on {at.namespace}/{at.pod} not written: {exc or kind}"
        if kind not in self._warned:
            self._warned.add(kind)
            hint = " (grant create and patch on events)" if status == 403 else ""
            log.warning("%s%s; further %s failures are logged at DEBUG", text, hint, kind)
        else:
            log.debug("%s", text)

    async def wait_sent(self, within: float) -> bool:
        """Whether everything queued was handled within ``within`` seconds (the tests)."""
        try:
            async with asyncio.timeout(within):
                await self._queue.join()
        except TimeoutError:
            return False
        return True

    async def stop(self, within: float = STOP_WITHIN) -> None:
        """Write what is queued for at most ``within`` seconds, then drop the rest (counted);
        a record after this drops its event."""
        self._stopped = True
        sender, self._sender = self._sender, None
        if sender is None:
            return
        if not await self.wait_sent(within):
            while not self._queue.empty():
                self._count(self._queue.get_nowait().occurrence.reason, "dropped_stop")
                self._queue.task_done()
        sender.cancel()
        await asyncio.wait([sender])  # its cancellation is not ours: ours still propagates
