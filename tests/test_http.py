"""The HTTP surface of contract §2 through the app: envelope, error table, tokens, config_sync
refusals, backends going down, /healthz and /metrics, and cleanup's dry run (it lists what
the same call deletes, and deletes nothing).

Tests whose outcome depends on Redis or the DB run on every ``redis`` × ``db`` combination;
pure envelope tests run on fakeredis + SQLite only (``one_backend``). The BUSY and
BACKEND_UNAVAILABLE tests run on the real Redis (the latter through a ``TcpProxy`` that is
stopped to take the backend down).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest
from redis.asyncio import Redis
from sqlalchemy.engine import make_url

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.session_manager import config_repo
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import build_redis
from helpers import TcpProxy, envelope, make_settings, redis_state, running_app, sync_body

SYNC = "/api/session/config_sync"
ADMIN = {"Authorization": "Bearer adm"}
MAX_BODY = 64 * 1024
SUCCESS_KEYS = {"kind", "op", "id", "change_class", "affected_scopes"}

F = TypeVar("F", bound=Callable[..., Any])


def one_backend(fn: F) -> F:
    """Pure envelope behaviour: one backend combination (fakeredis + SQLite) is enough."""
    fn = pytest.mark.parametrize("redis", ["fake"], indirect=True)(fn)
    return pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)(fn)  # type: ignore[return-value]


real_redis = pytest.mark.parametrize("redis", ["real"], indirect=True)
server_db = pytest.mark.parametrize("sql_backend", ["mariadb", "postgresql"], indirect=True)


def template(template_id: str, **fields: Any) -> dict[str, Any]:
    return {"template_id": template_id, "image": "agentserver:1", **fields}


def rule(group_id: str, bot_id: str, template_id: str) -> dict[str, Any]:
    return {"group_id": group_id, "bot_id": bot_id, "template_id": template_id}


ANY_ID = object()


def assert_failure(
    resp: httpx.Response, status: int, code: str, request_id: object = None
) -> dict[str, Any]:
    """A failure envelope with that status and code; ``retry_after`` only where the table
    has it, and then the same value in ``Retry-After``. ``request_id=ANY_ID``: not checked."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["ok"] is False
    assert body["error_code"] == code, body
    assert isinstance(body["error_message"], str) and body["error_message"]
    if request_id is not ANY_ID:
        assert body["request_id"] == request_id, body
    if code == "BACKEND_UNAVAILABLE":
        assert isinstance(body["retry_after"], int) and body["retry_after"] >= 1, body
        assert resp.headers["retry-after"] == str(body["retry_after"])
    else:
        assert "retry_after" not in body, body
        assert "retry-after" not in resp.headers
    return body


def assert_success(resp: httpx.Response, request_id: str, **data: Any) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"ok", "request_id", "data"}, body
    assert body["ok"] is True
    assert body["request_id"] == request_id
    assert set(body["data"]) == SUCCESS_KEYS, body
    for key, value in data.items():
        assert body["data"][key] == value, body
    return body["data"]


async def db_state(db: Database) -> config_repo.Snapshot:
    return await db.read(config_repo.load_snapshot)


async def post_sync(
    client: httpx.AsyncClient, kind: str, op: str, item: dict[str, Any], **metadata: Any
) -> httpx.Response:
    return await client.post(SYNC, json=sync_body(kind, op, item, **metadata))


async def poll(
    fn: Callable[[], Awaitable[httpx.Response]],
    done: Callable[[httpx.Response], bool],
    within: float = 10.0,
) -> httpx.Response:
    """Call ``fn`` until ``done`` says so, or fail at the deadline with the last answer."""
    deadline = time.monotonic() + within
    while True:
        resp = await fn()
        if done(resp):
            return resp
        assert time.monotonic() < deadline, f"no success before the deadline: {resp.text}"
        await asyncio.sleep(0.05)


class GatedWrites:
    """Stands in for one app's ``Database``: ``write`` signals ``entered`` and then waits for
    ``release`` (the other app, sharing the real Database object, is not affected)."""

    def __init__(self, inner: Database) -> None:
        self.inner = inner
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def write(self, fn: Any) -> Any:
        self.entered.set()
        await self.release.wait()
        return await self.inner.write(fn)


class DownAtWrite:
    """Stands in for a ``Database`` behind ``proxy``: the proxy goes down just before the
    write, after the plan's reads succeeded."""

    def __init__(self, inner: Database, proxy: TcpProxy) -> None:
        self.inner = inner
        self.proxy = proxy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def write(self, fn: Any) -> Any:
        await self.proxy.stop()
        return await self.inner.write(fn)


# --- 400 VALIDATION: the body itself ---------------------------------------------------------


@one_backend
@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"{not json", id="not-json"),
        pytest.param(b"", id="empty"),
        pytest.param(b'{"metadata": {"request_id": "\xc3\x28"}}', id="not-utf8"),
        pytest.param(b"[1]", id="array"),
        pytest.param(b'"x"', id="string"),
        pytest.param(b"42", id="number"),
        pytest.param(b"null", id="null"),
        pytest.param(b"[" * 50_000, id="deeply-nested"),
    ],
)
async def test_body_that_is_not_a_json_object_is_400(
    redis: Redis, db: Database, content: bytes
) -> None:
    async with running_app(redis, db) as client:
        resp = await client.post(
            SYNC, content=content, headers={"content-type": "application/json"}
        )
        assert_failure(resp, 400, "VALIDATION")
        assert await db_state(db) == config_repo.Snapshot()


@one_backend
async def test_json_body_is_read_whatever_the_content_type(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        body = sync_body("template", "create", template("t-plain"), request_id="r-plain")
        for i, content_type in enumerate(["text/plain", None]):
            body["rawdata"]["item"]["template_id"] = f"t-{i}"
            headers = {"content-type": content_type} if content_type else {}
            resp = await client.post(SYNC, content=json.dumps(body).encode(), headers=headers)
            assert_success(resp, "r-plain", id=f"t-{i}")


def _padded_body(size: int) -> bytes:
    """A valid config_sync body of exactly ``size`` bytes (padded in an ignored envelope field)."""
    body = sync_body("template", "create", template("t-big"), request_id="r-big")
    body["padding"] = ""
    raw = json.dumps(body).encode()
    body["padding"] = "x" * (size - len(raw))
    raw = json.dumps(body).encode()
    assert len(raw) == size
    return raw


async def _chunks(raw: bytes, size: int = 4096) -> AsyncIterator[bytes]:
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


@one_backend
@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
async def test_body_over_64_kib_is_400(redis: Redis, db: Database, streamed: bool) -> None:
    async with running_app(redis, db) as client:
        raw = _padded_body(MAX_BODY + 1)
        if streamed:
            request = client.build_request("POST", SYNC, content=_chunks(raw))
            assert "content-length" not in request.headers
            assert request.headers["transfer-encoding"] == "chunked"
        else:
            request = client.build_request("POST", SYNC, content=raw)
            assert request.headers["content-length"] == str(MAX_BODY + 1)
        resp = await client.send(request)
        body = assert_failure(resp, 400, "VALIDATION")
        assert str(MAX_BODY) in body["error_message"]
        assert await db_state(db) == config_repo.Snapshot()

        # exactly at the limit is accepted, both ways
        raw = _padded_body(MAX_BODY)
        content = _chunks(raw) if streamed else raw
        assert_success(await client.post(SYNC, content=content), "r-big", id="t-big")


@one_backend
async def test_oversized_declared_length_is_refused_before_the_body_is_read(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        request = client.build_request("POST", SYNC, content=b"{}")
        request.headers["content-length"] = str(10 * MAX_BODY)
        assert_failure(await client.send(request), 400, "VALIDATION")


# --- 400 VALIDATION: the envelope and the item --------------------------------------------------


@one_backend
@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        pytest.param({}, "metadata.request_id", id="missing"),
        pytest.param({"request_id": ""}, "metadata.request_id", id="empty"),
        pytest.param({"request_id": "r\x01x"}, "metadata.request_id", id="control-char"),
        pytest.param({"request_id": "r\nx"}, "metadata.request_id", id="newline"),
        pytest.param({"request_id": "r" * 257}, "metadata.request_id", id="257-chars"),
        pytest.param({"request_id": 7}, "metadata.request_id", id="not-a-string"),
        pytest.param(None, "metadata", id="no-metadata"),
        pytest.param("r-1", "metadata", id="metadata-not-object"),
    ],
)
async def test_bad_request_id_is_400_and_not_echoed(
    redis: Redis, db: Database, metadata: Any, field: str
) -> None:
    async with running_app(redis, db) as client:
        body: dict[str, Any] = {"rawdata": {"kind": "template", "op": "create"}}
        body["rawdata"]["item"] = template("t1")
        if metadata is not None:
            body["metadata"] = metadata
        resp = await client.post(SYNC, json=body)
        failure = assert_failure(resp, 400, "VALIDATION", request_id=None)
        assert field in failure["error_message"]
        assert await db_state(db) == config_repo.Snapshot()


@one_backend
async def test_request_id_of_256_chars_is_accepted_and_echoed(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        rid = "r" * 256
        assert_success(
            await post_sync(client, "template", "create", template("t1"), request_id=rid), rid
        )


@one_backend
@pytest.mark.parametrize(
    ("rawdata", "field"),
    [
        pytest.param(
            {"kind": "tmpl", "op": "create", "item": template("t")}, "rawdata.kind", id="kind"
        ),
        pytest.param(
            {"kind": "template", "op": "upsert", "item": template("t")}, "rawdata.op", id="op"
        ),
        pytest.param({"kind": "template", "op": "create"}, "rawdata.item", id="no-item"),
        pytest.param(
            {"kind": "template", "op": "create", "item": [1]}, "rawdata.item", id="item-list"
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": template("t"), "extra": 1},
            "rawdata.extra",
            id="rawdata-unknown-field",
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": template("t", bogus=1)},
            "item.bogus",
            id="template-unknown-field",
        ),
        pytest.param(
            {"kind": "template", "op": "update", "item": {"template_id": "t", "bogus": 1}},
            "item.bogus",
            id="partial-update-unknown-field",
        ),
        pytest.param(
            {"kind": "routing_rule", "op": "create", "item": {**rule("g", "b", "t"), "prio": 1}},
            "item.prio",
            id="rule-unknown-field",
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": template("t", sse_port="8080")},
            "item.sse_port",
            id="sse_port-string",
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": template("t", sse_port=70000)},
            "item.sse_port",
            id="sse_port-range",
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": template("t", enabled=1)},
            "item.enabled",
            id="enabled-int",
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": template("t", pod_name="Bad_Name")},
            "item.pod_name",
            id="pod_name-dns",
        ),
        pytest.param(
            {"kind": "template", "op": "create", "item": {"template_id": "t"}},
            "item.image",
            id="image-missing",
        ),
        pytest.param(
            {"kind": "routing_rule", "op": "delete", "item": {"group_id": "g"}},
            "item.bot_id",
            id="rule-delete-missing-id",
        ),
    ],
)
async def test_bad_rawdata_is_400_naming_the_field_with_request_id_echoed(
    redis: Redis, db: Database, rawdata: dict[str, Any], field: str
) -> None:
    async with running_app(redis, db) as client:
        resp = await client.post(
            SYNC, json={"metadata": {"request_id": "r-bad"}, "rawdata": rawdata}
        )
        failure = assert_failure(resp, 400, "VALIDATION", request_id="r-bad")
        assert field in failure["error_message"], failure
        assert "Traceback" not in failure["error_message"]
        assert await db_state(db) == config_repo.Snapshot()


async def test_bad_partial_update_names_the_field_and_changes_nothing(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        assert_success(
            await post_sync(client, "template", "create", template("t1"), request_id="r1"), "r1"
        )
        before_db, before_redis = await db_state(db), await redis_state(redis)
        resp = await post_sync(
            client, "template", "update", {"template_id": "t1", "sse_port": 0}, request_id="r2"
        )
        failure = assert_failure(resp, 400, "VALIDATION", request_id="r2")
        assert "item.sse_port" in failure["error_message"]
        assert await db_state(db) == before_db
        assert await redis_state(redis) == before_redis


async def test_rule_naming_a_missing_template_is_400(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        resp = await post_sync(
            client, "routing_rule", "create", rule("*", "*", "nope"), request_id="r1"
        )
        failure = assert_failure(resp, 400, "VALIDATION", request_id="r1")
        assert "item.template_id" in failure["error_message"]
        assert await db_state(db) == config_repo.Snapshot()


# --- 401 UNAUTHORIZED -------------------------------------------------------------------------


@one_backend
async def test_admin_token_guards_config_sync(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, admin_tokens=["adm"], gateway_tokens=["gw"]) as client:
        refused = [
            {},
            {"Authorization": ""},
            {"Authorization": "Bearer"},
            {"Authorization": "Bearer "},
            {"Authorization": "Bearer nope"},
            {"Authorization": "Bearer adm2"},
            {"Authorization": "Bearer ad"},
            {"Authorization": "Bearer gw"},  # a gateway token is not an admin token
            {"Authorization": "Basic adm"},
            {"Authorization": "adm"},
        ]
        for i, headers in enumerate(refused):
            body = sync_body("template", "create", template(f"t{i}"), request_id=f"r{i}")
            resp = await client.post(SYNC, json=body, headers=headers)
            failure = assert_failure(resp, 401, "UNAUTHORIZED", request_id=ANY_ID)
            assert failure["request_id"] in (None, f"r{i}")
            message = failure["error_message"].lower()
            assert "admin" not in message and "gateway" not in message, message
        assert await db_state(db) == config_repo.Snapshot()

        body = sync_body("template", "create", template("t-ok"), request_id="r-ok")
        assert_success(await client.post(SYNC, json=body, headers=ADMIN), "r-ok", id="t-ok")


@one_backend
@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"{not json", id="not-json"),
        pytest.param(b"[1]", id="not-object"),
        pytest.param(b'{"x": 1}', id="no-metadata"),
        pytest.param(json.dumps(sync_body("tmpl", "create", {})).encode(), id="bad-kind"),
    ],
)
async def test_401_comes_before_body_validation(redis: Redis, db: Database, content: bytes) -> None:
    async with running_app(redis, db, admin_tokens=["adm"], gateway_tokens=["gw"]) as client:
        headers = {"content-type": "application/json"}
        resp = await client.post(SYNC, content=content, headers=headers)
        assert_failure(resp, 401, "UNAUTHORIZED", request_id=None)
        # with the token the same body is a 400
        resp = await client.post(SYNC, content=content, headers={**headers, **ADMIN})
        assert resp.status_code == 400, resp.text


# --- 404 NOT_FOUND ----------------------------------------------------------------------------


async def test_update_or_delete_of_missing_items_is_404(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        assert_success(
            await post_sync(client, "template", "create", template("t1"), request_id="r0"), "r0"
        )
        assert_success(
            await post_sync(
                client, "routing_rule", "create", rule("g", "b", "t1"), request_id="r1"
            ),
            "r1",
        )
        before_db, before_redis = await db_state(db), await redis_state(redis)
        missing = [
            ("template", "update", template("t-missing")),
            ("template", "update", {"template_id": "t-missing", "sse_port": 9000}),
            ("template", "delete", {"template_id": "t-missing"}),
            ("routing_rule", "update", rule("g", "other", "t1")),
            ("routing_rule", "update", rule("*", "*", "t1")),
            ("routing_rule", "delete", {"group_id": "other", "bot_id": "b"}),
        ]
        for i, (kind, op, item) in enumerate(missing):
            resp = await post_sync(client, kind, op, item, request_id=f"r-404-{i}")
            assert_failure(resp, 404, "NOT_FOUND", request_id=f"r-404-{i}")
        assert await db_state(db) == before_db
        assert await redis_state(redis) == before_redis


@one_backend
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_unknown_path_is_a_404_envelope(redis: Redis, db: Database, method: str) -> None:
    async with running_app(redis, db) as client:
        for path in ["/nope", "/api/session/nope", "/api/session/config_sync/x"]:
            resp = await client.request(method, path, json={"metadata": {"request_id": "r1"}})
            assert_failure(resp, 404, "NOT_FOUND", request_id=None)


# --- 409 CONFLICT -----------------------------------------------------------------------------


async def test_create_of_existing_items_and_delete_of_used_template_are_409(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        assert_success(
            await post_sync(client, "template", "create", template("t1"), request_id="r0"), "r0"
        )
        assert_success(
            await post_sync(
                client, "routing_rule", "create", rule("g", "*", "t1"), request_id="r1"
            ),
            "r1",
        )
        before_db, before_redis = await db_state(db), await redis_state(redis)

        resp = await post_sync(
            client, "template", "create", template("t1", image="other:2"), request_id="r2"
        )
        assert_failure(resp, 409, "CONFLICT", request_id="r2")
        resp = await post_sync(
            client, "routing_rule", "create", rule("g", "*", "t1"), request_id="r3"
        )
        assert_failure(resp, 409, "CONFLICT", request_id="r3")
        resp = await post_sync(client, "template", "delete", {"template_id": "t1"}, request_id="r4")
        failure = assert_failure(resp, 409, "CONFLICT", request_id="r4")
        assert "t1" in failure["error_message"]

        assert await db_state(db) == before_db
        assert await redis_state(redis) == before_redis

        # once the rule is gone the template can go
        assert_success(
            await post_sync(
                client, "routing_rule", "delete", {"group_id": "g", "bot_id": "*"}, request_id="r5"
            ),
            "r5",
            kind="routing_rule",
            op="delete",
            id="g/*",
        )
        assert_success(
            await post_sync(client, "template", "delete", {"template_id": "t1"}, request_id="r6"),
            "r6",
            kind="template",
            op="delete",
            id="t1",
        )
        assert await db_state(db) == config_repo.Snapshot()


# --- 409 CONFIG_SYNC_BUSY across two replicas ---------------------------------------------------


async def test_config_sync_busy_across_two_instances(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        running_app(redis, db, instance_id="replica-a") as a,
        running_app(redis, db, instance_id="replica-b") as b,
    ):
        store_a = a.app.state.services.config_store  # type: ignore[attr-defined]
        assert store_a is not b.app.state.services.config_store  # type: ignore[attr-defined]
        gate = GatedWrites(store_a._db)
        monkeypatch.setattr(store_a, "_db", gate)

        task_a = asyncio.create_task(
            post_sync(a, "template", "create", template("t-a"), request_id="r-a")
        )
        try:
            await asyncio.wait_for(gate.entered.wait(), timeout=10)
            before_db, before_redis = await db_state(db), await redis_state(redis)

            resp_b = await post_sync(b, "template", "create", template("t-b"), request_id="r-b")
            assert_failure(resp_b, 409, "CONFIG_SYNC_BUSY", request_id="r-b")
            # and on A itself, while its own call holds the lock
            resp_a2 = await post_sync(
                a, "routing_rule", "create", rule("*", "*", "t-a"), request_id="r-a2"
            )
            assert_failure(resp_a2, 409, "CONFIG_SYNC_BUSY", request_id="r-a2")

            assert not task_a.done()
            assert await db_state(db) == before_db  # the refused calls changed nothing
            assert await redis_state(redis) == before_redis
            assert "t-b" not in before_db.templates and "t-a" not in before_db.templates
        finally:
            gate.release.set()
            resp_a = await asyncio.wait_for(task_a, timeout=10)
        assert_success(resp_a, "r-a", kind="template", op="create", id="t-a")

        resp_b = await post_sync(b, "template", "create", template("t-b"), request_id="r-b")
        assert_success(resp_b, "r-b", kind="template", op="create", id="t-b")
        assert set((await db_state(db)).templates) == {"t-a", "t-b"}


# --- 503 BACKEND_UNAVAILABLE ------------------------------------------------------------------


@real_redis
async def test_redis_down_is_503_and_the_app_recovers(redis: Redis, db: Database) -> None:
    conn = redis.connection_pool.connection_kwargs
    async with TcpProxy(conn.get("host", "127.0.0.1"), conn.get("port", 6379)) as proxy:
        # the production client (timeouts, retries), pointed at the proxy, on the claimed db
        settings = make_settings(
            redis_url=f"redis://127.0.0.1:{proxy.port}/{conn.get('db', 0)}", redis_timeout=1
        )
        proxied = build_redis(settings)
        try:
            assert int(conn.get("db", 0)) != 0
            async with running_app(proxied, db) as client:
                resp = await post_sync(
                    client, "template", "create", template("t1"), request_id="r1"
                )
                assert_success(resp, "r1")
                before_db = await db_state(db)

                await proxy.stop()
                started = time.monotonic()
                resp = await post_sync(
                    client, "template", "create", template("t2"), request_id="r2"
                )
                elapsed = time.monotonic() - started
                failure = assert_failure(resp, 503, "BACKEND_UNAVAILABLE", request_id="r2")
                assert elapsed < 5, f"a dead Redis took {elapsed:.1f}s to answer"
                assert "Traceback" not in failure["error_message"]
                assert await db_state(db) == before_db

                await proxy.start()
                resp = await poll(
                    lambda: post_sync(client, "template", "sync", template("t2"), request_id="r3"),
                    lambda r: r.status_code != 503,
                )
                assert_success(resp, "r3", op="sync", id="t2")
                assert set((await db_state(db)).templates) == {"t1", "t2"}
        finally:
            await proxied.aclose()


@server_db
async def test_db_down_is_503_and_changes_nothing(
    redis: Redis, db: Database, migrated_url: str
) -> None:
    url = make_url(migrated_url)
    default_port = 3306 if url.get_backend_name() in ("mysql", "mariadb") else 5432
    async with TcpProxy(url.host or "127.0.0.1", url.port or default_port) as proxy:
        proxied_url = url.set(host="127.0.0.1", port=proxy.port)
        proxied = Database.from_url(
            proxied_url.render_as_string(hide_password=False), pool_size=2, connect_timeout=1
        )
        try:
            async with running_app(redis, proxied) as client:
                resp = await post_sync(
                    client, "template", "create", template("t1"), request_id="r1"
                )
                assert_success(resp, "r1")
                before_db, before_redis = await db_state(db), await redis_state(redis)

                await proxy.stop()
                started = time.monotonic()
                resp = await post_sync(
                    client, "template", "create", template("t2"), request_id="r2"
                )
                elapsed = time.monotonic() - started
                assert_failure(resp, 503, "BACKEND_UNAVAILABLE", request_id="r2")
                assert elapsed < 5, f"a dead DB took {elapsed:.1f}s to answer"
                assert await redis_state(redis) == before_redis
                assert await db_state(db) == before_db

                await proxy.start()
                resp = await poll(
                    lambda: post_sync(client, "template", "sync", template("t2"), request_id="r3"),
                    lambda r: r.status_code != 503,
                )
                assert_success(resp, "r3", op="sync", id="t2")
                assert set((await db_state(db)).templates) == {"t1", "t2"}
        finally:
            await proxied.close()


@server_db
async def test_failed_db_write_drops_no_cache_and_pushes_nothing(
    redis: Redis, db: Database, migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DB fails between the plan (reads) and the write: the error is returned and Redis
    is exactly as before: no cache dropped, no generation bump, no pool config pushed."""
    url = make_url(migrated_url)
    default_port = 3306 if url.get_backend_name() in ("mysql", "mariadb") else 5432
    async with TcpProxy(url.host or "127.0.0.1", url.port or default_port) as proxy:
        proxied_url = url.set(host="127.0.0.1", port=proxy.port)
        proxied = Database.from_url(
            proxied_url.render_as_string(hide_password=False), pool_size=2, connect_timeout=1
        )
        try:
            async with running_app(redis, proxied) as client:
                svc = client.app.state.services  # type: ignore[attr-defined]
                assert_success(
                    await post_sync(client, "template", "create", template("t1"), request_id="r1"),
                    "r1",
                )
                assert_success(
                    await post_sync(
                        client, "routing_rule", "create", rule("*", "*", "t1"), request_id="r2"
                    ),
                    "r2",
                )
                scope_id = scope_id_of("g", "b")
                cached = await svc.config_store.resolve(scope_id, "g", "b")  # a known, cached scope
                assert cached.scope_concurrency == 10
                before_db, before_redis = await db_state(db), await redis_state(redis)
                assert any(scope_id in key and key.endswith(":config") for key in before_redis)

                monkeypatch.setattr(svc.config_store, "_db", DownAtWrite(proxied, proxy))
                resp = await post_sync(
                    client,
                    "template",
                    "update",
                    {"template_id": "t1", "scope_concurrency": 20},
                    request_id="r3",
                )
                assert_failure(resp, 503, "BACKEND_UNAVAILABLE", request_id="r3")
                assert not proxy.running
                assert await redis_state(redis) == before_redis
                assert await db_state(db) == before_db

                monkeypatch.undo()
                await proxy.start()
                resp = await poll(
                    lambda: post_sync(
                        client,
                        "template",
                        "update",
                        {"template_id": "t1", "scope_concurrency": 20},
                        request_id="r4",
                    ),
                    lambda r: r.status_code != 503,
                )
                assert_success(resp, "r4", change_class="policy", affected_scopes=1)
                assert (await db_state(db)).templates["t1"].scope_concurrency == 20
                assert (await svc.config_store.resolve(scope_id, "g", "b")).scope_concurrency == 20
        finally:
            await proxied.close()


# --- 500 INTERNAL -----------------------------------------------------------------------------


async def test_unexpected_error_is_500_without_stack_trace(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_app(redis, db) as client:
        store = client.app.state.services.config_store  # type: ignore[attr-defined]

        async def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom secret")

        monkeypatch.setattr(store, "config_sync", boom)
        resp = await post_sync(client, "template", "create", template("t1"), request_id="r-500")
        failure = assert_failure(resp, 500, "INTERNAL", request_id="r-500")
        message = failure["error_message"]
        assert "Traceback" not in message and 'File "' not in message, message

        monkeypatch.undo()  # the app goes on serving
        resp = await post_sync(client, "template", "create", template("t1"), request_id="r-ok")
        assert_success(resp, "r-ok")


# --- success envelope -------------------------------------------------------------------------


async def test_success_envelope_shape(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        resp = await post_sync(client, "template", "create", template("t1"), request_id="r-7f3a")
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json() == {
            "ok": True,
            "request_id": "r-7f3a",
            "data": {
                "kind": "template",
                "op": "create",
                "id": "t1",
                "change_class": "none",
                "affected_scopes": 0,
            },
        }
        resp = await post_sync(
            client, "routing_rule", "sync", rule("grp", "*", "t1"), request_id="r-2"
        )
        assert_success(resp, "r-2", kind="routing_rule", op="sync", id="grp/*", affected_scopes=0)
        resp = await post_sync(
            client, "template", "update", {"template_id": "t1", "image": "agentserver:2"},
            request_id="r-3",
        )  # fmt: skip
        assert_success(resp, "r-3", kind="template", op="update", id="t1", change_class="deploy")
        resp = await post_sync(
            client, "template", "sync", template("t1", image="agentserver:2", pod_ttl=600),
            request_id="r-4",
        )  # fmt: skip
        assert_success(resp, "r-4", op="sync", change_class="policy")
        resp = await post_sync(
            client, "template", "sync", template("t1", image="agentserver:2", pod_ttl=600),
            request_id="r-5",
        )  # fmt: skip
        assert_success(resp, "r-5", op="sync", change_class="none")
        stored = (await db_state(db)).templates["t1"]
        assert (stored.image, stored.pod_ttl) == ("agentserver:2", 600)


# --- /healthz and /metrics --------------------------------------------------------------------


@one_backend
async def test_healthz(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, instance_id="replica-h") as client:
        resp = await client.get("/healthz")
        assert resp.status_code == 200
        assert resp.json() == {"ok": True, "instance_id": "replica-h"}

        client.app.state.services.draining = True  # type: ignore[attr-defined]
        resp = await client.get("/healthz")
        assert resp.status_code == 503
        assert resp.json()["ok"] is False


@one_backend
async def test_healthz_and_metrics_are_open_when_tokens_are_set(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, admin_tokens=["adm"], gateway_tokens=["gw"]) as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


@one_backend
async def test_metrics_count_requests_per_endpoint_and_status(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        assert_success(
            await post_sync(client, "template", "create", template("t1"), request_id="r1"), "r1"
        )
        resp = await post_sync(client, "template", "create", template("t1"), request_id="r2")
        assert_failure(resp, 409, "CONFLICT", request_id="r2")
        assert (await client.get("/no-such-path-1234")).status_code == 404

        resp = await client.get("/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        text = resp.text
        assert "# TYPE agent_runtime_http_requests_total counter" in text
        series = (
            "agent_runtime_http_requests_total"
            '{code="%s",endpoint="/api/session/config_sync",status="%s"}'
        )
        assert f"{series % ('OK', 200)} 1.0" in text
        assert f"{series % ('CONFLICT', 409)} 1.0" in text  # the outcome: the error code
        assert "no-such-path-1234" not in text  # unknown paths do not grow the label set
        assert 'code="NOT_FOUND",endpoint="other",status="404"' in text
        assert resp.headers.get("x-error-code") is None  # only failures carry it


# --- cleanup's dry run ---------------------------------------------------------------------------

CLEANUP = "/api/session/cleanup"
PREVIEW_MAX = 500  # docs/reference/api.md: a dry run names the first 500 pods by name


def cleanup_cluster() -> tuple[FakeK8sPodClient, dict[str, str]]:
    """Pods a cleanup must tell apart: ours in the default namespace (two of team x), one of
    ours elsewhere, a gateway pod with our scope label, and another tool's AgentServer (no
    scope label of ours). Their names by role."""
    k8s = FakeK8sPodClient()
    x1 = k8s.add_pod(scope_id="s1", deploy_ver="v1", labels={"team": "x"}, node="node-a")
    x2 = k8s.add_pod(scope_id="s2", deploy_ver="v2", labels={"team": "x"}, phase="Pending")
    y = k8s.add_pod(scope_id="s3", deploy_ver="v1", labels={"team": "y"})
    elsewhere = k8s.add_pod(scope_id="s4", deploy_ver="v1", namespace="team", labels={"team": "x"})
    gateway = k8s.add_pod(
        scope_id="s5", deploy_ver="v1", labels={"jiuwenclaw-component": "gateway", "team": "x"}
    )
    unscoped = k8s.add_pod(scope_id="s6", deploy_ver="v1", labels={"team": "x"})
    labels = {k: v for k, v in unscoped.labels.items() if k != "agent-runtime/scope"}
    k8s.pods[unscoped.pod_id] = dataclasses.replace(unscoped, labels=labels)
    names = {
        "x1": x1.pod_id,
        "x2": x2.pod_id,
        "y": y.pod_id,
        "elsewhere": elsewhere.pod_id,
        "gateway": gateway.pod_id,
        "unscoped": unscoped.pod_id,
    }
    return k8s, names


async def post_cleanup(client: httpx.AsyncClient, **rawdata: Any) -> httpx.Response:
    return await client.post(CLEANUP, json=envelope(rawdata), headers=ADMIN)


@one_backend
async def test_cleanup_dry_run_lists_what_the_same_call_deletes_and_deletes_nothing(
    redis: Redis, db: Database
) -> None:
    k8s, names = cleanup_cluster()
    before = set(k8s.pods)
    async with running_app(redis, db, k8s=k8s, admin_tokens=["adm"], namespaces=["team"]) as app:
        resp = await post_cleanup(app, label_selector="team=x", dry_run=True)
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert set(data) == {"cleaned", "dry_run", "matched", "truncated", "pods"}
        assert data["cleaned"] == 0 and data["dry_run"] is True and data["truncated"] is False
        assert data["matched"] == 2, "component and scope labels ANDed in, one namespace"
        listed = {p["pod_id"]: p for p in data["pods"]}
        assert list(listed) == sorted([names["x1"], names["x2"]]), "by name"
        first, second = listed[names["x1"]], listed[names["x2"]]
        assert first["namespace"] == "default" and first["scope_id"] == "s1"
        assert (first["deploy_ver"], first["phase"], first["ready"]) == ("v1", "Running", True)
        assert first["node"] == "node-a"
        assert isinstance(first["created"], float) and abs(first["created"] - time.time()) < 600
        assert (second["scope_id"], second["phase"], second["ready"]) == ("s2", "Pending", False)
        assert set(k8s.pods) == before and not k8s.deleted, "a dry run deletes nothing"

        # every pod of ours in the default namespace; another namespace on its own
        resp = await post_cleanup(app, dry_run=True)
        assert resp.json()["data"]["matched"] == 3
        resp = await post_cleanup(app, namespace="team", dry_run=True)
        assert [p["pod_id"] for p in resp.json()["data"]["pods"]] == [names["elsewhere"]]

        # the real call deletes exactly what its dry run listed; its answer is the contract's
        resp = await post_cleanup(app, label_selector="team=x", dry_run=False)
        assert resp.json()["data"] == {"cleaned": 2}
        assert set(k8s.pods) == before - {names["x1"], names["x2"]}
        resp = await post_cleanup(app, label_selector="team=x", dry_run=True)
        assert resp.json()["data"] == {
            "cleaned": 0, "dry_run": True, "matched": 0, "truncated": False, "pods": []
        }  # fmt: skip


@one_backend
async def test_cleanup_dry_run_names_at_most_500_pods_and_counts_them_all(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    for i in range(PREVIEW_MAX + 3):
        k8s.add_pod(scope_id=f"s{i}", deploy_ver="v1", pod_id=f"agent-{i:04d}")
    async with running_app(redis, db, k8s=k8s, admin_tokens=["adm"]) as app:
        data = (await post_cleanup(app, dry_run=True)).json()["data"]
        assert data["matched"] == PREVIEW_MAX + 3 and data["truncated"] is True
        assert [p["pod_id"] for p in data["pods"]] == [f"agent-{i:04d}" for i in range(500)]
        assert len(k8s.pods) == PREVIEW_MAX + 3


@one_backend
async def test_cleanup_dry_run_refuses_and_fails_as_the_real_call_does(
    redis: Redis, db: Database
) -> None:
    k8s, _ = cleanup_cluster()
    k8s.forbidden_namespaces.add("team")
    async with running_app(redis, db, k8s=k8s, admin_tokens=["adm"], namespaces=["team"]) as app:
        for dry_run in (True, False):
            resp = await post_cleanup(app, label_selector="a in ()", dry_run=dry_run)
            body = assert_failure(resp, 400, "VALIDATION", request_id=ANY_ID)
            assert body["error_message"].startswith("rawdata.label_selector:")
            resp = await post_cleanup(app, namespace="team", dry_run=dry_run)
            body = assert_failure(resp, 502, "K8S_ERROR", request_id=ANY_ID)
            assert body["error_message"] == "kubernetes refused the cleanup: 403 Forbidden"
            # outside the allow-list: nothing of ours can be there, Kubernetes is not asked
            resp = await post_cleanup(app, namespace="elsewhere", dry_run=dry_run)
            expected: dict[str, Any] = {"cleaned": 0}
            if dry_run:
                expected.update(dry_run=True, matched=0, truncated=False, pods=[])
            assert resp.json()["data"] == expected
        for wrong in ("true", 1, None):  # strict: a boolean only
            resp = await post_cleanup(app, dry_run=wrong)
            body = assert_failure(resp, 400, "VALIDATION", request_id=ANY_ID)
            assert "rawdata.dry_run" in body["error_message"]
        resp = await app.post(CLEANUP, json=envelope({"dry_run": True}))  # no token
        assert_failure(resp, 401, "UNAUTHORIZED")
    assert not k8s.deleted
