"""The DRAM snapshot pool on a Redis server, shared by every engine process (on any machine) of
one model: the same calls as `SnapshotPool` (put, get, contains, drop, sweep, stats, close).

    pool = RedisSnapshotPool("redis://10.0.0.5:6379/0", fingerprint=salt, budget_bytes=8 << 30,
                             ttl_s=600)
    pool = RedisSnapshotPool("redis://10.0.0.5:7000,redis://10.0.0.6:7000", ...)  # a cluster

Choices, stated once:
- A pool over machines is a Redis Cluster (not standalone servers under client-side consistent
  hashing): the slot map lives on the servers, so every engine process of every machine agrees
  on where a key lives without sharing a ring's configuration, a node added later takes slots
  with `redis-cli --cluster reshard` (the keys move with them, instead of a ring remapping them
  to misses), and redis-py's `RedisCluster` follows MOVED/ASK itself. The URL is one server or
  one cluster: a URL whose server runs with `cluster-enabled yes` (seen at connect, `INFO
  cluster`) is a cluster; several URLs, comma-separated, are seeds of one cluster (the first
  that answers gives the slot map). Keys spread by hash slot; the hash tag `{<key>}` keeps a
  snapshot and its holders' set in one slot (the one multi-key transaction and script below
  need it); distinct snapshots land on distinct slots. Each node is sized by its own
  `maxmemory` (10% of its machine's memory is what `redis_server.RedisClusterNodes` sets); the
  pool checks every master's settings as for one server. A cluster's nodes should run with
  `cluster-require-full-coverage no`: a lost node then makes only its own slots miss (with
  `yes`, every node refuses until it is back: all misses, still no errors).
- One Redis string per snapshot, `dsv41:snap:<model fingerprint hex>:{<key>}`, its value a
  `runtime.wire` record (header with kind, key and fingerprint; sha256 of all of it), so another
  model's engines never read it and a damaged value is detected, deleted and counted, never
  served.
- The TTL is the key's native expiry (`SET ... PX`), from the write; a read does not extend it.
- Holds: a put with a `holder` (a session's uid) adds it to the snapshot's set of holders,
  `dsv41:hold:<model fingerprint hex>:{<key>}` (same TTL, written in one MULTI with the value); a
  drop with a holder removes that holder and deletes the snapshot only when the set is then
  empty (one Lua script, atomic on the server). Sessions of every process that stand at one
  state share one snapshot, and a session moving on never deletes one another session holds.
- The pool never changes the server's settings (it may be the user's, shared with others): it
  reads `maxmemory` and `maxmemory-policy` at connect and after every server restart (a new
  `run_id`, seen at the next put) and refuses a server without a byte bound (`maxmemory 0`) or
  whose policy never evicts (`noeviction`) with a `PoolConfigError` (a ValueError) naming the
  redis.conf lines. Any evicting policy is accepted; `volatile-lru` (every key here has an
  expiry, so the least recently read snapshots go first; Redis samples its LRU) is the one to
  use. `maxmemory` counts all of the server's memory (keys, overheads, other users), not only
  the snapshots' bytes. The pool's budget is the server's `maxmemory`, or `budget_bytes` when
  smaller (a snapshot bigger than the budget is refused, never sent). A server of our own
  (`redis_server.RedisServer`) is started with both set.
- Faults are misses, counted, never errors in a turn: a server down or slow (connection
  refused, a timeout of `timeout_s`, a cluster node that refuses its slots) is `unavailable`
  (and for `retry_s` seconds after, calls to that server, or to that node's keys, skip it and
  miss at once, so a dead node costs a turn no more than one timeout; the other nodes' keys
  still hit); a
  value that fails its checks is `corrupted` / `foreign` (and deleted); a snapshot this process
  wrote that is gone before its TTL is `lost` (evicted under the budget, or the server
  restarted); one gone after its TTL is `expired`; a put the server refuses for memory (every
  evictable key already gone: `OOM`) is `full`. The engine then replays (encoder bounded
  replay from the SSD blocks), as for any snapshot miss.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv41.runtime.tiers.base import NO_META, ArrayCheck
from dsv41.runtime.tiers.dram_pool import (
    Snapshot,
    check_holder,
    check_key,
    check_put,
    default_budget_bytes,
)
from dsv41.runtime.tiers.wire import (
    RecordError,
    RecordFault,
    RecordKind,
    decode_record,
    encode_record,
)

log = logging.getLogger(__name__)

POLICY = "volatile-lru"
KIND = RecordKind.SNAPSHOT
KEY_PREFIX = "dsv41:snap:"
WRITTEN_MEMORY = 65536  # keys this process remembers writing (to tell `expired` from `lost`)


HOLD_PREFIX = "dsv41:hold:"
# the snapshot (KEYS[1]) goes only when ARGV[1] was a holder of it (KEYS[2]) and the last one
RELEASE_SCRIPT = """
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 and redis.call('SCARD', KEYS[2]) == 0 then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
EVICTING_POLICIES = frozenset({"volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl",
                               "allkeys-lru", "allkeys-lfu", "allkeys-random"})


class PoolConfigError(ValueError):
    """The Redis server cannot hold the pool under a budget (no maxmemory, or a policy that
    never evicts); the pool does not change a server's settings."""


@dataclass(frozen=True, slots=True)
class RedisPoolStats:
    """The in-process pool's fields (same names) and the Redis faults."""

    entries: int  # this model's snapshots on the server now
    bytes: int  # the server's used_memory (all of it: keys, overheads, other users)
    budget: int  # the server's maxmemory
    hits: int  # get() that returned a snapshot
    misses: int  # get() that returned None, every fault below included
    expired: int  # misses of keys this process wrote whose TTL had passed
    evictions: int  # the server's evicted_keys since this pool connected (all its clients)
    refused: int  # put() of a snapshot bigger than the whole budget (never sent)
    lost: int  # misses of keys this process wrote, gone before their TTL (evicted, restart)
    corrupted: int  # values that failed the checksum or layout checks (deleted)
    foreign: int  # values of another model, kind or key (deleted)
    unavailable: int  # calls that failed or were skipped because the server was unreachable
    full: int  # put() refused by the server for memory (OOM)
    write_errors: int  # put() that did not reach the server (unreachable)
    restarts: int  # server restarts seen (a new run_id at a put): its settings checked again
    nodes: int  # the servers holding the pool (a cluster's masters; 1 for one server)
    nodes_down: int  # of those, the ones skipped or unreachable at this call


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    expired: int = 0
    refused: int = 0
    lost: int = 0
    corrupted: int = 0
    foreign: int = 0
    unavailable: int = 0
    full: int = 0
    write_errors: int = 0
    restarts: int = 0


def snapshot_key(fingerprint: bytes, key: str) -> str:
    """The Redis key of a snapshot: `dsv41:snap:<fingerprint hex>:{<key>}` (hash tag: its slot
    is the key's, shared with its holders' set)."""
    return f"{KEY_PREFIX}{fingerprint.hex()}:{{{key}}}"


def hold_key(fingerprint: bytes, key: str) -> str:
    """The Redis key of a snapshot's holders' set (same slot as the snapshot)."""
    return f"{HOLD_PREFIX}{fingerprint.hex()}:{{{key}}}"


def masked_url(url: str) -> str:
    """A URL as logged or printed: its password (redis://user:secret@host) replaced by ***."""
    if "," in url:
        return ",".join(masked_url(u) for u in url.split(","))
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    userinfo, host = rest.rsplit("@", 1)
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def _positive(name: str, v) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}.")
    return float(v)


class RedisSnapshotPool:
    """See the module docstring. Thread-safe (the redis client pools its connections; the
    counters have a lock)."""

    def __init__(self, url: str, *, fingerprint: bytes, budget_bytes: int | None = None,
                 ttl_s: float = 600.0, timeout_s: float = 1.0, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        # optional: the redis client (~0.13 s), only for a pool on a server (--redis-url)
        import redis

        seeds = url.split(",") if isinstance(url, str) else []
        if not seeds or not all(u.startswith(("redis://", "rediss://", "unix://"))
                                for u in seeds):
            raise ValueError(f"The Redis URL must start with redis://, rediss:// or unix:// (or "
                             f"be several such URLs, comma-separated: seeds of one cluster), got "
                             f"{masked_url(url) if isinstance(url, str) else url!r}.")
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise ValueError("The pool's fingerprint must be the 32-byte model key salt.")
        if budget_bytes is not None and (not isinstance(budget_bytes, int)
                                         or isinstance(budget_bytes, bool) or budget_bytes <= 0):
            raise ValueError(f"budget_bytes must be a positive int or None, got "
                             f"{budget_bytes!r}.")
        if not isinstance(retry_s, int | float) or not math.isfinite(retry_s) or retry_s < 0:
            raise ValueError(f"retry_s must be a finite number >= 0, got {retry_s!r}.")
        self.url, self.fingerprint = masked_url(url), fingerprint  # url: as logged
        self.seeds = tuple(seeds)
        self.ttl_s = _positive("ttl_s", ttl_s)
        self.timeout_s = _positive("timeout_s", timeout_s)
        self.retry_s, self.clock = float(retry_s), clock
        self.prefix = f"{KEY_PREFIX}{fingerprint.hex()}:"
        self.hold_prefix = f"{HOLD_PREFIX}{fingerprint.hex()}:"
        self._want_budget = budget_bytes
        self.budget_bytes = budget_bytes or 0  # the servers' maxmemory once configured
        ex = redis.exceptions
        # a node lost inside a cluster: refused, its slots down, or the client out of retries
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError, ex.ClusterError,
                        ex.SlotNotCoveredError, ex.TryAgainError, ex.MasterDownError,
                        ex.RedisClusterException)
        self._response_error = redis.ResponseError
        self._oom = redis.exceptions.OutOfMemoryError  # "OOM command not allowed ..."
        self._lock = threading.Lock()
        self._n = _Counters()
        self._r: Any = None  # redis.Redis or redis.RedisCluster, once a seed answered
        self._cluster = False
        self._release: Any = None
        self._down_until: dict[str, float] = {}  # node name ("" before connect) -> retry time
        self._run_ids: dict[str, str] = {}  # node name -> the run_id whose settings were read
        self._maxmemory: dict[str, int] = {}  # node name -> its maxmemory
        self._evicted0: dict[str, int] = {}  # node name -> evicted_keys when first seen
        self._written: OrderedDict[str, float] = OrderedDict()  # key -> expiry (wall clock)
        try:
            self._connect()  # a configuration problem is an error now, not a miss later
        except self._errors as e:
            log.warning("The Redis pool at %s is unreachable (%s); snapshots miss until it "
                        "answers.", self.url, e)
            self._failed("", e)

    # ---- connection and configuration ------------------------------------------------------------

    def _client_kw(self) -> dict[str, Any]:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # one immediate reconnect on a broken connection (a restarted server's first reply),
        # none on a timeout: a failure is seen here, counted, and the node skipped for retry_s
        return {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s,
                "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))}

    def _connect(self) -> None:
        """The client, from the first seed that answers (a cluster when its server runs with
        cluster-enabled), then every node's settings checked."""
        if self._r is None:
            import redis

            last: Exception | None = None
            for seed in self.seeds:
                probe = redis.Redis.from_url(seed, **self._client_kw())
                try:
                    cluster = bool(probe.info("cluster").get("cluster_enabled", 0))
                except self._errors as e:
                    last = e
                    continue
                finally:
                    probe.close()
                if len(self.seeds) > 1 and not cluster:
                    raise PoolConfigError(
                        f"The Redis server at {masked_url(seed)} is not in cluster mode: several "
                        f"URLs in --redis-url name the seeds of one Redis Cluster (give one URL "
                        f"for one server).")
                self._cluster = cluster
                self._r = redis.RedisCluster.from_url(seed, **self._client_kw()) if cluster \
                    else redis.Redis.from_url(seed, **self._client_kw())
                self._release = self._r.register_script(RELEASE_SCRIPT)  # EVALSHA, else EVAL
                self._down_until.pop("", None)
                break
            else:
                raise last if last is not None else redis.ConnectionError("no seed")
        for name, client in self._nodes():
            try:
                self._check_server(name, client)
            except self._errors as e:
                self._failed(name, e)

    def _nodes(self) -> list[tuple[str, Any]]:
        """(name, redis.Redis) of every server holding the pool: a cluster's masters."""
        if not self._cluster:
            return [("", self._r)]
        return [(n.name, self._r.get_redis_connection(n)) for n in self._r.get_primaries()]

    def _node(self, rkey: str) -> tuple[str, Any]:
        """(name, redis.Redis) of the server holding `rkey` (its slot's master)."""
        if not self._cluster:
            return "", self._r
        n = self._r.get_node_from_key(rkey)
        return n.name, self._r.get_redis_connection(n)

    def _check_server(self, name: str, client: Any) -> None:
        """Check maxmemory and the policy when the server is new to this pool (never set)."""
        info = client.info("server")
        if info["run_id"] == self._run_ids.get(name):
            return
        if name in self._run_ids:
            self._count("restarts")
            log.warning("The Redis pool's server %s at %s restarted; checking its settings "
                        "again.", name or "", self.url)
        self._check_settings(name, client)
        self._run_ids[name] = info["run_id"]
        self._evicted0[name] = int(client.info("stats").get("evicted_keys", 0))

    def _check_settings(self, name: str, client: Any) -> None:
        """The server's maxmemory and policy, read (INFO, not CONFIG): PoolConfigError when
        snapshots would grow without bound or be refused once it is full."""
        mem = client.info("memory")
        policy, maxmem = mem.get("maxmemory_policy"), int(mem.get("maxmemory", 0))
        where = self.url if not name else f"{name} (a node of {self.url})"
        if maxmem <= 0 or policy not in EVICTING_POLICIES:
            want = self._want_budget or default_budget_bytes()
            raise PoolConfigError(
                f"The Redis server at {where} runs with maxmemory {maxmem} and "
                f"maxmemory-policy {policy!r}: the snapshot pool needs a byte bound and a policy "
                f"that evicts expiring keys, and it never changes a server's settings. Set "
                f"`maxmemory {want}` and `maxmemory-policy {POLICY}` in its redis.conf (or with "
                f"CONFIG SET), or leave --redis-url out to use the in-process pool.")
        self._maxmemory[name] = maxmem
        total = sum(self._maxmemory.values())
        self.budget_bytes = total if self._want_budget is None else min(self._want_budget, total)

    # ---- the pool's calls ------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._n, name, getattr(self._n, name) + n)

    def _up(self, node: str) -> bool:
        """Whether to try the node now (not within retry_s of its failure); counts a skip."""
        if self.clock() < self._down_until.get(node, -math.inf):
            self._count("unavailable")
            return False
        return True

    def _route(self, key: str) -> tuple[str, Any] | None:
        """(node name, its client) for `key`, connecting first when no seed answered yet;
        None (counted) when that node, or every seed, is to be skipped or unreachable."""
        if self._r is None:
            if not self._up(""):
                return None
            try:
                self._connect()
            except self._errors as e:
                self._failed("", e)
                return None
            except PoolConfigError as e:  # a server that came up with settings we refuse
                log.error("%s", e)
                self._r = None
                self._failed("", e)
                return None
        node = self._node(self._rkey(key))
        return node if self._up(node[0]) else None

    def _failed(self, node: str, e: Exception) -> None:
        if self.clock() >= self._down_until.get(node, -math.inf):
            log.warning("The Redis pool at %s failed%s: %s; its snapshots miss for %g s.",
                        self.url, f" on {node}" if node else "", e, self.retry_s)
        self._count("unavailable")
        self._down_until[node] = self.clock() + self.retry_s

    def _rkey(self, key: str) -> str:
        return snapshot_key(self.fingerprint, key)

    def _hkey(self, key: str) -> str:
        return hold_key(self.fingerprint, key)

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META, *, holder: str | None = None) -> bool:
        """Store the snapshot under its key with the TTL (held by `holder`, besides any
        holders it has); False (counted) when it is bigger than the budget, the server is
        unreachable or full."""
        nbytes = check_put(key, arrays, meta)
        check_holder(holder)
        route = self._route(key)
        if route is None:
            self._count("write_errors")
            return False
        node, client = route
        try:
            self._check_server(node, client)
            if nbytes > min(self.budget_bytes, self._maxmemory.get(node, self.budget_bytes)):
                self._count("refused")
                return False
            now = time.time()
            value = encode_record(kind=KIND, key=key, fingerprint=self.fingerprint,
                                  created_at=now, meta=dict(meta), arrays=dict(arrays))
            px = max(1, int(self.ttl_s * 1000))
            with self._r.pipeline(transaction=True) as tx:  # the value and its hold together
                tx.set(self._rkey(key), value, px=px)
                if holder is not None:
                    tx.sadd(self._hkey(key), holder)
                    tx.pexpire(self._hkey(key), px)
                tx.execute()
        except self._errors as e:
            self._failed(node, e)
            self._count("write_errors")
            return False
        except PoolConfigError as e:  # a restarted server that runs with another policy
            log.error("%s", e)
            self._count("write_errors")
            return False
        except self._response_error as e:
            if not isinstance(e, self._oom) and "OOM" not in str(e):
                raise
            self._count("full")
            return False
        with self._lock:
            self._written.pop(key, None)
            self._written[key] = now + self.ttl_s
            while len(self._written) > WRITTEN_MEMORY:
                self._written.popitem(last=False)
        return True

    def get(self, key: str, *, check: ArrayCheck | None = None) -> Snapshot | None:
        """The snapshot (fresh arrays), or None: absent, expired, evicted, damaged or refused by
        `check` (deleted), or the server unreachable; every miss counted."""
        check_key(key)
        route = self._route(key)
        if route is None:
            self._count("misses")
            return None
        try:
            value = self._r.get(self._rkey(key))
        except self._errors as e:
            self._failed(route[0], e)
            self._count("misses")
            return None
        if value is None:
            self._absent(key)
            return None
        try:
            rec = decode_record(value, kind=KIND, key=key, fingerprint=self.fingerprint)
            if check is not None:
                try:
                    check(rec.arrays)
                except ValueError as e:
                    raise RecordError(RecordFault.CORRUPTED, f"its arrays do not fit this "
                                      f"engine: {e}") from None
        except RecordError as e:
            log.warning("Snapshot %s… in the Redis pool is unusable (%s); deleted.", key[:16], e)
            self._count("corrupted" if e.fault is RecordFault.CORRUPTED else "foreign")
            self._count("misses")
            self.drop(key)
            return None
        self._count("hits")
        return Snapshot(key, rec.arrays, rec.meta, rec.created_at, rec.nbytes)

    def contains(self, key: str) -> bool:
        """Whether the server holds a snapshot under `key` (a damaged value is found by get).
        Counted only when it misses a snapshot this process wrote (the engine asks about every
        position of a block; the others were never written)."""
        check_key(key)
        route = self._route(key)
        if route is None:
            return False
        try:
            present = bool(self._r.exists(self._rkey(key)))
        except self._errors as e:
            self._failed(route[0], e)
            return False
        if not present:
            with self._lock:
                ours = key in self._written
            if ours:
                self._absent(key)
        return present

    def _absent(self, key: str) -> None:
        """A miss of an absent key: `expired` or `lost` when this process wrote it."""
        with self._lock:
            expiry = self._written.pop(key, None)
        if expiry is not None:
            self._count("expired" if time.time() >= expiry else "lost")
        self._count("misses")

    def drop(self, key: str, *, holder: str | None = None) -> bool:
        """Delete the snapshot; True when it was present and is now gone (False too when
        unreachable). With `holder`: that holder lets go, and the snapshot goes only when it was
        its last holder (atomic on the server)."""
        check_key(key)
        check_holder(holder)
        route = self._route(key)
        if route is None:
            return False
        try:
            if holder is not None:
                return bool(self._release(keys=[self._rkey(key), self._hkey(key)],
                                          args=[holder]))
            with self._r.pipeline(transaction=True) as tx:
                tx.delete(self._rkey(key))
                tx.delete(self._hkey(key))
                return bool(tx.execute()[0])
        except self._errors as e:
            self._failed(route[0], e)
            return False

    def sweep(self) -> int:
        """Nothing to do: the server expires keys itself."""
        return 0

    def node_entries(self) -> dict[str, int]:
        """This model's snapshots on each reachable node (name: host:port; "" for one server)."""
        out: dict[str, int] = {}
        if self._r is None:
            return out
        for name, client in self._nodes():
            if self.clock() < self._down_until.get(name, -math.inf):
                continue
            try:
                out[name] = sum(1 for _ in client.scan_iter(match=self.prefix + "*", count=1000))
            except self._errors as e:
                self._failed(name, e)
        return out

    def stats(self) -> RedisPoolStats:
        entries = used = evicted = nodes = down = 0
        if self._r is not None:
            for name, client in self._nodes():
                nodes += 1
                if self.clock() < self._down_until.get(name, -math.inf):
                    down += 1  # (a skipped scrape is not counted)
                    continue
                try:
                    entries += sum(1 for _ in client.scan_iter(match=self.prefix + "*",
                                                               count=1000))
                    used += int(client.info("memory").get("used_memory", 0))
                    evicted += max(0, int(client.info("stats").get("evicted_keys", 0))
                                   - self._evicted0.get(name, 0))
                except self._errors as e:
                    self._failed(name, e)
                    down += 1
        with self._lock:
            n = self._n
            return RedisPoolStats(
                entries=entries, bytes=used, budget=self.budget_bytes, hits=n.hits,
                misses=n.misses, expired=n.expired, evictions=evicted, refused=n.refused,
                lost=n.lost, corrupted=n.corrupted, foreign=n.foreign, unavailable=n.unavailable,
                full=n.full, write_errors=n.write_errors, restarts=n.restarts, nodes=nodes,
                nodes_down=down)

    def close(self) -> None:
        if self._r is not None:
            self._r.close()
