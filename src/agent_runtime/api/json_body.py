"""A request body as a JSON object (400 ``VALIDATION`` otherwise): at most 64 KiB (enforced by
``error_handlers.GuardMiddleware`` and the HTTP protocol), UTF-8, nested at most ``MAX_DEPTH``
(checked before parsing), no NaN or Infinity."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from agent_runtime.errors import ValidationFailed

MAX_BODY_BYTES = 64 * 1024
MAX_DEPTH = 32  # JSON nesting; the deepest real body (config_sync env) is 4


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise _NotFinite(text)
    return value


# one decoder: json.loads(..., **options) would build a new one per call
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)

# a JSON string (escapes skipped; an unterminated one runs to the end, so the scan stays linear)
# or one bracket; UTF-8 never puts these bytes inside a multi-byte character
_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_OPENERS = frozenset(b"[{")


def nesting_exceeds(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text nests deeper than ``limit``, found without parsing: a body with
    at most ``limit`` opening brackets cannot (two C-speed counts, the normal case); otherwise
    one pass over its strings and brackets that stops at the first level past the limit."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for match in _STRUCTURE.finditer(raw):
        first = raw[match.start()]
        if first in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        elif first != 0x22 and depth:  # a closing bracket (a stray one buys no depth)
            depth -= 1
    return False


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or 400 ``VALIDATION``: UTF-8 only (a leading BOM is
    skipped), nesting at most ``MAX_DEPTH`` (checked before parsing), no NaN or Infinity
    (literals, or numbers too large for a float). Duplicate keys: the last one wins, as in
    ``json.loads`` (rejecting them would cost a Python call per object on every route)."""
    if nesting_exceeds(raw):
        raise ValidationFailed(f"body nests deeper than {MAX_DEPTH} levels")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
        data = _DECODER.decode(text)
    except _NotFinite:
        raise ValidationFailed("body holds NaN or Infinity, which JSON does not allow") from None
    except UnicodeDecodeError:
        raise ValidationFailed("body is not UTF-8") from None
    except (ValueError, RecursionError):  # bad JSON; RecursionError cannot pass the scan
        raise ValidationFailed("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ValidationFailed("body must be a JSON object")
    return data
