"""Bearer tokens (contract §2.4): constant-time, and a 401 that never says which token failed."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from agent_runtime.errors import Unauthorized


def check_bearer(authorization: str | None, tokens: Sequence[str]) -> None:
    """Pass when no tokens are configured (open) or the header carries one of them."""
    if not tokens:
        return
    scheme, _, presented = (authorization or "").partition(" ")
    presented_bytes = presented.strip().encode()
    matched = False
    for token in tokens:  # no early exit: the time does not depend on which token matched
        matched |= hmac.compare_digest(presented_bytes, token.encode())
    if scheme.lower() != "bearer" or not matched:
        raise Unauthorized("missing or invalid bearer token")
