"""Initial schema: service_config_template and routing_rule (legacy column names).

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from agent_runtime.db.tables import id_column_type

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "service_config_template",
        sa.Column("template_id", id_column_type(), primary_key=True),
        sa.Column("enabled", sa.Boolean, nullable=False),
        sa.Column("image", sa.String(1024), nullable=False),
        sa.Column("pod_name", sa.String(63), nullable=False),
        sa.Column("namespace", sa.String(63), nullable=True),
        sa.Column("container_port", sa.Integer, nullable=False),
        sa.Column("sse_port", sa.Integer, nullable=False),
        sa.Column("sse_path", sa.String(256), nullable=False),
        sa.Column("cpu_request", sa.String(32), nullable=True),
        sa.Column("cpu_limit", sa.String(32), nullable=True),
        sa.Column("memory_request", sa.String(32), nullable=True),
        sa.Column("memory_limit", sa.String(32), nullable=True),
        sa.Column("env", sa.Text, nullable=False),
        sa.Column("nfs_server", sa.String(1024), nullable=True),
        sa.Column("nfs_path", sa.String(1024), nullable=True),
        sa.Column("nfs_mount_path", sa.String(1024), nullable=True),
        sa.Column("ready_timeout", sa.Float, nullable=False),
        sa.Column("ready_poll_interval", sa.Float, nullable=False),
        sa.Column("kubeconfig", sa.Text, nullable=True),
        sa.Column("session_concurrency", sa.Integer, nullable=False),
        sa.Column("service_concurrency", sa.Integer, nullable=False),
        sa.Column("session_ttl", sa.Integer, nullable=False),
        sa.Column("service_ttl", sa.Integer, nullable=False),
        sa.Column("min_idle_services", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime, nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "routing_rule",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("group_id", id_column_type(), nullable=False),
        sa.Column("bot_id", id_column_type(), nullable=False),
        sa.Column("template_id", id_column_type(), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime, nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("group_id", "bot_id", name="uq_routing_rule_group_bot"),
    )
    op.create_index("ix_routing_rule_template_id", "routing_rule", ["template_id"])


def downgrade() -> None:
    op.drop_index("ix_routing_rule_template_id", table_name="routing_rule")
    op.drop_table("routing_rule")
    op.drop_table("service_config_template")
