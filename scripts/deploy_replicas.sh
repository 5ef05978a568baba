#!/usr/bin/env bash
# N replicas of the service on consecutive ports of this machine, sharing one Redis and one
# DB (server mode only: replicas cannot share an in-process fakeredis), as a Deployment runs
# them behind a Service. Waits until every /healthz answers, then until Ctrl-C / SIGTERM,
# and stops every replica on the way out (SIGTERM: each drains within its shutdown_timeout).
#
#   scripts/deploy_replicas.sh N ENV_FILE [FIRST_PORT]      (FIRST_PORT default 8091)
#
# Each replica gets AGENT_RUNTIME_PORT=FIRST_PORT+i and AGENT_RUNTIME_INSTANCE_ID=replica-i
# (these override the env file); logs go to ${AGENT_RUNTIME_LOG_DIR:-/tmp}/agent-runtime-PORT.log.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"

count="${1:-}"
env_file="${2:-}"
first_port="${3:-8091}"
if ! [[ "$count" =~ ^[1-9][0-9]*$ ]] || [[ -z "$env_file" || ! -f "$env_file" ]]; then
  echo "usage: $0 N ENV_FILE [FIRST_PORT]" >&2
  exit 2
fi
if [[ "$(env_file_mode "$env_file")" == "local" || "${AGENT_RUNTIME_MODE:-}" == "local" ]]; then
  echo "$0: local mode cannot run replicas (each would have its own in-process fakeredis);" \
    "use a server-mode env file" >&2
  exit 2
fi
log_dir="${AGENT_RUNTIME_LOG_DIR:-/tmp}"

"$AR" db upgrade --env-file "$env_file" >/dev/null

pids=()
stop_all() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT
trap 'exit 0' INT TERM

for ((i = 0; i < count; i++)); do
  port=$((first_port + i))
  AGENT_RUNTIME_PORT="$port" AGENT_RUNTIME_INSTANCE_ID="replica-$i" \
    "$AR" serve --mode server --env-file "$env_file" >"$log_dir/agent-runtime-$port.log" 2>&1 &
  pids+=("$!")
done
for ((i = 0; i < count; i++)); do
  port=$((first_port + i))
  if ! wait_healthy "http://127.0.0.1:$port/healthz" 60 "${pids[$i]}"; then
    echo "replica $i (port $port) did not come up; its log:" >&2
    tail -n 20 "$log_dir/agent-runtime-$port.log" >&2 || true
    exit 1
  fi
  echo "replica-$i: http://127.0.0.1:$port (pid ${pids[$i]}, log $log_dir/agent-runtime-$port.log)"
done
echo "$count replicas healthy; Ctrl-C stops them all"
wait -n "${pids[@]}" || true
echo "a replica exited; stopping the others" >&2
exit 1
