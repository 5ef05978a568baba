#!/usr/bin/env bash
# Server mode on one machine, in one command: the Kubernetes API simulator (kubesim) and
# `agent-runtime serve --mode server` against the local Redis (db 5) and MariaDB (database
# agent_runtime_demo, created if missing, schema upgraded). Prints the URLs and curl examples;
# Ctrl-C stops both. Needs .venv (README, command 1), into which it installs the simulator (its
# own distribution, kubesim/) when missing; starts Redis and MariaDB with scripts/services.sh
# when they do not answer.
#
# Knobs: DEMO_PORT (8091), DEMO_SIM_PORT (8001), DEMO_REDIS_DB (5), DEMO_DB_NAME
# (agent_runtime_demo), DEMO_ADMIN_TOKEN (demo-admin); AGENT_RUNTIME_* settings pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${DEMO_PORT:-8091}
SIM_PORT=${DEMO_SIM_PORT:-8001}
REDIS_DB=${DEMO_REDIS_DB:-5}
DB_NAME=${DEMO_DB_NAME:-agent_runtime_demo}
ADMIN_TOKEN=${DEMO_ADMIN_TOKEN:-demo-admin}
BIN=.venv/bin
MARKER=agent_runtime_demo:owner  # the Redis db is ours to flush only while it carries this

log() { printf 'demo: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

[ -x "$BIN/agent-runtime" ] || die "no $BIN/agent-runtime: create the venv first (README, command 1)"
# the simulator is not part of the service's distribution: installed once, next to it
if ! "$BIN/python" -c 'import kubesim.runner' 2>/dev/null; then
  log "installing the Kubernetes API simulator: pip install --no-deps -e ./kubesim"
  "$BIN/python" -m pip install -q --no-deps -e ./kubesim
fi

# --- backends --------------------------------------------------------------------------------
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 \
   || ! mariadb-admin -h 127.0.0.1 -P 3306 -uroot ping >/dev/null 2>&1; then
  scripts/services.sh
fi

# Redis: a db of its own, emptied at start (pods of an earlier demo died with its simulator)
rcli() { redis-cli -h 127.0.0.1 -p 6379 -n "$REDIS_DB" "$@"; }
keys=$(rcli dbsize)
if [ "$keys" != 0 ] && [ -z "$(rcli get "$MARKER")" ]; then
  die "redis db $REDIS_DB holds $keys keys that are not the demo's; pick another with DEMO_REDIS_DB"
fi
printf 'MULTI\nFLUSHDB\nSET %s demo\nEXEC\n' "$MARKER" | rcli >/dev/null

# MariaDB: the demo's database; the configuration pushed into it stays between runs
mariadb -h 127.0.0.1 -P 3306 -uroot \
  -e "CREATE DATABASE IF NOT EXISTS \`$DB_NAME\` CHARACTER SET utf8mb4"

# --- settings --------------------------------------------------------------------------------
work=$(mktemp -d -t agent-runtime-demo.XXXXXX)
# kubernetes_asyncio honours proxy variables, and a pod's service account would win over the
# kubeconfig: the simulator is on loopback and we are not in a cluster
unset HTTP_PROXY HTTPS_PROXY ALL_PROXY http_proxy https_proxy all_proxy
unset KUBERNETES_SERVICE_HOST KUBERNETES_SERVICE_PORT
export AGENT_RUNTIME_REDIS_URL="redis://127.0.0.1:6379/$REDIS_DB"
export AGENT_RUNTIME_DATABASE_URL="mysql+pymysql://root@127.0.0.1:3306/$DB_NAME"
export AGENT_RUNTIME_ADMIN_TOKENS="$ADMIN_TOKEN"
# the demo's gateway is the user at this terminal: route and touch open, said explicitly
export AGENT_RUNTIME_ALLOW_OPEN_GATEWAY=true
export AGENT_RUNTIME_KUBECONFIG="$work/kubeconfig"
export AGENT_RUNTIME_WATCH_INTERVAL=${AGENT_RUNTIME_WATCH_INTERVAL:-2}
export AGENT_RUNTIME_RECONCILE_INTERVAL=${AGENT_RUNTIME_RECONCILE_INTERVAL:-10}

"$BIN/agent-runtime" db upgrade

# --- the two processes -----------------------------------------------------------------------
sim_pid='' server_pid=''
stop() {
  trap - INT TERM EXIT
  local pid deadline=$((SECONDS + 15))
  for pid in $server_pid $sim_pid; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in $server_pid $sim_pid; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
  log "stopped"
}
trap stop EXIT
trap 'exit 130' INT TERM

alive() { kill -0 "$1" 2>/dev/null || die "$2 exited; see the lines above"; }

# own sessions: Ctrl-C reaches this script only, which stops both with one SIGTERM each
setsid "$BIN/agent-runtime" kubesim --port "$SIM_PORT" --kubeconfig-out "$work/kubeconfig" \
  --ready-delay 0.5 --jitter 0.2 --log-level WARNING &
sim_pid=$!
deadline=$((SECONDS + 30))
until [ -s "$work/kubeconfig" ]; do
  alive "$sim_pid" kubesim
  [ $SECONDS -lt $deadline ] || die "kubesim did not start within 30 s"
  sleep 0.1
done

setsid "$BIN/agent-runtime" serve --mode server --host 127.0.0.1 --port "$PORT" &
server_pid=$!
healthy() {
  "$BIN/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
    "http://127.0.0.1:$PORT/healthz" 2>/dev/null
}
deadline=$((SECONDS + 60))
until healthy; do
  alive "$server_pid" "agent-runtime serve"
  [ $SECONDS -lt $deadline ] || die "agent-runtime did not answer /healthz within 60 s"
  sleep 0.2
done

S="http://127.0.0.1:$PORT/api/session"
K="http://127.0.0.1:$SIM_PORT"
cat <<EOF

agent-runtime (server mode)   http://127.0.0.1:$PORT   (/healthz, /metrics)
Kubernetes API (kubesim)      $K   (kubeconfig $AGENT_RUNTIME_KUBECONFIG)
Redis db $REDIS_DB, MariaDB database $DB_NAME, admin token $ADMIN_TOKEN

Try (another terminal):
  H='content-type: application/json'; A='authorization: Bearer $ADMIN_TOKEN'
  curl -s -XPOST $S/config_sync -H "\$H" -H "\$A" -d '{"metadata": {"request_id": "demo-1"},
    "rawdata": {"kind": "template", "op": "sync", "item": {"template_id": "demo",
      "image": "agentserver:demo", "scope_concurrency": 4, "pod_concurrency": 2,
      "ready_poll_interval": 0.2}}}'
  curl -s -XPOST $S/config_sync -H "\$H" -H "\$A" -d '{"metadata": {"request_id": "demo-2"},
    "rawdata": {"kind": "routing_rule", "op": "sync",
      "item": {"group_id": "*", "bot_id": "*", "template_id": "demo"}}}'
  curl -s -XPOST $S/route -H "\$H" -d '{"metadata": {"request_id": "demo-3",
    "session_id": "s-1", "bot_id": "bot-1", "extra": {"group_id": "grp-1"}}}'
  curl -sN <pod_sse_url from the answer>     # the pod's SSE stream (Ctrl-C to leave it)
  curl -s -XPOST $S/touch -H "\$H" -d '{"metadata": {"session_id": "s-1"}}'
  curl -s -XPOST $S/touch -H "\$H" -d '{"metadata": {"session_id": "s-1"}, "rawdata": {"eos": true}}'
  curl -s $K/_sim/state                       # pods as Kubernetes sees them
  curl -s -XPOST $K/_sim/pods/default/<pod_id>/kill -d '{"mode": "fail"}'   # then route again

Ctrl-C stops both.
EOF

wait -n "$server_pid" "$sim_pid" || true
alive "$server_pid" "agent-runtime serve"
alive "$sim_pid" kubesim
