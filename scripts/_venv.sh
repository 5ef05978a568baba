# Sourced by the operator scripts: the project's venv, created from the lock file if missing.
# Sets AR (the agent-runtime command) and PY (the venv's python). The service only: these scripts
# run it against real backends; the simulator (kubesim/) is installed by test.sh and demo_server.sh.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AGENT_RUNTIME_VENV:-$ROOT/.venv}"
if [[ ! -x "$VENV/bin/agent-runtime" ]]; then
  echo "setting up $VENV from requirements.lock ..." >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r "$ROOT/requirements.lock"
  "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
fi
AR="$VENV/bin/agent-runtime"
PY="$VENV/bin/python"

# The mode an env file asks for (AGENT_RUNTIME_MODE), empty if it does not say.
env_file_mode() {
  sed -n 's/^[[:space:]]*AGENT_RUNTIME_MODE[[:space:]]*=[[:space:]]*["'"'"']\{0,1\}\([a-z]*\).*/\1/p' "$1" | tail -1
}

# Wait until http://HOST:PORT/healthz answers 200, or fail after SECONDS.
wait_healthy() {
  local url="$1" seconds="$2" pid="${3:-}"
  "$PY" - "$url" "$seconds" "$pid" <<'PYEOF'
import os, sys, time, urllib.request
url, seconds, pid = sys.argv[1], float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    if pid:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            sys.exit(f"{url}: the process exited before it was healthy")
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.2)
sys.exit(f"{url}: not healthy within {seconds:g} s")
PYEOF
}
