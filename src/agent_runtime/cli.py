"""Command line (contract §7): ``agent-runtime serve``, ``agent-runtime db upgrade|status`` and
``agent-runtime redis status|migrate`` (the key layout, ``key_layout.py``);
``agent-runtime admin …`` is the operators' client of a running service's admin API
(``admin_cli/``);
``agent-runtime kubesim`` runs the Kubernetes API simulator for tests (docs/spec/kubesim.md),
when its own distribution is installed (``pip install -e ./kubesim``; the service's wheel and
image carry none of it).

A bad configuration or an unreachable backend ends the process at once with one line on
stderr and exit status 2, before uvicorn starts.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from pydantic import ValidationError

from agent_runtime import logs
from agent_runtime.admin_cli import program as admin_cli
from agent_runtime.config import ConfigError, Settings

T = TypeVar("T")
EXIT_CONFIG = 2
EXIT_STOP_TIMEOUT = 3
EXIT_INTERRUPTED = 130  # Ctrl-C before the service ran (128 + SIGINT, as a shell says)


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    env_file = getattr(args, "env_file", None)
    if env_file is not None and not Path(env_file).is_file():
        raise ConfigError(f"env file {env_file} does not exist")
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(_env_file=env_file, **given)  # type: ignore[call-arg]
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"setting AGENT_RUNTIME_{field.upper()}: {first['msg']}") from None


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from agent_runtime import http_server
    from agent_runtime.main import create_app
    from agent_runtime.wiring import build_backends, check_backends

    settings = _settings(args, mode=args.mode, host=args.host, port=args.port)
    settings.check_server()
    max_connections, lowered = http_server.fit_descriptors(settings)

    async def preflight() -> None:
        backends = _unusable_url_is_config_error(build_backends, settings)
        try:
            await check_backends(settings, backends)
        finally:
            await backends.redis.aclose()
            await backends.db.close()

    asyncio.run(preflight())
    # only now: a failed preflight must leave exactly one line on stderr, not library logs
    logs.configure(settings.log_level, settings.log_format)
    if lowered:
        logging.getLogger(__name__).warning(lowered)
    app = create_app(settings)
    tune_gc()

    class DrainingServer(uvicorn.Server):
        """Turns /healthz to 503 the moment a stop signal arrives, before connections close;
        new routes are refused and waiting ones answered (503, retried elsewhere). The whole
        stop is bounded by shutdown_timeout: half for requests in flight (uvicorn cancels the
        rest), the remainder for the services (lifespan), and a watchdog ends the process if
        anything still hangs."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if getattr(app.state, "stop_deadline", None) is None:
                app.state.stop_deadline = time.monotonic() + settings.shutdown_timeout
                _start_watchdog(settings.shutdown_timeout + WATCHDOG_MARGIN)
            svc = getattr(app.state, "services", None)
            if svc is not None:
                svc.drain()
            super().handle_exit(sig, frame)
            if sig in (signal.SIGTERM, signal.SIGINT):
                # SIGTERM is the normal stop of a replica, Ctrl-C (SIGINT) the same at a
                # terminal: once drained, exit 0. uvicorn would re-raise the signal after
                # shutdown: the process would die of SIGTERM (-15), and a re-raised SIGINT
                # cancels asyncio's main task (two tracebacks: CancelledError, KeyboardInterrupt).
                captured = getattr(self, "_captured_signals", [])
                while sig in captured:
                    captured.remove(sig)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:
                # a second Ctrl-C: uvicorn stops waiting for requests in flight and skips the
                # lifespan's shutdown; ours still runs (jobs give their locks back, deploys
                # finish or clean up), bounded like any stop by the watchdog
                await self.lifespan.shutdown()

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout / 2)),
        log_config=None,  # ours (logs.configure): one format for every line
        access_log=False,
        # bounded heads, head/body deadlines, keep-alive timeout, connection cap
        **http_server.uvicorn_options(settings, max_connections, app.state.edge_shed),
    )
    DrainingServer(config).run()


def tune_gc() -> None:
    """Fewer, cheaper collections on a long-running server: what startup allocated (modules,
    the app) is frozen out of every later collection, and the young generation is collected
    less often. A full collection of a big heap stalls the event loop for 50-100 ms (seen in
    the bench as the only slow callbacks)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


WATCHDOG_MARGIN = 2.0  # seconds past shutdown_timeout before the process is ended hard


def _start_watchdog(seconds: float) -> None:
    """Last resort of the stop bound: whatever hangs (a library, a stuck thread), the process
    ends ``seconds`` after the stop signal. A daemon thread: a normal exit never waits for it."""

    def expire() -> None:
        time.sleep(seconds)
        sys.stderr.write(f"agent-runtime: not stopped within {seconds:g} s; exiting hard\n")
        sys.stderr.flush()
        os._exit(EXIT_STOP_TIMEOUT)

    threading.Thread(target=expire, name="stop-watchdog", daemon=True).start()


def _unusable_url_is_config_error(build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Build a backend from the settings; a URL the libraries cannot use (a driver that is
    not installed, a form the validators let through) is a startup refusal, not a
    traceback. Only the exception's type and first line: never the URL itself."""
    try:
        return build(*args, **kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"backend URL not usable: {type(exc).__name__}: {first}") from None


def _db(args: argparse.Namespace) -> None:
    # here, not at the top: SQLAlchemy and Alembic take ~0.6 s to import, which every
    # `agent-runtime admin` call would pay for nothing
    from agent_runtime.db import schema
    from agent_runtime.db.engine import Database

    settings = _settings(args)
    db = _unusable_url_is_config_error(
        Database.from_url, settings.sqlalchemy_url(), connect_timeout=settings.db_connect_timeout
    )
    try:
        if args.action == "upgrade":
            schema.upgrade(db.engine)
        status = schema.status(db.engine)
        print(status.describe())
        if not status.up_to_date:
            sys.exit(1)
    except Exception as exc:
        raise ConfigError(f"database: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    finally:
        db.engine.dispose()


def _redis(args: argparse.Namespace) -> None:
    """``redis status``: the key layout Redis holds; ``redis migrate``: move an earlier one."""
    from agent_runtime import key_layout
    from agent_runtime.wiring import build_redis

    settings = _settings(args)
    if not settings.redis_url:
        raise ConfigError("AGENT_RUNTIME_REDIS_URL is not set: nothing to look at")
    redis = _unusable_url_is_config_error(build_redis, settings)

    async def run() -> int:
        try:
            if args.action == "status":
                try:
                    await key_layout.check_only(redis)
                except ConfigError as exc:
                    print(str(exc))
                    return 1
                print(f"key layout {key_layout.LAYOUT}: current")
                return 0
            done = await key_layout.migrate(redis, dry_run=args.dry_run, force=args.force)
            print(done.describe())
            return 1 if done.clash_count else 0
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"redis: {type(exc).__name__}: {_first_line(exc)}") from None
        finally:
            await redis.aclose()

    sys.exit(asyncio.run(run()))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _admin(args: argparse.Namespace) -> None:
    sys.exit(admin_cli.run(args))


KUBESIM_MISSING = (
    "kubesim is not installed (the simulator is its own distribution, agent-runtime-kubesim):"
    " install it with `pip install -e ./kubesim` from the repository root"
)


def _kubesim_missing(exc: ModuleNotFoundError) -> bool:
    """The simulator itself is missing (not one of its own dependencies)."""
    return exc.name is not None and (exc.name == "kubesim" or exc.name.startswith("kubesim."))


def _kubesim(args: argparse.Namespace) -> None:
    from kubesim.runner import run

    run(args)


def _no_kubesim(args: argparse.Namespace) -> None:
    print(f"agent-runtime: error: {KUBESIM_MISSING}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-runtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the service (uvicorn)")
    serve.add_argument("--mode", choices=["local", "server"], default=None)
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--env-file", default=None, help="dotenv file with AGENT_RUNTIME_* settings")
    serve.set_defaults(handler=_serve)

    db = commands.add_parser("db", help="database schema")
    db.add_argument("action", choices=["upgrade", "status"])
    db.add_argument("--env-file", default=None)
    db.set_defaults(handler=_db)

    redis = commands.add_parser("redis", help="Redis key layout")
    redis.add_argument("action", choices=["status", "migrate"])
    redis.add_argument("--dry-run", action="store_true", help="migrate: say, change nothing")
    redis.add_argument(
        "--force", action="store_true", help="migrate: even while job locks show replicas"
    )
    redis.add_argument("--env-file", default=None)
    redis.set_defaults(handler=_redis)

    admin = commands.add_parser(
        "admin",
        help="ask a running service (admin API): scopes, pods, sessions, drains, cleanup",
        description="The operators' command line over a running service's admin API "
        "(docs/reference/cli.md#admin). Tables for people, --json for scripts.",
    )
    admin_cli.add_arguments(admin)
    admin.set_defaults(handler=_admin)

    kubesim_help = "run the Kubernetes API simulator (tests, no cluster; installed on its own)"
    try:
        from kubesim.runner import add_arguments as kubesim_arguments
    except ModuleNotFoundError as exc:
        if not _kubesim_missing(exc):
            raise
        # whatever the arguments (-h too), the answer is how to install it
        commands.add_parser("kubesim", help=kubesim_help, add_help=False).set_defaults(
            handler=_no_kubesim, any_arguments=True
        )
    else:
        kubesim = commands.add_parser("kubesim", help=kubesim_help)
        kubesim_arguments(kubesim)
        kubesim.set_defaults(handler=_kubesim)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # as parse_args says it
    try:
        args.handler(args)
    except ConfigError as exc:  # one line, passwords in URLs masked
        print(f"agent-runtime: error: {logs.redact(str(exc))}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except KeyboardInterrupt:  # Ctrl-C before the server listens (or in `db`): no traceback
        print("agent-runtime: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
