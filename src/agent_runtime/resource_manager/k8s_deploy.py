"""A deploy's steps against the Kubernetes API, for ``RealK8sPodClient`` (``k8s_real.py``):
create (a new name on 409, the same name again after a lost reply), the incarnation
signature (a merge patch naming the uid), the wait for Ready, the delete of a failed deploy's
pod; the deadline they share and the reading of API errors (status, text, ``Retry-After``,
whether another try is worth it).

Each step takes a ``DeployJob`` (or the API and a ``Deadline``) and is bounded by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import random
from typing import Any

import aiohttp

from agent_runtime.resource_manager.identity import IDENTITY_ANNOTATION, PodIdentity
from agent_runtime.resource_manager.models import DeployFailed, PodGone
from agent_runtime.resource_manager.pod_manifest import build_pod_body, new_pod_name
from agent_runtime.resource_manager.pod_reading import pod_status

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # cap of one API call; a deploy's own deadline may cut it shorter
DISCARD_TIMEOUT = 5.0  # best-effort delete after a failed deploy
CREATE_NAME_TRIES = 3  # 409 AlreadyExists → a new name, this many names in all
BACKOFF_BASE = 0.2
BACKOFF_CAP = 5.0
MERGE_PATCH = "application/merge-patch+json"

# Transport failures: the request may or may not have reached the API server.
LOST_REPLY = (TimeoutError, aiohttp.ClientError)

# kubernetes_asyncio is imported where used: it costs ~0.6 s and local mode never needs it.


def api_status(exc: BaseException) -> int | None:
    from kubernetes_asyncio.client.exceptions import ApiException

    return exc.status if isinstance(exc, ApiException) else None


def api_error_text(exc: BaseException) -> str:
    """``403 Forbidden: pods is forbidden: …`` — status, reason and the API server's message."""
    from kubernetes_asyncio.client.exceptions import ApiException

    if not isinstance(exc, ApiException):
        return f"{type(exc).__name__}: {exc}".rstrip(": ")
    text = f"{exc.status} {exc.reason or ''}".rstrip()
    with contextlib.suppress(Exception):
        message = json.loads(exc.body or "{}").get("message")
        if message:
            text += f": {str(message)[:300]}"
    return text


def retry_after(exc: BaseException) -> float | None:
    """The ``Retry-After`` header in seconds (the delta form; an HTTP date is ignored)."""
    headers = getattr(exc, "headers", None)
    if not headers:
        return None
    with contextlib.suppress(TypeError, ValueError):
        seconds = float(headers.get("Retry-After"))
        if math.isfinite(seconds):
            return max(seconds, 0.0)
    return None


def retryable(exc: BaseException) -> bool:
    """429, 5xx and lost replies are worth another try; any other refusal is final."""
    status = api_status(exc)
    if status is None:
        return isinstance(exc, LOST_REPLY)
    return status == 429 or status >= 500


class Deadline:
    """A monotonic deadline shared by every step of one deploy."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = asyncio.get_running_loop().time() + seconds

    def remaining(self) -> float:
        return self._at - asyncio.get_running_loop().time()

    def call_timeout(self) -> float:
        return max(min(self.remaining(), REQUEST_TIMEOUT), 0.0)


@dataclasses.dataclass
class DeployJob:
    """One deploy's inputs, and ``sent``: the names whose create may have landed (so a failed
    or cancelled deploy deletes them)."""

    api: Any
    namespace: str
    scope_id: str
    deploy_ver: str
    pod_spec: dict[str, Any]
    deadline: Deadline
    identity: PodIdentity | None  # None: a wait for an existing pod, which creates none
    sent: set[str] = dataclasses.field(default_factory=set)

    def body(self) -> dict[str, Any]:
        """A new name's manifest, signed for that name."""
        assert self.identity is not None
        name = new_pod_name(self.pod_spec.get("pod_name"))
        notes = self.identity.create_annotations(
            pod_id=name, namespace=self.namespace, scope_id=self.scope_id,
            deploy_ver=self.deploy_ver, pod_spec=self.pod_spec,
        )  # fmt: skip
        return build_pod_body(name, self.scope_id, self.deploy_ver, self.pod_spec, notes)


async def create(job: DeployJob) -> tuple[str, str, str]:
    """Create the pod; its name, the uid the API server gave it and its identity MAC.

    409 → a new name (3 names in all). 429 / 5xx / a lost reply → the same name again
    after a backoff, so a create that did land shows up as our own pod (GET, or the next
    create's 409) instead of an orphan. A 409 for a name whose earlier create may have
    landed, while the GET cannot tell whose pod it is, keeps the name and asks again
    (moving on would leave our own pod behind). Any other refusal is final.
    """
    names_tried = attempt = 0
    body: dict[str, Any] | None = None
    maybe_landed = False  # an earlier create of this name may have been applied
    while True:  # ends by return, by raise, or at the deadline
        if body is None:
            names_tried += 1
            if names_tried > CREATE_NAME_TRIES:
                raise DeployFailed(f"pod name taken {CREATE_NAME_TRIES} times in {job.namespace}")
            body = job.body()
            maybe_landed = False
        name = body["metadata"]["name"]
        signature = body["metadata"]["annotations"][IDENTITY_ANNOTATION]
        what = f"create pod {job.namespace}/{name}"
        if job.deadline.remaining() <= 0:
            raise DeployFailed(f"{what}: no time left")
        job.sent.add(name)
        try:
            async with asyncio.timeout(job.deadline.call_timeout()):
                created = await job.api.create_namespaced_pod(job.namespace, body)
            return name, uid_of(created, what), signature
        except DeployFailed:
            raise
        except Exception as exc:
            error = exc
        status = api_status(error)
        if status == 409:
            owner, uid = await is_ours(job, name, signature)
            if owner is True:
                return name, uid, signature
            if owner is None and maybe_landed:  # likely ours: keep it, ask again
                await backoff(attempt, error, job.deadline, what)
                attempt += 1
                continue
            job.sent.discard(name)  # another pod's name: never ours to delete
            body = None
            continue
        if not retryable(error):
            job.sent.discard(name)
            raise DeployFailed(f"{what} refused: {api_error_text(error)}") from error
        if status != 429:  # a 429 is refused before anything is applied
            maybe_landed = True
            owner, uid = await is_ours(job, name, signature)
            if owner:
                return name, uid, signature
        await backoff(attempt, error, job.deadline, what)
        attempt += 1


def uid_of(created: Any, what: str) -> str:
    uid = pod_status(created).uid
    if not uid:  # nothing to bind the signature to; the name is deleted by the caller
        raise DeployFailed(f"{what}: the reply carries no metadata.uid")
    return uid


async def is_ours(job: DeployJob, name: str, signature: str) -> tuple[bool | None, str]:
    """Whether ``name`` exists with our labels and the identity MAC we sent (a create that
    landed), and its uid: True, False (another pod, or none: 404), or None when the GET
    failed too (unknown).

    Unknown never counts as ours; the name stays in ``job.sent``, so a failed deploy
    still deletes it.
    """
    if job.deadline.remaining() <= 0:
        return None, ""
    try:
        async with asyncio.timeout(job.deadline.call_timeout()):
            found = pod_status(await job.api.read_namespaced_pod(name, job.namespace))
    except Exception as exc:
        log.debug("get pod %s/%s after a failed create: %s", job.namespace, name, exc)
        return (False if api_status(exc) == 404 else None), ""
    ours = (
        found.scope_id == job.scope_id
        and found.deploy_ver == job.deploy_ver
        and hmac.compare_digest(
            found.annotations.get(IDENTITY_ANNOTATION, "").encode(), signature.encode()
        )
        and bool(found.uid)
    )
    return ours, found.uid


async def sign_created(job: DeployJob, name: str, uid: str, signature: str) -> None:
    """Patch the incarnation MAC onto the pod we just created."""
    assert job.identity is not None
    notes = job.identity.incarnation_annotations(uid=uid, identity=signature)
    await patch_incarnation(job.api, job.namespace, name, uid, notes, job.deadline)


async def patch_incarnation(
    api: Any,
    namespace: str,
    name: str,
    uid: str,
    notes: dict[str, str],
    deadline: Deadline,
) -> None:
    """A JSON merge patch of ``notes`` (re-sent as is after a lost reply). The patch names
    the uid: should the name hold another incarnation by now, the API server refuses (the
    uid is immutable) instead of us signing that one."""
    patch = {"metadata": {"uid": uid, "annotations": notes}}
    what = f"sign pod {namespace}/{name}"
    attempt = 0
    while True:
        if deadline.remaining() <= 0:
            raise DeployFailed(f"{what}: no time left")
        try:
            async with asyncio.timeout(deadline.call_timeout()):
                await api.patch_namespaced_pod(name, namespace, patch, _content_type=MERGE_PATCH)
            return
        except Exception as exc:
            error = exc
        status = api_status(error)
        if status == 404:
            raise PodGone(f"pod {namespace}/{name} disappeared") from error
        if status in (409, 422):  # the uid named is not the name's: another incarnation
            raise PodGone(f"{what}: another pod holds the name now") from error
        if not retryable(error):
            hint = " (the service account needs `patch` on pods)" if status == 403 else ""
            raise DeployFailed(f"{what} refused: {api_error_text(error)}{hint}") from error
        await backoff(attempt, error, deadline, what)
        attempt += 1


async def backoff(attempt: int, error: BaseException, deadline: Deadline, what: str) -> None:
    """Sleep ``Retry-After`` or a capped exponential delay; fail now if it would pass the
    deadline (no point sleeping into a certain timeout)."""
    delay = retry_after(error)
    if delay is None:
        delay = min(BACKOFF_BASE * 2**attempt, BACKOFF_CAP) * random.uniform(0.5, 1.0)
    if delay >= deadline.remaining():
        raise DeployFailed(f"{what}: {api_error_text(error)} (no time left to retry)")
    log.warning("%s: %s; retry in %.2fs", what, api_error_text(error), delay)
    await asyncio.sleep(delay)


async def wait_ready(job: DeployJob, name: str, uid: str, poll: float) -> str:
    """Poll until Ready with an IP; dead, gone or replaced (another uid under the name)
    fails at once, a GET hiccup waits."""
    where = f"pod {job.namespace}/{name}"
    last = "unknown"
    while True:
        try:
            async with asyncio.timeout(job.deadline.call_timeout()):
                found = pod_status(await job.api.read_namespaced_pod(name, job.namespace))
        except Exception as exc:
            if api_status(exc) == 404:
                raise PodGone(f"{where} disappeared") from exc
            if not retryable(exc):
                raise DeployFailed(f"{where}: get refused: {api_error_text(exc)}") from exc
            last = f"get failed: {api_error_text(exc)}"
        else:
            if found.uid != uid:
                raise DeployFailed(f"{where} was replaced by another pod of that name")
            if found.dead:
                raise DeployFailed(f"{where} is {found.phase}")
            if found.ready and found.pod_ip:
                return found.pod_ip
            last = found.phase
        remaining = job.deadline.remaining()
        if remaining <= 0:
            raise DeployFailed(f"{where} not Ready within {job.deadline.seconds:g}s (last: {last})")
        await asyncio.sleep(min(poll, remaining))


async def discard(api: Any, name: str, namespace: str) -> None:
    """Delete a failed deploy's pod at once (grace 0). Best effort: reconcile catches a miss."""
    try:
        async with asyncio.timeout(DISCARD_TIMEOUT):
            await api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except Exception as exc:
        if api_status(exc) != 404:
            log.warning("delete of failed pod %s/%s: %s", namespace, name, exc)
