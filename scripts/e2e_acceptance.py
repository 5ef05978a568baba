#!/usr/bin/env python3
"""Scenarios A–N of docs/design/hld.md §4 against a RUNNING deployment, over real HTTP.

The scenarios are the ones CI runs against a stack it starts itself
(``tests/test_server_e2e.py``); here they are pointed at your deployment instead: its base
URL, the Redis it uses (read to check invariants: the four places, seats, placeholders) and
the Kubernetes API simulator it is configured with (the scenarios kill pods, fail health
checks and inject API faults through the simulator's control endpoint, which a real cluster
does not have). The deployment must run with the settings ``--print-settings`` shows (the
tokens the scenarios present, short job intervals so waits stay short).

  scripts/e2e_acceptance.py --print-settings > e2e.env      # then start the service with it
  scripts/e2e_acceptance.py --base-url http://127.0.0.1:8091 \\
      --redis-url redis://127.0.0.1:6379/5 --kubesim http://127.0.0.1:8001

Every scenario uses a scope of its own and deletes its pods at the end; nothing else is
written. A Redis db that holds keys other than this service's is refused unless
``--allow-foreign-keys``. Prints ``N passed, M failed`` and exits 1 on any failure, 2 when it
cannot start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
OUR_PREFIXES = ("session_manager:", "resource_manager:", "agent_runtime:")


def settings() -> dict[str, str]:
    sys.path.insert(0, str(TESTS))
    import test_server_e2e  # the scenarios' own settings: one definition

    return dict(test_server_e2e.SETTINGS)


def foreign_keys(redis_url: str) -> list[str]:
    from redis import Redis

    client = Redis.from_url(redis_url, decode_responses=True, socket_connect_timeout=3)
    try:
        found = []
        for key in client.scan_iter(count=1000):
            if not str(key).startswith(OUR_PREFIXES):
                found.append(str(key))
                if len(found) >= 3:
                    break
        return found
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="the deployment, e.g. http://127.0.0.1:8091")
    parser.add_argument("--redis-url", help="the Redis db the deployment uses")
    parser.add_argument("--kubesim", help="the simulator the deployment's kubeconfig names")
    parser.add_argument("--allow-foreign-keys", action="store_true")
    parser.add_argument("--print-settings", action="store_true", help="the env it needs, then exit")
    parser.add_argument("-k", dest="select", help="only scenarios matching (pytest -k)")
    args = parser.parse_args()
    if args.print_settings:
        for key, value in settings().items():
            print(f"{key}={value}")
        return
    if not (args.base_url and args.redis_url and args.kubesim):
        parser.error("--base-url, --redis-url and --kubesim are required")
    try:
        foreign = foreign_keys(args.redis_url)
    except Exception as exc:
        print(f"e2e_acceptance: redis {args.redis_url}: {exc}", file=sys.stderr)
        sys.exit(2)
    if foreign and not args.allow_foreign_keys:
        print(
            f"e2e_acceptance: {args.redis_url} holds keys that are not this service's "
            f"({', '.join(foreign)}…); use a db of its own or --allow-foreign-keys",
            file=sys.stderr,
        )
        sys.exit(2)
    env = {
        **os.environ,
        "AGENT_RUNTIME_E2E_BASE_URL": args.base_url,
        "AGENT_RUNTIME_E2E_REDIS_URL": args.redis_url,
        "AGENT_RUNTIME_E2E_KUBESIM_URL": args.kubesim,
    }
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", str(TESTS / "test_server_e2e.py"), "-q",
               "-p", "no:randomly", "-p", "no:cacheprovider", f"--junitxml={report}"]  # fmt: skip
        if args.select:
            cmd += ["-k", args.select]
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if not report.exists():
            print(run.stdout[-4000:] + run.stderr[-4000:], file=sys.stderr)
            sys.exit(2)
        passed = failed = skipped = 0
        for case in ET.parse(report).getroot().iter("testcase"):
            name = case.get("name", "?")
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                print(f"FAIL {name}")
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
                print(f"ok   {name}")
    if failed:
        print(run.stdout[-8000:])
    print(f"{passed} passed, {failed} failed" + (f" ({skipped} skipped)" if skipped else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
