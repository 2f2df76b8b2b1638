"""The DRAM snapshot pool on a real redis-server (runtime/redis_pool.py): keys, records, TTL as
native expiry, the budget as maxmemory + volatile-lru, and its faults (server killed mid-run,
restarted empty, a corrupted value, TTL expiry, memory full): each a counted miss, the turn
served by bounded replay, its tokens equal to an engine whose pool missed the same snapshot.

Each test starts its own redis-server (`redis_server` fixture, conftest.py); without the binary
they skip, under DSV41_REQUIRE_REDIS=1 (.ci/run) they fail. Turns run on the torch graph over
shared-small, pages of 8 positions.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from dsv41.runtime.engine import Engine
from dsv41.runtime.tiers.redis_pool import (
    KEY_PREFIX,
    POLICY,
    PoolConfigError,
    RedisSnapshotPool,
    hold_key,
    snapshot_key,
)
from dsv41.runtime.tiers.redis_server import RedisServer
from dsv41.runtime.tiers.wire import encode_record

PAGE = 8
FP = bytes(range(32))
W = "w" * 64
# three turns of one session: 20 prompt tokens (2 full blocks, then a snapshot in block 2),
# then two short continuations
TURNS = ((20, 1, 2), (2, 2, 2), (3, 3, 1))  # (new tokens, seed, tokens to decode)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _state(seed: int = 0, n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ring": rng.integers(0, 256, (n, 4), dtype=np.uint8),
            "tail": rng.standard_normal(n).astype(np.float32),
            "pos": np.array([n], dtype=np.int64)}


def _pool(server: RedisServer, **kw) -> RedisSnapshotPool:
    return RedisSnapshotPool(server.url, fingerprint=kw.pop("fingerprint", FP),
                             budget_bytes=kw.pop("budget_bytes", 64 << 20),
                             ttl_s=kw.pop("ttl_s", 60.0), retry_s=kw.pop("retry_s", 0.0), **kw)


def _raw(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def _engine(model, store, **kw) -> Engine:
    return Engine.from_model(model, weights_hash=W, page_tokens=PAGE, store_dir=store, **kw)


def _play(engine: Engine, turns=TURNS, faults=None) -> tuple[list[list[int]], list[str]]:
    """Each turn's tokens and tier; `faults[i]()` runs before turn i."""
    s = engine.session()
    out, tiers = [], []
    for i, (n, seed, decode) in enumerate(turns):
        if faults and i in faults:
            faults[i]()
        out.append(list(s.send(_prompt(n, seed), max_new_tokens=decode)))
        tiers.append(s.turns[-1].tier)
    return out, tiers


@pytest.fixture(scope="module")
def references(small_model, tmp_path_factory):
    """(tokens, tiers) of the turns with an in-process pool that always hits, and with one that
    always misses (a 1-byte budget refuses every snapshot)."""
    root = tmp_path_factory.mktemp("refs")
    with _engine(small_model, root / "hit") as e:
        hit = _play(e)
    with _engine(small_model, root / "miss", pool_budget_bytes=1) as e:
        miss = _play(e)
    assert hit[1] == ["cold", "snapshot", "snapshot"] and miss[1] == ["cold", "prefix", "prefix"]
    return hit, miss


# ---- the pool alone ------------------------------------------------------------------------------

def test_roundtrip_one_key_with_the_fingerprint_and_a_native_ttl(redis_server):
    pool = _pool(redis_server, ttl_s=30.0)
    a = _state(1)
    assert pool.put("k1", a, {"session": 3, "tokens": 64})
    got = pool.get("k1")
    assert got.meta == {"session": 3, "tokens": 64} and got.nbytes == sum(x.nbytes for x in
                                                                          a.values())
    for name in a:
        assert got.arrays[name].dtype == a[name].dtype
        assert got.arrays[name].tobytes() == a[name].tobytes()
        assert got.arrays[name].flags.writeable
    raw = _raw(redis_server)
    assert raw.keys("*") == [snapshot_key(FP, "k1").encode()]
    assert 29_000 < raw.pttl(snapshot_key(FP, "k1")) <= 30_000
    pool.get("k1")
    assert 0 < raw.pttl(snapshot_key(FP, "k1")) <= 30_000  # a read does not extend it
    st = pool.stats()
    assert (st.entries, st.hits, st.misses, st.budget) == (1, 2, 0, 64 << 20)
    assert pool.drop("k1") and not pool.contains("k1") and pool.get("k1") is None


def test_our_own_server_runs_with_a_budget_and_the_policy(tmp_path):
    """The one server the runtime configures is the one it starts (runtime/redis_server.py)."""
    from conftest import redis_or_skip

    redis_or_skip()
    with RedisServer.start(tmp_path / "r", maxmemory_bytes=32 << 20) as s:
        cfg = _raw(s).config_get("maxmemory*")
        assert cfg["maxmemory"] == str(32 << 20) and cfg["maxmemory-policy"] == POLICY
        assert _pool(s, budget_bytes=None).budget_bytes == 32 << 20  # the server's maxmemory
        assert _pool(s, budget_bytes=8 << 20).budget_bytes == 8 << 20  # a smaller cap
        assert _pool(s, budget_bytes=64 << 20).budget_bytes == 32 << 20
        assert _raw(s).config_get("maxmemory")["maxmemory"] == str(32 << 20)  # untouched


def test_a_port_another_server_holds_is_never_taken_for_ours(tmp_path, redis_server,
                                                           monkeypatch):
    """A free port another redis-server binds before ours does: the PONG on it is not our
    server's (its process id tells), so a server asked for that port fails naming the holder,
    and one started on a found port moves on to the next free one (never shares the other)."""
    from dsv41.runtime.tiers import redis_server as rs

    taken = redis_server.port
    with pytest.raises(rs.PortTakenError, match=f"Port {taken} is held"):
        RedisServer.start(tmp_path / "b", port=taken)
    found = iter([taken, rs.free_port()])
    monkeypatch.setattr(rs, "free_port", lambda: next(found))
    with RedisServer.start(tmp_path / "c") as s:
        assert s.port != taken and rs.answering_pid(s.port) == s.proc.pid
        assert rs.answering_pid(taken) == redis_server.proc.pid != s.proc.pid
        _raw(s).set("k", b"ours")
        assert _raw(redis_server).get("k") is None  # the first server saw nothing


def test_a_server_with_config_disabled_and_a_budget_is_accepted(tmp_path):
    from conftest import redis_or_skip

    redis_or_skip()
    with RedisServer.start(tmp_path / "r2", maxmemory_bytes=8 << 20,
                           extra=["--rename-command", "CONFIG", ""]) as s:
        assert _pool(s).budget_bytes == 8 << 20  # the server's own settings are accepted


def test_a_users_server_is_never_reconfigured(tmp_path):
    """A server the user gives us keeps its settings: an evicting one with a budget is used as
    it is (whatever budget the pool asks for), an unbounded or non-evicting one is refused with
    a clear error naming the redis.conf lines, and left as it was (issue 38: the pool used to
    CONFIG SET maxmemory and the policy on any server, and never restored them)."""
    from conftest import redis_or_skip

    redis_or_skip()
    users = {"ok": ["--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru"],
             "unbounded": ["--maxmemory", "0"],
             "noeviction": ["--maxmemory-policy", "noeviction"]}
    for name, extra in users.items():
        with RedisServer.start(tmp_path / name, extra=extra) as s:
            before = _raw(s).config_get("maxmemory*")
            if name == "ok":
                assert _pool(s, budget_bytes=64 << 20).budget_bytes == 16 << 20
                assert _pool(s, budget_bytes=None).put("k", _state(1), {})
            else:
                with pytest.raises(PoolConfigError) as err:
                    _pool(s, budget_bytes=32 << 20)
                policy = "noeviction" if name == "noeviction" else POLICY
                maxmem = 0 if name == "unbounded" else s.maxmemory_bytes
                assert str(err.value) == (
                    f"The Redis server at {s.url} runs with maxmemory {maxmem} and "
                    f"maxmemory-policy {policy!r}: the snapshot pool needs a byte bound and a "
                    f"policy that evicts expiring keys, and it never changes a server's "
                    f"settings. Set `maxmemory {32 << 20}` and `maxmemory-policy {POLICY}` in "
                    f"its redis.conf (or with CONFIG SET), or leave --redis-url out to use the "
                    f"in-process pool.")
            assert _raw(s).config_get("maxmemory*") == before


def test_another_models_snapshot_is_never_served(redis_server):
    mine, theirs = _pool(redis_server), _pool(redis_server, fingerprint=bytes(32))
    theirs.put("k", _state(2), {})
    assert mine.get("k") is None and not mine.contains("k")  # another key prefix
    # a value of another model under this model's key: detected inside the value, deleted
    value = encode_record(kind="snapshot", key="k", fingerprint=bytes(32), created_at=0.0,
                          meta={}, arrays=_state(2))
    _raw(redis_server).set(snapshot_key(FP, "k"), value, px=10_000)
    assert mine.get("k") is None
    st = mine.stats()
    assert (st.foreign, st.misses, st.corrupted) == (1, 2, 0)
    assert not _raw(redis_server).exists(snapshot_key(FP, "k"))
    assert theirs.get("k") is not None


def test_every_corrupted_byte_is_a_counted_miss(redis_server):
    pool, raw = _pool(redis_server), _raw(redis_server)
    rkey = snapshot_key(FP, "k")
    for i, where in enumerate((0.0, 0.01, 0.1, 0.5, 1.0)):
        pool.put("k", _state(3), {})
        at = min(int(where * raw.strlen(rkey)), raw.strlen(rkey) - 1)  # magic .. checksum
        byte = raw.getrange(rkey, at, at)
        raw.setrange(rkey, at, bytes([byte[0] ^ 0x20]))
        assert pool.get("k") is None
        assert pool.stats().corrupted == i + 1 and not raw.exists(rkey)
    pool.put("k", _state(3), {})
    raw.set(rkey, raw.getrange(rkey, 0, raw.strlen(rkey) - 10))  # truncated
    assert pool.get("k") is None and pool.stats().corrupted == 6


def test_expired_and_lost_are_told_apart(redis_server):
    pool = _pool(redis_server, ttl_s=0.2)
    pool.put("old", _state(4), {})
    pool.put("gone", _state(5), {})
    _raw(redis_server).delete(snapshot_key(FP, "gone"))  # as an eviction would
    assert pool.get("gone") is None
    time.sleep(0.4)
    assert not pool.contains("old") and pool.get("old") is None
    st = pool.stats()
    assert (st.expired, st.lost, st.misses, st.hits) == (1, 1, 3, 0)


def test_the_budget_evicts_least_recently_read_first(redis_server):
    raw = _raw(redis_server)
    used = int(raw.info("memory")["used_memory"])
    big = {"a": np.zeros(1_000_000, dtype=np.uint8)}  # one allocation class below 1 MiB
    budget = used + int(4.5 * (1 << 20))
    raw.config_set("maxmemory", str(budget))  # the test's own server (the pool never sets it)
    pool = _pool(redis_server, budget_bytes=None)
    # the server's LRU clock ticks once a second: k1 is made the one least recently used
    assert pool.put("k0", big, {}) and pool.put("k1", big, {})
    time.sleep(1.1)
    assert pool.put("k2", big, {}) and pool.get("k0") is not None
    time.sleep(1.1)
    assert pool.put("k3", big, {}) and pool.put("k4", big, {})
    present = [k for k in ("k0", "k1", "k2", "k3", "k4") if pool.contains(k)]
    assert "k1" not in present and {"k3", "k4"} <= set(present)
    st = pool.stats()
    assert st.evictions >= 1 and st.lost >= 1 and st.bytes <= budget
    assert not pool.put("huge", {"a": np.zeros(budget + 1, dtype=np.uint8)}, {})
    assert pool.stats().refused == 1


def test_a_dead_server_is_misses_and_refused_writes_then_recovers(redis_server):
    pool = _pool(redis_server, timeout_s=0.5)
    pool.put("k", _state(6), {})
    redis_server.kill()
    assert pool.get("k") is None and not pool.contains("k") and not pool.put("k2", _state(6), {})
    st = pool.stats()
    assert st.unavailable >= 3 and st.write_errors == 1 and st.misses == 1
    redis_server.restart()
    assert pool.put("k3", _state(6), {}) and pool.get("k3") is not None
    assert pool.stats().restarts == 1
    assert _raw(redis_server).config_get("maxmemory-policy")["maxmemory-policy"] == POLICY


def test_retry_window_skips_a_dead_server():
    clock = [0.0]
    pool = RedisSnapshotPool("redis://127.0.0.1:1/0", fingerprint=FP, budget_bytes=1 << 20,
                             retry_s=5.0, timeout_s=0.5, clock=lambda: clock[0])
    assert pool.stats().unavailable >= 1  # unreachable at connect: a warning, not an error
    n = pool.stats().unavailable
    assert pool.get("k") is None and pool.get("k") is None
    assert pool.stats().unavailable == n + 2 and pool.stats().misses == 2  # skipped, no connect


# ---- the engine on the Redis pool: faults are misses, outputs equal a run that missed ------------

def test_engine_hits_through_redis_like_the_in_process_pool(small_model, tmp_path,
                                                            redis_server, references):
    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        assert _play(e) == references[0]
        st = e.stats().pool
        assert (st.hits, st.misses) == (2, 0)


def test_server_killed_mid_run_then_restarted(small_model, tmp_path, redis_server, references):
    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        e.pool.retry_s = 0.0  # try the server again at every call (the default waits 1 s)
        got = _play(e, faults={1: redis_server.kill, 2: redis_server.restart})
        assert got == references[1]  # turn 2 missed (server dead), turn 3 (its snapshot lost)
        st = e.stats().pool
        assert st.unavailable >= 1 and st.write_errors == 1 and st.restarts == 1
        assert st.entries == 1  # turn 3's snapshot, on the restarted (reconfigured) server


def test_server_restarted_empty(small_model, tmp_path, redis_server, references):
    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        got = _play(e, TURNS[:2], faults={1: redis_server.restart})
        assert got == (references[1][0][:2], references[1][1][:2])
        st = e.stats().pool
        assert (st.lost, st.misses, st.restarts, st.hits) == (1, 1, 1, 0)


def test_corrupted_value(small_model, tmp_path, redis_server, references):
    raw = _raw(redis_server)

    def corrupt():
        (key,) = raw.keys(f"{KEY_PREFIX}*")
        raw.setrange(key, 1000, b"\xff\x00\xff")

    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        got = _play(e, TURNS[:2], faults={1: corrupt})
        assert got == (references[1][0][:2], references[1][1][:2])
        st = e.stats().pool
        assert (st.corrupted, st.misses, st.hits) == (1, 1, 0)


def test_ttl_expiry(small_model, tmp_path, redis_server, references):
    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url, pool_ttl_s=0.3) as e:
        got = _play(e, TURNS[:2], faults={1: lambda: time.sleep(0.5)})
        assert got == (references[1][0][:2], references[1][1][:2])
        st = e.stats().pool
        assert (st.expired, st.misses, st.hits) == (1, 1, 0)


def test_memory_full(small_model, tmp_path, redis_server, references):
    """The server holds more than the budget in keys without expiry, which volatile-lru may not
    evict (another user's data): every snapshot write is refused (OOM), counted `full`."""
    raw = _raw(redis_server)
    for i in range(64):
        raw.set(f"other:{i}", b"x" * (16 << 10))
    budget = int(raw.info("memory")["used_memory"]) - (256 << 10)
    raw.config_set("maxmemory", str(budget))  # the test's own server (the pool never sets it)
    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        got = _play(e, TURNS[:2])
        assert got == (references[1][0][:2], references[1][1][:2])
        st = e.stats().pool
        assert (st.full, st.hits, st.budget) == (2, 0, budget)  # both turns' snapshots refused
    assert raw.dbsize() == 64


def test_two_engines_share_one_pool(small_model, tmp_path, redis_server):
    """A session continued by another engine (another process would do the same): a history
    shorter than a block needs no SSD block, only the shared snapshot."""
    with _engine(small_model, tmp_path / "a", redis_url=redis_server.url) as a, \
            _engine(small_model, tmp_path / "b", redis_url=redis_server.url) as b:
        sa = a.session()
        list(sa.send(_prompt(4, 7), max_new_tokens=2))
        sb = b.session(transcript=sa.transcript)
        got = list(sb.send(_prompt(1, 8), max_new_tokens=3))
        assert sb.turns[-1].tier == "snapshot"
        assert got == list(sa.send(_prompt(1, 8), max_new_tokens=3))


def test_bench_pool_times_both_pools_on_the_bills_snapshot(redis_server):
    from dsv41.compiler.tools.bench.pool import PoolBenchOptions, run_pool_bench, snapshot_arrays_of
    from dsv41.graph.config import preset
    from dsv41.graph.layout import encoder_snapshot_bytes
    from dsv41.graph.plan import build_plan

    full = snapshot_arrays_of("full")
    assert sum(a.nbytes for a in full.values()) == encoder_snapshot_bytes(
        build_plan(preset("full"))) == 1_376_296  # `dsv41 bill --preset full`
    r = run_pool_bench(PoolBenchOptions(preset="small", reps=2, redis_url=redis_server.url))
    for name in ("in_process", "redis"):
        assert r[name]["put_s"] > 0 and r[name]["get_s"] > 0 and r[name]["put_MBps"] > 0
    assert r["redis"]["url"] == redis_server.url and not r["redis"]["started_here"]
    assert r["snapshot_bytes"] == encoder_snapshot_bytes(build_plan(preset("small")))


def test_a_urls_password_is_never_printed():
    from dsv41.runtime.tiers.redis_pool import masked_url

    assert masked_url("redis://:s3cret@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert masked_url("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert masked_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError) as e:
        RedisSnapshotPool("http://:s3cret@h", fingerprint=FP)
    assert "s3cret" not in str(e.value)


# ---- issue 38: holds across engines, records this engine cannot restore --------------------------

def test_holds_one_snapshot_many_holders(redis_server):
    """A drop with a holder lets go of that hold only; the snapshot goes with its last holder,
    and a holder that never held it deletes nothing."""
    pool, raw = _pool(redis_server), _raw(redis_server)
    assert pool.put("k", _state(1), {}, holder="a") and pool.put("k", _state(1), {}, holder="b")
    assert raw.smembers(hold_key(FP, "k")) == {b"a", b"b"}
    assert not pool.drop("k", holder="x") and not pool.drop("k", holder="a")
    assert pool.contains("k") and not pool.drop("k", holder="a")
    assert pool.drop("k", holder="b") and not pool.contains("k") and raw.dbsize() == 0


def test_a_session_moving_on_never_deletes_another_engines_snapshot(small_model, tmp_path,
                                                                     redis_server):
    """Two engines (two processes of a deployment) on one pool, a session on each with one
    history: the first moving on used to delete the snapshot the second needs (the engine only
    knew its own sessions), so the second was served cold with other tokens."""
    p1, p2, p3 = _prompt(5, 7), _prompt(1, 8), _prompt(1, 9)  # under a block: the snapshot alone
    with _engine(small_model, tmp_path / "a", redis_url=redis_server.url) as a, \
            _engine(small_model, tmp_path / "b", redis_url=redis_server.url) as b:
        sa, sb = a.session(), b.session()
        assert list(sa.send(p1, max_new_tokens=1)) == list(sb.send(p1, max_new_tokens=1))
        list(sa.send(p2, max_new_tokens=1))  # a moves on: it lets go of its hold only
        got = list(sb.send(p3, max_new_tokens=3))
        assert sb.turns[-1].tier == "snapshot"
        assert (b.stats().pool.hits, b.stats().pool.misses) == (1, 0)
    with _engine(small_model, tmp_path / "ref") as ref:
        s = ref.session()
        list(s.send(p1, max_new_tokens=1))
        want = list(s.send(p3, max_new_tokens=3))
        assert s.turns[-1].tier == "snapshot"
    assert got == want


def _refit(arrays: dict, how: str) -> dict:
    """The snapshot's arrays with its first ring array missing, reshaped or retyped."""
    name = min(k for k in arrays if k.startswith("ring."))
    out = dict(arrays)
    if how == "missing":
        del out[name]
    elif how == "reshaped":
        out[name] = out[name].reshape(-1)
    else:
        out[name] = out[name].view(np.int8) if out[name].dtype != np.int8 \
            else out[name].view(np.uint8)
    return out


@pytest.mark.parametrize("how", ["missing", "reshaped", "retyped"])
def test_a_well_formed_record_this_engine_cannot_restore_is_a_deleted_miss(
        small_model, tmp_path, redis_server, references, how):
    """A record with the right kind, key, fingerprint and checksum whose arrays do not fit the
    engine used to raise out of the turn (and stay, failing that prefix on every engine until
    its TTL): now a miss, counted `corrupted`, deleted, the turn served as any miss."""
    from dsv41.runtime.tiers.wire import decode_record

    raw = _raw(redis_server)

    def refit():
        (rkey,) = raw.keys(f"{KEY_PREFIX}*")
        key = rkey.decode()[len(f"{KEY_PREFIX}{e.keys.salt.hex()}:{{"):-1]
        rec = decode_record(raw.get(rkey), kind="snapshot", key=key, fingerprint=e.keys.salt)
        value = encode_record(kind="snapshot", key=key, fingerprint=e.keys.salt,
                              created_at=rec.created_at, meta=rec.meta,
                              arrays=_refit(rec.arrays, how))
        raw.set(rkey, value, px=60_000)

    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        got = _play(e, TURNS[:2], faults={1: refit})
        assert got == (references[1][0][:2], references[1][1][:2])
        st = e.stats().pool
        assert (st.corrupted, st.misses, st.hits) == (1, 1, 0)
        assert len(raw.keys(f"{KEY_PREFIX}*")) == 1  # the bad one deleted; turn 2's stored


def test_server_lost_inside_a_turn_then_restarted_is_misses_never_errors(small_model, tmp_path,
                                                                          redis_server):
    """The server dies while a turn decodes (after its restore, before its snapshot is
    written) and comes back empty: the turn ends normally (its write counted), the next turn
    misses (`lost` is not counted: the write never landed) and replays from the SSD blocks with
    the tokens of an engine whose pool lost that snapshot too."""
    def play(e, during=None, before_last=None):
        s, out = e.session(), []
        for i, (n, seed, decode) in enumerate(TURNS):
            if i == 2 and before_last:
                before_last()
            gen = s.send(_prompt(n, seed), max_new_tokens=decode)
            toks = [next(gen)]
            if i == 1 and during:
                during()
            out.append(toks + list(gen))
        return out, [r.tier for r in s.turns]

    with _engine(small_model, tmp_path / "s", redis_url=redis_server.url) as e:
        e.pool.retry_s = 0.0
        got = play(e, during=redis_server.kill, before_last=redis_server.restart)
        st = e.stats().pool
        assert (st.write_errors, st.restarts, st.hits) == (1, 1, 1) and st.unavailable >= 1
    with _engine(small_model, tmp_path / "ref") as ref:  # its pool loses turn 2's snapshot
        want = play(ref, before_last=lambda: [ref.pool.drop(k) for k in ref.pool.backend.keys()])
    assert got == want and got[1] == ["cold", "snapshot", "prefix"]
