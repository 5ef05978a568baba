"""What the session manager's HTTP handlers hold, declared here and filled by the wiring.

The handlers get exactly this: the session manager's own orchestrator and config store, the
resource manager's facade, the tokens and the namespaces cleanup may reach — never the
process's whole set of services. The app's wiring builds one ``HandlerDeps`` per process
and hands it to ``install`` (the way Starlette's lifespan state hands a request what the
lifespan made); ``handler_deps`` is the FastAPI dependency that gives it to a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request

from agent_runtime.errors import BackendUnavailable
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.orchestrator import SessionOrchestrator

# where the wiring leaves it on the app (the one name both sides know)
_APP_STATE_SLOT = "session_manager_handler_deps"


@dataclass(frozen=True, slots=True)
class HandlerDeps:
    orchestrator: SessionOrchestrator
    config_store: ConfigStore
    resources: ResourceManagerFacade
    gateway_tokens: Sequence[str]
    admin_tokens: Sequence[str]
    # False while the process starts or stops: every handler answers 503 then
    serving: Callable[[], bool]


def install(app: FastAPI, deps: HandlerDeps | None) -> None:
    """The wiring's side: from now on (None: no longer) requests get ``deps``."""
    setattr(app.state, _APP_STATE_SLOT, deps)


async def handler_deps(request: Request) -> HandlerDeps:
    """FastAPI dependency: the handlers' collaborators, or 503 while starting or stopping.
    Async on purpose: FastAPI runs a sync dependency on its thread pool (a hop per request)."""
    deps: HandlerDeps | None = getattr(request.app.state, _APP_STATE_SLOT, None)
    if deps is None or not deps.serving():
        raise BackendUnavailable("service is starting or stopping")
    return deps
