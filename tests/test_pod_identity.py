"""Pod identity: the signature that tells this installation's pods from any other pod with
our labels (``resource_manager/identity.py``), the secret behind it (settings, or generated
once into the config DB by the first replica), the real client signing each pod it creates
(create manifest, then a patch bound to the uid), and the two scripts the reconcile side
adds (``adopt.lua``, ``foreign_report.lua``) on fakeredis and the real Redis.

Reconcile, the admin view and routes over foreign and adopted pods: ``test_pod_adoption.py``;
a full Redis data loss under a real server process: ``test_pod_identity_e2e.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import V1Container, V1ObjectMeta, V1Pod, V1PodSpec
from pydantic import ValidationError
from redis.asyncio import Redis
from sqlalchemy import create_engine, inspect

from agent_runtime.db import installation, schema
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import installation_secret
from agent_runtime.resource_manager import identity as identity_module
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.identity import (
    IDENTITY_ANNOTATION,
    INCARNATION_ANNOTATION,
    SSE_PATH_ANNOTATION,
    SSE_PORT_ANNOTATION,
    Ownership,
    PodIdentity,
)
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import DEPLOY_VER_LABEL, SCOPE_LABEL, DeployFailed
from agent_runtime.resource_manager.pod_reading import pod_status, pod_status_from_json
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state_values import BudgetRepair
from agent_runtime.resource_manager.views import ResourceViews
from agent_runtime.wiring import load_pod_identity
from contract_keys import rm_pod_known
from helpers import IDENTITY, make_settings, make_sql_backend
from test_k8s import Opened, ScriptedCoreApi, api_error, as_json, spec

SCOPE = "0123456789abcdef0123456789abcdef"
VER = "feedfacecafebeef"
SECRET = "tests-pod-identity-secret-0001"  # helpers.IDENTITY's


def our_pod(**kw: Any) -> Any:
    """A pod as this installation leaves it: both annotations, signed with IDENTITY."""
    fake = FakeK8sPodClient()
    return fake.add_pod(
        scope_id=SCOPE,
        deploy_ver=VER,
        identity=IDENTITY,
        pod_spec={"sse_port": 9000, "sse_path": "/events"},
        **kw,
    )


# --- sign and verify ---------------------------------------------------------------------------


def test_our_pod_verifies_and_carries_its_signed_sse_endpoint() -> None:
    pod = our_pod()
    verdict = IDENTITY.verify(pod)
    assert verdict.ownership is Ownership.OURS and verdict.reason == ""
    assert verdict.sse_url("10.0.0.7") == "http://10.0.0.7:9000/events"
    assert pod.annotations[SSE_PORT_ANNOTATION] == "9000"
    assert pod.annotations[IDENTITY_ANNOTATION].startswith("v1:")
    assert SECRET not in json.dumps(pod.annotations)


@pytest.mark.parametrize(
    "tamper",
    [
        {"pod_id": "agent-another-name"},
        {"namespace": "other"},
        {"labels": "scope"},
        {"labels": "deploy_ver"},
        {"annotations": {SSE_PORT_ANNOTATION: "9001"}},
        {"annotations": {SSE_PATH_ANNOTATION: "/elsewhere"}},
        {"annotations": {SSE_PORT_ANNOTATION: "not-a-port"}},
        {"annotations": {IDENTITY_ANNOTATION: "v1:" + "0" * 64}},
        {"annotations": {IDENTITY_ANNOTATION: ""}},
        {"annotations": {IDENTITY_ANNOTATION: "v1:\u00fcber", SSE_PATH_ANNOTATION: "/\u00e9"}},
        {"drop": IDENTITY_ANNOTATION},
        {"drop": SSE_PATH_ANNOTATION},
    ],
    ids=lambda t: next(iter(t)) + ":" + str(next(iter(t.values())))[:20],
)
def test_anything_adoption_reads_is_covered_by_the_signature(tamper: dict[str, Any]) -> None:
    pod = our_pod()
    if "labels" in tamper:
        key = SCOPE_LABEL if tamper["labels"] == "scope" else DEPLOY_VER_LABEL
        pod = dataclasses.replace(pod, labels={**pod.labels, key: "f" * 32})
    elif "annotations" in tamper:
        pod = dataclasses.replace(pod, annotations={**pod.annotations, **tamper["annotations"]})
    elif "drop" in tamper:
        notes = {k: v for k, v in pod.annotations.items() if k != tamper["drop"]}
        pod = dataclasses.replace(pod, annotations=notes)
    else:
        pod = dataclasses.replace(pod, **tamper)
    assert IDENTITY.verify(pod).ownership is Ownership.FOREIGN


def test_no_annotation_or_another_secret_is_foreign() -> None:
    bare = FakeK8sPodClient().add_pod(scope_id=SCOPE, deploy_ver=VER, image="attacker/agent")
    verdict = IDENTITY.verify(bare)
    assert (verdict.ownership, verdict.reason) == (Ownership.FOREIGN, "no identity annotation")
    theirs = FakeK8sPodClient().add_pod(
        scope_id=SCOPE, deploy_ver=VER, identity=PodIdentity("someone-elses-secret-0001")
    )
    assert IDENTITY.verify(theirs).ownership is Ownership.FOREIGN


def test_a_copy_on_another_incarnation_is_only_unfinished() -> None:
    """Our annotations copied onto a pod re-created under the same name (ours was deleted):
    the create signature still verifies, the uid-bound one does not."""
    pod = our_pod()
    replay = dataclasses.replace(pod, uid="another-incarnation")
    verdict = IDENTITY.verify(replay)
    assert verdict.ownership is Ownership.UNFINISHED and "uid" in verdict.reason
    unsigned = {k: v for k, v in pod.annotations.items() if k != INCARNATION_ANNOTATION}
    assert IDENTITY.verify(dataclasses.replace(pod, annotations=unsigned)).ownership is (
        Ownership.UNFINISHED
    )
    assert IDENTITY.verify(dataclasses.replace(pod, uid="")).ownership is Ownership.UNFINISHED


def test_rotation_previous_secrets_verify_but_never_sign() -> None:
    old = PodIdentity("the-previous-secret-0001")
    signed_before = FakeK8sPodClient().add_pod(scope_id=SCOPE, deploy_ver=VER, identity=old)
    rotated = PodIdentity("the-current-secret-00001", previous=["the-previous-secret-0001"])
    assert rotated.verify(signed_before).ownership is Ownership.OURS
    signed_now = FakeK8sPodClient().add_pod(scope_id=SCOPE, deploy_ver=VER, identity=rotated)
    assert old.verify(signed_now).ownership is Ownership.FOREIGN, "signed with the new one"
    dropped = PodIdentity("the-current-secret-00001")
    assert dropped.verify(signed_before).ownership is Ownership.FOREIGN


def test_macs_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real_compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(identity_module.hmac, "compare_digest", spy)
    two_keys = PodIdentity(SECRET, previous=["the-previous-secret-0001"])
    pod = our_pod()
    assert two_keys.verify(pod).ownership is Ownership.OURS
    # both MACs, each against every accepted key (which key matched does not show in time)
    assert len(compared) == 4
    assert {a for a, _ in compared} == {
        pod.annotations[IDENTITY_ANNOTATION].encode(),
        pod.annotations[INCARNATION_ANNOTATION].encode(),
    }


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        PodIdentity("short")
    with pytest.raises(ValueError, match="at least 16"):
        PodIdentity(SECRET, previous=["short"])
    with pytest.raises(ValidationError, match="at least 16"):
        make_settings(pod_identity_secret="short")
    with pytest.raises(ValidationError, match="at least 16"):
        make_settings(pod_identity_previous_secrets=f"{SECRET},short")


def test_the_setting_is_a_secret() -> None:
    settings = make_settings(
        pod_identity_secret=SECRET,
        pod_identity_previous_secrets="old-secret-number-1, old-2-secret-number",
    )
    assert SECRET not in repr(settings) and "old-secret-number-1" not in repr(settings)
    assert [s.get_secret_value() for s in settings.pod_identity_previous_secrets] == [
        "old-secret-number-1",
        "old-2-secret-number",
    ]


# --- the secret: configured, or generated once into the config DB ------------------------------


async def test_replicas_starting_at_once_share_one_generated_secret(
    db: Database, migrated_url: str
) -> None:
    """Two "replicas" (their own engines and DB threads) generate at the same moment, many
    times: the insert-if-absent keeps one row, and both read it back."""
    other = Database.from_url(migrated_url, pool_size=2)
    try:
        for _ in range(5):
            await db.write(lambda conn: conn.execute(installation_secret.delete()))
            first, second = await asyncio.gather(
                installation.ensure_secret(db, installation.POD_IDENTITY_SECRET),
                installation.ensure_secret(other, installation.POD_IDENTITY_SECRET),
            )
            assert first == second and len(first) == 64
            stored = await installation.stored_secret(other, installation.POD_IDENTITY_SECRET)
            assert stored == first
        again = await installation.ensure_secret(db, installation.POD_IDENTITY_SECRET)
        assert again == first, "a restart reads the same secret"
    finally:
        await other.close()


async def test_the_configured_secret_signs_and_the_generated_one_still_verifies(
    db: Database,
) -> None:
    generated = await load_pod_identity(make_settings(), db)
    before = FakeK8sPodClient().add_pod(scope_id=SCOPE, deploy_ver=VER, identity=generated)
    assert (await load_pod_identity(make_settings(), db)).verify(before).ownership is Ownership.OURS

    configured = await load_pod_identity(make_settings(pod_identity_secret=SECRET), db)
    assert configured.verify(before).ownership is Ownership.OURS, "setting a key keeps our pods"
    after = FakeK8sPodClient().add_pod(scope_id=SCOPE, deploy_ver=VER, identity=configured)
    assert IDENTITY.verify(after).ownership is Ownership.OURS, "signed with the configured one"
    assert generated.verify(after).ownership is Ownership.FOREIGN

    # revoking the generated one: delete its row
    await db.write(lambda conn: conn.execute(installation_secret.delete()))
    revoked = await load_pod_identity(make_settings(pod_identity_secret=SECRET), db)
    assert revoked.verify(before).ownership is Ownership.FOREIGN
    assert await installation.stored_secret(db, installation.POD_IDENTITY_SECRET) is None


# --- the real client signs what it creates (a scripted CoreV1Api) ------------------------------


@pytest.fixture
async def api() -> ScriptedCoreApi:
    return ScriptedCoreApi()


@pytest.fixture
async def real(api: ScriptedCoreApi) -> Any:
    client = RealK8sPodClient(default_namespace="ns", api_factory=Opened(api))
    await client.start()
    yield client
    await client.close()


async def deploy(client: RealK8sPodClient) -> Any:
    return await client.deploy(scope_id=SCOPE, deploy_ver=VER, pod_spec=spec(), identity=IDENTITY)


async def test_a_deploy_signs_its_pod_for_the_uid_its_create_answered(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    info = await deploy(real)
    ((name, patch, content_type),) = api.patches
    stored = api.pods[("ns", info.pod_id)]["metadata"]
    assert name == info.pod_id and content_type == "application/merge-patch+json"
    assert patch["metadata"]["uid"] == stored["uid"], "the patch names the incarnation it means"
    assert set(stored["annotations"]) == {
        IDENTITY_ANNOTATION,
        INCARNATION_ANNOTATION,
        SSE_PORT_ANNOTATION,
        SSE_PATH_ANNOTATION,
    }
    found = pod_status(await api.read_namespaced_pod(info.pod_id, "ns"))
    assert IDENTITY.verify(found).ownership is Ownership.OURS


async def test_a_lost_sign_reply_is_sent_again(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.patch_faults = ["lost", api_error(503, "Service Unavailable")]
    info = await deploy(real)
    assert len(api.patches) == 3 and api.deletes == []
    found = pod_status(await api.read_namespaced_pod(info.pod_id, "ns"))
    assert IDENTITY.verify(found).ownership is Ownership.OURS


async def test_a_refused_sign_fails_the_deploy_and_deletes_the_pod(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    api.patch_faults = [api_error(403, "Forbidden", 'pods "x" is forbidden')]
    with pytest.raises(DeployFailed, match="needs `patch` on pods"):
        await deploy(real)
    assert [name for name, _ in api.deletes] == api.creates and api.pods == {}


async def test_a_pod_replaced_under_its_name_fails_the_deploy(
    real: RealK8sPodClient, api: ScriptedCoreApi
) -> None:
    """Someone deletes our new pod and creates theirs under its name: the deploy never takes
    their pod for ours (its uid differs), whatever it carries."""
    api.pod_state = "pending"

    async def replace() -> None:
        await api.created.wait()
        await asyncio.sleep(0.05)  # our patch first, then the swap
        ((namespace, name),) = api.pods
        body = api.pods[(namespace, name)]
        api.pods[(namespace, name)] = {**body, "metadata": {**body["metadata"], "uid": "theirs"}}
        api.pod_state = "ready"

    swap = asyncio.create_task(replace())
    with pytest.raises(DeployFailed, match="replaced by another pod"):
        await real.deploy(
            scope_id=SCOPE,
            deploy_ver=VER,
            pod_spec=spec(ready_poll_interval=0.02),
            identity=IDENTITY,
        )
    await swap


# --- adopt.lua ---------------------------------------------------------------------------------


POOL = {"min_idle_pods": 0, "max_pods": 2, "pod_ttl": 60, "pod_concurrency": 1}
POD_SPEC = {"image": "agentserver:1", "sse_port": 8080, "sse_path": "/sse"}


async def adopt(state: ResourceState, pod_id: str, *, scope: str = SCOPE, ver: str = VER) -> Any:
    return await PoolJobsState(state).adopt(
        scope_id=scope,
        pod_id=pod_id,
        pod_sse_url=f"http://10.0.0.1:8080/sse#{pod_id}",
        pod_ip="10.0.0.1",
        namespace="default",
        deploy_ver=ver,
    )


def rm(what: str, scope: str = SCOPE) -> str:
    return f"resource_manager:resource:scope:{{{scope}}}:{what}"


async def test_adopt_without_a_pool_config_registers_warm_and_counts_the_budget(
    redis: Redis,
) -> None:
    state = ResourceState(redis, pod_budget=1)
    first = await adopt(state, "agent-a")
    assert (first.action, first.detail) == ("adopted", "unconfigured")
    # the pods exist: past the installation's budget too (it only refuses new deploys)
    assert (await adopt(state, "agent-b")).detail == "unconfigured"
    assert (await adopt(state, "agent-a")).action == "known", "a re-sent call changes nothing"
    assert not await redis.exists(rm("config"))
    assert sorted(await redis.smembers(rm("idle"))) == ["agent-a", "agent-b"]
    assert sorted(await redis.zrange(rm("pods"), 0, -1)) == ["agent-a", "agent-b"]
    info = await redis.hgetall(f"resource_manager:resource:pod:{{{SCOPE}}}:agent-a:info")
    assert info["phase"] == "idle" and info["deploy_ver"] == VER and info["scope_id"] == SCOPE
    assert await redis.exists(f"resource_manager:resource:pod:{{{SCOPE}}}:agent-a:idle_since")
    assert await ResourceViews(state).budget_used() == 2
    assert await PoolJobsState(state).repair_budgets() == BudgetRepair(0, 0), "nothing to fix"


async def test_adopt_with_a_pool_config_keeps_max_pods_the_version_and_the_budgets(
    redis: Redis,
) -> None:
    state = ResourceState(redis, pod_budget=3)
    await state.write_pool_config(SCOPE, POOL, deploy_ver=VER, pod_spec=POD_SPEC)
    assert (await adopt(state, "agent-old", ver="0000000000000000")).action == "old_version"
    assert (await adopt(state, "agent-a")).detail == "configured"
    expired = await DeployState(state).add_placeholder(SCOPE, "dead-deployer", -5)  # already past
    assert expired is not None
    assert (await adopt(state, "agent-b")).detail == "configured", "an expired one holds nothing"
    assert (await adopt(state, "agent-c")).action == "max_reached"
    assert await ResourceViews(state).budget_used() == 2

    other = "fedcba9876543210fedcba9876543210"
    await state.write_pool_config(other, {**POOL, "max_pods": 5}, deploy_ver=VER, pod_spec=POD_SPEC)
    assert (await adopt(state, "agent-d", scope=other)).action == "adopted"
    refused = await adopt(state, "agent-e", scope=other)
    assert (refused.action, refused.detail) == ("budget_reached", "global")
    for pod in ("agent-old", "agent-c", "agent-e"):
        assert not await rm_pod_known(redis, pod)


async def test_adopt_counts_against_the_rule_the_scope_is_linked_to(redis: Redis) -> None:
    state = ResourceState(redis)
    await state.write_pool_config(SCOPE, {**POOL, "max_pods": 5}, deploy_ver=VER, pod_spec=POD_SPEC)
    await state.acquire(SCOPE, "r-link", "tok", 30, rule_id="g/*", rule_pod_budget=2)  # links
    assert (await adopt(state, "agent-a")).action == "adopted"
    views = ResourceViews(state)
    assert await views.budget_used("g/*") == 2, "the acquire's placeholder and the pod"
    refused = await adopt(state, "agent-b")
    assert (refused.action, refused.detail) == ("budget_reached", "rule")


async def test_a_scope_adopted_without_config_moves_its_units_to_its_rule_at_its_next_acquire(
    redis: Redis,
) -> None:
    state = ResourceState(redis)
    await adopt(state, "agent-a")
    await state.write_pool_config(SCOPE, POOL, deploy_ver=VER, pod_spec=POD_SPEC)
    outcome = await state.acquire(SCOPE, "r-1", "tok", 30, rule_id="g/b", rule_pod_budget=4)
    assert (outcome.action, outcome.pod_id) == ("reuse", "agent-a")
    views = ResourceViews(state)
    assert await views.budget_used("g/b") == 1 and await views.budget_used() == 1


# --- foreign_report.lua ------------------------------------------------------------------------


async def test_the_foreign_report_is_replaced_as_a_whole(redis: Redis) -> None:
    state = ResourceState(redis)
    jobs, views = PoolJobsState(state), ResourceViews(state)
    assert await views.foreign_pods() == (0, [])
    pods = {f"default/p{i}": {"pod_id": f"p{i}", "namespace": "default"} for i in range(3)}
    await jobs.report_foreign(7, pods)
    count, listed = await views.foreign_pods()
    assert count == 7 and [p["pod_id"] for p in listed] == ["p0", "p1", "p2"]
    await jobs.report_foreign(7, pods)  # a re-sent call: the same report
    assert await views.foreign_pods() == (count, listed)
    await jobs.report_foreign(1, {"team/q": {"pod_id": "q", "namespace": "team"}})
    assert await views.foreign_pods() == (1, [{"pod_id": "q", "namespace": "team"}])
    await jobs.report_foreign(0, {})
    assert await views.foreign_pods() == (0, []) and await views.foreign_pod_count() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend_name", ["sqlite", "mariadb", "postgresql"])
def test_migration_0003_adds_the_installation_secret_table(
    backend_name: str, tmp_path: Path
) -> None:
    backend = make_sql_backend(backend_name, tmp_path)
    engine = create_engine(backend.url)
    try:
        schema.upgrade(engine, "0002")
        assert "installation_secret" not in inspect(engine).get_table_names()
        schema.upgrade(engine, "0003")
        assert "installation_secret" in inspect(engine).get_table_names()
        with engine.begin() as conn:
            conn.execute(installation_secret.insert().values(name="pod_identity", value="x" * 64))
        schema.downgrade(engine, "0002")
        assert "installation_secret" not in inspect(engine).get_table_names()
        schema.upgrade(engine)
        with engine.connect() as conn:  # a fresh table: the next start generates a new secret
            assert conn.execute(installation_secret.select()).all() == []
    finally:
        engine.dispose()
        backend.cleanup()


def test_both_readings_of_a_pod_carry_what_verify_needs() -> None:
    """The V1Pod path (get, deploy polling) and the raw JSON path (LIST) read the uid, the
    annotations and the image alike, so a pod verifies the same whichever way it was read."""
    pod = our_pod()
    v1 = V1Pod(
        metadata=V1ObjectMeta(
            name=pod.pod_id, namespace=pod.namespace, labels=pod.labels, uid=pod.uid,
            annotations=pod.annotations,
        ),
        spec=V1PodSpec(containers=[V1Container(name="agentserver", image="agentserver:1")]),
    )  # fmt: skip
    from_object = pod_status(v1)
    from_json = pod_status_from_json(as_json(v1))
    assert from_object == from_json
    assert (from_json.uid, from_json.annotations, from_json.image) == (
        pod.uid,
        pod.annotations,
        "agentserver:1",
    )
    assert IDENTITY.verify(from_json).ownership is Ownership.OURS
