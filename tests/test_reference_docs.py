"""docs/reference/ held to the code, so the reference cannot drift from what runs.

Every setting of ``Settings`` is in the settings tables with its default and range; every
``ErrorCode`` is in the error table with its exception's HTTP status and ``retry_after``;
every key, pattern and channel the two ``state.py`` modules build (rendered with placeholder
arguments) is in the key tables, and every key there is one they build; every route of the app
is in the endpoint table. No Markdown file of the repository points outside it, and the
reference's relative links resolve.
"""

from __future__ import annotations

import enum
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le
from pydantic.fields import FieldInfo

from agent_runtime import errors, jobs
from agent_runtime.config import RM_KEY_PREFIX, SM_KEY_PREFIX, Settings
from agent_runtime.main import create_app
from agent_runtime.resource_manager import budget_state as rm_budget_state
from agent_runtime.resource_manager import state as rm_state
from agent_runtime.session_manager import state as sm_state

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
NOT_OURS = {".venv", ".git", "node_modules", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
# the state modules that build each prefix's keys (the pod budgets' in a module of their own)
MODULE_KEYS = {SM_KEY_PREFIX: (sm_state,), RM_KEY_PREFIX: (rm_state, rm_budget_state)}


def _read(name: str) -> str:
    return (REFERENCE / name).read_text(encoding="utf-8")


def _rows(text: str) -> list[list[str]]:
    """The cells of every table row whose first cell is code (not headers or separators)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| `")
    ]


def _code(cell: str) -> str:
    return cell.strip().strip("`")


# --- settings ---------------------------------------------------------------------------------


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default(field: FieldInfo) -> str | None:
    """The default as the table writes it; None where it is computed per process."""
    factory = field.default_factory
    value = field.default if factory is None else factory()  # type: ignore[call-arg]
    if value is None or value == [] or value == {}:
        return "–"
    if factory is not None:
        return None  # instance_id: hostname-pid-random
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{_number(value) if isinstance(value, int | float) else value}`"


def _range(field: FieldInfo) -> str | None:
    """The accepted range as the table writes it; None where the type alone says it."""
    low: Any = None
    high: Any = None
    strict = False
    for bound in field.metadata:
        if isinstance(bound, Ge):
            low = bound.ge
        elif isinstance(bound, Gt):
            low, strict = bound.gt, True
        elif isinstance(bound, Le):
            high = bound.le
    if low is None and high is None:
        if get_origin(field.annotation) is Literal:
            return ", ".join(f"`{choice}`" for choice in get_args(field.annotation))
        if isinstance(field.annotation, type) and issubclass(field.annotation, enum.Enum):
            return ", ".join(f"`{member.value}`" for member in field.annotation)
        return None
    if strict:
        return f"> {_number(low)}" + ("" if high is None else f", ≤ {_number(high)}")
    if high is None:
        return f"≥ {_number(low)}"
    return f"{_number(low)}–{_number(high)}"


def test_every_setting_is_documented_with_its_default_and_range() -> None:
    rows = {_code(r[0]): r for r in _rows(_read("settings.md")) if r[0].startswith("`AGENT_")}
    fields = {f"AGENT_RUNTIME_{n.upper()}": f for n, f in Settings.model_fields.items()}
    assert sorted(set(fields) - set(rows)) == [], "settings missing from settings.md"
    assert sorted(set(rows) - set(fields)) == [], "settings.md lists settings config.py lacks"
    for variable, field in fields.items():
        _, default, accepted, meaning = rows[variable]
        assert meaning, variable
        if (expected := _default(field)) is not None:
            assert default == expected, f"{variable}: default"
        if (expected := _range(field)) is not None:
            assert accepted == expected, f"{variable}: range"


# --- error codes ------------------------------------------------------------------------------


def test_every_error_code_is_in_the_table_with_its_status_and_retry_after() -> None:
    classes: dict[errors.ErrorCode, type[errors.AgentRuntimeError]] = {}
    for value in vars(errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, errors.AgentRuntimeError)
            and value is not errors.AgentRuntimeError
        ):
            assert value.code not in classes, f"{value.code} has two exception classes"
            classes[value.code] = value
    assert set(errors.ErrorCode) == set(classes), "an ErrorCode without an exception class"
    table = {
        _code(r[0]): r
        for r in _rows(_read("api.md"))
        if re.fullmatch(r"`[A-Z][A-Z0-9_]*`", r[0]) and r[1].isdigit()
    }
    assert sorted(table) == sorted(code.value for code in errors.ErrorCode)
    for code, cls in classes.items():
        _, status, retry_after, when = table[code.value]
        assert int(status) == cls.http_status, f"{code}: HTTP status"
        assert (retry_after == "yes") == (cls.default_retry_after is not None), f"{code}"
        assert when, code


# --- Redis keys -------------------------------------------------------------------------------


def _shape(key: str) -> str:
    """A key with its variable parts made alike: the scope id's hash tag (``{sid}`` in the
    reference, the braces part of the key; ``{*}`` in a SCAN or pub/sub pattern) stays
    ``{sid}``, every other placeholder (``{pod_id}``, a SCAN ``*``) becomes ``{}``."""
    return re.sub(r"\{[^}]*\}|\*", "{}", re.sub(r"\{(?:sid|\*)\}", "<sid>", key)).replace(
        "<sid>", "{sid}"
    )


def _built_keys(module: ModuleType, prefix: str) -> set[str]:
    """What the module builds, without its prefix: constants and key functions, each function
    called with its parameter names as placeholders (``session_key("{session_id}")``), a scope
    id as the bare ``sid`` (the builder must wrap it in braces: ``scope:{sid}:pods``)."""
    built = set()
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            params = inspect.signature(value).parameters.values()
            if any(
                p.default is not p.empty or p.annotation not in ("str", str, "int", int)
                for p in params
            ):
                continue
            value = value(  # a bucket of an index over scopes: {b00} (the reference's {bNN})
                *(
                    0 if p.annotation in ("int", int)
                    else "sid" if p.name == "scope_id"
                    else f"{{{p.name}}}"
                    for p in params
                )
            )  # fmt: skip
        if isinstance(value, str) and value.startswith(prefix) and value != prefix:
            built.add(value.removeprefix(prefix))
    return built


def _documented_keys() -> dict[str | None, set[str]]:
    """Key column of each section of redis-keys.md, by the module prefix its heading names
    (None: full key names)."""
    keys: dict[str | None, set[str]] = {}
    for section in re.split(r"^## ", _read("redis-keys.md"), flags=re.MULTILINE)[1:]:
        heading = section.splitlines()[0]
        prefix = next((p for p in MODULE_KEYS if f"`{p}`" in heading), None)
        for row in _rows(section):
            assert row[2] in ("stable", "internal"), f"{row[0]}: stability is {row[2]!r}"
            keys.setdefault(prefix, set()).add(_shape(_code(row[0])))
    return keys


def test_every_redis_key_is_documented_and_every_documented_key_exists() -> None:
    documented = _documented_keys()
    for prefix, modules in MODULE_KEYS.items():
        built = {_shape(key) for module in modules for key in _built_keys(module, prefix)}
        listed = documented.get(prefix, set())
        stems = {key for key in built if key.endswith(":")}  # prefixes keys are built from
        missing = sorted(key for key in built - stems if key not in listed)
        assert missing == [], f"{prefix} keys missing from redis-keys.md"
        for stem in stems:
            assert any(key.startswith(stem) for key in listed), f"no {prefix}{stem}… documented"
        assert sorted(listed - built) == [], f"redis-keys.md lists {prefix} keys not built"
    assert _shape(jobs.JOB_LOCK_PREFIX + "{name}") in documented.get(None, set())


# --- routes -------------------------------------------------------------------------------------


def test_every_route_is_in_the_endpoint_table() -> None:
    table = {_code(r[0]) for r in _rows(_read("api.md")) if re.match(r"`(GET|POST) /", r[0])}
    app = create_app(Settings(_env_file=None))  # type: ignore[call-arg]
    served = {f"GET {app.openapi_url}"}  # the document does not list itself
    local = create_app(Settings(_env_file=None, mode="local"))  # type: ignore[call-arg]
    served.add(f"GET {local.docs_url}")  # the Swagger UI: local mode only
    for path, operations in app.openapi()["paths"].items():
        path = re.sub(r":\w+\}", "}", path)  # {scope_id:anyid} → {scope_id}
        served |= {f"{method.upper()} {path}" for method in operations}
    assert sorted(served - table) == [], "routes missing from the endpoint table of api.md"
    assert sorted(table - served) == [], "api.md lists endpoints the app does not serve"


# --- links --------------------------------------------------------------------------------------


def _markdown_files() -> list[Path]:
    return [
        path
        for path in ROOT.rglob("*.md")
        if not NOT_OURS.intersection(path.relative_to(ROOT).parts)
    ]


def test_no_markdown_file_points_outside_the_repository() -> None:
    outside = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _markdown_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "../shared" in line or "CONTRACT.md" in line
    ]
    assert outside == []


def test_the_reference_links_resolve() -> None:
    broken = []
    for path in REFERENCE.glob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" not in target and not (path.parent / target).resolve().exists():
                broken.append(f"{path.name} → {target}")
    assert broken == []
