"""The client's sans-IO core: what to send, how to read an answer, and whether to try again.

Both clients (``AsyncGatewayClient``, ``GatewayClient``) are thin loops around ``Attempts``:
the loop sends, the core decides. No retry rule lives anywhere else.

Why retries are safe by construction: every attempt of one call sends the very same bytes,
``request_id`` included. The service keeps a route's answer (and an ``eos`` that ended a
session) for 60 s under its request_id and answers a repeat with the first answer, or waits
for the first attempt still running; a plain touch repeated only extends again. So a retry
after a lost answer never places a session twice. What is retried:

- no usable answer: connect, read and write errors, a connection the server closed, an
  attempt that timed out (while the call's deadline still leaves time);
- an answer with ``retry_after`` (503/504 codes marked so in the reference, or a 503 with a
  ``Retry-After`` header from a proxy), after at least that pause.

Never retried: 4xx (``REQUEST_ID_REUSED`` included), 500, 502, and 503 without retry_after
(``CONFIG_NOT_FOUND``): they fail the same way until something changes.

Hazard: the deadline covers the whole call, pauses included; an attempt's timeout is the time
left. A pause is made only if it leaves ``min_attempt_time`` for the attempt after it, and
``Retry-After`` is never cut short: if it does not fit, the call ends with the answer's error.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from agent_runtime_client.errors import (
    AgentRuntimeError,
    DeadlineExceeded,
    Unavailable,
    UnexpectedAnswer,
    error_for,
)
from agent_runtime_client.models import Ended, Placement, Route

ROUTE_PATH = "/api/session/route"
TOUCH_PATH = "/api/session/touch"
URL_ENV = "AGENT_RUNTIME_URL"
TOKEN_ENV = "AGENT_RUNTIME_GATEWAY_TOKEN"
MAX_TOKEN = 4096  # characters: a bearer token in one header line

DEFAULT_DEADLINE = 35.0  # a route may wait scope_full_timeout (30 s) in its scope's queue
DEFAULT_MAX_ATTEMPTS = 4
DEFAULT_MAX_ANSWER_BYTES = 1 << 20  # the service's answers are a few hundred bytes
RETRYABLE_STATUSES = frozenset({503, 504})
EXCERPT_CHARS = 200


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How many attempts a call may make and how long it pauses between them.

    The pause before attempt n+1 is max(Retry-After, a backoff drawn uniformly from
    [0, min(backoff_cap, backoff_base × 2^(n-1))]) ("full jitter": callers that failed
    together do not come back together).
    """

    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # 1: retries off
    backoff_base: float = 0.05
    backoff_cap: float = 1.0
    min_attempt_time: float = 0.5  # a retry is made only if this much deadline is left for it

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.backoff_base < 0 or self.backoff_cap < 0 or self.min_attempt_time < 0:
            raise ValueError("backoff_base, backoff_cap and min_attempt_time must be >= 0")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """What a client was built with, the environment's values filled in."""

    base_url: str
    token: str | None
    deadline: float
    retry: RetryPolicy
    max_answer_bytes: int

    def headers(self) -> dict[str, str]:
        # identity: the answer's size is bounded as it arrives; a compressed answer would be
        # bounded only after decompression (a 200 KB gzip body can inflate to gigabytes)
        headers = {
            "content-type": "application/json",
            "accept": "application/json",
            "accept-encoding": "identity",
        }
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return headers

    def http_options(self) -> dict[str, Any]:
        """What both httpx clients are built with (besides pool, transport and proxies)."""
        return {"base_url": self.base_url, "headers": self.headers(), "follow_redirects": False}


def resolve_config(
    base_url: str | None,
    token: str | None,
    *,
    deadline: float,
    retry: RetryPolicy | None,
    max_answer_bytes: int,
    environ: Mapping[str, str] = os.environ,
) -> ClientConfig:
    """The constructor's values, else ``AGENT_RUNTIME_URL`` / ``AGENT_RUNTIME_GATEWAY_TOKEN``."""
    url = base_url or environ.get(URL_ENV, "")
    if not url:
        raise ValueError(f"no base_url given and {URL_ENV} is not set")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
    if not (deadline > 0 and math.isfinite(deadline)):
        raise ValueError("deadline must be a positive number of seconds")
    if max_answer_bytes < 1:
        raise ValueError("max_answer_bytes must be at least 1")
    token = (token if token is not None else environ.get(TOKEN_ENV)) or None  # "": none
    if token is not None and not _valid_token(token):
        # else every attempt fails in httpx before it is sent, and the call ends `Unavailable`
        raise ValueError(f"a token is 1-{MAX_TOKEN} visible ASCII characters, no spaces")
    return ClientConfig(
        base_url=url.rstrip("/"),
        token=token,
        deadline=deadline,
        retry=retry or RetryPolicy(),
        max_answer_bytes=max_answer_bytes,
    )


def _valid_token(token: str) -> bool:
    return 0 < len(token) <= MAX_TOKEN and all("!" <= c <= "~" for c in token)


# --- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One call: the same path and bytes on every attempt."""

    path: str
    content: bytes
    request_id: str


def new_request_id() -> str:
    return uuid.uuid4().hex


def _encode(metadata: dict[str, Any], rawdata: dict[str, Any]) -> bytes:
    body = {"metadata": metadata, "rawdata": rawdata}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def route_call(
    session_id: str,
    bot_id: str,
    group_id: str,
    *,
    failed_pod_id: str | None,
    request_id: str | None,
) -> Call:
    rid = request_id or new_request_id()
    metadata = {
        "request_id": rid,
        "session_id": session_id,
        "bot_id": bot_id,
        "extra": {"group_id": group_id},
    }
    rawdata = {} if failed_pod_id is None else {"failed_pod_id": failed_pod_id}
    return Call(ROUTE_PATH, _encode(metadata, rawdata), rid)


def touch_call(
    session_id: str,
    *,
    bot_id: str | None,
    group_id: str | None,
    eos: bool,
    request_id: str | None,
) -> Call:
    if (bot_id is None) != (group_id is None):
        raise ValueError("bot_id and group_id go together: give both (one round trip) or neither")
    rid = request_id or new_request_id()
    metadata: dict[str, Any] = {"request_id": rid, "session_id": session_id}
    if bot_id is not None:
        metadata |= {"bot_id": bot_id, "extra": {"group_id": group_id}}
    return Call(TOUCH_PATH, _encode(metadata, {"eos": True} if eos else {}), rid)


# --- answers -------------------------------------------------------------------------------------


class AttemptTimedOut(TimeoutError):
    """The call's deadline passed while an answer was still arriving."""


class AnswerReader:
    """Reads one answer's body, refusing it past ``limit`` bytes or past the deadline."""

    def __init__(
        self,
        limit: int,
        deadline_at: float,
        *,
        status: int,
        content_length: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = limit
        self._deadline_at = deadline_at
        self._clock = clock
        self._status = status
        self._chunks: list[bytes] = []
        self._size = 0
        declared = content_length.strip() if content_length is not None else ""
        if declared.isdigit() and int(declared) > limit:  # refused before a byte is read
            raise self._too_large()

    def _too_large(self) -> UnexpectedAnswer:
        return UnexpectedAnswer(
            f"the answer is over the client's bound of {self._limit} bytes",
            http_status=self._status,
        )

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self._limit:
            raise self._too_large()
        self._chunks.append(chunk)
        if self._clock() >= self._deadline_at:
            raise AttemptTimedOut("the call's deadline passed while its answer was arriving")

    def body(self) -> bytes:
        return b"".join(self._chunks)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    retry_after_header: str | None
    body: bytes


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _excerpt(body: bytes) -> str:
    return body[: EXCERPT_CHARS * 4].decode("utf-8", "replace")[:EXCERPT_CHARS]


@dataclass(frozen=True, slots=True)
class Done:
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Retry:
    delay: float


def read_answer(answer: Answer) -> Done | AgentRuntimeError | UnexpectedAnswer:
    """The envelope's data, or the failure it says (not raised: the caller decides)."""
    try:
        envelope = json.loads(answer.body)
    except (ValueError, UnicodeDecodeError):
        envelope = None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("ok"), bool):
        return UnexpectedAnswer(
            f"HTTP {answer.status}: not an agent-runtime envelope",
            http_status=answer.status,
            excerpt=_excerpt(answer.body),
        )
    if envelope["ok"]:
        data = envelope.get("data")
        if answer.status != 200 or not isinstance(data, dict):
            return UnexpectedAnswer(
                f"HTTP {answer.status}: a success envelope without its data",
                http_status=answer.status,
                excerpt=_excerpt(answer.body),
            )
        return Done(data)
    code = envelope.get("error_code")
    message = envelope.get("error_message")
    request_id = envelope.get("request_id")
    retry_after = parse_retry_after(answer.retry_after_header)
    if retry_after is None:
        body_value = envelope.get("retry_after")
        if isinstance(body_value, int | float) and not isinstance(body_value, bool):
            retry_after = max(0.0, float(body_value))
    return error_for(
        code if isinstance(code, str) and code else f"HTTP_{answer.status}",
        answer.status,
        message if isinstance(message, str) else "",
        request_id=request_id if isinstance(request_id, str) else None,
        retry_after=retry_after,
    )


# --- one call's attempts -------------------------------------------------------------------------


class Attempts:
    """One call's retry state: each attempt's time budget, and what follows each outcome.

    ``start()`` before each attempt gives its timeout (the time left); then ``answered()`` or
    ``failed()`` gives ``Done`` (return its data), ``Retry`` (pause ``delay`` seconds, then
    ``start()`` again), or raises the call's error.
    """

    def __init__(
        self,
        call: Call,
        config: ClientConfig,
        *,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        budget = config.deadline if deadline is None else deadline
        if not (budget > 0 and math.isfinite(budget)):
            raise ValueError("deadline must be a positive number of seconds")
        self.call = call
        self.policy = config.retry
        self.max_answer_bytes = config.max_answer_bytes
        self.deadline_at = clock() + budget
        self.attempts = 0
        self._clock = clock
        self._jitter = jitter
        self._last: BaseException | None = None

    def remaining(self) -> float:
        return self.deadline_at - self._clock()

    def start(self) -> float:
        """The next attempt's timeout; raises ``DeadlineExceeded`` when no time is left."""
        remaining = self.remaining()
        if remaining <= 0:
            raise self._deadline_exceeded()
        self.attempts += 1
        return remaining

    def reader(self, status: int, content_length: str | None) -> AnswerReader:
        return AnswerReader(
            self.max_answer_bytes,
            self.deadline_at,
            status=status,
            content_length=content_length,
            clock=self._clock,
        )

    def answered(self, answer: Answer) -> Done | Retry:
        outcome = read_answer(answer)
        if isinstance(outcome, Done):
            return outcome
        if isinstance(outcome, UnexpectedAnswer):
            outcome.request_id = self.call.request_id
            retry_after = parse_retry_after(answer.retry_after_header)
            if answer.status == 503 and retry_after is not None:  # a proxy's "try again"
                return self._retry_or_raise(outcome, retry_after, raise_as=outcome)
            raise outcome
        if answer.status in RETRYABLE_STATUSES and outcome.retry_after is not None:
            return self._retry_or_raise(outcome, outcome.retry_after, raise_as=outcome)
        raise outcome

    def failed(self, exc: BaseException) -> Retry:
        """An attempt that got no usable answer (a transport error or its timeout)."""
        if isinstance(exc, UnexpectedAnswer):  # over the size bound: not retried
            exc.request_id = self.call.request_id
            raise exc
        return self._retry_or_raise(exc, 0.0, raise_as=None)

    def _retry_or_raise(
        self, failure: BaseException, retry_after: float, *, raise_as: BaseException | None
    ) -> Retry:
        self._last = failure
        if raise_as is None and self.remaining() <= 0:  # the attempt ran into the deadline
            raise self._deadline_exceeded()
        if self.attempts >= self.policy.max_attempts:
            if raise_as is not None:
                raise raise_as
            raise Unavailable(
                f"no answer after {self.attempts} attempts: {_describe(failure)}",
                cause=failure,
                attempts=self.attempts,
                request_id=self.call.request_id,
            ) from failure
        ceiling = min(self.policy.backoff_cap, self.policy.backoff_base * 2 ** (self.attempts - 1))
        delay = max(retry_after, self._jitter() * ceiling)
        if self.remaining() - delay < self.policy.min_attempt_time:
            if raise_as is not None:  # Retry-After is not cut short: the answer stands
                raise raise_as
            raise self._deadline_exceeded()
        return Retry(delay)

    def _deadline_exceeded(self) -> DeadlineExceeded:
        last = self._last
        error = DeadlineExceeded(
            f"the call's deadline ran out after {self.attempts} attempts"
            + (f": {_describe(last)}" if last is not None else ""),
            cause=last,
            attempts=self.attempts,
            request_id=self.call.request_id,
        )
        error.__cause__ = last
        return error


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- typed results -------------------------------------------------------------------------------


def _unexpected(what: str, data: dict[str, Any], request_id: str) -> UnexpectedAnswer:
    error = UnexpectedAnswer(what, http_status=200, excerpt=_excerpt(json.dumps(data).encode()))
    error.request_id = request_id
    return error


def decode_route(data: dict[str, Any], request_id: str) -> Route:
    pod_id, url, placement = data.get("pod_id"), data.get("pod_sse_url"), data.get("placement")
    previous = data.get("previous_pod_id")
    if not (isinstance(pod_id, str) and isinstance(url, str) and isinstance(placement, str)):
        raise _unexpected("route: data without pod_id, pod_sse_url or placement", data, request_id)
    try:
        kind = Placement(placement)
    except ValueError:
        raise _unexpected(f"route: unknown placement {placement!r}", data, request_id) from None
    if previous is not None and not isinstance(previous, str):
        raise _unexpected("route: previous_pod_id is not a string", data, request_id)
    return Route(pod_id, url, kind, previous, request_id)


def decode_touch(data: dict[str, Any], request_id: str) -> bool:
    touched = data.get("touched")
    if not isinstance(touched, bool):
        raise _unexpected("touch: data without touched", data, request_id)
    return touched


def decode_end(data: dict[str, Any], request_id: str) -> Ended:
    touched, released = data.get("touched"), data.get("released")
    if not (isinstance(touched, bool) and isinstance(released, bool)):
        raise _unexpected("end: data without touched and released", data, request_id)
    return Ended(touched, released)
