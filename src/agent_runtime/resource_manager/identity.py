"""Pod identity: which pods provably came from this installation.

Labels prove nothing: anyone who may create pods in the namespace can copy them from any of
our pods (the scope id and deploy_ver are readable there). Ownership is proven by two
annotations, HMAC-SHA256 under the installation's secret:

- ``agent-runtime/identity``, set in the create manifest: binds the namespace, the pod name,
  the scope, the deploy_ver and the SSE port and path (the adoption rebuilds the SSE URL from
  them after a Redis data loss, so they must be signed, not read from a label or the spec).
- ``agent-runtime/incarnation``, patched on right after the create: binds the object's
  ``metadata.uid`` (assigned by the API server, unique per object) to the first. A name is
  reused the moment our pod is gone: a copy of our annotations on a pod re-created under
  that name verifies the first MAC but never the second.

``verify`` gives ``OURS`` (both verify: may be adopted and routed to), ``UNFINISHED`` (the first
only: our create whose signing never finished, e.g. the deployer died in between, or a replay
of a gone pod's name; never routed to, deleted as our orphan) or ``FOREIGN`` (never adopted,
never deleted, reported). Signing uses the current secret; verifying also accepts the
previous ones (rotation). Every comparison is constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent_runtime.config import MIN_POD_SECRET_LENGTH
from agent_runtime.resource_manager.models import PodStatus

IDENTITY_ANNOTATION = "agent-runtime/identity"
INCARNATION_ANNOTATION = "agent-runtime/incarnation"
SSE_PORT_ANNOTATION = "agent-runtime/sse-port"
SSE_PATH_ANNOTATION = "agent-runtime/sse-path"
MAC_VERSION = "v1"
DEFAULT_SSE_PORT = 8080
DEFAULT_SSE_PATH = "/sse"


class Ownership(enum.Enum):
    OURS = "ours"
    UNFINISHED = "unfinished"
    FOREIGN = "foreign"


@dataclass(frozen=True, slots=True)
class Verdict:
    ownership: Ownership
    reason: str  # why not OURS ("" when it is)
    sse_port: int | None = None  # signed: read only when the identity verified
    sse_path: str | None = None

    def sse_url(self, pod_ip: str) -> str:
        assert self.sse_port is not None and self.sse_path is not None
        return f"http://{pod_ip}:{self.sse_port}{self.sse_path}"


def _message(*parts: str) -> bytes:
    # a JSON array: unambiguous whatever the parts hold (an SSE path may contain anything)
    return json.dumps(list(parts), separators=(",", ":")).encode()


def _sse_of(pod_spec: dict[str, Any]) -> tuple[int, str]:
    return int(pod_spec.get("sse_port") or DEFAULT_SSE_PORT), str(
        pod_spec.get("sse_path") or DEFAULT_SSE_PATH
    )


class PodIdentity:
    """Signs the pods this installation creates and tells its own from any other."""

    def __init__(self, secret: str, previous: Iterable[str] = ()) -> None:
        keys = [secret, *(p for p in previous if p and p != secret)]
        if any(len(k) < MIN_POD_SECRET_LENGTH for k in keys):
            raise ValueError(
                f"a pod identity secret has at least {MIN_POD_SECRET_LENGTH} characters"
            )
        self._keys = [k.encode() for k in keys]

    def _mac(self, key: bytes, message: bytes) -> str:
        return f"{MAC_VERSION}:{hmac.new(key, message, hashlib.sha256).hexdigest()}"

    def _matches(self, given: str, message: bytes) -> bool:
        """Whether ``given`` is the MAC of ``message`` under any accepted key (each compared in
        constant time; every key is tried, so the time does not tell which one matched)."""
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(given.encode(), self._mac(key, message).encode())
        return found

    @staticmethod
    def _identity_message(
        *, namespace: str, pod_id: str, scope_id: str, deploy_ver: str, sse_port: int, sse_path: str
    ) -> bytes:
        return _message(
            "agent-runtime/pod", MAC_VERSION, namespace, pod_id, scope_id, deploy_ver,
            str(sse_port), sse_path,
        )  # fmt: skip

    @staticmethod
    def _incarnation_message(uid: str, identity: str) -> bytes:
        return _message("agent-runtime/incarnation", MAC_VERSION, uid, identity)

    def create_annotations(
        self,
        *,
        pod_id: str,
        namespace: str,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
    ) -> dict[str, str]:
        """The annotations of the create manifest (the first MAC and what it covers)."""
        port, path = _sse_of(pod_spec)
        message = self._identity_message(
            namespace=namespace, pod_id=pod_id, scope_id=scope_id, deploy_ver=deploy_ver,
            sse_port=port, sse_path=path,
        )  # fmt: skip
        return {
            IDENTITY_ANNOTATION: self._mac(self._keys[0], message),
            SSE_PORT_ANNOTATION: str(port),
            SSE_PATH_ANNOTATION: path,
        }

    def incarnation_annotations(self, *, uid: str, identity: str) -> dict[str, str]:
        """The annotation patched on after the create: ``uid`` is the one the create (or the
        GET that found our pod after a lost reply) answered, never one read later."""
        message = self._incarnation_message(uid, identity)
        return {INCARNATION_ANNOTATION: self._mac(self._keys[0], message)}

    def completion(self, status: PodStatus) -> dict[str, str]:
        """The incarnation annotation that completes an UNFINISHED pod of ours (its deployer
        died between the create and the patch), for ``status.uid``. Only for a pod whose
        ownership is proven otherwise — the deploy record of a lease we now hold names this
        very uid: signing on the first MAC alone would accept a replay."""
        identity = status.annotations[IDENTITY_ANNOTATION]
        return self.incarnation_annotations(uid=status.uid, identity=identity)

    def verify(self, status: PodStatus) -> Verdict:
        notes = status.annotations
        identity = notes.get(IDENTITY_ANNOTATION)
        scope_id, deploy_ver = status.scope_id, status.deploy_ver
        if not identity:
            return Verdict(Ownership.FOREIGN, "no identity annotation")
        if not scope_id or deploy_ver is None:
            return Verdict(Ownership.FOREIGN, "no scope or deploy-ver label")
        raw_port, path = notes.get(SSE_PORT_ANNOTATION, ""), notes.get(SSE_PATH_ANNOTATION)
        if not raw_port.isdigit() or not 0 < int(raw_port) < 65536 or path is None:
            return Verdict(Ownership.FOREIGN, "no signed SSE port and path")
        port = int(raw_port)
        message = self._identity_message(
            namespace=status.namespace, pod_id=status.pod_id, scope_id=scope_id,
            deploy_ver=deploy_ver, sse_port=port, sse_path=path,
        )  # fmt: skip
        if not self._matches(identity, message):
            return Verdict(Ownership.FOREIGN, "identity does not verify")
        incarnation = notes.get(INCARNATION_ANNOTATION, "")
        if not status.uid or not self._matches(
            incarnation, self._incarnation_message(status.uid, identity)
        ):
            reason = "not signed for this incarnation (uid)"
            return Verdict(Ownership.UNFINISHED, reason, port, path)
        return Verdict(Ownership.OURS, "", port, path)
