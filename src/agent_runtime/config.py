"""Settings: one typed object read from ``AGENT_RUNTIME_*`` (contract §6, §2.4).

Hazard: server mode must never fall back to an embedded backend. ``Settings.check_server``
refuses a server configuration without a Redis URL, a database URL, or (unless explicitly
allowed) admin tokens, so a mis-deployed replica dies at start instead of serving alone.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

SM_KEY_PREFIX = "session_manager:"
RM_KEY_PREFIX = "resource_manager:"
API_PREFIX = "/api/session"
MIN_POD_SECRET_LENGTH = 16


class Mode(StrEnum):
    LOCAL = "local"
    SERVER = "server"


class ConfigError(Exception):
    """A setting is missing or unusable; the message is one line, fit for a startup error."""


def _default_instance_id() -> str:
    # hostname is the pod name in Kubernetes, so an operator can map an id to a replica
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is reachable from this machine only."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a name (or 0.0.0.0 / ::, which are not loopback): assume reachable


def _split_tokens(value: object) -> object:
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    return value


TokenList = Annotated[list[str], NoDecode]
SecretList = Annotated[list[SecretStr], NoDecode]
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label


def _split_clusters(value: object) -> object:
    """``east=/etc/ar/east.kubeconfig,west=...`` → ``{"east": "/etc/...", ...}``."""
    if not isinstance(value, str):
        return value
    clusters: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, path = (part.strip() for part in entry.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"{entry!r} is not name=kubeconfig-path")
        if name in clusters:
            raise ValueError(f"cluster {name!r} is named twice")
        clusters[name] = path
    return clusters


ClusterMap = Annotated[dict[str, str], NoDecode]


class Settings(BaseSettings):
    """Everything the service reads from its environment, typed and documented."""

    model_config = SettingsConfigDict(
        env_prefix="AGENT_RUNTIME_", extra="ignore", frozen=True, env_file=None
    )

    mode: Mode = Field(Mode.LOCAL, description="local (embedded backends) or server")
    host: str = Field("127.0.0.1", description="address uvicorn binds")
    port: int = Field(8091, ge=1, le=65535, description="port uvicorn binds")
    redis_url: str | None = Field(
        None,
        description="redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// URL; "
        "required in server mode",
    )
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
    default_session_ttl: float = Field(
        60.0,
        gt=0,
        le=30 * 24 * 3600,
        description="session_ttl of a template config_sync creates without one (s, whole up)",
    )
    sweep_interval: float = Field(1.0, gt=0, description="session sweeper tick (s)")
    autoscale_interval: float = Field(1.0, gt=0, description="warm-pool autoscale tick (s)")
    reclaim_interval: float = Field(1.0, gt=0, description="idle reclaim tick (s)")
    watch_interval: float = Field(10.0, gt=0, description="dead/half-dead pod watch tick (s)")
    pod_watch_stream: bool = Field(
        True,
        description="watch our pods in Kubernetes (one stream per place, on the leader of "
        "rm_pod_watch) so a deleted, failed or crash-looping pod is cleaned within about a "
        "second; the watch pass stays as the safety net (needs jobs_enabled)",
    )
    reconcile_interval: float = Field(30.0, gt=0, description="Redis/Kubernetes reconcile tick (s)")
    pod_events: bool = Field(
        True,
        description="record each decision about a pod (deployed, adopted, reclaimed, deleted "
        "dead or half-dead, drained, foreign pod ignored) as a Kubernetes Event on it, for "
        "`kubectl describe pod` (needs create and patch on events)",
    )
    pod_events_queue: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="pod Events waiting for the one sender at most; beyond it an event is "
        "dropped and counted (agent_runtime_pod_events_total{outcome=dropped_full})",
    )
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
    deploy_lease: float = Field(
        5.0,
        ge=1.0,
        le=60.0,
        description="seconds a deploy's claim (the scope's deploy lock, its placeholder, a "
        "follower's seat) lives unless its replica renews it (every third of it): a replica "
        "that dies mid-deploy frees them this long after, and a follower takes the deploy over "
        "(set the same on every replica)",
    )
    scope_deploy_concurrency: int = Field(
        100,
        ge=1,
        le=1000,
        description="cold deploys one scope runs at once (routes that need a pod: one deploy "
        "per pod the waiting demand needs, each followed by up to pod_concurrency - 1 others); "
        "a route past it waits for one of them, within its deadline (set the same on every "
        "replica)",
    )
    warm_deploy_concurrency: int = Field(
        64,
        ge=1,
        le=1000,
        description="warm-pool deploys (autoscale) one replica runs at once, over all scopes; "
        "each scope's also stay within scope_deploy_concurrency with its cold deploys",
    )
    redis_timeout: float = Field(
        2.0, gt=0, description="Redis connect and command timeout (s); keeps failures fast"
    )
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description="after a route binds a session and after a pod is registered, WAIT for "
        "this many replicas to have the write (0: off); fewer within the timeout are counted "
        "(agent_runtime_redis_wait_short_total), never an error",
    )
    redis_wait_timeout_ms: int = Field(
        50,
        ge=1,
        le=5000,
        description="the longest such a WAIT holds the call (ms)",
    )
    db_connect_timeout: int = Field(5, ge=1, description="DB connect timeout (s)")
    db_pool_size: int = Field(8, ge=1, le=128, description="DB connections (and DB threads)")

    # -- http edge: connections (headers, timeouts, connection cap) --
    http_max_header_bytes: int = Field(
        16384,
        ge=1024,
        le=1 << 20,
        description="bytes of a request head (request line + headers); over it: 431 and close",
    )
    http_max_header_line_bytes: int = Field(
        8192, ge=256, le=1 << 20, description="bytes of one request or header line; over: 431"
    )
    http_max_headers: int = Field(
        100, ge=8, le=10_000, description="header lines of a request; more: 431 and close"
    )
    http_header_timeout: float = Field(
        5.0,
        gt=0,
        description="a request head must be complete within this (s) of the connection's "
        "start or of its first byte; else 408 and close",
    )
    http_body_timeout: float = Field(
        10.0,
        gt=0,
        description="a request body must be complete within this (s) of its head; else close",
    )
    http_keepalive_timeout: float = Field(
        5.0, gt=0, description="an idle keep-alive connection is closed after this (s)"
    )
    http_max_connections: int = Field(
        4096,
        ge=1,
        description="open connections per replica; one more is answered 503 and closed at once",
    )

    # -- http edge: requests (methods, open gateway, overload) --
    allow_open_gateway: bool = Field(
        False,
        description="route and touch may run without gateway tokens in server mode (or on a "
        "non-loopback host in local mode) only when this (or allow_unauthenticated) is true",
    )
    max_in_flight: int = Field(
        32,
        ge=1,
        le=1024,
        description="API requests one replica works on at once; past it a request is answered "
        "503 OVERLOADED + Retry-After before any Redis or DB work (a route waiting in a "
        "scope's queue does not count while it waits)",
    )
    admission_queue: int = Field(
        512,
        ge=0,
        le=100_000,
        description="requests over max_in_flight that may wait for a place (newest first); "
        "more are answered 503 OVERLOADED at once; 0: no waiting",
    )
    admission_burst_wait: float = Field(
        0.1,
        gt=0,
        le=60,
        description="how long a backlog over max_in_flight may stand as a burst: its requests "
        "wait for a place up to this long; a backlog that has stood this long with no place "
        "going spare is overload: from then on only a waiter of at most 5 ms is served, the "
        "rest are shed at once, until a place goes spare again",
    )
    admission_lag_target: float = Field(
        0.003,
        ge=0,
        le=1,
        description="event-loop lateness (s) the in-flight bound is steered to: while the "
        "loop runs later than this the working bound shrinks (down to 4), while it runs on "
        "time it grows back to max_in_flight; 0: a fixed bound of max_in_flight",
    )

    # -- templates: clusters, namespaces, secrets --
    clusters: ClusterMap = Field(
        default_factory=dict,
        description="clusters a template may name in `kubeconfig`: name=kubeconfig-path,... "
        "(each file read once at startup; a template can name no other cluster or path)",
    )
    clusters_allow_exec: TokenList = Field(
        default_factory=list,
        description="cluster names whose kubeconfig may use `exec` or `auth-provider` "
        "(runs a program in the service); refused at startup otherwise",
    )
    namespaces: TokenList = Field(
        default_factory=list,
        description="namespaces templates may deploy to and cleanup may touch, besides "
        "the default namespace (comma-separated)",
    )

    # -- bounded growth: pod budgets --
    pod_budget: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="the installation's pod budget: pods + deploys in flight over all scopes; "
        "a route that would need one more gets 503 NO_POD_AVAILABLE at once (set the same on "
        "every replica)",
    )
    wildcard_rule_pod_budget: int = Field(
        100,
        ge=0,
        le=1_000_000,
        description="pod budget of a routing rule with a '*' and no pod_budget of its own "
        "(pods + deploys in flight of every scope it resolves); 0 = unbounded. Exact (g, b) "
        "rules are unbounded unless they set pod_budget (their scope's max_pods bounds them)",
    )

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

    # -- pod identity: which pods are ours --
    pod_identity_secret: SecretStr | None = Field(
        None,
        description="HMAC key (>= 16 characters) that signs every pod this installation "
        "creates; reconcile adopts only pods whose signature verifies. Unset: a random one is "
        "generated once and kept in the config DB (every replica and restart shares it). Set "
        "the same on every replica",
    )
    pod_identity_previous_secrets: SecretList = Field(
        default_factory=list,
        description="earlier pod identity secrets (comma-separated) still accepted when "
        "verifying, never used to sign: rotation. Drop one once no pod signed with it is left",
    )
    adopted_pod_ttl: float = Field(
        600.0,
        gt=0,
        description="a warm pod whose scope has no pool config (adopted after a Redis data "
        "loss, before the scope's next route wrote one) is deleted after this long idle (s)",
    )
    drain_timeout: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="a drain's deadline when none is given (an admin drain without "
        "deadline_seconds, a cordoned node's pods): its sessions are rebound after it (s)",
    )
    drain_margin: float = Field(
        2.0,
        ge=0,
        le=60,
        description="a pod Kubernetes deletes gracefully drains until this long before its "
        "deletionTimestamp, so its sessions move before the kill (s)",
    )
    drain_interval: float = Field(1.0, gt=0, description="drain job tick (s)")

    # -- answers: replay binding, messages --

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        """A malformed URL is a startup refusal (one line, exit 2), not a traceback. The
        library's reason is left out: it may quote the URL, password and all. Unset or empty:
        ``check_server`` says what is missing."""
        if not value:
            return value
        from agent_runtime.redis_client import RedisUrlError, parse

        try:
            parse(value)
        except RedisUrlError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if not value:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            make_url(value).get_dialect()  # the dialect only: its driver is imported later
        except (ArgumentError, ValueError, TypeError):
            raise ValueError(
                "not a usable SQLAlchemy URL: dialect[+driver]://user[:password]@host[:port]/db "
                "(mysql, postgresql; sqlite in local mode)"
            ) from None
        return value

    _split_gateway = field_validator(
        "gateway_tokens", "admin_tokens", "clusters_allow_exec", "namespaces", mode="before"
    )(_split_tokens)
    _split_cluster_map = field_validator("clusters", mode="before")(_split_clusters)
    _split_secrets = field_validator("pod_identity_previous_secrets", mode="before")(_split_tokens)

    @field_validator("pod_identity_secret", "pod_identity_previous_secrets")
    @classmethod
    def _secret_length(cls, value: SecretStr | list[SecretStr] | None) -> object:
        """A short HMAC key is a guessable one: refused at startup (the value is never shown)."""
        for secret in value if isinstance(value, list) else [value]:
            if secret is not None and len(secret.get_secret_value()) < MIN_POD_SECRET_LENGTH:
                raise ValueError(
                    f"a pod identity secret has at least {MIN_POD_SECRET_LENGTH} characters"
                )
        return value

    @field_validator("clusters")
    @classmethod
    def _cluster_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not _NAME.fullmatch(name):
                raise ValueError(f"cluster name {name!r} is not a DNS-1123 label")
            if not path.startswith("/"):
                raise ValueError(f"cluster {name!r}: the kubeconfig path must be absolute")
        return value

    @field_validator("namespaces")
    @classmethod
    def _namespace_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _NAME.fullmatch(name):
                raise ValueError(f"namespace {name!r} is not a DNS-1123 label")
        return value

    def allowed_namespaces(self) -> frozenset[str]:
        """Where templates may deploy and cleanup may delete: the default and ``namespaces``."""
        return frozenset({self.default_namespace, *self.namespaces})

    @field_validator("log_level")
    @classmethod
    def _upper_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"}:
            raise ValueError(f"unknown log level {value!r}")
        return level

    @property
    def gateway_open(self) -> bool:
        """route and touch answer anyone (no gateway tokens)."""
        return not self.gateway_tokens

    @property
    def open_gateway_allowed(self) -> bool:
        return self.allow_open_gateway or self.allow_unauthenticated

    def check_server(self) -> None:
        """Raise ConfigError with a one-line reason if this is not a usable config to serve:
        server mode's backends and tokens, and in either mode an open gateway (no gateway
        tokens) reachable from other hosts without the opt-in."""
        if self.mode is not Mode.SERVER:
            if self.gateway_open and not is_loopback(self.host) and not self.open_gateway_allowed:
                raise ConfigError(
                    f"local mode on {self.host} (not loopback) needs AGENT_RUNTIME_GATEWAY_TOKENS "
                    "(or AGENT_RUNTIME_ALLOW_OPEN_GATEWAY=true)"
                )
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
        if self.gateway_open and not self.open_gateway_allowed:
            raise ConfigError(
                "server mode needs AGENT_RUNTIME_GATEWAY_TOKENS "
                "(or AGENT_RUNTIME_ALLOW_OPEN_GATEWAY=true to serve route and touch to anyone)"
            )

    def sqlalchemy_url(self) -> str:
        """The DB URL this process uses: the configured one, or the local SQLite file."""
        if self.mode is Mode.SERVER or self.database_url:
            if not self.database_url:  # server mode never falls back to SQLite
                raise ConfigError("AGENT_RUNTIME_DATABASE_URL is required in server mode")
            return self.database_url
        return f"sqlite:///{self.sqlite_path}"
