"""scripts/redis_topologies.sh for real: a cluster of 3 + 3 and a Sentinel set started on
ports of their own (never the ones the tests use), checked, and stopped by PID — a server on
one of its ports that it did not start is left alone and named.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from helpers import IN_CI

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "redis_topologies.sh"
BASH = shutil.which("bash") or "/bin/bash"


def port_free(port: int) -> bool:
    with socket.socket() as sock:  # as a server binds (TIME_WAIT is no owner)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_block() -> dict[str, int]:
    """Three blocks of ports nobody uses: the cluster's six (and their bus ports +10000), the
    set's two servers, its three sentinels."""
    for base in range(21000, 29000, 50):
        wanted = [*range(base, base + 6), *range(base + 10000, base + 10006)]
        wanted += [*range(base + 20, base + 22), *range(base + 30, base + 33)]
        if all(port_free(p) for p in wanted):
            return {"cluster": base, "data": base + 20, "sentinel": base + 30}
    pytest.fail("no free block of ports for the topologies")


@pytest.fixture
def topo(tmp_path: Path) -> Iterator[dict[str, str]]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if IN_CI:
            pytest.fail("CI=true and redis-server / redis-cli are missing (services.sh installs)")
        pytest.skip("redis-server / redis-cli are not installed")
    ports = free_block()
    env = {
        **{k: v for k, v in os.environ.items() if k != "CI"},
        "AGENT_RUNTIME_SERVICES_STATE_DIR": str(tmp_path / "state"),
        "AGENT_RUNTIME_REDIS_CLUSTER_PORT": str(ports["cluster"]),
        "AGENT_RUNTIME_REDIS_SENTINEL_DATA_PORT": str(ports["data"]),
        "AGENT_RUNTIME_REDIS_SENTINEL_PORT": str(ports["sentinel"]),
        "AGENT_RUNTIME_REDIS_SENTINEL_MASTER": "topo-script-test",
    }
    env["PORTS"] = " ".join(f"{k}={v}" for k, v in ports.items())
    try:
        yield env
    finally:  # whatever the test left: only the processes the script recorded
        for record in (tmp_path / "state" / "topologies").glob("*.run"):
            pid = int(record.read_text().split()[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run(env: dict[str, str], action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT), action],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def recorded(env: dict[str, str]) -> list[int]:
    folder = Path(env["AGENT_RUNTIME_SERVICES_STATE_DIR"]) / "topologies"
    return sorted(int(p.read_text().split()[0]) for p in folder.glob("*.run"))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(300)
def test_start_check_stop_and_a_foreign_server_is_left_alone(topo: dict[str, str]) -> None:
    ports = dict(item.split("=") for item in topo["PORTS"].split())
    started_at = time.monotonic()
    started = run(topo, "start")
    took = time.monotonic() - started_at
    assert started.returncode == 0, started.stderr
    changes = [line for line in started.stderr.splitlines() if "CHANGE:" in line]
    assert len(changes) == 6 + 1 + 2 + 3, started.stderr  # nodes, create, servers, sentinels
    assert "3 masters, 3 replicas" in started.stderr
    assert f"master 127.0.0.1:{ports['data']}" in started.stderr
    pids = recorded(topo)
    assert len(pids) == 11 and all(alive(pid) for pid in pids)
    print(f"redis_topologies.sh start: {took:.1f} s")

    again = run(topo, "start")  # all up, all ours: nothing to do
    assert again.returncode == 0 and "CHANGE" not in again.stderr, again.stderr
    checked = run(topo, "check")
    assert checked.returncode == 0 and "CHANGE" not in checked.stderr, checked.stderr
    assert checked.stderr.count(": usable") == 2

    # a slot move a test left half done (its node MIGRATING): check names it, start settles it
    # (`--cluster create` gave slot 0 to the first node)
    port = int(ports["cluster"])
    node = Redis(host="127.0.0.1", port=port, decode_responses=True)
    try:
        nodes = [line.split() for line in node.execute_command("CLUSTER", "NODES").splitlines()]
        other = next(n[0] for n in nodes if "master" in n[2] and "myself" not in n[2])
        node.execute_command("CLUSTER", "SETSLOT", 0, "MIGRATING", other)
        named = run(topo, "check")
        assert f"slot 0 of the redis cluster node 127.0.0.1:{port} is migrating" in named.stderr
        assert "CHANGE" not in named.stderr, named.stderr
        settled = run(topo, "start")
        assert settled.returncode == 0, settled.stderr
        assert f"CHANGE: slot 0 of the redis cluster node 127.0.0.1:{port}" in settled.stderr
        myself = next(line for line in node.execute_command("CLUSTER", "NODES").splitlines()
                      if "myself" in line)  # fmt: skip
        assert "->-" not in myself, myself
    finally:
        node.close()

    # a sentinel dies; a stranger takes its port: check and start name it, never touch it
    sentinel = int(ports["sentinel"])
    record = (
        Path(topo["AGENT_RUNTIME_SERVICES_STATE_DIR"]) / "topologies" / f"sentinel-{sentinel}.run"
    )
    os.kill(int(record.read_text().split()[0]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not port_free(sentinel):
        assert time.monotonic() < deadline, "the killed sentinel's port stays taken"
        time.sleep(0.1)
    stranger = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(sentinel)], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while port_free(sentinel):
            assert time.monotonic() < deadline, "the stranger does not listen"
            time.sleep(0.1)
        for action in ("check", "start"):
            refused = run(topo, action)
            assert refused.returncode == 1, refused.stderr
            assert f"127.0.0.1:{sentinel} answers, but this script did not start" in refused.stderr
            assert "CHANGE" not in refused.stderr

        stopped = run(topo, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stderr.count("CHANGE: stopping") == 10
        assert "the process this script started is gone" in stopped.stderr
        assert not any(alive(pid) for pid in pids)
        assert stranger.poll() is None  # not ours: left running
        assert recorded(topo) == []
        nothing = run(topo, "stop")
        assert nothing.returncode == 0 and "nothing to stop" in nothing.stderr
    finally:
        stranger.kill()
        stranger.wait(timeout=10)


@pytest.mark.timeout(300)
def test_after_its_servers_died_start_makes_both_anew(topo: dict[str, str]) -> None:
    """Everything it started killed (a reboot, a CI machine's cleanup): the nodes' files would
    bring back a stale cluster and master, so `start` forgets them and starts afresh."""
    first = run(topo, "start")
    assert first.returncode == 0, first.stderr
    for pid in recorded(topo):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in recorded(topo)):
        assert time.monotonic() < deadline, "the killed servers stay"
        time.sleep(0.1)
    again = run(topo, "start")
    assert again.returncode == 0, again.stderr
    assert "forgetting the files of the redis cluster" in again.stderr
    assert "forgetting the files of the redis sentinel set" in again.stderr
    assert "creating the redis cluster" in again.stderr
    assert again.stderr.count(": usable") == 2
    stopped = run(topo, "stop")
    assert stopped.returncode == 0 and stopped.stderr.count("CHANGE: stopping") == 11


LISTENER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
while True:
    s.accept()[0].close()
"""


@pytest.mark.real_backend
def test_the_topologies_of_this_machine_are_usable() -> None:
    """`check` (changes nothing) on the ports the tests use."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = run(env, "check")
    if proc.returncode != 0 and not IN_CI:
        pytest.skip(f"the Redis topologies are not usable here:\n{proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    assert "CHANGE" not in proc.stderr
