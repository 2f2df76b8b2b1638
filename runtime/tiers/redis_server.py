"""A local `redis-server` process in a folder of its own: for the tests (which kill, restart and
fill it), `dsv41 bench pool` and a one-machine EPD deployment.

    with RedisServer.start(tmp_dir) as server:      # a free port on 127.0.0.1
        pool = RedisSnapshotPool(server.url, ...)
        server.kill()                               # SIGKILL: the pool sees a dead server
        server.restart()                            # same port, empty (nothing is saved)

    with RedisClusterNodes.start(tmp_dir, nodes=3) as cluster:   # a local Redis Cluster
        pool = RedisSnapshotPool(cluster.url, ...)  # every node's URL: the seeds
        cluster.servers[1].kill()                   # one node lost: its slots miss
        cluster.servers[1].restart()                # back (its nodes.conf kept), empty

No persistence (`--save ''`, no AOF): a restart comes back empty, as a restarted cache does.
This is the one Redis server the runtime configures (the snapshot pool only reads a server's
settings): it starts with `maxmemory` (`maxmemory_bytes`, default 10% of the host's memory, as
the in-process pool) and `maxmemory-policy volatile-lru`. `extra` passes more `--option value`
arguments after those (e.g. `rename-command CONFIG ""`, or other memory settings).

A cluster of our own (`RedisClusterNodes`) is that server `nodes` times, each with
`cluster-enabled yes` and `cluster-require-full-coverage no` (a lost node makes only its own
slots miss, the others keep answering), the 16384 slots split evenly with `CLUSTER ADDSLOTSRANGE`
and the nodes joined with `CLUSTER MEET`; each node's `maxmemory` is its machine's 10% (here all
on one host: `maxmemory_bytes` each, default 10% of the host's memory divided by `nodes`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsv41.runtime.tiers.dram_pool import default_budget_bytes
from dsv41.runtime.tiers.redis_pool import POLICY

BINARY = "redis-server"
SLOTS = 16384  # a Redis Cluster's hash slots
BUS_OFFSET = 10000  # a cluster node's bus port is its port + 10000
START_TRIES = 20  # free ports tried when the one found is taken before the server binds it


def redis_binary() -> str | None:
    """The path of `redis-server`, or None when it is not installed."""
    return shutil.which(BINARY)


class PortTakenError(RuntimeError):
    """Another redis-server answers on the port this one was to bind."""


def answering_pid(port: int) -> int | None:
    """The process id of the redis-server answering on 127.0.0.1:`port` (`INFO server`), None
    while it is not ready; OSError when nothing listens. A free port can be taken by another
    process between the moment it was found and the server's bind: only the process id tells
    our server from another one on that port."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"INFO server\r\n")
        data = b""
        while b"\r\n" not in data or len(data) < _bulk_end(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data.startswith(b"$"):
        return None  # -LOADING or another error: not ready yet
    for line in data.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.split(b":", 1)[1])
    raise ValueError(f"The server on port {port} sent no process_id in INFO server.")


def _bulk_end(data: bytes) -> int:
    """The length of a whole RESP reply that starts `data` (a bulk string: its header, body and
    CRLF; anything else: its first line)."""
    head, _, _ = data.partition(b"\r\n")
    if not head.startswith(b"$"):
        return len(head) + 2
    return len(head) + 2 + max(0, int(head[1:])) + 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder: Path, port: int, extra: Sequence[str] = (),
                 maxmemory_bytes: int | None = None):
        self.folder, self.port, self.extra = Path(folder), port, tuple(extra)
        self.maxmemory_bytes = default_budget_bytes() if maxmemory_bytes is None \
            else maxmemory_bytes
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, folder: str | Path, *, port: int | None = None, extra: Sequence[str] = (),
              maxmemory_bytes: int | None = None) -> RedisServer:
        if redis_binary() is None:
            raise FileNotFoundError(f"`{BINARY}` is not installed (Debian: apt-get install -y "
                                    "redis-server).")
        if maxmemory_bytes is not None and (not isinstance(maxmemory_bytes, int)
                                            or isinstance(maxmemory_bytes, bool)
                                            or maxmemory_bytes <= 0):
            raise ValueError(f"maxmemory_bytes must be a positive int or None, got "
                             f"{maxmemory_bytes!r}.")
        for _ in range(1 if port else START_TRIES):
            server = cls(Path(folder), port or free_port(), extra, maxmemory_bytes)
            server.folder.mkdir(parents=True, exist_ok=True)
            try:
                server._spawn()
                return server
            except PortTakenError:
                if port:
                    raise
        raise RuntimeError(f"redis-server found every one of {START_TRIES} free ports taken "
                           "before it could bind them.")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self, timeout_s: float = 20.0) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.folder), "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--logfile", str(self.folder / "redis.log"),
                "--maxmemory", str(self.maxmemory_bytes), "--maxmemory-policy", POLICY,
                *self.extra]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                log = (self.folder / "redis.log")
                tail = log.read_text()[-500:] if log.exists() else ""
                error = PortTakenError if "in use" in tail else RuntimeError
                raise error(f"redis-server exited with {self.proc.returncode} on port "
                            f"{self.port}: {tail}")
            try:
                pid = answering_pid(self.port)
            except (OSError, ValueError):
                pid = None
            if pid == self.proc.pid:
                return
            if pid is not None:  # another redis-server holds the port: ours cannot bind it
                self.kill()
                raise PortTakenError(f"Port {self.port} is held by another redis-server "
                                     f"(process {pid}).")
            if time.monotonic() - t0 > timeout_s:
                self.kill()
                raise RuntimeError(f"redis-server did not answer on port {self.port} within "
                                   f"{timeout_s:g} s.")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crash looks like to a client."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Kill, then start again on the same port, empty."""
        self.kill()
        self._spawn()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    for _ in range(1000):
        p = free_port()
        if p > 65535 - BUS_OFFSET:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + BUS_OFFSET))
            except OSError:
                continue
        return p
    raise RuntimeError("No free port pair (p, p + 10000) for a cluster node.")


def cluster_info(client) -> dict[str, str]:
    """`CLUSTER INFO` of one node (a redis.Redis) as a dict of strings."""
    raw = client.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


@dataclass
class RedisClusterNodes:
    """A local Redis Cluster of `RedisServer`s (see the module docstring); masters only."""

    servers: list[RedisServer]

    @classmethod
    def start(cls, folder: str | Path, *, nodes: int = 3, maxmemory_bytes: int | None = None,
              timeout_s: float = 20.0) -> RedisClusterNodes:
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ValueError(f"A cluster needs at least one node, got nodes={nodes!r}.")
        if maxmemory_bytes is None:
            maxmemory_bytes = max(1 << 20, default_budget_bytes() // nodes)
        extra = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                 "--cluster-require-full-coverage", "no")
        cluster = cls([])
        try:
            for i in range(nodes):
                cluster.servers.append(RedisServer.start(
                    Path(folder) / f"node{i}", port=_free_cluster_port(), extra=extra,
                    maxmemory_bytes=maxmemory_bytes))
            cluster._join(timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _join(self, timeout_s: float) -> None:
        import redis  # the client, only for a cluster of our own

        clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in self.servers]
        try:
            n = len(clients)
            for i, c in enumerate(clients):  # slots [i*S/n, (i+1)*S/n)
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n,
                                  (i + 1) * SLOTS // n - 1)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.servers[0].port)
            t0 = time.monotonic()
            while not all(cluster_info(c).get("cluster_state") == "ok"
                          and cluster_info(c).get("cluster_known_nodes") == str(n)
                          for c in clients):
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"The local Redis Cluster of {n} nodes did not form "
                                       f"within {timeout_s:g} s.")
                time.sleep(0.05)
        finally:
            for c in clients:
                c.close()

    def restart(self, i: int, timeout_s: float = 20.0) -> None:
        """Kill node i and start it again (same port and nodes.conf: same id and slots), empty;
        back when every node sees the cluster whole again."""
        self.servers[i].restart()
        self._wait_ok(timeout_s)

    def _wait_ok(self, timeout_s: float) -> None:
        import redis

        clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in self.servers]
        try:
            t0 = time.monotonic()
            while not all(cluster_info(c).get("cluster_state") == "ok" for c in clients):
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"The local Redis Cluster was not whole again within "
                                       f"{timeout_s:g} s.")
                time.sleep(0.05)
        finally:
            for c in clients:
                c.close()

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: the pool's seeds (any one that answers will do)."""
        return ",".join(s.url for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> RedisClusterNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
