"""Secrets the installation makes for itself and keeps in the config DB.

Hazard: replicas start at once. ``ensure_secret`` inserts a candidate only if the name is
absent and then reads back whatever row won (the primary key makes the insert race-free on
every backend: the loser's insert fails, its read sees the winner's value), so all replicas
end up with one value. The DB outlives Redis: a Redis data loss keeps the secret.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable

from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError

from agent_runtime.db.engine import Database
from agent_runtime.db.tables import installation_secret

POD_IDENTITY_SECRET = "pod_identity"


def _read(name: str) -> Callable[[Connection], str | None]:
    def read(conn: Connection) -> str | None:
        query = select(installation_secret.c.value).where(installation_secret.c.name == name)
        value = conn.execute(query).scalar_one_or_none()
        return None if value is None else str(value)

    return read


async def stored_secret(db: Database, name: str) -> str | None:
    """The stored value, or None (never generated)."""
    return await db.read(_read(name))


async def ensure_secret(db: Database, name: str) -> str:
    """The stored value; generated (32 random bytes, hex) on the first call anywhere."""
    found = await stored_secret(db, name)
    if found is not None:
        return found
    candidate = secrets.token_hex(32)

    def insert(conn: Connection) -> None:
        conn.execute(installation_secret.insert().values(name=name, value=candidate))

    with contextlib.suppress(IntegrityError):  # another replica inserted first: its value wins
        await db.write(insert)
    found = await stored_secret(db, name)
    if found is None:  # deleted by hand right between the two calls
        raise RuntimeError(f"installation secret {name!r} vanished after it was written")
    return found
