"""core/v1 Events: the store behind ``api_events.py``, bounded as the API server bounds them.

The API server keeps an event for ``--event-ttl`` (1 h by default) after its last write (an
etcd lease renewed by each write) and drops it then, whoever wrote it. Here: each event
expires ``ttl`` seconds after its last create or patch, and the store holds at most ``cap``
events: a create beyond it drops the event written longest ago first (as if its TTL ran
out; counted in ``evicted``), so an event storm costs bounded memory. Events are not
published to the watch history (no event watch is served).

A create is checked as the API server's validation does for what our clients send
(``metadata.name``, ``involvedObject.kind`` and ``.name``, ``involvedObject.namespace``
equal to the event's, ``reason`` and ``message`` within bounds) → 422 ``Invalid``. A patch
(merge or strategic merge: events carry no lists it would treat differently) may change
anything but ``metadata.name``, ``.namespace``, ``.uid`` and ``involvedObject`` → 422.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from kubesim.errors import already_exists, bad_request, invalid, not_found
from kubesim.labels import FieldRequirement, Selector, dns1123_subdomain_errors, fields_match
from kubesim.store import Obj, Store, new_uid, timestamp

DEFAULT_TTL = 3600.0  # seconds: the API server's --event-ttl default
DEFAULT_CAP = 10_000  # events kept at once
REASON_LIMIT = 128  # the API server refuses longer reasons
MESSAGE_LIMIT = 4096  # bytes of a message kubesim accepts (client-go sends at most 1024)

# the event fields the API server's field selectors know (``source`` is not: it is an object)
EVENT_FIELDS = (
    "metadata.name",
    "metadata.namespace",
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "type",
)
_FROZEN_META = ("name", "namespace", "uid", "creationTimestamp")


class EventStore:
    """Events by (namespace, name), oldest last write first; each bounded by ``ttl`` and the
    whole by ``cap``. ``clock``: monotonic seconds (the tests turn it)."""

    def __init__(
        self,
        store: Store,
        *,
        ttl: float = DEFAULT_TTL,
        cap: int = DEFAULT_CAP,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl <= 0 or cap <= 0:
            raise ValueError("the event ttl and cap must be > 0")
        self._store = store
        self.ttl = ttl
        self.cap = cap
        self._clock = clock
        self._events: OrderedDict[tuple[str, str], tuple[float, Obj]] = OrderedDict()
        self.evicted = 0  # dropped over the cap before their TTL

    def __len__(self) -> int:
        self._expire()
        return len(self._events)

    def clear(self) -> None:
        self._events.clear()

    def _expire(self) -> None:
        now = self._clock()
        while self._events:
            key, (expires, _) = next(iter(self._events.items()))
            if expires > now:
                return
            del self._events[key]

    def _keep(self, key: tuple[str, str], event: Obj) -> None:
        self._store.stamp(event)
        self._events[key] = (self._clock() + self.ttl, event)
        self._events.move_to_end(key)

    # --- writes -------------------------------------------------------------------------------

    def create(self, namespace: str, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was not an Event")
        event = copy.deepcopy(body)
        meta = event.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        name = meta.get("name")
        if not name and isinstance(meta.get("generateName"), str):
            name = f"{meta['generateName']}{new_uid()[:5]}"
        _check(namespace, str(name or ""), event)
        self._expire()
        key = (namespace, str(name))
        if key in self._events:
            raise already_exists("events", str(name))
        while len(self._events) >= self.cap:
            self._events.popitem(last=False)
            self.evicted += 1
        meta.update(
            name=str(name), namespace=namespace, uid=new_uid(), creationTimestamp=timestamp()
        )
        meta.pop("generateName", None)
        event["kind"], event["apiVersion"] = "Event", "v1"
        self._keep(key, event)
        return copy.deepcopy(event)

    def patch(self, namespace: str, name: str, patch: Any) -> Obj:
        if not isinstance(patch, dict):
            raise bad_request("a merge patch must be a JSON object")
        self._expire()
        key = (namespace, name)
        found = self._events.get(key)
        if found is None:
            raise not_found("events", name)
        before = found[1]
        meta = patch.get("metadata")
        causes: list[tuple[str, str, str]] = []
        if isinstance(meta, dict):
            causes += [
                _cause("FieldValueInvalid", f"field is immutable: {field}", f"metadata.{field}")
                for field in _FROZEN_META
                if field in meta and meta[field] != before["metadata"].get(field)
            ]
        if "involvedObject" in patch and patch["involvedObject"] != before.get("involvedObject"):
            causes.append(_cause("FieldValueInvalid", "field is immutable", "involvedObject"))
        if causes:
            raise invalid("Event", name, causes)
        event = _merge(copy.deepcopy(before), patch)
        _check(namespace, name, event)
        self._keep(key, event)
        return copy.deepcopy(event)

    def delete(self, namespace: str, name: str) -> Obj:
        self._expire()
        found = self._events.pop((namespace, name), None)
        if found is None:
            raise not_found("events", name)
        return copy.deepcopy(found[1])

    # --- reads --------------------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> Obj:
        self._expire()
        found = self._events.get((namespace, name))
        if found is None:
            raise not_found("events", name)
        return copy.deepcopy(found[1])

    def iter(
        self,
        namespace: str | None,
        selector: Selector | None = None,
        fields: list[FieldRequirement] | None = None,
    ) -> Iterator[tuple[tuple[str, str], Obj]]:
        """``((namespace, name), event)`` of the matching events, NOT copied: for a reader that
        serialises them at once (a LIST page's snapshot)."""
        self._expire()
        for key, (_, event) in self._events.items():
            if namespace is not None and key[0] != namespace:
                continue
            if selector is not None and not selector.matches(event["metadata"].get("labels")):
                continue
            if fields and not fields_match(fields, event):
                continue
            yield key, event


def _merge(target: Obj, patch: Obj) -> Obj:
    """RFC 7386: null deletes, objects merge, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            target[key] = _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def _check(namespace: str, name: str, event: Obj) -> None:
    causes: list[tuple[str, str, str]] = []
    if not name:
        causes.append(
            _cause("FieldValueRequired", "name or generateName is required", "metadata.name")
        )
    else:
        causes += [
            _cause("FieldValueInvalid", e, "metadata.name") for e in dns1123_subdomain_errors(name)
        ]
    involved = event.get("involvedObject")
    if not isinstance(involved, dict):
        involved = {}
        causes.append(_cause("FieldValueRequired", "Required value", "involvedObject"))
    for field in ("kind", "name"):
        if not isinstance(involved.get(field), str) or not involved.get(field):
            causes.append(_cause("FieldValueRequired", "Required value", f"involvedObject.{field}"))
    if involved.get("namespace") not in (None, "", namespace):
        causes.append(
            _cause(
                "FieldValueInvalid", "does not match event.namespace", "involvedObject.namespace"
            )
        )
    reason = event.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > REASON_LIMIT):
        causes.append(_cause("FieldValueInvalid", f"at most {REASON_LIMIT} characters", "reason"))
    message = event.get("message")
    if message is not None and (
        not isinstance(message, str) or len(message.encode()) > MESSAGE_LIMIT
    ):
        causes.append(_cause("FieldValueInvalid", f"at most {MESSAGE_LIMIT} bytes", "message"))
    if event.get("type") not in (None, "", "Normal", "Warning"):
        causes.append(
            _cause("FieldValueNotSupported", 'supported values: "Normal", "Warning"', "type")
        )
    count = event.get("count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
        causes.append(_cause("FieldValueInvalid", "must be an integer", "count"))
    if causes:
        raise invalid("Event", name or "", causes)


def _cause(reason: str, message: str, field: str) -> tuple[str, str, str]:
    """A 422's cause as ``errors.invalid`` takes it: (field, reason, message)."""
    return (field, reason, message)
