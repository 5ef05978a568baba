"""The clusters a template may name: kubeconfig files the operator lists at startup
(``AGENT_RUNTIME_CLUSTERS``), read and checked once, before the service serves.

A template's ``kubeconfig`` field holds one of these names, never a path: a path let a template
make the service read any local file (the loader's error was a file oracle) and run the
``exec`` plugin of any kubeconfig it could point at.

Hazard: a kubeconfig ``exec`` entry, and the ``auth-provider`` ones (gcp runs its ``cmd-path``,
oidc refreshes over the network), run when the loader reads the file. They are refused here,
before any loader sees the file, unless ``AGENT_RUNTIME_CLUSTERS_ALLOW_EXEC`` names the
cluster. The process default (``AGENT_RUNTIME_KUBECONFIG``, in-cluster first) is not a cluster
of this list and is not checked: the operator chose it for the process itself.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent_runtime.config import ConfigError

MAX_KUBECONFIG_BYTES = 1 << 20  # a kubeconfig is a few KiB; more is not one
_RUNS_CODE = ("exec", "auth-provider")


@dataclass(frozen=True)
class ClusterConfig:
    """One named cluster: its kubeconfig, parsed (the file is never read again)."""

    name: str
    path: str
    kubeconfig: dict[str, Any]

    def loader_input(self) -> dict[str, Any]:
        """A copy for kubernetes_asyncio's loader (which may write into what it is given)."""
        return copy.deepcopy(self.kubeconfig)


def read_clusters(
    clusters: Mapping[str, str], allow_exec: Collection[str]
) -> dict[str, ClusterConfig]:
    """Each cluster's kubeconfig read, parsed and checked; ``ConfigError`` (one line) for a
    file that cannot be read, is not a kubeconfig, or has an entry that runs code while its
    cluster is not allowed to. Blocking: call it at startup, before serving."""
    unknown = sorted(set(allow_exec) - set(clusters))
    if unknown:
        raise ConfigError(
            f"AGENT_RUNTIME_CLUSTERS_ALLOW_EXEC names {unknown[0]!r}, "
            "which AGENT_RUNTIME_CLUSTERS does not configure"
        )
    return {
        name: ClusterConfig(name, path, _read(name, path, allowed=name in allow_exec))
        for name, path in clusters.items()
    }


def _read(name: str, path: str, *, allowed: bool) -> dict[str, Any]:
    where = f"cluster {name!r}: kubeconfig {path}"
    try:
        with Path(path).open("rb") as handle:
            raw = handle.read(MAX_KUBECONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_KUBECONFIG_BYTES:
        raise ConfigError(f"{where} is over {MAX_KUBECONFIG_BYTES} bytes")
    try:
        parsed = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{where} is not YAML: {reason}") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("current-context"), str):
        raise ConfigError(f"{where} is not a kubeconfig (no current-context)")
    for entry in parsed.get("users") or []:
        user = entry.get("user") if isinstance(entry, dict) else None
        if not isinstance(user, dict):
            continue
        runs = [key for key in _RUNS_CODE if key in user]
        if runs and not allowed:
            who = entry.get("name")
            raise ConfigError(
                f"{where}: user {who!r} has an {runs[0]!r} entry, which runs a program in the "
                f"service; refused (allow it with AGENT_RUNTIME_CLUSTERS_ALLOW_EXEC={name})"
            )
    return parsed


def template_cluster(pod_spec: Mapping[str, Any]) -> str | None:
    """The cluster a template's new pods go to: the name in its ``kubeconfig`` field, None for
    the process default. A pod keeps the cluster it was created in (recorded with it in Redis):
    a template that changes ``kubeconfig`` moves no running pod."""
    return pod_spec.get("kubeconfig") or None
