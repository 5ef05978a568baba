#!/usr/bin/env bash
# The Redis topologies the tests run on besides the single server: a Redis Cluster of three
# masters with one replica each, and a Sentinel set (one master, one replica, three sentinels),
# all on loopback, in memory (no RDB, no AOF), from the machine's redis-server and redis-cli.
#
#   scripts/redis_topologies.sh [start]  start what is down (cluster nodes, then `redis-cli
#                                        --cluster create` on six fresh nodes; the sentinel
#                                        set's servers, then its sentinels) and wait until the
#                                        cluster says cluster_state:ok with 3 masters + 3
#                                        replicas and the sentinels agree on the master; a
#                                        slot a test left migrating or importing (a slot move
#                                        it did not finish) is set stable
#   scripts/redis_topologies.sh check    say what is usable, change nothing; exit 1 if not
#   scripts/redis_topologies.sh stop     stop the servers this script started (by PID), nothing
#                                        else, and forget their state (the next start is fresh)
#
# Ports (loopback, each overridable): the cluster's six nodes from
# AGENT_RUNTIME_REDIS_CLUSTER_PORT (default 17101: 17101-17106; bus ports +10000), the sentinel
# set's master and replica from AGENT_RUNTIME_REDIS_SENTINEL_DATA_PORT (17201: 17201-17202), its
# three sentinels from AGENT_RUNTIME_REDIS_SENTINEL_PORT (17211: 17211-17213); the master name
# is AGENT_RUNTIME_REDIS_SENTINEL_MASTER (agent-runtime-test): quorum 2, down after 1 s, failover
# timeout 5 s, so a test fails over in seconds. The tests reach them through
# AGENT_RUNTIME_TEST_REDIS_CLUSTER_URL and AGENT_RUNTIME_TEST_REDIS_SENTINEL_URL (their defaults
# name these ports).
#
# When none of a topology's servers that this script started runs any more (a reboot, a kill),
# `start` forgets their files (nodes.conf, sentinel.conf) and makes it anew; one server of it
# that died is restarted from its files and rejoins.
#
# A port that answers but whose server this script did not start is never touched: one line
# says so (exit 1). What this script started is recorded with its PID and start time, with the
# nodes' files, in the folder `topologies` of the services state folder
# (AGENT_RUNTIME_SERVICES_STATE_DIR; default /run/agent-runtime-services for root, else
# $XDG_RUNTIME_DIR or /tmp, agent-runtime-services-UID). Every change is printed (CHANGE:).
# scripts/services.sh runs this script with its own start | check | stop.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
action=${1:-start}
case "$action" in
  start|check|stop) ;;
  -h|--help) usage; exit 0 ;;
  *) echo "usage: $0 [start|check|stop] (see --help)" >&2; exit 2 ;;
esac

uid=$(id -u)
if [ "$uid" = 0 ]; then state_default=/run/agent-runtime-services
else state_default=${XDG_RUNTIME_DIR:-/tmp}/agent-runtime-services-$uid; fi
STATE=${AGENT_RUNTIME_SERVICES_STATE_DIR:-$state_default}/topologies
HOST=127.0.0.1
C_PORT=${AGENT_RUNTIME_REDIS_CLUSTER_PORT:-17101}
S_DATA_PORT=${AGENT_RUNTIME_REDIS_SENTINEL_DATA_PORT:-17201}
S_PORT=${AGENT_RUNTIME_REDIS_SENTINEL_PORT:-17211}
MASTER=${AGENT_RUNTIME_REDIS_SENTINEL_MASTER:-agent-runtime-test}
WAIT=${AGENT_RUNTIME_REDIS_TOPOLOGIES_WAIT:-60}  # seconds each topology may take to come up
SBIN=${AGENT_RUNTIME_SERVICES_SBIN-/usr/sbin:/sbin}

cluster_ports=() data_ports=() sentinel_ports=()
for i in 0 1 2 3 4 5; do cluster_ports+=($((C_PORT + i))); done
for i in 0 1; do data_ports+=($((S_DATA_PORT + i))); done
for i in 0 1 2; do sentinel_ports+=($((S_PORT + i))); done

say() { printf 'topologies: %s\n' "$*" >&2; }
change() { printf 'topologies: CHANGE: %s\n' "$*" >&2; }  # every change this script makes
sbin() { PATH="$PATH${SBIN:+:$SBIN}" command -v "$1" 2>/dev/null; }
cli() { timeout 5 redis-cli -h "$HOST" -p "$@" 2>/dev/null; }  # port command...
# shellcheck disable=SC2016  # $0 and $1 are the inner bash's arguments
port_open() { timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$HOST" "$1" 2>/dev/null; }

# --- what this script started: NAME -> "pid starttime what" (as services.sh) --------------------
starttime() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '$1 != "Z" { print $20 }'; }
record() { # name pid what...
  local name=$1 pid=$2; shift 2
  echo "$pid $(starttime "$pid") $*" > "$STATE/$name.run"
}
ours() { # name -> o_pid; true while the recorded process is the one that was started
  o_pid=''
  [ -f "$STATE/$1.run" ] || return 1
  local pid start
  read -r pid start _ < "$STATE/$1.run" || return 1
  [ -n "$pid" ] && [ "$(starttime "$pid")" = "$start" ] || return 1
  o_pid=$pid
}

wait_for() { # what seconds command... (true once the command succeeds)
  local what=$1 seconds=$2 deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then say "$what: not ready within ${seconds} s"; return 1; fi
    sleep 0.1
  done
}

foreign=()  # ports that answer with a server this script did not start
# server NAME PORT -> 0: ours and up; 1: down; 2: someone else's
server_state() {
  if ours "$1"; then port_open "$2" && return 0; return 1; fi
  port_open "$2" && return 2
  return 1
}

launch() { # name port what args... : a daemonized redis-server, recorded by its pidfile
  local name=$1 port=$2 what=$3 bin dir; shift 3
  bin=$(sbin redis-server) || { say "redis-server is missing (apt-get install redis-server)"; return 1; }
  dir=$STATE/$name
  mkdir -p "$dir" && rm -f "$dir/pid"
  change "starting $what on $HOST:$port (files and log in $dir)"
  "$bin" "$@" --daemonize yes --bind "$HOST" --port "$port" --dir "$dir" \
    --pidfile "$dir/pid" --logfile "$dir/log" || return 1
  wait_for "$what $port" 20 test -s "$dir/pid" || return 1
  record "$name" "$(cat "$dir/pid")" "$what $HOST:$port"
  wait_for "$what $port" 20 port_open "$port"
}

ensure() { # name port what args... ; start it if down and not someone else's
  local name=$1 port=$2 rc=0
  server_state "$name" "$port" || rc=$?
  case $rc in
    0) return 0 ;;
    2) foreign+=("$port"); say "$HOST:$port answers, but this script did not start that server: left as it is"; return 1 ;;
  esac
  if [ "$action" = check ]; then return 1; fi
  launch "$@"
}

# --- Redis Cluster -------------------------------------------------------------------------------
cluster_counts() { # port -> "state masters replicas" as that node sees the cluster
  local info nodes
  info=$(cli "$1" cluster info | tr -d '\r') || return 1
  nodes=$(cli "$1" cluster nodes) || return 1
  printf '%s %s %s\n' \
    "$(sed -n 's/^cluster_state://p' <<< "$info")" \
    "$(awk '$3 ~ /master/ && $3 !~ /fail/ && $8 == "connected" && NF > 8 { n++ } END { print n + 0 }' <<< "$nodes")" \
    "$(awk '$3 ~ /slave/ && $3 !~ /fail/ && $8 == "connected" { n++ } END { print n + 0 }' <<< "$nodes")"
}
cluster_ok() { # every node: ok, 3 masters with slots, 3 replicas
  local port
  for port in "${cluster_ports[@]}"; do [ "$(cluster_counts "$port")" = "ok 3 3" ] || return 1; done
}
open_slots() { # port -> the slots that node has in a migrating or importing state
  cli "$1" cluster nodes | awk '$3 ~ /myself/ { for (i = 9; i <= NF; i++) if ($i ~ /^\[[0-9]+-[<>]-/) { s = $i; sub(/^\[/, "", s); sub(/-.*/, "", s); print s } }'
}
settle_open_slots() { # a slot move a test left half done (interrupted): back to stable
  local port slot
  for port in "${cluster_ports[@]}"; do
    for slot in $(open_slots "$port"); do
      if [ "$action" = start ]; then
        change "slot $slot of the redis cluster node $HOST:$port was left migrating or importing: set stable"
        cli "$port" cluster setslot "$slot" stable > /dev/null || return 1
      else
        say "slot $slot of the redis cluster node $HOST:$port is migrating or importing (\`$0 start\` sets it stable)"
      fi
    done
  done
}
cluster_fresh() { # every node knows only itself and holds no slot
  local port
  for port in "${cluster_ports[@]}"; do
    [ "$(cli "$port" cluster info | tr -d '\r' | sed -n 's/^cluster_known_nodes://p')" = 1 ] || return 1
  done
}
none_alive() { # name-prefix ports... -> true when no server of these that we started runs
  local prefix=$1 port; shift
  for port in "$@"; do ! ours "$prefix-$port" || return 1; done
}
forget() { # what globs... : files of servers of ours that all are gone (a reboot, a kill):
  # a restart from them would bring back a stale cluster or master; start afresh instead
  local what=$1 path found=''; shift
  for path in "$@"; do [ -e "$path" ] && found=1; done
  [ -n "$found" ] || return 0
  change "forgetting the files of the $what this script started before (none of them runs)"
  rm -rf "$@"
}
cluster_up() { # -> 0 usable
  local port ok=0 addrs=()
  if [ "$action" = start ] && none_alive cluster "${cluster_ports[@]}"; then
    forget "redis cluster" "$STATE"/cluster-*
  fi
  for port in "${cluster_ports[@]}"; do
    ensure "cluster-$port" "$port" "redis cluster node (in memory)" --cluster-enabled yes \
      --cluster-config-file nodes.conf --cluster-node-timeout 3000 --save "" --appendonly no || ok=1
    addrs+=("$HOST:$port")
  done
  if [ $ok != 0 ]; then
    say "redis cluster ${cluster_ports[0]}-${cluster_ports[5]}: not usable (a node is down or not ours)"
    return 1
  fi
  if cluster_ok; then
    settle_open_slots || return 1
    say "redis cluster ${addrs[0]}-${cluster_ports[5]}: usable (3 masters, 3 replicas, started by this script)"; return 0
  fi
  if [ "$action" = start ] && cluster_fresh; then
    change "creating the redis cluster over ${addrs[*]} (3 masters, 1 replica each)"
    timeout "$WAIT" redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
      > "$STATE/cluster-create.log" 2>&1 || { say "redis-cli --cluster create failed: see $STATE/cluster-create.log"; return 1; }
  fi
  if [ "$action" = start ] && wait_for "redis cluster" "$WAIT" cluster_ok; then
    say "redis cluster ${addrs[0]}-${cluster_ports[5]}: usable (3 masters, 3 replicas, started by this script)"
    return 0
  fi
  say "redis cluster ${cluster_ports[0]}-${cluster_ports[5]}: not usable: $(cluster_counts "${cluster_ports[0]}" || echo 'no answer') (state masters replicas); \`$0 stop\` then \`$0 start\` makes it anew"
  return 1
}

# --- Sentinel ------------------------------------------------------------------------------------
sentinel_master() { # sentinel port -> "host:port" of the master it names
  cli "$1" sentinel get-master-addr-by-name "$MASTER" | paste -sd: -
}
sentinel_field() { # sentinel port field -> the value in SENTINEL MASTER
  cli "$1" sentinel master "$MASTER" | awk -v f="$2" 'prev == f { print; exit } { prev = $0 }'
}
sentinels_agree() { # every sentinel names the same master, knows the two others, and the
  # master has a replica that is in sync (so a forced failover has somewhere to go)
  local port first='' addr
  for port in "${sentinel_ports[@]}"; do
    addr=$(sentinel_master "$port") || return 1
    [ -n "$addr" ] || return 1
    [ -z "$first" ] || [ "$addr" = "$first" ] || return 1
    first=$addr
    [ "$(sentinel_field "$port" num-other-sentinels)" = 2 ] || return 1
    [ "$(sentinel_field "$port" num-slaves)" -ge 1 ] || return 1
    [[ $(sentinel_field "$port" flags) == master ]] || return 1
  done
  [ "$(cli "${first##*:}" info replication | tr -d '\r' | sed -n 's/^connected_slaves://p')" -ge 1 ]
}
sentinel_conf() { # port -> the config file a fresh sentinel starts from (it rewrites it)
  local port=$1 dir=$STATE/sentinel-$1
  mkdir -p "$dir"
  [ -s "$dir/sentinel.conf" ] && return 0
  cat > "$dir/sentinel.conf" <<EOF
port $port
bind $HOST
dir $dir
sentinel monitor $MASTER $HOST ${data_ports[0]} 2
sentinel down-after-milliseconds $MASTER 1000
sentinel failover-timeout $MASTER 5000
sentinel parallel-syncs $MASTER 1
EOF
}
sentinel_up() { # -> 0 usable
  local port ok=0 master='' role i
  if [ "$action" = start ] && none_alive data "${data_ports[@]}" && none_alive sentinel "${sentinel_ports[@]}"; then
    forget "redis sentinel set" "$STATE"/data-* "$STATE"/sentinel-*
  fi
  # the data servers: a restarted one joins the master the sentinels name, if they name one
  for port in "${sentinel_ports[@]}"; do
    if ours "sentinel-$port" && port_open "$port"; then master=$(sentinel_master "$port") && break; fi
  done
  for i in 0 1; do
    port=${data_ports[$i]} role=()
    if [ -n "$master" ] && [ "$master" != "$HOST:$port" ]; then role=(--replicaof "${master%:*}" "${master##*:}")
    elif [ -z "$master" ] && [ "$i" = 1 ]; then role=(--replicaof "$HOST" "${data_ports[0]}"); fi
    ensure "data-$port" "$port" "redis of the sentinel set (in memory)" --save "" --appendonly no "${role[@]}" || ok=1
  done
  for port in "${sentinel_ports[@]}"; do
    if [ "$action" = start ] && ! ours "sentinel-$port"; then sentinel_conf "$port"; fi
    ensure "sentinel-$port" "$port" "redis sentinel" "$STATE/sentinel-$port/sentinel.conf" --sentinel || ok=1
  done
  local where="redis sentinel set $MASTER (sentinels ${sentinel_ports[0]}-${sentinel_ports[2]}, servers ${data_ports[*]})"
  if [ $ok != 0 ]; then say "$where: not usable (a server is down or not ours)"; return 1; fi
  if sentinels_agree || { [ "$action" = start ] && wait_for "$where" "$WAIT" sentinels_agree; }; then
    say "$where: usable (master $(sentinel_master "${sentinel_ports[0]}"), started by this script)"
    return 0
  fi
  say "$where: not usable: the sentinels do not agree on a master with a replica yet"
  return 1
}

# --- stop ----------------------------------------------------------------------------------------
stop_all() {
  local file name rc=0 deadline
  shopt -s nullglob
  local files=("$STATE"/*.run)
  if [ ${#files[@]} -eq 0 ]; then say "nothing to stop: this script started no server (state folder $STATE)"; return 0; fi
  for file in "${files[@]}"; do
    name=$(basename "$file" .run)
    if ! ours "$name"; then
      say "$name: the process this script started is gone (pid $(cut -d' ' -f1 "$file")); nothing to stop"
      rm -f "$file"; continue
    fi
    change "stopping $(cut -d' ' -f3- "$file") (pid $o_pid, started by this script)"
    kill -s TERM "$o_pid" || true
  done
  for file in "${files[@]}"; do
    name=$(basename "$file" .run)
    [ -f "$file" ] || continue
    deadline=$((SECONDS + 30))
    while ours "$name"; do
      if [ $SECONDS -ge $deadline ]; then say "$name (pid $o_pid) did not stop within 30 s"; rc=1; break; fi
      sleep 0.2
    done
    ours "$name" || rm -f "$file"
  done
  if [ $rc = 0 ]; then  # nothing of ours runs any more: forget the cluster and sentinel state
    rm -rf "${STATE:?}"/cluster-* "${STATE:?}"/data-* "${STATE:?}"/sentinel-* "$STATE/cluster-create.log"
  fi
  return $rc
}

if [ "$action" = stop ]; then stop_all; exit $?; fi

command -v redis-cli >/dev/null || { say "redis-cli is missing (apt-get install redis-tools)"; exit 1; }
[ "$action" = check ] || mkdir -p "$STATE"
rc=0
cluster_up || rc=1
sentinel_up || rc=1
if [ ${#foreign[@]} -gt 0 ]; then
  say "ports ${foreign[*]} are taken by servers this script did not start: set AGENT_RUNTIME_REDIS_CLUSTER_PORT / AGENT_RUNTIME_REDIS_SENTINEL_DATA_PORT / AGENT_RUNTIME_REDIS_SENTINEL_PORT (and the AGENT_RUNTIME_TEST_REDIS_*_URL to match)"
fi
exit $rc
