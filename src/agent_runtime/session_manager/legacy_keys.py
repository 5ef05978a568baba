"""The session manager's keys as an earlier version named them: what ``agent-runtime redis
migrate`` renames (``key_layout.py`` runs it). The only place that spells a retired key name;
the current names are ``state.py``'s.

Layout 1 (before Redis Cluster, issue 17) put the scope id bare in a key name; layout 2 wraps
it in braces, the Redis Cluster hash tag, so that every key of one scope lives in one slot.
"""

from __future__ import annotations

import re

from agent_runtime.config import SM_KEY_PREFIX as P

# what SCAN looks at (MATCH): every key of this module
SCAN_PATTERN = f"{P}*"

# scope:{sid}:… and pod:{sid}:{pod_id}:… with a bare scope id (a scope id is hex, or any id
# without ':' and braces in tests): the tag goes around it, the rest stays as it was
_SCOPE_BARE = re.compile(rf"^({re.escape(P)}(?:scope|pod):)([^:{{}}]+)(:.+)$")

# pods:{pod_id}:scopes, the SET of the scopes that referenced a pod: gone (a pod belongs to one
# scope, and the resource manager names it when it asks the session side)
_POD_SCOPES = re.compile(rf"^{re.escape(P)}pods:[^{{}}]+:scopes$")


def current_name(key: str) -> str | None:
    """The layout-2 name of a layout-1 key, or None when ``key`` is not one (already
    current, or a key whose name did not change)."""
    match = _SCOPE_BARE.match(key)
    if match is None:
        return None
    head, scope_id, rest = match.groups()
    return f"{head}{{{scope_id}}}{rest}"


def retired(key: str) -> bool:
    """Whether ``key`` is of a name no current version uses: the migration deletes it."""
    return _POD_SCOPES.match(key) is not None
