#!/usr/bin/env bash
# Run one replica of the service in the foreground.
#
#   scripts/deploy.sh local                 embedded fakeredis + SQLite + fake Kubernetes
#   scripts/deploy.sh server ENV_FILE       real Redis, DB and Kubernetes from ENV_FILE
#                                           (schema upgraded first, as an operator would)
# Several replicas on one machine: scripts/deploy_replicas.sh. On Kubernetes: deploy/README.md.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"

mode="${1:-}"
env_file="${2:-}"
case "$mode" in
  local)
    if [[ -n "$env_file" ]]; then
      exec "$AR" serve --mode local --env-file "$env_file"
    fi
    exec "$AR" serve --mode local
    ;;
  server)
    if [[ -z "$env_file" || ! -f "$env_file" ]]; then
      echo "usage: $0 server ENV_FILE (see deploy/agent_runtime.server.env.example)" >&2
      exit 2
    fi
    "$AR" db upgrade --env-file "$env_file" >/dev/null
    exec "$AR" serve --mode server --env-file "$env_file"
    ;;
  *)
    echo "usage: $0 local [ENV_FILE] | $0 server ENV_FILE" >&2
    exit 2
    ;;
esac
