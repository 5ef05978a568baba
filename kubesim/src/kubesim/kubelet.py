"""The simulated scheduler and kubelet: brings each pod from Pending to Running and Ready.

Per pod, one task: schedule (``spec.nodeName``: the schedulable node with the fewest pods,
``nodes.py``; none: Pending ``Unschedulable`` until a node changes), give it the next free
loopback IP (127.0.0.2, 127.0.0.3, …; its ports are bound and held at once, and an address
where another program on this machine holds one of them is skipped, as an IPAM skips an
address in use), wait ``ready_delay`` plus up to ``jitter`` seconds
(pulling and starting), then start its AgentServer on that IP and report Running and Ready.
While it runs, a readiness check every ``probe_period`` keeps the Ready condition in line with
the pod's ``/health`` faults.
Pod faults (image pull, crash loop, never ready) are drawn once, when the pod starts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kubesim import pod_status
from kubesim.agentserver import AgentServer, reserve_ports
from kubesim.faults import Fault, Faults
from kubesim.nodes import Nodes
from kubesim.store import Obj, Store

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
FIRST_POD_IP = "127.0.0.2"
_LAST_POD_IP = int(ipaddress.IPv4Address("127.255.255.254"))
# addresses in use by other programs skipped for one pod at most: a listener on 0.0.0.0 at a
# pod's port takes that port on every address, and 16M binds would stall the loop
MAX_SKIPPED = 256

Key = tuple[str, str]


@dataclass
class _Runtime:
    uid: str
    task: asyncio.Task[None] | None = None
    server: AgentServer | None = None
    ip: str | None = None
    sockets: list[socket.socket] = field(default_factory=list)  # held until the server owns them
    never_ready: bool = False
    labels: dict[str, str] = field(default_factory=dict)


def pod_ports(pod: Obj) -> list[int]:
    """Where the pod's process listens: its declared container ports (the readiness probe's
    port included), else 8080."""
    ports: list[int] = []
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            ports.append(int(port["containerPort"]))
        probe_port = ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("port")
        if isinstance(probe_port, int):
            ports.append(probe_port)
    return sorted(set(ports)) or [DEFAULT_PORT]


def _probe(pod: Obj, *, ready: bool) -> None:
    """A readiness result lands on a Running pod that is not being deleted."""
    if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"):
        pod_status.set_ready(pod, ready)


class Kubelet:
    def __init__(
        self,
        store: Store,
        faults: Faults,
        *,
        ready_delay: float,
        jitter: float,
        probe_period: float,
        sse_interval: float,
        rng: random.Random,
        nodes: Nodes,
        first_ip: str = FIRST_POD_IP,
    ) -> None:
        self._store = store
        self._nodes = nodes
        self._faults = faults
        self.ready_delay = ready_delay
        self.jitter = jitter
        self.probe_period = probe_period
        self.sse_interval = sse_interval
        self._rng = rng
        self._pods: dict[Key, _Runtime] = {}
        self._next_ip = int(ipaddress.IPv4Address(first_ip))
        self._first_ip = self._next_ip
        self._ips: set[str] = set()

    # --- lifecycle of one pod ---------------------------------------------------------------

    def pod_created(self, pod: Obj) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        runtime = _Runtime(uid=meta["uid"], labels=dict(meta.get("labels") or {}))
        self._pods[key] = runtime
        runtime.task = asyncio.get_running_loop().create_task(
            self._run(key, runtime), name=f"kubesim-kubelet:{key[0]}/{key[1]}"
        )

    async def pod_removed(self, namespace: str, name: str) -> None:
        """The pod is gone from the store: stop everything it ran and free its IP. Forgotten
        only once stopped, so ``stop`` finishes what an interrupted removal left."""
        key = (namespace, name)
        runtime = self._pods.get(key)
        if runtime is None:
            return
        await self._halt(runtime)
        if self._pods.get(key) is runtime:
            del self._pods[key]
            if runtime.ip is not None:
                self._ips.discard(runtime.ip)

    async def halt(self, namespace: str, name: str) -> None:
        """Stop the pod's containers (its IP stays taken while the pod object exists)."""
        runtime = self._pods.get((namespace, name))
        if runtime is not None:
            await self._halt(runtime)

    async def stop(self) -> None:
        for key in list(self._pods):
            await self.pod_removed(*key)

    def server(self, namespace: str, name: str) -> AgentServer | None:
        runtime = self._pods.get((namespace, name))
        return runtime.server if runtime is not None else None

    async def _halt(self, runtime: _Runtime) -> None:
        task = runtime.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait({task})  # our own cancellation still reaches us
            runtime.task = None
        server = runtime.server
        if server is not None:
            await server.stop()
            runtime.server = None

    # --- the kubelet's work -----------------------------------------------------------------

    def _update(self, key: Key, runtime: _Runtime, change: Callable[[Obj], None]) -> Obj | None:
        return self._store.update_pod(*key, change, uid=runtime.uid)

    def _draw(self, kind: str, key: Key, runtime: _Runtime) -> Fault | None:
        return self._faults.take(kind, namespace=key[0], name=key[1], labels=runtime.labels)

    async def _run(self, key: Key, runtime: _Runtime) -> None:
        try:
            await self._lifecycle(key, runtime)
        except asyncio.CancelledError:
            raise
        except Exception:  # a simulator bug must not kill the loop silently
            log.exception("kubelet: pod %s/%s", *key)
        finally:  # a pod that fails, or goes, before its server starts frees its ports
            for sock in runtime.sockets:
                sock.close()
            runtime.sockets = []

    async def _lifecycle(self, key: Key, runtime: _Runtime) -> None:
        pull = self._draw("image_pull", key, runtime)
        crash = None if pull else self._draw("crash_loop", key, runtime)
        never = None if pull or crash else self._draw("never_ready", key, runtime)
        if never is not None and never.params["mode"] == "pending":
            self._update(key, runtime, pod_status.unschedulable)
            return
        runtime.never_ready = never is not None
        node = self._nodes.pick()
        while node is None:  # every node cordoned: Pending until one changes
            pending = partial(pod_status.unschedulable, message=self._nodes.unschedulable_message())
            if self._update(key, runtime, pending) is None:
                return
            await self._nodes.changed()
            node = self._nodes.pick()
        current = self._store.get_pod(*key)
        if current is None:
            return
        runtime.ip, runtime.sockets = self._allocate_ip(pod_ports(current))
        ip, chosen = runtime.ip, node

        def start_sandbox(pod: Obj) -> None:
            pod_status.scheduled(pod, chosen)
            pod_status.sandbox_ready(pod, ip)

        if self._update(key, runtime, start_sandbox) is None:
            return
        await asyncio.sleep(self.ready_delay + self._rng.uniform(0.0, self.jitter))
        pod = self._store.get_pod(*key)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return
        image = pod["spec"]["containers"][0]["image"]
        if pull is not None:
            await self._fail_pull(key, runtime, image, pull.params["reason"])
            return
        if crash is not None:
            code = int(crash.params["exit_code"])
            self._update(key, runtime, lambda p: pod_status.crash_loop(p, code))
            return
        sockets = runtime.sockets or reserve_ports(ip, pod_ports(pod))
        runtime.sockets = []
        if sockets is None:  # taken by another program (MAX_SKIPPED reached at allocation)
            message = f"listen on {ip}: [Errno 98] address already in use"
            self._update(key, runtime, lambda p: pod_status.crash_loop(p, 1, message))
            return
        server = AgentServer(
            namespace=key[0],
            name=key[1],
            sockets=sockets,
            health=lambda: self._health_mode(key, runtime),
            sse_interval=self.sse_interval,
        )
        runtime.server = server  # before it starts: a halt during start() still stops it
        try:
            await server.start()
        except OSError as exc:  # start() closed the sockets
            runtime.server = None
            message = f"listen on {ip}: {exc}"
            self._update(key, runtime, lambda p: pod_status.crash_loop(p, 1, message))
            return
        ready = self._ready(key, runtime)
        self._update(key, runtime, lambda p: pod_status.running(p, ready))
        while True:  # the readiness probe
            await asyncio.sleep(self.probe_period)
            if self._update(key, runtime, partial(_probe, ready=self._ready(key, runtime))) is None:
                return

    async def _fail_pull(self, key: Key, runtime: _Runtime, image: str, reason: str) -> None:
        if reason == "InvalidImageName":
            message = f'Failed to apply default image tag "{image}": invalid reference format'
            self._update(key, runtime, lambda p: pod_status.waiting(p, reason, message))
            return
        pulled = (
            f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull '
            f'and unpack image "{image}": not found'
        )
        self._update(key, runtime, lambda p: pod_status.waiting(p, "ErrImagePull", pulled))
        if reason == "ErrImagePull":  # the kubelet then backs off: the two alternate
            await asyncio.sleep(max(self.ready_delay, 0.05))
        backoff = f'Back-off pulling image "{image}"'
        self._update(key, runtime, lambda p: pod_status.waiting(p, "ImagePullBackOff", backoff))

    def _health_mode(self, key: Key, runtime: _Runtime) -> str | None:
        if runtime.never_ready:
            return "500"
        fault = self._draw("health", key, runtime)
        return str(fault.params["mode"]) if fault is not None else None

    def _ready(self, key: Key, runtime: _Runtime) -> bool:
        if runtime.never_ready:
            return False
        fault = self._faults.active("health", namespace=key[0], name=key[1], labels=runtime.labels)
        return fault is None

    def _allocate_ip(self, ports: list[int]) -> tuple[str, list[socket.socket]]:
        """The next free loopback address (round robin: a freed IP is not reused at once) and
        sockets bound on it at each of ``ports`` (``reserve_ports``).

        Free means unused by this simulator and bindable: two simulators on one machine (two
        test runs, a run beside a local-mode service) start at the same address, and the
        second one's pod used to crash-loop on ``address already in use``. The sockets are
        held from here on, so nothing can take the address before the pod's server starts.
        After ``MAX_SKIPPED`` addresses in use, the next one unused by this simulator is given
        without sockets: the pod crash-loops on the bind, as a pod whose port is taken does."""
        skipped = 0
        for _ in range(_LAST_POD_IP - self._first_ip + 1):
            candidate = ipaddress.IPv4Address(self._next_ip)
            self._next_ip = self._next_ip + 1 if self._next_ip < _LAST_POD_IP else self._first_ip
            text = str(candidate)
            if text.endswith((".0", ".255")) or text in self._ips:
                continue
            sockets = reserve_ports(text, ports) if skipped < MAX_SKIPPED else []
            if sockets is None:
                skipped += 1
                log.info("kubelet: %s is in use by another program, skipped", text)
                continue
            self._ips.add(text)
            return text, sockets
        raise RuntimeError("kubesim: no loopback address left for a pod")

    def describe(self, namespace: str, name: str) -> dict[str, Any]:
        runtime = self._pods.get((namespace, name))
        if runtime is None:
            return {}
        server = runtime.server
        return {
            "agent_server": {"ip": server.ip, "ports": server.ports} if server else None,
            "never_ready": runtime.never_ready,
        }
