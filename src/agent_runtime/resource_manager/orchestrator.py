"""Acquire a pod for a scope: a warm one, or a place in a cold deploy — as many deploys at once
as the waiting demand needs.

A cold acquire (no warm pod) claims in one step (deploy_claim.lua, race-free across
replicas): it follows a deploy in flight whose follower room has a free seat (each deploy's
pod holds its leader and ``pod_concurrency - 1`` followers), else leads a deploy of its own —
one whose leader's lease lapsed (with the pod that leader created: adopted once Ready,
deleted if it fails), or a new one — within max_pods, the pod budgets and the scope's deploy
concurrency. So a cold burst that needs K pods makes K deploys in parallel. Each deploy has
its own lease (``lock:rm:deploy:{sid}:{deploy id}``, lease.py), its own pod record and its own
follower room; its id is the demand's (the route's request id), so a duplicate of a request
joins the deploy it already leads instead of making another. A follower that sees its
leader's lease lapse runs its acquire again: the next claim takes that deploy over. Followers
never take over a failed deploy: the leader leaves a notice (same image, same failure). A
caller waits at most its own deadline (``ready_timeout + FOLLOWER_MARGIN`` from when it first
asked), once, however many rounds it takes. Hazard: every exit path must give back what it
took — the placeholder, the follower seat, the lease — and a pod created by a failed deploy
is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import uuid
from collections.abc import Mapping
from typing import Any

from agent_runtime import admission, spec_fields
from agent_runtime.jobs import BackgroundTasks
from agent_runtime.metrics import Metrics
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.cleanup import BulkCleanup
from agent_runtime.resource_manager.deploy_state import DeployState, lock_token
from agent_runtime.resource_manager.deployer import Deployer, Requester
from agent_runtime.resource_manager.followers import (
    AcquireCall,
    FollowerRoom,
    LeaderGone,
    OnReady,
)
from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.lease import DeployLease
from agent_runtime.resource_manager.models import (
    AcquiredPod,
    DeployBounds,
    DeployFailed,
    DeployInProgress,
    DeployTimedOut,
    IdleTransition,
    LeaseLost,
    MaxPodsReached,
    PodBudgetReached,
    PoolConfigUpdate,
)
from agent_runtime.resource_manager.pod_events import PodEventSink
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state_values import DeployClaim, OrphanPod
from agent_runtime.resource_manager.warm_policy import WARM_POOLS
from agent_runtime.tracing import SCOPE_ID, Tracing

log = logging.getLogger(__name__)

LOCK_MARGIN = 30  # seconds a recorded pod outlives ready_timeout
DEFAULT_DEPLOY_LEASE = 5.0
DEFAULT_SCOPE_DEPLOY_CONCURRENCY = 100  # cold deploys of one scope at once
MAX_ROUNDS = 20  # acquire rounds of one call (takeovers, lost leases): bounded even so
POOL_CONFIG_FIELDS = ("min_idle_pods", "max_pods", "pod_ttl", "pod_concurrency")
ACQUIRE_SOURCE = "agent_runtime.acquire.source"  # the acquires metric's label, on the span


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
        deploy_lease: float = DEFAULT_DEPLOY_LEASE,
        instance_id: str = "",
        scope_deploy_concurrency: int = DEFAULT_SCOPE_DEPLOY_CONCURRENCY,
        tracing: Tracing | None = None,
        events: PodEventSink | None = None,
    ) -> None:
        """``bounds``: where a deploy may go (the wiring passes the settings'; None: anywhere,
        for tests that build an orchestrator by hand); ``identity`` signs every pod (and completes
        the identity of a dead leader's pod it takes over). ``deploy_lease``: seconds a deploy's
        claim lives unless renewed (AGENT_RUNTIME_DEPLOY_LEASE). ``instance_id``: named in
        the deploy lock's token, so an operator sees which replica leads a deploy.
        ``scope_deploy_concurrency``: cold deploys of one scope at once
        (AGENT_RUNTIME_SCOPE_DEPLOY_CONCURRENCY). ``tracing``: spans of acquire, deploy and
        follower wait (off unless given). ``events``: where a deploy records the pod's
        Deployed / Adopted event (``pod_events.py``; None: nowhere)."""
        metrics = metrics or Metrics()
        tracing = tracing or Tracing()
        self._tracing = tracing
        self._acquired = metrics.acquires
        self._claims = metrics.deploy_claims
        self._state = state
        self._deploy_state = DeployState(state)
        self._k8s = k8s
        # the operator's bulk delete and its dry run (the facade's cleanup calls)
        self.cleanup = BulkCleanup(
            k8s=k8s,
            default_namespace=default_namespace,
            namespaces=bounds.namespaces if bounds is not None else None,
        )
        self._deployer = Deployer(
            state=state,
            deploys=self._deploy_state,
            k8s=k8s,
            notifier=notifier,
            default_namespace=default_namespace,
            bounds=bounds,
            metrics=metrics,
            lease=deploy_lease,
            identity=identity,
            tracing=tracing,
            events=events,
        )
        self._followers = FollowerRoom(
            state=state,
            deploys=self._deploy_state,
            notifier=notifier,
            waits=metrics.follower_waits,
            deploy_lease=deploy_lease,
            seat_hold=math.ceil(deploy_lease),
            tracing=tracing,
        )
        self._deploys = BackgroundTasks()
        self.deploy_lease = deploy_lease
        self.scope_deploy_concurrency = scope_deploy_concurrency
        self._instance_id = instance_id

    @property
    def placeholder_ttl(self) -> int:
        """Seconds a new placeholder lives before its deployer first renews it."""
        return math.ceil(self.deploy_lease)

    def drain(self) -> None:
        """The replica is stopping: followers leave their seats at their next look (their
        routes were answered already); deploys run on, within the stop bound."""
        self._followers.stopping = True

    # --- acquire -------------------------------------------------------------------------------

    async def acquire(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        pool_config: Mapping[str, int | str],
        request_id: str,
        *,
        on_ready: OnReady | None = None,
        rule_id: str = "",
        rule_pod_budget: int = 0,
        asked_at: float | None = None,
        demand_id: str = "",
    ) -> AcquiredPod:
        # the slow path's own span: the deploy or follower wait under it (no-op when off)
        with self._tracing.span("acquire", attributes={SCOPE_ID: scope_id}) as span:
            source = "failed"
            try:
                call = AcquireCall(
                    scope_id,
                    pod_spec,
                    pool_config,
                    request_id,
                    0.0,
                    on_ready,
                    rule_id,
                    rule_pod_budget,
                    asyncio.get_running_loop().time() if asked_at is None else asked_at,
                    demand_id,
                )
                result, source = await self._acquire(call)
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
            except DeployTimedOut:
                source = "timeout"
                raise
            finally:
                self._acquired.labels(source).inc()
                span.set_attribute(ACQUIRE_SOURCE, source)

    async def _acquire(self, call: AcquireCall) -> tuple[AcquiredPod, str]:
        """The pod and where it came from: replay, warm, deploy or follower."""
        scope_id, request_id = call.scope_id, call.request_id
        cached = await self._state.cached_result(scope_id, request_id)
        if cached is not None:
            return cached, "replay"
        call = dataclasses.replace(call, started_at=await self._state.now())
        wrote_config = False
        for _ in range(MAX_ROUNDS):
            if call.remaining() <= 0:
                raise call.expired()
            token = f"{request_id}:{uuid.uuid4().hex[:8]}"
            # a warm pod, or "cold": nothing is reserved here (the claim reserves a slot)
            outcome = await self._state.acquire(
                scope_id,
                request_id,
                token,
                self.placeholder_ttl,
                rule_id=call.rule_id,
                rule_pod_budget=call.rule_pod_budget,
                cold_claim=True,
            )
            if outcome.action in ("cached", "reuse"):
                assert outcome.pod is not None
                return outcome.pod, "replay" if outcome.action == "cached" else "warm"
            if outcome.action == "no_config":
                if wrote_config:
                    raise DeployFailed(f"scope {scope_id}: pool config vanished during acquire")
                await self.update_pool_config(scope_id, call.pool_config, call.pod_spec)
                wrote_config = True
                continue
            lock = lock_token(self._instance_id, call.started_at, call.deploy_id)
            try:
                claim = await self._claim(call, token, lock)
                if claim.action == "follow":
                    return await self._followers.follow(call, claim.deploy_id), "follower"
                if claim.action == "lead":
                    return await self._deploy(call, claim, lock)
                if claim.action in ("busy", "coming"):
                    # the scope deploys all it may at once, or a pod is on its way: the route
                    # waits (its slot reserved) and asks again when a pod registers
                    raise DeployInProgress(f"scope {scope_id}: its deploys are all under way")
                raise self._refusal(call, claim)  # no new pod, and none is on its way
            except (LeaderGone, LeaseLost) as exc:
                log.info("scope %s: %s; acquiring again", scope_id, exc)
        raise DeployFailed(f"scope {scope_id}: no pod after {MAX_ROUNDS} acquire rounds")

    @staticmethod
    def _refusal(call: AcquireCall, claim: DeployClaim) -> Exception:
        if claim.action == "max_reached":
            return MaxPodsReached(f"scope {call.scope_id} is at max_pods")
        budget = claim.budget or "global"
        return PodBudgetReached(
            f"scope {call.scope_id}: the {budget} pod budget is reached", budget=budget
        )

    async def _claim(self, call: AcquireCall, token: str, lock: str) -> DeployClaim:
        """Follow or lead (deploy_claim.lua); a claim whose reply never came back (the caller
        cancelled, the connection dropped) gives back what it may have taken: the placeholder
        (``token``: it would hold a slot of max_pods), and the lock of the deploy we would
        lead (a seat it may have taken lapses with its lease)."""
        try:
            claim = await self._deploy_state.claim_deploy(
                call.scope_id,
                call.deploy_id,
                token=lock,
                lease=self.deploy_lease,
                placeholder_token=token,
                member=call.request_id,
                seat_hold=self._followers.seat_hold,
                room_ttl=math.ceil(call.ready_timeout) + LOCK_MARGIN,
                concurrency=self.scope_deploy_concurrency,
                pod_concurrency=max(int(call.pool_config.get("pod_concurrency", 1)), 1),
                rule=(call.rule_id, call.rule_pod_budget),
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._deploy_state.drop_placeholders_of(call.scope_id, token)
            # the deploy we would lead: our demand's id, or this attempt's own when a taker
            # holds that id (a deploy taken over lapses with its lease)
            for deploy_id in (call.deploy_id, token):
                with contextlib.suppress(Exception):
                    await self._deploy_state.end_deploy_lease(
                        call.scope_id, deploy_id, lock, "none", self.deploy_lease
                    )
            raise
        self._claims.labels(claim.action).inc()
        return claim

    async def _deploy(
        self, call: AcquireCall, claim: DeployClaim, lock: str
    ) -> tuple[AcquiredPod, str]:
        scope_id = call.scope_id
        assert claim.placeholder is not None
        lease = DeployLease(
            self._deploy_state,
            scope_id,
            claim.placeholder,
            seconds=self.deploy_lease,
            lock_token=lock,
            deploy_id=claim.deploy_id,
            record_ttl=math.ceil(call.ready_timeout) + LOCK_MARGIN,
        )
        requester = Requester()
        # Our own task: a caller that disconnects (or whose deadline passes) does not abort a
        # deploy half-way (that would leave a pod nobody tracks, or a lease given back while
        # its deploy still runs).
        task = self._deploys.spawn(
            self._lead(call, lease, claim.orphan, requester), name=f"deploy:{scope_id}"
        )
        try:
            # the route waits on Kubernetes, not on Redis: its place at the edge is given back
            # meanwhile (the deploy task's own parking is not the route's: another task)
            with admission.parked():
                done, _ = await asyncio.wait({task}, timeout=max(call.remaining(), 0.0))
        except asyncio.CancelledError:
            requester.gone = True  # the pod, once Ready, goes to the warm pool
            raise
        if task not in done:
            requester.gone = True
            raise call.expired()
        return task.result(), "deploy"

    async def _lead(
        self,
        call: AcquireCall,
        lease: DeployLease,
        orphan: OrphanPod | None,
        requester: Requester,
    ) -> AcquiredPod:
        scope_id = call.scope_id
        outcome = "failed"  # the followers' notice: same image, same failure
        try:
            result = await self.deploy_and_register(
                scope_id,
                call.pod_spec,
                lease,
                warm=False,
                requester=requester,
                orphan=orphan,
            )
            outcome = "ok"
            await self._state.cache_result(scope_id, call.request_id, result)
            if call.on_ready is not None and not requester.gone:
                try:  # still under the lease: nobody decides to deploy before the pod is seen
                    await call.on_ready(result)
                except Exception as exc:  # the caller gets the pod and publishes it itself
                    log.warning("scope %s: on_ready for %s failed: %s", scope_id, result, exc)
            return result
        except (LeaseLost, asyncio.CancelledError):
            outcome = "none"  # taken over, or stopped: followers take over, never fail
            raise
        finally:
            with contextlib.suppress(Exception):
                await lease.end(outcome)

    async def deploy_and_register(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        placeholder: str | DeployLease,
        *,
        warm: bool,
        requester: Requester | None = None,
        orphan: OrphanPod | None = None,
    ) -> AcquiredPod:
        """See ``Deployer.deploy_and_register`` (autoscale's warm deploys come here too)."""
        return await self._deployer.deploy_and_register(
            scope_id, pod_spec, placeholder, warm=warm, requester=requester, orphan=orphan
        )

    # --- the rest of the facade ----------------------------------------------------------------

    async def idle_consider(self, pod_id: str, scope_id: str) -> IdleTransition:
        return IdleTransition(await self._state.release(scope_id, pod_id))

    async def set_rule_pod_budget(self, rule_id: str, limit: int) -> None:
        await self._state.set_rule_pod_budget(rule_id, limit)

    async def update_pool_config(
        self,
        scope_id: str,
        pool_config: Mapping[str, int | str],
        pod_spec: dict[str, Any] | None = None,
        *,
        generation: int | None = None,
    ) -> PoolConfigUpdate:
        missing = [f for f in POOL_CONFIG_FIELDS if f not in pool_config]
        if missing:
            raise ValueError(f"pool_config lacks {', '.join(missing)}")
        config: dict[str, int | str] = {f: int(pool_config[f]) for f in POOL_CONFIG_FIELDS}
        mode = str(pool_config.get("warm_pool") or "static")
        config["warm_pool"] = mode if mode in WARM_POOLS else "static"
        version = spec_fields.deploy_ver(pod_spec) if pod_spec is not None else None
        updated = await self._state.write_pool_config(
            scope_id, config, deploy_ver=version, pod_spec=pod_spec, generation=generation
        )
        return PoolConfigUpdate(updated)

    async def expire_scope(self, scope_id: str) -> bool:
        return await self._state.expire_scope(scope_id)

    async def close(self) -> None:
        """Let running deploys finish or clean up (they give back their placeholders)."""
        self._followers.stopping = True
        await self._deploys.wait()
