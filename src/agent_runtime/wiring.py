"""Building the process: backends per mode, the startup checks, and the wired services.

``Backends`` are the external resources (Redis, DB, Kubernetes); tests inject their own, e.g.
two apps over one real Redis as two replicas. ``Services`` is the typed object the lifespan
the lifespan keeps; handlers never see it: they get the small typed dependencies their
floor declares (``handler_deps``, ``admin_deps``), built from it here. Nothing here runs at
import time.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from redis.asyncio import BlockingConnectionPool, Redis

from agent_runtime import key_layout, logs, lua, redis_client
from agent_runtime.admin import AdminDeps
from agent_runtime.config import ConfigError, Mode, Settings
from agent_runtime.db import installation, schema
from agent_runtime.db.engine import Database
from agent_runtime.jobs import Job, JobRunner
from agent_runtime.metrics import Metrics
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.clusters import read_clusters
from agent_runtime.resource_manager.drains import Drains
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_metered import MeteredK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import DeployBounds
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.places import Places
from agent_runtime.resource_manager.pod_events import PodEvents
from agent_runtime.resource_manager.pod_reports import PodReports
from agent_runtime.resource_manager.pod_watch import PodWatch
from agent_runtime.resource_manager.pool_jobs import PoolJobs
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.views import ResourceViews
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.handler_deps import HandlerDeps
from agent_runtime.session_manager.orchestrator import SessionOrchestrator
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState
from agent_runtime.session_manager.sweeper import SessionSweeper
from agent_runtime.session_manager.views import SessionViews
from agent_runtime.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class Backends:
    redis: Redis
    db: Database
    k8s: K8sPodClient
    # the job leader locks' own small pool (None: they share ``redis``): a renewal never
    # waits behind requests for a connection, so leadership holds under any load
    job_locks: Redis | None = None

    async def close(self) -> None:
        await self.k8s.close()
        await self.redis.aclose()
        if self.job_locks is not None:
            await self.job_locks.aclose()
        await self.db.close()


# Connections beyond the requests' share: the notifier's pub/sub, the job ticks, /metrics,
# warm deploys and the lease renewals of parked routes.
REDIS_RESERVE = 16
JOB_LOCK_CONNECTIONS = 8  # the job leader locks' own pool: one lock call at a time per job


def redis_pool_size(settings: Settings) -> int:
    """Connections of the shared pool: a request in flight uses at most two at once (a slow
    route's command and its lease renewal), touch has a second bound's worth of room
    (admission.py), and the reserve. So the pool never runs dry while the in-flight bound
    holds ("No connection available" was the collapse of issue 13)."""
    return 2 * 2 * settings.max_in_flight + REDIS_RESERVE


REDIS_RETRIES = 1  # a command whose reply was lost is re-sent once (scripts are replay-safe)


def build_redis(settings: Settings, *, max_connections: int | None = None) -> Redis:
    """The client ``AGENT_RUNTIME_REDIS_URL`` names: one server, a Redis Cluster or a
    Sentinel set's master (redis_client.py); fakeredis in local mode without a URL."""
    # A blocking pool: a burst of more concurrent commands than connections waits (server: at most
    # redis_timeout) for a free one. redis-py's default pool raises at once instead, which
    # turned a burst of routes into 503 BACKEND_UNAVAILABLE while Redis was fine.
    if settings.mode is Mode.LOCAL and not settings.redis_url:
        import fakeredis

        return fakeredis.FakeAsyncRedis(
            server=fakeredis.FakeServer(),
            decode_responses=True,
            connection_pool_class=BlockingConnectionPool,
            max_connections=redis_pool_size(settings),
        )
    assert settings.redis_url is not None
    # Scripts are replay-safe, so a command whose reply was lost may be re-sent once; timeouts
    # keep a dead Redis a fast 503 instead of a hang.
    return redis_client.build(
        redis_client.parse(settings.redis_url),
        redis_client.ClientOptions(
            max_connections=max_connections or redis_pool_size(settings),
            timeout=settings.redis_timeout,
            retries=REDIS_RETRIES,
        ),
    )


def build_backends(settings: Settings) -> Backends:
    settings.check_server()
    db = Database.from_url(
        settings.sqlalchemy_url(),
        pool_size=settings.db_pool_size,
        connect_timeout=settings.db_connect_timeout,
    )
    namespace = settings.default_namespace
    # the clusters' kubeconfigs, read and checked once here, at startup (a refusal is one line
    # and exit 2); local mode has no Kubernetes to reach, but refuses the same files
    clusters = read_clusters(settings.clusters, settings.clusters_allow_exec)
    k8s: K8sPodClient = (
        FakeK8sPodClient(default_namespace=namespace, clusters=set(clusters))
        if settings.mode is Mode.LOCAL
        else RealK8sPodClient(
            kubeconfig=settings.kubeconfig, default_namespace=namespace, clusters=clusters
        )
    )
    redis = build_redis(settings)
    # fakeredis (local mode without a URL) has no pool to run dry: the locks share it
    locks = (
        build_redis(settings, max_connections=JOB_LOCK_CONNECTIONS) if settings.redis_url else None
    )
    return Backends(redis=redis, db=db, k8s=k8s, job_locks=locks)


async def check_backends(settings: Settings, backends: Backends) -> None:
    """Reach Redis and the DB, bring the schema up (local) or refuse an old one (server), and
    refuse Redis keys of an earlier key layout (``key_layout``).

    Raises ConfigError with a one-line reason.
    """
    try:
        await backends.redis.ping()
    except Exception as exc:
        raise ConfigError(f"redis unreachable: {type(exc).__name__}: {exc}") from None
    if settings.redis_url:  # the embedded fakeredis never evicts: nothing to say about it
        await check_redis_version(backends.redis)
        await warn_on_eviction(backends.redis)
    try:
        await backends.db.ping()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {_first_line(exc)}"
        raise ConfigError(f"database unreachable: {reason}") from None
    if settings.mode is Mode.LOCAL:
        await backends.db.run(schema.upgrade, backends.db.engine)
    else:
        status = await backends.db.run(schema.status, backends.db.engine)
        if not status.up_to_date:
            raise ConfigError(
                f"database {status.describe()}: run `agent-runtime db upgrade` (same environment)"
            )
    # last: a start refused for another reason writes nothing to Redis (not even the layout)
    await key_layout.check(backends.redis)  # keys of an older version: migrate first


WAIT_LOG_EVERY = 10.0  # seconds between two log lines of short WAITs (each one is counted)


def replica_wait(settings: Settings, metrics: Metrics) -> lua.ReplicaWait | None:
    """The admission scripts' WAIT (``AGENT_RUNTIME_REDIS_WAIT_*``), None when off. A short
    one is counted always and logged at most every ``WAIT_LOG_EVERY`` s: with no replica in
    reach every placement is short, and the log would repeat it per call."""
    replicas, timeout_ms = settings.redis_wait_replicas, settings.redis_wait_timeout_ms
    if replicas <= 0 or not settings.redis_url:  # (the embedded fakeredis has no replica)
        return None
    logged = [-WAIT_LOG_EVERY]

    def short(use: str, acked: int) -> None:
        metrics.redis_wait_short.labels(use).inc()
        now = time.monotonic()
        if now - logged[0] >= WAIT_LOG_EVERY:
            logged[0] = now
            log.warning(
                "redis WAIT after %s: %d of %d replicas acknowledged within %d ms (counted in "
                "agent_runtime_redis_wait_short_total; the write is on the master)",
                use, acked, replicas, timeout_ms,
            )  # fmt: skip

    return lua.ReplicaWait(replicas, timeout_ms, short)


MIN_REDIS = (7, 0)  # the scripts' wake-ups are SPUBLISH (sharded pub/sub)


async def check_redis_version(redis: Redis) -> str | None:
    """Refuse a Redis older than 7.0 (each master of a cluster asked): its scripts would fail at
    their SPUBLISH — every eos, eviction and pod registration. Returns the oldest version seen
    (None where INFO is not allowed: nothing to check then)."""
    try:
        masters = await redis_client.primaries(redis)
        if masters:
            replies = [await redis.info("server", target_nodes=node) for node in masters]
        else:
            replies = [await redis.info("server")]
    except Exception as exc:  # INFO disabled or renamed
        log.info("redis version could not be read (%s); it must be 7.0 or later", exc)
        return None
    versions = []
    for reply in replies:
        if isinstance(reply, dict) and len(reply) == 1 and "redis_version" not in reply:
            reply = next(iter(reply.values()))  # a cluster's answer, keyed by its node
        text = str(reply.get("redis_version", "")) if isinstance(reply, dict) else ""
        numbers = tuple(int(p) for p in text.split(".")[:2] if p.isdigit())
        if len(numbers) == 2:
            versions.append((numbers, text))
    if not versions:
        return None
    oldest, text = min(versions)
    if oldest < MIN_REDIS:
        raise ConfigError(
            f"redis {text} is too old: agent-runtime needs Redis 7.0 or later (the wake-ups "
            "are sharded pub/sub, SPUBLISH)"
        )
    return text


async def warn_on_eviction(redis: Redis) -> str | None:
    """Loudly, at startup: a Redis that may evict keys under memory pressure can drop a
    session, a seat or a lock silently (over-admission). Returns the policy it found (None
    where CONFIG is not allowed, e.g. some managed services: nothing to check then). On a
    Redis Cluster each master is asked (each holds its own setting): the first one that may
    evict is named."""
    try:
        masters = await redis_client.primaries(redis)
        if masters:
            replies = [
                (node.name, await redis.config_get("maxmemory-policy", target_nodes=node))
                for node in masters
            ]
        else:
            replies = [("", await redis.config_get("maxmemory-policy"))]
    except Exception as exc:  # CONFIG disabled or renamed
        log.info("redis maxmemory-policy could not be read (%s); make sure it is noeviction", exc)
        return None
    found = ""
    for where, reply in replies:
        policy = str(reply.get("maxmemory-policy", "")) if isinstance(reply, dict) else ""
        if policy and policy != "noeviction":
            log.warning(
                "REDIS MAY EVICT KEYS: maxmemory-policy is %r%s, not 'noeviction'. Under memory "
                "pressure Redis can drop sessions, queue seats and locks without a trace, and "
                "limits stop holding. Set maxmemory-policy noeviction for this database.",
                policy,
                f" on {where}" if where else "",
            )
            return policy
        found = found or policy
    return found or None


async def load_pod_identity(settings: Settings, db: Database) -> PodIdentity:
    """The key that signs our pods: the configured one, else the installation's generated one
    (made on the first start anywhere, kept in the DB). A generated key the DB holds is still
    accepted for verification after a configured one takes over (delete its row to revoke it),
    so setting a key never turns the pods signed so far into foreign ones."""
    previous = [s.get_secret_value() for s in settings.pod_identity_previous_secrets]
    if settings.pod_identity_secret is not None:
        current = settings.pod_identity_secret.get_secret_value()
        generated = await installation.stored_secret(db, installation.POD_IDENTITY_SECRET)
        if generated is not None:
            previous.append(generated)
    else:
        current = await installation.ensure_secret(db, installation.POD_IDENTITY_SECRET)
    logs.add_secret_values([current, *previous])  # masked should an error ever echo one
    return PodIdentity(current, previous)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


@dataclass
class Services:
    """Everything a request or a job needs, wired once per process."""

    settings: Settings
    backends: Backends
    session_state: SessionState
    scope_state: ScopeState
    session_views: SessionViews
    resource_state: ResourceState
    resource_views: ResourceViews
    notifier: Notifier
    orchestrator: ResourceOrchestrator
    resources: ResourceManagerFacade
    sessions: SessionManagerFacade
    pool_jobs: PoolJobs
    pod_watch: PodWatch
    session_orchestrator: SessionOrchestrator
    session_sweeper: SessionSweeper
    jobs: JobRunner
    config_store: ConfigStore
    identity: PodIdentity
    pod_events: PodEvents
    ready: bool = False  # set once startup completed; /healthz and handlers wait for it
    draining: bool = False  # set on SIGTERM; /healthz turns 503 first

    def handler_deps(self) -> HandlerDeps:
        """What the session manager's handlers hold (it declares the type)."""
        return HandlerDeps(
            orchestrator=self.session_orchestrator,
            config_store=self.config_store,
            resources=self.resources,
            gateway_tokens=tuple(self.settings.gateway_tokens),
            admin_tokens=tuple(self.settings.admin_tokens),
            serving=lambda: self.ready,
        )

    def admin_deps(self) -> AdminDeps:
        """What the admin views read."""
        return AdminDeps(
            sessions=self.session_views,
            resources=self.resource_views,
            control=self.resources,
            admin_tokens=tuple(self.settings.admin_tokens),
            serving=lambda: self.ready,
        )

    def drain(self) -> None:
        """Stop signal: /healthz 503 at once, new routes refused, waiting routes answered at
        once (queue, follower room, a shared acquire, a deploy of their own), followers'
        seats given back."""
        self.draining = True
        self.session_orchestrator.drain()
        self.orchestrator.drain()

    async def update_gauges(self, metrics: Metrics) -> None:
        """Pods by state and live sessions, read from Redis when /metrics is scraped (a few
        pipelined reads, O(pods + scopes)); per scope only with ``scope_metrics``."""
        scopes = await self.session_views.known_scopes()
        phases = await self.resource_views.pod_phases()
        metrics.pods.labels("in_use").set(phases.get("in_use", 0))
        metrics.pods.labels("idle").set(phases.get("idle", 0))
        metrics.pods.labels("draining").set(phases.get("draining", 0))
        metrics.pods.labels("deploying").set(await self.resource_views.placeholders(scopes))
        metrics.pods.labels("retiring").set(await self.session_views.retiring_pods())
        metrics.sessions.set(await self.session_views.live_sessions())
        metrics.pod_budget_used.set(await self.resource_views.budget_used())
        metrics.foreign_pods_seen.set(await self.resource_views.foreign_pod_count())
        if self.settings.scope_metrics:
            counts = await self.session_views.scope_session_counts(scopes)
            metrics.scope_sessions.clear()
            for scope_id, n in zip(scopes, counts, strict=True):
                metrics.scope_sessions.labels(scope_id).set(n)

    async def start(self) -> None:
        await self.notifier.start()
        if self.settings.jobs_enabled:
            self.jobs.start()
            if self.settings.pod_watch_stream:
                self.pod_watch.start()

    async def stop(self) -> None:
        """Reverse order: the index writes of the last requests (they are done: none comes
        after), no new ticks, then running deploys finish or clean up."""
        await self.session_state.index_writes.drain()
        await self.pod_watch.stop()
        await self.jobs.stop()
        await self.session_sweeper.wait_for_notices()
        await self.pool_jobs.wait_for_warm_deploys()
        await self.orchestrator.close()
        await self.pod_events.stop()  # the decisions above are all taken: their events go
        await self.notifier.stop()


def wire(
    settings: Settings,
    backends: Backends,
    metrics: Metrics | None = None,
    *,
    identity: PodIdentity,
    tracing: Tracing | None = None,
) -> Services:
    """Build every service over the backends; with ``metrics``, Redis scripts, SQL calls and
    Kubernetes calls are timed and counted into it (the backends themselves stay as given).
    ``identity``: ``load_pod_identity``'s (it signs every pod and proves adoptions).
    ``tracing``: the app's (off unless given); each floor that opens spans gets it."""
    metrics = metrics or Metrics()
    tracing = tracing or Tracing()
    redis = backends.redis
    db = backends.db.observed(metrics.db_call)
    k8s = MeteredK8sPodClient(backends.k8s, metrics.k8s_call, tracing=tracing)
    wait = replica_wait(settings, metrics)
    session_state = SessionState(
        redis,
        observe=metrics.redis_call,
        wait=wait,
        index_writes_counted=lambda outcome, n: metrics.index_writes.labels(outcome).inc(n),
    )
    scope_state = ScopeState(redis, observe=metrics.redis_call)
    resource_state = ResourceState(
        redis, observe=metrics.redis_call, pod_budget=settings.pod_budget, wait=wait
    )
    notifier = Notifier(redis)
    # one recorder of the pods' Events, on the metered client (its calls are counted too)
    pod_events = PodEvents(
        k8s=k8s,
        instance_id=settings.instance_id,
        enabled=settings.pod_events,
        queue_size=settings.pod_events_queue,
        metrics=metrics,
    )
    orchestrator = ResourceOrchestrator(
        state=resource_state,
        k8s=k8s,
        notifier=notifier,
        default_namespace=settings.default_namespace,
        bounds=DeployBounds(
            clusters=frozenset(settings.clusters), namespaces=settings.allowed_namespaces()
        ),
        metrics=metrics,
        identity=identity,
        deploy_lease=settings.deploy_lease,
        instance_id=settings.instance_id,
        scope_deploy_concurrency=settings.scope_deploy_concurrency,
        tracing=tracing,
        events=pod_events,
    )
    sessions = SessionManagerFacade(state=session_state)
    drains = Drains(
        state=resource_state,
        k8s=k8s,
        sessions=sessions,
        default_namespace=settings.default_namespace,
        metrics=metrics,
        default_timeout=settings.drain_timeout,
        margin=settings.drain_margin,
        events=pod_events,
    )
    pool_jobs = PoolJobs(
        state=resource_state,
        k8s=k8s,
        orchestrator=orchestrator,
        sessions=sessions,
        default_namespace=settings.default_namespace,
        namespaces=settings.allowed_namespaces(),
        identity=identity,
        metrics=metrics,
        adopted_pod_ttl=settings.adopted_pod_ttl,
        drains=drains,
        warm_deploy_concurrency=settings.warm_deploy_concurrency,
        events=pod_events,
    )
    resources = ResourceManagerFacade(
        orchestrator=orchestrator,
        drains=drains,
        reports=PodReports(
            state=resource_state,
            k8s=k8s,
            dead_pods=pool_jobs.dead_pods,
            default_namespace=settings.default_namespace,
            metrics=metrics,
        ),
    )
    pod_watch = PodWatch(
        lock_redis=backends.job_locks or redis,
        state=resource_state,
        k8s=k8s,
        places=Places(
            jobs_state=PoolJobsState(resource_state),
            k8s=k8s,
            default_namespace=settings.default_namespace,
            namespaces=settings.allowed_namespaces(),
        ),
        dead_pods=pool_jobs.dead_pods,
        default_namespace=settings.default_namespace,
        metrics=metrics,
    )
    config_store = ConfigStore(
        db=db,
        state=session_state,
        scopes=scope_state,
        resources=resources,
        clusters=frozenset(settings.clusters),
        namespaces=settings.allowed_namespaces(),
        default_namespace=settings.default_namespace,
        wildcard_rule_pod_budget=settings.wildcard_rule_pod_budget,
        # a template's session_ttl is whole seconds: a fractional setting rounds up
        default_session_ttl=math.ceil(settings.default_session_ttl),
        tracing=tracing,
    )
    session_sweeper = SessionSweeper(
        state=session_state,
        scopes=scope_state,
        resources=resources,
        scope_idle_ttl=settings.scope_idle_ttl,
    )
    jobs = JobRunner(
        redis=backends.job_locks or redis,
        jobs=[
            Job("sm_sweep", settings.sweep_interval, session_sweeper.sweep_once),
            Job("scope_expiry", settings.scope_expiry_interval, session_sweeper.expire_scopes_once),
            Job("rm_autoscale", settings.autoscale_interval, pool_jobs.autoscale_once),
            Job("rm_reclaim", settings.reclaim_interval, pool_jobs.reclaim_and_prune_once),
            Job("rm_watch", settings.watch_interval, pool_jobs.watch_once),
            Job("rm_reconcile", settings.reconcile_interval, pool_jobs.reconcile_once),
            Job("rm_drains", settings.drain_interval, drains.drains_once),
        ],
        tracing=tracing,
    )
    return Services(
        settings=settings,
        backends=backends,
        session_state=session_state,
        scope_state=scope_state,
        session_views=SessionViews(session_state, scope_state),
        resource_state=resource_state,
        resource_views=ResourceViews(resource_state),
        notifier=notifier,
        orchestrator=orchestrator,
        resources=resources,
        sessions=sessions,
        pool_jobs=pool_jobs,
        pod_watch=pod_watch,
        session_orchestrator=SessionOrchestrator(
            state=session_state,
            config_store=config_store,
            resources=resources,
            notifier=notifier,
            scope_full_timeout=settings.scope_full_timeout,
            metrics=metrics,
            tracing=tracing,
        ),
        session_sweeper=session_sweeper,
        jobs=jobs,
        config_store=config_store,
        identity=identity,
        pod_events=pod_events,
    )
