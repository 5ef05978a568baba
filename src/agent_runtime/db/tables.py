"""The two configuration tables, with the legacy column names of contract §3.

Field names in code are the contract's; ``COLUMN_OF`` maps the four that differ in the DB.
Adding a template field: classify it in ``spec_fields``, add the column here and a migration.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects import mysql

metadata = MetaData()

# contract field name → DB column name (only where they differ)
COLUMN_OF: dict[str, str] = {
    "min_idle_pods": "min_idle_services",
    "pod_concurrency": "service_concurrency",
    "pod_ttl": "service_ttl",
    "scope_concurrency": "session_concurrency",
}
FIELD_OF: dict[str, str] = {column: field for field, column in COLUMN_OF.items()}

ID_LEN = 256


def id_column_type() -> String:
    """Ids are case-sensitive: MySQL/MariaDB's default collation is not, so use a binary one."""
    return String(ID_LEN).with_variant(
        mysql.VARCHAR(ID_LEN, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


service_config_template = Table(
    "service_config_template",
    metadata,
    Column("template_id", id_column_type(), primary_key=True),
    Column("enabled", Boolean, nullable=False, default=True),
    Column("image", String(1024), nullable=False),
    Column("pod_name", String(63), nullable=False),
    Column("namespace", String(63), nullable=True),
    Column("container_port", Integer, nullable=False),
    Column("sse_port", Integer, nullable=False),
    Column("sse_path", String(256), nullable=False),
    Column("cpu_request", String(32), nullable=True),
    Column("cpu_limit", String(32), nullable=True),
    Column("memory_request", String(32), nullable=True),
    Column("memory_limit", String(32), nullable=True),
    Column("env", Text, nullable=False),  # JSON object of str → str
    Column("nfs_server", String(1024), nullable=True),
    Column("nfs_path", String(1024), nullable=True),
    Column("nfs_mount_path", String(1024), nullable=True),
    Column("ready_timeout", Float, nullable=False),
    Column("ready_poll_interval", Float, nullable=False),
    Column("kubeconfig", Text, nullable=True),
    Column("session_concurrency", Integer, nullable=False),
    Column("service_concurrency", Integer, nullable=False),
    Column("session_ttl", Integer, nullable=False),
    Column("service_ttl", Integer, nullable=False),
    Column("min_idle_services", Integer, nullable=False),
    # the warm pool's policy (revision 0004): rows written before it are "static"
    Column("warm_pool", String(16), nullable=False, server_default="static"),
    Column("created_at", DateTime, nullable=False, server_default=func.now()),
    Column("updated_at", DateTime, nullable=False, server_default=func.now()),
)

routing_rule = Table(
    "routing_rule",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("group_id", id_column_type(), nullable=False),
    Column("bot_id", id_column_type(), nullable=False),
    Column("template_id", id_column_type(), nullable=False, index=True),
    # pods (+ deploys in flight) the rule's scopes may have together; NULL = the default
    Column("pod_budget", Integer, nullable=True),
    Column("created_at", DateTime, nullable=False, server_default=func.now()),
    Column("updated_at", DateTime, nullable=False, server_default=func.now()),
    UniqueConstraint("group_id", "bot_id", name="uq_routing_rule_group_bot"),
)

# Secrets the installation generates for itself (one row per name, written once, never
# updated): every replica and restart reads the same value. ``installation.ensure_secret``.
installation_secret = Table(
    "installation_secret",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
    Column("created_at", DateTime, nullable=False, server_default=func.now()),
)
