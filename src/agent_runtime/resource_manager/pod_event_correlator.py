"""``EventCorrelator``: what client-go's ``tools/record`` does to an event before it is sent
(``events_cache.go``), pure and clock-driven, so a storm of decisions about one pod costs the
API server a bounded number of writes.

Three steps, in client-go's order, each over an LRU cache of ``cache_size`` keys:

1. aggregate (``EventAggregator``): events alike but for their message (same pod, source,
   type, reason) are counted per ``similar_window`` seconds; from the ``max_similar``-th
   distinct message on, one event stands for them all: message ``(combined from similar
   events): <latest>``, keyed without the message;
2. observe (``eventLogger``): an event seen before under its key (object, source, type,
   reason, message) within the cache becomes an occurrence more of the one already written:
   a PATCH of ``count``, ``lastTimestamp`` and ``message`` onto the same Event name;
3. spam filter (``EventSourceObjectSpamFilter``): a token bucket per (source, pod) —
   ``burst`` tokens, one more every ``refill_every`` seconds; an event without a token is
   dropped (the observation in step 2 still counted it, as in client-go: the next one sent
   carries the true count).

Hazard: the cache remembers a name only until it is evicted or the API server's TTL drops the
event (1 h); the sender then gets 404 on the PATCH and creates the event anew (count 1 again),
as client-go does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

CACHE_SIZE = 4096  # client-go's maxLruCacheEntries
MAX_SIMILAR = 10  # defaultAggregateMaxEvents
SIMILAR_WINDOW = 600.0  # defaultAggregateIntervalInSeconds
SPAM_BURST = 25  # defaultSpamBurst
SPAM_REFILL_EVERY = 300.0  # seconds a token takes to come back (defaultSpamQPS = 1/300)
COMBINED_PREFIX = "(combined from similar events): "

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A dict that forgets its least recently used key beyond ``size``."""

    def __init__(self, size: int) -> None:
        self._size = max(size, 1)
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, slots=True)
class Occurrence:
    """One decision about one pod, as the recorder was handed it (``at``: wall seconds)."""

    cluster: str | None
    namespace: str
    pod: str
    uid: str
    type: str  # Normal / Warning
    reason: str
    message: str
    at: float

    @property
    def object_key(self) -> tuple[str | None, str, str, str]:
        """The pod and its incarnation (the source is this one recorder's, the same for all)."""
        return (self.cluster, self.namespace, self.pod, self.uid)


@dataclass(frozen=True, slots=True)
class Correlated:
    """What to write: a new Event (``count`` 1) or a patch of ``name`` (``count`` > 1)."""

    key: tuple[object, ...]  # the observation key, for ``written``
    occurrence: Occurrence
    message: str
    name: str
    count: int
    first_at: float
    combined: bool

    @property
    def is_patch(self) -> bool:
        return self.count > 1


@dataclass
class _Similar:
    messages: OrderedDict[str, None] = field(default_factory=OrderedDict)
    last_at: float = 0.0


@dataclass(frozen=True, slots=True)
class _Observed:
    count: int
    first_at: float
    name: str


@dataclass
class _Bucket:
    tokens: float
    at: float


class EventCorrelator:
    def __init__(
        self,
        *,
        name_of: Callable[[Occurrence], str],
        cache_size: int = CACHE_SIZE,
        max_similar: int = MAX_SIMILAR,
        similar_window: float = SIMILAR_WINDOW,
        burst: int = SPAM_BURST,
        refill_every: float = SPAM_REFILL_EVERY,
    ) -> None:
        """``name_of``: the Event name of a first occurrence (client-go: ``<pod>.<hex ns>``)."""
        self._name_of = name_of
        self._max_similar = max(max_similar, 1)
        self._similar_window = similar_window
        self._burst = burst
        self._refill_every = refill_every
        self._similar: Lru[tuple[object, ...], _Similar] = Lru(cache_size)
        self._observed: Lru[tuple[object, ...], _Observed] = Lru(cache_size)
        self._buckets: Lru[tuple[object, ...], _Bucket] = Lru(cache_size)

    def correlate(self, event: Occurrence) -> Correlated | None:
        """The write ``event`` becomes, or None when the spam filter drops it."""
        message, key, combined = self._aggregate(event)
        seen = self._observed.get(key)
        if seen is None:
            observed = _Observed(1, event.at, self._name_of(event))
        else:
            observed = _Observed(seen.count + 1, seen.first_at, seen.name)
        self._observed.put(key, observed)
        if not self._take_token(event):
            return None
        return Correlated(
            key, event, message, observed.name, observed.count, observed.first_at, combined
        )

    def forget(self, sent: Correlated) -> None:
        """The Event is gone upstream (a patch answered 404): the next one is created anew."""
        self._observed.put(sent.key, _Observed(1, sent.occurrence.at, sent.name))

    def _aggregate(self, event: Occurrence) -> tuple[str, tuple[object, ...], bool]:
        similar_key = (*event.object_key, event.type, event.reason)
        record = self._similar.get(similar_key)
        if record is None or event.at - record.last_at > self._similar_window:
            record = _Similar()
        record.messages[event.message] = None
        record.messages.move_to_end(event.message)
        record.last_at = event.at
        self._similar.put(similar_key, record)
        if len(record.messages) < self._max_similar:
            return event.message, (*similar_key, event.message), False
        # keep the set bounded (client-go pops one); the combined event stands for the rest
        record.messages.popitem(last=False)
        return COMBINED_PREFIX + event.message, similar_key, True

    def _take_token(self, event: Occurrence) -> bool:
        key = event.object_key
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(float(self._burst), event.at)
        elapsed = max(event.at - bucket.at, 0.0)
        refill = elapsed / self._refill_every if self._refill_every > 0 else float(self._burst)
        bucket.tokens = min(float(self._burst), bucket.tokens + refill)
        bucket.at = event.at
        self._buckets.put(key, bucket)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True
