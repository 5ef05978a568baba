"""The deploy_ver fingerprint, change classification and the pure helpers (contract §1, §3)."""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_runtime import spec_fields
from agent_runtime.session_manager.items import TemplateItem
from agent_runtime.spec_fields import (
    DEPLOY_FIELDS,
    DEPLOY_VER_FIELDS,
    POLICY_FIELDS,
    classify_change,
    deploy_ver,
)
from agent_runtime.util import max_pods, scope_id_of

HEX16 = re.compile(r"^[0-9a-f]{16}$")


def full_template(**overrides: Any) -> dict[str, Any]:
    """A complete template dict with every deploy field set (no nulls)."""
    base = TemplateItem(
        template_id="t1",
        image="registry.local/agent:1.0",
        namespace="agents",
        cpu_request="500m",
        cpu_limit="1",
        memory_request="256Mi",
        memory_limit="1Gi",
        env={"A": "1", "B": "two"},
        nfs_server="10.0.0.1",
        nfs_path="/export/agents",
        nfs_mount_path="/mnt/agents",
        kubeconfig="/etc/kube/config",
    ).as_dict()
    base.update(overrides)
    return base


def _other_value(field: str, value: Any) -> Any:
    """A different, still plausible value for ``field``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, dict):
        return {**value, "EXTRA": "x"}
    if isinstance(value, str):
        return value + "-2" if not value.startswith("/") else value + "/2"
    raise AssertionError(f"no alternative value for {field}={value!r}")


# --- field lists ---------------------------------------------------------------------------------


def test_every_template_field_is_classified_exactly_once() -> None:
    deploy, policy = set(DEPLOY_FIELDS), set(POLICY_FIELDS)
    assert not deploy & policy
    assert deploy | policy | {"template_id"} == set(TemplateItem.model_fields)


def test_deploy_ver_fields_are_deploy_fields_without_kubeconfig() -> None:
    assert "kubeconfig" in DEPLOY_FIELDS
    assert "kubeconfig" not in DEPLOY_VER_FIELDS
    assert set(DEPLOY_VER_FIELDS) == set(DEPLOY_FIELDS) - {"kubeconfig"}
    # ready_timeout / ready_poll_interval are in the fingerprint (contract §3)
    assert {"ready_timeout", "ready_poll_interval"} <= set(DEPLOY_VER_FIELDS)


# --- deploy_ver ----------------------------------------------------------------------------------


def test_deploy_ver_is_16_lowercase_hex() -> None:
    assert HEX16.match(deploy_ver(full_template()))
    assert HEX16.match(deploy_ver({}))
    assert HEX16.match(deploy_ver(TemplateItem(template_id="d", image="i").as_dict()))


def test_deploy_ver_is_first_16_hex_of_md5_over_sorted_non_null_fields() -> None:
    # pinned independently of the implementation: changing the canonical form would give every
    # running pod a new version on upgrade (and sunset it)
    template = {
        "image": "img",
        "container_port": 8080,
        "env": {"B": "2", "A": "1"},
        "cpu_limit": None,
    }
    expected = hashlib.md5(b'{"container_port":8080,"env":{"A":"1","B":"2"},"image":"img"}')
    assert deploy_ver(template) == expected.hexdigest()[:16]


def test_deploy_ver_is_stable_for_equal_input() -> None:
    a, b = full_template(), full_template()
    assert a is not b
    assert deploy_ver(a) == deploy_ver(b) == deploy_ver(a)
    item = TemplateItem(template_id="x", image="img")
    assert item.deploy_ver() == TemplateItem(template_id="x", image="img").deploy_ver()


def test_deploy_ver_ignores_ids_and_policy_fields() -> None:
    base = full_template()
    ver = deploy_ver(base)
    assert deploy_ver({**base, "template_id": "another"}) == ver
    for field in POLICY_FIELDS:
        assert deploy_ver({**base, field: _other_value(field, base[field])}) == ver, field
    assert deploy_ver({**base, "unrelated": 1}) == ver


@pytest.mark.parametrize("field", DEPLOY_VER_FIELDS)
def test_every_versioned_deploy_field_changes_deploy_ver(field: str) -> None:
    base = full_template()
    changed = {**base, field: _other_value(field, base[field])}
    assert deploy_ver(changed) != deploy_ver(base)
    # dropping the field (None) changes it too: it was part of the fingerprint
    assert deploy_ver({**base, field: None}) != deploy_ver(base)


def test_kubeconfig_does_not_change_deploy_ver() -> None:
    base = full_template()
    ver = deploy_ver(base)
    assert deploy_ver({**base, "kubeconfig": "/other/kubeconfig"}) == ver
    assert deploy_ver({**base, "kubeconfig": None}) == ver
    without = {k: v for k, v in base.items() if k != "kubeconfig"}
    assert deploy_ver(without) == ver


def test_null_field_equals_absent_field() -> None:
    base = full_template(cpu_limit=None, namespace=None)
    absent = {k: v for k, v in base.items() if k not in ("cpu_limit", "namespace")}
    assert deploy_ver(base) == deploy_ver(absent)


def test_env_key_order_does_not_matter() -> None:
    one = full_template(env={"A": "1", "B": "2", "C": "3"})
    two = full_template(env={"C": "3", "A": "1", "B": "2"})
    assert deploy_ver(one) == deploy_ver(two)


# a fixed alphabet with the awkward characters (quotes, backslash, non-ASCII): no unicode table
# to build on a fresh checkout, so the first run is as fast as the others
_ALPHABET = 'aZ09-_/:. "\\é组\u2028'
_text = st.text(alphabet=_ALPHABET, max_size=20)
_value = st.one_of(
    st.none(),
    _text,
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.dictionaries(_text, _text, max_size=4),
)
_deploy_dicts = st.dictionaries(st.sampled_from(DEPLOY_FIELDS), _value)


@given(template=_deploy_dicts, data=st.data())
def test_deploy_ver_independent_of_key_order(template: dict[str, Any], data: st.DataObject) -> None:
    items = data.draw(st.permutations(list(template.items())))
    shuffled = dict(items)
    reversed_ = dict(reversed(items))
    assert deploy_ver(shuffled) == deploy_ver(template) == deploy_ver(reversed_)


@given(
    template=_deploy_dicts,
    extra_nulls=st.lists(st.sampled_from(DEPLOY_FIELDS), unique=True),
)
def test_deploy_ver_drops_nulls(template: dict[str, Any], extra_nulls: list[str]) -> None:
    without_nulls = {k: v for k, v in template.items() if v is not None}
    with_more_nulls = {**template, **{f: None for f in extra_nulls if f not in template}}
    assert deploy_ver(template) == deploy_ver(without_nulls) == deploy_ver(with_more_nulls)


@given(template=_deploy_dicts, kubeconfig=st.one_of(st.none(), _text))
def test_deploy_ver_never_depends_on_kubeconfig(
    template: dict[str, Any], kubeconfig: str | None
) -> None:
    assert deploy_ver({**template, "kubeconfig": kubeconfig}) == deploy_ver(
        {k: v for k, v in template.items() if k != "kubeconfig"}
    )


def test_one_function_for_both_modules() -> None:
    item = TemplateItem(template_id="t", image="img", cpu_limit="2")
    assert item.deploy_ver() == spec_fields.deploy_ver(item.as_dict())
    assert item.deploy_ver() == spec_fields.deploy_ver(item.pod_spec())


# --- classify_change -----------------------------------------------------------------------------


def test_classify_identical_is_none() -> None:
    assert classify_change(full_template(), full_template()) == "none"


def test_classify_template_id_only_is_none() -> None:
    assert classify_change(full_template(), full_template(template_id="other")) == "none"


@pytest.mark.parametrize("field", DEPLOY_FIELDS)
def test_classify_deploy_field_is_deploy(field: str) -> None:
    old = full_template()
    new = {**old, field: _other_value(field, old[field])}
    assert classify_change(old, new) == "deploy"


@pytest.mark.parametrize("field", POLICY_FIELDS)
def test_classify_policy_field_is_policy(field: str) -> None:
    old = full_template()
    new = {**old, field: _other_value(field, old[field])}
    assert classify_change(old, new) == "policy"


def test_classify_deploy_wins_over_policy() -> None:
    old = full_template()
    new = {**old, "image": "img:2", "scope_concurrency": 99, "enabled": False}
    assert classify_change(old, new) == "deploy"


def test_classify_setting_a_null_deploy_field_is_deploy() -> None:
    old = full_template(cpu_limit=None)
    assert classify_change(old, full_template(cpu_limit="2")) == "deploy"
    assert classify_change(full_template(cpu_limit="2"), old) == "deploy"


def test_kubeconfig_only_change_is_deploy_with_unchanged_version() -> None:
    old = full_template(kubeconfig="/a")
    new = full_template(kubeconfig="/b")
    assert classify_change(old, new) == "deploy"
    assert deploy_ver(old) == deploy_ver(new)
    # also from / to no kubeconfig
    assert classify_change(full_template(kubeconfig=None), new) == "deploy"
    assert deploy_ver(full_template(kubeconfig=None)) == deploy_ver(new)


# --- util ----------------------------------------------------------------------------------------


def test_scope_id_is_md5_of_group_nul_bot() -> None:
    assert scope_id_of("grp-9", "bot-1") == hashlib.md5(b"grp-9\x00bot-1").hexdigest()
    assert re.fullmatch(r"[0-9a-f]{32}", scope_id_of("g", "b"))


def test_scope_id_separator_keeps_pairs_apart() -> None:
    assert scope_id_of("ab", "c") != scope_id_of("a", "bc")
    assert scope_id_of("g", "b") != scope_id_of("b", "g")
    assert scope_id_of("*", "*") == hashlib.md5(b"*\x00*").hexdigest()


def test_scope_id_of_non_ascii_ids_is_md5_of_utf8() -> None:
    assert scope_id_of("组", "机器人") == hashlib.md5("组\x00机器人".encode()).hexdigest()


_id = st.text(alphabet="ab*-é", max_size=6)


@given(a=st.tuples(_id, _id), b=st.tuples(_id, _id))
def test_scope_id_injective_on_nul_free_ids(a: tuple[str, str], b: tuple[str, str]) -> None:
    assert (scope_id_of(*a) == scope_id_of(*b)) == (a == b)


@pytest.mark.parametrize(
    ("scope", "pod", "expected"),
    [(10, 5, 2), (11, 5, 3), (1, 5, 1), (5, 5, 1), (1, 1, 1), (100, 1, 100), (7, 3, 3)],
)
def test_max_pods_is_ceil(scope: int, pod: int, expected: int) -> None:
    assert max_pods(scope, pod) == expected


@given(scope=st.integers(1, 100_000), pod=st.integers(1, 100_000))
def test_max_pods_is_enough_and_not_more(scope: int, pod: int) -> None:
    n = max_pods(scope, pod)
    assert n == math.ceil(scope / pod)
    assert n * pod >= scope
    assert (n - 1) * pod < scope
