"""Several processes on one SSD store folder (issue 42, item 2): each serves the blocks the others
wrote, a writer killed mid-write never exposes a partial or foreign entry, eviction by one never
serves a half-deleted entry to another, and no owner evicts another's entry younger than the
minimum lifetime.

The processes are forked (`multiprocessing`'s fork context: no interpreter start per round) and
work on real files in `tmp_path`. A block's bytes are a function of its key (`content`), so any
reader checks exactly what it was served.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dsv41.runtime.tiers.ssd_store import HEADER_SIZE, KVStore, encode_block, model_fingerprint

FP = model_fingerprint("cfg", "weights", 1)
FP_OTHER = model_fingerprint("cfg-other", "weights", 1)
FORK = multiprocessing.get_context("fork")


def key(owner: str, i: int) -> str:
    return hashlib.sha256(f"{owner}{i}".encode()).hexdigest()


def content(k: str, n: int = 2048) -> dict[str, np.ndarray]:
    """The one right block of key `k` (n float32 from its digest)."""
    seed = int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "little")
    return {"kv": np.random.default_rng(seed).standard_normal(n).astype(np.float32)}


BLOCK_BYTES = HEADER_SIZE + len(encode_block(content(key("x", 0))))


def served_right(k: str, got: dict[str, np.ndarray] | None) -> bool:
    return got is None or (
        list(got) == ["kv"] and got["kv"].tobytes() == content(k)["kv"].tobytes()
    )


def run_children(*targets) -> list[dict]:
    """Run each (function, args) in a forked child; their JSON results, in order."""
    procs, reads = [], []
    for fn, args in targets:
        r, w = os.pipe()
        p = FORK.Process(target=_child, args=(fn, args, w))
        p.start()
        os.close(w)
        procs.append(p)
        reads.append(r)
    out = []
    for p, r in zip(procs, reads, strict=True):
        with os.fdopen(r) as f:
            out.append(json.loads(f.read() or "null"))
        p.join(60)
        assert p.exitcode == 0, (p.exitcode, out[-1])
    return out


def _child(fn, args, w: int) -> None:
    result = fn(*args)
    with os.fdopen(w, "w") as f:
        f.write(json.dumps(result))


def stats(s: KVStore) -> dict:
    st = s.stats()
    return {
        f: getattr(st, f)
        for f in (
            "hits",
            "misses",
            "writes",
            "evictions",
            "corrupt",
            "truncated",
            "foreign",
            "adopted",
            "entries",
        )
    }


# -- two processes, each serving the other's blocks -------------------------------------------


def ping_pong(root: str, me: str, other: str, n: int, both_open) -> dict:
    """Write my n blocks interleaved with reads of the other's until all n were served."""
    s = KVStore(root, capacity_bytes=1 << 30, fingerprint=FP)
    both_open.wait(30)  # neither index holds a block yet: every one of the other's is adopted
    served, wrong, deadline = set(), 0, time.monotonic() + 30
    for i in range(n):
        assert s.put(key(me, i), content(key(me, i)))
        for j in range(n):
            if j not in served:
                got = s.get(key(other, j))
                wrong += not served_right(key(other, j), got)
                if got is not None:
                    served.add(j)
    while len(served) < n and time.monotonic() < deadline:
        for j in set(range(n)) - served:
            got = s.get(key(other, j))
            wrong += not served_right(key(other, j), got)
            if got is not None:
                served.add(j)
    return {"served": sorted(served), "wrong": wrong, **stats(s)}


def test_two_processes_each_serve_the_others_blocks(tmp_path):
    both_open = FORK.Barrier(2)
    a, b = run_children(
        (ping_pong, (str(tmp_path), "a", "b", 12, both_open)),
        (ping_pong, (str(tmp_path), "b", "a", 12, both_open)),
    )
    for r in (a, b):
        assert r["served"] == list(range(12)) and r["wrong"] == 0
        assert (r["writes"], r["hits"], r["adopted"], r["entries"]) == (12, 12, 12, 24)
        assert (r["corrupt"], r["truncated"], r["foreign"]) == (0, 0, 0)
    with KVStore(tmp_path, capacity_bytes=1 << 30, fingerprint=FP) as s:  # a third, later
        assert s.stats().entries == 24 and s.stats().bytes == 24 * BLOCK_BYTES
        for k in [key(o, i) for o in "ab" for i in range(12)]:
            assert s.get(k)["kv"].tobytes() == content(k)["kv"].tobytes()


# -- kill -9 of a writer mid-write while another writes ---------------------------------------


def write_forever(root: str, owner: str, fp: bytes) -> None:
    s = KVStore(root, capacity_bytes=1 << 30, fingerprint=fp)
    for i in range(10**9):
        s.put(key(owner, i), content(key(owner, i)))


def write_and_read(root: str, rounds_done: str, n: int) -> dict:
    """The survivor: writes its own blocks and reads every block of the killed writers (this
    model's) until the parent says the rounds are over; every block served is checked."""
    s = KVStore(root, capacity_bytes=1 << 30, fingerprint=FP)
    i, wrong, hits = 0, 0, 0
    while not os.path.exists(rounds_done) or i < n:
        assert s.put(key("live", i), content(key("live", i)))
        i += 1
        for r in set(range(20)) - {OTHER_MODEL_ROUND}:
            for j in range(4):
                got = s.get(key(f"k{r}", j))
                wrong += not served_right(key(f"k{r}", j), got)
                hits += got is not None
    own = all(
        served_right(key("live", j), s.get(key("live", j))) and s.contains(key("live", j))
        for j in range(i)
    )
    return {"written": i, "own_whole": own, "wrong": wrong, "hits_of_killed": hits, **stats(s)}


OTHER_MODEL_ROUND = 6  # its writer is another model's: its entries are kept, never served


def listing(folder: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every path under `folder` but `skip`, with its size and mtime (what must not change)."""
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if Path(dirpath) / d != skip]
        for name in [*dirs, *files]:
            st = os.lstat(Path(dirpath) / name)
            out[str((Path(dirpath) / name).relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_writer_killed_mid_write_20_times_never_exposes_a_bad_entry(tmp_path):
    parent, root = tmp_path / "parent", tmp_path / "parent" / "store"
    parent.mkdir()
    (parent / "mine.txt").write_text("not the store's")
    (parent / "sub").mkdir()
    (parent / "sub" / "x.bin").write_bytes(b"\x00" * 100)
    os.symlink(parent / "mine.txt", parent / "link")
    KVStore(root, capacity_bytes=1 << 30, fingerprint=FP).close()
    before = listing(parent, root)
    done = str(tmp_path / "rounds-done")
    r_pipe, w_pipe = os.pipe()
    survivor = FORK.Process(target=_child, args=(write_and_read, (str(root), done, 5), w_pipe))
    survivor.start()
    os.close(w_pipe)
    mid_write = 0
    for r in range(20):  # each round a new writer (its own keys k<r>), killed with SIGKILL
        fp = FP_OTHER if r == OTHER_MODEL_ROUND else FP
        w = FORK.Process(target=write_forever, args=(str(root), f"k{r}", fp))
        w.start()
        first = root / key(f"k{r}", 0)[:2] / f"{key(f'k{r}', 0)}.blk"
        deadline = time.monotonic() + (10.0 if r % 2 == 0 else 0.05 * (r % 5))
        while time.monotonic() < deadline:  # even rounds: the moment a temp file of its exists
            if (
                r % 2 == 0
                and list(root.glob(f"*/.*.{w.pid}.*.tmp"))
                and (r != OTHER_MODEL_ROUND or first.exists())
            ):
                break
            time.sleep(0.0005)
        os.kill(w.pid, signal.SIGKILL)
        w.join()
        mid_write += bool(list(root.glob(f"*/.*.{w.pid}.*.tmp")))
    Path(done).touch()
    with os.fdopen(r_pipe) as f:
        live = json.loads(f.read())
    survivor.join(60)
    assert survivor.exitcode == 0
    assert live["wrong"] == 0 and live["own_whole"] and live["hits_of_killed"] > 0
    assert (live["corrupt"], live["truncated"], live["foreign"]) == (0, 0, 0)
    assert mid_write >= 5  # the even rounds caught writers between create and publish
    left = len(list(root.glob("*/.*.tmp")))
    with KVStore(root, capacity_bytes=1 << 30, fingerprint=FP) as s:  # the next start's scan
        st = s.stats()
        assert (st.corrupt, st.truncated, st.foreign, st.read_errors) == (0, 0, 0, 0)
        assert st.others >= 1  # the other model's entries: kept, never served
        assert not list(root.glob("*/.*.tmp"))  # the killed writers' temp files removed
        ours = [p.stem for p in root.glob("*/*.blk") if s.contains(p.stem)]
        assert len(ours) == st.entries and all(s.get(k) is not None for k in ours)  # whole
    assert listing(parent, root) == before  # nothing outside the store touched
    print(
        json.dumps(
            {
                "rounds": 20,
                "killed_mid_write": mid_write,
                "temp_files_left": left,
                "survivor_writes": live["written"],
                "survivor_hits_of_killed": live["hits_of_killed"],
                "entries": st.entries,
                "others": st.others,
            }
        )
    )


# -- eviction by one process, reads by another ------------------------------------------------


def evict_constantly(root: str, n: int, room: int, done: str = "") -> dict:
    """Write n blocks into a folder with room for `room` (no lifetime): each write past the
    room evicts the least recently used block, whoever wrote it."""
    s = KVStore(root, capacity_bytes=room * BLOCK_BYTES, fingerprint=FP, min_lifetime_s=0)
    for i in range(n):
        assert s.put(key("e", i), content(key("e", i)))
    if done:
        Path(done).touch()
    return stats(s)


def read_constantly(root: str, n: int, done: str) -> dict:
    """Read the evicting writer's n keys until it is done, then once more; every block served
    is checked."""
    s = KVStore(root, capacity_bytes=1 << 30, fingerprint=FP)
    wrong, last = 0, False
    while not last:
        last = os.path.exists(done)
        for i in range(n):
            wrong += not served_right(key("e", i), s.get(key("e", i)))
    return {"wrong": wrong, **stats(s)}


def test_eviction_by_one_process_never_serves_a_half_deleted_entry(tmp_path):
    root, done = tmp_path / "store", str(tmp_path / "done")
    KVStore(root, capacity_bytes=1 << 30, fingerprint=FP).close()
    writer, reader = run_children(
        (evict_constantly, (str(root), 60, 4, done)), (read_constantly, (str(root), 60, done))
    )
    assert writer["writes"] == 60 and writer["evictions"] == 60 - 4
    assert reader["wrong"] == 0 and (reader["corrupt"], reader["truncated"]) == (0, 0)
    assert reader["hits"] >= 4 and reader["misses"] >= 56  # the last pass: 4 left, 56 gone
    blk = sorted(p for p in root.glob("*/*.blk"))
    # 4 of the writer's blocks, its last among them (which 4: the reader's hits move them)
    assert len(blk) == 4 and key("e", 59) in {p.stem for p in blk}
    assert {p.stem for p in blk} <= {key("e", i) for i in range(60)}
    assert sum(p.stat().st_size for p in blk) == 4 * BLOCK_BYTES  # the writer's room


def test_an_entry_evicted_by_another_process_is_a_plain_miss(tmp_path):
    mine = KVStore(tmp_path, capacity_bytes=2 * BLOCK_BYTES, fingerprint=FP, min_lifetime_s=0)
    k = key("m", 0)
    assert mine.put(k, content(k)) and mine.contains(k)
    (other,) = run_children((evict_constantly, (str(tmp_path), 3, 2)))
    assert other["evictions"] == 2  # the folder held 1 + 3 blocks of room 2: mine went first
    assert mine.get(k) is None and not mine.contains(k)
    st = mine.stats()
    assert (st.misses, st.corrupt, st.truncated, st.read_errors, st.entries) == (1, 0, 0, 0, 0)


# -- the minimum lifetime across processes ----------------------------------------------------


def put_at(root: str, t: float, k: str, lifetime: float = 100.0) -> dict:
    s = KVStore(
        root,
        capacity_bytes=2 * BLOCK_BYTES,
        fingerprint=FP,
        min_lifetime_s=lifetime,
        clock=lambda: t,
    )
    return {"stored": s.put(k, content(k)), **stats(s)}


def test_no_process_evicts_another_ones_young_entry(tmp_path):
    clock = [1000.0]
    mine = KVStore(
        tmp_path,
        capacity_bytes=2 * BLOCK_BYTES,
        fingerprint=FP,
        min_lifetime_s=100.0,
        clock=lambda: clock[0],
    )
    a, b = key("m", 0), key("m", 1)
    assert mine.put(a, content(a))
    clock[0] = 1050.0
    assert mine.put(b, content(b))  # the folder is full: a (1000), b (1050)
    # another process, opened after both were written, at ages 99 and 49: refused
    (young,) = run_children((put_at, (str(tmp_path), 1099.0, key("o", 0))))
    assert (young["stored"], young["evictions"]) == (False, 0)
    # one of no lifetime of its own honours the longest any writer here promised
    (short,) = run_children((put_at, (str(tmp_path), 1099.0, key("o", 0), 0.0)))
    assert (short["stored"], short["evictions"]) == (False, 0)
    assert mine.get(a) is not None and mine.get(b) is not None
    # at 1101 a is 101 s old: the other process evicts it (and only it)
    (old,) = run_children((put_at, (str(tmp_path), 1101.0, key("o", 1))))
    assert (old["stored"], old["evictions"]) == (True, 1)
    assert mine.get(a) is None and mine.get(b) is not None
    # a process that opened the folder before others filled it still honours their lifetime
    clock[0] = 1102.0
    assert not mine.put(key("m", 2), content(key("m", 2)))
    assert mine.get(key("o", 1))["kv"].tobytes() == content(key("o", 1))["kv"].tobytes()


# -- `dsv41 serve`'s persistent default store -------------------------------------------------


def test_serve_keeps_a_persistent_store_in_the_users_cache_folder(
    small_case, tmp_path, monkeypatch
):
    from dsv41.compiler.tools.cli.main import build_parser
    from dsv41.graph.checkpoint import weights_fingerprint
    from dsv41.runtime.serving.assembly import ServingOptions, default_store_folder, serving_engine

    ckpt = Path(small_case.checkpoint)
    model_id = weights_fingerprint(ckpt)[:16]
    assert (
        default_store_folder(ckpt, {"XDG_CACHE_HOME": str(tmp_path / "c")})
        == tmp_path / "c" / "dsv41" / "store" / model_id
    )
    for env in ({}, {"XDG_CACHE_HOME": ""}, {"XDG_CACHE_HOME": "relative/cache"}):
        assert default_store_folder(ckpt, env) == Path.home() / ".cache/dsv41/store" / model_id

    def opts(*argv):
        ns = build_parser().parse_args(list(argv))
        o = ns.options(ns)
        return o.serving if hasattr(o, "serving") else o

    assert (opts("serve").persistent_store, opts("serve").store_capacity_bytes) == (True, None)
    assert opts("serve", "--store-capacity-gib", "0.5").store_capacity_bytes == 1 << 29
    assert opts("serve").runtime_prefix
    assert not opts("serve", "--runtime-prefix", "off").runtime_prefix
    assert opts("chat").persistent_store is False  # chat and bench serve: a temporary store
    for bad in ("0", "-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--store-capacity-gib", bad])

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    o = ServingOptions(
        backend="torch",
        checkpoint=ckpt,
        page_tokens=8,
        persistent_store=True,
        store_capacity_bytes=1 << 20,
    )
    first, second = serving_engine(o), serving_engine(o)  # two serves of the model: one store
    folder = tmp_path / "cache" / "dsv41" / "store" / model_id
    assert first.store == second.store == folder and first.temp_store is None
    assert first.engine.store.capacity_bytes == 1 << 20
    k = first.engine.block_keys(range(3, 11))[0]  # the same key in both (same model, options)
    assert second.engine.block_keys(range(3, 11)) == [k]
    assert first.engine.store.put(k, content(k))
    assert second.engine.store.get(k)["kv"].tobytes() == content(k)["kv"].tobytes()
    first.close()
    second.close()
    assert (folder / "DSV41-STORE.json").exists()  # kept: the next serve finds the block
    with KVStore(folder, capacity_bytes=1 << 20, fingerprint=first.engine.keys.salt) as again:
        assert again.get(k)["kv"].tobytes() == content(k)["kv"].tobytes()
