"""``PodWatch``: Kubernetes watch streams of our pods, one per place, on one replica.

A dead pod is noticed the moment Kubernetes says so instead of at the next watch pass: one
watch stream (``K8sPodClient.watch_pods``, label selector ``OWN_PODS_SELECTOR``) per place
(cluster, namespace) where Redis has pods or a pool config deploys. A DELETED event, or a
pod turned Failed, Succeeded or crash-looping, of a pod Redis knows at that place goes to
``DeadPods.settle`` (the pass's own judgement): cleaned, its sessions evicted, their next
route ``rebound``. The periodic pass (``rm_watch``) stays as the safety net, and keeps the
half-dead checks (``/health``), which no event reports.

One replica runs the streams: the leader of ``rm_pod_watch`` (a job leader lock,
``agent_runtime:job:rm_pod_watch``, held for ``LEASE`` s and renewed every third of it). A
leader that dies lets it lapse; another replica takes it within ``LEASE`` + a third, and
starts every stream with a LIST. A replica that cannot renew (Redis away, another took it)
stops its streams at once.

A stream: LIST (its resourceVersion; every pod Redis knew at that place before the LIST is
judged on it, so a death missed while nobody watched is found), then WATCH from that version
with ``timeoutSeconds`` ``STREAM_TIMEOUT``; a stream that ends (the server's timeout, a
dropped connection) is resumed from the last event's version; a 410 (the version was
compacted) lists again; any other failure lists again after a backoff (``BACKOFF_MIN`` doubling
to ``BACKOFF_MAX``). Cleanings run beside the stream, ``CLEAN_CONCURRENCY`` at once, one per
pod at a time, so a node's worth of deaths does not queue behind one another's deletes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from agent_runtime.jobs import JOB_LOCK_PREFIX, BackgroundTasks
from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.dead_pods import DeadPods
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import (
    OWN_PODS_SELECTOR,
    WATCH_EVENT_TYPES,
    K8sApiError,
    PodEvent,
    PodStatus,
)
from agent_runtime.resource_manager.places import Place, Places
from agent_runtime.resource_manager.state import ResourceState

log = logging.getLogger(__name__)

LOCK_NAME = "rm_pod_watch"
LEASE = 3.0  # seconds the leader lock lives unless renewed (every third of it)
PLACES_EVERY = 5.0  # seconds between two looks at where our pods are
STREAM_TIMEOUT = 240  # timeoutSeconds of one WATCH request; then resumed from its version
BACKOFF_MIN, BACKOFF_MAX = 0.2, 5.0  # after a failed LIST or WATCH (and a stream that ends at once)
QUICK_END = 1.0  # a stream that ends within this, with no event, is backed off too
CLEAN_CONCURRENCY = 16


class PodWatch:
    def __init__(
        self,
        *,
        lock_redis: Redis,
        state: ResourceState,
        k8s: K8sPodClient,
        places: Places,
        dead_pods: DeadPods,
        default_namespace: str,
        metrics: Metrics | None = None,
        lease: float = LEASE,
    ) -> None:
        """``lock_redis``: where the leader lock lives (the job locks' own pool)."""
        lock_name = JOB_LOCK_PREFIX + LOCK_NAME
        self._lock = Lock(lock_redis, lock_name, timeout=lease, thread_local=False)
        self._lease = lease
        self._state = state
        self._k8s = k8s
        self._places = places
        self._dead = dead_pods
        self._default_namespace = default_namespace
        metrics = metrics or Metrics()
        self._events = {kind: metrics.pod_watch_events.labels(kind) for kind in WATCH_EVENT_TYPES}
        self._relists = metrics.pod_watch_relists
        self._restarts = metrics.pod_watch_restarts
        self._open = metrics.pod_watch_streams
        self._streams: dict[Place, asyncio.Task[None]] = {}
        self._cleanings = BackgroundTasks()
        self._cleaning: set[str] = set()  # pods being cleaned now (one cleaning per pod)
        self._clean_slots = asyncio.Semaphore(CLEAN_CONCURRENCY)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.leading = False

    # --- leadership ------------------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.create_task(self._lead_loop(), name="pod-watch")

    async def stop(self) -> None:
        """End the streams and the cleanings, and give the lock back (if still ours)."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._end_streams()
        await self._cleanings.wait()
        if self.leading:
            self.leading = False
            with contextlib.suppress(Exception):  # not ours any more, or Redis is gone
                await self._lock.release()

    async def _lead_loop(self) -> None:
        loop = asyncio.get_running_loop()
        places_at = -PLACES_EVERY
        while not self._stop.is_set():
            self.leading = await self._lead()
            if not self.leading:
                await self._end_streams()
                places_at = -PLACES_EVERY
            elif loop.time() - places_at >= PLACES_EVERY:
                try:
                    await self._follow_places()
                    places_at = loop.time()
                except Exception as exc:  # Redis away: the next round looks again
                    log.warning("pod watch: where our pods are could not be read: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._lease / 3)

    async def _lead(self) -> bool:
        try:
            if self.leading and await self._lock.owned():
                await self._lock.reacquire()  # the lease goes on while this replica lives
                return True
            return bool(await self._lock.acquire(blocking=False))
        except LockError:
            return False  # lapsed between the check and the renewal: somebody else leads
        except Exception as exc:  # Redis away: stop watching (another replica may lead)
            log.warning("pod watch: leader lock not renewed: %s", exc)
            return False

    # --- streams ---------------------------------------------------------------------------------

    async def _follow_places(self) -> None:
        """A stream per place our pods are in or a pool config deploys to; a place left
        behind (no pod, no config) keeps its stream until the leadership ends (cheap)."""
        places = set(await self._places.pods_by_place()) | await self._places.config_places()
        for place in places - set(self._streams):
            self._streams[place] = asyncio.create_task(
                self._follow(place), name=f"pod-watch:{place[0] or ''}/{place[1]}"
            )
        self._open.set(len(self._streams))

    async def _end_streams(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        self._open.set(0)

    async def _follow(self, place: Place) -> None:
        cluster, namespace = place
        loop = asyncio.get_running_loop()
        version: str | None = None
        backoff = BACKOFF_MIN
        while True:
            listed = False  # this round began with a LIST
            try:
                if version is None:
                    version, listed = await self._relist(place), True
                started, seen = loop.time(), 0
                events = self._k8s.watch_pods(
                    namespace, OWN_PODS_SELECTOR, resource_version=version,
                    timeout_seconds=STREAM_TIMEOUT, cluster=cluster,
                )  # fmt: skip
                async with contextlib.aclosing(events) as stream:
                    async for event in stream:
                        seen += 1
                        version = event.resource_version or version
                        self._on_event(place, event)
                self._restarts.labels("ended").inc()
                if seen or loop.time() - started >= QUICK_END:
                    backoff = BACKOFF_MIN
                    continue  # resumed from its version at once
            except K8sApiError as exc:
                version = None
                if exc.status == 410:
                    log.info("pod watch %s: %s; listing again", namespace, exc)
                    self._restarts.labels("expired").inc()
                    if not listed:  # a 410 right after a LIST is backed off: never a LIST loop
                        backoff = BACKOFF_MIN
                        continue
                else:
                    log.warning("pod watch %s: %s; again in %.1f s", namespace, exc, backoff)
                    self._restarts.labels("error").inc()
            except Exception as exc:
                version = None
                log.warning("pod watch %s: %s; listing again in %.1f s", namespace, exc, backoff)
                self._restarts.labels("error").inc()
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, BACKOFF_MAX)  # jittered above: places never retry in step

    async def _relist(self, place: Place) -> str:
        """LIST the place; every pod Redis knew there before the LIST is judged on it (a death
        while nobody watched); the LIST's resourceVersion, to watch from."""
        cluster, namespace = place
        known = (await self._places.pods_by_place()).get(place, {})  # Redis BEFORE the LIST
        listing = await self._k8s.list_pods_versioned(namespace, OWN_PODS_SELECTOR, cluster=cluster)
        self._relists.inc()
        listed = {pod.pod_id: pod for pod in listing.pods}
        for n, pod_id in enumerate(known):
            if n % 500 == 499:
                await asyncio.sleep(0)  # a place with thousands of pods yields now and then
            status = listed.get(pod_id)
            if DeadPods.why_dead(status) is not None:
                self._spawn_settle(place, pod_id, status, check_known=False)
        # a namespace that does not exist lists [] without a version: watch from "0" (now)
        return listing.resource_version or "0"

    def _on_event(self, place: Place, event: PodEvent) -> None:
        kind = event.kind if event.kind in self._events else "MODIFIED"
        self._events[kind].inc()
        if event.pod is None:
            return  # a bookmark: only its version counts
        status = None if event.kind == "DELETED" else event.pod
        if DeadPods.why_dead(status) is not None:
            self._spawn_settle(place, event.pod.pod_id, status, check_known=True)

    def _spawn_settle(
        self, place: Place, pod_id: str, status: PodStatus | None, *, check_known: bool
    ) -> None:
        if pod_id in self._cleaning:
            return  # being cleaned already
        self._cleaning.add(pod_id)
        settle = self._settle(place, pod_id, status, check_known=check_known)
        self._cleanings.spawn(settle, name=f"pod-watch-clean:{pod_id}")

    async def _settle(
        self, place: Place, pod_id: str, status: PodStatus | None, *, check_known: bool
    ) -> None:
        cluster, namespace = place
        scope_id: str | None = None
        try:
            async with self._clean_slots:
                if check_known:
                    # only a pod Redis has at this very place (a deploying one is its
                    # deploy's to judge; a cleaned one is gone already)
                    info = await self._state.pod_info(pod_id)
                    if info is None or (
                        info.cluster,
                        info.namespace or self._default_namespace,
                    ) != (cluster, namespace):
                        return
                    scope_id = info.scope_id
                await self._dead.settle(
                    pod_id, namespace, cluster, status, by="stream", scope_id=scope_id
                )
        except Exception as exc:  # the pass finds it again
            log.warning("pod %s: the watch stream could not clean it: %s", pod_id, exc)
        finally:
            self._cleaning.discard(pod_id)
