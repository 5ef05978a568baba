"""``kubesim`` or ``agent-runtime kubesim``: the simulator as a process, until Ctrl-C or SIGTERM
(exit 0).

Prints one line when it listens: ``kubesim: listening on URL, kubeconfig PATH``. A bad option
or a port it cannot bind ends it with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubesim.sim import KubeSim

EXIT_USAGE = 2
DEFAULT_GRACE = 1.0  # seconds; KubeSim's own default
DEFAULT_FIRST_POD_IP = "127.0.0.2"  # the kubelet's own default
DEFAULT_WATCH_HISTORY = 1000  # watch.DEFAULT_HISTORY (watch.py needs aiohttp)
DEFAULT_MAX_WATCHES = 256  # watch.DEFAULT_MAX_WATCHES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    parser.add_argument("--port", type=int, default=0, help="API port (0: any free one)")
    parser.add_argument(
        "--kubeconfig-out", default=None, help="write the kubeconfig here (default: a temp file)"
    )
    parser.add_argument(
        "--ready-delay", type=float, default=0.5, help="seconds from create to Ready"
    )
    parser.add_argument("--jitter", type=float, default=0.0, help="up to this many seconds more")
    parser.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE,
        help="longest graceful-delete wait in seconds",
    )
    parser.add_argument("--probe-period", type=float, default=0.2, help="readiness re-check")
    parser.add_argument("--sse-interval", type=float, default=1.0, help="AgentServer SSE pings")
    parser.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="a namespace that exists (repeatable; default: default)",
    )
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument(
        "--first-pod-ip",
        default=DEFAULT_FIRST_POD_IP,
        help="first loopback address pods get (give two simulators distinct ranges)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for jitter and ratios")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="how many nodes (kubesim-node, kubesim-node-2, ...; 1 to 1000)",
    )
    parser.add_argument(
        "--watch-history",
        type=int,
        default=DEFAULT_WATCH_HISTORY,
        help="events kept for resuming watches",
    )
    parser.add_argument(
        "--max-watches",
        type=int,
        default=DEFAULT_MAX_WATCHES,
        help="watch streams open at once (more: 429)",
    )
    parser.add_argument("--log-level", default="INFO")


def build_sim(args: argparse.Namespace) -> KubeSim:
    from kubesim.sim import KubeSim

    return KubeSim(
        host=args.host,
        port=args.port,
        ready_delay=args.ready_delay,
        jitter=args.jitter,
        grace_period=args.grace_period,
        probe_period=args.probe_period,
        sse_interval=args.sse_interval,
        namespaces=args.namespace or ["default"],
        token=args.token,
        kubeconfig_path=args.kubeconfig_out,
        seed=args.seed,
        first_pod_ip=args.first_pod_ip,
        nodes=args.nodes,
        watch_history=args.watch_history,
        max_watches=args.max_watches,
    )


async def serve(sim: KubeSim) -> None:
    """Run until SIGINT or SIGTERM, then stop everything."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await sim.start()
        print(f"kubesim: listening on {sim.url}, kubeconfig {sim.kubeconfig_path}", flush=True)
        await stop.wait()
    finally:
        await sim.stop()
        for sig in signals:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> None:
    try:
        logging.basicConfig(
            level=str(args.log_level).upper(),
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
        sim = build_sim(args)
        asyncio.run(serve(sim))
    except (ValueError, OSError) as exc:
        print(f"kubesim: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kubesim", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))
