"""What an id, and any config text, may hold (contract §2.1): 1–256 characters, none of them a
control or format character (``_FORBIDDEN``); the ``Id`` type of the request models, the
OpenAPI pattern that documents the rule, and ``printable`` for messages and log lines."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

ID_MAX = 256  # contract §2.1; also the width of the id columns (db/tables.py ID_LEN)

# Characters no id or config text may hold: C0 and C1 controls and DEL, the Unicode format
# characters (category Cf: zero-width, bidi overrides, BOM, soft hyphen, tags), the line and
# paragraph separators, surrogates (a lone one cannot be encoded as UTF-8: Redis, the DB and the
# answer would fail on it) and the noncharacters U+FFFE/U+FFFF. They make log lines, Redis key
# names and error messages show something other than what they hold. Cf as of Unicode 15.1
# (Python 3.13); test_models checks this list against the running Python's unicodedata.
_FORBIDDEN_BMP = (
    "\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ufffe\uffff"
)
_FORBIDDEN = re.compile(
    f"[{_FORBIDDEN_BMP}\ud800-\udfff\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)
# The same rule for the OpenAPI schema (ECMA-262 syntax, BMP only: surrogates and astral format
# characters are left out of the documented pattern; the server refuses them all the same).
PRINTABLE_CLASS = (
    "[^" + "".join(c if c == "-" else f"\\u{ord(c):04x}" for c in _FORBIDDEN_BMP) + "]"
)
PRINTABLE_PATTERN = f"^{PRINTABLE_CLASS}*$"


# the same for ASCII text (the usual id: ``str.isascii`` is O(1)); a smaller class, 3x faster
_FORBIDDEN_ASCII = re.compile("[\x00-\x1f\x7f]")


def has_forbidden(value: str) -> bool:
    return (_FORBIDDEN_ASCII if value.isascii() else _FORBIDDEN).search(value) is not None


def no_control(value: str) -> str:
    """Refuse control and format characters (see ``_FORBIDDEN``)."""
    if has_forbidden(value):
        raise ValueError("must not contain control or format characters")
    return value


def is_id(value: object) -> bool:
    """Whether ``value`` is a valid id: a string of 1–256 characters, none of them forbidden."""
    return isinstance(value, str) and 0 < len(value) <= ID_MAX and not has_forbidden(value)


def printable(text: str, limit: int = 64) -> str:
    """``text`` fit for an error message or a log line: forbidden characters escaped
    (``\\u202e``), cut at ``limit`` characters."""
    if len(text) > limit:
        text = text[:limit] + "…"
    return _FORBIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


Id = Annotated[
    str,
    Field(min_length=1, max_length=ID_MAX, json_schema_extra={"pattern": PRINTABLE_PATTERN}),
    AfterValidator(no_control),
]
