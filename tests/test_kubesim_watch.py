"""kubesim's watch API: pod watches over raw HTTP (the newline-delimited JSON stream, list then
watch from the list's resourceVersion, resume, 410 after compaction or beyond the history,
selectors, the cap, timeouts, bookmarks, drops, the fault gate) and through kubernetes_asyncio's
own ``watch.Watch``, unchanged, as the service will use it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from kubesim import KubeSim
from kubesim.watch import Filter, WatchHub

PODS = "/api/v1/namespaces/default/pods"
WAIT = 10.0  # generous: a loaded 2-core machine


def pod_body(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": "x"}},
        "spec": {
            "containers": [
                {
                    "name": "agent",
                    "image": "registry.local/agent:1",
                    "ports": [{"containerPort": 8080}],
                }
            ]
        },
    }


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(
        ready_delay=0.05,
        grace_period=0.3,
        probe_period=0.05,
        namespaces=("default", "team"),
        seed=3,
        max_watches=4,
        watch_history=50,
    ) as s:
        yield s


@pytest.fixture
async def http(sim: KubeSim) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=WAIT) as c:
        yield c


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(trust_env=False) as s:
        yield s


class Stream:
    """A raw watch stream: its events one by one, each with a deadline."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self) -> dict[str, Any] | None:
        """The next event, or None when the server ended the stream."""
        try:
            async with asyncio.timeout(WAIT):
                line = await self.response.content.readline()
        except BaseException:
            self.response.close()  # a cut stream still gives its connection back
            raise
        if not line:
            return None
        assert line.endswith(b"\n") and line.strip(), line
        event: dict[str, Any] = json.loads(line)
        return event

    async def until(self, want: str, name: str) -> list[dict[str, Any]]:
        """Events up to and including the first ``want`` event of pod ``name``."""
        seen: list[dict[str, Any]] = []
        while True:
            event = await self.next()
            assert event is not None, f"stream ended before {want} {name}: {seen}"
            seen.append(event)
            if event["type"] == want and event["object"]["metadata"].get("name") == name:
                return seen

    async def end(self) -> list[dict[str, Any]]:
        rest = []
        while (event := await self.next()) is not None:
            rest.append(event)
        return rest


async def open_watch(
    session: aiohttp.ClientSession, sim: KubeSim, path: str = PODS, **params: str
) -> Stream:
    response = await session.get(f"{sim.url}{path}", params={"watch": "1", **params})
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("application/json")
    return Stream(response)


async def create(http: httpx.AsyncClient, name: str, ns: str = "default", **labels: str) -> None:
    resp = await http.post(f"/api/v1/namespaces/{ns}/pods", json=pod_body(name, labels or None))
    assert resp.status_code == 201, resp.text


def names(events: list[dict[str, Any]], kind: str | None = None) -> list[str]:
    return [e["object"]["metadata"]["name"] for e in events if kind in (None, e["type"])]


async def test_list_then_watch_sees_create_modify_and_delete(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    await create(http, "before")
    listed = (await http.get(PODS)).json()
    version = listed["metadata"]["resourceVersion"]
    assert version == sim.store.resource_version
    stream = await open_watch(session, sim, resourceVersion=version)
    await create(http, "p1")
    added = await stream.until("ADDED", "p1")
    assert "before" not in names(added, "ADDED"), "a watch from the list's version replays none"
    running = await stream.until("MODIFIED", "p1")  # the kubelet's status writes
    assert all(e["type"] == "MODIFIED" for e in running)
    patch = await http.patch(
        f"{PODS}/p1",
        json={"metadata": {"labels": {"app": "x", "seen": "yes"}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert patch.status_code == 200
    while (event := await stream.next()) is not None:
        if event["object"]["metadata"].get("labels", {}).get("seen") == "yes":
            break
    assert event is not None and event["type"] == "MODIFIED"
    assert (
        event["object"]["metadata"]["resourceVersion"]
        == patch.json()["metadata"]["resourceVersion"]
    )
    assert (await http.delete(f"{PODS}/p1", params={"gracePeriodSeconds": "0"})).status_code == 200
    deleted = (await stream.until("DELETED", "p1"))[-1]
    assert deleted["object"]["metadata"]["uid"] == patch.json()["metadata"]["uid"]
    assert int(deleted["object"]["metadata"]["resourceVersion"]) == int(
        sim.store.resource_version
    ), "a delete carries a version of its own"
    stream.response.close()


async def test_versions_increase_and_resume_sees_only_later_events(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    first = await open_watch(session, sim, resourceVersion=sim.store.resource_version)
    await create(http, "a")
    events = await first.until("ADDED", "a")
    mark = events[-1]["object"]["metadata"]["resourceVersion"]
    await create(http, "b")
    await create(http, "c")
    seen = await first.until("ADDED", "c")
    every = events + seen
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in every]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    first.response.close()
    resumed = await open_watch(session, sim, resourceVersion=mark, timeoutSeconds="1")
    replay = await resumed.end()  # the server ends it after 1 s
    replayed = [int(e["object"]["metadata"]["resourceVersion"]) for e in replay]
    assert replayed and min(replayed) > int(mark)
    assert "a" not in names(replay, "ADDED") and {"b", "c"} <= set(names(replay, "ADDED"))


async def test_without_a_version_current_pods_come_first_as_added(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    for name in ("x1", "x2"):
        await create(http, name)
    for params in ({}, {"resourceVersion": "0"}):
        existing = sorted(p["metadata"]["name"] for p in sim.pods())
        stream = await open_watch(session, sim, **params)
        initial = [await stream.next() for _ in existing]
        assert [e["type"] for e in initial if e] == ["ADDED"] * len(existing)
        assert sorted(names([e for e in initial if e])) == existing
        await create(http, f"live{len(params)}")
        assert (await stream.until("ADDED", f"live{len(params)}"))[-1]["type"] == "ADDED"
        stream.response.close()


async def test_compact_and_a_version_beyond_the_history_answer_410_in_stream(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    old = sim.store.resource_version
    await create(http, "c1")
    compacted = (await http.post("/_sim/watches/compact")).json()
    assert compacted["oldest_resource_version"] == sim.store.resource_version
    stream = await open_watch(session, sim, resourceVersion=old)
    error = await stream.next()
    assert error is not None and error["type"] == "ERROR"
    status = error["object"]
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
    assert status["message"].startswith(f"too old resource version: {old} (")
    assert await stream.next() is None, "the stream ends after the ERROR"
    fresh = await open_watch(session, sim, resourceVersion=compacted["oldest_resource_version"])
    await create(http, "c2")
    assert names(await fresh.until("ADDED", "c2"), "ADDED") == ["c2"]
    fresh.response.close()
    # the bounded history (50 events here) forgets on its own
    start = sim.store.resource_version
    for i in range(30):
        await create(http, f"many{i}")
    await asyncio.sleep(0)
    deadline = asyncio.get_running_loop().time() + WAIT
    while sim.watches.describe()["oldest_resource_version"] <= start:
        await asyncio.sleep(0.05)  # the kubelets' writes push the start out of the history
        assert asyncio.get_running_loop().time() < deadline, "history never filled"
    expired = await open_watch(session, sim, resourceVersion=start)
    event = await expired.next()
    assert event is not None and event["object"]["code"] == 410
    assert sim.watches.describe()["counts"]["expired"] == 2


async def test_selectors_filter_the_stream(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    version = sim.store.resource_version
    by_label = await open_watch(session, sim, resourceVersion=version, labelSelector="app=keep")
    by_field = await open_watch(
        session, sim, resourceVersion=version, fieldSelector="metadata.name=f2"
    )
    everywhere = await open_watch(
        session, sim, "/api/v1/pods", resourceVersion=version, labelSelector="app=keep"
    )
    await create(http, "f1", app="drop")
    await create(http, "f2", app="keep")
    await create(http, "f3", ns="team", app="keep")
    await create(http, "f4", app="keep")
    label_events = await by_label.until("ADDED", "f4")
    assert set(names(label_events)) == {"f2", "f4"}
    field_events = await by_field.until("ADDED", "f2")
    assert set(names(field_events)) == {"f2"}
    all_events = await everywhere.until("ADDED", "f4")
    assert {"f2", "f3", "f4"} <= set(names(all_events)) and "f1" not in names(all_events)
    bad = await http.get(PODS, params={"watch": "1", "labelSelector": "a in (b"})
    assert bad.status_code == 400 and bad.json()["reason"] == "BadRequest"
    bad_version = await http.get(PODS, params={"watch": "1", "resourceVersion": "x"})
    assert bad_version.status_code == 400
    for stream in (by_label, by_field, everywhere):
        stream.response.close()
    deadline = asyncio.get_running_loop().time() + WAIT
    while sim.watches.open_watches:  # a client that goes frees its place in the cap
        await asyncio.sleep(0.02)
        assert asyncio.get_running_loop().time() < deadline, sim.watches.describe()
    assert sim.watches.describe()["closed"] == {"gone": 3}


async def test_the_cap_on_open_watches_is_429_and_frees_up(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    streams = [await open_watch(session, sim) for _ in range(4)]
    refused = await http.get(PODS, params={"watch": "1"})
    assert refused.status_code == 429 and refused.json()["reason"] == "TooManyRequests"
    assert refused.headers["Retry-After"] == "1"
    dropped = (await http.post("/_sim/watches/drop")).json()
    assert dropped == {"dropped": 4}
    for stream in streams:
        assert await stream.end() == [], "a dropped stream ends cleanly"
    again = await open_watch(session, sim, timeoutSeconds="1")
    assert await again.end() == []


async def test_drop_reset_cuts_the_connection_and_stop_ends_every_stream(
    session: aiohttp.ClientSession,
) -> None:
    async with KubeSim(ready_delay=0.05, namespaces=("default",)) as sim:
        stream = await open_watch(session, sim)
        async with httpx.AsyncClient(base_url=sim.url, trust_env=False) as http:
            resp = await http.post("/_sim/watches/drop", json={"mode": "reset"})
            assert resp.json() == {"dropped": 1}
            assert (await http.post("/_sim/watches/drop", json={"mode": "x"})).status_code == 400
        with pytest.raises(aiohttp.ClientError):
            await stream.end()
        last = await open_watch(session, sim)
        await sim.stop()
        assert await last.end() == []
        assert sim.watches.open_watches == 0


async def test_bookmarks_and_timeout(
    session: aiohttp.ClientSession,
) -> None:
    async with KubeSim(ready_delay=0.05, bookmark_interval=0.2, namespaces=("default",)) as sim:
        stream = await open_watch(session, sim, allowWatchBookmarks="true", timeoutSeconds="2")
        event = await stream.next()
        assert event is not None and event["type"] == "BOOKMARK"
        assert event["object"]["kind"] == "Pod"
        assert int(event["object"]["metadata"]["resourceVersion"]) == sim.store.revision()
        rest = await stream.end()  # ends by itself after 2 s
        assert {e["type"] for e in rest} <= {"BOOKMARK"}
        plain = await open_watch(session, sim, timeoutSeconds="1")
        assert await plain.end() == [], "no bookmarks unless asked for"


async def test_graceful_delete_is_modified_with_deletion_timestamp_then_deleted(
    sim: KubeSim, http: httpx.AsyncClient, session: aiohttp.ClientSession
) -> None:
    await create(http, "g1")
    stream = await open_watch(session, sim, fieldSelector="metadata.name=g1")
    while True:
        event = await stream.next()
        assert event is not None
        if event["object"]["status"].get("phase") == "Running":
            break
    assert (await http.delete(f"{PODS}/g1", params={"gracePeriodSeconds": "5"})).status_code == 200
    events = await stream.until("DELETED", "g1")
    marked = [e for e in events if e["object"]["metadata"].get("deletionTimestamp")]
    assert marked[0]["type"] == "MODIFIED"
    assert marked[0]["object"]["metadata"]["deletionGracePeriodSeconds"] == 5
    assert events[-1]["type"] == "DELETED" and events.index(marked[0]) < len(events) - 1
    stream.response.close()


async def test_the_fault_gate_applies_to_watches(sim: KubeSim, http: httpx.AsyncClient) -> None:
    sim.faults.add("api_error", status=503, verb="watch", count=1)
    failed = await http.get(PODS, params={"watch": "1"})
    assert failed.status_code == 503 and failed.json()["kind"] == "Status"
    assert (await http.get(PODS)).status_code == 200, "a list is not a watch"
    sim.faults.add("namespace_forbidden", namespace="team")
    forbidden = await http.get("/api/v1/namespaces/team/pods", params={"watch": "1"})
    assert forbidden.status_code == 403
    assert sim.requests["watch pods"] == 2


async def test_a_slow_consumer_is_cut_off_not_buffered() -> None:
    version = 0

    def revision() -> int:
        return version

    hub = WatchHub(revision, history=10, max_watches=2, queue=3)
    watcher, backlog = hub.open(Filter("pods"), None, [])
    assert backlog == []
    for i in range(4):
        version += 1
        obj = {"metadata": {"name": f"p{i}", "namespace": "d", "resourceVersion": str(version)}}
        hub.publish("pods", "ADDED", obj)
    assert watcher.closed == "overflow" and watcher.take() == []
    assert hub.open_watches == 0 and hub.describe()["closed"] == {"overflow": 1}
    # the history kept the newest 10 events at most; from before them: Expired
    for _ in range(10):
        version += 1
        hub.publish(
            "pods", "MODIFIED", {"metadata": {"name": "p", "resourceVersion": str(version)}}
        )
    with pytest.raises(Exception, match="too old resource version: 1"):
        hub.open(Filter("pods"), 1, [])


# --- kubernetes_asyncio's own Watch, unchanged -------------------------------------------------


@pytest.fixture
async def v1(sim: KubeSim, _no_proxy: None) -> AsyncIterator[client.CoreV1Api]:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(sim.kubeconfig_path), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api:
        yield client.CoreV1Api(api)


async def test_kubernetes_asyncio_list_then_watch(
    sim: KubeSim, http: httpx.AsyncClient, v1: client.CoreV1Api
) -> None:
    listed = await v1.list_namespaced_pod("default")
    version = listed.metadata.resource_version
    await create(http, "k1")
    await http.delete(f"{PODS}/k1", params={"gracePeriodSeconds": "0"})
    seen: list[tuple[str, str]] = []
    w = watch.Watch()
    async with asyncio.timeout(WAIT):
        async for event in w.stream(
            v1.list_namespaced_pod, "default", resource_version=version, timeout_seconds=5
        ):
            seen.append((event["type"], event["object"].metadata.name))
            if event["type"] == "DELETED":
                w.stop()
    await w.close()
    assert seen[0] == ("ADDED", "k1") and seen[-1] == ("DELETED", "k1")
    assert {t for t, _ in seen[1:-1]} <= {"MODIFIED"}
    assert w.resource_version is not None and int(w.resource_version) == sim.store.revision(), (
        "the client tracks the version"
    )


async def test_kubernetes_asyncio_raises_410_after_compact(
    sim: KubeSim, http: httpx.AsyncClient, v1: client.CoreV1Api
) -> None:
    version = (await v1.list_namespaced_pod("default")).metadata.resource_version
    await create(http, "k2")
    await http.post("/_sim/watches/compact")
    w = watch.Watch()
    with pytest.raises(ApiException) as raised:
        async with asyncio.timeout(WAIT):
            async for _ in w.stream(
                v1.list_namespaced_pod, "default", resource_version=version, timeout_seconds=5
            ):
                pytest.fail("no event before the 410")
    assert raised.value.status == 410 and "Expired" in str(raised.value.reason)
    # without timeout_seconds (watch forever) the client retries a 410 once, then raises
    forever = watch.Watch()
    with pytest.raises(ApiException) as again:
        async with asyncio.timeout(WAIT):
            async for _ in forever.stream(
                v1.list_namespaced_pod, "default", resource_version=version
            ):
                pytest.fail("no event before the 410")
    assert again.value.status == 410


async def test_kubernetes_asyncio_stream_ends_when_dropped(
    sim: KubeSim, http: httpx.AsyncClient, v1: client.CoreV1Api
) -> None:
    w = watch.Watch()
    seen: list[str] = []

    async def consume() -> None:
        async for event in w.stream(v1.list_namespaced_pod, "default", timeout_seconds=60):
            seen.append(event["type"])

    task = asyncio.create_task(consume())
    deadline = asyncio.get_running_loop().time() + WAIT
    while sim.watches.open_watches == 0:
        await asyncio.sleep(0.02)
        assert asyncio.get_running_loop().time() < deadline
    assert (await http.post("/_sim/watches/drop")).json() == {"dropped": 1}
    async with asyncio.timeout(WAIT):
        await task  # the dropped stream ends the client's iteration
    assert seen == []


async def test_kubernetes_asyncio_without_timeout_resumes_after_a_drop_and_misses_nothing(
    sim: KubeSim, http: httpx.AsyncClient, v1: client.CoreV1Api
) -> None:
    """Watching forever, the client reconnects from its last version when the stream ends:
    what happened between the drop and the reconnect still reaches it, once."""
    version = (await v1.list_namespaced_pod("default")).metadata.resource_version
    w = watch.Watch()
    added: list[str] = []
    await create(http, "r1")

    async def consume() -> None:
        async for event in w.stream(v1.list_namespaced_pod, "default", resource_version=version):
            if event["type"] == "ADDED":
                added.append(event["object"].metadata.name)
            if event["type"] == "DELETED" and event["object"].metadata.name == "r2":
                w.stop()
                return

    task = asyncio.create_task(consume())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while added != ["r1"]:
            await asyncio.sleep(0.02)
            assert loop.time() < deadline, "r1 never seen"
        assert (await http.post("/_sim/watches/drop")).json() == {"dropped": 1}
        await create(http, "r2")
        await http.delete(f"{PODS}/r2", params={"gracePeriodSeconds": "0"})
        async with asyncio.timeout(WAIT):
            await task
    finally:
        task.cancel()
        await w.close()
    assert added == ["r1", "r2"], "resumed from its version: nothing lost, nothing twice"
    assert sim.watches.describe()["counts"]["opened"] == 2


async def test_a_stream_that_falls_behind_its_queue_is_cut(session: aiohttp.ClientSession) -> None:
    """Three events in one synchronous burst (a namespace removed with its three pods) for a
    stream allowed two waiting: the server cuts that stream, it does not buffer on."""
    async with KubeSim(ready_delay=0.05, namespaces=("default", "team"), watch_queue=2) as sim:
        http = httpx.AsyncClient(base_url=sim.url, trust_env=False, timeout=WAIT)
        async with http:
            for i in range(3):
                await create(http, f"q{i}", ns="team")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT
            while not all(p["status"].get("phase") == "Running" for p in sim.pods("team")):
                await asyncio.sleep(0.02)  # the kubelet's writes are over: no event but ours
                assert loop.time() < deadline
            stream = await open_watch(session, sim, "/api/v1/pods", timeoutSeconds="30")
            for _ in range(3):
                assert (await stream.next()) is not None  # the synthetic ADDED
            assert (await http.delete("/_sim/namespaces/team")).status_code == 200
            with pytest.raises(aiohttp.ClientError):
                await stream.end()
            assert sim.watches.describe()["closed"].get("overflow") == 1
