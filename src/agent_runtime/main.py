"""App assembly: ``create_app(settings)`` builds one FastAPI app; its lifespan wires the process.

Startup: build (or take injected) backends → check them (schema too) → the pod identity key
(configured, or the installation's own from the DB) → seed local defaults →
start Kubernetes (a failure only degrades the pod jobs) → wire services → ready. Shutdown
runs in reverse; ``/healthz`` is 503 until ready and from the moment draining starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agent_runtime.admin import install as install_admin_deps
from agent_runtime.admin import router as admin_router
from agent_runtime.admission import Admission, AdmissionMiddleware, EdgeShed, LagGovernor
from agent_runtime.api import error_handlers, openapi
from agent_runtime.api.json_body import MAX_BODY_BYTES
from agent_runtime.config import API_PREFIX, ConfigError, Mode, Settings, is_loopback
from agent_runtime.jobs import Job
from agent_runtime.metrics import CONTENT_TYPE_LATEST, Metrics, MetricsMiddleware
from agent_runtime.session_manager.handler_deps import install as install_handler_deps
from agent_runtime.session_manager.handlers import router as session_router
from agent_runtime.tracing import Tracing, from_environment
from agent_runtime.wiring import (
    Backends,
    Services,
    build_backends,
    check_backends,
    load_pod_identity,
    wire,
)

log = logging.getLogger(__name__)
GAUGES_TIMEOUT = 2.0  # seconds /metrics may spend reading Redis for the state gauges
TRACES_FLUSH_MIN = 0.5  # seconds the spans' last export gets even when the stop bound is spent


def create_app(
    settings: Settings,
    *,
    backends: Backends | None = None,
    owns_backends: bool | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The service. Pass ``backends`` to share Redis/DB/Kubernetes (tests, replicas in one
    process); they are then closed by their owner unless ``owns_backends`` is true.
    ``tracing``: the process environment's (``OTEL_*``, tracing.py) unless given."""
    traces = tracing if tracing is not None else _environment_tracing(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = backends is None if owns_backends is None else owns_backends
        live = backends or build_backends(settings)
        try:
            await check_backends(settings, live)
            identity = await load_pod_identity(settings, live.db)
            svc = wire(settings, live, metrics, identity=identity, tracing=traces)
            if settings.mode is Mode.LOCAL and settings.local_seed:
                await svc.config_store.seed_local_defaults()
            try:
                await live.k8s.start()
            except Exception as exc:  # pods jobs degrade; config and routing of warm pods go on
                log.error("kubernetes client failed to start: %s", exc)
            app.state.services = svc  # before start(): a failed start is still stopped below
            # each floor's handlers get only what their floor declares (503 until ready)
            install_handler_deps(app, svc.handler_deps())
            install_admin_deps(app, svc.admin_deps())
            if settings.admission_lag_target > 0:
                governor = LagGovernor(app.state.admission, settings.admission_lag_target)
                app.state.admission_governor = asyncio.create_task(
                    governor.run(), name="admission-governor"
                )
            await svc.start()
            svc.ready = True
            log.info("ready: mode=%s instance=%s", settings.mode, settings.instance_id)
            if settings.gateway_open and (
                settings.mode is Mode.SERVER or not is_loopback(settings.host)
            ):
                log.warning(
                    "GATEWAY OPEN: no AGENT_RUNTIME_GATEWAY_TOKENS; route and touch answer "
                    "anyone who reaches %s:%s (opted in by AGENT_RUNTIME_ALLOW_OPEN_GATEWAY "
                    "or AGENT_RUNTIME_ALLOW_UNAUTHENTICATED)",
                    settings.host,
                    settings.port,
                )
            yield
        finally:
            # one stop bound for all of it: what the cli left of it (set at the signal), else
            # the whole shutdown_timeout from now
            deadline: float = getattr(app.state, "stop_deadline", None) or (
                time.monotonic() + settings.shutdown_timeout
            )
            governing: asyncio.Task[None] | None = getattr(app.state, "admission_governor", None)
            if governing is not None:
                governing.cancel()
                await asyncio.gather(governing, return_exceptions=True)
            svc_now: Services | None = getattr(app.state, "services", None)
            if svc_now is not None:
                svc_now.ready = False
                svc_now.drain()
                try:
                    await asyncio.wait_for(svc_now.stop(), max(1.0, deadline - time.monotonic()))
                except Exception:
                    log.exception("shutdown: services did not stop cleanly")
            # last: the spans of the stop itself (deploys that finished) go out too
            await traces.shutdown(max(deadline - time.monotonic(), TRACES_FLUSH_MIN))
            if owned:
                await live.close()

    app = FastAPI(
        title="agent-runtime",
        version="0.1.0",
        lifespan=lifespan,
        # the Swagger UI in local mode only (a developer's machine): it loads its scripts from a
        # CDN, which a production replica has no business pointing browsers at
        docs_url="/docs" if settings.mode is Mode.LOCAL else None,
        redoc_url=None,
        openapi_url="/openapi.json",  # the contract as OpenAPI; open, like /healthz
        strict_content_type=False,  # a body is JSON whatever Content-Type a client sent
        # no 307 to the slash-less path (it came before auth, and is no envelope): a path with
        # a trailing slash is an unknown path, 404 NOT_FOUND like any other
        redirect_slashes=False,
    )
    error_handlers.install(app)
    app.include_router(session_router, prefix=API_PREFIX)
    app.include_router(admin_router, prefix=API_PREFIX)
    metrics = Metrics()

    def live_jobs() -> list[Job]:
        svc: Services | None = getattr(app.state, "services", None)
        return list(svc.jobs.jobs.values()) if svc is not None else []

    metrics.watch_jobs(live_jobs)
    # from the router itself: FastAPI keeps an included router as one nested entry of app.routes
    api_paths = {API_PREFIX + r.path for r in session_router.routes if hasattr(r, "path")}
    known = frozenset(api_paths | {"/healthz", "/metrics"})
    # inside the metrics (a shed request is counted), outside everything else (shed first)
    admitted = Admission(
        settings.max_in_flight,
        queue=settings.admission_queue,
        burst_wait=settings.admission_burst_wait,
    )
    app.state.admission = admitted
    reserve_paths = frozenset({API_PREFIX + "/touch"})  # a touch frees what a route took
    app.add_middleware(
        AdmissionMiddleware,
        admission=admitted,
        prefix=API_PREFIX + "/",
        reserve_paths=reserve_paths,
        body_limit=MAX_BODY_BYTES,
    )

    def count_shed(path: str) -> None:
        metrics.requests.labels(path if path in known else "other", "503", "OVERLOADED").inc()

    # the HTTP protocol's door (serve passes it to uvicorn): under overload the excess is
    # answered before it becomes a task (admission.Admission.shed_early)
    app.state.edge_shed = EdgeShed(
        admitted, prefix=API_PREFIX + "/", reserve_paths=reserve_paths, on_shed=count_shed
    )
    metrics.watch_admission(
        lambda: (admitted.active, admitted.parked_now, admitted.waiting, admitted.limit)
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics, known_paths=known)
    # outermost, and only when on: off, the stack is exactly as without tracing
    if traces.enabled:
        untraced = frozenset({"/healthz", "/metrics"})  # probes and scrapes: no trace each
        app.add_middleware(traces.middleware, known_paths=known, untraced=untraced)

    @app.get("/metrics", response_class=Response, responses=openapi.METRICS_RESPONSES)
    async def metrics_endpoint(request: Request) -> Response:
        svc: Services | None = getattr(request.app.state, "services", None)
        if svc is not None and svc.ready:
            try:  # the counters are served even when Redis cannot be read
                await asyncio.wait_for(svc.update_gauges(metrics), GAUGES_TIMEOUT)
            except Exception as exc:
                log.warning("metrics: state gauges not updated: %s", exc)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", responses=openapi.HEALTHZ_RESPONSES)
    async def healthz(request: Request) -> JSONResponse:
        svc: Services | None = getattr(request.app.state, "services", None)
        jobs_down = svc is not None and settings.jobs_enabled and not svc.jobs.running
        if svc is None or not svc.ready or svc.draining or jobs_down:
            state = "draining" if svc is not None and svc.draining else "starting"
            return JSONResponse({"ok": False, "state": state}, status_code=503)
        return JSONResponse({"ok": True, "instance_id": settings.instance_id})

    return app


def _environment_tracing(settings: Settings) -> Tracing:
    """Tracing as the process's ``OTEL_*`` variables say (off without an endpoint)."""
    try:
        return from_environment(os.environ, instance_id=settings.instance_id)
    except ValueError as exc:  # a protocol we do not export with: a refused start, one line
        raise ConfigError(str(exc)) from None
