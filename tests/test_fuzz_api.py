"""The HTTP surface under fire: Schemathesis over the app's own OpenAPI, plus hand-made edges.

Schemathesis (stateless, in process through ASGI) generates bodies for every documented
operation from ``/openapi.json``: valid ones and ones that break the schema. The app is the
local mode one (in-process fakeredis, SQLite in a temporary folder, fake Kubernetes) with
gateway and admin tokens configured; the tokens go with every call. Every answer must be one
the OpenAPI documents for that operation (status, content type, headers, body schema), never a
5xx, and every failure the contract's envelope with the status its error code has; a body that
breaks the schema is a 400 ``VALIDATION`` (never 422).

The hand-made tests below cover what a generator does not reach: nesting, NaN, forbidden
characters in every id, over-long ids, bytes that are not UTF-8, the 64 KiB limit, duplicate keys.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from redis.asyncio import Redis
from schemathesis.checks import CheckContext
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi

from agent_runtime.api.json_body import MAX_BODY_BYTES, MAX_DEPTH
from agent_runtime.db.engine import Database
from agent_runtime.errors import AgentRuntimeError, ErrorCode
from agent_runtime.main import create_app
from helpers import make_settings, running_app

GATEWAY = "gw-fuzz"
ADMIN = "adm-fuzz"
ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
CLEANUP = "/api/session/cleanup"
EXAMPLES = 150  # per operation (fuzzing phase); the coverage phase adds its own cases
CALL_TIMEOUT = 10.0  # seconds one call may take (a hung handler fails its case, not the run)
# the built-in checks that apply to a stateless run against a documented schema; left out:
# positive_data_acceptance (the schema cannot say "the rule's template must exist"),
# unsupported_method (405 is outside the contract), the stateful ones (no links)
BUILTIN_CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
]

# the contract's table (errors.py): which HTTP status each error code comes with (one class
# per code; a code two classes shared would make this ambiguous)
STATUS_OF = {cls.code: cls.http_status for cls in AgentRuntimeError.__subclasses__()}
assert len(STATUS_OF) == len(AgentRuntimeError.__subclasses__())


def _token_for(path: str) -> str:
    return GATEWAY if path in (ROUTE, TOUCH) else ADMIN  # admin: config_sync, cleanup, admin/*


# --- Schemathesis --------------------------------------------------------------------------------


# The app is built at import (cheap: its backends are built by its lifespan) so that Schemathesis
# can make one test per operation at collection; Schemathesis starts the lifespan at the first
# call (on its own event loop thread) and ``_app_lifespan`` ends it after this module.
# (``schemathesis.pytest.from_fixture`` would load it later, but 4.32 reads a node attribute
# that pytest 9 dropped.)
FUZZ_DB = Path(tempfile.gettempdir()) / f"agent_runtime_fuzz_{os.getpid()}.db"
app = create_app(
    make_settings(
        sqlite_path=FUZZ_DB,
        local_seed=True,  # a `default` template and a (*, *) rule: routes can succeed
        gateway_tokens=[GATEWAY],
        admin_tokens=[ADMIN],
        scope_full_timeout=0.2,  # a full scope answers 504 at once
    )
)
schema = schemathesis.openapi.from_dict(app.openapi())
schema.app = app  # calls go to the app in process (ASGI)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES,
    deterministic=True,
    database="none",
)
schema.config.update(request_timeout=CALL_TIMEOUT)
schema.config.checks.update(included_check_names=BUILTIN_CHECKS)
# a body that breaks the schema is a 400; a missing or mangled token (Schemathesis negates the
# security scheme too) a 401; never a 422 (contract_envelope tells the two apart)
schema.config.checks.negative_data_rejection.expected_statuses = ["400", "401"]


@pytest.fixture(scope="module", autouse=True)
def _app_lifespan() -> Iterator[None]:
    FUZZ_DB.unlink(missing_ok=True)
    yield
    asgi.shutdown_lifespans()  # ends the lifespans Schemathesis started: backends closed
    FUZZ_DB.unlink(missing_ok=True)


def contract_envelope(ctx: CheckContext, response: Any, case: schemathesis.Case) -> bool | None:
    """Every API answer is the contract's envelope and a failure has its code's status; a
    401 comes only without the right token, and with it a body that breaks the schema is a 400
    VALIDATION. A method the path does not have is 405 ``METHOD_NOT_ALLOWED`` with ``Allow``."""
    if not case.path.startswith("/api/"):
        return None
    body = response.json()
    assert isinstance(body, dict), body
    if response.status_code == 200:
        assert body["ok"] is True and set(body) == {"ok", "request_id", "data"}, body
        return None
    assert body["ok"] is False, body
    assert set(body) - {"retry_after"} == {"ok", "request_id", "error_code", "error_message"}, body
    assert isinstance(body["error_message"], str) and body["error_message"], body
    assert "Traceback" not in body["error_message"], body
    code = ErrorCode(body["error_code"])
    if response.status_code == 405:
        assert code is ErrorCode.METHOD_NOT_ALLOWED and response.headers.get("allow"), body
        assert case.method.lower() not in case.operation.schema.raw_schema["paths"][case.path]
        return None
    assert STATUS_OF[code] == response.status_code, body
    sent = response.request.headers.get("authorization")
    right = sent == f"Bearer {_token_for(case.path)}"
    assert (response.status_code == 401) is not right, (sent, response.status_code, body)
    meta = case.meta
    body_info = meta.components.get(ParameterLocation.BODY) if meta is not None else None
    if right and body_info is not None and body_info.mode is GenerationMode.NEGATIVE:
        assert response.status_code == 400, (response.status_code, body)
    return None


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_fuzz_every_operation(case: schemathesis.Case) -> None:
    headers = {"Authorization": f"Bearer {_token_for(case.path)}"}
    for name, value in list((case.query or {}).items()):
        if value in ([], {}):  # an extra parameter that serialises to nothing: the negative
            case.query[name] = "x"  # case would reach the app as a valid request (a false 200)
    case.call_and_validate(headers=headers, additional_checks=[contract_envelope])


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_admin_cursor_out_of_range_is_400(redis: Redis, db: Database) -> None:
    """Found by the fuzz run: a cursor past 64 bits was a 500 (Redis refused it)."""
    async with running_app(redis, db) as client:
        resp = await client.get(f"/api/session/admin/scopes?cursor={2**64}")
        assert resp.status_code == 400, resp.text
        newline = await client.get("/api/session/admin/sessions/s-1%0A")
        assert newline.status_code == 400, newline.text


# --- hand-made edges ------------------------------------------------------------------------------


def _route_body(**metadata: Any) -> dict[str, Any]:
    base = {"request_id": "r-1", "session_id": "s-1", "bot_id": "b-1", "extra": {"group_id": "g"}}
    base.update(metadata)
    return {"metadata": base, "rawdata": {}}


async def _post(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    """POST ``body`` as JSON the way most clients write it: ASCII, ``\\uXXXX`` escapes (httpx's
    own ``json=`` writes UTF-8 and cannot carry a lone surrogate)."""
    return await client.post(path, content=json.dumps(body).encode())


def _assert_400(resp: httpx.Response, *, request_id: object = None) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["ok"] is False and body["error_code"] == "VALIDATION", body
    assert body["request_id"] == request_id, body
    return body


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"[" * 10_000, id="10k-open-brackets"),
        pytest.param(b"[" * 10_000 + b"]" * 10_000, id="10k-deep-array"),
        pytest.param(b'{"a":' * 10_000 + b"1" + b"}" * 10_000, id="10k-deep-object"),
        pytest.param(
            json.dumps(_route_body()).encode()[:-1]
            + b', "x": '
            + b"[" * (MAX_DEPTH + 1)
            + b"]" * (MAX_DEPTH + 1)
            + b"}",
            id="limit-plus-one-deep-in-an-ignored-field",
        ),
    ],
)
async def test_deep_nesting_is_a_fast_400(redis: Redis, db: Database, content: bytes) -> None:
    assert len(content) <= MAX_BODY_BYTES
    async with running_app(redis, db) as client:
        started = time.perf_counter()
        resp = await client.post(ROUTE, content=content)
        elapsed = time.perf_counter() - started
        body = _assert_400(resp)
        assert "nests deeper" in body["error_message"], body
        assert elapsed < 0.5, elapsed


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_nesting_up_to_the_limit_is_read(redis: Redis, db: Database) -> None:
    """MAX_DEPTH levels (the body's own object included) are fine; brackets in strings do not
    count."""
    async with running_app(redis, db, local_seed=True) as client:
        deep = MAX_DEPTH - 1  # inside the body's object
        body = json.dumps(_route_body()).encode()[:-1]
        content = body + b', "x": ' + b"[" * deep + b"]" * deep + b', "s": "' + b"[{" * 100 + b'"}'
        resp = await client.post(ROUTE, content=content)
        assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"], ids=lambda b: b.decode()
)
async def test_nan_and_infinity_are_400(redis: Redis, db: Database, literal: bytes) -> None:
    async with running_app(redis, db, local_seed=True) as client:
        body = json.dumps(_route_body()).encode()[:-1] + b', "x": ' + literal + b"}"
        resp = await client.post(ROUTE, content=body)
        message = _assert_400(resp)["error_message"]
        assert "NaN or Infinity" in message
        # in a config item too (ready_timeout is a float)
        item = b'{"template_id": "t", "image": "i", "ready_timeout": ' + literal + b"}"
        raw = b'{"metadata": {"request_id": "r"}, "rawdata": {"kind": "template", "op": "create", '
        resp = await client.post(SYNC, content=raw + b'"item": ' + item + b"}}")
        _assert_400(resp)


FORBIDDEN = [
    "\x00", "\x01", "\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\x9f", "\u00ad", "\u200b",
    "\u200d", "\u202e", "\u2066", "\u2028", "\u2029", "\ufeff", "\ufffe", "\ud800", "\udfff",
    "\U000e0041",
]  # fmt: skip
ID_FIELDS = ["request_id", "session_id", "bot_id", "group_id"]


def _with_id(field: str, value: str) -> dict[str, Any]:
    body = _route_body()
    if field == "group_id":
        body["metadata"]["extra"]["group_id"] = value
    else:
        body["metadata"][field] = value
    return body


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("field", ID_FIELDS)
async def test_forbidden_characters_in_every_route_id_are_400(
    redis: Redis, db: Database, field: str
) -> None:
    async with running_app(redis, db, local_seed=True) as client:
        for char in FORBIDDEN:
            for value in (char, f"a{char}", f"{char}b", f"a{char}b"):
                # ensure_ascii: a lone surrogate travels as \\ud800, as a client would send it
                content = json.dumps(_with_id(field, value)).encode()
                resp = await client.post(ROUTE, content=content)
                echoed = None if field == "request_id" else "r-1"
                body = _assert_400(resp, request_id=echoed)
                assert field in body["error_message"], body
                assert char not in body["error_message"], body


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_forbidden_characters_in_touch_and_admin_ids_are_400(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        for char in ("\x00", "\u202e", "\ud800"):
            for field in ("request_id", "session_id"):
                metadata = {"request_id": "r-1", "session_id": "s-1", field: f"x{char}"}
                resp = await _post(client, TOUCH, {"metadata": metadata})
                _assert_400(resp, request_id=None if field == "request_id" else "r-1")
            resp = await _post(client, SYNC, {"metadata": {"request_id": f"r{char}"}})
            _assert_400(resp)
            resp = await _post(client, CLEANUP, {"metadata": {"request_id": f"r{char}"}})
            _assert_400(resp)
            items = [
                ("template", {"template_id": f"t{char}", "image": "i"}),
                ("template", {"template_id": "t", "image": f"i{char}"}),
                ("template", {"template_id": "t", "image": "i", "sse_path": f"/s{char}"}),
                ("routing_rule", {"group_id": f"g{char}", "bot_id": "b", "template_id": "t"}),
                ("routing_rule", {"group_id": "g", "bot_id": f"b{char}", "template_id": "t"}),
            ]
            for kind, item in items:
                body = {"metadata": {"request_id": "r-2"}, "rawdata": {}}
                body["rawdata"] = {"kind": kind, "op": "create", "item": item}
                _assert_400(await _post(client, SYNC, body), request_id="r-2")


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_ids_over_256_characters_are_400_and_256_is_fine(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, local_seed=True) as client:
        for field in ID_FIELDS:
            body = _assert_400(await _post(client, ROUTE, _with_id(field, "x" * 257)),
                               request_id=None if field == "request_id" else "r-1")  # fmt: skip
            assert field in body["error_message"]
        long = {f: "界" * 256 for f in ("request_id", "session_id", "bot_id")}
        resp = await _post(client, ROUTE, _route_body(**long, extra={"group_id": "g" * 256}))
        assert resp.status_code == 200, resp.text
        assert resp.json()["request_id"] == "界" * 256


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_session_ids_with_colons_never_share_a_redis_key(redis: Redis, db: Database) -> None:
    """``s-1:previous_pod`` once shared its key with the tombstone of ``s-1``; both route."""
    async with running_app(redis, db, local_seed=True) as client:
        for i, sid in enumerate(("s-1", "s-1:previous_pod", "tenant:s-1:previous")):
            resp = await _post(client, ROUTE, _route_body(request_id=f"r-{i}", session_id=sid))
            assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"\xff\xfe{}", id="latin1-bytes"),
        pytest.param(b'{"metadata": {"request_id": "\xc3\x28"}}', id="invalid-utf8"),
        pytest.param(b'{"metadata": {"request_id": "\xed\xa0\x80"}}', id="utf8-encoded-surrogate"),
        pytest.param('{"metadata": {}}'.encode("utf-16"), id="utf-16"),
        pytest.param(b"\xef\xbb\xbf\xef\xbb\xbf{}", id="two-boms"),
    ],
)
async def test_bytes_that_are_not_utf8_json_are_400(
    redis: Redis, db: Database, content: bytes
) -> None:
    async with running_app(redis, db) as client:
        for path in (ROUTE, TOUCH, SYNC, CLEANUP):
            _assert_400(await client.post(path, content=content))


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_utf8_bom_is_skipped(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, local_seed=True) as client:
        resp = await client.post(
            ROUTE, content=b"\xef\xbb\xbf" + json.dumps(_route_body()).encode()
        )
        assert resp.status_code == 200, resp.text


def _padded_route(size: int) -> bytes:
    """A valid route body of exactly ``size`` bytes (padding in an ignored envelope field)."""
    body: dict[str, Any] = {**_route_body(), "padding": ""}
    raw = json.dumps(body).encode()
    body["padding"] = "x" * (size - len(raw))
    raw = json.dumps(body).encode()
    assert len(raw) == size
    return raw


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_body_of_exactly_the_limit_is_read_and_one_byte_more_is_400(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db, local_seed=True) as client:
        resp = await client.post(ROUTE, content=_padded_route(MAX_BODY_BYTES))
        assert resp.status_code == 200, resp.text
        body = _assert_400(await client.post(ROUTE, content=_padded_route(MAX_BODY_BYTES + 1)))
        assert str(MAX_BODY_BYTES) in body["error_message"]


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_duplicate_keys_the_last_one_wins(redis: Redis, db: Database) -> None:
    """Decided: duplicate keys are read as json.loads reads them (the last one wins), not
    refused: refusing costs a Python call per object on every route (see the feature record)."""
    async with running_app(redis, db, local_seed=True) as client:
        content = (
            b'{"metadata": {"request_id": "r-first", "session_id": "s-1", "bot_id": "b",'
            b' "extra": {"group_id": "g"}, "request_id": "r-last"}, "rawdata": {}}'
        )
        resp = await client.post(ROUTE, content=content)
        assert resp.status_code == 200, resp.text
        assert resp.json()["request_id"] == "r-last"
        # the last value is the one validated
        content = content.replace(b'"r-last"', b'"r\\u0000"')
        _assert_400(await client.post(ROUTE, content=content))


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_odd_field_names_are_escaped_in_the_message(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        for name in ("\u202eevil", "a\x00b", "\ud800", "x" * 5000):
            item = {"template_id": "t", "image": "i", name: 1}
            body = {"metadata": {"request_id": "r"}, "rawdata": {}}
            body["rawdata"] = {"kind": "template", "op": "create", "item": item}
            message = _assert_400(await _post(client, SYNC, body), request_id="r")["error_message"]
            assert len(message) < 400, message
            assert not any(c in message for c in "\u202e\x00\ud800"), message


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_label_selector_is_checked_at_the_edge(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        for selector in ("a b", "=x", "a=b=c", "a=" + "v" * 64, "a\x00=b", "a,,!", "a=b,", ","):
            body = {"metadata": {"request_id": "r"}, "rawdata": {"label_selector": selector}}
            resp = await _post(client, CLEANUP, body)
            message = _assert_400(resp, request_id="r")["error_message"]
            assert "rawdata.label_selector" in message, message
        for selector in (
            "app=x",
            " a = b , !c , d!=e,f==g",
            "agent-runtime/scope=abc",
            "env in (a,b)",
        ):
            body = {"metadata": {"request_id": "r"}, "rawdata": {"label_selector": selector}}
            resp = await _post(client, CLEANUP, body)
            assert resp.status_code == 200, (selector, resp.text)


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_openapi_json_is_served_and_is_what_the_fuzz_run_reads(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db, admin_tokens=["adm"]) as client:
        resp = await client.get("/openapi.json")  # open, like /healthz
        assert resp.status_code == 200
        assert resp.json() == json.loads(json.dumps(app.openapi()))
        # local mode serves the Swagger UI over that document; no ReDoc
        ui = await client.get("/docs")
        assert ui.status_code == 200 and "/openapi.json" in ui.text
        assert (await client.get("/redoc")).status_code == 404
    # server mode serves no UI (it loads scripts from a CDN)
    server = create_app(make_settings(mode="server", redis_url="redis://127.0.0.1:1/0"))
    paths = {getattr(r, "path", None) for r in server.routes}
    assert "/openapi.json" in paths and "/docs" not in paths and "/redoc" not in paths


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_method_the_path_does_not_have_is_405_with_allow(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db) as client:
        resp = await client.get(ROUTE)
        assert resp.status_code == 405
        assert resp.headers["allow"] == "POST"
        body = resp.json()
        assert body["ok"] is False and body["error_code"] == "METHOD_NOT_ALLOWED", body


def test_openapi_documents_every_body_and_answer() -> None:
    """The schema is built from the models the handlers use; no 422 anywhere."""
    app = create_app(make_settings())
    doc = app.openapi()
    for path, token in ((ROUTE, "GatewayToken"), (TOUCH, "GatewayToken"),
                        (SYNC, "AdminToken"), (CLEANUP, "AdminToken")):  # fmt: skip
        op = doc["paths"][path]["post"]
        assert op["security"] == [{token: []}]
        assert op["requestBody"]["content"]["application/json"]["schema"]["type"] == "object"
        assert "422" not in op["responses"]
        assert {"200", "400", "401", "500", "503"} <= set(op["responses"])
    for ops in doc["paths"].values():
        for op in ops.values():
            assert "422" not in op["responses"], op
    assert set(doc["components"]["securitySchemes"]) == {"GatewayToken", "AdminToken"}
