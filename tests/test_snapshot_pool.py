"""The host-DRAM snapshot pool: TTL, LRU within the budget, byte accounting, copy semantics."""

from __future__ import annotations

import numpy as np
import pytest

from dsv41.runtime.tiers.dram_pool import (
    InProcessBackend,
    Snapshot,
    SnapshotBackend,
    SnapshotPool,
)


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def state(seed: int, n: int = 16) -> dict[str, np.ndarray]:
    """n float32 + n uint16 + n int64 values: 14 * n bytes."""
    rng = np.random.default_rng(seed)
    return {"window_ring": rng.standard_normal(n).astype(np.float32),
            "tail_bf16": rng.integers(0, 1 << 16, n, dtype=np.uint16),
            "pos": np.arange(n, dtype=np.int64)}


SIZE = 14 * 16


def pool(clock: Clock, budget: int = 3 * SIZE, ttl: float = 10.0, backend=None) -> SnapshotPool:
    return SnapshotPool(backend, budget_bytes=budget, ttl_s=ttl, clock=clock)


def test_roundtrip_and_metadata():
    clock = Clock(5.0)
    p = pool(clock)
    arrays = state(0)
    assert p.put("s1", arrays, {"pos": 16, "turn": 2, "tags": ["a"]})
    snap = p.get("s1")
    assert isinstance(snap, Snapshot)
    assert (snap.key, snap.created_at, snap.nbytes) == ("s1", 5.0, SIZE)
    assert snap.meta == {"pos": 16, "turn": 2, "tags": ["a"]}
    assert sorted(snap.arrays) == sorted(arrays)
    for name, a in arrays.items():
        assert snap.arrays[name].dtype == a.dtype
        np.testing.assert_array_equal(snap.arrays[name], a)
    assert p.get("nope") is None
    st = p.stats()
    assert (st.entries, st.bytes, st.budget, st.hits, st.misses) == (1, SIZE, 3 * SIZE, 1, 1)


def test_ttl_expiry_and_hits_do_not_refresh_it():
    clock = Clock(0.0)
    p = pool(clock, ttl=10.0)
    p.put("a", state(0), {})
    clock.t = 5.0
    assert p.get("a") is not None  # a hit, but the TTL still runs from t = 0
    clock.t = 9.999
    assert p.get("a") is not None
    clock.t = 10.0
    assert p.get("a") is None
    st = p.stats()
    assert (st.hits, st.misses, st.expired, st.entries, st.bytes) == (2, 1, 1, 0, 0)
    assert p.get("a") is None  # now simply absent: a miss, not a second expiry
    assert (p.stats().misses, p.stats().expired) == (2, 1)


def test_put_of_present_key_replaces_and_restarts_ttl():
    clock = Clock(0.0)
    p = pool(clock, ttl=10.0)
    p.put("a", state(0), {"turn": 1})
    clock.t = 8.0
    p.put("a", state(1, n=8), {"turn": 2})
    assert p.stats().bytes == 14 * 8 and p.stats().entries == 1
    clock.t = 15.0
    snap = p.get("a")
    assert snap.meta == {"turn": 2} and snap.created_at == 8.0 and snap.nbytes == 14 * 8
    np.testing.assert_array_equal(snap.arrays["pos"], np.arange(8))


def test_lru_eviction_order_is_exact():
    clock = Clock(0.0)
    backend = InProcessBackend()
    p = pool(clock, budget=3 * SIZE, ttl=1000.0, backend=backend)
    for k in "abc":
        assert p.put(k, state(0), {})
    assert backend.keys() == ["a", "b", "c"]
    assert p.get("a") is not None
    assert backend.keys() == ["b", "c", "a"]
    assert p.put("d", state(1), {})  # b is least recently used
    assert backend.keys() == ["c", "a", "d"]
    p.get("c")  # a, d, c
    assert p.put("e", state(2), {})
    assert backend.keys() == ["d", "c", "e"]
    assert p.put("big", state(3, n=32), {})  # 2 * SIZE: evicts d, then c
    assert backend.keys() == ["e", "big"]
    st = p.stats()
    assert (st.evictions, st.expired, st.entries, st.bytes) == (4, 0, 2, 3 * SIZE)


def test_expired_entries_go_before_live_ones():
    clock = Clock(0.0)
    backend = InProcessBackend()
    p = pool(clock, budget=3 * SIZE, ttl=10.0, backend=backend)
    p.put("old", state(0), {})
    clock.t = 5.0
    p.put("b", state(1), {})
    p.put("c", state(2), {})
    p.get("b")
    p.get("c")
    p.get("old")  # most recently used, but it expires at t = 10
    clock.t = 12.0
    assert p.put("d", state(3), {})
    assert backend.keys() == ["b", "c", "d"]
    st = p.stats()
    assert (st.expired, st.evictions) == (1, 0)
    clock.t = 14.0
    assert p.sweep() == 0
    clock.t = 15.0
    assert p.sweep() == 2 and backend.keys() == ["d"] and p.stats().expired == 3


def test_oversize_is_refused_and_evicts_nothing():
    clock = Clock(0.0)
    p = pool(clock, budget=3 * SIZE)
    p.put("a", state(0), {})
    assert not p.put("huge", state(1, n=16 * 3 + 1), {})  # 14 bytes over the budget
    st = p.stats()
    assert (st.refused, st.entries, st.bytes, st.evictions) == (1, 1, SIZE, 0)
    assert p.get("huge") is None and p.get("a") is not None
    assert p.put("exact", state(2, n=48), {})  # exactly the budget: fits after evicting a
    st = p.stats()
    assert (st.refused, st.entries, st.bytes, st.evictions) == (1, 1, 3 * SIZE, 1)
    assert not pool(clock, budget=0).put("x", state(0), {})
    assert pool(clock, budget=0).put("empty", {}, {"note": "no arrays is 0 bytes"})


def test_byte_accounting_is_exact():
    clock = Clock(0.0)
    p = pool(clock, budget=10_000, ttl=100.0)
    shapes = {"f32": (np.float32, (3, 5)), "bf16": (np.uint16, (7,)), "i8": (np.int8, (2, 2, 2)),
              "f64": (np.float64, (0, 4)), "u8": (np.uint8, ())}
    arrays = {n: np.zeros(s, dt) for n, (dt, s) in shapes.items()}
    expect = 3 * 5 * 4 + 7 * 2 + 8 + 0 + 1
    assert p.put("a", arrays, {})
    assert p.stats().bytes == expect == p.get("a").nbytes
    strided = np.arange(100, dtype=np.float32)[::4]  # 25 values; a view of 400 bytes
    assert p.put("b", {"x": strided}, {})
    assert p.stats().bytes == expect + 100
    assert p.drop("a") and not p.drop("a")
    assert p.stats().bytes == 100 and p.stats().entries == 1
    np.testing.assert_array_equal(p.get("b").arrays["x"], strided)


def test_copy_semantics():
    clock = Clock(0.0)
    p = pool(clock)
    arrays = state(0)
    meta = {"pos": 16, "hist": [1, 2]}
    p.put("a", arrays, meta)
    want = {n: a.copy() for n, a in arrays.items()}
    arrays["window_ring"][:] = 99.0  # the caller reuses its buffers
    arrays["pos"] += 1
    meta["hist"].append(3)
    got = p.get("a")
    for n, a in want.items():
        np.testing.assert_array_equal(got.arrays[n], a)
    assert got.meta == {"pos": 16, "hist": [1, 2]}
    assert all(g.flags.writeable for g in got.arrays.values())
    got.arrays["pos"][:] = -1  # the returned copy is the caller's to change
    got.meta["hist"].clear()
    again = p.get("a")
    np.testing.assert_array_equal(again.arrays["pos"], want["pos"])
    assert again.meta == {"pos": 16, "hist": [1, 2]}
    stored = p.backend.get("a").arrays
    assert not any(np.shares_memory(stored[n], again.arrays[n]) for n in stored)
    assert not any(np.shares_memory(stored[n], arrays[n]) for n in stored)
    assert not any(s.flags.writeable for s in stored.values())


def test_backend_protocol_and_shared_backend():
    backend = InProcessBackend()
    assert isinstance(backend, SnapshotBackend)
    clock = Clock(0.0)
    p1, p2 = pool(clock, backend=backend), pool(clock, backend=backend)
    p1.put("a", state(0), {})
    assert p2.get("a") is not None  # one store behind both pools
    assert p2.stats().bytes == SIZE and p1.stats().hits == 0 and p2.stats().hits == 1


@pytest.mark.parametrize("kw", [{"budget_bytes": -1}, {"budget_bytes": 1.0},
                                {"ttl_s": 0}, {"ttl_s": float("nan")}, {"clock": 3}])
def test_bad_construction(kw):
    with pytest.raises(ValueError):
        SnapshotPool(**({"budget_bytes": 10} | kw))


def test_bad_put_arguments():
    p = pool(Clock())
    for args in (("", state(0), {}), (3, state(0), {}), ("a", {"x": [1.0]}, {}),
                 ("a", {"x": np.array([None])}, {}), ("a", {1: np.zeros(2)}, {}),
                 ("a", state(0), None)):
        with pytest.raises(ValueError):
            p.put(*args)
    assert p.stats().entries == 0
    with pytest.raises(ValueError):
        p.get("")


def test_expired_entries_are_freed_on_schedule_without_a_put_needing_room():
    clock = Clock(0.0)
    backend = InProcessBackend()
    p = SnapshotPool(backend, budget_bytes=10 * SIZE, ttl_s=10.0, clock=clock,
                     sweep_interval_s=2.0)
    p.put("a", state(0), {})  # sweeps at t = 0 (nothing there yet)
    clock.t = 1.0
    p.put("b", state(1), {})  # plenty of room, and no sweep is due (1 s < 2 s)
    clock.t = 10.5  # a has expired, b has not
    assert p.contains("b") and not p.contains("a")  # the sweep this call ran freed a
    assert backend.keys() == ["b"] and backend.bytes() == SIZE
    st = p.stats()
    assert (st.entries, st.bytes, st.expired, st.hits, st.misses) == (1, SIZE, 1, 0, 0)
    clock.t = 11.0  # b expires; the last sweep was at 10.5, so none is due yet
    assert not p.contains("b") and backend.keys() == ["b"]
    clock.t = 12.5
    assert p.stats().entries == 0 and p.stats().expired == 2  # the stats call swept


def test_default_budget_is_a_tenth_of_host_memory():
    import psutil

    from dsv41.runtime.tiers.dram_pool import default_budget_bytes

    total = psutil.virtual_memory().total
    assert default_budget_bytes() == int(total * 0.10)
    assert SnapshotPool(ttl_s=1.0).budget_bytes == default_budget_bytes()
    assert SnapshotPool(budget_bytes=123, ttl_s=1.0).budget_bytes == 123
    with pytest.raises(ValueError, match="sweep_interval_s"):
        SnapshotPool(budget_bytes=1, sweep_interval_s=-1.0)


def test_holds_a_snapshot_goes_with_its_last_holder():
    """Two sessions at one state share one snapshot: a drop with a holder lets go of that hold
    only; a holder that never held it deletes nothing; eviction forgets the holds too."""
    p = pool(Clock())
    assert p.put("k", state(0), holder="a") and p.put("k", state(0), holder="b")
    assert not p.drop("k", holder="x") and not p.drop("k", holder="a")
    assert not p.drop("k", holder="a") and p.contains("k")
    assert p.drop("k", holder="b") and not p.contains("k")
    assert p.put("k", state(0), holder="a") and p.put("j", state(1))
    assert not p.drop("j", holder="a") and p.contains("j")  # held by nobody: a drops nothing
    with pytest.raises(ValueError, match="holder must be a non-empty string"):
        p.put("k", state(0), holder="")


def test_a_snapshot_the_reader_refuses_is_a_deleted_counted_miss():
    p = pool(Clock())
    p.put("k", state(0))

    def refuse(arrays):
        raise ValueError("no")

    assert p.get("k", check=refuse) is None and not p.contains("k")
    st = p.stats()
    assert (st.corrupted, st.misses, st.hits, st.entries) == (1, 1, 0, 0)
