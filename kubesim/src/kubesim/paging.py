"""LIST paging: ``limit`` and ``continue`` as the API server answers them.

A list with ``limit`` > 0 that does not fit gets ``metadata.continue``: a token for the next
page, with the same query, and ``metadata.remainingItemCount`` when the list has no label or
field selector (the real server cannot count the rest of a filtered list either). A list
without a token in its reply is complete. ``limit`` absent or 0: one page.

Tokens are the API server's (``storage.EncodeContinue``): unpadded base64url of
``{"v": "meta.k8s.io/v1", "rv": <resourceVersion of the first page>, "start": <key>}``, the
key relative to the list's prefix (``name\\x00`` in a namespace, ``namespace/name\\x00`` across
all), so pages run in etcd's key order and never repeat an item.

Later pages are read from the first page's snapshot, as the real server reads them from
etcd's history at that resourceVersion: whatever changed meanwhile, the pages together are
one consistent list. kubesim keeps no other history, so a token finds its snapshot only for
the query that made it, within ``ttl`` seconds, among the last ``keep`` lists in flight, and
not once the list's last page was served; else (or when the ``continue_expired`` fault fires)
the answer is 410 ``Expired`` with a token (``rv`` -1) that goes on from the current state, as
the real server answers a token whose revision was compacted. A token of the current
resourceVersion always works (nothing changed). A token that does not decode is 400
``invalid continue token: …``.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import posixpath
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubesim.errors import ApiError, bad_request

TOKEN_VERSION = "meta.k8s.io/v1"
CONTINUE_TTL = 300.0  # seconds: etcd's default compaction interval
KEEP_SNAPSHOTS = 16
INCONSISTENT_RV = -1
EXPIRED_MESSAGE = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter, or use the continue token in this "
    "response to retrieve the remainder of the results. Continuing with the provided token "
    "results in an inconsistent list - objects that were created, modified, or deleted "
    "between the time the first chunk was returned and now may show up in the list."
)

# (namespace or None, labelSelector, fieldSelector): a token is good for the query that made it
Query = tuple[str | None, str, str]


def encode_token(rv: int, start: str) -> str:
    raw = json.dumps({"v": TOKEN_VERSION, "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[int, str]:
    """``(rv, start key)``, or 400 ``invalid continue token: continue key is not valid…``."""

    def invalid(why: str = "") -> ApiError:
        return bad_request(f"invalid continue token: continue key is not valid{why}")

    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f": {exc}") from None
    if not isinstance(data, dict):
        raise invalid(": not an object")
    if data.get("v") != TOKEN_VERSION:
        raise invalid(f" server does not recognize this encoded key version: {data.get('v')}")
    rv, start = data.get("rv"), data.get("start")
    if not isinstance(rv, int) or isinstance(rv, bool) or rv == 0:
        raise invalid(": incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
    if not isinstance(start, str) or not start:
        raise invalid(": encoded start key empty")
    if posixpath.normpath("/" + start.lstrip("/")) != "/" + start.lstrip("/"):
        raise invalid(f": {start}")  # no climbing out of the list's prefix
    return rv, start


def expired(start: str) -> ApiError:
    """410: the token's snapshot is gone; the token in the Status goes on inconsistently."""
    return ApiError(
        410,
        "Expired",
        EXPIRED_MESSAGE,
        metadata={"continue": encode_token(INCONSISTENT_RV, start)},
    )


@dataclass
class Page:
    items: list[str]  # the items as JSON text
    resource_version: int
    continue_token: str | None
    remaining: int | None

    def list_text(self, kind: str) -> str:
        """The page as a ``<kind>`` (PodList, EventList …) body: its ListMeta and its items."""
        meta: dict[str, Any] = {"resourceVersion": str(self.resource_version)}
        if self.continue_token is not None:
            meta["continue"] = self.continue_token
        if self.remaining is not None:
            meta["remainingItemCount"] = self.remaining
        head = json.dumps({"kind": kind, "apiVersion": "v1", "metadata": meta})
        return f'{head[:-1]}, "items": [{", ".join(self.items)}]}}'


def parse_limit(raw: str | None) -> int:
    """``limit``: a whole number; absent, 0 or negative is no limit (one page)."""
    if not raw:
        return 0
    try:
        return max(int(raw), 0)
    except ValueError:
        raise bad_request(f'invalid value for limit: "{raw}": not an integer') from None


@dataclass
class _Snapshot:
    rv: int
    keys: list[str]  # sorted
    texts: list[str]
    taken: float


class Pager:
    """The snapshots of the paged lists in flight, and the pages cut from them."""

    def __init__(
        self,
        *,
        ttl: float = CONTINUE_TTL,
        keep: int = KEEP_SNAPSHOTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.keep = keep
        self._clock = clock
        self._snapshots: OrderedDict[tuple[int, Query], _Snapshot] = OrderedDict()

    def __len__(self) -> int:
        return len(self._snapshots)

    def clear(self) -> None:
        """Forget every snapshot (as a compaction): older tokens are 410 from now on."""
        self._snapshots.clear()

    def page(
        self,
        query: Query,
        *,
        limit: int,
        token: str | None,
        resource_version: int,
        listing: Callable[[], Iterable[tuple[str, Any]]],
        expire: Callable[[], bool] = lambda: False,
    ) -> Page:
        """The page ``limit`` (0: all the rest) and ``token`` (None: the first) ask for.

        ``listing`` gives the current matching items as ``(key, item)``, ``resource_version``
        is the store's now; ``expire`` is asked (once per continued page) whether a fault
        expires the token anyway.
        """
        now = self._clock()
        for key, old in list(self._snapshots.items()):
            if now - old.taken > self.ttl:
                del self._snapshots[key]
        start = ""
        snapshot: _Snapshot | None = None
        if token is not None:
            rv, start = decode_token(token)
            if expire():
                raise expired(start)
            if rv != INCONSISTENT_RV:
                snapshot = self._snapshots.get((rv, query))
                if snapshot is None and rv != resource_version:
                    raise expired(start)
        if snapshot is None:
            entries = sorted(listing(), key=lambda entry: entry[0])
            snapshot = _Snapshot(
                resource_version,
                [key for key, _ in entries],
                [json.dumps(item) for _, item in entries],
                now,
            )
        first = bisect.bisect_left(snapshot.keys, start)
        end = len(snapshot.keys) if limit <= 0 else min(len(snapshot.keys), first + limit)
        slot = (snapshot.rv, query)
        if end >= len(snapshot.keys):
            self._snapshots.pop(slot, None)  # the list is complete
            return Page(snapshot.texts[first:end], snapshot.rv, None, None)
        self._snapshots[slot] = snapshot
        self._snapshots.move_to_end(slot)
        while len(self._snapshots) > self.keep:
            self._snapshots.popitem(last=False)
        next_token = encode_token(snapshot.rv, snapshot.keys[end - 1] + "\x00")
        remaining = len(snapshot.keys) - end if query[1:] == ("", "") else None
        return Page(snapshot.texts[first:end], snapshot.rv, next_token, remaining)
