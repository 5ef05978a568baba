#!/usr/bin/env bash
# Do the README's two commands work on a fresh Debian 12 (bookworm) machine?
#
# Builds a minimal Debian bookworm root with debootstrap (--variant=minbase: what a container
# or minimal cloud image has), installs only the packages README.md names in its
# `apt-get install` line, clones a committed ref of this repository into it, and runs as root,
# with CI=true, in a network namespace of its own (its own loopback: the host's Redis, MariaDB
# and PostgreSQL are out of reach, and nothing on the host answers it):
#   1. README command 1 (local mode): waits for /healthz, places one session with a route,
#      then stops the service;
#   2. README command 2 (./scripts/test.sh): installs and starts Redis, MariaDB and PostgreSQL
#      inside the root, then ruff, mypy, lint-imports and pytest.
# Prints PASS/FAIL and the wall time of every step; exits 0 only when all pass. The backends it
# started are stopped by PID, the namespace's mounts go with it, the host is left as found.
#
# Needs: root, debootstrap, iproute2 (ip netns, veth), nftables (NAT out of the namespace),
# util-linux (unshare), and access to a Debian mirror and to PyPI. Takes ~20 min.
#
#   sudo scripts/fresh_debian_check.sh [--dir DIR] [--reuse] [--keep] [--repo PATH] [--ref REF]
#        [--packages "P ..."] [--mirror URL] [-- PYTEST_ARGS...]
#
#   --dir DIR        working folder (default /tmp/agent-runtime-fresh-debian): base/ is the
#                    pristine debootstrap root, root/ the copy one run uses, logs/ every run's logs
#   --reuse          reuse DIR/base when it is complete (saves the ~1 min debootstrap)
#   --keep           keep DIR/root after the run (inspect it with chroot)
#   --repo / --ref   what to clone (default: this checkout, HEAD); a branch name or HEAD
#   --packages       install these Debian packages instead of the README's list
#   --mirror URL     Debian mirror (default: the host's apt source for bookworm; its
#                    security archive is the host's too, else URL's sibling debian-security)
#   PYTEST_ARGS      go to test.sh (e.g. -- -k healthz for a quick check of this script)
#
# Environment specifics: the host's CA bundle is copied in as PIP_CERT (pip then works behind
# a TLS-inspecting egress proxy, as the host's own pip does); PIP_INDEX_URL and
# PIP_DEFAULT_TIMEOUT are passed through when set. Nothing else of the host's pip or apt
# configuration is copied (local wheel folders would hide a package missing from PyPI).
set -euo pipefail

dir=/tmp/agent-runtime-fresh-debian
reuse=0 keep=0 packages=""
repo=$(cd "$(dirname "$0")/.." && pwd)
ref=HEAD
mirror=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --reuse) reuse=1; shift ;;
    --keep) keep=1; shift ;;
    --repo) repo=$2; shift 2 ;;
    --ref) ref=$2; shift 2 ;;
    --packages) packages=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
pytest_args=("$@")

say() { printf 'fresh-debian: %s\n' "$*" >&2; }
apt_uri() { # suite -> the host's first apt URI serving it (deb822 or one-line sources)
  cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v s="$1" '
    /^URIs:/ { u = $2 } /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == s) { print u; exit } }'
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk -v s="$1" '$1 == "deb" && $3 == s { print $2; exit }'
  return 0  # a missing sources file is no error
}
die() { say "$*"; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, ip netns)"
for tool in debootstrap ip nft unshare git; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install debootstrap iproute2 nftables git)"
done

[ -n "$mirror" ] || mirror=$(apt_uri bookworm | head -n 1)
[ -n "$mirror" ] || die "no bookworm mirror in the host's apt sources: give --mirror URL"
security=$(apt_uri bookworm-security | head -n 1)
security=${security:-${mirror%/debian}/debian-security}
dir=$(mkdir -p "$dir" && cd "$dir" && pwd)
base=$dir/base root=$dir/root
run_id=$(date +%Y%m%d-%H%M%S)
logs=$dir/logs/$run_id
mkdir -p "$logs"
exec 9>"$dir/.lock"
flock -n 9 || die "another check is running on $dir"

# --- what to run: read from the README of the ref under test -------------------------------
readme=$(git -C "$repo" show "$ref:README.md") || die "no README.md at $ref in $repo"
# The block under "## The two commands": the line after "# 1. ..." and the one after "# 2. ...".
readme_cmd() {
  printf '%s\n' "$readme" | awk -v n="$1" '
    /^## The two commands/ { on = 1 } on && /^## / && !/two commands/ { on = 0 }
    on && take { print; exit } on && $0 ~ "^# " n "\\. " { take = 1 }'
}
cmd1=$(readme_cmd 1) cmd2=$(readme_cmd 2)
[ -n "$cmd1" ] && [ -n "$cmd2" ] || die "README.md has no '# 1.' / '# 2.' commands under '## The two commands'"
if [ -z "$packages" ]; then
  packages=$(printf '%s\n' "$readme" | grep -o -m1 'apt-get install[^`]*' | sed 's/apt-get install//; s/ -[a-z-]*//g' | xargs || true)
  if [ -z "$packages" ]; then
    say "README.md names no Debian packages (no 'apt-get install' line): installing python3 only"
    packages=python3
  fi
fi
commit=$(git -C "$repo" rev-parse --verify "$ref^{commit}") || die "no commit $ref in $repo"
if [ "$ref" != HEAD ]; then
  git -C "$repo" show-ref -q --verify "refs/heads/$ref" || die "--ref takes HEAD or a branch name"
fi
say "checking $repo $ref (${commit:0:12}); packages: $packages; logs: $logs"

# --- network namespace: own loopback, NAT to the mirrors, nothing on the host reachable ------
ns=agent-rt-fresh
veth_host=arfresh-h veth_ns=arfresh-n net=10.213.77
ip netns list | grep -qw "$ns" && die "network namespace $ns exists (another check, or a crashed one: ip netns delete $ns)"
forward_before=$(cat /proc/sys/net/ipv4/ip_forward)
inner_pid=""
cleanup() {
  local rc=$?
  set +e
  if [ -n "$inner_pid" ] && kill -0 "$inner_pid" 2>/dev/null; then
    # unshare --fork ignores SIGTERM while it waits; --kill-child makes its death SIGKILL the
    # PID namespace's init, and with it everything in the namespace
    say "stopping the run (unshare, pid $inner_pid)"
    kill -KILL "$inner_pid"; wait "$inner_pid" 2>/dev/null
  fi
  local pids
  for _ in $(seq 20); do  # anything still in the namespace is ours: by PID, then it is gone
    pids=$(ip netns pids "$ns" 2>/dev/null) && [ -n "$pids" ] || break
    kill -KILL $pids 2>/dev/null; sleep 0.5
  done
  nft delete table ip agent_rt_fresh 2>/dev/null
  ip link delete "$veth_host" 2>/dev/null
  ip netns delete "$ns" 2>/dev/null
  echo "$forward_before" > /proc/sys/net/ipv4/ip_forward
  if grep -q " $root/" /proc/mounts; then
    say "WARNING: mounts left under $root, not deleting it:"; grep " $root/" /proc/mounts >&2
  elif [ "$keep" = 0 ] && [ -d "$root" ]; then
    rm -rf --one-file-system "$root"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$ns"
ip link add "$veth_host" type veth peer name "$veth_ns"
ip link set "$veth_ns" netns "$ns"
ip addr add "$net.1/30" dev "$veth_host" && ip link set "$veth_host" up
ip netns exec "$ns" ip addr add "$net.2/30" dev "$veth_ns"
ip netns exec "$ns" ip link set "$veth_ns" up
ip netns exec "$ns" ip link set lo up
ip netns exec "$ns" ip route add default via "$net.1"
echo 1 > /proc/sys/net/ipv4/ip_forward
nft -f - <<EOF
table ip agent_rt_fresh {
  chain postrouting { type nat hook postrouting priority srcnat; ip saddr $net.0/30 oifname != "$veth_host" masquerade; }
  chain input { type filter hook input priority filter;
    iifname "$veth_host" ct state established,related accept; iifname "$veth_host" drop; }
}
EOF
in_ns() { ip netns exec "$ns" "$@"; }

# --- the pristine base root --------------------------------------------------------------
t0=$SECONDS
base_how=reused
if [ "$reuse" = 1 ] && [ -f "$base/.fresh-debian-base" ]; then
  say "reusing $base"
else
  base_how=built
  rm -rf --one-file-system "$base"
  say "debootstrap bookworm (minbase) from $mirror into $base"
  in_ns debootstrap --variant=minbase bookworm "$base" "$mirror" > "$logs/debootstrap.log" 2>&1 \
    || die "debootstrap failed: $logs/debootstrap.log"
  cat > "$base/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
  echo freshdebian > "$base/etc/hostname"
  printf '127.0.0.1\tlocalhost\n127.0.1.1\tfreshdebian\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
    > "$base/etc/hosts"
  touch "$base/.fresh-debian-base"
fi
build_s=$((SECONDS - t0))

# --- this run's root: a copy of the base, the repository as a bundle -----------------------
[ -d "$root" ] && { grep -q " $root/" /proc/mounts && die "mounts under $root"; rm -rf --one-file-system "$root"; }
cp -a "$base" "$root"
# a resolver on the host's loopback (systemd-resolved) is out of the namespace's reach
resolv=/etc/resolv.conf
grep -q '^nameserver 127\.' "$resolv" && [ -f /run/systemd/resolve/resolv.conf ] && resolv=/run/systemd/resolve/resolv.conf
cp "$resolv" "$root/etc/resolv.conf"
mkdir -p "$root/fresh-check"
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$root/fresh-check/host-ca-bundle.pem"
git -C "$repo" bundle create "$root/fresh-check/repo.bundle" "$ref" 2>/dev/null
clone_args=(-c advice.detachedHead=false)
[ "$ref" != HEAD ] && clone_args+=(-b "$ref")
{
  printf 'packages=%q\ncmd1=%q\ncmd2=%q\n' "$packages" "$cmd1" "$cmd2"
  printf 'clone_args=(%s)\n' "$(printf '%q ' "${clone_args[@]}")"
  printf 'pytest_args=(%s)\n' "$(printf '%q ' "${pytest_args[@]+"${pytest_args[@]}"}")"
} > "$root/fresh-check/params.sh"

cat > "$root/fresh-check/inside.sh" <<'INSIDE'
# Runs inside the fresh root as PID 1's child of a new PID namespace. Writes result.txt.
set -uo pipefail
source /fresh-check/params.sh
out=/fresh-check
result() { echo "$1=$2" >> $out/result.txt; }
why() { tail -n 1 "$out/$1.log" | cut -c1-200; }  # a failed step's last log line
now() { date +%s; }
: > $out/result.txt

t=$(now)
{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $packages; } \
  > $out/prerequisites.log 2>&1
rc=$?
result prerequisites "$([ $rc = 0 ] && echo PASS || echo "FAIL: $(why prerequisites)") $(( $(now) - t ))s"

t=$(now)
git clone -q "${clone_args[@]}" /fresh-check/repo.bundle /root/agent-runtime > $out/clone.log 2>&1
rc=$?
result clone "$([ $rc = 0 ] && echo PASS || echo "FAIL: $(why clone)") $(( $(now) - t ))s"
[ $rc = 0 ] || exit 0
cd /root/agent-runtime

# 1. local mode: up when /healthz answers, good when a route places a session
probe() { # url [json body] -> prints the body; fails on a connection error or non-2xx
  python3 - "$@" <<'PY'
import sys, urllib.request
data = sys.argv[2].encode() if len(sys.argv) > 2 else None
req = urllib.request.Request(sys.argv[1], data=data, headers={"content-type": "application/json"})
print(urllib.request.urlopen(req, timeout=60).read().decode())
PY
}
t=$(now)
setsid bash -c "$cmd1" > $out/command1.log 2>&1 &
serve=$!
verdict="FAIL no /healthz within 1200s"
while [ $(( $(now) - t )) -lt 1200 ]; do
  if ! kill -0 $serve 2>/dev/null; then verdict="FAIL exited before /healthz answered"; break; fi
  if probe http://127.0.0.1:8091/healthz >> $out/command1.log 2>/dev/null; then
    up=$(( $(now) - t ))
    body='{"metadata": {"request_id": "fresh-1", "session_id": "fresh-s1", "bot_id": "bot-1", "extra": {"group_id": "grp-1"}}, "rawdata": {}}'
    answer=$(probe http://127.0.0.1:8091/api/session/route "$body" 2>&1)
    echo "route: $answer" >> $out/command1.log
    case "$answer" in
      *'"placement":"placed"'*) verdict="PASS healthz after ${up}s, route placed" ;;
      *) verdict="FAIL healthz after ${up}s, route: $answer" ;;
    esac
    break
  fi
  sleep 2
done
kill -TERM -- -$serve 2>/dev/null  # its process group: the shell and the service
for _ in $(seq 60); do kill -0 $serve 2>/dev/null || break; sleep 0.5; done
kill -KILL -- -$serve 2>/dev/null
wait $serve 2>/dev/null
result command1 "$verdict (total $(( $(now) - t ))s)"

# 2. the test suite (its backends are installed and started by scripts/services.sh)
t=$(now)
CI=true bash -c "$cmd2 \"\$@\"" cmd2 "${pytest_args[@]+"${pytest_args[@]}"}" > $out/command2.log 2>&1
rc=$?
line=$(grep -E '(passed|failed|errors?|no tests ran).* in [0-9.]+s' $out/command2.log | tail -n 1 | tr -d '=' | xargs)
result command2 "$([ $rc = 0 ] && echo PASS || echo "FAIL rc=$rc") $(( $(now) - t ))s: ${line:-no pytest summary (see command2.log)}"

# stop what test.sh started before the namespace goes: `services.sh stop` stops the servers it
# started, by PID; then any server still up in the root (a ref whose services.sh has no `stop`),
# by PID (PostgreSQL: SIGINT is its fast shutdown; Redis and MariaDB shut down on SIGTERM)
scripts/services.sh stop >> $out/command2.log 2>&1
stop() { # signal pid
  [ -n "$2" ] && kill -"$1" "$2" 2>/dev/null || return 0
  for _ in $(seq 120); do kill -0 "$2" 2>/dev/null || return 0; sleep 0.5; done
  echo "pid $2 did not stop" >> $out/command2.log
}
stop TERM "$(redis-cli -h 127.0.0.1 info server 2>/dev/null | tr -d '\r' | sed -n 's/^process_id://p')"
stop TERM "$(cat /run/mysqld/mysqld.pid 2>/dev/null)"
for f in /var/lib/postgresql/*/main/postmaster.pid; do
  if [ -f "$f" ]; then stop INT "$(head -n 1 "$f")"; fi
done
INSIDE

# --- run it: netns + new PID, mount and UTS namespaces + chroot ------------------------------
env_in=(HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM=dumb
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
[ -f "$root/fresh-check/host-ca-bundle.pem" ] && env_in+=(PIP_CERT=/fresh-check/host-ca-bundle.pem)
[ -n "${PIP_INDEX_URL:-}" ] && env_in+=("PIP_INDEX_URL=$PIP_INDEX_URL")
[ -n "${PIP_DEFAULT_TIMEOUT:-}" ] && env_in+=("PIP_DEFAULT_TIMEOUT=$PIP_DEFAULT_TIMEOUT")
say "running both commands inside (output: $logs)"
t0=$SECONDS
# The mount namespace is private: /proc, /sys, /dev/shm and /dev/pts mounted here vanish with
# it. A fresh /dev/shm keeps PostgreSQL's shared memory off the host's.
ip netns exec "$ns" unshare --pid --fork --kill-child --mount --uts --mount-proc="$root/proc" bash -c '
  root=$1; shift
  mount -t sysfs sysfs "$root/sys"
  mount -t tmpfs -o mode=1777 shm "$root/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666 devpts "$root/dev/pts"
  hostname freshdebian
  exec chroot "$root" /usr/bin/env -i "$@" /bin/bash /fresh-check/inside.sh
' fresh "$root" "${env_in[@]}" &
inner_pid=$!
wait "$inner_pid" || say "the inside run exited with $?"
inner_pid=""
inside_s=$((SECONDS - t0))
cp "$root"/fresh-check/*.log "$root/fresh-check/result.txt" "$logs/" 2>/dev/null

# --- report ----------------------------------------------------------------------------------
echo
echo "fresh Debian 12 check of ${commit:0:12} ($ref), packages: $packages"
echo "  base root     $base_how ${build_s}s"
ok=1
for step in prerequisites clone command1 command2; do
  line=$(sed -n "s/^$step=//p" "$logs/result.txt" 2>/dev/null)
  printf '  %-13s %s\n' "$step" "${line:-NOT RUN}"
  case "$line" in PASS*) ;; *) ok=0 ;; esac
done
echo "  inside total  ${inside_s}s; logs in $logs"
[ "$ok" = 1 ] && echo "PASS" || { echo "FAIL"; exit 1; }
