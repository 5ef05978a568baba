#!/usr/bin/env bash
# The test backends: Redis, MariaDB and PostgreSQL where the tests look for them —
# AGENT_RUNTIME_TEST_REDIS_URL (default redis://127.0.0.1:6379/13), AGENT_RUNTIME_TEST_MYSQL_URL
# (mysql+pymysql://root@127.0.0.1:3306/test: root with an empty password, database `test`) and
# AGENT_RUNTIME_TEST_PG_URL (postgresql+psycopg://root@127.0.0.1:5432/test: role root that may
# create databases, trust auth on loopback).
#
#   scripts/services.sh [start]   check each backend; start one that is down (installing it with
#                                 apt-get when missing: root), then set up what the tests need
#                                 on the servers it started itself, and on no other
#   scripts/services.sh check     check each backend, change nothing; exit 1 if one is unusable
#   scripts/services.sh stop      stop the servers this script started (by PID), nothing else
#
# A server this script did not start is never changed: when the tests cannot use it as it is,
# one line says why and what to do (which AGENT_RUNTIME_TEST_*_URL to set); `start` then exits
# 1 with CI=true (the run would fail on it), elsewhere 0 (the tests of that backend are skipped).
# Every change is printed. PostgreSQL: the Debian cluster on the URL's port (pg_lsclusters), not
# an assumed one. What `start` started is recorded with its PID and start time in the state
# folder (AGENT_RUNTIME_SERVICES_STATE_DIR; default /run/agent-runtime-services for root, else
# $XDG_RUNTIME_DIR or /tmp, agent-runtime-services-UID): `stop` ends exactly those processes, as
# the same user. A server started here stays set up (the MariaDB root login over TCP, the
# PostgreSQL trust line, role and database live in its data folder) after `stop`.
#
# The Redis Cluster and the Sentinel set of the topology tests are scripts/redis_topologies.sh's
# (its ports, its state in the folder `topologies` of the state folder): `start`, `check` and
# `stop` here run it with the same word (AGENT_RUNTIME_SERVICES_TOPOLOGIES names another script,
# empty: none), and a topology it cannot make usable counts as a backend that is not usable.
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
STATE=${AGENT_RUNTIME_SERVICES_STATE_DIR:-$state_default}
# test hooks (tests/test_services_script.py): where sbin programs and system folders are
SBIN=${AGENT_RUNTIME_SERVICES_SBIN-/usr/sbin:/sbin}
PG_ETC=${AGENT_RUNTIME_SERVICES_PG_ETC:-/etc/postgresql}
MYSQLD_RUN=${AGENT_RUNTIME_SERVICES_MYSQLD_RUN:-/run/mysqld}
TOPOLOGIES=${AGENT_RUNTIME_SERVICES_TOPOLOGIES-$(dirname "$0")/redis_topologies.sh}

say() { printf 'services: %s\n' "$*" >&2; }
change() { printf 'services: CHANGE: %s\n' "$*" >&2; }  # every change this script makes
have() { command -v "$1" >/dev/null 2>&1; }
sbin() { PATH="$PATH${SBIN:+:$SBIN}" command -v "$1" 2>/dev/null; }  # also /usr/sbin as a user
is_root() { [ "$uid" = 0 ]; }
in_ci() { [ "${CI:-}" = true ]; }
first_line() { printf '%s\n' "$1" | awk 'NF { print; found = 1; exit } END { if (!found) print "failed without a message" }'; }

# --- URLs --------------------------------------------------------------------------------------
urldecode() { local s=${1//+/ }; printf '%b' "${s//%/\\x}"; }
parse_url() { # URL -> u_user u_pass u_host u_port u_db
  local re='^[a-z0-9+]+://(([^:@/]*)(:([^@/]*))?@)?(\[[^]/]*\]|[^:/?]*)(:([0-9]+))?(/([^?]*))?'
  [[ $1 =~ $re ]] || return 1
  u_user=$(urldecode "${BASH_REMATCH[2]}") u_pass=$(urldecode "${BASH_REMATCH[4]}")
  u_host=${BASH_REMATCH[5]} u_port=${BASH_REMATCH[7]} u_db=${BASH_REMATCH[9]}
  u_host=${u_host#[} u_host=${u_host%]}
}
is_local() { case "$1" in 127.*|localhost|::1|"") return 0 ;; *) return 1 ;; esac; }
tcp_host() { case "$1" in localhost|"") echo 127.0.0.1 ;; *) echo "$1" ;; esac; }
# shellcheck disable=SC2016  # $0 and $1 are the inner bash's arguments
port_open() { timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; }

# --- what this script started: NAME -> "pid starttime what" -------------------------------------
# a process's start time (clock ticks since boot): with the PID, it names one process for good;
# nothing for a process that is gone or a zombie (exited, not yet reaped)
starttime() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '$1 != "Z" { print $20 }'; }
record() { # name pid what...
  local name=$1 pid=$2; shift 2
  mkdir -p "$STATE"
  echo "$pid $(starttime "$pid") $*" > "$STATE/$name"
}
ours() { # name -> o_pid o_what; true while the recorded process is the one that was started
  o_pid='' o_what=''
  [ -f "$STATE/$1" ] || return 1
  local pid start what
  read -r pid start what < "$STATE/$1" || return 1
  [ -n "$pid" ] && [ "$(starttime "$pid")" = "$start" ] || return 1
  o_pid=$pid o_what=$what
}

wait_for() { # what seconds command... (true once the command succeeds)
  local what=$1 seconds=$2 deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then say "$what did not come up within ${seconds} s"; return 1; fi
    sleep 0.5
  done
}

need_root() { # what -> true as root; else one line saying so
  is_root && return 0
  say "$1 needs root: run \`sudo scripts/services.sh\` (or sudo ./scripts/test.sh)"
  return 1
}

policy_made=''
apt_install() { # packages...
  need_root "installing $*" || return 1
  change "installing $* with apt-get"
  env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    # 101: the packages install without starting their services; this script starts them
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    policy_made=1
  fi
  local rc=0
  env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null || rc=$?
  if [ -n "$policy_made" ]; then rm -f /usr/sbin/policy-rc.d; policy_made=''; fi
  return $rc
}
trap '[ -z "$policy_made" ] || rm -f /usr/sbin/policy-rc.d' EXIT

unusable=()  # the backends the tests cannot use, for the last line

# --- Redis ---------------------------------------------------------------------------------------
REDIS_URL=${AGENT_RUNTIME_TEST_REDIS_URL:-redis://127.0.0.1:6379/13}
parse_url "$REDIS_URL" || { say "cannot read AGENT_RUNTIME_TEST_REDIS_URL"; exit 2; }
r_host=$(tcp_host "$u_host") r_port=${u_port:-6379}
r_where="redis $r_host:$r_port"

# NAME_check prints why the tests cannot use the server: nothing when they can, "?why" when it
# cannot tell (no client here: the tests will say)
redis_check() {
  have redis-cli || { echo "?redis-cli is missing (apt-get install redis-tools)"; return; }
  local answer
  answer=$(redis-cli -u "$REDIS_URL" ping 2>/dev/null | head -n 1) || true
  [ "$answer" = PONG ] || echo "PING answered '${answer:-nothing}'"
}
redis_hint() { echo "set AGENT_RUNTIME_TEST_REDIS_URL=redis://[:PASSWORD@]HOST:PORT/DB (db 13 down to 9 must be free)"; }
redis_start() {
  local bin
  bin=$(sbin redis-server) || { need_root "installing redis-server" && apt_install redis-server && bin=$(sbin redis-server); } || return 1
  mkdir -p "$STATE" && rm -f "$STATE/redis.pid"
  change "starting redis-server on $r_host:$r_port (loopback, no persistence; log $STATE/redis.log)"
  "$bin" --daemonize yes --bind "$r_host" --port "$r_port" --save "" --appendonly no \
    --dir "$STATE" --pidfile "$STATE/redis.pid" --logfile "$STATE/redis.log" || return 1
  wait_for "$r_where" 20 test -s "$STATE/redis.pid" || return 1
  record redis "$(cat "$STATE/redis.pid")" "redis-server $r_host:$r_port"
  wait_for "$r_where" 20 port_open "$r_host" "$r_port"
}
redis_setup() { :; }  # nothing to set up: any db of a server we started will do

# --- MariaDB -------------------------------------------------------------------------------------
MYSQL_URL=${AGENT_RUNTIME_TEST_MYSQL_URL:-mysql+pymysql://root@127.0.0.1:3306/test}
parse_url "$MYSQL_URL" || { say "cannot read AGENT_RUNTIME_TEST_MYSQL_URL"; exit 2; }
m_host=$(tcp_host "$u_host") m_port=${u_port:-3306} m_user=${u_user:-root} m_pass=$u_pass m_db=$u_db
m_where="mariadb $m_host:$m_port"

mysql_client() { sbin mariadb || sbin mysql; }
mysql_tcp() { # sql -> runs it as the URL's user over TCP
  local client; client=$(mysql_client) || return 1
  MYSQL_PWD=$m_pass "$client" --protocol=tcp -h "$m_host" -P "$m_port" -u "$m_user" \
    --connect-timeout=3 -N -e "$1" ${m_db:+"$m_db"}
}
mariadb_check() {
  mysql_client >/dev/null || { echo "?the mariadb client is missing (apt-get install mariadb-client)"; return; }
  local out
  out=$(mysql_tcp "SELECT 1" 2>&1) && return 0
  first_line "$out"
}
mariadb_hint() { echo "set AGENT_RUNTIME_TEST_MYSQL_URL=mysql+pymysql://USER:PASSWORD@$m_host:$m_port/DB (an account that may create and drop databases, DB an existing database)"; }
mariadb_start() {
  local bin datadir pid
  # a MariaDB that runs, but not on this port, is someone else's: never start a second one
  if pid=$(pgrep -x -d ' ' 'mariadbd|mysqld' 2>/dev/null) && [ -n "$pid" ]; then
    say "$m_where: nothing answers there, yet a MariaDB server runs (pid $pid), not started by this script: left as it is; $(mariadb_hint)"
    return 1
  fi
  bin=$(sbin mariadbd) || { need_root "installing mariadb-server" && apt_install mariadb-server && bin=$(sbin mariadbd); } || return 1
  need_root "starting mariadbd" || return 1
  datadir=$(my_print_defaults --mysqld 2>/dev/null | sed -n 's/^--datadir=//p' | tail -n 1)
  datadir=${datadir:-/var/lib/mysql}
  mkdir -p "$STATE" && rm -f "$STATE/mariadbd.pid"
  install -d -o mysql -g mysql "$MYSQLD_RUN" || return 1
  change "starting mariadbd on $m_host:$m_port (datadir $datadir; log $STATE/mariadbd.log)"
  start-stop-daemon --start --background --make-pidfile --pidfile "$STATE/mariadbd.pid" \
    --output "$STATE/mariadbd.log" --exec "$bin" -- --user=mysql --bind-address="$m_host" \
    --port="$m_port" || return 1
  wait_for "$m_where" 10 test -s "$STATE/mariadbd.pid" || return 1
  record mariadb "$(cat "$STATE/mariadbd.pid")" "mariadbd $m_host:$m_port datadir=$datadir"
  wait_for "$m_where" 60 port_open "$m_host" "$m_port"
}
mariadb_setup() { # on a server this script started: what the tests need
  local why=$1 client
  client=$(mysql_client) || return 1
  if [ "$m_user" != root ] || [ -n "$m_pass" ]; then
    say "$m_where: this script sets up only root with an empty password, not $m_user: create the account yourself"
    return 1
  fi
  case "$why" in
    *"Access denied"*)
      # a fresh Debian install lets root in only through the unix socket
      change "$m_where: root may log in over TCP from 127.0.0.1 with an empty password (a loopback test server)"
      "$client" -uroot -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD(''); CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; FLUSH PRIVILEGES;"
      ;;
  esac
  if [ -n "$m_db" ] && ! mysql_tcp "SELECT 1" >/dev/null 2>&1; then
    change "$m_where: creating database $m_db"
    m_db='' mysql_tcp "CREATE DATABASE IF NOT EXISTS \`$u_db\`" >/dev/null
  fi
}

# --- PostgreSQL ----------------------------------------------------------------------------------
PG_URL=${AGENT_RUNTIME_TEST_PG_URL:-postgresql+psycopg://root@127.0.0.1:5432/test}
parse_url "$PG_URL" || { say "cannot read AGENT_RUNTIME_TEST_PG_URL"; exit 2; }
p_host=$(tcp_host "$u_host") p_port=${u_port:-5432} p_user=${u_user:-root} p_pass=$u_pass p_db=${u_db:-postgres}
p_where="postgresql $p_host:$p_port"

clusters() { # ver name port status owner datadir log, one line per Debian cluster
  if have pg_lsclusters; then pg_lsclusters --no-header 2>/dev/null || true; fi
}
cluster_on() { clusters | awk -v p="$1" '$3 == p' | head -n 1; }
as_owner() { # owner command... (from /: the owner may not enter the caller's folder)
  local owner=$1; shift
  (cd / && runuser -u "$owner" -- "$@")
}
postgresql_check() {
  have psql || { echo "?psql is missing (apt-get install postgresql-client)"; return; }
  local out
  out=$(PGPASSWORD=${p_pass:-${PGPASSWORD:-}} PGCONNECT_TIMEOUT=3 psql -wXAtq \
    "host=$p_host port=$p_port user=$p_user dbname=$p_db" \
    -c "SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user" 2>&1) \
    || { first_line "$out"; return; }
  [ "$out" = t ] || echo "role $p_user may not create databases"
}
postgresql_hint() {
  local online others
  online=$(clusters | awk -v p="$p_port" '$3 != p && $4 ~ /^online/ { print $3; exit }')
  if [ -n "$online" ]; then  # the PostgreSQL that runs here, on its own port
    echo "PostgreSQL runs here on port $online (pg_lsclusters): set AGENT_RUNTIME_TEST_PG_URL=postgresql+psycopg://$p_user@127.0.0.1:$online/$p_db (a role that may create databases)"
    return
  fi
  others=$(clusters | awk '{printf "%s%s/%s on port %s (%s)", sep, $1, $2, $3, $4; sep = ", "}')
  echo "set AGENT_RUNTIME_TEST_PG_URL=postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (a role that may create databases)${others:+; clusters here: $others}"
}
postgresql_start() {
  local line ver name port status owner datadir
  line=$(cluster_on "$p_port")
  if [ -z "$line" ] && ! have pg_ctlcluster; then
    need_root "installing postgresql" && apt_install postgresql || return 1
    line=$(cluster_on "$p_port")
  fi
  if [ -z "$line" ] && [ -z "$(clusters)" ] && have pg_createcluster; then
    need_root "creating a PostgreSQL cluster" || return 1
    ver=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)
    change "creating PostgreSQL cluster $ver/main on port $p_port"
    (cd / && pg_createcluster "$ver" main --port "$p_port" >/dev/null)
    line=$(cluster_on "$p_port")
  fi
  if [ -z "$line" ]; then
    say "$p_where: no PostgreSQL cluster on port $p_port; $(postgresql_hint)"
    return 1
  fi
  read -r ver name port status owner datadir _ <<< "$line"
  if [ "$status" != down ]; then
    say "$p_where: cluster $ver/$name is $status but does not answer on $p_host (not started by this script: left as it is); $(postgresql_hint)"
    return 1
  fi
  need_root "starting PostgreSQL cluster $ver/$name" || return 1
  change "starting PostgreSQL cluster $ver/$name on port $port (datadir $datadir)"
  (cd / && pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start) || return 1
  wait_for "$p_where" 60 pg_isready -q -h "$p_host" -p "$p_port" || return 1
  record postgresql "$(head -n 1 "$datadir/postmaster.pid")" "postgresql cluster $ver/$name (owner $owner)"
}
postgresql_setup() { # on a cluster this script started: trust on loopback, the role, the database
  local ver name owner hba mask=32
  [[ $o_what =~ cluster\ ([^/]+)/([^ ]+)\ \(owner\ ([^\)]+)\) ]] || return 1
  ver=${BASH_REMATCH[1]} name=${BASH_REMATCH[2]} owner=${BASH_REMATCH[3]}
  if [ -n "$p_pass" ]; then
    say "$p_where: this script sets up roles without a password only, not $p_user: create it yourself"
    return 1
  fi
  hba=$PG_ETC/$ver/$name/pg_hba.conf
  [[ $p_host == *:* ]] && mask=128
  if ! grep -Eq "^host[[:space:]]+all[[:space:]]+all[[:space:]]+$p_host/${mask}[[:space:]]+trust" "$hba"; then
    change "$p_where: trust auth from $p_host/$mask (first line of $hba), reloading"
    sed -i "1i host all all $p_host/$mask trust" "$hba"
    (cd / && pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" reload)
  fi
  if [ "$(as_owner "$owner" psql -p "$p_port" -XAtqc "SELECT 1 FROM pg_roles WHERE rolname = '$p_user'")" != 1 ]; then
    change "$p_where: creating role $p_user (superuser, login)"
    as_owner "$owner" psql -p "$p_port" -Xqc "CREATE ROLE \"$p_user\" SUPERUSER LOGIN"
  fi
  if [ "$(as_owner "$owner" psql -p "$p_port" -XAtqc "SELECT 1 FROM pg_database WHERE datname = '$p_db'")" != 1 ]; then
    change "$p_where: creating database $p_db (owner $p_user)"
    as_owner "$owner" createdb -p "$p_port" -O "$p_user" "$p_db"
  fi
}

# --- stop ----------------------------------------------------------------------------------------
stop_one() { # name signal (redis, mariadbd: SIGTERM; postgres: SIGINT, its fast shutdown)
  local name=$1 sig=$2
  [ -f "$STATE/$name" ] || return 0
  if ! ours "$name"; then
    say "$name: the process this script started is gone (pid $(cut -d' ' -f1 "$STATE/$name")); nothing to stop"
    rm -f "$STATE/$name"
    return 0
  fi
  change "stopping $o_what (pid $o_pid, started by this script)"
  kill -s "$sig" "$o_pid"
  local deadline=$((SECONDS + 60))
  while ours "$name"; do
    if [ $SECONDS -ge $deadline ]; then say "$name (pid $o_pid) did not stop within 60 s"; return 1; fi
    sleep 0.5
  done
  rm -f "$STATE/$name"
}

topologies() { # start|check|stop -> redis_topologies.sh with the same word (none: true)
  [ -n "$TOPOLOGIES" ] || return 0
  bash "$TOPOLOGIES" "$1"
}

if [ "$action" = stop ]; then
  rc=0
  topologies stop || rc=1
  if ! [ -f "$STATE/redis" ] && ! [ -f "$STATE/mariadb" ] && ! [ -f "$STATE/postgresql" ]; then
    say "nothing to stop: this script started no server (state folder $STATE)"
    exit $rc
  fi
  stop_one postgresql INT || rc=1
  stop_one mariadb TERM || rc=1
  stop_one redis TERM || rc=1
  exit $rc
fi

# --- check / start -------------------------------------------------------------------------------
# install in one go what a local backend that is down lacks (the checks need the clients too)
if [ "$action" = start ]; then
  packages=()
  if is_local "$r_host"; then
    # the topologies run the machine's redis-server even when the single server answers
    if ! port_open "$r_host" "$r_port" || [ -n "$TOPOLOGIES" ]; then
      sbin redis-server >/dev/null || packages+=(redis-server)
    fi
    have redis-cli || [[ " ${packages[*]} " == *" redis-server "* ]] || packages+=(redis-tools)
  fi
  if is_local "$m_host"; then
    port_open "$m_host" "$m_port" || pgrep -x 'mariadbd|mysqld' >/dev/null 2>&1 \
      || sbin mariadbd >/dev/null || packages+=(mariadb-server)
    mysql_client >/dev/null || [[ " ${packages[*]} " == *" mariadb-server "* ]] || packages+=(mariadb-client)
  fi
  if is_local "$p_host"; then
    port_open "$p_host" "$p_port" || have pg_ctlcluster || packages+=(postgresql)
    have psql || [[ " ${packages[*]} " == *" postgresql "* ]] || packages+=(postgresql-client)
  fi
  if [ ${#packages[@]} -gt 0 ]; then apt_install "${packages[@]}" || true; fi
fi

backend() { # name where host port
  local name=$1 where=$2 host=$3 port=$4 why mine=''
  if ours "$name"; then mine=" (started by this script, pid $o_pid)"; fi
  if ! port_open "$host" "$port"; then
    if ! is_local "$host"; then
      say "$where: does not answer (not on this machine: not managed here); $("${name}_hint")"
      unusable+=("$name"); return
    fi
    if [ "$action" = check ]; then
      say "$where: does not answer${mine}: \`scripts/services.sh\` starts it, or $("${name}_hint")"
      unusable+=("$name"); return
    fi
    if [ -n "$mine" ]; then
      wait_for "$where" 60 port_open "$host" "$port" || { unusable+=("$name"); return; }
    else
      "${name}_start" || { unusable+=("$name"); return; }
      ours "$name" && mine=" (started by this script, pid $o_pid)"
    fi
  fi
  why=$("${name}_check")
  if [ -n "$why" ] && [[ $why != "?"* ]] && [ -n "$mine" ] && [ "$action" = start ]; then
    "${name}_setup" "$why" || true
    why=$("${name}_check")
  fi
  if [ -z "$why" ]; then
    say "$where: usable${mine:- (already running, not started by this script: left as it is)}"
  elif [[ $why == "?"* ]]; then
    say "$where: answers; not checked: ${why#?}${mine}"
  elif [ -n "$mine" ]; then
    say "$where: not usable: $why${mine}"; unusable+=("$name")
  else
    say "$where: runs, but the tests cannot use it as it is ($why); not changing a server this script did not start: $("${name}_hint")"
    unusable+=("$name")
  fi
}

backend redis "$r_where" "$r_host" "$r_port"
backend mariadb "$m_where" "$m_host" "$m_port"
backend postgresql "$p_where" "$p_host" "$p_port"
if [ -n "$TOPOLOGIES" ]; then
  topologies "$action" || unusable+=(redis-topologies)
fi

if [ ${#unusable[@]} -eq 0 ]; then
  say "redis${TOPOLOGIES:+ (single, cluster, sentinel)}, mariadb and postgresql are ready"
  exit 0
fi
if [ "$action" = check ] || in_ci; then
  say "not usable: ${unusable[*]}$(in_ci && echo " (CI=true: the test run would fail on it)")"
  exit 1
fi
say "not usable: ${unusable[*]}: their tests will be skipped (with CI=true they fail)"
