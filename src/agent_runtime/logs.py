"""Structured logs: one JSON object per line, with the ids of what the event concerns.

``bind(request_id=..., session_id=...)`` puts ids in a context variable for the rest of the
current task (each request and each job tick is its own task, so ids never leak between
them); every record logged inside carries them, plus ``pod_id`` / ``scope_id`` given as
``extra``. Secrets never reach a log line: values under secret-looking keys are replaced
and passwords in URLs are masked, whatever the message or extra says.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import sys
import time
from collections.abc import Coroutine, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

CONTEXT_FIELDS = ("request_id", "session_id", "scope_id", "pod_id", "job")
_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "agent_runtime_log_context", default=None
)
_SECRET_KEY = re.compile(r"token|secret|password|passwd|authorization|api_key", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@/\s]+@", re.I)
_BEARER = re.compile(r"(bearer\s+)[^\s\"',]+", re.IGNORECASE)
_RECORD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def bind(**fields: str | None) -> None:
    """Add ids to the current task's log context (None values are skipped)."""
    current = dict(_context.get() or {})
    current.update({k: v for k, v in fields.items() if v is not None})
    _context.set(current)


@contextmanager
def bound(**fields: str | None) -> Iterator[None]:
    """``bind`` for a block: the previous context is restored after it."""
    token = _context.set({**(_context.get() or {}), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _context.reset(token)


# Template env values (API keys) this process has seen: masked wherever they show up (an API
# server's error echoing a manifest, a repr). Short values would mangle ordinary words, and
# the set is bounded: the newest MAX_SECRET_VALUES are kept.
MIN_SECRET_LENGTH = 6
MAX_SECRET_VALUES = 1000
_secret_values: dict[str, None] = {}  # insertion-ordered set
_secret_pattern: re.Pattern[str] | None = None


T = TypeVar("T")


def detached_task(coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    """A task that outlives the request or job that starts it (a reader, a sender, a watch),
    started in an empty context: it must not carry that caller's log fields or trace span
    (its own log lines and Kubernetes calls would wear them for ever after)."""
    return asyncio.create_task(coro, name=name, context=contextvars.Context())


def add_secret_values(values: Iterable[str]) -> None:
    """Remember values to mask in every later log line (idempotent, cheap when known)."""
    global _secret_pattern
    new = [v for v in values if len(v) >= MIN_SECRET_LENGTH and v not in _secret_values]
    if not new:
        return
    for value in new:
        _secret_values[value] = None
    while len(_secret_values) > MAX_SECRET_VALUES:
        del _secret_values[next(iter(_secret_values))]
    ordered = sorted(_secret_values, key=len, reverse=True)  # the longest match first
    _secret_pattern = re.compile("|".join(re.escape(v) for v in ordered))


def redact(text: str) -> str:
    """Mask passwords in URLs, bearer tokens and known template env values in free text."""
    text = _URL_PASSWORD.sub(r"\g<scheme>\g<user>:***@", text)
    text = _BEARER.sub(r"\1***", text)
    pattern = _secret_pattern
    return pattern.sub("***", text) if pattern is not None else text


def _clean(key: str, value: Any) -> Any:
    if _SECRET_KEY.search(key):
        return "***"
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, int | float | bool) or value is None:
        return value
    return redact(str(value))


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", <context ids>, <extra>, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in (_context.get() or {}).items():
            event[key] = _clean(key, value)
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                event[key] = _clean(key, value)
        if record.exc_info:
            event["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(event, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """The human form (local development): the same ids, appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = redact(super().format(record))
        ids = {**(_context.get() or {})}
        ids.update(
            {k: v for k, v in record.__dict__.items() if k in CONTEXT_FIELDS and v is not None}
        )
        if ids:
            line += " " + " ".join(f"{k}={_clean(k, v)}" for k, v in ids.items())
        return line


def configure(level: str, fmt: str = "json") -> None:
    """The root logger: one handler on stderr, JSON or text; uvicorn's loggers go through it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
