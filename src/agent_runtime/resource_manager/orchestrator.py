"""Acquire a pod for a scope: a warm one, or exactly one new deploy per scope at a time.

Concurrent cold acquires of one scope (on any replica) race for ``lock:rm:deploy:{sid}``.
The winner deploys; the others give back their placeholder and wait in the follower room
(at most ``pod_concurrency - 1`` seats: what the new pod can still hold) for the leader's
pod, woken by the registration signal. Followers never take over a failed deploy: same
image, same failure. Hazard: every exit path must give back what it took — the placeholder,
the follower seat, the lock — and a pod created by a failed deploy is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from agent_runtime import admission, logs, spec_fields
from agent_runtime.jobs import BackgroundTasks
from agent_runtime.metrics import Metrics
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s import K8sPodClient, parse_label_selector
from agent_runtime.resource_manager.models import (
    OWN_PODS_SELECTOR,
    POOL_TOKEN_PREFIXES,
    DeployBounds,
    DeployFailed,
    DeployInProgress,
    MaxPodsReached,
    PodBudgetReached,
    PodDeployInfo,
)
from agent_runtime.resource_manager.state import (
    ResourceState,
    deploy_lock_key,
    registered_channel,
)

log = logging.getLogger(__name__)

FOLLOWER_MARGIN = 10  # seconds a follower waits beyond ready_timeout (registration overhead)
LOCK_MARGIN = 30  # seconds the deploy lock outlives ready_timeout
FOLLOWER_POLL = 0.25  # safety net under the registration signal
CLEANUP_CONCURRENCY = 10
POOL_CONFIG_FIELDS = ("min_idle_pods", "max_pods", "pod_ttl", "pod_concurrency")

OnReady = Callable[[dict[str, str]], Awaitable[object]]


@dataclass(frozen=True)
class _Acquire:
    """One acquire call: what its deploy or its follower wait needs."""

    scope_id: str
    pod_spec: dict[str, Any]
    pool_config: dict[str, int]
    request_id: str
    started_at: float  # Redis seconds: every pod registered since may be ours to share
    on_ready: OnReady | None
    rule_id: str = ""  # the rule whose pod budget a new pod counts against ("" = none)
    rule_pod_budget: int = 0  # 0 = unbounded

    @property
    def ready_timeout(self) -> float:
        return float(self.pod_spec.get("ready_timeout") or 300)


@dataclass
class _Requester:
    """Whether the caller is still there when its deploy finishes."""

    gone: bool = False


class ResourceOrchestrator:
    def __init__(
        self,
        *,
        state: ResourceState,
        k8s: K8sPodClient,
        notifier: Notifier,
        default_namespace: str,
        bounds: DeployBounds | None = None,
        metrics: Metrics | None = None,
        identity: PodIdentity,
    ) -> None:
        """``bounds``: where a deploy may go (the wiring passes the settings'; None: anywhere,
        for tests that build an orchestrator by hand); ``identity`` signs every pod."""
        metrics = metrics or Metrics()
        self._acquired = metrics.acquires
        self._deploys_done = metrics.deploys
        self._deploy_seconds = metrics.deploy_seconds
        self._follower_waits = metrics.follower_waits
        self._state = state
        self._k8s = k8s
        self._notifier = notifier
        self._default_namespace = default_namespace
        self._bounds = bounds
        self._identity = identity
        self._deploys = BackgroundTasks()

    # --- acquire -------------------------------------------------------------------------------

    async def acquire(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        pool_config: dict[str, int],
        request_id: str,
        *,
        on_ready: OnReady | None = None,
        rule_id: str = "",
        rule_pod_budget: int = 0,
    ) -> dict[str, str]:
        source = "failed"
        try:
            result, source = await self._acquire(
                scope_id, pod_spec, pool_config, request_id, on_ready, rule_id, rule_pod_budget
            )
            return result
        except DeployInProgress:
            source = "in_progress"
            raise
        except MaxPodsReached:
            source = "max_pods"
            raise
        except PodBudgetReached:
            source = "budget"
            raise
        finally:
            self._acquired.labels(source).inc()

    async def _acquire(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        pool_config: dict[str, int],
        request_id: str,
        on_ready: OnReady | None,
        rule_id: str,
        rule_pod_budget: int,
    ) -> tuple[dict[str, str], str]:
        """The pod and where it came from: replay, warm, deploy or follower."""
        cached = await self._state.cached_result(scope_id, request_id)
        if cached is not None:
            return cached, "replay"
        call = _Acquire(
            scope_id,
            pod_spec,
            pool_config,
            request_id,
            await self._state.now(),
            on_ready,
            rule_id,
            rule_pod_budget,
        )
        placeholder_ttl = math.ceil(call.ready_timeout) + LOCK_MARGIN
        wrote_config = False
        while True:
            token = f"{request_id}:{uuid.uuid4().hex[:8]}"
            try:
                outcome = await self._state.acquire(
                    scope_id,
                    request_id,
                    token,
                    placeholder_ttl,
                    rule_id=rule_id,
                    rule_pod_budget=rule_pod_budget,
                )
            except BaseException:
                # the script may have taken a placeholder whose reply never came back (the
                # caller cancelled, the connection dropped): it would hold a slot of max_pods
                with contextlib.suppress(Exception):
                    await self._state.drop_placeholders_of(scope_id, token)
                raise
            if outcome.action in ("cached", "reuse"):
                assert outcome.pod_id is not None and outcome.pod_sse_url is not None
                pod = {
                    "pod_id": outcome.pod_id,
                    "pod_sse_url": outcome.pod_sse_url,
                    "deploy_ver": outcome.deploy_ver or "",
                }
                return pod, "replay" if outcome.action == "cached" else "warm"
            if outcome.action == "no_config":
                if wrote_config:
                    raise DeployFailed(f"scope {scope_id}: pool config vanished during acquire")
                await self.update_pool_config(scope_id, pool_config, pod_spec)
                wrote_config = True
                continue
            if outcome.action in ("max_reached", "budget_reached"):
                # no new pod: one on its way may still serve us; else refused (max_pods: the
                # route waits a moment for a candidate; a budget: it is answered at once)
                if outcome.action == "max_reached":
                    refusal: Exception = MaxPodsReached(f"scope {scope_id} is at max_pods")
                else:
                    budget = outcome.budget or "global"
                    refusal = PodBudgetReached(
                        f"scope {scope_id}: the {budget} pod budget is reached", budget=budget
                    )
                return await self._follow_in_flight(call, refusal), "follower"
            assert outcome.placeholder is not None
            return await self._deploy_or_follow(call, outcome.placeholder)

    async def _follow_in_flight(self, call: _Acquire, refusal: Exception) -> dict[str, str]:
        """The scope may not grow: follow a deploy in flight (its pod may have room for us),
        wait for a warm one, or raise ``refusal``."""
        scope_id = call.scope_id
        # the leader's start, read now: a leader that registered its pod just before we
        # started may release its lock before _follow looks
        leader_started = await self._leader_started_at(scope_id)
        placeholders = await self._state.deploying(scope_id)
        cold = [p for p in placeholders if not p.startswith(POOL_TOKEN_PREFIXES)]
        if leader_started is None and placeholders and not cold:
            # only the warm pool's deploys hold the cap: their pods come as warm pods, to be
            # taken by a later acquire, never handed to a follower
            raise DeployInProgress(f"scope {scope_id}: a warm pod is being deployed")
        if leader_started is not None or cold:
            since = min(call.started_at, leader_started or math.inf)
            return await self._follow(call, since)
        raise refusal

    async def _deploy_or_follow(
        self, call: _Acquire, placeholder: str
    ) -> tuple[dict[str, str], str]:
        scope_id = call.scope_id
        lock = Lock(
            self._state.redis,
            deploy_lock_key(scope_id),
            timeout=call.ready_timeout + LOCK_MARGIN,
            thread_local=False,
        )
        # the token carries when this acquire started, for followers (_leader_started_at)
        token = f"{uuid.uuid4().hex}@{call.started_at!r}"
        since = call.started_at
        try:
            leader = await lock.acquire(blocking=False, token=token)
            for _ in range(3):  # a leader that finished in between is gone: lead ourselves
                if leader:
                    break
                leader_started = await self._leader_started_at(scope_id)
                if leader_started is not None:
                    since = min(since, leader_started)
                    break
                leader = await lock.acquire(blocking=False, token=token)
        except BaseException:
            # the SET NX may have taken the lock before its reply was lost: give it back if
            # it holds our token (compare-and-delete), or no cold start until it expires
            with contextlib.suppress(Exception):
                await self._state.release_lock_of(lock, token)
            await self._state.drop_placeholder(scope_id, placeholder)
            raise
        if not leader:
            await self._state.drop_placeholder(scope_id, placeholder)
            return await self._follow(call, since), "follower"
        requester = _Requester()
        # Our own task: a caller that disconnects does not abort a deploy half-way (that would
        # leave a pod nobody tracks, or a lock released while its deploy still runs).
        task = self._deploys.spawn(
            self._lead(call, placeholder, lock, requester), name=f"deploy:{scope_id}"
        )
        try:
            return await asyncio.shield(task), "deploy"
        except asyncio.CancelledError:
            requester.gone = True  # the pod, once Ready, goes to the warm pool
            raise

    async def _lead(
        self, call: _Acquire, placeholder: str, lock: Lock, requester: _Requester
    ) -> dict[str, str]:
        scope_id = call.scope_id
        try:
            # a leader that finished just before we took the lock may have brought a pod with
            # room for us (never with pod_concurrency 1: it is full with its own session)
            shareable = int(call.pool_config.get("pod_concurrency", 1)) > 1
            fresh = await self._registered_since(scope_id, call.started_at) if shareable else None
            if fresh is not None:
                await self._state.drop_placeholder(scope_id, placeholder)
                return fresh
            result = await self.deploy_and_register(
                scope_id, call.pod_spec, placeholder, warm=False, requester=requester
            )
            await self._state.cache_result(scope_id, call.request_id, result)
            if call.on_ready is not None and not requester.gone:
                try:  # still under the lock: nobody decides to deploy before the pod is seen
                    await call.on_ready(result)
                except Exception as exc:  # the caller gets the pod and publishes it itself
                    log.warning("scope %s: on_ready for %s failed: %s", scope_id, result, exc)
            return result
        finally:
            with contextlib.suppress(LockError, Exception):
                await lock.release()

    async def deploy_and_register(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        placeholder: str,
        *,
        warm: bool,
        requester: _Requester | None = None,
    ) -> dict[str, str]:
        """Deploy one pod and register it; the placeholder is given back on every path."""
        version = spec_fields.deploy_ver(pod_spec)
        logs.add_secret_values(spec_fields.clear_env_values(pod_spec))  # an error may echo them
        kind = "warm" if warm else "cold"
        started = time.perf_counter()
        try:
            refusal = self._bounds and self._bounds.refusal(pod_spec, self._default_namespace)
            if refusal:
                log.warning(
                    "scope %s: no deploy: %s (namespace %.80r, cluster %.80r)",
                    scope_id, refusal, pod_spec.get("namespace"), pod_spec.get("kubeconfig"),
                )  # fmt: skip
                raise DeployFailed(refusal)
            with admission.parked():  # a cold route waits on Kubernetes, not on Redis
                info = await self._k8s.deploy(
                    scope_id=scope_id, deploy_ver=version, pod_spec=pod_spec,
                    identity=self._identity,
                )  # fmt: skip
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            self._deploys_done.labels(kind, "cancelled" if cancelled else "failed").inc()
            with contextlib.suppress(Exception):
                await self._state.drop_placeholder(scope_id, placeholder)
            if isinstance(exc, DeployFailed | asyncio.CancelledError):
                raise
            raise DeployFailed(f"scope {scope_id}: deploy failed: {exc}") from exc
        self._deploy_seconds.labels(kind).observe(time.perf_counter() - started)
        warm = warm or (requester is not None and requester.gone)
        try:
            await self._state.register(
                scope_id=scope_id,
                pod_id=info.pod_id,
                placeholder=placeholder,
                pod_sse_url=info.pod_sse_url,
                pod_ip=info.pod_ip,
                namespace=info.namespace,
                deploy_ver=version,
                warm=warm,
            )
        except BaseException:
            # Ready in Kubernetes but not in Redis: delete it rather than leak it
            self._deploys_done.labels(kind, "unregistered").inc()
            await self._discard_pod(scope_id, info, placeholder)
            raise
        self._deploys_done.labels(kind, "ok").inc()
        with contextlib.suppress(Exception):  # followers also poll; the signal only speeds up
            await self._notifier.publish(registered_channel(scope_id), info.pod_id)
        log.info(
            "scope %s: pod %s registered (%s)", scope_id, info.pod_id, "warm" if warm else "in use"
        )
        return {"pod_id": info.pod_id, "pod_sse_url": info.pod_sse_url, "deploy_ver": version}

    async def _discard_pod(self, scope_id: str, info: PodDeployInfo, placeholder: str) -> None:
        with contextlib.suppress(Exception):
            await self._k8s.delete(info.pod_id, info.namespace)
        with contextlib.suppress(Exception):
            await self._state.drop_placeholder(scope_id, placeholder)

    async def _follow(self, call: _Acquire, since: float) -> dict[str, str]:
        """Wait in the follower room for the leader's pod (registered since ``since``)."""
        scope_id, request_id = call.scope_id, call.request_id
        limit = max(int(call.pool_config.get("pod_concurrency", 1)) - 1, 0)
        hold = math.ceil(call.ready_timeout) + FOLLOWER_MARGIN
        loop = asyncio.get_running_loop()
        entered = loop.time()
        deadline = entered + hold
        try:
            # inside the try: a cancellation while the gate's reply is in flight still gives
            # the seat back (ZREM of a seat we never got is harmless)
            if not await self._state.take_follower_seat(scope_id, request_id, hold, limit):
                raise DeployInProgress(
                    f"scope {scope_id}: a deploy is running and its room is full"
                )
            async with self._notifier.listen(registered_channel(scope_id)) as listener:
                while True:
                    # the leader may bring a pod registered before we started (its own, its
                    # lock not yet released; or one it found registered since it started)
                    leader_started = await self._leader_started_at(scope_id)
                    if leader_started is not None:
                        since = min(since, leader_started)
                    fresh = await self._registered_since(scope_id, since)
                    if fresh is not None:
                        return fresh
                    if not await self._deploy_in_flight(scope_id):
                        # the leader is done and brought nothing: its deploy failed
                        fresh = await self._registered_since(scope_id, since)
                        if fresh is not None:
                            return fresh
                        raise DeployFailed(f"scope {scope_id}: the leader's deploy failed")
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise MaxPodsReached(f"scope {scope_id}: no pod within {hold} s")
                    with admission.parked():  # waits on the leader, holds no connection
                        await listener.wait(min(FOLLOWER_POLL, remaining))
        finally:
            self._follower_waits.observe(loop.time() - entered)
            with contextlib.suppress(Exception):
                await self._state.leave_follower_seat(scope_id, request_id)

    async def _leader_started_at(self, scope_id: str) -> float | None:
        """When the current deploy leader's acquire started (Redis seconds, from its lock
        token), None without a leader: every pod it brings was registered at or after that."""
        token = await self._state.redis.get(deploy_lock_key(scope_id))
        if token is None:
            return None
        _, at, started = str(token).rpartition("@")
        try:
            return float(started) if at else math.inf
        except ValueError:
            return math.inf  # not our token format: nothing known, nothing widened

    async def _deploy_in_flight(self, scope_id: str) -> bool:
        """A leader holds the lock, or a placeholder is taken (a caller on its way to the lock,
        or a warm deploy)."""
        if await self._state.redis.exists(deploy_lock_key(scope_id)):
            return True
        return bool(await self._state.deploying(scope_id))

    async def _registered_since(self, scope_id: str, since: float) -> dict[str, str] | None:
        """The newest in-use pod of the scope registered since ``since`` (Redis seconds)."""
        for pod_id in await self._state.pods_registered_since(scope_id, since):
            info = await self._state.pod_info(pod_id)
            if info.get("pod_sse_url") and info.get("phase") == "in_use":
                return {
                    "pod_id": pod_id,
                    "pod_sse_url": info["pod_sse_url"],
                    "deploy_ver": info.get("deploy_ver", ""),
                }
        return None

    # --- the rest of the facade ----------------------------------------------------------------

    async def idle_consider(self, pod_id: str, scope_id: str) -> dict[str, bool]:
        return {"transitioned_to_idle": await self._state.release(scope_id, pod_id)}

    async def set_rule_pod_budget(self, rule_id: str, limit: int) -> None:
        await self._state.set_rule_pod_budget(rule_id, limit)

    async def update_pool_config(
        self,
        scope_id: str,
        pool_config: dict[str, int],
        pod_spec: dict[str, Any] | None = None,
        *,
        generation: int | None = None,
    ) -> dict[str, bool]:
        missing = [f for f in POOL_CONFIG_FIELDS if f not in pool_config]
        if missing:
            raise ValueError(f"pool_config lacks {', '.join(missing)}")
        config = {f: int(pool_config[f]) for f in POOL_CONFIG_FIELDS}
        version = spec_fields.deploy_ver(pod_spec) if pod_spec is not None else None
        updated = await self._state.write_pool_config(
            scope_id, config, deploy_ver=version, pod_spec=pod_spec, generation=generation
        )
        return {"updated": updated}

    async def expire_scope(self, scope_id: str) -> bool:
        return await self._state.expire_scope(scope_id)

    async def cleanup(self, namespace: str | None = None, label_selector: str | None = None) -> int:
        """Delete AgentServer pods matching the selector (the component label and the
        existence of our scope label always ANDed in: another tool's AgentServer is never
        ours to delete). Redis is not touched: watch and reconcile notice the deleted pods."""
        ns = namespace or self._default_namespace
        # ValueError for a selector we do not accept; what Kubernetes gets is its canonical
        # form, so the API server never refuses (502) what we validated (400)
        terms = parse_label_selector(label_selector or "")
        selector = ",".join([OWN_PODS_SELECTOR, *(term.render() for term in terms)])
        pods = await self._k8s.list_pods(ns, selector)
        gate = asyncio.Semaphore(CLEANUP_CONCURRENCY)

        async def delete(pod_id: str) -> bool:
            async with gate:
                return await self._k8s.delete(pod_id, ns)

        deleted = await asyncio.gather(*(delete(p.pod_id) for p in pods))
        return sum(1 for d in deleted if d)

    async def close(self) -> None:
        """Let running deploys finish or clean up (they give back their placeholders)."""
        await self._deploys.wait()
