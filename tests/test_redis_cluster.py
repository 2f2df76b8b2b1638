"""The DRAM snapshot pool over machines (issue 42): a 3-node local Redis Cluster started by the
tests (runtime/tiers/redis_server.py `RedisClusterNodes`, masters only, 10% of memory each by
default, here 32 MiB) as the pool. Snapshots spread by hash slot over the nodes (the exact
count per node follows from each key's slot); a node killed mid-run makes only its own keys miss
(counted, never an error, every turn answered with the tokens of an engine whose pool lost the
same snapshots); restarted empty, nothing it held before is served, and it hits again once
written.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis
from redis.crc import key_slot

from dsv41.runtime.engine import Engine
from dsv41.runtime.tiers.redis_pool import (
    KEY_PREFIX,
    PoolConfigError,
    RedisSnapshotPool,
    hold_key,
    snapshot_key,
)
from dsv41.runtime.tiers.redis_server import SLOTS, RedisClusterNodes

PAGE = 8
FP = bytes(range(32))
W = "w" * 64
NODES = 3
NODE_BYTES = 32 << 20
KEYS = [f"k{i:02d}" for i in range(30)]


@pytest.fixture
def cluster(tmp_path):
    from conftest import redis_or_skip

    redis_or_skip()
    with RedisClusterNodes.start(tmp_path / "cluster", nodes=NODES,
                                 maxmemory_bytes=NODE_BYTES) as c:
        yield c


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ring": rng.integers(0, 256, (16, 4), dtype=np.uint8)}


def _node_of(key: str) -> int:
    """The node (0..2) whose slots hold a snapshot key: slots split evenly, in order."""
    return key_slot(snapshot_key(FP, key).encode()) * NODES // SLOTS


def _raw_keys(c: RedisClusterNodes, i: int) -> set[str]:
    """The snapshot keys (the pool's own `key`) on node i."""
    r = redis.Redis(host="127.0.0.1", port=c.servers[i].port)
    try:
        pre = f"{KEY_PREFIX}{FP.hex()}:{{"
        return {k.decode()[len(pre):-1] for k in r.keys(f"{KEY_PREFIX}*")}
    finally:
        r.close()


def test_snapshots_spread_over_the_nodes_by_hash_slot(cluster):
    pool = RedisSnapshotPool(cluster.url, fingerprint=FP, ttl_s=60.0)
    for i, k in enumerate(KEYS):
        assert pool.put(k, _state(i), {"i": i}, holder="s")
    want = [{k for k in KEYS if _node_of(k) == n} for n in range(NODES)]
    assert [len(w) for w in want] == [7, 10, 13]  # every node holds some
    assert [_raw_keys(cluster, n) for n in range(NODES)] == want
    for n in range(NODES):  # the holders' set shares its snapshot's slot and node
        r = redis.Redis(host="127.0.0.1", port=cluster.servers[n].port)
        assert {m.decode() for m in r.keys("dsv41:hold:*")} == {hold_key(FP, k) for k in want[n]}
        r.close()
    for i, k in enumerate(KEYS):
        got = pool.get(k)
        assert got.meta == {"i": i} and got.arrays["ring"].tobytes() == _state(i)[
            "ring"].tobytes()
    assert sorted(pool.node_entries().values()) == [7, 10, 13]
    st = pool.stats()
    assert (st.hits, st.misses, st.entries, st.nodes, st.nodes_down) == (30, 0, 30, 3, 0)
    assert st.budget == NODES * NODE_BYTES  # the sum of the masters' maxmemory
    assert pool.drop(KEYS[0], holder="s") and pool.get(KEYS[0]) is None


def test_a_node_killed_mid_run_is_misses_of_its_keys_only_then_hits_again(cluster):
    clock = [0.0]
    pool = RedisSnapshotPool(cluster.url, fingerprint=FP, ttl_s=60.0, retry_s=5.0,
                             timeout_s=0.5, clock=lambda: clock[0])
    for i, k in enumerate(KEYS):
        assert pool.put(k, _state(i), {})
    dead = {k for k in KEYS if _node_of(k) == 1}
    cluster.servers[1].kill()
    got = {k: pool.get(k) for k in KEYS}  # never raises
    assert {k for k, v in got.items() if v is None} == dead
    assert all(got[k].arrays["ring"].tobytes() == _state(i)["ring"].tobytes()
               for i, k in enumerate(KEYS) if k not in dead)
    assert not any(pool.contains(k) for k in dead)
    assert (_node_of("z"), _node_of("x")) == (1, 2)
    assert not pool.put("z", _state(99), {}) and pool.put("x", _state(99), {})
    st = pool.stats()
    assert (st.hits, st.misses, st.nodes, st.nodes_down) == (20, 10, 3, 1)
    # one failure, then node 1 skipped for retry_s: 10 gets, 10 contains, 1 put (a stats()
    # scrape that skips it is not counted); the other nodes answered every call
    assert (st.unavailable, st.write_errors, st.entries) == (10 + 10 + 1, 1, 21)

    cluster.restart(1)  # same port and nodes.conf: back in the cluster, empty
    clock[0] += 10.0  # past the skip window
    assert [pool.get(k) for k in sorted(dead)] == [None] * 10  # nothing from before the restart
    assert _raw_keys(cluster, 1) == set() and pool.stats().lost == 10
    for i, k in enumerate(KEYS):
        assert pool.put(k, _state(i), {})
    assert all(pool.get(k) is not None for k in dead)  # hits again
    st = pool.stats()
    assert (st.hits, st.restarts, st.nodes_down) == (30, 1, 0)
    assert _raw_keys(cluster, 1) == dead


def test_several_urls_must_be_one_cluster(redis_server, tmp_path):
    with pytest.raises(ValueError) as e:
        RedisSnapshotPool("redis://127.0.0.1:1/0,http://x", fingerprint=FP)
    assert str(e.value) == ("The Redis URL must start with redis://, rediss:// or unix:// (or be "
                            "several such URLs, comma-separated: seeds of one cluster), got "
                            "'redis://127.0.0.1:1/0,http://x'.")
    with pytest.raises(PoolConfigError) as e:
        RedisSnapshotPool(f"{redis_server.url},{redis_server.url}", fingerprint=FP)
    assert str(e.value) == (f"The Redis server at {redis_server.url} is not in cluster mode: "
                            f"several URLs in --redis-url name the seeds of one Redis Cluster "
                            f"(give one URL for one server).")


def test_a_users_cluster_node_without_a_budget_is_refused(tmp_path):
    """Every master's settings are read (never set): one node without maxmemory refuses the
    whole pool at connect, naming that node."""
    from conftest import redis_or_skip

    redis_or_skip()
    with RedisClusterNodes.start(tmp_path / "c", nodes=2, maxmemory_bytes=NODE_BYTES) as c:
        r = redis.Redis(host="127.0.0.1", port=c.servers[1].port)
        r.config_set("maxmemory", "0")  # the test's own node (the pool never sets it)
        with pytest.raises(PoolConfigError) as e:
            RedisSnapshotPool(c.servers[0].url, fingerprint=FP)  # one seed: the cluster found
        assert str(e.value).startswith(
            f"The Redis server at 127.0.0.1:{c.servers[1].port} (a node of "
            f"{c.servers[0].url}) runs with maxmemory 0 and maxmemory-policy 'volatile-lru'")
        assert r.config_get("maxmemory") == {"maxmemory": "0"}
        r.close()


# ---- the engine on the cluster: a node lost between turns -------------------------------------

def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


SESSIONS = 3
TURNS = ((4, 1), (1, 2))  # (new tokens, tokens to decode): under a block, the snapshot only


def _run(engine: Engine, before_turn) -> tuple[list[list[list[int]]], list[list[str]]]:
    """SESSIONS sessions, their turns interleaved; `before_turn(t)` runs before turn t."""
    sessions = [engine.session() for _ in range(SESSIONS)]
    out = [[] for _ in sessions]
    for t, (n, decode) in enumerate(TURNS):
        before_turn(t)
        for i, s in enumerate(sessions):
            out[i].append(list(s.send(_prompt(n, 100 * i + t), max_new_tokens=decode)))
    return out, [[r.tier for r in s.turns] for s in sessions]


def test_engine_turns_through_a_cluster_that_loses_a_node(small_model, tmp_path, cluster):
    """Node 1 killed between the turns of 3 sessions: every turn is answered, the snapshots on
    the live nodes hit, those on node 1 miss (replayed), and the tokens and tiers equal an
    engine on the in-process pool that lost exactly those snapshots."""
    kept: list[set[str]] = []  # the snapshot keys the cluster holds before each turn

    def fault(t: int) -> None:
        if t == 1:
            cluster.servers[1].kill()
        kept.append(set().union(*(_raw_keys_of(cluster, n, e.keys.salt)
                                  for n in range(NODES) if n != 1 or t != 1)))

    with Engine.from_model(small_model, weights_hash=W, page_tokens=PAGE,
                           store_dir=tmp_path / "s", redis_url=cluster.url) as e:
        e.pool.retry_s = 0.0  # try node 1 again at every call
        got = _run(e, fault)
        st = e.stats().pool
    with Engine.from_model(small_model, weights_hash=W, page_tokens=PAGE,
                           store_dir=tmp_path / "ref") as ref:
        def lose(t: int) -> None:
            for k in [k for k in ref.pool.backend.keys() if k not in kept[t]]:
                ref.pool.drop(k)

        want = _run(ref, lose)
    assert got == want
    assert [s[1] for s in got[1]] == ["cold", "cold", "snapshot"]  # s0, s1 were on node 1
    # the engine asks `contains` first: node 1's snapshots are unavailable (not counted as
    # misses of a get), and turn 2's two writes to node 1 failed
    assert (st.hits, st.misses, st.write_errors, st.entries) == (1, 0, 2, 2)
    assert (st.nodes, st.nodes_down) == (3, 1) and st.unavailable >= 2


def _raw_keys_of(c: RedisClusterNodes, i: int, fp: bytes) -> set[str]:
    r = redis.Redis(host="127.0.0.1", port=c.servers[i].port)
    try:
        pre = f"{KEY_PREFIX}{fp.hex()}:{{"
        return {k.decode()[len(pre):-1] for k in r.keys(f"{pre}*")}
    finally:
        r.close()


# ---- the CLI: --redis-url takes one server or a cluster's seeds --------------------------------

def test_redis_url_flag_takes_a_clusters_seeds(cluster):
    from dsv41.compiler.tools.cli.serve import check_redis

    cluster.servers[0].kill()
    check_redis(cluster.url, timeout_s=1.0)  # one seed answers: enough
    dead = cluster.servers[0].url
    with pytest.raises(ValueError) as e:
        check_redis(f"{dead},{dead}", timeout_s=1.0)
    assert str(e.value).startswith(f"--redis-url {dead},{dead}: no Redis server answers there (")
    pool = RedisSnapshotPool(cluster.url, fingerprint=FP)  # the first seed dead: the next
    assert pool.put("x", _state(1), {}) and pool.get("x") is not None
    assert pool.stats().nodes == 3


def test_an_epd_stage_needs_one_server():
    from dsv41.runtime.serving.assembly import ServeOptions, ServingOptions

    opts = ServeOptions(ServingOptions(redis_url="redis://a:1/0,redis://b:1/0"), role="decode")
    with pytest.raises(ValueError) as e:
        opts.validate()
    assert str(e.value) == ("--role decode needs one Redis server in --redis-url: the stages' "
                            "queues and hand-offs are not spread over a cluster (give one "
                            "server's URL).")
