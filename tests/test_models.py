"""Strict validation of config_sync items (contract §3): a bad item is refused naming the field;
and the input limits of the envelope (ids, nesting, NaN, UTF-8)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from pydantic import ValidationError

from agent_runtime.api.ids import PRINTABLE_PATTERN, has_forbidden, is_id, printable
from agent_runtime.api.json_body import nesting_exceeds, parse_body
from agent_runtime.errors import ErrorCode, ValidationFailed
from agent_runtime.session_manager import state
from agent_runtime.session_manager.items import (
    POD_NAME_MAX,
    RoutingRuleItem,
    TemplateItem,
    parse_item,
)
from agent_runtime.session_manager.models import CleanupRequest, ConfigSyncRequest, check_fields
from agent_runtime.session_manager.scope_cache import ScopeConfig
from agent_runtime.spec_fields import DEPLOY_FIELDS
from agent_runtime.util import scope_id_of

BASE: dict[str, Any] = {"template_id": "t1", "image": "registry.local/agent:1.0"}


def template(**fields: Any) -> TemplateItem:
    return parse_item(TemplateItem, {**BASE, **fields})


def refused(model: type[Any], item: dict[str, Any]) -> str:
    """The ``ValidationFailed`` message for ``item`` (fails the test when it is accepted)."""
    with pytest.raises(ValidationFailed) as info:
        parse_item(model, item)
    assert info.value.code is ErrorCode.VALIDATION
    assert info.value.http_status == 400
    return info.value.message


def refused_template(**fields: Any) -> str:
    return refused(TemplateItem, {**BASE, **fields})


# --- defaults ------------------------------------------------------------------------------------


def test_minimal_template_gets_defaults() -> None:
    t = template()
    assert t.template_id == "t1"
    assert t.image == "registry.local/agent:1.0"
    assert t.enabled is True
    assert t.pod_name == "agent"
    assert t.namespace is None
    assert (t.container_port, t.sse_port, t.sse_path) == (8080, 8080, "/sse")
    assert (t.cpu_request, t.cpu_limit, t.memory_request, t.memory_limit) == (None,) * 4
    assert t.env == {}
    assert (t.nfs_server, t.nfs_path, t.nfs_mount_path) == (None, None, None)
    assert t.ready_timeout == 300.0
    assert t.ready_poll_interval == 2.0
    assert t.kubeconfig is None
    assert (t.scope_concurrency, t.pod_concurrency) == (10, 5)
    assert (t.session_ttl, t.pod_ttl, t.min_idle_pods) == (60, 300, 0)
    # the dict form is complete: every field present, defaults included
    assert set(t.as_dict()) == set(TemplateItem.model_fields)


def test_full_template_is_kept_as_given() -> None:
    item = {
        **BASE,
        "enabled": False,
        "pod_name": "my-agent",
        "namespace": "agents",
        "container_port": 9000,
        "sse_port": 9001,
        "sse_path": "/events",
        "cpu_request": "500m",
        "cpu_limit": "1",
        "memory_request": "256Mi",
        "memory_limit": "1.5Gi",
        "env": {"MODEL": "m1", "a.b-c_d": ""},
        "nfs_server": "10.0.0.1",
        "nfs_path": "/export",
        "nfs_mount_path": "/mnt/data",
        "ready_timeout": 60.5,
        "ready_poll_interval": 0.5,
        "kubeconfig": "/etc/kube/config",
        "scope_concurrency": 7,
        "pod_concurrency": 3,
        "session_ttl": 120,
        "pod_ttl": 600,
        "min_idle_pods": 3,
        "warm_pool": "predictive",
    }
    assert parse_item(TemplateItem, item).as_dict() == item


def test_int_accepted_for_float_fields() -> None:
    t = template(ready_timeout=5, ready_poll_interval=1)
    assert t.ready_timeout == 5.0
    assert isinstance(t.ready_timeout, float)


def test_missing_required_fields_are_named() -> None:
    assert "item.image" in refused(TemplateItem, {"template_id": "t1"})
    assert "item.template_id" in refused(TemplateItem, {"image": "i"})
    message = refused(RoutingRuleItem, {"group_id": "g"})
    assert "item.bot_id" in message
    assert "item.template_id" in message


def test_routing_rule_valid_and_wildcards() -> None:
    rule = parse_item(RoutingRuleItem, {"group_id": "g", "bot_id": "*", "template_id": "t"})
    assert (rule.group_id, rule.bot_id, rule.template_id) == ("g", "*", "t")
    star = parse_item(RoutingRuleItem, {"group_id": "*", "bot_id": "*", "template_id": "t"})
    assert (star.group_id, star.bot_id) == ("*", "*")


# --- strictness ----------------------------------------------------------------------------------


def test_unknown_template_field_rejected() -> None:
    assert refused_template(bogus=1) == "item.bogus: unknown field"


def test_unknown_rule_field_rejected() -> None:
    item = {"group_id": "g", "bot_id": "b", "template_id": "t", "bogus": "x"}
    assert refused(RoutingRuleItem, item) == "item.bogus: unknown field"


def test_every_problem_is_named() -> None:
    message = refused_template(bogus=1, sse_port=0)
    assert "item.bogus: unknown field" in message
    assert "item.sse_port" in message


@pytest.mark.parametrize(
    "field",
    ["container_port", "sse_port", "scope_concurrency", "pod_concurrency", "session_ttl",
     "pod_ttl", "min_idle_pods"],
)  # fmt: skip
def test_bool_is_not_an_int(field: str) -> None:
    message = refused_template(**{field: True})
    assert message.startswith(f"item.{field}:")
    assert "integer" in message


@pytest.mark.parametrize("field", ["ready_timeout", "ready_poll_interval"])
def test_bool_is_not_a_float(field: str) -> None:
    assert refused_template(**{field: True}).startswith(f"item.{field}:")


@pytest.mark.parametrize(
    "field", ["container_port", "sse_port", "scope_concurrency", "pod_concurrency", "session_ttl"]
)
def test_numeric_string_is_not_an_int(field: str) -> None:
    message = refused_template(**{field: "5"})
    assert message.startswith(f"item.{field}:")
    assert "integer" in message


def test_numeric_string_is_not_a_float() -> None:
    assert refused_template(ready_timeout="5").startswith("item.ready_timeout:")


def test_float_is_not_an_int() -> None:
    assert refused_template(scope_concurrency=2.5).startswith("item.scope_concurrency:")


def test_string_is_not_a_bool() -> None:
    assert refused_template(enabled="true").startswith("item.enabled:")
    assert refused_template(enabled=1).startswith("item.enabled:")


def test_int_is_not_a_string() -> None:
    assert refused_template(image=5).startswith("item.image:")
    rule = {"group_id": 1, "bot_id": "b", "template_id": "t"}
    assert refused(RoutingRuleItem, rule).startswith("item.group_id:")


# --- ranges --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["scope_concurrency", "pod_concurrency"])
@pytest.mark.parametrize("value", [0, -1])
def test_concurrency_at_least_one(field: str, value: int) -> None:
    assert refused_template(**{field: value}).startswith(f"item.{field}:")


def test_concurrency_one_accepted() -> None:
    t = template(scope_concurrency=1, pod_concurrency=1)
    assert t.max_pods == 1


@pytest.mark.parametrize(
    "field", ["session_ttl", "pod_ttl", "ready_timeout", "ready_poll_interval"]
)
@pytest.mark.parametrize("value", [0, -5])
def test_ttls_and_timeouts_positive(field: str, value: int) -> None:
    assert refused_template(**{field: value}).startswith(f"item.{field}:")


def test_min_idle_pods_not_negative() -> None:
    assert refused_template(min_idle_pods=-1).startswith("item.min_idle_pods:")
    assert template(min_idle_pods=0).min_idle_pods == 0


@pytest.mark.parametrize("field", ["container_port", "sse_port"])
@pytest.mark.parametrize("value", [0, -1, 65536, 100_000])
def test_port_out_of_range(field: str, value: int) -> None:
    assert refused_template(**{field: value}).startswith(f"item.{field}:")


@pytest.mark.parametrize("value", [1, 80, 65535])
def test_port_in_range(value: int) -> None:
    t = template(container_port=value, sse_port=value)
    assert (t.container_port, t.sse_port) == (value, value)


# --- Kubernetes names and quantities -------------------------------------------------------------


@pytest.mark.parametrize("value", ["a", "agent", "my-agent-2", "0abc", "a" * POD_NAME_MAX])
def test_pod_name_valid(value: str) -> None:
    assert template(pod_name=value).pod_name == value


@pytest.mark.parametrize(
    "value",
    ["Agent", "AGENT", "my_agent", "my.agent", "-agent", "agent-", "", "a b", "agent\n",
     "a" * (POD_NAME_MAX + 1), "a" * 64],
)  # fmt: skip
def test_pod_name_invalid(value: str) -> None:
    assert refused_template(pod_name=value).startswith("item.pod_name:")


def test_pod_name_leaves_room_for_the_random_suffix() -> None:
    # "{pod_name}-{10}-{5}" must fit a 63-character label
    assert POD_NAME_MAX + 1 + 10 + 1 + 5 <= 63


@pytest.mark.parametrize("value", ["default", "agents-prod", "a" * 63, None])
def test_namespace_valid(value: str | None) -> None:
    assert template(namespace=value).namespace == value


@pytest.mark.parametrize("value", ["Agents", "agents_prod", "a" * 64, "", "-ns", "ns.", "ns\n"])
def test_namespace_invalid(value: str) -> None:
    assert refused_template(namespace=value).startswith("item.namespace:")


@pytest.mark.parametrize(
    "value", ["500m", "1", "256Mi", "1.5Gi", "0.5", "2", "100k", "1Ki", "1e3", "1Ti", "+1"]
)
@pytest.mark.parametrize("field", ["cpu_request", "cpu_limit", "memory_request", "memory_limit"])
def test_quantity_valid(field: str, value: str) -> None:
    assert getattr(template(**{field: value}), field) == value


@pytest.mark.parametrize(
    "value", ["10 MB", "abc", "", "-1", "1.5.5", "Mi", "1 Gi", "1GB", "1mi", "m", "1\n"]
)
@pytest.mark.parametrize("field", ["cpu_request", "cpu_limit", "memory_request", "memory_limit"])
def test_quantity_invalid(field: str, value: str) -> None:
    assert refused_template(**{field: value}).startswith(f"item.{field}:")


# --- env -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["FOO", "foo_bar", "_X", "A1", "a.b-c", "-dash"])
def test_env_names_valid(name: str) -> None:
    assert template(env={name: "v"}).env == {name: "v"}


@pytest.mark.parametrize("name", ["1FOO", "FOO BAR", "FOO=1", "", "É", "a\tb", "a/b", "FOO\n"])
def test_env_names_invalid(name: str) -> None:
    assert refused_template(env={name: "v"}).startswith("item.env")


def test_env_values_must_be_strings() -> None:
    assert refused_template(env={"A": 1}).startswith("item.env")
    assert refused_template(env={"A": None}).startswith("item.env")
    assert refused_template(env=["A=1"]).startswith("item.env")


def test_env_value_may_be_empty() -> None:
    assert template(env={"A": ""}).env == {"A": ""}


# --- paths, nfs ----------------------------------------------------------------------------------


def test_sse_path_must_start_with_slash() -> None:
    assert refused_template(sse_path="sse").startswith("item.sse_path:")
    assert refused_template(sse_path="").startswith("item.sse_path:")
    assert refused_template(sse_path="http://x/sse").startswith("item.sse_path:")
    assert template(sse_path="/").sse_path == "/"
    assert template(sse_path="/a/b").sse_path == "/a/b"


NFS = {"nfs_server": "10.0.0.1", "nfs_path": "/export", "nfs_mount_path": "/mnt/data"}


def test_nfs_all_set_accepted() -> None:
    t = template(**NFS)
    assert (t.nfs_server, t.nfs_path, t.nfs_mount_path) == tuple(NFS.values())


@pytest.mark.parametrize("missing", sorted(NFS))
def test_nfs_all_or_none(missing: str) -> None:
    partial = {k: v for k, v in NFS.items() if k != missing}
    message = refused_template(**partial)
    assert "nfs_server" in message
    assert message.startswith("item")


@pytest.mark.parametrize("only", sorted(NFS))
def test_nfs_single_field_rejected(only: str) -> None:
    assert "nfs" in refused_template(**{only: NFS[only]})


@pytest.mark.parametrize("field", ["nfs_path", "nfs_mount_path"])
def test_nfs_paths_absolute(field: str) -> None:
    assert refused_template(**{**NFS, field: "relative/path"}).startswith(f"item.{field}:")


# --- cross-field rules ---------------------------------------------------------------------------


def test_ready_poll_interval_not_above_ready_timeout() -> None:
    message = refused_template(ready_timeout=5, ready_poll_interval=10)
    assert "ready_poll_interval" in message
    assert "ready_timeout" in message
    t = template(ready_timeout=5, ready_poll_interval=5)
    assert t.ready_poll_interval == t.ready_timeout


def test_min_idle_pods_not_above_max_pods() -> None:
    # max_pods = ceil(10 / 5) = 2
    message = refused_template(scope_concurrency=10, pod_concurrency=5, min_idle_pods=3)
    assert "min_idle_pods" in message
    assert "max_pods" in message
    assert template(scope_concurrency=10, pod_concurrency=5, min_idle_pods=2).min_idle_pods == 2
    # ceil: 11 / 5 → 3 pods
    assert template(scope_concurrency=11, pod_concurrency=5, min_idle_pods=3).max_pods == 3


@pytest.mark.parametrize(
    ("scope", "pod", "expected"), [(10, 5, 2), (11, 5, 3), (1, 100, 1), (100, 1, 100), (5, 5, 1)]
)
def test_max_pods_property(scope: int, pod: int, expected: int) -> None:
    t = template(scope_concurrency=scope, pod_concurrency=pod)
    assert t.max_pods == expected
    assert ScopeConfig.of("sid", "g", "b", t).pool_config()["max_pods"] == expected


def test_max_pods_is_not_an_input() -> None:
    assert refused_template(max_pods=3) == "item.max_pods: unknown field"


# --- ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["a\nb", "a\x00b", "tab\there", "del\x7f", "\x1b[31m", "cr\r"])
def test_template_id_with_control_characters_rejected(value: str) -> None:
    assert refused_template(template_id=value).startswith("item.template_id:")


@pytest.mark.parametrize("field", ["group_id", "bot_id", "template_id"])
@pytest.mark.parametrize("value", ["a\nb", "x\x00", "x" * 257, ""])
def test_rule_ids_rejected(field: str, value: str) -> None:
    item = {"group_id": "g", "bot_id": "b", "template_id": "t", field: value}
    assert refused(RoutingRuleItem, item).startswith(f"item.{field}:")


def test_id_length_limit() -> None:
    assert template(template_id="x" * 256).template_id == "x" * 256
    assert refused_template(template_id="x" * 257).startswith("item.template_id:")
    assert refused_template(template_id="").startswith("item.template_id:")


def test_ids_may_be_unicode_and_case_sensitive() -> None:
    assert template(template_id="模板-A").template_id == "模板-A"
    item = {"group_id": "Grp", "bot_id": "BOT", "template_id": "t"}
    rule = parse_item(RoutingRuleItem, item)
    assert (rule.group_id, rule.bot_id) == ("Grp", "BOT")


def test_image_with_control_characters_rejected() -> None:
    assert refused_template(image="img\n:1").startswith("item.image:")


# --- ScopeConfig ---------------------------------------------------------------------------------


def test_scope_config_of_template() -> None:
    t = template(scope_concurrency=11, pod_concurrency=5, min_idle_pods=1, env={"A": "1"})
    sid = scope_id_of("g", "b")
    config = ScopeConfig.of(sid, "g", "b", t)
    assert config.scope_id == sid
    assert (config.group_id, config.bot_id, config.template_id) == ("g", "b", "t1")
    assert config.max_pods == 3
    assert config.deploy_ver == t.deploy_ver()
    assert set(config.pod_spec) == set(DEPLOY_FIELDS)
    assert config.pod_spec["env"] == {"A": "1"}
    assert config.pool_config() == {
        "min_idle_pods": 1,
        "max_pods": 3,
        "pod_ttl": 300,
        "pod_concurrency": 5,
        "warm_pool": "static",
    }


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"env": {"Z": "1", "A": "é"}, "cpu_limit": "2", "namespace": "ns"},
        {**NFS, "kubeconfig": "/k", "ready_timeout": 12.5, "ready_poll_interval": 0.25},
        {"scope_concurrency": 100_000, "pod_concurrency": 1, "min_idle_pods": 100_000},
    ],
)
def test_scope_config_hash_round_trip(fields: dict[str, Any]) -> None:
    sid = scope_id_of("grp", "bot")
    config = ScopeConfig.of(sid, "grp", "bot", template(**fields))
    h = config.to_hash()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.items())
    assert h["deploy_ver"] == config.deploy_ver
    assert h["max_pods"] == str(config.max_pods)
    restored = ScopeConfig.from_hash(sid, h)
    assert restored == config
    assert restored.to_hash() == h


def test_scope_config_from_hash_rejects_incomplete_hash() -> None:
    config = ScopeConfig.of("sid", "g", "b", template())
    h = config.to_hash()
    del h["deploy_ver"]
    with pytest.raises(KeyError):
        ScopeConfig.from_hash("sid", h)
    broken = {**config.to_hash(), "max_pods": "two"}
    with pytest.raises(ValueError):
        ScopeConfig.from_hash("sid", broken)


# --- input limits at the edge (api/ids.py, api/json_body.py) --------------------------------------


def _forbidden_by_unicodedata() -> list[str]:
    """Every character of the categories the id rule refuses, per this Python's Unicode data."""
    import unicodedata

    categories = {"Cc", "Cf", "Cs", "Zl", "Zp"}
    return [chr(cp) for cp in range(0x110000) if unicodedata.category(chr(cp)) in categories]


def test_id_rule_refuses_every_control_format_and_separator_character() -> None:
    """The hand-written class in api/ids.py covers Cc, Cf, Cs, Zl and Zp of the running
    Python's Unicode version (a newer Python with new format characters fails here first)."""
    missed = [f"U+{ord(c):04X}" for c in _forbidden_by_unicodedata() if not has_forbidden(c)]
    assert not missed, missed
    for value in ("\ufffe", "\uffff"):  # noncharacters, refused too
        assert has_forbidden(value)


@pytest.mark.parametrize(
    "value",
    ["r-7f3a", "grp:9/a.b@c", "界面-ид", "emoji 🙂", "with space", "\u00a0nbsp", "*", "\ue000"],
)
def test_id_rule_accepts_printable_text(value: str) -> None:
    assert is_id(value)
    assert parse_item(TemplateItem, {**BASE, "template_id": value}).template_id == value


@pytest.mark.parametrize("value", ["", "x" * 257, 7, None, "a\u202eb", "a\ud800", "\U000e0041"])
def test_is_id_refuses(value: object) -> None:
    assert not is_id(value)


def test_printable_escapes_and_cuts() -> None:
    assert printable("a\u202eb\x00c") == "a\\u202eb\\u0000c"
    assert printable("x" * 100, limit=10) == "x" * 10 + "…"
    assert printable("plain") == "plain"


def test_documented_pattern_matches_the_rule_on_the_bmp() -> None:
    """PRINTABLE_PATTERN (for the OpenAPI schema) says what has_forbidden says, BMP minus
    surrogates (the pattern cannot name those; the server refuses them anyway)."""
    pattern = re.compile(PRINTABLE_PATTERN)
    for cp in range(0x10000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        char = chr(cp)
        assert (pattern.fullmatch(char) is None) == has_forbidden(char), f"U+{cp:04X}"


@pytest.mark.parametrize(
    ("raw", "deep"),
    [
        (b'{"a": 1}', False),
        (b"[" * 32 + b"]" * 32, False),
        (b"[" * 33 + b"]" * 33, True),
        (b"[" * 10_000, True),
        (b'{"s": "' + b"[" * 100 + b'"}', False),  # brackets in a string do not count
        (b'{"s": "\\"' + b"[" * 100 + b'"}', False),  # nor after an escaped quote
        (b'{"s": "\\\\", "t": ' + b"[" * 33 + b"]" * 33 + b"}", True),  # an escaped backslash
        (b"[" * 20 + b"]" * 20 + b"[" * 20 + b"]" * 20, False),  # siblings: depth 20
        (b'"' + b"[" * 40, False),  # unterminated string: all of it is the string
    ],
)
def test_nesting_exceeds(raw: bytes, deep: bool) -> None:
    assert nesting_exceeds(raw) is deep


def test_nesting_scan_stays_linear_on_hostile_strings() -> None:
    """Unterminated strings full of escaped quotes: each byte is looked at once."""
    import time

    raw = b"[" * 40 + b'"' + b'\\"' * 32_000
    started = time.perf_counter()
    nesting_exceeds(raw)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[1]", "must be a JSON object"),
        (b'{"a": NaN}', "NaN or Infinity"),
        (b'{"a": -Infinity}', "NaN or Infinity"),
        (b'{"a": 1e400}', "NaN or Infinity"),
        (b'{"a": "\xff"}', "not UTF-8"),
        (b'{"a": 1,}', "not valid JSON"),
        (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),  # int digits limit
        (b"[" * 33 + b"]" * 33, "nests deeper than 32"),
    ],
)
def test_parse_body_refusals(raw: bytes, message: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_body(raw)
    assert message in info.value.message


def test_parse_body_reads_plain_json() -> None:
    assert parse_body(b'\xef\xbb\xbf{"a": [1.5, "x"], "b": {"c": null}}') == {
        "a": [1.5, "x"],
        "b": {"c": None},
    }
    assert parse_body(b'{"a": 1, "a": 2}') == {"a": 2}  # duplicate keys: the last one wins


def test_no_session_id_names_another_sessions_tombstone() -> None:
    """Session ids may hold ':' (and end in anything): the tombstone key lives apart."""
    for sid in ("s", "s:previous_pod", "a:b"):
        assert state.previous_pod_key("scope-a", sid) not in {
            state.session_key("scope-a", other) for other in ("s", "s:previous_pod", "a:b", "a")
        }


@pytest.mark.parametrize(
    "selector",
    [
        "app=x",
        " a = b , !c , d!=e,f==g",
        "agent-runtime/scope=abc",
        "x",
        "k=",
        "a.b_c-d=v.1",
        "env in (a,b)",
        "env notin (a)",
    ],
)
def test_label_selector_accepted(selector: str) -> None:
    assert CleanupRequest.model_validate({"label_selector": selector}).label_selector == selector


@pytest.mark.parametrize(
    "selector",
    [
        *("a b", "=x", "a=b=c", "a=" + "v" * 64, "a\x00=b", "!", "A/b=c", "-a=b"),
        *(",", "a=b,", ",a", "a,,b", " , ", "a gt 1", "a < 2", "a in ()", "a in (b,)", "!a=b"),
    ],
)
def test_label_selector_refused(selector: str) -> None:
    with pytest.raises(ValidationError):
        CleanupRequest.model_validate({"label_selector": selector})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sse_path", "/a\x00b"),
        ("nfs_path", "/a\u202eb"),
        ("image", "img\u2028x"),
        ("kubeconfig", "/k\x7f"),
    ],
)
def test_config_texts_refuse_control_and_format_characters(field: str, value: str) -> None:
    nfs = {"nfs_server": "10.0.0.1", "nfs_path": "/x", "nfs_mount_path": "/y"}
    extra = nfs if field.startswith("nfs") else {}
    assert refused_template(**{**extra, field: value}).startswith(f"item.{field}:")


def test_env_value_may_hold_newlines_but_not_nul() -> None:
    assert (
        template(env={"PEM": "-----BEGIN-----\nabc\n-----END-----\t"}).env["PEM"].count("\n") == 2
    )
    assert refused_template(env={"A": "x\x00y"}).startswith("item.env.A:")


def test_floats_refuse_nan_and_infinity() -> None:
    for value in (math.nan, math.inf):
        assert refused_template(ready_timeout=value).startswith("item.ready_timeout:")


def test_partial_update_fields_are_checked_before_anything_is_looked_up() -> None:
    request = ConfigSyncRequest(
        kind="template", op="update", item={"template_id": "t", "pod_ttl": 0}
    )
    with pytest.raises(ValidationFailed, match=r"item\.pod_ttl"):
        check_fields(request)
    with pytest.raises(ValidationFailed, match=r"item\.bogus: unknown field"):
        check_fields(
            ConfigSyncRequest(kind="template", op="update", item={"template_id": "t", "bogus": 1})
        )
    # cross-field rules wait for the merge (the stored template may hold the other half)
    check_fields(
        ConfigSyncRequest(kind="template", op="update", item={"template_id": "t", "nfs_path": "/x"})
    )
    check_fields(
        ConfigSyncRequest(kind="template", op="delete", item={"template_id": "t", "pod_ttl": 0})
    )


def test_config_sync_item_field_names_are_bounded() -> None:
    for name in ("x" * 65, "a\x00b", ""):
        with pytest.raises(ValidationError):
            ConfigSyncRequest.model_validate(
                {"kind": "template", "op": "create", "item": {name: 1}}
            )
