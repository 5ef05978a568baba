"""routing_rule.pod_budget: the pods a rule's scopes may have together (NULL = the default).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable, no default: every existing rule keeps the behaviour of "no pod_budget of its own"
    op.add_column("routing_rule", sa.Column("pod_budget", sa.Integer, nullable=True))


def downgrade() -> None:
    op.drop_column("routing_rule", "pod_budget")
