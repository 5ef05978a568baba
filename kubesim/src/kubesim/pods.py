"""Pod objects: what the API server admits and defaults on create, and what a PATCH may change
(the shapes of core/v1 ``Pod``). The status changes the scheduler and kubelet write are
``pod_status``'s."""

from __future__ import annotations

import random
import re
from typing import Any

from kubesim.errors import bad_request, conflict, invalid
from kubesim.labels import (
    dns1123_label_errors,
    dns1123_subdomain_errors,
    label_value_errors,
    qualified_name_errors,
)
from kubesim.store import Obj, new_uid, timestamp

# apimachinery's generateName suffix: 5 characters of an alphabet without vowels or look-alikes
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_GENERATE_SUFFIX = 5
_GENERATE_PREFIX_MAX = 63 - _GENERATE_SUFFIX
ANNOTATIONS_MAX_BYTES = 256 * 1024  # apimachinery's TotalAnnotationSizeLimitB
# what a PATCH may change here (the real server lets a pod's image and a few more change too)
PATCHABLE = ("labels", "annotations")


# --- admission: validation and defaults of a create ---------------------------------------------


def admit(namespace: str, body: Any, rng: random.Random) -> Obj:
    """The pod to store for ``POST .../namespaces/{namespace}/pods``, or ``ApiError``
    (400 for a body that is not a Pod, 422 Invalid with causes for bad fields)."""
    if not isinstance(body, dict):
        raise bad_request("the body of the request was in an unknown format")
    kind, version = body.get("kind"), body.get("apiVersion")
    if kind not in (None, "Pod") or version not in (None, "v1"):
        raise bad_request(f'{kind} in version "{version}" cannot be handled as a Pod')
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict | None):
        raise bad_request('Pod in version "v1" cannot be handled as a Pod: bad metadata or spec')
    if meta.get("namespace") not in (None, "", namespace):
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    if meta.get("resourceVersion"):
        raise bad_request("resourceVersion should not be set on objects to be created")
    name = str(meta.get("name") or "")
    generate = meta.get("generateName")
    if not name and isinstance(generate, str) and generate:
        suffix = "".join(rng.choice(_GENERATE_ALPHABET) for _ in range(_GENERATE_SUFFIX))
        name = generate[:_GENERATE_PREFIX_MAX] + suffix
    causes = _validate(name, meta, spec or {})
    if causes:
        raise invalid("Pod", name, causes)
    return _defaulted(namespace, name, meta, spec or {})


Cause = tuple[str, str, str]


def _invalid_value(field: str, value: Any, message: str) -> Cause:
    shown = f'"{value}"' if isinstance(value, str) else repr(value)
    return field, "FieldValueInvalid", f"{field}: Invalid value: {shown}: {message}"


def _required(field: str, why: str = "") -> Cause:
    return field, "FieldValueRequired", f"{field}: Required value{': ' + why if why else ''}"


def _validate(name: str, meta: dict[str, Any], spec: dict[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    if not name:
        causes.append(_required("metadata.name", "name or generateName is required"))
    for message in dns1123_subdomain_errors(name) if name else []:
        causes.append(_invalid_value("metadata.name", name, message))
    causes += meta_map_causes(meta)
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        causes.append(_required("spec.containers"))
        return causes
    seen: set[str] = set()
    for i, container in enumerate(containers):
        where = f"spec.containers[{i}]"
        if not isinstance(container, dict):
            causes.append(_invalid_value(where, str(container), "must be an object"))
            continue
        cname = container.get("name")
        if not cname:
            causes.append(_required(f"{where}.name"))
        else:
            for message in dns1123_label_errors(str(cname)):
                causes.append(_invalid_value(f"{where}.name", cname, message))
            if cname in seen:
                causes.append(
                    (
                        f"{where}.name",
                        "FieldValueDuplicate",
                        f'{where}.name: Duplicate value: "{cname}"',
                    )
                )
            seen.add(str(cname))
        if not container.get("image"):
            causes.append(_required(f"{where}.image"))
        causes += _env_causes(where, container.get("env"))
        for j, port in enumerate(container.get("ports") or []):
            number = port.get("containerPort") if isinstance(port, dict) else None
            if not isinstance(number, int) or not 1 <= number <= 65535:
                causes.append(
                    _invalid_value(
                        f"{where}.ports[{j}].containerPort",
                        number,
                        "must be between 1 and 65535, inclusive",
                    )
                )
    return causes


def meta_map_causes(meta: dict[str, Any]) -> list[Cause]:
    """The API server's checks of ``metadata.labels`` and ``metadata.annotations`` (keys are
    qualified names; label values label values; annotations any string, 256 KiB in all)."""
    causes: list[Cause] = []
    for kind in ("labels", "annotations"):
        field = f"metadata.{kind}"
        entries = meta.get(kind) or {}
        if not isinstance(entries, dict):
            causes.append(_invalid_value(field, str(entries), "must be a map"))
            continue
        for key, value in entries.items():
            for message in qualified_name_errors(str(key)):
                causes.append(_invalid_value(field, key, message))
            if not isinstance(value, str):
                causes.append(_invalid_value(field, str(value), "must be a string"))
            elif kind == "labels":
                for message in label_value_errors(value):
                    causes.append(_invalid_value(field, value, message))
        if kind == "annotations":
            size = sum(len(str(k)) + len(str(v)) for k, v in entries.items())
            if size > ANNOTATIONS_MAX_BYTES:
                causes.append(
                    (field, "FieldValueTooLong",
                     f"{field}: Too long: must have at most {ANNOTATIONS_MAX_BYTES} bytes")
                )  # fmt: skip
    return causes


_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_VALUE_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")


def _env_causes(where: str, env: Any) -> list[Cause]:
    """The API server's env checks: a valid name, ``value`` or ``valueFrom`` (not both), one
    source in ``valueFrom``, and for ``secretKeyRef`` a Secret name and a key it can hold."""
    if env is None:
        return []
    if not isinstance(env, list):
        return [_invalid_value(f"{where}.env", str(env), "must be a list")]
    causes: list[Cause] = []
    for k, var in enumerate(env):
        at = f"{where}.env[{k}]"
        if not isinstance(var, dict):
            causes.append(_invalid_value(at, str(var), "must be an object"))
            continue
        name = var.get("name")
        if not name:
            causes.append(_required(f"{at}.name"))
        elif not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            causes.append(
                _invalid_value(f"{at}.name", name, "a valid environment variable name must "
                "consist of alphabetic characters, digits, '_', '-', or '.', and must not "
                "start with a digit")
            )  # fmt: skip
        source = var.get("valueFrom")
        if source is None:
            if not isinstance(var.get("value", ""), str):
                causes.append(_invalid_value(f"{at}.value", var.get("value"), "must be a string"))
            continue
        if var.get("value"):
            causes.append(
                _invalid_value(
                    f"{at}.valueFrom", "", "may not be specified when `value` is not empty"
                )
            )  # fmt: skip
        given = [s for s in _VALUE_SOURCES if isinstance(source, dict) and source.get(s)]
        if len(given) != 1:
            causes.append(
                _invalid_value(f"{at}.valueFrom", "", "must specify exactly one of: "
                "`fieldRef`, `resourceFieldRef`, `configMapKeyRef` or `secretKeyRef`")
            )  # fmt: skip
            continue
        if given[0] != "secretKeyRef":
            continue
        ref = source["secretKeyRef"]
        ref_at = f"{at}.valueFrom.secretKeyRef"
        if not isinstance(ref, dict):
            causes.append(_invalid_value(ref_at, str(ref), "must be an object"))
            continue
        secret, key = ref.get("name"), ref.get("key")
        if not secret:
            causes.append(_required(f"{ref_at}.name"))
        else:
            for message in dns1123_subdomain_errors(str(secret)):
                causes.append(_invalid_value(f"{ref_at}.name", secret, message))
        if not key:
            causes.append(_required(f"{ref_at}.key"))
        elif not isinstance(key, str) or len(key) > 253 or not _CONFIG_KEY.fullmatch(key):
            causes.append(
                _invalid_value(f"{ref_at}.key", key, "a valid config key must consist of "
                "alphanumeric characters, '-', '_' or '.'")
            )  # fmt: skip
        if not isinstance(ref.get("optional", False), bool):
            causes.append(_invalid_value(f"{ref_at}.optional", ref.get("optional"), "a bool"))
    return causes


def _pull_policy(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def _defaulted_container(container: dict[str, Any]) -> dict[str, Any]:
    out = dict(container)
    out.setdefault("imagePullPolicy", _pull_policy(str(out["image"])))
    out.setdefault("terminationMessagePath", "/dev/termination-log")
    out.setdefault("terminationMessagePolicy", "File")
    resources = dict(out.get("resources") or {})
    limits = resources.get("limits") or {}
    if limits:  # requests default to the limits
        resources["requests"] = {**limits, **(resources.get("requests") or {})}
    out["resources"] = resources
    out["ports"] = [{**p, "protocol": p.get("protocol") or "TCP"} for p in out.get("ports") or []]
    if not out["ports"]:
        del out["ports"]
    probe = out.get("readinessProbe")
    if isinstance(probe, dict):
        defaults = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1}
        out["readinessProbe"] = {**defaults, "failureThreshold": 3, **probe}
        if isinstance(probe.get("httpGet"), dict):
            out["readinessProbe"]["httpGet"] = {"scheme": "HTTP", **probe["httpGet"]}
    return out


def _qos(containers: list[dict[str, Any]]) -> str:
    requests = [c["resources"].get("requests") or {} for c in containers]
    limits = [c["resources"].get("limits") or {} for c in containers]
    if not any(requests) and not any(limits):
        return "BestEffort"
    guaranteed = all(
        set(lim) >= {"cpu", "memory"} and req == lim
        for req, lim in zip(requests, limits, strict=True)
    )
    return "Guaranteed" if guaranteed else "Burstable"


def _defaulted(namespace: str, name: str, meta: dict[str, Any], spec: dict[str, Any]) -> Obj:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": new_uid(),
        "creationTimestamp": timestamp(),
    }
    for key in ("generateName", "labels", "annotations", "ownerReferences", "finalizers"):
        if meta.get(key):
            metadata[key] = meta[key]
    containers = [_defaulted_container(c) for c in spec["containers"]]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": [
            {
                "key": f"node.kubernetes.io/{taint}",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            }
            for taint in ("not-ready", "unreachable")
        ],
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
        **{k: v for k, v in spec.items() if k != "containers"},
        "containers": containers,
    }
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": pod_spec,
        "status": {"phase": "Pending", "qosClass": _qos(containers)},
    }


# --- PATCH: a JSON merge patch (and a strategic one, which reads the same for two maps) ---------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def patched(pod: Obj, patch: Any) -> Obj:
    """``pod`` after ``patch``, or ``ApiError``: 400 for a body that is no object, 409 for a
    stale ``resourceVersion``, 422 for an immutable field changed (``uid``: a client that
    names the incarnation it means is refused for any other) or for anything kubesim does not
    let change (only ``metadata.labels`` and ``metadata.annotations``), or bad labels."""
    if not isinstance(patch, dict):
        raise bad_request("the body of the request was in an unknown format")
    old = pod["metadata"]
    name = old["name"]
    given = patch.get("metadata")
    version = given.get("resourceVersion") if isinstance(given, dict) else None
    if version is not None and version != old.get("resourceVersion"):
        raise conflict("pods", name)
    result = merge_patch(pod, patch)
    meta = result.get("metadata") if isinstance(result.get("metadata"), dict) else {}
    causes = [
        _invalid_value(f"metadata.{field}", meta.get(field), "field is immutable")
        for field in ("name", "namespace", "uid", "creationTimestamp")
        if meta.get(field) != old.get(field)
    ]
    if not causes:
        kept = {k: v for k, v in meta.items() if k not in (*PATCHABLE, "resourceVersion")}
        before = {k: v for k, v in old.items() if k not in (*PATCHABLE, "resourceVersion")}
        others = {k: v for k, v in result.items() if k != "metadata"}
        if kept != before or others != {k: v for k, v in pod.items() if k != "metadata"}:
            causes.append(
                ("spec", "FieldValueForbidden",
                 "Forbidden: kubesim lets a patch change metadata.labels and "
                 "metadata.annotations only")
            )  # fmt: skip
    causes += meta_map_causes(meta)
    if causes:
        raise invalid("Pod", name, causes)
    result["metadata"] = {**meta, "resourceVersion": old.get("resourceVersion")}
    for kind in PATCHABLE:
        if not result["metadata"].get(kind):
            result["metadata"].pop(kind, None)
    return result
