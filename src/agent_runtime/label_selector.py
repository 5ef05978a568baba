"""Label selectors: the one parser of the service (cleanup's validation, the fake cluster's
matching, what is sent to Kubernetes).

The grammar is the part of Kubernetes' ``labels.Parse`` we accept: requirements separated by
commas, each ``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``,
``key in (v1,v2)`` or ``key notin (v1,v2)``; whitespace between tokens is free. Keys are
qualified names (``[dns-subdomain/]name``: prefix ≤ 253, name ≤ 63 characters), values label
values (≤ 63, may be empty). Anything else — an empty requirement (``","``, ``"a=b,"``), ``gt``
/ ``lt``, a malformed key or value — raises ``ValueError`` naming the requirement: the caller
answers 400, never a 502 from the API server refusing what we passed on. Hazard: a selector
accepted here must be one the API server accepts and matches the same way (``render`` sends a
canonical form; tests hold it against the simulator's copy of ``labels.Parse``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_MAX = 63
PREFIX_MAX = 253
VALUE_MAX = 63
MAX_REQUIREMENTS = 64
MAX_VALUES = 64

_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", re.ASCII)
_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", re.ASCII)
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_PREFIX = re.compile(rf"{_LABEL}(\.{_LABEL})*", re.ASCII)
# tokens: the operators and brackets, or a run of anything else up to them or whitespace
_TOKEN = re.compile(r"\s*(==|!=|=|!|\(|\)|,|[^\s=!(),]+)", re.ASCII)
_SET_OPERATORS = ("in", "notin")


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!exists" ("==" is read as "=")
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        if self.operator in ("=", "in"):
            return has and labels[self.key] in self.values
        if self.operator in ("!=", "notin"):  # as Kubernetes: also true without the key
            return not has or labels[self.key] not in self.values
        return has if self.operator == "exists" else not has

    def render(self) -> str:
        if self.operator == "exists":
            return self.key
        if self.operator == "!exists":
            return f"!{self.key}"
        if self.operator in _SET_OPERATORS:
            return f"{self.key} {self.operator} ({','.join(self.values)})"
        return f"{self.key}{self.operator}{self.values[0]}"


def _key_errors(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > PREFIX_MAX or not _PREFIX.fullmatch(prefix)):
        return f"key prefix {prefix!r} must be a DNS subdomain of at most {PREFIX_MAX} characters"
    if len(name) > NAME_MAX or not _NAME.fullmatch(name):
        return (
            f"key name {name!r} must be 1-{NAME_MAX} alphanumerics, '-', '_' or '.', starting "
            "and ending with an alphanumeric"
        )
    return None


def _value_errors(value: str) -> str | None:
    if len(value) > VALUE_MAX or not _VALUE.fullmatch(value):
        return (
            f"value {value!r} must be at most {VALUE_MAX} alphanumerics, '-', '_' or '.', "
            "starting and ending with an alphanumeric"
        )
    return None


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:  # only whitespace is left
            break
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


def _split(tokens: list[str]) -> list[list[str]]:
    """The requirements' tokens, split at the commas outside a value set."""
    parts: list[list[str]] = [[]]
    depth = 0
    for token in tokens:
        depth += {"(": 1, ")": -1}.get(token, 0)
        if token == "," and depth == 0:
            parts.append([])
        else:
            parts[-1].append(token)
    return parts


def _requirement(tokens: list[str]) -> Requirement:
    shown = " ".join(tokens)
    if not tokens:
        raise ValueError("empty requirement (a leading, trailing or doubled ',')")
    negated = tokens[0] == "!"
    key, rest = (tokens[1], tokens[2:]) if negated and len(tokens) > 1 else (tokens[0], tokens[1:])
    if key in ("!", "=", "==", "!=", "(", ")"):
        raise ValueError(f"{shown!r}: a requirement starts with a label key")
    problem = _key_errors(key)
    if problem:
        raise ValueError(f"{shown!r}: {problem}")
    if negated or not rest:
        if rest:
            raise ValueError(f"{shown!r}: '!key' takes no operator")
        return Requirement(key, "!exists" if negated else "exists")
    operator, operands = rest[0], rest[1:]
    if operator in ("=", "==", "!="):
        if len(operands) > 1:
            raise ValueError(f"{shown!r}: one value after {operator!r}")
        value = operands[0] if operands else ""
        problem = _value_errors(value) if value not in ("(", ")", "!") else "a value is expected"
        if problem:
            raise ValueError(f"{shown!r}: {problem}")
        return Requirement(key, "=" if operator == "==" else operator, (value,))
    if operator in _SET_OPERATORS:
        if len(operands) < 2 or operands[0] != "(" or operands[-1] != ")":
            raise ValueError(f"{shown!r}: {operator} takes a set of values: ({operator} (a,b))")
        inner = operands[1:-1]
        values = inner[0::2]
        if not inner or len(inner) % 2 == 0 or any(sep != "," for sep in inner[1::2]):
            raise ValueError(f"{shown!r}: one or more values separated by single commas")
        if len(values) > MAX_VALUES:
            raise ValueError(f"{shown!r}: at most {MAX_VALUES} values")
        for value in values:
            problem = _value_errors(value) if value not in "()!,=" else "a value is expected"
            if problem or not value:
                raise ValueError(f"{shown!r}: {problem or 'a value is expected'}")
        return Requirement(key, operator, tuple(values))
    raise ValueError(
        f"{shown!r}: operator must be one of =, ==, !=, in, notin (gt, lt are not supported)"
    )


def parse(selector: str) -> list[Requirement]:
    """The requirements of ``selector`` (``""`` or blanks: none, matches every pod)."""
    tokens = _tokens(selector)
    if not tokens:
        return []
    parts = _split(tokens)
    if len(parts) > MAX_REQUIREMENTS:
        raise ValueError(f"at most {MAX_REQUIREMENTS} requirements")
    return [_requirement(part) for part in parts]


def render(requirements: list[Requirement]) -> str:
    """The canonical text of parsed requirements, as sent to the API server."""
    return ",".join(r.render() for r in requirements)


def matches(requirements: list[Requirement], labels: dict[str, str]) -> bool:
    """Every requirement holds (no requirements: every pod)."""
    return all(r.matches(labels) for r in requirements)
