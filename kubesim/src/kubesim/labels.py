"""Names, labels and label selectors, validated and parsed the way the Kubernetes API server does.

The selector grammar is ``k8s.io/apimachinery/pkg/labels`` (``labels.Parse``): requirements
separated by commas, each ``key``, ``!key``, ``key=v`` / ``key==v`` / ``key!=v``,
``key in (a,b)`` / ``key notin (a,b)`` or ``key gt N`` / ``key lt N`` (written ``>`` / ``<``).
Keys are qualified names (``[prefix/]name``), values label values; a malformed selector raises
``SelectorError`` with the API server's wording. ``in`` / ``notin`` / ``!=`` semantics follow
the real matcher: ``!=`` and ``notin`` also match objects without the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL_RE = re.compile(rf"^{_LABEL}$")
_DNS1123_SUBDOMAIN_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_QUALIFIED_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_QUALIFIED_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
    "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used "
    "for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def dns1123_subdomain_errors(value: str) -> list[str]:
    """Why ``value`` is not a DNS-1123 subdomain (pod names); empty when it is one."""
    errors = []
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        errors.append(f"must be no more than {DNS1123_SUBDOMAIN_MAX} characters")
    if not _DNS1123_SUBDOMAIN_RE.match(value):
        errors.append(_SUBDOMAIN_MSG)
    return errors


def dns1123_label_errors(value: str) -> list[str]:
    """Why ``value`` is not a DNS-1123 label (namespaces, container names)."""
    errors = []
    if len(value) > DNS1123_LABEL_MAX:
        errors.append(f"must be no more than {DNS1123_LABEL_MAX} characters")
    if not _DNS1123_LABEL_RE.match(value):
        errors.append(_LABEL_MSG)
    return errors


def qualified_name_errors(value: str) -> list[str]:
    """Why ``value`` is not a label key (``[dns-subdomain/]name``)."""
    parts = value.split("/")
    if len(parts) == 1:
        name, errors = parts[0], []
    elif len(parts) == 2:
        prefix, name = parts
        errors = (
            ["prefix part must be non-empty"]
            if not prefix
            else [f"prefix part {m}" for m in dns1123_subdomain_errors(prefix)]
        )
    else:
        return [
            "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character with an optional DNS subdomain prefix "
            "and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errors.append("name part must be non-empty")
    else:
        if len(name) > DNS1123_LABEL_MAX:
            errors.append(f"name part must be no more than {DNS1123_LABEL_MAX} characters")
        if not _QUALIFIED_NAME_RE.match(name):
            errors.append(_QUALIFIED_MSG)
    return errors


def label_value_errors(value: str) -> list[str]:
    errors = []
    if len(value) > LABEL_VALUE_MAX:
        errors.append(f"must be no more than {LABEL_VALUE_MAX} characters")
    if not _LABEL_VALUE_RE.match(value):
        errors.append(_VALUE_MSG)
    return errors


# --- selectors --------------------------------------------------------------------------------


class SelectorError(ValueError):
    """A label selector the API server would refuse (it answers 400 BadRequest)."""


# tokens, as the apimachinery lexer names them
_EOS, _IDENT, _OPEN, _CLOSE, _COMMA, _NOT, _EQ, _DEQ, _NEQ, _GT, _LT, _IN, _NOTIN = range(13)
_TOKENS = {
    ")": _CLOSE,
    ",": _COMMA,
    "!": _NOT,
    "==": _DEQ,
    "=": _EQ,
    ">": _GT,
    "in": _IN,
    "!=": _NEQ,
    "notin": _NOTIN,
    "(": _OPEN,
    "<": _LT,
}
_SPECIAL = frozenset("=!(),><")
_WHITESPACE = frozenset(" \t\r\n")
_BINARY_OPERATORS = "in, notin, =, ==, !=, gt, lt"
_OPERATORS = {_IN: "in", _NOTIN: "notin", _EQ: "=", _DEQ: "==", _NEQ: "!=", _GT: "gt", _LT: "lt"}


def _lex(text: str) -> list[tuple[int, str]]:
    items: list[tuple[int, str]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _WHITESPACE:
            i += 1
        if i >= n:
            items.append((_EOS, ""))
            return items
        if text[i] in _SPECIAL:
            # the longest run of special characters that is still one token ("!=", "==")
            literal = text[i]
            i += 1
            while i < n and text[i] in _SPECIAL and literal + text[i] in _TOKENS:
                literal += text[i]
                i += 1
            items.append((_TOKENS[literal], literal))
        else:
            start = i
            while i < n and text[i] not in _SPECIAL and text[i] not in _WHITESPACE:
                i += 1
            word = text[start:i]
            items.append((_TOKENS.get(word, _IDENT), word))


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # "=", "==", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        op, has = self.operator, self.key in labels
        if op in ("=", "==", "in"):
            return has and labels[self.key] in self.values
        if op in ("!=", "notin"):
            return not has or labels[self.key] not in self.values
        if op == "exists":
            return has
        if op == "!":
            return not has
        if not has:  # gt, lt
            return False
        try:
            value = int(labels[self.key])
        except ValueError:
            return False
        bound = int(next(iter(self.values)))
        return value > bound if op == "gt" else value < bound


@dataclass(frozen=True, slots=True)
class Selector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: dict[str, str] | None) -> bool:
        """Every requirement holds (the empty selector matches everything)."""
        found = labels or {}
        return all(r.matches(found) for r in self.requirements)


class _Parser:
    def __init__(self, text: str) -> None:
        self._items = _lex(text)
        self._pos = 0

    def _peek(self, values: bool = True) -> tuple[int, str]:
        return self._context(self._items[self._pos], values)

    def _next(self, values: bool = True) -> tuple[int, str]:
        item = self._items[self._pos]
        self._pos += 1
        return self._context(item, values)

    @staticmethod
    def _context(item: tuple[int, str], values: bool) -> tuple[int, str]:
        # where a value is expected, "in" and "notin" are plain identifiers
        tok, literal = item
        if values and tok in (_IN, _NOTIN):
            return _IDENT, literal
        return tok, literal

    def parse(self) -> Selector:
        requirements: list[Requirement] = []
        while True:
            tok, literal = self._peek()
            if tok == _EOS:
                return Selector(tuple(sorted(requirements, key=lambda r: r.key)))
            if tok not in (_IDENT, _NOT):
                raise SelectorError(
                    f"found '{literal}', expected: !, identifier, or 'end of string'"
                )
            requirements.append(self._requirement())
            tok, literal = self._next()
            if tok == _EOS:
                return Selector(tuple(sorted(requirements, key=lambda r: r.key)))
            if tok != _COMMA:
                raise SelectorError(f"found '{literal}', expected: ',' or 'end of string'")
            tok, literal = self._peek()
            if tok not in (_IDENT, _NOT):
                raise SelectorError(f"found '{literal}', expected: identifier after ','")

    def _requirement(self) -> Requirement:
        try:
            key, operator = self._key_and_operator()
            if operator in ("exists", "!"):
                return _requirement(key, operator, [])
            tok, literal = self._next(values=False)
            if tok not in _OPERATORS:
                raise SelectorError(f"found '{literal}', expected: {_BINARY_OPERATORS}")
            operator = _OPERATORS[tok]
            values = self._set() if operator in ("in", "notin") else self._exact()
            return _requirement(key, operator, values)
        except SelectorError as exc:
            raise SelectorError(f"unable to parse requirement: {exc}") from None

    def _key_and_operator(self) -> tuple[str, str]:
        operator = ""
        tok, literal = self._next()
        if tok == _NOT:
            operator = "!"
            tok, literal = self._next()
        if tok != _IDENT:
            raise SelectorError(f"found '{literal}', expected: identifier")
        for message in qualified_name_errors(literal):
            raise SelectorError(f'key: Invalid value: "{literal}": {message}')
        if self._peek()[0] in (_EOS, _COMMA) and operator != "!":
            operator = "exists"
        return literal, operator

    def _exact(self) -> list[str]:
        tok, _ = self._peek()
        if tok in (_EOS, _COMMA):
            return [""]
        tok, literal = self._next()
        if tok == _IDENT:
            return [literal]
        raise SelectorError(f"found '{literal}', expected: identifier")

    def _set(self) -> list[str]:
        tok, literal = self._next()
        if tok != _OPEN:
            raise SelectorError(f"found '{literal}' expected: '('")
        tok, literal = self._peek()
        if tok == _CLOSE:
            self._next()
            return [""]
        if tok not in (_IDENT, _COMMA):
            raise SelectorError(f"found '{literal}', expected: ',', ')' or identifier")
        values = self._identifiers()
        tok, literal = self._next()
        if tok != _CLOSE:
            raise SelectorError(f"found '{literal}', expected: ')'")
        return values

    def _identifiers(self) -> list[str]:
        values: list[str] = []
        while True:
            tok, literal = self._next()
            if tok == _IDENT:
                values.append(literal)
                tok2, literal2 = self._peek()
                if tok2 == _COMMA:
                    continue
                if tok2 == _CLOSE:
                    return values
                raise SelectorError(f"found '{literal2}', expected: ',' or ')'")
            if tok == _COMMA:  # "(,", ",)" and ",," stand for the empty value
                if not values:
                    values.append("")
                tok2, _ = self._peek()
                if tok2 == _CLOSE:
                    values.append("")
                    return values
                if tok2 == _COMMA:
                    self._next()
                    values.append("")
                continue
            raise SelectorError(f"found '{literal}', expected: ',', or identifier")


def _requirement(key: str, operator: str, values: list[str]) -> Requirement:
    if operator in ("in", "notin") and not values:
        raise SelectorError("for 'in', 'notin' operators, values set can't be empty")
    if operator in ("gt", "lt"):
        try:
            int(values[0])
        except ValueError:
            raise SelectorError(
                f"values[0]: Invalid value: \"{values[0]}\": for 'Gt', 'Lt' operators, "
                "the value must be an integer"
            ) from None
    for i, value in enumerate(values):
        for message in label_value_errors(value):
            raise SelectorError(f'values[{i}][{key}]: Invalid value: "{value}": {message}')
    return Requirement(key, operator, frozenset(values))


def parse_selector(text: str | None) -> Selector:
    """``labelSelector`` as the API server parses it; ``SelectorError`` when it would refuse."""
    if not text:
        return Selector()
    return _Parser(text).parse()


# --- field selectors (pods) -------------------------------------------------------------------

POD_FIELDS = (
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "status.phase",
    "status.podIP",
)


@dataclass(frozen=True, slots=True)
class FieldRequirement:
    field: str
    negate: bool
    value: str


NODE_FIELDS = ("metadata.name", "spec.unschedulable")
_FIELD_DEFAULTS = {"spec.unschedulable": "false"}  # the API server's value of an omitted bool


def parse_field_selector(
    text: str | None, supported: tuple[str, ...] = POD_FIELDS
) -> list[FieldRequirement]:
    """``fieldSelector``: ``field=v``, ``field==v``, ``field!=v`` terms over ``supported``."""
    terms: list[FieldRequirement] = []
    for raw in (text or "").split(","):
        term = raw.strip()
        if not term:
            continue
        op = next((op for op in ("!=", "==", "=") if op in term), None)
        if op is None:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        field, value = term.split(op, 1)
        field = field.strip()
        if field not in supported:
            raise SelectorError(f'field label not supported: "{field}"')
        terms.append(FieldRequirement(field, op == "!=", value.strip()))
    return terms


def field_value(obj: dict[str, object], field: str) -> str:
    node: object = obj
    for part in field.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, bool):
        return "true" if node else "false"
    return _FIELD_DEFAULTS.get(field, "") if node is None else str(node)


def fields_match(terms: list[FieldRequirement], obj: dict[str, object]) -> bool:
    return all((field_value(obj, t.field) == t.value) != t.negate for t in terms)
