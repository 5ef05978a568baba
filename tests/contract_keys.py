"""The contract's Redis key names (docs/reference/redis-keys.md), spelled out literally.

Tests that look at Redis directly name keys through these, never through the service's own
``state`` modules: a renamed key in the code must fail a test, not follow it silently. One
argument order everywhere: the scope first, then the pod, then the part. A scope id in a key
name is the key's Redis Cluster hash tag: it is written in braces (``scope:{<sid>}:pods``).
"""

from __future__ import annotations

RM_PODS_ALL = "resource_manager:resource:pods:all"


def sm_session(scope_id: str, session_id: str) -> str:
    """A session's hash, in its scope."""
    return f"session_manager:session:{{{scope_id}}}:{session_id}"


def sm_session_scope(session_id: str) -> str:
    """The session-scope index (a hint: session id → the scope it was last bound in)."""
    return f"session_manager:session_scope:{session_id}"


def sm_expiry(scope_id: str) -> str:
    """The scope's sessions by expiry."""
    return sm_scope(scope_id, "session_expiry")


def sm_pods_registered(scope_id: str) -> str:
    """The pods registered in the scope (pod ids)."""
    return f"session_manager:pods:{{{scope_id}}}:registered"


def sm_touch(scope_id: str, request_id: str) -> str:
    return f"session_manager:touch:{{{scope_id}}}:{request_id}"


def sm_bucket(index: str, bucket: int) -> str:
    """expiry_due | leased_scopes | scope_registry | scope_idle: a bucket of an index over
    scopes (``{b00}`` … ``{b63}``)."""
    return f"session_manager:{index}:{{b{bucket:02d}}}"


def sm_scope(scope_id: str, what: str) -> str:
    """sessions | session_expiry | pods | pod_seq | config | waiters | reserved | arrivals"""
    return f"session_manager:scope:{{{scope_id}}}:{what}"


def sm_pod(scope_id: str, pod_id: str, what: str) -> str:
    """sessions | info | idle_notified"""
    return f"session_manager:pod:{{{scope_id}}}:{pod_id}:{what}"


def route_marker(scope_id: str, request_id: str) -> str:
    return f"session_manager:route:{{{scope_id}}}:{request_id}"


def rm_scope(scope_id: str, what: str) -> str:
    """pods | idle | config | deploying | cold_deploys | deploy_followers:{deploy id} |
    deploy_pod:{deploy id}"""
    return f"resource_manager:resource:scope:{{{scope_id}}}:{what}"


def rm_pod(pod_id: str, what: str) -> str:
    """info | idle_since | health_fails"""
    return f"resource_manager:resource:pod:{pod_id}:{what}"


def rm_deploy_lock(scope_id: str, deploy_id: str) -> str:
    """One cold deploy's lock (a scope runs many: helpers.deploy_locks reads them all)."""
    return f"resource_manager:lock:rm:deploy:{{{scope_id}}}:{deploy_id}"
