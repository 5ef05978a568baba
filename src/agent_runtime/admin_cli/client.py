"""The admin CLI's HTTP client: one call at a time to ``/api/session/…`` with the admin token,
the answer's envelope read into its ``data`` or a typed failure.

Bounded: every call has a deadline (``timeout`` for connecting and for each read, and the
whole answer must arrive within ``timeout`` of the call's start, checked between chunks), and
an answer is read a chunk at a time and refused past ``max_bytes`` before any of it is parsed.
Answers are asked for uncompressed (``Accept-Encoding: identity``): a compressed body could
grow past the bound inside one chunk.

Hazard: the token travels in the ``Authorization`` header; over plain ``http://`` anyone on
the path can read it (the default URL is the loopback's).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

MAX_ANSWER_BYTES = 32 * 1024 * 1024  # a full scopes page of 200 configs is well below
MAX_SHOWN_BODY = 200  # characters of a non-envelope answer quoted in an error


class AdminFailure(Exception):
    """The service answered with a failure envelope: its HTTP status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class Unreachable(Exception):
    """No usable answer: the service could not be reached, did not answer in time, or what
    answered is not the service (no envelope, too large)."""


def path_id(value: str) -> str:
    """An id as one path segment: ``/``, ``?``, ``#``, ``%`` and spaces percent-encoded (the
    service decodes them back: ``/admin/sessions/a%2Fb`` asks for session ``a/b``)."""
    return quote(value, safe="")


def request_id() -> str:
    """The id this call goes by in the service's logs (the admin views echo it)."""
    return f"cli-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class Target:
    """Where the service is and how to reach it."""

    url: httpx.URL  # scheme, host, port and an optional path prefix; no query or fragment
    token: str | None  # None: no Authorization header (a local-mode service is open)
    timeout: float  # seconds
    max_bytes: int = MAX_ANSWER_BYTES

    @property
    def shown(self) -> str:
        """The URL as messages show it: never its user info (a password could be there)."""
        return str(self.url.copy_with(userinfo=b""))


class AdminClient:
    """Calls of one command. Use as ``with AdminClient(target) as client``."""

    def __init__(self, target: Target) -> None:
        self._target = target
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        if target.token is not None:
            headers["Authorization"] = f"Bearer {target.token}"
        # trust_env: HTTPS_PROXY / NO_PROXY and SSL_CERT_FILE are honoured, as kubectl does
        self._http = httpx.Client(
            headers=headers, timeout=httpx.Timeout(target.timeout), follow_redirects=False
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def get(self, path: str, params: Mapping[str, str | int] | None = None) -> Any:
        """``GET /api/session{path}``: the answer's ``data``."""
        return self._call("GET", path, params=params)

    def post(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """``POST /api/session{path}`` with a JSON body (None: none): the answer's ``data``."""
        return self._call("POST", path, body=body)

    def call(self, endpoint: str, rawdata: Mapping[str, Any]) -> Any:
        """One of the service's envelope endpoints (``/cleanup``): one request id, in the
        envelope's metadata and in ``X-Request-Id`` alike, so the logs agree."""
        rid = request_id()
        return self._call(
            "POST", endpoint, body={"metadata": {"request_id": rid}, "rawdata": rawdata}, rid=rid
        )

    def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        body: Mapping[str, Any] | None = None,
        rid: str | None = None,
    ) -> Any:
        url = self._target.url.copy_with(
            path=self._target.url.path.rstrip("/") + "/api/session" + path
        )
        headers = {"X-Request-Id": rid or request_id()}
        content = None
        if body is not None:
            content = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        with self._failures():
            started = time.monotonic()
            with self._http.stream(
                method, url, params=params, content=content, headers=headers
            ) as resp:
                raw = self._bounded_body(resp, started)
                status = resp.status_code
        return self._data(status, raw)

    def _bounded_body(self, resp: httpx.Response, started: float) -> bytes:
        limit = self._target.max_bytes
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise Unreachable(self._too_large())
        body = bytearray()
        for chunk in resp.iter_raw():
            body += chunk
            if len(body) > limit:
                raise Unreachable(self._too_large())
            if time.monotonic() - started > self._target.timeout:
                raise httpx.ReadTimeout("the whole answer took too long")
        return bytes(body)

    def _too_large(self) -> str:
        return (
            f"the answer from {self._target.shown} is larger than "
            f"{self._target.max_bytes // (1024 * 1024)} MiB; ask for less (--limit)"
        )

    def _data(self, status: int, raw: bytes) -> Any:
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
            text = raw[:MAX_SHOWN_BODY].decode("utf-8", "replace")
            raise Unreachable(
                f"{self._target.shown} answered HTTP {status} without an agent-runtime "
                f"envelope (is it the service?): {text!r}"
            )
        if answer["ok"]:
            return answer.get("data")
        code = str(answer.get("error_code") or f"HTTP_{status}")
        raise AdminFailure(status, code, str(answer.get("error_message") or ""))

    @contextmanager
    def _failures(self) -> Iterator[None]:
        """httpx's errors as ``Unreachable`` with a sentence an operator can act on."""
        where = self._target.shown
        try:
            yield
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise Unreachable(
                    f"cannot reach the service at {where}: no connection within "
                    f"{self._target.timeout:g} s"
                ) from None
            raise Unreachable(
                f"no answer from {where} within {self._target.timeout:g} s (--timeout)"
            ) from None
        except httpx.ConnectError as exc:
            raise Unreachable(f"cannot reach the service at {where}: {_reason(exc)}") from None
        except httpx.HTTPError as exc:
            raise Unreachable(f"the call to {where} failed: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """The innermost cause's first line (``[Errno 111] Connection refused``)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:MAX_SHOWN_BODY]
