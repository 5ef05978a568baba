"""Faults of the tests' Redis Cluster (scripts/redis_topologies.sh), brought mid-load by
``failover_load.one_failover`` and timed as a ``Failover``:

- ``kill_master``: SIGKILL of the master that owns a slot (its process id from ``INFO
  server``: the cluster is the tests' own, started on loopback by the project's script); the
  cluster promotes its replica after the node timeout (3 s). Writes the old master acknowledged
  after the last byte its replica received are lost. ``restore`` starts the killed node again
  (the script's ``start``; it rejoins as a replica of the new master).
- ``move_slot``: the slot's keys migrated to another master one by one (``CLUSTER SETSLOT
  … IMPORTING / MIGRATING``, ``MIGRATE``, ``SETSLOT … NODE``), as ``redis-cli --cluster
  reshard`` does, while the load runs. A client meets ``ASK`` / ``MOVED`` and, for a script
  whose keys are split between the two nodes, ``TRYAGAIN``; nothing is lost.

Times are ``time.monotonic()``. ``promoted``: the new owner serves the slot; ``named``: every
live node's view agrees; ``demoted``: the end of the exposure (writes after it cannot be lost):
the promotion for a kill (the old master is dead), the end of the move for a migration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis
from redis.cluster import key_slot

from agent_runtime import redis_client
from failover_load import Failover

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "redis_topologies.sh"


@dataclass(frozen=True)
class Node:
    node_id: str
    addr: tuple[str, int]
    flags: frozenset[str]
    master_id: str  # "-" for a master
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags and "fail" not in self.flags

    def owns(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def parse_nodes(text: str) -> list[Node]:
    """``CLUSTER NODES``: id, ip:port@bus, flags, master, ping, pong, epoch, link, slots…"""
    nodes = []
    for line in text.strip().splitlines():
        parts = line.split()
        host, _, rest = parts[1].partition(":")
        port = int(rest.split("@")[0])
        slots = []
        for item in parts[8:]:
            if item.startswith("["):  # a slot being migrated or imported: not owned yet
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        nodes.append(
            Node(parts[0], (host, port), frozenset(parts[2].split(",")), parts[3], tuple(slots))
        )
    return nodes


def slot_of(scope_id: str) -> int:
    """The slot of every key of the scope (its hash tag)."""
    return key_slot(f"{{{scope_id}}}".encode())


class ClusterSet:
    """The cluster of a ``redis+cluster://`` URL, spoken to node by node."""

    def __init__(self, url: str) -> None:
        self.seeds = list(redis_client.parse(url).nodes)
        self.killed: list[tuple[str, int]] = []

    @staticmethod
    def direct(addr: tuple[str, int]) -> Redis:
        return Redis(
            host=addr[0], port=addr[1], decode_responses=True, socket_timeout=2,
            socket_connect_timeout=2,
        )  # fmt: skip

    async def nodes(self, via: tuple[str, int] | None = None) -> list[Node]:
        """The cluster as one live node sees it (``via``, or the first seed that answers)."""
        for addr in [via] if via else self.seeds:
            client = self.direct(addr)
            try:
                return parse_nodes(str(await client.execute_command("CLUSTER", "NODES")))
            except Exception:
                continue
            finally:
                await client.aclose()
        raise ConnectionError(f"no node of the cluster answers (seeds {self.seeds})")

    async def owner(self, slot: int) -> Node:
        for node in await self.nodes():
            if node.is_master and node.owns(slot):
                return node
        raise LookupError(f"no master owns slot {slot}")

    async def agreed(self, slot: int, owner: tuple[str, int]) -> bool:
        """Every node that answers says ``owner`` serves the slot and the cluster is ok."""
        live = [
            n for n in await self.nodes() if "fail" not in n.flags and n.addr not in self.killed
        ]
        for node in live:
            client = self.direct(node.addr)
            try:
                info = str(await client.execute_command("CLUSTER", "INFO"))
                view = parse_nodes(str(await client.execute_command("CLUSTER", "NODES")))
            except Exception:
                return False
            finally:
                await client.aclose()
            if "cluster_state:ok" not in info:
                return False
            if not any(n.addr == owner and n.is_master and n.owns(slot) for n in view):
                return False
        return True

    # --- a master killed ----------------------------------------------------------------------

    async def kill_master(self, slot: int, within: float = 60.0) -> Failover:
        old = await self.owner(slot)
        replicas = [n for n in await self.nodes() if n.master_id == old.node_id]
        if not replicas:
            raise LookupError(f"the master of slot {slot} ({old.addr}) has no replica")
        old_client = self.direct(old.addr)
        try:
            pid = int((await old_client.info("server"))["process_id"])
            old_offset = int((await old_client.info("replication"))["master_repl_offset"])
        finally:
            await old_client.aclose()
        fo = Failover(old.addr, old_last_offset=old_offset)
        fo.commanded = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self.killed.append(old.addr)
        deadline = time.monotonic() + within
        while not (fo.promoted and fo.named):
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot}: no replica took over within {within} s: {fo}")
            now = time.monotonic()
            for replica in replicas:
                client = self.direct(replica.addr)
                try:
                    info = await client.info("replication")
                except Exception:
                    continue
                finally:
                    await client.aclose()
                if info.get("role") == "master" and not fo.promoted:
                    fo.new, fo.promoted = replica.addr, now
                    fo.promoted_at_offset = int(info.get("second_repl_offset", 0))
            if fo.new and not fo.named and await self.agreed(slot, fo.new):
                fo.named = now
            await asyncio.sleep(0.02)
        fo.demoted = fo.promoted  # dead: it wrote nothing after the kill
        return fo

    async def restore(self, within: float = 120.0) -> None:
        """Start the killed nodes again (the project's script); they rejoin as replicas and
        the cluster is 3 masters + 3 replicas again."""
        if not self.killed:
            return
        proc = await asyncio.create_subprocess_exec(
            "bash", str(SCRIPT), "start",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), within)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{SCRIPT.name} start: {out.decode(errors='replace')[-2000:]}")
        self.killed.clear()

    # --- a slot moved -------------------------------------------------------------------------

    async def move_slot(self, slot: int, *, pause: float = 0.01, within: float = 60.0) -> Failover:
        """Migrate the slot's keys to another master, one key at a time (``pause`` between
        them, so that the load meets the slot half-moved)."""
        nodes = await self.nodes()
        source = next(n for n in nodes if n.is_master and n.owns(slot))
        target = next(n for n in nodes if n.is_master and n.node_id != source.node_id)
        fo = Failover(source.addr, target.addr)
        src, dst = self.direct(source.addr), self.direct(target.addr)
        deadline = time.monotonic() + within
        try:
            fo.commanded = time.monotonic()
            await dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
            await src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
            while True:
                keys = await src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1)
                if not keys:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"slot {slot}: keys still on {source.addr} after {within} s")
                await src.execute_command(
                    "MIGRATE", target.addr[0], target.addr[1], "", 0, 5000, "KEYS", *keys
                )
                await asyncio.sleep(pause)
            fo.promoted = time.monotonic()
            others = [n for n in nodes if n.is_master and n not in (source, target)]
            for node in [target, source, *others]:  # the target first, as redis-cli does
                client = self.direct(node.addr)
                try:
                    await client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
                finally:
                    await client.aclose()
            while not await self.agreed(slot, target.addr):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"slot {slot}: the nodes do not agree on {target.addr}")
                await asyncio.sleep(0.02)
            fo.named = fo.demoted = time.monotonic()
        except BaseException:
            # a move cut short: the slot to the target, where the moved keys are (the rest
            # stay on the source, unreachable: the test has failed; `stop` + `start` of the
            # script makes the cluster anew)
            with contextlib.suppress(Exception):
                await dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
                await src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
            raise
        finally:
            await src.aclose()
            await dst.aclose()
        return fo
