"""The resource manager's keys as an earlier version named them: what ``agent-runtime redis
migrate`` renames (``key_layout.py`` runs it). The only place that spells a retired key name;
the current names are ``state.py``'s.

Layout 1 (before Redis Cluster, issue 17) put the scope id bare in a key name; layout 2 wraps
it in braces, the Redis Cluster hash tag, so that every key of one scope lives in one slot.
"""

from __future__ import annotations

import re

from agent_runtime.config import RM_KEY_PREFIX as P

SCAN_PATTERN = f"{P}*"

# resource:scope:{sid}:… and lock:rm:deploy:{sid}:{deploy_id} with a bare scope id
_SCOPE_BARE = re.compile(rf"^({re.escape(P)}(?:resource:scope|lock:rm:deploy):)([^:{{}}]+)(:.+)$")


def current_name(key: str) -> str | None:
    """The layout-2 name of a layout-1 key, or None when ``key`` is not one."""
    match = _SCOPE_BARE.match(key)
    if match is None:
        return None
    head, scope_id, rest = match.groups()
    return f"{head}{{{scope_id}}}{rest}"


def retired(key: str) -> bool:
    """Whether ``key`` is of a name no current version uses (the migration deletes it): none
    of this module's earlier names is retired."""
    return False
