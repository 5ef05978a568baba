"""Read-only views of the session side's state: the admin views (``/api/session/admin/...``)
and the state gauges ``/metrics`` reads at scrape.

Nothing here writes, and nothing on a route's path reads through it. Each call is bounded: an
HSCAN page, a pipeline per page of scopes or per scope, an SSCAN of ``pods:registered``. Key
names come from ``state``'s builders; registry entries are read with ``scope_state``'s decoder.
"""

from __future__ import annotations

from typing import Any, cast

from agent_runtime.session_manager.scope_state import ScopeState, registry_ids
from agent_runtime.session_manager.state import (
    SCOPE_REGISTRY_KEY,
    SessionState,
    pod_info_key,
    pod_sessions_key,
    previous_pod_key,
    registry_pages,
    scope_config_key,
    scope_pods_key,
    scope_reserved_key,
    scope_sessions_key,
    scope_waiters_key,
    session_key,
)


class SessionViews:
    """What an operator and the gauges see of sessions, scopes and pods."""

    def __init__(self, state: SessionState, scopes: ScopeState) -> None:
        self._state = state
        self._scopes = scopes
        self.redis = state.redis

    # --- the gauges ----------------------------------------------------------------------------

    async def live_sessions(self) -> int:
        """Sessions of every registered scope (each scope's set: one pipeline a page)."""
        live = 0
        async for page in registry_pages(self.redis):
            live += sum(await self.scope_session_counts(page))
        return live

    async def known_scopes(self) -> list[str]:
        """Every scope that ever resolved (the registry)."""
        return list(await self._scopes.known_scopes())

    async def scope_session_counts(self, scope_ids: list[str]) -> list[int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in scope_ids:
                pipe.scard(scope_sessions_key(scope_id))
            return [int(n) for n in await pipe.execute()]

    async def retiring_pods(self) -> int:
        """Registered pods that are no longer placement candidates (an older version — the
        "sunset" pods — or one being handed back): they keep their sessions, take no new
        ones."""
        pods = await self._state.registered_pods()
        if not pods:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id, pod_id in pods:
                pipe.zscore(scope_pods_key(scope_id), pod_id)
            return sum(1 for score in await pipe.execute() if score is None)

    # --- the admin views -----------------------------------------------------------------------

    async def scopes_page(self, cursor: int, limit: int) -> tuple[int, list[tuple[str, str, str]]]:
        """One page of the scope registry: (next cursor, 0 at the end; [(sid, group, bot)]).
        HSCAN's COUNT is a hint, so a page may hold a little more or less than ``limit``."""
        next_cursor, page = await self.redis.hscan(SCOPE_REGISTRY_KEY, cursor, count=limit)
        entries = cast(dict[str, str], page).items()
        return int(next_cursor), [(sid, *registry_ids(value)) for sid, value in entries]

    async def registered_pods_by_scope(self, scope_ids: set[str]) -> dict[str, list[str]]:
        """Registered pod ids of the given scopes (candidates or not)."""
        return await self._scopes.registered_pods_by_scope(scope_ids)

    async def scope_summaries(self, scope_ids: list[str]) -> list[dict[str, Any]]:
        """Per scope: live sessions, queue seats and reservations (live ones: their deadline
        not passed), candidate pods, whether the resolve cache holds its policy."""
        if not scope_ids:
            return []
        seconds, micros = await self.redis.time()
        now = seconds + micros / 1_000_000
        async with self.redis.pipeline(transaction=False) as pipe:
            for sid in scope_ids:
                pipe.scard(scope_sessions_key(sid))
                pipe.zcount(scope_waiters_key(sid), now, "+inf")
                pipe.zcount(scope_reserved_key(sid), now, "+inf")
                pipe.zcard(scope_pods_key(sid))
                pipe.hgetall(scope_config_key(sid))
            replies = await pipe.execute()
        out = []
        for i, sid in enumerate(scope_ids):
            sessions, waiters, reserved, candidates, config = replies[5 * i : 5 * i + 5]
            out.append(
                {
                    "scope_id": sid,
                    "live_sessions": int(sessions),
                    "waiters": int(waiters),
                    "reserved": int(reserved),
                    "candidate_pods": int(candidates),
                    "config": config or None,
                }
            )
        return out

    async def scope_detail(self, scope_id: str) -> dict[str, Any]:
        """Candidates in arrival order with their sessions, the registered pods that are not
        candidates (retiring: sunset / being handed back), the queue and the reservations."""
        candidates = await self._state.candidate_pods(scope_id)
        registered = (await self.registered_pods_by_scope({scope_id})).get(scope_id, [])
        pods = sorted(set(registered) | set(candidates), key=lambda p: (p not in candidates, p))
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pods:
                pipe.scard(pod_sessions_key(scope_id, pod_id))
            pipe.zrange(scope_waiters_key(scope_id), 0, 99, withscores=True)
            pipe.zrange(scope_reserved_key(scope_id), 0, 99, withscores=True)
            pipe.scard(scope_sessions_key(scope_id))
            replies = await pipe.execute()
        counts, (waiters, reserved, sessions) = replies[: len(pods)], replies[len(pods) :]
        return {
            "live_sessions": int(sessions),
            "pods": [
                {"pod_id": p, "candidate": p in candidates, "sessions": int(n)}
                for p, n in zip(pods, counts, strict=True)
            ],
            "waiters": [{"request_id": m, "deadline": d} for m, d in waiters],
            "reserved": [{"request_id": m, "deadline": d} for m, d in reserved],
        }

    async def session_view(self, session_id: str, scope_id: str = "") -> dict[str, Any] | None:
        """The binding and the tombstone in ``scope_id``, or else in the scope the
        session-scope index names (both are kept per scope; the index outlives a binding
        whose pod died by a session ttl at least)."""
        scope = scope_id or await self._state.session_scope(session_id) or ""
        if not scope:
            return None
        binding = cast(dict[str, str], await self.redis.hgetall(session_key(scope, session_id)))
        binding.pop("index_until", None)  # the index's bookkeeping, not the binding
        tombstone = await self.redis.get(previous_pod_key(scope, session_id))
        if not binding and tombstone is None:
            return None
        return {"binding": binding or None, "previous_pod_id": tombstone}

    async def pod_registrations(self, pod_id: str, scope_id: str) -> list[dict[str, Any]]:
        """The pod's registration in its scope (the resource manager's record names it; none
        when ``scope_id`` is empty or the scope does not reference the pod), with its sessions
        there and whether it is a candidate."""
        scopes = [scope_id] if scope_id else []
        async with self.redis.pipeline(transaction=False) as pipe:
            for sid in scopes:
                pipe.scard(pod_sessions_key(sid, pod_id))
                pipe.zscore(scope_pods_key(sid), pod_id)
                pipe.hgetall(pod_info_key(sid, pod_id))
            replies = await pipe.execute()
        views = [
            {
                "scope_id": sid,
                "sessions": int(replies[3 * i]),
                "candidate": replies[3 * i + 1] is not None,
                "info": replies[3 * i + 2],
            }
            for i, sid in enumerate(scopes)
        ]
        return [v for v in views if v["sessions"] or v["candidate"] or v["info"]]
