"""kubesim: a Kubernetes API simulator for testing ``RealK8sPodClient`` without a cluster.

It speaks the core/v1 pods subset over HTTP with the real API's shapes and ``Status`` errors, runs
a simulated kubelet that gives each pod its own loopback IP and a real little AgentServer, and
takes faults through a control endpoint. A stand-in for Kubernetes, not part of the service: its
own distribution (``agent-runtime-kubesim``, ``kubesim/`` in the repository), and it imports
nothing of ``agent_runtime`` (checked by ``lint-imports``). Spec: ``docs/spec/kubesim.md``.

``KubeSim``, ``Faults`` and ``Fault`` are loaded on first use, so the CLI can build its parser
without importing aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubesim.faults import Fault, Faults
    from kubesim.sim import KubeSim

__all__ = ["Fault", "Faults", "KubeSim"]


def __getattr__(name: str) -> Any:
    if name == "KubeSim":
        from kubesim.sim import KubeSim

        return KubeSim
    if name in ("Fault", "Faults"):
        from kubesim import faults

        return getattr(faults, name)
    raise AttributeError(name)
