"""scope_buckets: a cross-scope index split in per-bucket keys (issue 17), and its two
shared scripts, bucket_due.lua and bucket_settle.lua, on fakeredis and the real Redis.

The race that matters: a mark (someone made the scope need a look sooner) and a settle (the
job's "looked, next time is T") interleave; the mark must never be lost.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter

import pytest
from redis.asyncio import Redis

from agent_runtime.scope_buckets import BUCKETS, DueIndex, bucket_of, bucket_tag

pytestmark = pytest.mark.topologies

PREFIX = "test_buckets:due:"


def key_of(bucket: int) -> str:
    return f"{PREFIX}{bucket_tag(bucket)}"


@pytest.fixture
def index(redis: Redis) -> DueIndex:
    return DueIndex(redis, key_of, name="test")


async def rnow(redis: Redis) -> float:
    sec, usec = await redis.time()
    return float(sec) + usec / 1e6


def test_bucket_of_is_stable_and_spreads_scope_ids() -> None:
    assert bucket_of("0123456789abcdef0123456789abcdef") == bucket_of(
        "0123456789abcdef0123456789abcdef"
    )
    assert bucket_of("scope-a") == zlib.crc32(b"scope-a") % BUCKETS  # not Python's hash
    counts = Counter(bucket_of(f"{i:032x}") for i in range(6400))
    assert len(counts) == BUCKETS and max(counts.values()) < 2 * 6400 / BUCKETS
    assert bucket_tag(7) == "{b07}"
    with pytest.raises(ValueError):
        bucket_tag(BUCKETS)


async def test_due_gives_what_is_due_by_the_redis_clock(index: DueIndex, redis: Redis) -> None:
    now = await rnow(redis)
    sids = [f"s{i}" for i in range(40)]
    same = [s for s in sids if bucket_of(s) == bucket_of("s0")]
    for n, sid in enumerate(same):
        await index.mark(sid, now - 100 + n if n % 2 == 0 else now + 3600)
    due = await index.due(bucket_of("s0"), 100)
    assert [sid for sid, _ in due] == [s for n, s in enumerate(same) if n % 2 == 0]
    assert [sid for sid, _ in await index.due(bucket_of("s0"), 1)] == [same[0]], "soonest first"
    assert await index.due((bucket_of("s0") + 1) % BUCKETS, 100) == [] or all(
        bucket_of(s) != bucket_of("s0")
        for s, _ in await index.due((bucket_of("s0") + 1) % BUCKETS, 100)
    )


async def test_a_mark_brings_the_time_forward_and_always_moves_it(
    index: DueIndex, redis: Redis
) -> None:
    await index.mark("s1", 2000.0)
    assert await redis.zscore(index.key("s1"), "s1") == 2000.0
    await index.mark("s1", 3000.0)  # later: a millisecond sooner, so a settle in flight sees it
    assert await redis.zscore(index.key("s1"), "s1") == pytest.approx(1999.999)
    await index.mark("s1", 1000.0)
    assert await redis.zscore(index.key("s1"), "s1") == 1000.0


async def test_settle_sets_the_next_time_or_drops_unless_marked_since(
    index: DueIndex, redis: Redis
) -> None:
    now = await rnow(redis)
    await index.mark("s1", now - 5)
    [(sid, seen)] = [d for d in await index.due(bucket_of("s1"), 10) if d[0] == "s1"]
    assert await index.settle(sid, seen, now + 600)
    assert await redis.zscore(index.key("s1"), "s1") == pytest.approx(now + 600)
    assert not await index.settle(sid, seen, None), "the score moved: a stale settle is refused"

    # a mark between the job's read and its settle wins
    await index.mark("s2", now - 5)
    [(sid, seen)] = [d for d in await index.due(bucket_of("s2"), 10) if d[0] == "s2"]
    await index.mark("s2", now + 60)  # a session placed after the job's look, due later
    assert not await index.settle(sid, seen, None), "the mark is not dropped"
    assert await redis.zscore(index.key("s2"), "s2") == pytest.approx(now - 5.001)
    [(sid, seen)] = [d for d in await index.due(bucket_of("s2"), 10) if d[0] == "s2"]
    assert await index.settle(sid, seen, None)
    assert await redis.zscore(index.key("s2"), "s2") is None
    assert not await index.settle("s2", seen, now), "gone: nothing to settle, nothing added"
    assert await redis.zscore(index.key("s2"), "s2") is None


async def test_concurrent_marks_and_settles_never_lose_a_mark(
    index: DueIndex, redis: Redis
) -> None:
    """Many tasks mark scopes while a job settles them as 'never again'; every scope marked
    after the job's last read of it is still in the index."""
    now = await rnow(redis)
    sids = [f"c{i}" for i in range(50)]
    marked_last: dict[str, int] = {}
    settled_after: dict[str, int] = {}
    clock = 0

    async def marker(sid: str) -> None:
        nonlocal clock
        for _ in range(20):
            clock += 1
            marked_last[sid] = clock
            await index.mark(sid, now - 1 if clock % 3 else now + 60)
            await asyncio.sleep(0)

    async def job() -> None:
        nonlocal clock
        for _ in range(40):
            for bucket in {bucket_of(s) for s in sids}:
                for sid, seen in await index.due(bucket, 100):
                    clock += 1
                    read_at = clock
                    if await index.settle(sid, seen, None):
                        settled_after[sid] = read_at
            await asyncio.sleep(0)

    await asyncio.gather(job(), *(marker(s) for s in sids))
    for sid in sids:
        present = await redis.zscore(index.key(sid), sid) is not None
        dropped_last = settled_after.get(sid, -1) > marked_last[sid]
        assert present or dropped_last, sid
