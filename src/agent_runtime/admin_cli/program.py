"""``agent-runtime admin [options] COMMAND``: the arguments, where the service is and which
token to send, and the run (docs/reference/cli.md#admin). What each command asks and shows is
``commands.py``'s.

The options (``--url``, ``--token``, ``--token-file``, ``--json``/``-o``, ``--timeout``) go
before or after the command, as kubectl's flags do. Exit status: 0 done, 1 the service refused
or could not be reached (one line on stderr: the error code and message, or why), 2 a usage
error (argparse's, and the checks made before any call).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agent_runtime.admin_cli import commands, output
from agent_runtime.admin_cli.client import AdminClient, AdminFailure, Target, Unreachable
from agent_runtime.admin_cli.commands import MAX_DRAIN_SECONDS, MAX_PAGE, Command, UnexpectedAnswer
from agent_runtime.config import Settings

URL_ENV = "AGENT_RUNTIME_URL"
TOKEN_ENV = "AGENT_RUNTIME_ADMIN_TOKEN"
DEFAULT_URL = f"http://127.0.0.1:{Settings.model_fields['port'].default}"  # local mode's
DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 3600.0
MAX_TOKEN = 4096  # characters; a token file is read no further than this
EXIT_FAILED = 1

TOKEN_HELP = (
    "the admin token (one of AGENT_RUNTIME_ADMIN_TOKENS); default: $AGENT_RUNTIME_ADMIN_TOKEN. "
    "A token on the command line shows in `ps` and in shell history: prefer the variable or "
    "--token-file"
)


# --- the parser ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``admin`` parser's options and commands (``cli.py`` dispatches to ``run``)."""
    _options(parser, suppress=False)
    subcommands = parser.add_subparsers(dest="admin_command", required=True, metavar="COMMAND")

    def command(name: str, run: Command, help: str) -> argparse.ArgumentParser:
        sub = subcommands.add_parser(name, help=help, description=help)
        _options(sub, suppress=True)
        sub.set_defaults(admin_run=run, admin_parser=sub)
        return sub

    sub = command("scopes", commands.scopes, "scopes with their sessions, waiters and pods")
    sub.add_argument("--limit", type=_bounded_int(1, MAX_PAGE), help="one page of at most N")
    sub.add_argument("--cursor", type=_bounded_int(0, 2**63 - 1), help="the page from here")
    sub = command("scope", commands.scope, "one scope in detail: policy, pods, deploys")
    sub.add_argument("scope_id", metavar="SCOPE_ID")
    sub = command("pod", commands.pod, "one pod: record, registration, drain, foreign report")
    sub.add_argument("pod_id", metavar="POD_ID")
    sub = command("session", commands.session, "one session's binding and tombstone")
    sub.add_argument("session_id", metavar="SESSION_ID")
    sub.add_argument("--scope", dest="scope_id", metavar="SCOPE_ID", help="the tombstone's scope")
    command("foreign-pods", commands.foreign_pods, "pods with our labels that are not ours")
    sub = command("drains", commands.drains, "pods under a drain, soonest deadline first")
    sub.add_argument("--limit", type=_bounded_int(1, MAX_PAGE), default=50)
    sub = command("drain", commands.drain, "drain a pod, or every pod of ours on a node")
    sub.add_argument("kind", choices=["pod", "node"], metavar="pod|node")
    sub.add_argument("name", metavar="NAME")
    sub.add_argument(
        "--seconds",
        type=_bounded_int(0, MAX_DRAIN_SECONDS),
        help="until the sessions left are moved (default: the service's drain timeout)",
    )
    sub = command(
        "cleanup", commands.cleanup, "delete AgentServer pods in Kubernetes (or list them)"
    )
    sub.add_argument("-n", "--namespace", help="default: the service's default namespace")
    sub.add_argument("-l", "--selector", help="a label selector, ANDed with our own labels")
    sub.add_argument("--dry-run", action="store_true", help="list what would go, delete none")
    sub.add_argument("--yes", action="store_true", help="delete without --dry-run first")


def _options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The shared options, on ``admin`` (defaults) and on each command (``SUPPRESS``: only a
    value given after the command replaces the one before it)."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--url", default=default(None), help=f"the service; default ${URL_ENV}, else {DEFAULT_URL}"
    )
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--token", default=default(None), help=TOKEN_HELP)
    tokens.add_argument(
        "--token-file", default=default(None), help="read the admin token from this file"
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default=default("table"),
        help="table (people) or json (scripts: the answer's data)",
    )
    parser.add_argument(
        "--json", dest="output", action="store_const", const="json", default=default("table"),
        help="the same as -o json",
    )  # fmt: skip
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=default(DEFAULT_TIMEOUT),
        help=f"seconds a call may take (default {DEFAULT_TIMEOUT:g})",
    )


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isascii() or not text.isdigit() or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"an integer from {low} to {high}")
        return int(text)

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT:  # NaN fails too
        raise argparse.ArgumentTypeError(f"seconds, more than 0 and at most {MAX_TIMEOUT:g}")
    return value


# --- running a command -----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit status (usage errors exit 2 through argparse)."""
    parser: argparse.ArgumentParser = args.admin_parser
    if args.admin_run is commands.cleanup and not args.dry_run and not args.yes:
        parser.error("cleanup deletes pods: run it with --dry-run first, then with --yes")
    target = _target(args, parser)
    try:
        with AdminClient(target) as client:
            shown = args.admin_run(client, args, time.time())
    except AdminFailure as exc:
        return _fail(f"{exc.code}: {output.printable(exc.message)}")
    except Unreachable as exc:
        return _fail(output.printable(str(exc)))
    except (UnexpectedAnswer, KeyError, TypeError, AttributeError) as exc:
        # a success whose data this version cannot read (another version of the service)
        why = output.printable(str(exc))[:200]
        return _fail(f"the answer from {target.shown} is not what this version reads: {why}")
    try:
        if args.output == "json":
            print(output.as_json(shown.data))
        elif shown.text:
            print(shown.text)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    for note in shown.notes:
        print(note, file=sys.stderr)
    return 0


def _fail(message: str) -> int:
    print(f"agent-runtime: error: {message}", file=sys.stderr)
    return EXIT_FAILED


def _target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Target:
    source = "--url" if args.url else URL_ENV
    given = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    try:
        url = httpx.URL(given)
    except (httpx.InvalidURL, TypeError) as exc:
        parser.error(f"{source}: not a URL ({output.printable(str(exc))})")
    if url.scheme not in ("http", "https") or not url.host or url.query or url.fragment:
        parser.error(f"{source}: http:// or https://, a host, an optional path; no query")
    if url.userinfo:
        parser.error(f"{source}: no user or password in the URL (the token goes in --token)")
    return Target(url=url, token=_token(args, parser), timeout=args.timeout)


def _token(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    if args.token is not None and args.token_file is not None:  # one before, one after
        parser.error("--token and --token-file: give one")
    if args.token is not None:
        token, source = args.token, "--token"
    elif args.token_file is not None:
        source = "--token-file"
        try:
            with Path(args.token_file).open("rb") as file:
                raw = file.read(MAX_TOKEN + 2)  # a token, maybe a line end
        except OSError as exc:
            parser.error(f"--token-file: {exc.strerror or exc}")
        token = raw.decode("ascii", "replace").strip()
    elif os.environ.get(TOKEN_ENV):
        token, source = os.environ[TOKEN_ENV], TOKEN_ENV
    else:
        return None
    if not token or len(token) > MAX_TOKEN or not all("!" <= c <= "~" for c in token):
        parser.error(f"{source}: a token is 1-{MAX_TOKEN} visible ASCII characters, no spaces")
    return token
