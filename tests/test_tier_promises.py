"""The promises README.md and docs/runtime-and-tiers.md make about the tiers, the sessions, the
SSD store and the DRAM / Redis pools: one test per sentence that states a guarantee, the
sentence quoted first in its docstring (`<file>: "<sentence>"`), and a test that every quoted
sentence is still, word for word, in its file (so the docs and these tests cannot drift apart).

Deeper tests of each tier live beside it (test_kv_store, test_snapshot_pool, test_redis_pool,
test_engine_tiers, test_faults); these check each promise as it is worded, on the torch graph
over shared-small with pages of 8 positions.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from dsv41.runtime.engine import Engine
from dsv41.runtime.tiers import ssd_store
from dsv41.runtime.tiers.dram_pool import SnapshotPool, default_budget_bytes
from dsv41.runtime.tiers.redis_pool import (
    HOLD_PREFIX,
    KEY_PREFIX,
    POLICY,
    PoolConfigError,
    RedisSnapshotPool,
)
from dsv41.runtime.tiers.redis_server import RedisServer
from dsv41.runtime.tiers.ssd_store import (
    MAX_CLOCK_SKEW_S,
    KVStore,
    model_fingerprint,
)
from dsv41.runtime.tiers.store_folder import MARKER_NAME, StoreFolderError
from dsv41.runtime.tiers.wire import RecordKind, decode_record

ROOT = Path(__file__).resolve().parents[1]
PAGE = 8
W = "w" * 64
FP = model_fingerprint("cfg", "weights", 1)
LIFE = 100.0


def _engine(model, store=None, **kw) -> Engine:
    return Engine.from_model(model, weights_hash=W, page_tokens=PAGE, store_dir=store, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _state(seed: int = 0, n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ring": rng.integers(0, 256, (n, 4), dtype=np.uint8),
            "pos": np.array([n], dtype=np.int64)}


def _block(seed: int) -> dict[str, np.ndarray]:
    return {"kv": np.random.default_rng(seed).standard_normal(64).astype(np.float32)}


def _key(i: int) -> str:
    return f"{i:064x}"


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _store(root: Path, clock: Clock | None = None, capacity: int = 1 << 30) -> KVStore:
    return KVStore(root, capacity_bytes=capacity, fingerprint=FP, min_lifetime_s=LIFE,
                   clock=clock or Clock())


def _redis(tmp_path: Path, **kw) -> RedisServer:
    from conftest import redis_or_skip

    redis_or_skip()
    return RedisServer.start(tmp_path / "redis", **kw)


def _raw(server: RedisServer):
    import redis

    return redis.Redis.from_url(server.url)


# ---- the docs' sentences are the ones quoted here ------------------------------------------------

_QUOTE = re.compile(r'^(README\.md|docs/[\w-]+\.md): "(.+?)"', re.S)


def _words(text: str) -> str:
    return " ".join(text.split())


def test_every_quoted_promise_is_in_its_file_word_for_word():
    me = test_every_quoted_promise_is_in_its_file_word_for_word
    quoted = {name: _QUOTE.match(f.__doc__ or "") for name, f in globals().items()
              if name.startswith("test_") and f is not me}
    assert all(quoted.values()), [n for n, m in quoted.items() if not m]
    for name, m in quoted.items():
        assert _words(m.group(2)) in _words((ROOT / m.group(1)).read_text()), name


# ---- README.md -----------------------------------------------------------------------------------

def test_readme_next_turns_are_served_from_the_snapshot(small_model, tmp_path):
    """README.md: "The first turn is cold (CED prefill of the 512-token context), the next ones
    are served from the DRAM snapshot and prefill only their new tokens; the last 16 tokens of
    every prefill go through the decoder's bounded replay."

    (16: the small preset's window.)"""
    w = small_model.args.window_size
    with _engine(small_model, tmp_path / "s") as e:
        s = e.session()
        for n, seed in ((20, 1), (16, 2), (16, 3)):
            list(s.send(_prompt(n, seed), max_new_tokens=1))
        recs = s.turns
    assert [r.tier for r in recs] == ["cold", "snapshot", "snapshot"]
    assert [r.prefilled for r in recs] == [20, 17, 17]  # the new tokens (+ the pending one)
    assert [r.decoder_replayed for r in recs] == [w, w, w] and w == 16


def test_readme_restart_between_turns_carries_over_by_the_ssd_store(small_model, tmp_path):
    """README.md: "`--restart-between-turns` a new engine per turn (only the SSD store carries the
    conversation over)"

    (what the flag does, on the engine: a new engine on the same store resumes from its
    blocks; its pool, in the process that ended, is gone.)"""
    with _engine(small_model, tmp_path / "s") as e:
        s = e.session()
        list(s.send(_prompt(20, 1), max_new_tokens=2))
        transcript = s.transcript
    with _engine(small_model, tmp_path / "s") as e:
        s = e.session(transcript=transcript)
        list(s.send([7], max_new_tokens=2))
        assert (s.turns[-1].tier, len(s.turns[-1].reused_keys)) == ("prefix", 2)


# ---- docs/runtime-and-tiers.md: keys and sessions ------------------------------------------------

def test_a_session_holds_its_snapshot_under_its_uid(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "a session holds its DRAM snapshot under its uid
    (`Session.uid`).\""""
    with _engine(small_model, tmp_path / "s") as e:
        a, b = e.session(), e.session()
        list(a.send(_prompt(5, 1), max_new_tokens=1))
        assert not e.pool.drop(a.snapshot_key, holder=b.uid)  # b holds nothing there
        assert e.pool.drop(a.snapshot_key, holder=a.uid)  # a was its only holder: gone
        assert not e.pool.contains(a.snapshot_key)


def test_keys_name_tokens_so_any_session_in_any_process_is_served(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "Keys name tokens, not sessions, so any session's records
    serve any request, in any process: the longest run of the sequence's complete blocks in the
    SSD store (a walk over the chained keys), then the latest snapshot within the block after
    them (DRAM pool; exact mode also the SSD state records)."

    (two engines on one Redis pool and one store, one after the other.)"""
    with _redis(tmp_path) as server:
        with _engine(small_model, tmp_path / "s", redis_url=server.url) as a:
            sa = a.session()
            list(sa.send(_prompt(21, 1), max_new_tokens=1))
            transcript = sa.transcript
        with _engine(small_model, tmp_path / "s", redis_url=server.url) as b:
            sb = b.session()
            list(sb.send(transcript + [9], max_new_tokens=1))
            rec = sb.turns[-1]
            assert (rec.tier, rec.reused_keys, rec.reused_tokens) == \
                ("snapshot", b.block_keys(transcript)[:2], 21)


def test_diverging_sessions_share_only_the_blocks_before_the_divergence(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "Two sessions that share a prefix and diverge share only the
    blocks before the divergence.\""""
    with _engine(small_model, tmp_path / "s") as e:
        a, b = e.session(), e.session()
        pa = _prompt(25, 1)
        list(a.send(pa, max_new_tokens=1))
        e.flush()
        list(b.send(pa[:12] + _prompt(13, 2), max_new_tokens=1))  # diverges inside block 1
        assert b.turns[-1].reused_keys == e.block_keys(a.history)[:1]


def test_a_session_moving_on_lets_go_of_its_own_hold_only(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "A session that moves on lets go of its own hold on its
    previous snapshot only: a snapshot goes when no session of any engine on the pool holds it
    (or by its TTL or the budget).\""""
    with _engine(small_model, tmp_path / "s") as e:
        a, b = e.session(), e.session()
        p = _prompt(5, 1)
        list(a.send(p, max_new_tokens=1))
        list(b.send(p, max_new_tokens=1))
        shared = a.snapshot_key
        assert b.snapshot_key == shared
        list(a.send([7], max_new_tokens=1))
        assert e.pool.contains(shared)  # b still holds it
        list(b.send([8], max_new_tokens=1))
        assert not e.pool.contains(shared)  # its last holder moved on


def test_a_record_that_does_not_fit_is_a_counted_deleted_miss(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "Every record is checked against the arrays this engine
    restores (names, shapes, dtypes, position) before use: one that does not fit is a counted
    miss, deleted, never an error."

    (here: a snapshot whose position is not the one its key names.)"""
    with _engine(small_model, tmp_path / "s") as e:
        s = e.session()
        list(s.send(_prompt(5, 1), max_new_tokens=1))
        key = s.snapshot_key
        snap = e.pool.get(key)
        arrays = dict(snap.arrays, pos=snap.arrays["pos"] - 1)
        assert e.pool.put(key, arrays, snap.meta, holder=s.uid)
        list(s.send([7], max_new_tokens=1))
        assert s.turns[-1].tier == "cold"
        st = e.stats().pool
        assert (st.corrupted, st.hits) == (1, 1) and not e.pool.contains(key)


# ---- docs/runtime-and-tiers.md: the SSD store ----------------------------------------------------

def test_ssd_only_old_entries_are_evicted_and_young_ones_refuse_writes(tmp_path):
    """docs/runtime-and-tiers.md: "Only entries older than the minimum lifetime are evicted
    (least recently used first); when the store is full of younger entries, writes are refused
    and counted.\""""
    clock = Clock(0.0)
    probe = _store(tmp_path / "p", clock)
    probe.put(_key(0), _block(0))
    s = _store(tmp_path / "s", clock, capacity=2 * probe.stats().bytes)
    assert s.put(_key(1), _block(1)) and s.put(_key(2), _block(2))
    assert not s.put(_key(3), _block(3)) and s.stats().refused_writes == 1
    clock.t = LIFE
    assert s.get(_key(1)) is not None  # LRU: key 2, then key 1
    assert s.put(_key(3), _block(3))
    assert [s.contains(_key(i)) for i in (1, 2, 3)] == [True, False, True]


def test_ssd_ages_trust_the_clock_within_five_minutes(tmp_path):
    """docs/runtime-and-tiers.md: "Ages trust the clock within 5 minutes: an entry stamped
    further in the future (the clock stepped back) is of unknown age, evicted first and never
    protected.\""""
    assert MAX_CLOCK_SKEW_S == 300
    clock = Clock(0.0)
    probe = _store(tmp_path / "p", clock)
    probe.put(_key(0), _block(0))
    s = _store(tmp_path / "s", clock, capacity=2 * probe.stats().bytes)
    clock.t = 301.0
    assert s.put(_key(1), _block(1))  # stamped 301 s ahead of where the clock steps back to
    clock.t = 299.0
    assert s.put(_key(2), _block(2))  # stamped 299 s ahead: trusted
    clock.t = 0.0
    assert s.put(_key(3), _block(3))  # key 1 (unknown age) goes, key 2 (young) stays
    assert [s.contains(_key(i)) for i in (1, 2, 3)] == [False, True, True]
    assert not s.put(_key(4), _block(4))


def test_ssd_bad_entries_are_deleted_counted_misses(tmp_path):
    """docs/runtime-and-tiers.md: "Corrupted, truncated and foreign (other model) entries are
    detected, deleted, counted and served as misses.\""""
    s = _store(tmp_path / "s")
    other = KVStore(tmp_path / "o", capacity_bytes=1 << 30,
                    fingerprint=model_fingerprint("other", "weights", 1))
    for i in range(3):
        assert s.put(_key(i), _block(i))
    other.put(_key(2), _block(2))
    path = [tmp_path / "s" / _key(i)[:2] / f"{_key(i)}.blk" for i in range(3)]
    raw = path[0].read_bytes()
    path[0].write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    path[1].write_bytes(path[1].read_bytes()[:-5])
    path[2].write_bytes((tmp_path / "o" / _key(2)[:2] / f"{_key(2)}.blk").read_bytes())
    assert [s.get(_key(i)) for i in range(3)] == [None, None, None]
    st = s.stats()
    assert (st.corrupt, st.truncated, st.foreign, st.misses) == (1, 1, 1, 3)
    assert not any(p.exists() for p in path)


def test_ssd_folder_is_marked_and_an_unmarked_one_refused(tmp_path):
    """docs/runtime-and-tiers.md: "The folder is marked on first use (`DSV41-STORE.json`, with
    the format version); a non-empty folder without the marker is refused.\""""
    _store(tmp_path / "s").close()
    assert (tmp_path / "s" / MARKER_NAME).read_text() == \
        '{"kind": "dsv41-kv-store", "version": 1}\n'
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(StoreFolderError, match="is not empty and is not a dsv41 store"):
        _store(tmp_path / "user")
    assert [p.name for p in (tmp_path / "user").iterdir()] == ["notes.txt"]


def test_ssd_several_engines_share_one_folder(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "Several engines share one folder: any number of processes (or
    engines in one process) open it at once, and each serves the blocks the others wrote.\""""
    a, b = _engine(small_model, tmp_path / "s"), _engine(small_model, tmp_path / "s")
    sa = a.session()
    list(sa.send(_prompt(20, 1), max_new_tokens=2))
    a.blocks.drain()  # a's blocks are files now
    sb = b.session(transcript=sa.transcript)
    list(sb.send([7], max_new_tokens=2))
    assert (sb.turns[-1].tier, len(sb.turns[-1].reused_keys)) == ("prefix", 2)
    assert (b.store.stats().hits, b.store.stats().adopted) == (2, 2)
    a.close()
    b.close()


def test_ssd_scan_never_follows_a_link(tmp_path):
    """docs/runtime-and-tiers.md: "The scan never follows a link and deletes only regular files
    at an entry's path.\""""
    s = _store(tmp_path / "s")
    s.put(_key(1), _block(1))
    s.close()
    outside = tmp_path / "outside.blk"
    outside.write_bytes(b"garbage")
    (tmp_path / "s" / _key(2)[:2]).mkdir(exist_ok=True)
    (tmp_path / "s" / _key(2)[:2] / f"{_key(2)}.blk").symlink_to(outside)
    s = _store(tmp_path / "s")
    assert s.stats().entries == 1 and outside.read_bytes() == b"garbage"
    assert s.stats().corrupt == 0


def test_ssd_io_stays_in_the_folder_the_store_opened(tmp_path):
    """docs/runtime-and-tiers.md: "Every read, write and deletion goes through the folder the
    store opened (a directory descriptor, no link followed at any step), so a shard swapped for a
    link is a counted miss, never a file outside the store.\""""
    s = _store(tmp_path / "s")
    k = _key(1)
    s.put(k, _block(1))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{k}.blk").write_bytes(b"garbage")
    shutil.rmtree(tmp_path / "s" / k[:2])
    (tmp_path / "s" / k[:2]).symlink_to(outside, target_is_directory=True)
    assert s.get(k) is None and (outside / f"{k}.blk").read_bytes() == b"garbage"
    assert (s.stats().read_errors, s.stats().misses, s.stats().corrupt) == (1, 1, 0)


def test_ssd_folder_replaced_under_a_running_engine(small_model, tmp_path, caplog):
    """docs/runtime-and-tiers.md: "A store folder removed or replaced under a running engine
    disables the store, with a logged error: turns go on without the SSD tier, and nothing is
    written into the new folder.\""""
    root = tmp_path / "s"
    with _engine(small_model, root) as e:
        s = e.session()
        list(s.send(_prompt(20, 1), max_new_tokens=1))
        e.flush()
        shutil.rmtree(root)
        root.mkdir()
        with caplog.at_level("ERROR", logger=ssd_store.__name__):
            toks = list(s.send([7], max_new_tokens=2))
            e.flush()
        assert len(toks) == 2 and s.turns[-1].tier == "cold"
        assert e.stats().store.disabled and list(root.iterdir()) == []
        assert any("the SSD tier is disabled" in r.getMessage() for r in caplog.records)


def test_ssd_io_failures_are_counted_and_the_turn_keeps_its_tokens(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "I/O failures (permission, full disk, a directory or FIFO at a
    block path, a file where a shard folder should be) are misses or refused writes, counted
    (`read_errors`, `write_errors`) and logged once; the turn completes and keeps its tokens.\""""
    prompt = _prompt(20, 1)
    with _engine(small_model) as ref:
        want = list(ref.session().send(prompt, max_new_tokens=2))
    with _engine(small_model, tmp_path / "s") as e:
        for k in e.block_keys(prompt):
            (tmp_path / "s" / k[:2]).write_bytes(b"a file where the shard folder goes")
        s = e.session()
        assert list(s.send(prompt, max_new_tokens=2)) == want
        e.flush()
        st = e.stats().store
        assert st.writes == 0 and st.write_errors == 2 and s.transcript[-1] == want[-1]


# ---- docs/runtime-and-tiers.md: the DRAM and Redis pools -----------------------------------------

def test_dram_pool_ttl_budget_copies_and_holds():
    """docs/runtime-and-tiers.md: "TTL from the write (a hit does not extend it), expired entries
    swept on a schedule, byte budget (10% of host memory by default) with LRU eviction, private
    read-only copies, one hold per session standing at a snapshot.\""""
    clock = Clock(0.0)
    nbytes = sum(a.nbytes for a in _state().values())
    p = SnapshotPool(budget_bytes=2 * nbytes, ttl_s=10.0, clock=clock, sweep_interval_s=1.0)
    assert SnapshotPool().budget_bytes == default_budget_bytes()
    arrays = _state(1)
    p.put("a", arrays, holder="s1")
    arrays["ring"][:] = 0  # the pool kept its own copy
    clock.t = 9.0
    got = p.get("a")
    assert got.arrays["ring"].tobytes() == _state(1)["ring"].tobytes()
    got.arrays["ring"][:] = 0  # a fresh copy: the stored one is unchanged
    clock.t = 10.0
    assert p.stats().entries == 0 and p.stats().expired == 1  # swept; the hit did not extend
    p.put("b", _state(2))
    p.put("c", _state(3))
    p.get("b")
    p.put("d", _state(4))  # c, least recently used, goes
    assert [p.contains(k) for k in "bcd"] == [True, False, True]
    p.put("d", _state(4), holder="s1")
    p.put("d", _state(4), holder="s2")
    assert not p.drop("d", holder="s1") and p.drop("d", holder="s2")


def test_redis_one_key_per_snapshot_native_ttl_and_holds(tmp_path):
    """docs/runtime-and-tiers.md: "The same calls on a Redis server, so every engine process of
    the model on any machine shares one pool: one key per snapshot, `dsv41:snap:<model
    fingerprint>:{<key>}`, its value a `runtime/tiers/wire.py` record (magic, header with kind,
    key, fingerprint, `created_at`, meta and array layout, sha256 of every byte); the TTL is the
    key's native expiry (`SET PX`, a read does not extend it); the sessions holding a snapshot
    are a set `dsv41:hold:<model fingerprint>:{<key>}` beside it (a hold let go and the snapshot's
    deletion are one atomic script).\""""
    with _redis(tmp_path) as server:
        one = RedisSnapshotPool(server.url, fingerprint=FP, ttl_s=30.0)
        two = RedisSnapshotPool(server.url, fingerprint=FP, ttl_s=30.0)  # another process's
        raw = _raw(server)
        assert one.put("k", _state(1), {"tokens": 64}, holder="s1")
        assert two.put("k", _state(1), {"tokens": 64}, holder="s2")
        snap, hold = f"{KEY_PREFIX}{FP.hex()}:{{k}}", f"{HOLD_PREFIX}{FP.hex()}:{{k}}"
        assert sorted(raw.keys("*")) == sorted([snap.encode(), hold.encode()])
        rec = decode_record(raw.get(snap), kind=RecordKind.SNAPSHOT, key="k", fingerprint=FP)
        assert rec.meta == {"tokens": 64} and rec.arrays["ring"].tobytes() == \
            _state(1)["ring"].tobytes()
        ttl = raw.pttl(snap)
        assert 29_000 < ttl <= 30_000 and 29_000 < raw.pttl(hold) <= 30_000
        time.sleep(0.05)
        assert two.get("k") is not None and raw.pttl(snap) < ttl  # a read does not extend it
        assert raw.smembers(hold) == {b"s1", b"s2"}
        assert not one.drop("k", holder="s1") and two.contains("k")
        assert two.drop("k", holder="s2") and raw.dbsize() == 0


def test_redis_pool_never_changes_the_servers_settings(tmp_path):
    """docs/runtime-and-tiers.md: "The pool never changes the server's settings: it reads
    `maxmemory` and `maxmemory-policy` at connect and after a server restart (a new `run_id`,
    seen at the next put), and a server without a `maxmemory` or with a policy that never evicts
    is refused with a `PoolConfigError` naming the redis.conf lines (`maxmemory-policy
    volatile-lru` is the one to use).\""""
    with _redis(tmp_path, extra=["--maxmemory", "24mb", "--maxmemory-policy", "allkeys-lfu"]) \
            as server:
        before = _raw(server).config_get("maxmemory*")
        pool = RedisSnapshotPool(server.url, fingerprint=FP, budget_bytes=64 << 20, retry_s=0.0)
        server.restart()
        assert pool.put("k", _state(1))  # the restart seen, the settings read again
        assert pool.stats().restarts == 1 and _raw(server).config_get("maxmemory*") == before
    with RedisServer.start(tmp_path / "r2", extra=["--maxmemory-policy", "noeviction"]) as server:
        with pytest.raises(PoolConfigError, match="`maxmemory-policy volatile-lru` in its "
                                                  "redis.conf"):
            RedisSnapshotPool(server.url, fingerprint=FP)
        assert _raw(server).config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"


def test_redis_budget_is_the_servers_maxmemory(tmp_path):
    """docs/runtime-and-tiers.md: "The budget is the server's `maxmemory` (`pool_budget_bytes`,
    when smaller, caps a snapshot).\""""
    with _redis(tmp_path, maxmemory_bytes=8 << 20) as server:
        assert RedisSnapshotPool(server.url, fingerprint=FP).budget_bytes == 8 << 20
        capped = RedisSnapshotPool(server.url, fingerprint=FP, budget_bytes=1000)
        assert capped.budget_bytes == 1000
        assert not capped.put("big", {"a": np.zeros(1001, dtype=np.uint8)})
        assert capped.stats().refused == 1 and not capped.contains("big")


def test_the_runtime_configures_only_the_redis_server_it_starts(tmp_path):
    """docs/runtime-and-tiers.md: "The runtime configures only a redis-server it starts itself
    (`runtime/tiers/redis_server.py`: `maxmemory`, 10% of the host's memory by default, and
    `volatile-lru`).\""""
    with _redis(tmp_path) as server:
        cfg = _raw(server).config_get("maxmemory*")
        assert (cfg["maxmemory"], cfg["maxmemory-policy"]) == \
            (str(default_budget_bytes()), POLICY)


def test_redis_faults_are_counted_misses_and_the_turn_replays(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "Faults are counted misses (`RedisPoolStats`), and the turn
    replays from the SSD blocks: server down or slow (`unavailable`, 1 s timeouts, then the
    server is skipped for `retry_s`), a value that fails its checks (`corrupted` / `foreign`,
    deleted), a snapshot gone before its TTL (`lost`: evicted, or the server restarted) or after
    it (`expired`), a write refused for memory (`full`: only keys without expiry left)."

    (the server down, then restarted empty; the other faults: test_redis_pool.py.)"""
    with _redis(tmp_path) as server:
        with _engine(small_model, tmp_path / "s", redis_url=server.url) as e:
            e.pool.retry_s = 0.0
            s = e.session()
            list(s.send(_prompt(20, 1), max_new_tokens=1))
            server.kill()
            list(s.send([7], max_new_tokens=1))
            server.restart()
            list(s.send([8], max_new_tokens=1))
            assert [r.tier for r in s.turns] == ["cold", "prefix", "prefix"]
            st = e.stats().pool
            assert st.unavailable >= 1  # turn 2: the server down (its lookups skipped)
            # turn 3: turn 2's write never landed; turn 1's snapshot, gone before its TTL, is lost
            assert (st.write_errors, st.lost, st.misses, st.restarts, st.hits) == (1, 1, 1, 1, 0)


def test_exact_mode_resumes_in_a_new_process(small_model, tmp_path):
    """docs/runtime-and-tiers.md: "In exact mode the snapshot is also written to the SSD store,
    so a conversation resumes exactly in a new process."

    (a new engine on the store stands for the new process.)"""
    with _engine(small_model, tmp_path / "s", exact=True) as e:
        s = e.session()
        list(s.send(_prompt(12, 1), max_new_tokens=1))
        transcript = s.transcript
        want = list(s.send([7], max_new_tokens=2))
    with _engine(small_model, tmp_path / "s", exact=True) as e:
        s = e.session(transcript=transcript)
        assert list(s.send([7], max_new_tokens=2)) == want
        assert s.turns[-1].tier == "snapshot-ssd"
