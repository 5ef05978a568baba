"""service_config_template.warm_pool: how a template's warm pool is sized.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a server default: every existing template keeps today's static floor (min_idle_pods)
    op.add_column(
        "service_config_template",
        sa.Column("warm_pool", sa.String(16), nullable=False, server_default="static"),
    )


def downgrade() -> None:
    op.drop_column("service_config_template", "warm_pool")
