"""``KubeSim``: the Kubernetes API simulator, in-process (tests) or as ``kubesim`` /
``agent-runtime kubesim``.

    async with KubeSim(ready_delay=0.1) as sim:
        sim.url, sim.kubeconfig_path        # point kubernetes_asyncio at it
        sim.faults.add("image_pull", count=1)
        sim.kill("default", name, mode="fail")

It owns the store, the fault rules, the kubelet (and so every AgentServer) and the deletions in
their grace period; ``stop`` ends all of them and closes every socket. It binds to loopback
addresses only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from kubesim import events, pod_status, pods, watch
from kubesim.api import build_app
from kubesim.errors import not_found
from kubesim.faults import Faults
from kubesim.kubeconfig import write_kubeconfig
from kubesim.kubelet import FIRST_POD_IP, Kubelet
from kubesim.nodes import Nodes
from kubesim.paging import Pager
from kubesim.store import Obj, Store

log = logging.getLogger(__name__)

KILL_MODES = ("vanish", "fail", "crash")
DEFAULT_GRACE = 1.0  # the CLI repeats it (runner.DEFAULT_GRACE), to start without aiohttp


def check_loopback(host: str) -> None:
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"kubesim binds to loopback addresses only, not {host!r}")


class KubeSim:
    """The simulator. Knobs (all seconds): ``ready_delay`` and ``jitter`` (Pending → Running
    and Ready), ``grace_period`` (longest wait of a graceful delete, whatever the client asked),
    ``probe_period`` (readiness re-check), ``sse_interval`` (AgentServer pings).
    ``token``: require ``Authorization: Bearer <token>`` (and write it to the kubeconfig).
    ``nodes``: how many nodes (``kubesim-node``, ``kubesim-node-2``, …; ``nodes.py``).
    ``watch_history``, ``max_watches``, ``watch_queue``, ``watch_timeout``,
    ``bookmark_interval``: the bounds of watches (``watch.py``).
    ``event_ttl``, ``max_events``: how long an event is kept after its last write, and how
    many at most (``events.py``).
    ``seed``: makes jitter, fault ratios and generated names repeatable."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready_delay: float = 0.5,
        jitter: float = 0.0,
        grace_period: float = DEFAULT_GRACE,
        probe_period: float = 0.2,
        sse_interval: float = 1.0,
        namespaces: tuple[str, ...] | list[str] = ("default",),
        token: str | None = None,
        kubeconfig_path: str | Path | None = None,
        seed: int | None = None,
        first_pod_ip: str = FIRST_POD_IP,
        user: str | None = None,
        watch_history: int = watch.DEFAULT_HISTORY,
        max_watches: int = watch.DEFAULT_MAX_WATCHES,
        watch_queue: int = watch.DEFAULT_QUEUE,
        watch_timeout: float = watch.DEFAULT_TIMEOUT,
        bookmark_interval: float = watch.DEFAULT_BOOKMARK_INTERVAL,
        nodes: int = 1,
        event_ttl: float = events.DEFAULT_TTL,
        max_events: int = events.DEFAULT_CAP,
    ) -> None:
        check_loopback(host)
        check_loopback(first_pod_ip)
        for value, what in ((ready_delay, "ready_delay"), (jitter, "jitter")):
            if value < 0:
                raise ValueError(f"{what} must be >= 0")
        if probe_period <= 0:
            raise ValueError("probe_period must be > 0")
        if watch_timeout <= 0 or bookmark_interval <= 0:
            raise ValueError("watch_timeout and bookmark_interval must be > 0")
        self.host = host
        self.port = port
        self.grace_period = grace_period
        self.token = token
        self.user = user or ("kubesim" if token else "system:anonymous")
        self.rng = random.Random(seed)
        self.watch_timeout = watch_timeout
        self.bookmark_interval = bookmark_interval
        self.store = Store()
        self.watches = watch.WatchHub(
            self.store.revision, history=watch_history, max_watches=max_watches, queue=watch_queue
        )
        self.store.publish = self.watches.publish
        self.nodes = Nodes(self.store, nodes)
        self.pager = Pager()  # the snapshots paged LISTs continue from
        self.events = events.EventStore(self.store, ttl=event_ttl, cap=max_events)
        self.event_pager = Pager()  # the event LISTs' own (a query names no resource)
        self.faults = Faults(self.rng)
        self.kubelet = Kubelet(
            self.store,
            self.faults,
            ready_delay=ready_delay,
            jitter=jitter,
            probe_period=probe_period,
            sse_interval=sse_interval,
            rng=self.rng,
            nodes=self.nodes,
            first_ip=first_pod_ip,
        )
        self.requests: Counter[str] = Counter()  # "create pods", "list pods", ...
        self.injected: Counter[str] = Counter()  # "api_error 429", "reply_lost drop", ...
        for namespace in namespaces:
            self.store.add_namespace(namespace)
        self._kubeconfig_wanted = Path(kubeconfig_path) if kubeconfig_path else None
        self._tmpdir: Path | None = None
        self.kubeconfig_path: Path | None = None
        self._runner: web.AppRunner | None = None
        self._reapers: set[asyncio.Task[None]] = set()  # graceful deletes, waiting
        self._teardowns: set[asyncio.Task[None]] = set()  # pods being stopped
        self.stopping = asyncio.Event()  # ends injected latency at once on stop

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("kubesim is not running")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self.stopping.clear()
        # handler_cancellation: a client that gives up (e.g. during injected latency) aborts its
        # request, as the API server's request context does; nothing is applied after that
        runner = web.AppRunner(
            build_app(self), access_log=None, shutdown_timeout=2.0, handler_cancellation=True
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = int(runner.addresses[0][1])
            self._runner = runner
            if self._kubeconfig_wanted is None:
                self._tmpdir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="kubesim-"))
                self.kubeconfig_path = self._tmpdir / "kubeconfig"
            else:
                self.kubeconfig_path = self._kubeconfig_wanted
            await write_kubeconfig(self.kubeconfig_path, self.url, token=self.token)
        except BaseException:
            self._runner = None
            await runner.cleanup()
            raise
        log.info("kubesim listening on %s (kubeconfig %s)", self.url, self.kubeconfig_path)

    async def stop(self) -> None:
        """Stop answering, end every deletion, pod task and AgentServer; nothing is left."""
        self.stopping.set()
        self.watches.close_all("stopped")  # each stream ends at once, before the listener goes
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        reapers = list(self._reapers)
        for task in reapers:
            task.cancel()
        await asyncio.gather(*reapers, return_exceptions=True)
        await asyncio.gather(*list(self._teardowns), return_exceptions=True)
        await self.kubelet.stop()
        if self._tmpdir is not None:
            await asyncio.to_thread(shutil.rmtree, self._tmpdir, True)
            self._tmpdir = None

    async def __aenter__(self) -> KubeSim:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- what the API handlers and the control endpoint do ------------------------------------

    def namespace_exists(self, namespace: str) -> bool:
        return namespace in self.store.namespaces and self.faults.namespace_state(namespace) is None

    def create_pod(self, pod: Obj) -> Obj:
        created = self.store.create_pod(pod)
        self.kubelet.pod_created(created)
        return created

    def patch_pod(self, namespace: str, name: str, patch: Any) -> Obj:
        """Apply a merge patch (``pods.patched`` says what may change); the pod as answered."""
        current = self.store.require_pod(namespace, name)
        result = pods.patched(current, patch)

        def apply(pod: Obj) -> None:
            pod["metadata"] = result["metadata"]

        updated = self.store.update_pod(namespace, name, apply, uid=current["metadata"]["uid"])
        assert updated is not None  # one synchronous step: the pod cannot go in between
        return updated

    async def delete_pod(
        self, namespace: str, name: str, grace_seconds: int | None, *, capped: bool = True
    ) -> Obj:
        """Begin (or finish) a deletion as the API server does; returns the pod as answered.

        Grace 0, a pod never scheduled, or one already Failed/Succeeded goes at once;
        otherwise ``deletionTimestamp`` is set (a MODIFIED event) and the pod is gone (DELETED)
        after ``min(grace, grace_period)`` seconds, or exactly ``grace`` when not ``capped``
        (the control endpoint's delete: a drain test's long grace).
        """
        pod = self.store.require_pod(namespace, name)
        grace = grace_seconds
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds") or 0)
        unscheduled = not pod["spec"].get("nodeName")
        over = pod["status"].get("phase") in ("Failed", "Succeeded")
        if grace <= 0 or unscheduled or over:
            await self._remove(namespace, name, pod["metadata"]["uid"])
            return pod
        wait = min(float(grace), self.grace_period) if capped else float(grace)
        if pod["metadata"].get("deletionTimestamp"):
            return pod  # already going: a second delete changes nothing here
        uid = pod["metadata"]["uid"]
        updated = self.store.update_pod(
            namespace, name, lambda p: pod_status.mark_deleting(p, grace, wait), uid=uid
        )
        reaper = asyncio.get_running_loop().create_task(
            self._reap(namespace, name, uid, wait), name=f"kubesim-reap:{namespace}/{name}"
        )
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        return updated or pod

    async def _reap(self, namespace: str, name: str, uid: str, wait: float) -> None:
        await asyncio.sleep(wait)
        await self._remove(namespace, name, uid)

    async def _remove(self, namespace: str, name: str, uid: str) -> None:
        """Drop the pod and stop what it ran. The stopping is a task of its own that a
        request giving up (handler cancellation) cannot interrupt; ``stop`` waits for it."""
        if self.store.remove_pod(namespace, name, uid=uid) is not None:
            await self._shielded(self.kubelet.pod_removed(namespace, name), f"{namespace}/{name}")

    async def _shielded(self, work: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=f"kubesim-teardown:{what}")
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)
        await asyncio.shield(task)

    async def kill(self, namespace: str, name: str, mode: str = "fail") -> Obj | None:
        """The pod dies behind the client's back: ``vanish`` (gone, as if force-deleted by
        someone else), ``fail`` (phase Failed, reason Evicted) or ``crash`` (its container
        exits and backs off: CrashLoopBackOff). Returns the pod afterwards (None if vanished).
        """
        if mode not in KILL_MODES:
            raise ValueError(f"kill mode must be one of {', '.join(KILL_MODES)}")
        pod = self.store.get_pod(namespace, name)
        if pod is None:
            raise not_found("pods", name)
        uid = pod["metadata"]["uid"]
        if mode == "vanish":
            await self._remove(namespace, name, uid)
            return None
        await self._shielded(self.kubelet.halt(namespace, name), f"{namespace}/{name}")
        if mode == "fail":
            message = "The node was low on resource: memory."
            return self.store.update_pod(
                namespace, name, lambda p: pod_status.failed(p, "Evicted", message), uid=uid
            )
        return self.store.update_pod(
            namespace, name, lambda p: pod_status.crash_loop(p, 137), uid=uid
        )

    async def remove_namespace(self, namespace: str) -> None:
        for name in self.store.remove_namespace(namespace):
            await self._shielded(self.kubelet.pod_removed(namespace, name), f"{namespace}/{name}")

    async def reset(self) -> None:
        """Forget every pod, event and fault, the counters and paged lists; namespaces stay."""
        self.faults.clear()
        self.pager.clear()
        self.event_pager.clear()
        self.events.clear()
        self.nodes.uncordon_all()
        self.requests.clear()
        self.injected.clear()
        for namespace, name in list(self.store.pods()):
            uid = self.store.pod_uid(namespace, name)
            if uid is not None:
                await self._remove(namespace, name, uid)

    # --- views --------------------------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> Obj | None:
        return self.store.get_pod(namespace, name)

    def pods(self, namespace: str | None = None) -> list[Obj]:
        return self.store.list_pods(namespace)

    def state(self) -> dict[str, Any]:
        """What ``GET /_sim/state`` answers."""
        listed = []
        for pod in self.store.list_pods(None):
            meta, status = pod["metadata"], pod["status"]
            reasons = [
                cs["state"]["waiting"].get("reason")
                for cs in status.get("containerStatuses") or []
                if "waiting" in cs["state"]
            ]
            listed.append(
                {
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "labels": meta.get("labels") or {},
                    "annotations": meta.get("annotations") or {},
                    "phase": status.get("phase"),
                    "ready": pod_status.is_ready(pod),
                    "podIP": status.get("podIP"),
                    "node": pod["spec"].get("nodeName"),
                    "waiting": reasons,
                    "deleting": bool(meta.get("deletionTimestamp")),
                    **self.kubelet.describe(meta["namespace"], meta["name"]),
                }
            )
        return {
            "url": self.url if self._runner is not None else None,
            "resourceVersion": self.store.resource_version,
            "namespaces": {
                name: self.faults.namespace_state(name) or "active"
                for name in sorted(self.store.namespaces)
            },
            "pods": listed,
            "nodes": self.nodes.describe(),
            "watches": self.watches.describe(),
            "events": {"kept": len(self.events), "evicted": self.events.evicted},
            "faults": self.faults.to_json(),
            "requests": dict(self.requests),
            "injected": dict(self.injected),
            "settings": {
                "ready_delay": self.kubelet.ready_delay,
                "jitter": self.kubelet.jitter,
                "grace_period": self.grace_period,
                "probe_period": self.kubelet.probe_period,
                "auth": "token" if self.token else "none",
            },
        }

    # for reconfiguring a running simulator (control endpoint)
    def set_timing(self, **values: float) -> None:
        for key, value in values.items():
            if value < 0 or (key == "probe_period" and value <= 0):
                raise ValueError(f"{key} must be {'> 0' if key == 'probe_period' else '>= 0'}")
            if key == "grace_period":
                self.grace_period = value
            elif key in ("ready_delay", "jitter", "probe_period"):
                setattr(self.kubelet, key, value)
            else:
                raise ValueError(f"unknown setting {key}")
