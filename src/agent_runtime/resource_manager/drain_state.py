"""Drains in Redis (``drains.py``'s): a pod's drain hash and the index of draining pods, begun
by one script (``drain_begin.lua``: marked and out of the warm pool together) and ended by the
pod's purge (``purge.lua`` drops both). Keys from ``state.py``'s builders; replies decoded here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from agent_runtime.resource_manager.pool_jobs_state import BATCH, SCRIPT_BATCH
from agent_runtime.resource_manager.state import (
    ResourceState,
    draining_key,
    hash_of,
    pod_drain_key,
    pod_idle_since_key,
    pod_info_key,
    scope_draining_key,
    scope_idle_key,
)
from agent_runtime.resource_manager.state_values import Drain, DrainBegun
from agent_runtime.scope_buckets import BUCKETS, bucket_tag


def _drain_of(pod_id: str, raw: dict[str, str]) -> Drain | None:
    if not raw or raw.get("state") not in ("pending", "draining"):
        return None
    return Drain(
        pod_id=pod_id,
        scope_id=raw.get("scope_id", ""),
        state="pending" if raw["state"] == "pending" else "draining",
        trigger=raw.get("trigger", ""),
        deadline=float(raw.get("deadline") or 0.0),
        since=float(raw.get("since") or 0.0),
    )


class DrainState:
    """The drains over a ``ResourceState``'s client."""

    def __init__(self, state: ResourceState) -> None:
        self.redis = state.redis
        self._state = state
        self._begin = state.script("drain_begin")
        self._read_many = state.script("read_many")

    async def begin(
        self,
        pod_id: str,
        scope_id: str,
        *,
        trigger: str,
        pending: bool,
        seconds: float | None = None,
        deadline: float | None = None,
    ) -> DrainBegun | None:
        """Mark the pod draining (or pending), its deadline ``seconds`` from now (Redis clock)
        or at ``deadline`` (Unix seconds); None: the pod is not registered (in ``scope_id``)."""
        assert (seconds is None) != (deadline is None)
        reply = await self._begin(
            keys=[pod_info_key(scope_id, pod_id), pod_drain_key(scope_id, pod_id),
                  pod_idle_since_key(scope_id, pod_id), scope_idle_key(scope_id)],
            args=[pod_id, "" if seconds is None else repr(float(seconds)),
                  "" if deadline is None else repr(float(deadline)), trigger,
                  "pending" if pending else "draining"],
        )  # fmt: skip
        if reply[0] == "unknown":
            return None
        # into the draining pods after (another slot): a crash between, reconcile adds it.
        # LT: a deadline only comes forward, and concurrent calls' writes may come in any order
        await self.redis.zadd(scope_draining_key(scope_id), {pod_id: float(reply[2])}, lt=True)
        return DrainBegun(
            started=reply[0] == "started",
            state="pending" if reply[1] == "pending" else "draining",
            deadline=float(reply[2]),
            trigger=str(reply[3] or ""),
        )

    async def drain_of(self, pod_id: str, scope_id: str | None = None) -> Drain | None:
        """The pod's drain; without ``scope_id`` the pod index names the scope."""
        if scope_id is None and (scope_id := await self._state.scope_of_pod(pod_id)) is None:
            return None
        raw = cast(dict[str, str], await self.redis.hgetall(pod_drain_key(scope_id, pod_id)))
        return _drain_of(pod_id, raw)

    async def draining_pods(self) -> list[str]:
        """Every pod under a drain, soonest deadline first."""
        found = [entry for entries in (await self._entries()).values() for entry in entries]
        return [pod for pod, _ in sorted(found, key=lambda x: (x[1], x[0]))]

    async def drop_stale(self, stale: set[str]) -> int:
        """Entries of the draining pods that have no drain (a crash between a purge and the
        entry's removal; a drain begun as its pod was purged) leave; each checked again
        after its removal: a drain begun meanwhile is put back. How many left."""
        dropped = 0
        for key, entries in (await self._entries()).items():
            for pod_id, _ in entries:
                if pod_id not in stale:
                    continue
                await self.redis.zrem(key, pod_id)
                if (drain := await self.drain_of(pod_id)) is not None:
                    await self.redis.zadd(
                        scope_draining_key(drain.scope_id), {pod_id: drain.deadline}
                    )
                else:
                    dropped += 1
        return dropped

    async def index_drains(self, pods: Mapping[str, str]) -> int:
        """Reconcile's repair: every drain of these pods (pod id → scope id) in the draining
        pods (a crash between drain_begin and the entry). How many were added."""
        keys = [pod_drain_key(s, p) for p, s in pods.items()]
        pod_ids = list(pods)
        added = 0
        for positions in self._state.key_slices(keys, SCRIPT_BATCH):
            raws = await self._read_many(keys=[keys[i] for i in positions], args=["HGETALL"])
            for i, flat in zip(positions, raws, strict=True):
                if (drain := _drain_of(pod_ids[i], hash_of(flat))) is not None:
                    key = scope_draining_key(drain.scope_id or pods[pod_ids[i]])
                    added += int(await self.redis.zadd(key, {drain.pod_id: drain.deadline}) or 0)
        return added

    async def _entries(self) -> dict[str, list[tuple[str, float]]]:
        """Each bucket's draining pods and deadlines: every bucket's first BATCH in one
        pipeline, then the rest of a bucket that holds more (ZRANGE in slices of BATCH)."""
        keys = [draining_key(bucket_tag(bucket)) for bucket in range(BUCKETS)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zrange(key, 0, BATCH - 1, withscores=True)
            pages = cast(list[list[tuple[str, float]]], await pipe.execute())
        found: dict[str, list[tuple[str, float]]] = {}
        for key, page in zip(keys, pages, strict=True):
            found[key] = list(page)
            start = len(page)
            while len(page) == BATCH:
                page = cast(
                    list[tuple[str, float]],
                    await self.redis.zrange(key, start, start + BATCH - 1, withscores=True),
                )
                found[key] += page
                start += len(page)
        return found

    async def forget(self, scope_id: str, pod_id: str) -> None:
        """A pod in the draining pods without a drain (a crash between a purge and its
        removal here, or a drain begun as the pod was purged) leaves it; checked again after:
        a drain begun meanwhile is put back."""
        await self.redis.zrem(scope_draining_key(scope_id), pod_id)
        if (drain := await self.drain_of(pod_id, scope_id)) is not None:
            await self.redis.zadd(scope_draining_key(scope_id), {pod_id: drain.deadline})

    async def drains(self, pod_ids: list[str]) -> list[Drain]:
        """The drains of these pods (one without a drain hash left out, or not indexed), their
        scopes from the pod index, then SCRIPT_BATCH a call (on a Redis Cluster one slot a
        call)."""
        scopes = await self._state.scopes_of_pods(pod_ids)
        indexed = [p for p in pod_ids if p in scopes]
        keys = [pod_drain_key(scopes[p], p) for p in indexed]
        found: list[Drain] = []
        for positions in self._state.key_slices(keys, SCRIPT_BATCH):
            raws = await self._read_many(keys=[keys[i] for i in positions], args=["HGETALL"])
            for i, flat in zip(positions, raws, strict=True):
                if (drain := _drain_of(indexed[i], hash_of(flat))) is not None:
                    found.append(drain)
        return found

    async def count(self) -> int:
        async with self.redis.pipeline(transaction=False) as pipe:
            for bucket in range(BUCKETS):
                pipe.zcard(draining_key(bucket_tag(bucket)))
            return sum(int(n) for n in await pipe.execute())
