"""pod_events: what recording the pods' Kubernetes Events costs (``pod_events.py``).

- ``record()`` itself, the call a decision makes: µs per call (p50 / p99), on the fake client;
- the sender against kubesim through the real client (kubernetes_asyncio): ``PODS`` pods,
  one event each (creates), then the same again (patches: count 2) — events written a second,
  and the longest stretch the sender held the event loop (a sampler task's worst wake-up);
- a storm: ``STORM`` records about one pod at once — how many API writes it cost (the per-pod
  token bucket lets 25 through) and what was dropped.

Needs no Redis; kubesim must be installed (``pip install -e ./kubesim``).
``python -m bench.pod_events`` runs it alone.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.pod_events import PodEventReason, PodEvents, PodRef

NAME = "pod_events"


async def run(ctx: Any) -> dict[str, Any]:
    quick = bool(getattr(ctx, "quick", False))
    return {
        "record_us": await record_cost(2_000 if quick else 20_000),
        "sender": await sender_throughput(100 if quick else 500),
        "storm": await storm(1_000 if quick else 10_000),
    }


async def record_cost(calls: int) -> dict[str, float]:
    events = PodEvents(k8s=FakeK8sPodClient(), instance_id="bench", queue_size=calls + 1)
    took: list[float] = []
    for i in range(calls):
        pod = PodRef(f"p-{i % 500}", "default", f"u-{i % 500}")
        started = time.perf_counter()
        events.record(pod, PodEventReason.DEPLOYED, "deployed for scope s (in use)")
        took.append((time.perf_counter() - started) * 1e6)
    await events.wait_sent(60.0)
    await events.stop()
    took.sort()
    return {
        "calls": calls,
        "p50": round(statistics.median(took), 2),
        "p99": round(took[int(len(took) * 0.99)], 2),
    }


async def _longest_hold(stop: asyncio.Event) -> float:
    worst = 0.0
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.001)
        worst = max(worst, loop.time() - before - 0.001)
    return worst


async def sender_throughput(pods: int) -> dict[str, Any]:
    from kubesim import KubeSim

    async with KubeSim(ready_delay=0.05) as sim:
        client = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path))
        await client.start()
        metrics = Metrics()
        events = PodEvents(k8s=client, instance_id="bench", metrics=metrics, queue_size=pods)
        result: dict[str, Any] = {"pods": pods}
        try:
            for phase in ("create", "patch"):
                stop = asyncio.Event()
                sampler = asyncio.create_task(_longest_hold(stop))
                started = time.perf_counter()
                for i in range(pods):
                    events.record(
                        PodRef(f"p-{i}", "default", f"u-{i}"),
                        PodEventReason.FOREIGN_POD_IGNORED,
                        "not provably ours",
                    )
                assert await events.wait_sent(120.0)
                took = time.perf_counter() - started
                stop.set()
                hold = await sampler
                result[phase] = {
                    "events_per_s": round(pods / took, 1),
                    "ms_per_event": round(took * 1000 / pods, 2),
                    "longest_loop_hold_ms": round(hold * 1000, 2),
                }
            result["kept_by_kubesim"] = len(sim.events)
        finally:
            await events.stop()
            await client.close()
        return result


async def storm(records: int) -> dict[str, Any]:
    k8s, metrics = FakeK8sPodClient(), Metrics()
    events = PodEvents(k8s=k8s, instance_id="bench", metrics=metrics, queue_size=records)
    pod = PodRef("p-storm", "default", "u-storm")
    for i in range(records):
        events.record(pod, PodEventReason.DELETED_HALF_DEAD, f"failing {i % 3}")
    await events.wait_sent(60.0)
    await events.stop()

    def outcome(name: str) -> int:
        value = metrics.registry.get_sample_value(
            "agent_runtime_pod_events_total", {"reason": "DeletedHalfDead", "outcome": name}
        )
        return int(value or 0)

    written = k8s.kube_events.of_pod("p-storm")
    return {
        "records": records,
        "api_writes": outcome("sent") + outcome("aggregated"),
        "dropped_spam": outcome("dropped_spam"),
        "events_kept": len(written),
        "counts": sorted(e["count"] for e in written),
    }


def summary(result: dict[str, Any]) -> str:
    rec, send, burst = result["record_us"], result["sender"], result["storm"]
    return (
        f"pod_events: record() p50 {rec['p50']} / p99 {rec['p99']} µs; against kubesim "
        f"{send['create']['events_per_s']} creates/s, {send['patch']['events_per_s']} patches/s "
        f"(longest loop hold {send['create']['longest_loop_hold_ms']} / "
        f"{send['patch']['longest_loop_hold_ms']} ms); a storm of {burst['records']} records "
        f"on one pod → {burst['api_writes']} API writes, {burst['dropped_spam']} dropped"
    )


if __name__ == "__main__":
    measured = asyncio.run(run(None))
    print(measured)
    print(summary(measured))
