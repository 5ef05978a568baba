"""Settings: one typed object read from ``AGENT_RUNTIME_*`` (contract §6, §2.4).

Hazard: server mode must never fall back to an embedded backend. ``Settings.check_server``
refuses a server configuration without a Redis URL, a database URL, or (unless explicitly
allowed) admin tokens, so a mis-deployed replica dies at start instead of serving alone.
"""

from __future__ import annotations

import os
import socket
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

SM_KEY_PREFIX = "session_manager:"
RM_KEY_PREFIX = "resource_manager:"
API_PREFIX = "/api/session"


class Mode(StrEnum):
    LOCAL = "local"
    SERVER = "server"


class ConfigError(Exception):
    """A setting is missing or unusable; the message is one line, fit for a startup error."""


def _default_instance_id() -> str:
    # hostname is the pod name in Kubernetes, so an operator can map an id to a replica
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _split_tokens(value: object) -> object:
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    return value


TokenList = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    """Everything the service reads from its environment, typed and documented."""

    model_config = SettingsConfigDict(
        env_prefix="AGENT_RUNTIME_", extra="ignore", frozen=True, env_file=None
    )

    mode: Mode = Field(Mode.LOCAL, description="local (embedded backends) or server")
    host: str = Field("127.0.0.1", description="address uvicorn binds")
    port: int = Field(8091, ge=1, le=65535, description="port uvicorn binds")
    redis_url: str | None = Field(None, description="redis:// URL; required in server mode")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL (MySQL/MariaDB or PostgreSQL); required in server mode"
    )
    sqlite_path: Path = Field(
        Path("agent_runtime_local.db"), description="SQLite file used by local mode"
    )
    local_seed: bool = Field(
        True, description="local mode seeds a `default` template and a (*, *) rule on first start"
    )
    kubeconfig: str | None = Field(None, description="kubeconfig path when not running in-cluster")
    default_namespace: str = Field("default", description="namespace for pods and cleanup")
    scope_full_timeout: float = Field(30.0, gt=0, description="max wait in a scope's queue (s)")
    default_session_ttl: float = Field(60.0, gt=0, description="session ttl fallback (s)")
    sweep_interval: float = Field(1.0, gt=0, description="session sweeper tick (s)")
    autoscale_interval: float = Field(1.0, gt=0, description="warm-pool autoscale tick (s)")
    reclaim_interval: float = Field(1.0, gt=0, description="idle reclaim tick (s)")
    watch_interval: float = Field(10.0, gt=0, description="dead/half-dead pod watch tick (s)")
    reconcile_interval: float = Field(30.0, gt=0, description="Redis/Kubernetes reconcile tick (s)")
    jobs_enabled: bool = Field(
        True, description="run the background jobs (tests switch them off to tick by hand)"
    )
    instance_id: str = Field(default_factory=_default_instance_id, description="replica id")
    log_level: str = Field("INFO", description="root log level")
    log_format: Literal["json", "text"] = Field(
        "json", description="json: one object per line (production); text: for humans"
    )
    gateway_tokens: TokenList = Field(
        default_factory=list, description="bearer tokens for route/touch (comma-separated)"
    )
    admin_tokens: TokenList = Field(
        default_factory=list, description="bearer tokens for config_sync/cleanup/admin reads"
    )
    allow_unauthenticated: bool = Field(
        False, description="server mode may run without admin tokens only when this is true"
    )
    shutdown_timeout: float = Field(20.0, gt=0, description="hard bound on graceful shutdown (s)")
    scope_metrics: bool = Field(
        False, description="per-scope series on /metrics (cardinality: one series per scope)"
    )
    redis_timeout: float = Field(
        2.0, gt=0, description="Redis connect and command timeout (s); keeps failures fast"
    )
    db_connect_timeout: int = Field(5, ge=1, description="DB connect timeout (s)")
    db_pool_size: int = Field(8, ge=1, le=128, description="DB connections (and DB threads)")

    # -- http edge: connections (headers, timeouts, connection cap) --

    # -- http edge: requests (methods, open gateway, overload) --

    # -- templates: clusters, namespaces, secrets --

    # -- bounded growth: pod budgets --

    # -- bounded growth: scope expiry, config_sync propagation --
    scope_idle_ttl: float = Field(
        600.0,
        gt=0,
        description="a scope with no session, pod, waiter or deploy in flight leaves Redis "
        "after this long (s); its next route rebuilds it from the DB",
    )
    scope_expiry_interval: float = Field(
        10.0, gt=0, description="scope expiry tick (s): marks empty scopes, expires due ones"
    )

    # -- answers: replay binding, messages --

    _split_gateway = field_validator("gateway_tokens", "admin_tokens", mode="before")(_split_tokens)

    @field_validator("log_level")
    @classmethod
    def _upper_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"}:
            raise ValueError(f"unknown log level {value!r}")
        return level

    def check_server(self) -> None:
        """Raise ConfigError with a one-line reason if this is not a usable server config."""
        if self.mode is not Mode.SERVER:
            return
        if not self.redis_url:
            raise ConfigError("server mode needs AGENT_RUNTIME_REDIS_URL (no fakeredis fallback)")
        if not self.database_url:
            raise ConfigError(
                "server mode needs AGENT_RUNTIME_DATABASE_URL (MySQL/MariaDB or PostgreSQL)"
            )
        if self.database_url.startswith("sqlite"):
            raise ConfigError("server mode refuses SQLite: SQLite is for local mode only")
        if not self.admin_tokens and not self.allow_unauthenticated:
            raise ConfigError(
                "server mode needs AGENT_RUNTIME_ADMIN_TOKENS "
                "(or AGENT_RUNTIME_ALLOW_UNAUTHENTICATED=true)"
            )

    def sqlalchemy_url(self) -> str:
        """The DB URL this process uses: the configured one, or the local SQLite file."""
        if self.mode is Mode.SERVER or self.database_url:
            assert self.database_url is not None
            return self.database_url
        return f"sqlite:///{self.sqlite_path}"
