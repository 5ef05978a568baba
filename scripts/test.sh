#!/usr/bin/env bash
# The whole test suite, from a fresh clone: backends up, a venv with the locked versions,
# then lint, format, types, import boundaries and pytest (fakeredis + real Redis, SQLite +
# MariaDB + PostgreSQL). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${AGENT_RUNTIME_SKIP_SERVICES:-}" != "1" ]; then
  scripts/services.sh
fi

# As root (sudo, su) in a checkout that a user owns: only the services step above runs as
# root; the venv, the caches and the tests run as the checkout's owner, so that nothing in it
# becomes root's. What an earlier run as root left there goes back to the owner first.
owner=$(stat -c %U .)
if [ "$(id -u)" = 0 ] && [ "$owner" != root ] && [ "$owner" != UNKNOWN ]; then
  left=$(find . -xdev -path ./.git -prune -o -user 0 -print | wc -l)
  if [ "$left" -gt 0 ]; then
    echo "test.sh: giving $left root-owned files in the checkout (an earlier run as root) back to $owner" >&2
    find . -xdev -path ./.git -prune -o -user 0 -exec chown -h "$(stat -c %u:%g .)" {} +
  fi
  echo "test.sh: running the rest as $owner, the checkout's owner" >&2
  exec runuser -u "$owner" -- env AGENT_RUNTIME_SKIP_SERVICES=1 "$PWD/scripts/test.sh" "$@"
fi

PY=${PYTHON:-python3}
# A venv made while python3-venv was missing has a python but no pip: make it anew.
if [ ! -x .venv/bin/python ] || [ ! -x .venv/bin/pip ]; then
  "$PY" -m venv --clear .venv
fi
stamp=.venv/.installed-$(cat requirements.lock pyproject.toml kubesim/pyproject.toml client/pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps -e .
  # the Kubernetes API simulator: its own distribution, which the tests use (docs/spec/kubesim.md)
  .venv/bin/python -m pip install -q --no-deps -e ./kubesim
  # the gateway's client: its own distribution, which the e2e scripts and the load test use
  .venv/bin/python -m pip install -q --no-deps -e ./client
  rm -f .venv/.installed-* && touch "$stamp"
fi

echo "== ruff";         .venv/bin/ruff check .
echo "== ruff format";  .venv/bin/ruff format --check .
echo "== mypy";         .venv/bin/mypy
echo "== import-linter"; .venv/bin/lint-imports
echo "== pytest"
exec .venv/bin/pytest "$@"
