"""A Sentinel failover mid-load (issue 17, "Sentinel" and "Fault tests"): two replicas over a
``redis+sentinel://`` client each, a gateway's load over three scopes with small caps, and
``SENTINEL FAILOVER`` on the tests' Sentinel set (scripts/redis_topologies.sh) while it runs.

The scenario and its judgement live in ``failover_load.py`` (``bench/failover.py`` measures the
same over many failovers). Asserted, because it must hold whatever the failover lost:

- every answer is a contract answer: 200, or a refusal with ``retry_after`` and its header
  (never a 500), and no route names a pod that does not exist;
- the service follows the failover without a restart: every replica answers routes and
  touches again (its scripts run on the new master), and its pub/sub wake-ups arrive again;
- Redis stays consistent: no scope or pod over its cap (sampled during the load, and after),
  every session in its four places, nothing held once the leases ran out and the prunes ran;
- a session with no call in flight around the failover keeps what it was told.

What asynchronous replication lost (bindings, ended sessions back, seats beyond a cap once the
forgotten sessions count, pods whose registration vanished) and the unavailability window are
printed, never asserted.
"""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis

import failover_load
from agent_runtime.db.engine import Database
from failover_load import SentinelSet, Shape, one_failover, service
from helpers import sentinel_url


@pytest.mark.real_backend
# the guard above the scenario's own bounded waits: the set ready (60 s), the warm-up (60 s), the
# failover (30 s), every replica answering again (35 s), the cleanup (30 s), the wake-up (15 s)
@pytest.mark.timeout(420)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_sentinel_failover_mid_load_answers_in_contract_and_keeps_redis_consistent(
    redis_sentinel: Redis, db: Database
) -> None:
    shape = Shape()
    sentinels = SentinelSet(sentinel_url())
    try:
        async with service(sentinel_url(), db, shape) as svc:
            out = await one_failover(svc, sentinels.failover, redis_sentinel, shape)
            print("\n" + out.summary())
            fo = out.failover
            assert fo.new != fo.old and fo.demoted >= fo.promoted > 0, fo
            assert out.bad == [], out.bad[:10]
            assert out.unexposed_anomalies == [], out.unexposed_anomalies[:5]
            assert out.over_cap_seen == [], out.over_cap_seen[:10]
            assert out.state is not None and out.state.consistent, out.state.problems()[:10]
            registered = set().union(*out.state.registered_pods.values())
            assert registered <= set(svc.k8s.pods), registered - set(svc.k8s.pods)
            assert out.after is not None and out.after.leftovers == [], out.after.problems()
            assert out.after.sessions == 0 and out.after.consistent, out.after.problems()
            # the load ran across the failover: answers before the command and after the demotion
            assert out.codes["OK"] > 100, out.codes
            # each replica's pub/sub follows the master: a wake-up published now arrives
            channel = failover_load.free_channel(svc.scope_ids[0])
            for i in range(shape.replicas):
                notifier = svc.services(i).notifier
                async with notifier.listen(channel) as listener:
                    deadline = time.monotonic() + 15
                    while not listener.payloads:
                        assert time.monotonic() < deadline, f"replica {i}: no wake-up arrived"
                        await redis_sentinel.spublish(channel, f"probe-{i}")
                        await listener.wait(0.5)
    finally:
        await sentinels.aclose()
        # connections a demoted master closed: the fixture's cleanup starts on fresh ones
        await redis_sentinel.connection_pool.disconnect()
