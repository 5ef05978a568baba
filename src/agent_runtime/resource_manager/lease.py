"""A deploy's claim on a short lease: its placeholder and, for a route's (cold) deploy, that
deploy's lock (``lock:rm:deploy:{sid}:{deploy id}``: a scope runs many deploys at once),
renewed together (one ``deploy_lease`` script call) every lease / 3 while the deploy runs; the
pod it creates is recorded under the lock before the wait for Ready.

A replica that dies mid-deploy stops renewing: within one lease its lock and placeholder lapse,
the next cold claim of the scope takes the deploy over (``deploy_claim`` hands it the pod the
dead leader created) and reconcile no longer waits for a deploy that will never end. Hazard: a
leader whose renewals fail (Redis unreachable for a moment) goes on deploying — a failed
renewal is retried at the next tick, never an abort; the first renewal that gets through finds
its claim intact (or takes it again: nobody took it meanwhile) or lost (another leader holds
it, with the pod): the leader then registers nothing and deletes nothing, and its caller
follows the new leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.models import LeaseLost
from agent_runtime.resource_manager.state import placeholder_token

log = logging.getLogger(__name__)

RECORD_RETRY = 0.2  # seconds between tries to record a created pod while Redis hiccups


class DeployLease:
    """One deploy's claim. ``member``: its placeholder's current name (each renewal moves the
    deadline in it); ``lock_token``: the deploy lock's token ("" for a warm deploy, which has
    no lock and no pod record); ``deploy_id``: the cold deploy's id (its lock, record and
    follower room)."""

    def __init__(
        self,
        state: DeployState,
        scope_id: str,
        member: str,
        *,
        seconds: float,
        lock_token: str = "",
        deploy_id: str = "",
        record_ttl: int = 0,
    ) -> None:
        self._state = state
        self.scope_id = scope_id
        self.member = member
        self.placeholder_token = placeholder_token(member)
        self.lock_token = lock_token
        self.deploy_id = deploy_id
        self.seconds = seconds
        self._record_ttl = record_ttl
        self._pod: tuple[str, str, str] | None = None
        self._pod_cluster: str | None = None
        self.lost = False
        self.lost_to = ""  # "taken" or "no_room" (deploy_lease.lua), once lost
        self._closed = True

    @property
    def cold(self) -> bool:
        return bool(self.lock_token)

    async def renew(self) -> bool:
        """One renewal (with the pod, once recorded); False once the claim is lost."""
        if self.lost:
            return False
        renewal = await self._state.renew_deploy_claim(
            self.scope_id,
            self.placeholder_token,
            self.lock_token,
            self.seconds,
            deploy_id=self.deploy_id,
            pod=self._pod,
            record_ttl=self._record_ttl,
            cluster=self._pod_cluster,
        )
        if renewal.member is None:
            self.lost, self.lost_to = True, renewal.lost or "taken"
            return False
        self.member = renewal.member
        return True

    async def confirm(self) -> None:
        """The last look before registering: LeaseLost if another leader has the claim. Tried
        again while Redis hiccups, for one lease; then its error is raised (whether the pod is
        still ours cannot be told: the caller neither registers nor deletes it)."""
        await self._renewed_within(self.seconds)

    async def record_pod(
        self, pod_id: str, namespace: str, uid: str, *, cluster: str | None = None
    ) -> None:
        """The deploy's ``on_created``: the pod (this incarnation of the name: its uid, in
        ``cluster``) is recorded under our lock before its incarnation is signed and before
        the wait for Ready, so a leader taking over finds it where it runs and can tell it
        from a pod re-created under the name. Tried again while Redis hiccups, for one lease;
        LeaseLost when another leader holds the lock. Either failure makes the deploy delete
        the pod: nobody else knows it."""
        self._pod, self._pod_cluster = (pod_id, namespace, uid), cluster
        try:
            await self._renewed_within(self.seconds)
        except BaseException:
            self._pod = None
            raise

    async def _renewed_within(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + seconds
        while True:
            try:
                if await self.renew():
                    return
            except Exception as exc:
                if loop.time() + RECORD_RETRY >= give_up:
                    raise
                log.debug("scope %s: lease not renewed yet: %s", self.scope_id, exc)
                await asyncio.sleep(RECORD_RETRY)
                continue
            if self.lost_to == "no_room":
                raise LeaseLost(
                    f"scope {self.scope_id}: deploy {self.deploy_id}'s lease lapsed and the "
                    "scope has no room for it again",
                    taken=False,
                )
            raise LeaseLost(
                f"scope {self.scope_id}: deploy {self.deploy_id}'s lease was taken over"
            )

    async def give_back(self) -> None:
        """The placeholder and its budget units back (by token: whatever its current name)."""
        await self._state.drop_placeholders_of(self.scope_id, self.placeholder_token)

    async def end(self, outcome: str) -> None:
        """The lock back (a cold deploy): "ok" (the record, naming the registered pod, stays
        for its followers for one lease), "failed" (a notice for the followers, for one lease)
        or "none" (the record stays: whoever claims next takes the deploy over)."""
        if self.cold:
            await self._state.end_deploy_lease(
                self.scope_id, self.deploy_id, self.lock_token, outcome, self.seconds
            )

    @contextlib.asynccontextmanager
    async def kept(self) -> AsyncIterator[DeployLease]:
        """Renewed in the background while the block runs."""
        self._closed = False
        keeper = asyncio.create_task(self._keep(), name=f"deploy-lease:{self.scope_id}")
        try:
            yield self
        finally:
            self._closed = True
            keeper.cancel()
            await asyncio.wait([keeper], timeout=1.0)  # never swallows a cancel of our own

    async def _keep(self) -> None:
        # ends on `_closed`, not only on cancel: fakeredis absorbs a cancellation that lands
        # inside a command (see SlowRoute._keep_lease)
        while not self._closed:
            await asyncio.sleep(self.seconds / 3)
            if self._closed:
                return
            try:
                if not await self.renew():
                    log.warning("scope %s: deploy lease lost to another leader", self.scope_id)
                    return
            except Exception as exc:  # the next tick tries again; the deploy goes on
                log.info("scope %s: deploy lease not renewed: %s", self.scope_id, exc)
