"""Alembic environment: the engine comes from the caller (``schema.upgrade``), never from a file."""

from __future__ import annotations

from alembic import context

from agent_runtime.db.tables import metadata

engine = context.config.attributes["engine"]

with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
