"""Answers that do not leak or mislead (issue 13, section 4), through HTTP.

A used request_id replays only for the request that used it (two replicas over one Redis);
gateway-facing error messages carry no Kubernetes, loader or backend text (the details go to
the log with the request id); a cleanup label_selector is validated with the grammar we
accept; the admin views take every id route takes. Key names are the contract's (§4).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import fakeredis
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from agent_runtime import label_selector
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.wiring import build_redis
from helpers import (
    IDENTITY,
    TcpProxy,
    envelope,
    make_settings,
    other_client,
    real_only,
    real_redis_url,
    running_app,
    session_hashes,
    sync_body,
)
from kubesim import KubeSim
from kubesim import labels as sim_labels

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
CLEANUP = "/api/session/cleanup"


def scope_of(group_id: str, bot_id: str) -> str:
    return hashlib.md5(f"{group_id}\x00{bot_id}".encode()).hexdigest()  # contract §1


async def configure(client: httpx.AsyncClient, **fields: Any) -> None:
    item = {"template_id": "tpl-a", "image": "agentserver:1", "ready_poll_interval": 0.02}
    resp = await client.post(SYNC, json=sync_body("template", "create", {**item, **fields}))
    assert resp.status_code == 200, resp.text
    rule = {"group_id": "*", "bot_id": "*", "template_id": "tpl-a"}
    resp = await client.post(SYNC, json=sync_body("routing_rule", "create", rule))
    assert resp.status_code == 200, resp.text


def route_body(request_id: str, session_id: str, group_id: str = "g1", bot_id: str = "b1") -> Any:
    return envelope(
        request_id=request_id, session_id=session_id, bot_id=bot_id, extra={"group_id": group_id}
    )


# --- 1. a used request_id replays only for its own request -------------------------------------


async def test_a_reused_request_id_gets_409_in_its_scope_and_never_the_first_pod(
    redis: Redis, db: Database
) -> None:
    """Another session of the scope with a used request_id gets 409 on either replica; answers
    are kept per scope (route:{sid}:{request_id}), so another tenant or bot with the id is
    another request: served on its own with a pod of its scope, never the first answer."""
    cluster = FakeK8sPodClient()
    second = other_client(redis)
    try:
        async with (
            running_app(redis, db, k8s=cluster, instance_id="replica-a") as a,
            running_app(second, db, k8s=cluster, instance_id="replica-b") as b,
        ):
            await configure(a)
            first = await a.post(ROUTE, json=route_body("r-shared", "s-tenant-1", "g1"))
            assert first.status_code == 200, first.text
            first_pod = first.json()["data"]["pod_id"]
            for client in (a, b):
                resp = await client.post(ROUTE, json=route_body("r-shared", "s-other", "g1"))
                assert resp.status_code == 409, resp.text
                failure = resp.json()
                assert failure["error_code"] == "REQUEST_ID_REUSED"
                assert failure["request_id"] == "r-shared"
                assert first_pod not in resp.text
                assert "retry_after" not in failure
            # nothing was done for it: no session, no reservation
            assert not await session_hashes(redis, "s-other")
            sid = scope_of("g1", "b1")
            assert not await redis.exists(f"session_manager:scope:{{{sid}}}:reserved")
            assert cluster.deploy_calls == 1
            # another tenant (group) and another bot: their own request, their own pod, and
            # the same answer again on the other replica
            for session_id, group_id, bot_id in (("s-tenant-2", "g2", "b1"), ("s-3", "g1", "b2")):
                body = route_body("r-shared", session_id, group_id, bot_id)
                theirs = await a.post(ROUTE, json=body)
                assert theirs.status_code == 200, theirs.text
                assert theirs.json()["data"]["pod_id"] != first_pod
                assert (await b.post(ROUTE, json=body)).json() == theirs.json()
            assert cluster.deploy_calls == 3
            # the first request still replays the first answer on both replicas (contract §2.3)
            for client in (a, b):
                again = await client.post(ROUTE, json=route_body("r-shared", "s-tenant-1", "g1"))
                assert again.status_code == 200 and again.json() == first.json()
            schema = (await a.get("/openapi.json")).json()
            route_409 = schema["paths"][ROUTE]["post"]["responses"]["409"]
            assert "REQUEST_ID_REUSED" in str(schema["components"]["schemas"]) + str(route_409)
    finally:
        await second.aclose()


async def test_an_eos_request_id_reused_for_another_session_ends_nothing(
    redis: Redis, db: Database
) -> None:
    second = other_client(redis)
    cluster = FakeK8sPodClient()
    try:
        async with (
            running_app(redis, db, k8s=cluster, instance_id="replica-a") as a,
            running_app(second, db, k8s=cluster, instance_id="replica-b") as b,
        ):
            await configure(a, pod_concurrency=4, scope_concurrency=4)
            for session_id in ("s1", "s2"):
                resp = await a.post(ROUTE, json=route_body(f"r-{session_id}", session_id))
                assert resp.status_code == 200, resp.text
            eos = {"eos": True}
            ended = await a.post(TOUCH, json=envelope(eos, request_id="r-eos", session_id="s1"))
            assert ended.json()["data"] == {"touched": True, "released": True}
            for client in (a, b):
                body = envelope(eos, request_id="r-eos", session_id="s2")
                resp = await client.post(TOUCH, json=body)
                assert resp.status_code == 409, resp.text
                assert resp.json()["error_code"] == "REQUEST_ID_REUSED"
                # the first eos re-sent still gets its own answer
                body = envelope(eos, request_id="r-eos", session_id="s1")
                assert (await client.post(TOUCH, json=body)).json() == ended.json()
            assert await session_hashes(redis, "s2"), "s2 was not ended"
    finally:
        await second.aclose()


# --- 2. gateway-facing messages carry no Kubernetes, loader or backend text ---------------------


@pytest.mark.usefixtures("_no_proxy")
async def test_kubernetes_text_goes_to_the_log_not_to_the_gateway(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A deploy refused by the API server (`namespaces "default" not found`) answers the
    gateway 503 NO_POD_AVAILABLE with a fixed message; a cleanup refused (403) names the status
    and its reason, not the API server's body. The details are logged with the request id."""
    async with KubeSim(ready_delay=0.05, namespaces=("default",), seed=3) as sim:
        client = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path), default_namespace="default")
        await client.start()
        db = Database.from_url(f"sqlite:///{tmp_path / 'config.db'}")
        redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
        try:
            async with running_app(redis, db, k8s=client) as app:  # type: ignore[arg-type]
                await configure(app, ready_timeout=5)
                sim.faults.add("namespace_missing", namespace="default")
                with caplog.at_level(logging.WARNING):
                    resp = await app.post(ROUTE, json=route_body("r-deploy", "s1"))
                assert resp.status_code == 503, resp.text
                failure = resp.json()
                assert failure["error_code"] == "NO_POD_AVAILABLE"
                message = failure["error_message"]
                for leak in ("namespace", "not found", '"', "default", "404", "create pod"):
                    assert leak not in message, message
                logged = [r for r in caplog.records if "r-deploy" in r.getMessage()]
                assert logged and logged[0].levelno == logging.WARNING
                assert 'namespaces \\"default\\" not found' in logged[0].getMessage() or (
                    'namespaces "default" not found' in logged[0].getMessage()
                ), logged[0].getMessage()
                sim.faults.clear()

                caplog.clear()
                sim.faults.add("namespace_forbidden", namespace="default")
                with caplog.at_level(logging.WARNING):
                    resp = await app.post(CLEANUP, json=envelope({}, request_id="r-clean"))
                assert resp.status_code == 502, resp.text
                assert resp.json()["error_code"] == "K8S_ERROR"
                assert resp.json()["error_message"] == (
                    "kubernetes refused the cleanup: 403 Forbidden"
                )
                logged = [r for r in caplog.records if "r-clean" in r.getMessage()]
                assert logged and "is forbidden: User" in logged[0].getMessage()
        finally:
            await client.close()
            await redis.aclose()
            await db.close()


# --- 3. cleanup label selectors: the grammar we accept, 400 for the rest -----------------------


@pytest.mark.parametrize(
    "selector", [",", "a=b,", ",a=b", "a=b,,c", " , ", "a gt 1", "a in ()", "a in (b,)", "!a=b"]
)
async def test_cleanup_refuses_a_selector_kubernetes_would_refuse_with_400(
    redis: Redis, db: Database, selector: str
) -> None:
    cluster = FakeK8sPodClient()
    async with running_app(redis, db, k8s=cluster) as app:
        resp = await app.post(CLEANUP, json=envelope({"label_selector": selector}))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error_code"] == "VALIDATION"
        assert resp.json()["error_message"].startswith("rawdata.label_selector:")


@pytest.mark.usefixtures("_no_proxy")
async def test_cleanup_selectors_reach_kubernetes_as_accepted(tmp_path: Path) -> None:
    """Set-based and equality selectors through the real client and the simulator's API
    server: what we accept, it accepts too, and it deletes exactly the matching pods."""
    async with KubeSim(ready_delay=0.05, namespaces=("default",), seed=5) as sim:
        client = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path), default_namespace="default")
        await client.start()
        db = Database.from_url(f"sqlite:///{tmp_path / 'config.db'}")
        redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
        try:
            async with running_app(redis, db, k8s=client) as app:  # type: ignore[arg-type]
                await configure(app, ready_timeout=5)
                pods = [
                    await client.deploy(
                        scope_id=scope_of(f"g{i}", "b"),
                        deploy_ver="v1",
                        pod_spec={"image": "agentserver:1", "ready_timeout": 5, "pod_name": "x"},
                        identity=IDENTITY,
                    )
                    for i in range(3)
                ]
                first, second = scope_of("g0", "b"), scope_of("g1", "b")
                selector = f"agent-runtime/scope in ({first}, {second}), app notin (nothing)"
                # the dry run lists those pods as the API server gives them, deletes nothing
                dry = {"label_selector": selector, "dry_run": True}
                resp = await app.post(CLEANUP, json=envelope(dry))
                assert resp.status_code == 200, resp.text
                listed = resp.json()["data"]["pods"]
                assert resp.json()["data"]["matched"] == 2
                assert sorted(p["pod_id"] for p in listed) == sorted(p.pod_id for p in pods[:2])
                assert {p["scope_id"] for p in listed} == {first, second}
                assert all(p["phase"] == "Running" and p["ready"] for p in listed), listed
                # creationTimestamp: whole seconds, as the API server writes it
                assert all(abs(p["created"] - time.time()) < 600 for p in listed), listed
                assert all(not p["metadata"].get("deletionTimestamp") for p in sim.pods("default"))
                resp = await app.post(CLEANUP, json=envelope({"label_selector": selector}))
                assert resp.status_code == 200, resp.text
                assert resp.json()["data"] == {"cleaned": 2}
                left = {  # deleted: gone, or terminating (the simulator's grace period)
                    p["metadata"]["name"]
                    for p in sim.pods("default")
                    if not p["metadata"].get("deletionTimestamp")
                }
                assert pods[2].pod_id in left and pods[0].pod_id not in left
        finally:
            await client.close()
            await redis.aclose()
            await db.close()


_TOKENS = ["a", "b", "x.io/k", "v", "", "=", "==", "!=", "!", ",", "(", ")", " in ", " notin ", " "]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(_TOKENS), max_size=8),
    st.dictionaries(st.sampled_from(["a", "b", "x.io/k"]), st.sampled_from(["v", "b", ""])),
)
def test_what_the_service_accepts_the_api_server_accepts_and_matches_alike(
    parts: list[str], labels: dict[str, str]
) -> None:
    """kubesim's copy of ``labels.Parse`` is the oracle: a selector we accept (and the
    canonical form we send) parses there and selects the same labels."""
    text = "".join(parts)
    try:
        ours = label_selector.parse(text)
    except ValueError:
        return
    for sent in (text, label_selector.render(ours)):
        theirs = sim_labels.parse_selector(sent)
        assert theirs.matches(labels) == label_selector.matches(ours, labels), sent


# --- 4. the admin views take every id route takes ----------------------------------------------

ADMIN_IDS = ["a b", "会话-一", "s*", "x" * 256, "a/b", "a:b", "s?[x]", "100%", "é\U0001f600"]


async def test_admin_views_accept_exactly_the_ids_route_accepts(redis: Redis, db: Database) -> None:
    cluster = FakeK8sPodClient()
    async with running_app(redis, db, k8s=cluster) as app:
        await configure(app, pod_concurrency=20, scope_concurrency=20)
        for i, session_id in enumerate(["s1", *ADMIN_IDS]):
            resp = await app.post(ROUTE, json=route_body(f"r-{i}", session_id))
            assert resp.status_code == 200, (session_id, resp.text)
        base = "/api/session/admin"
        for session_id in ADMIN_IDS:
            resp = await app.get(f"{base}/sessions/{quote(session_id, safe='')}")
            assert resp.status_code == 200, (session_id, resp.text)
            data = resp.json()["data"]
            assert data["session_id"] == session_id
            assert data["binding"]["scope_id"] == scope_of("g1", "b1")
        # exact keys, never patterns: "s*" names no other session; a pod or scope id likewise
        assert (await app.get(f"{base}/sessions/s%2A%2A")).status_code == 404
        assert (await app.get(f"{base}/sessions/s%3F")).status_code == 404
        for kind in ("pods", "scopes"):
            for odd in ("a b", "会话-一", "p*", "x" * 256):
                resp = await app.get(f"{base}/{kind}/{quote(odd, safe='')}")
                assert resp.status_code == 404, (kind, odd, resp.text)
                assert resp.json()["error_code"] == "NOT_FOUND"
        # what route refuses, the views refuse: too long, control and format characters
        for refused in ("x" * 257, "a\x00b", "a\nb", "a\u202eb", "a\x7f"):
            for kind in ("sessions", "pods", "scopes"):
                resp = await app.get(f"{base}/{kind}/{quote(refused, safe='')}")
                assert resp.status_code == 400, (kind, refused, resp.text)
                assert resp.json()["error_code"] == "VALIDATION"
            route = await app.post(ROUTE, json=route_body("r-refused", refused))
            assert route.status_code == 400
        schema = (await app.get("/openapi.json")).json()
        for path, name in (
            ("/sessions/{session_id}", "session_id"),
            ("/pods/{pod_id}", "pod_id"),
            ("/scopes/{scope_id}", "scope_id"),
        ):
            param, *query = schema["paths"][base + path]["get"]["parameters"]
            assert param["name"] == name and param["in"] == "path"
            # the session view's tombstone scope: an id by the same rule
            assert [q["name"] for q in query] == (["scope_id"] if name == "session_id" else [])
            for extra in query:
                assert (
                    extra["in"] == "query"
                    and extra["schema"]["pattern"] == (param["schema"]["pattern"])
                )
            assert param["schema"]["minLength"] == 1 and param["schema"]["maxLength"] == 256
            route_schema = schema["paths"][ROUTE]["post"]["requestBody"]["content"]
            session = route_schema["application/json"]["schema"]["properties"]["metadata"]
            assert param["schema"]["pattern"] == session["properties"]["session_id"]["pattern"]


@real_only
async def test_a_redis_outage_is_a_generic_503_and_the_reason_is_logged(
    redis: Redis, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    conn = redis.connection_pool.connection_kwargs
    async with TcpProxy(conn.get("host", "127.0.0.1"), conn.get("port", 6379)) as proxy:
        index = real_redis_url().rsplit("/", 1)[1]
        client = build_redis(
            make_settings(redis_url=f"redis://127.0.0.1:{proxy.port}/{index}", redis_timeout=0.5)
        )
        try:
            async with running_app(client, db) as app:  # type: ignore[arg-type]
                await configure(app)
                assert (await app.post(ROUTE, json=route_body("r-up", "s1"))).status_code == 200
                await proxy.stop()
                with caplog.at_level(logging.WARNING):
                    down = [
                        await app.post(ROUTE, json=route_body("r-down", "s1")),
                        await app.post(TOUCH, json=envelope({}, request_id="r-t", session_id="s1")),
                    ]
                for resp in down:
                    assert resp.status_code == 503, resp.text
                    assert resp.json()["error_code"] == "BACKEND_UNAVAILABLE"
                    assert resp.json()["error_message"] == "redis is unavailable; retry shortly"
                logged = " ".join(r.getMessage() for r in caplog.records)
                assert "r-down" in logged and "r-t" in logged and "ConnectionError" in logged
        finally:
            await client.aclose()
