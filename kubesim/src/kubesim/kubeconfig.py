"""The kubeconfig the simulator writes for its clients (kubernetes_asyncio, kubectl).

Plain http to the simulator's loopback address; ``token`` auth when the simulator has one,
otherwise an empty user (anonymous). The file is YAML whose strings are written in JSON's
double-quoted form (valid YAML), so no YAML library is needed to write it.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

CONTEXT = "kubesim"


def render_kubeconfig(server: str, *, token: str | None = None, namespace: str = "default") -> str:
    q = json.dumps
    user = f"    token: {q(token)}\n" if token else "    {}\n"
    return (
        "apiVersion: v1\n"
        "kind: Config\n"
        "preferences: {}\n"
        "clusters:\n"
        f"- name: {q(CONTEXT)}\n"
        "  cluster:\n"
        f"    server: {q(server)}\n"
        "contexts:\n"
        f"- name: {q(CONTEXT)}\n"
        "  context:\n"
        f"    cluster: {q(CONTEXT)}\n"
        f"    user: {q(CONTEXT)}\n"
        f"    namespace: {q(namespace)}\n"
        f"current-context: {q(CONTEXT)}\n"
        "users:\n"
        f"- name: {q(CONTEXT)}\n"
        "  user:\n"
        f"{user}"
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    # owner-only: it may hold a token
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)  # readers never see half a file


async def write_kubeconfig(path: Path, server: str, *, token: str | None = None) -> None:
    await asyncio.to_thread(_write, path, render_kubeconfig(server, token=token))
