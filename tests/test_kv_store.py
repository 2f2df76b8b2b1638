"""The SSD global-KV store: keys, file format, verification, restart, and the lifetime rule."""

from __future__ import annotations

import hashlib
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from dsv41.runtime.tiers import ssd_store as kv_store
from dsv41.runtime.tiers.ssd_store import (
    HEADER_SIZE,
    MAGIC,
    KVStore,
    block_keys,
    decode_block,
    encode_block,
    model_fingerprint,
)
from dsv41.runtime.tiers.store_folder import MARKER_NAME

FP = model_fingerprint("cfg-a", "weights-a", 1)
FP_OTHER = model_fingerprint("cfg-b", "weights-a", 1)
LIFE = 100.0


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def key(i: int) -> str:
    return hashlib.sha256(f"k{i}".encode()).hexdigest()


def block(seed: int, n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"kv": rng.standard_normal(n).astype(np.float32),
            "scale": rng.integers(0, 255, n // 4, dtype=np.uint8)}


def path_of(root: Path, k: str) -> Path:
    return root / k[:2] / f"{k}.blk"


def store(root: Path, clock: Clock, capacity: int = 1 << 30, fp: bytes = FP) -> KVStore:
    return KVStore(root, capacity_bytes=capacity, fingerprint=fp, min_lifetime_s=LIFE,
                   clock=clock)


# -- keys -------------------------------------------------------------------------------------

def test_fingerprint_is_stable_and_sensitive_to_each_part():
    assert FP == model_fingerprint("cfg-a", "weights-a", 1) and len(FP) == 32
    others = {model_fingerprint("cfg-b", "weights-a", 1), model_fingerprint("cfg-a", "w", 1),
              model_fingerprint("cfg-a", "weights-a", 2)}
    assert FP not in others and len(others) == 3
    with pytest.raises(ValueError, match="config_hash"):
        model_fingerprint("", "w", 1)
    with pytest.raises(ValueError, match="format_version"):
        model_fingerprint("c", "w", -1)


def test_block_keys_match_an_independent_hashlib_computation():
    fp = bytes(range(32))
    k0 = hashlib.sha256(fp + struct.pack("<2q", 1, 2)).digest()
    k1 = hashlib.sha256(fp + k0 + struct.pack("<2q", 3, -4)).digest()
    assert block_keys([1, 2, 3, -4, 5], 2, fp) == [k0.hex(), k1.hex()]
    # Pinned so that a change to the scheme (which orphans every stored block) is noticed.
    assert block_keys([1, 2, 3, -4], 2, fp) == [
        "4eda7b1d359ab209d87d382affa21fbea8bdaef5eaea4107dae09efc6da68f3e",
        "2e85f3d7e1842ae7834a4306734b5c2c4b028c03ad187c2a2d7033ebcd5a651a"]
    assert k0.hex() == hashlib.sha256(fp + b"\x01" + b"\x00" * 7 + b"\x02" + b"\x00" * 7
                                      ).hexdigest()


def test_block_keys_same_for_any_integer_container():
    toks = [7, 1 << 40, 0, 3, 9, 11, 2, 5]
    ref = block_keys(toks, 4, FP)
    assert block_keys(np.array(toks, dtype=np.int64), 4, FP) == ref
    assert block_keys(np.array(toks, dtype=np.uint64), 4, FP) == ref
    assert block_keys(tuple(toks), 4, FP) == ref
    assert block_keys(toks, 4, FP_OTHER) != ref


def test_block_keys_chain_and_partial_block():
    toks = list(range(100, 130))  # 30 tokens, block 8: 3 complete blocks + 6 tokens
    keys = block_keys(toks, 8, FP)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(toks[:24], 8, FP) == keys  # the trailing partial block adds nothing
    assert block_keys(toks[:7], 8, FP) == [] and block_keys([], 8, FP) == []
    early = block_keys([999] + toks[1:], 8, FP)
    assert all(a != b for a, b in zip(early, keys, strict=True))  # every later key changes
    mid = toks.copy()
    mid[9] = 999  # inside block 1
    changed = block_keys(mid, 8, FP)
    assert changed[0] == keys[0] and changed[1] != keys[1] and changed[2] != keys[2]
    tail = toks.copy()
    tail[27] = 999  # in the partial block
    assert block_keys(tail, 8, FP) == keys


@pytest.mark.parametrize("args", [
    ([1, 2], 0, FP), ([1, 2], 2.0, FP), ([1, 2], True, FP), ([1.5, 2.0], 2, FP),
    ([[1, 2]], 2, FP), ([1, 2], 2, b"short"), ([1, 2], 2, FP.hex()), ([1 << 64, 2], 2, FP),
    (np.array([1 << 63, 0], dtype=np.uint64), 2, FP), ([True, False], 2, FP),
])
def test_block_keys_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        block_keys(*args)


# -- payload and file format ------------------------------------------------------------------

def mixed_block() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    bf16_bits = np.array([0x7FC1, 0xFF80, 0x0001, 0x3F80, 0x8000], dtype=np.uint16)  # NaN, -inf..
    nan_f32 = np.array([np.nan, -0.0, np.inf], dtype=np.float32)
    nan_f32.view(np.uint32)[0] = 0x7FC0_1234  # a NaN payload must survive bit-exactly
    return {
        "kv_fp8": rng.integers(0, 256, (3, 5, 7), dtype=np.uint8),
        "pos": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
        "scale": rng.standard_normal((4, 2)).astype(np.float32),
        "bf16": bf16_bits,
        "nan": nan_f32,
        "half": np.array([1.5, -2.25], dtype=np.float16),
        "mask": np.array([True, False, True]),
        "cplx": np.array([1 + 2j], dtype=np.complex64),
        "big_endian": np.array([1.0, 2.0], dtype=">f8"),
        "scalar": np.array(42, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "strided": np.arange(20, dtype=np.int16)[::3],
    }


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert b.tobytes() == a.tobytes(order="C"), name


def test_encode_is_deterministic_and_decodes_bit_exact():
    arrays = mixed_block()
    payload = encode_block(arrays)
    assert encode_block(dict(reversed(list(arrays.items())))) == payload
    assert_bit_exact(decode_block(bytearray(payload)), arrays)


def test_roundtrip_mixed_dtypes_bit_exact(tmp_path):
    s = store(tmp_path, Clock(5.0))
    arrays, k = mixed_block(), key(0)
    assert s.put(k, arrays)
    got = s.get(k)
    assert_bit_exact(got, arrays)
    got["pos"][0, 0] = 12345  # returned arrays are writable and private
    assert s.get(k)["pos"][0, 0] == -3
    st = s.stats()
    assert (st.entries, st.hits, st.misses, st.writes) == (1, 2, 0, 1)


def test_file_layout(tmp_path):
    s = store(tmp_path, Clock(1234.5))
    k = key(1)
    s.put(k, block(1))
    p = path_of(tmp_path, k)
    raw = p.read_bytes()
    payload = encode_block(block(1))
    assert len(raw) == HEADER_SIZE + len(payload) == s.stats().bytes == p.stat().st_size
    assert raw[:8] == MAGIC and raw[HEADER_SIZE:] == payload
    version, raw_key, fp, n, created, sha = struct.unpack_from("<I32s32sQd32s", raw, 8)
    assert (version, raw_key.hex(), fp, n, created) == (1, k, FP, len(payload), 1234.5)
    assert sha == hashlib.sha256(payload).digest()
    assert raw[124:156] == hashlib.sha256(raw[:124]).digest()
    assert p.stat().st_mtime == 1234.5  # last access starts at created_at
    assert [q.name for q in p.parent.iterdir()] == [p.name]  # no temp file left


# -- verification -----------------------------------------------------------------------------

def put_one(tmp_path, clock=None):
    s = store(tmp_path, clock or Clock())
    k = key(2)
    assert s.put(k, block(2))
    return s, k, path_of(tmp_path, k)


def assert_dropped(s: KVStore, k: str, p: Path, counter: str) -> None:
    assert s.get(k) is None
    assert not p.exists() and not s.contains(k)
    st = s.stats()
    assert getattr(st, counter) == 1 and st.misses == 1 and st.hits == 0
    assert (st.entries, st.bytes) == (0, 0)
    others = {"corrupt", "truncated", "foreign"} - {counter}
    assert all(getattr(st, c) == 0 for c in others)


@pytest.mark.parametrize("offset", [-1, HEADER_SIZE, HEADER_SIZE + 20])
def test_flipped_payload_byte_is_corrupt(tmp_path, offset):
    s, k, p = put_one(tmp_path)
    raw = bytearray(p.read_bytes())
    raw[offset] ^= 0x01
    p.write_bytes(raw)
    assert_dropped(s, k, p, "corrupt")


@pytest.mark.parametrize("field_offset", [0, 40, 80, 88, 100, 130])  # magic, key, fp, ..
def test_flipped_header_byte_is_corrupt(tmp_path, field_offset):
    s, k, p = put_one(tmp_path)
    raw = bytearray(p.read_bytes())
    raw[field_offset] ^= 0x10
    p.write_bytes(raw)
    assert_dropped(s, k, p, "corrupt")


@pytest.mark.parametrize("keep", [0, 5, 60, HEADER_SIZE, -10, -1])
def test_truncated_file(tmp_path, keep):
    s, k, p = put_one(tmp_path)
    raw = p.read_bytes()
    p.write_bytes(raw[:keep] if keep >= 0 else raw[:len(raw) + keep])
    assert_dropped(s, k, p, "truncated")


def test_extra_trailing_bytes_are_corrupt(tmp_path):
    s, k, p = put_one(tmp_path)
    with open(p, "ab") as f:
        f.write(b"\x00")
    assert_dropped(s, k, p, "corrupt")


def test_garbage_file_is_corrupt(tmp_path):
    s, k, p = put_one(tmp_path)
    p.write_bytes(os.urandom(4096))
    assert_dropped(s, k, p, "corrupt")


def test_foreign_fingerprint_detected_on_get(tmp_path):
    s, k, p = put_one(tmp_path / "a")
    other = store(tmp_path / "b", Clock(), fp=FP_OTHER)
    assert other.put(k, block(2))
    p.write_bytes(path_of(tmp_path / "b", k).read_bytes())
    assert_dropped(s, k, p, "foreign")


def test_other_file_format_version_is_foreign(tmp_path):
    s, k, p = put_one(tmp_path)
    raw = bytearray(p.read_bytes())
    raw[8:12] = struct.pack("<I", 2)
    p.write_bytes(raw)
    assert_dropped(s, k, p, "foreign")


def test_file_renamed_to_another_keys_name_is_corrupt(tmp_path):
    s = store(tmp_path, Clock())
    k1, k2 = key(10), key(11)
    s.put(k1, block(10))
    s.put(k2, block(11))
    p1, p2 = path_of(tmp_path, k1), path_of(tmp_path, k2)
    os.replace(p1, p2)
    assert s.get(k2) is None and not p2.exists()
    assert s.stats().corrupt == 1
    assert s.get(k1) is None  # vanished behind our back: a plain miss, forgotten
    st = s.stats()
    assert (st.entries, st.bytes, st.corrupt, st.misses) == (0, 0, 1, 2)


def test_restart_scan_drops_bad_headers_and_keeps_good_ones(tmp_path):
    clock = Clock(10.0)
    s = store(tmp_path, clock)
    keys = [key(i) for i in range(6)]
    for i, k in enumerate(keys):
        s.put(k, block(i))
    good = s.stats().bytes // 6
    paths = [path_of(tmp_path, k) for k in keys]
    paths[0].write_bytes(os.urandom(300))  # garbage
    paths[1].write_bytes(paths[1].read_bytes()[:-3])  # truncated
    os.replace(paths[2], paths[3])  # renamed: paths[3] now names the wrong key
    raw = bytearray(paths[4].read_bytes())
    raw[-1] ^= 0xFF  # payload flip: headers only are read at scan, found on get
    paths[4].write_bytes(raw)
    misplaced = tmp_path / "00" / f"{key(5)}.blk"
    if key(5)[:2] != "00":
        misplaced.parent.mkdir(exist_ok=True)
        misplaced.write_bytes(paths[5].read_bytes())
    foreign_root = tmp_path / "other"
    store(foreign_root, Clock(), fp=FP_OTHER).put(key(7), block(7))
    (theirs,) = foreign_root.rglob("*.blk")
    target = tmp_path / theirs.relative_to(foreign_root)
    target.parent.mkdir(exist_ok=True)
    os.replace(theirs, target)  # another model's entry (an engine sharing the folder): kept
    (tmp_path / "README.txt").write_text("not ours")

    s.close()  # the restart
    s2 = store(tmp_path, clock)
    st = s2.stats()
    assert (st.corrupt, st.truncated, st.foreign) == (2 + (key(5)[:2] != "00"), 1, 0)
    assert [s2.contains(k) for k in keys] == [False, False, False, False, True, True]
    assert not s2.contains(key(7)) and target.exists()
    assert (st.entries, st.others, st.bytes) == (2, 1, 2 * good + target.stat().st_size)
    assert s2.get(keys[4]) is None and s2.stats().corrupt == st.corrupt + 1
    assert_bit_exact(s2.get(keys[5]), block(5))
    assert (tmp_path / "README.txt").exists() and not misplaced.exists()


# -- restart, temp files ----------------------------------------------------------------------

def test_restart_preserves_entries_created_at_and_lru(tmp_path):
    clock = Clock(0.0)
    s = store(tmp_path, clock)
    size = None
    for i, t in enumerate([0.0, 1.0, 2.0]):  # a, b, c
        clock.t = t
        s.put(key(i), block(i))
        size = size or s.stats().bytes
    clock.t = 3.0
    assert s.get(key(0)) is not None  # LRU order now b, c, a
    before = s.stats()

    # created_at comes from the header: at 1 + LIFE - 0.5 only a (created 0) is old enough,
    # although it is the most recently used (its mtime is 3).
    clock.t = 1.0 + LIFE - 0.5
    s.close()
    s2 = store(tmp_path, clock, capacity=3 * size)
    st = s2.stats()
    assert (st.entries, st.bytes) == (before.entries, before.bytes)
    assert all(s2.contains(key(i)) for i in range(3))
    assert s2.put(key(3), block(3))
    assert [s2.contains(key(i)) for i in range(4)] == [False, True, True, True]
    assert not s2.put(key(4), block(4)) and s2.stats().refused_writes == 1


def test_restart_lru_order_exact(tmp_path):
    clock = Clock(0.0)
    s = store(tmp_path, clock)
    for i in range(3):  # a, b, c at t = 0, 1, 2
        clock.t = float(i)
        s.put(key(i), block(i))
    size = s.stats().bytes // 3
    clock.t = 3.0
    s.get(key(0))  # b, c, a
    clock.t = 4.0
    s.put(key(1), block(1))  # present: a no-op that touches it -> c, a, b
    assert s.stats().writes == 3

    clock.t = 1000.0
    s.close()
    s2 = store(tmp_path, clock, capacity=3 * size)
    evicted = []
    for i in range(3, 6):
        present = {k for k in map(key, range(6)) if s2.contains(k)}
        assert s2.put(key(i), block(i))
        evicted += sorted(present - {k for k in map(key, range(6)) if s2.contains(k)})
    assert evicted == [key(2), key(0), key(1)]
    assert s2.stats().evictions == 3


def test_leftover_temp_files_are_removed_at_start(tmp_path):
    s, k, p = put_one(tmp_path)
    tmp = p.parent / f".{k}.4242.deadbeef.tmp"
    tmp.write_bytes(p.read_bytes()[:50])
    other_shard = tmp_path / "ab"
    other_shard.mkdir(exist_ok=True)
    tmp2 = other_shard / f".{'ab' + k[2:]}.1.00000000.tmp"
    tmp2.write_bytes(b"partial")
    keep = p.parent / "notes.txt"
    keep.write_text("left alone")
    s.close()
    s2 = store(tmp_path, Clock())
    assert not tmp.exists() and not tmp2.exists() and keep.exists()
    st = s2.stats()
    assert st.entries == 1 and st.bytes == p.stat().st_size
    assert (st.corrupt, st.truncated, st.foreign) == (0, 0, 0)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    s = store(tmp_path, Clock())
    k = key(3)

    def crash(src, dst, **dir_fds):
        raise OSError("simulated crash at rename")

    monkeypatch.setattr(kv_store.os, "replace", crash)
    assert not s.put(k, block(3))  # a refused write, counted (tests/test_faults.py: more)
    monkeypatch.undo()
    assert list((tmp_path / k[:2]).iterdir()) == []
    assert not s.contains(k) and s.stats().entries == 0 and s.stats().bytes == 0
    assert (s.stats().write_errors, s.stats().refused_writes) == (1, 1)


# -- capacity and the minimum lifetime --------------------------------------------------------

def present(s: KVStore, keys: list[str]) -> list[str]:
    return [k for k in keys if s.contains(k)]


def test_young_entries_are_never_evicted_and_lru_order_is_exact(tmp_path):
    clock = Clock(0.0)
    a, b, c, d, e, f = (key(i) for i in range(6))
    probe = store(tmp_path / "probe", clock)
    probe.put(a, block(0))
    size = probe.stats().bytes
    s = store(tmp_path / "s", clock, capacity=3 * size)
    for k, t in ((a, 0.0), (b, 10.0), (c, 20.0)):
        clock.t = t
        assert s.put(k, block(0))
    allk = [a, b, c, d, e, f]

    clock.t = 50.0  # full, nobody is LIFE old
    assert not s.put(d, block(0))
    assert present(s, allk) == [a, b, c]
    st = s.stats()
    assert (st.refused_writes, st.evictions, st.writes, st.bytes) == (1, 0, 3, 3 * size)

    clock.t = 115.0  # a (115) and b (105) are old enough, c (95) is not
    assert s.get(a) is not None  # LRU order: b, c, a
    assert s.put(d, block(0))  # evicts b, the least recently used old entry
    assert present(s, allk) == [a, c, d]
    assert s.put(e, block(0))  # c is older in LRU order but young: a goes
    assert present(s, allk) == [c, d, e]
    assert not s.put(f, block(0))  # only young entries left
    assert s.stats().refused_writes == 2

    clock.t = 120.0  # c is exactly LIFE old
    assert s.put(f, block(0))
    assert present(s, allk) == [d, e, f]
    st = s.stats()
    assert (st.evictions, st.refused_writes, st.writes, st.entries) == (3, 2, 6, 3)
    assert st.bytes == 3 * size == sum(p.stat().st_size for p in (tmp_path / "s").rglob("*.blk"))


def test_refused_write_evicts_nothing(tmp_path):
    clock = Clock(0.0)
    s = store(tmp_path, clock)
    s.put(key(0), block(0, 64))
    small = s.stats().bytes
    s2 = store(tmp_path / "s", clock, capacity=2 * small + 10)
    s2.put(key(0), block(0, 64))
    clock.t = 1.0
    s2.put(key(1), block(1, 64))
    clock.t = LIFE + 0.5  # key 0 is old, key 1 is not; a double-size block needs both gone
    assert not s2.put(key(2), block(2, 256))
    assert present(s2, [key(0), key(1)]) == [key(0), key(1)]
    assert s2.stats().evictions == 0


def test_entry_bigger_than_capacity_is_refused(tmp_path):
    s = store(tmp_path, Clock(), capacity=100)
    assert not s.put(key(0), block(0))
    st = s.stats()
    assert (st.refused_writes, st.writes, st.entries, st.bytes) == (1, 0, 0, 0)
    assert not list(tmp_path.rglob("*.blk"))


def test_lifetime_invariant_under_random_traffic(tmp_path):
    clock = Clock(0.0)
    s = store(tmp_path, clock, capacity=20_000)
    rng = random.Random(7)
    created: dict[str, float] = {}
    for i in range(300):
        clock.t += rng.uniform(0.0, 8.0)
        k = key(rng.randrange(120))
        before = set(created)
        if rng.random() < 0.3:
            s.get(k)
        elif s.put(k, block(i, rng.choice([16, 64, 256, 512]))) and k not in created:
            created[k] = clock.t
        gone = {g for g in before if not s.contains(g)}
        assert all(clock.t - created[g] >= LIFE for g in gone), "a young entry was evicted"
        for g in gone:
            del created[g]
        st = s.stats()
        assert st.bytes <= 20_000 and st.entries == len(created)
    st = s.stats()
    assert st.evictions > 0 and st.refused_writes > 0 and st.hits > 0


def test_lookup_prefix_and_contains(tmp_path):
    s = store(tmp_path, Clock())
    keys = block_keys(list(range(32)), 8, FP)
    s.put(keys[0], block(0))
    s.put(keys[1], block(1))
    s.put(keys[3], block(3))
    assert s.lookup_prefix(keys) == 2 and s.lookup_prefix([]) == 0
    assert s.lookup_prefix(keys[2:]) == 0 and s.lookup_prefix(keys[3:]) == 1
    assert s.contains(keys[3]) and not s.contains(keys[2])
    st = s.stats()
    assert (st.hits, st.misses) == (0, 0)  # no payload read, nothing counted
    assert s.get(keys[2]) is None and s.stats().misses == 1


# -- argument checking ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    "abc", key(0).upper(), key(0)[:63], key(0) + "0", "../" + key(0)[3:], "g" * 64,
    key(0)[:62] + "/x", b"0" * 64, None, 7,
])
def test_invalid_keys_are_rejected(tmp_path, bad):
    s = store(tmp_path, Clock())
    for call in (lambda: s.put(bad, block(0)), lambda: s.get(bad), lambda: s.contains(bad),
                 lambda: s.lookup_prefix([key(0), bad])):
        with pytest.raises(ValueError, match="64 lowercase hex"):
            call()
    assert [p.name for p in tmp_path.iterdir()] == [MARKER_NAME]  # no entry written


def test_invalid_construction_and_blocks(tmp_path):
    for kw in ({"capacity_bytes": -1}, {"capacity_bytes": 1.5}, {"min_lifetime_s": -1},
               {"min_lifetime_s": float("inf")}, {"fingerprint": b"x" * 31},
               {"fingerprint": FP.hex()}):
        args = {"capacity_bytes": 10, "fingerprint": FP} | kw
        with pytest.raises(ValueError):
            KVStore(tmp_path / "s", **args)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        KVStore(tmp_path / "file", capacity_bytes=10, fingerprint=FP)
    s = store(tmp_path / "ok", Clock())
    for bad in ({"x": [1, 2]}, {"x": np.array([object()])}, {"": np.zeros(2)},
                {"x": np.zeros(2, dtype="U3")}, [("x", np.zeros(2))]):
        with pytest.raises(ValueError):
            s.put(key(0), bad)
    assert s.stats().writes == 0


# -- the background writer ----------------------------------------------------------------------

class GatedStore(KVStore):
    """A store whose puts wait for `gate` and log their keys in order (test control only)."""

    def __init__(self, *a, **kw):
        import threading

        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.order: list[str] = []

    def put(self, k, arrays):
        self.gate.wait()
        self.order.append(k)
        return super().put(k, arrays)


def test_writer_serves_queued_blocks_and_writes_in_submission_order(tmp_path):
    from dsv41.runtime.tiers.block_writer import BlockWriter

    clock = Clock(1000.0)
    st = GatedStore(tmp_path, capacity_bytes=1 << 30, fingerprint=FP, min_lifetime_s=LIFE,
                    clock=clock)
    w = BlockWriter(st)
    keys = [key(i) for i in range(4)]
    src = {k: block(i) for i, k in enumerate(keys)}
    for k in keys:
        assert w.submit(k, src[k])
    assert not w.submit(keys[1], src[keys[1]])  # already queued
    src[keys[2]]["kv"][:] = 0  # the queue holds its own copy
    assert w.lookup_prefix(keys) == 4 and w.contains(keys[3])
    got = w.get(keys[2])
    np.testing.assert_array_equal(got["kv"], block(2)["kv"])
    got["kv"][:] = 7  # a fresh copy: the queue is untouched
    np.testing.assert_array_equal(w.get(keys[2])["kv"], block(2)["kv"])
    assert not list(tmp_path.rglob("*.blk"))  # nothing written while the gate is shut
    assert w.stats().queued == 4 and w.stats().served_queued == 2
    st.gate.set()
    w.drain()
    assert st.order == keys and list(st._index) == keys  # submission order, LRU order too
    for i, k in enumerate(keys):
        payload = path_of(tmp_path, k).read_bytes()[HEADER_SIZE:]
        assert payload == encode_block(block(i))
    s = w.stats()
    assert (s.queued, s.submitted, s.written, s.refused, s.failed) == (0, 4, 4, 0, 0)
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.submit(key(9), block(9))


def test_writer_crash_loses_only_queued_blocks(tmp_path):
    """A new store over the folder while blocks are still queued (what a crash leaves) sees the
    written blocks whole and nothing of the others."""
    from dsv41.runtime.tiers.block_writer import BlockWriter

    clock = Clock(1000.0)
    st = GatedStore(tmp_path, capacity_bytes=1 << 30, fingerprint=FP, min_lifetime_s=LIFE,
                    clock=clock)
    w = BlockWriter(st)
    w.submit(key(0), block(0))
    st.gate.set()
    w.drain()
    st.gate.clear()
    w.submit(key(1), block(1))
    w.submit(key(2), block(2))
    st.close()  # what a crash does to the folder's lock: the next owner may open it
    after = store(tmp_path, clock)
    assert after.lookup_prefix([key(0), key(1), key(2)]) == 1
    np.testing.assert_array_equal(after.get(key(0))["kv"], block(0)["kv"])
    assert after.get(key(1)) is None and not path_of(tmp_path, key(1)).exists()
    assert after.stats().corrupt == after.stats().truncated == 0
    st.gate.set()  # let the first writer finish before the folder goes away
    w.close()


def test_writer_counts_refusals_and_failures_and_goes_on(tmp_path):
    from dsv41.runtime.tiers.block_writer import BlockWriter

    clock = Clock(1000.0)
    size = HEADER_SIZE + len(encode_block(block(0)))
    st = store(tmp_path, clock, capacity=size)  # room for one block, none old enough to evict
    w = BlockWriter(st)
    w.submit(key(0), block(0))
    w.submit(key(1), block(1))  # refused: the store is full of a young entry
    w.submit(key(2), {"bad": np.zeros(2, np.float32)})
    w.drain()
    s = w.stats()
    assert (s.written, s.refused, s.failed) == (1, 2, 0)
    st2 = store(tmp_path / "two", clock)
    original = st2._write

    def broken(*a, **kw):
        raise OSError("disk on fire")

    st2._write = broken
    w2 = BlockWriter(st2)
    w2.submit(key(3), block(3))
    w2.drain()
    st2._write = original
    w2.submit(key(4), block(4))
    w2.close()
    s2 = w2.stats()
    # the store turns an I/O failure into a refused write (counted there, logged once)
    assert (s2.written, s2.refused, s2.failed) == (1, 1, 0)
    assert st2.stats().write_errors == 1
    assert st2.contains(key(4)) and not st2.contains(key(3))
    assert not list((tmp_path / "two").rglob("*.tmp"))
    w.close()


# -- drop -------------------------------------------------------------------------------------

def test_drop_deletes_exactly_that_blocks_file(tmp_path):
    clock = Clock(1000.0)
    s = store(tmp_path, clock)
    keys = [key(i) for i in range(3)]
    for i, k in enumerate(keys):
        assert s.put(k, block(i))
    kept = {k: path_of(tmp_path, k).read_bytes() for k in (keys[0], keys[2])}
    size = len(kept[keys[0]])
    assert s.drop(keys[1])
    assert not path_of(tmp_path, keys[1]).exists() and not s.contains(keys[1])
    assert {k: path_of(tmp_path, k).read_bytes() for k in kept} == kept  # the others untouched
    st = s.stats()
    assert (st.entries, st.bytes, st.drops, st.evictions, st.write_errors) == (2, 2 * size, 1, 0,
                                                                                0)
    assert list(s._index) == [keys[0], keys[2]]  # LRU order of the others unchanged
    assert not s.drop(keys[1]) and s.stats().drops == 1  # gone: nothing to drop
    assert s.get(keys[1]) is None
    np.testing.assert_array_equal(s.get(keys[2])["kv"], block(2)["kv"])
    assert s.lookup_prefix(keys) == 1
    s.close()
    after = store(tmp_path, clock)  # a restart does not bring it back
    assert sorted(after._index) == sorted(kept) and not after.contains(keys[1])
    after.close()


def test_drop_never_follows_a_link_and_checks_its_key(tmp_path):
    s = store(tmp_path, Clock(1000.0))
    k = key(5)
    assert s.put(k, block(5))
    p = path_of(tmp_path, k)
    target = tmp_path / "precious.bin"
    target.write_bytes(b"not the store's")
    p.unlink()
    p.symlink_to(target)  # the block's name now points elsewhere
    assert s.drop(k)
    assert target.read_bytes() == b"not the store's" and p.is_symlink()
    assert not s.contains(k) and s.stats().entries == 0
    for bad in ("", "x" * 64, key(1).upper(), 7):
        with pytest.raises(ValueError):
            s.drop(bad)
    with pytest.raises(ValueError, match="no metadata"):
        s.put(key(6), block(6), {"session": "a"})
    assert not s.contains(key(6))
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.drop(k)


def test_writer_drop_removes_a_queued_or_a_stored_block(tmp_path):
    """A queued block is taken off the queue (never written), a stored one deleted; a drop
    waits for the one write in progress, as a read does."""
    import threading
    import time

    from dsv41.runtime.tiers.block_writer import BlockWriter

    clock = Clock(1000.0)
    st = GatedStore(tmp_path, capacity_bytes=1 << 30, fingerprint=FP, min_lifetime_s=LIFE,
                    clock=clock)
    w = BlockWriter(st)
    assert w.put(key(0), block(0))
    st.gate.set()
    w.drain()
    st.gate.clear()
    assert w.put(key(1), block(1)) and w.put(key(2), block(2))  # key(1) waits at the gate
    out = []
    dropping = threading.Thread(target=lambda: out.append(w.drop(key(2))))
    dropping.start()
    while w.stats().dropped_queued == 0:  # off the queue at once; the store's half waits
        time.sleep(0.001)
    assert w.stats().queued == 1  # key(1), in its write
    st.gate.set()
    dropping.join()
    w.drain()
    assert out == [True] and w.get(key(2)) is None
    assert w.drop(key(0))  # stored: its file deleted
    assert not w.drop(key(0)) and not w.drop(key(3))
    assert st.order == [key(0), key(1)]  # key(2) was never written
    assert sorted(p.name for p in tmp_path.rglob("*.blk")) == [f"{key(1)}.blk"]
    np.testing.assert_array_equal(w.get(key(1))["kv"], block(1)["kv"])
    s = w.stats()
    assert (s.queued, s.submitted, s.written, s.dropped_queued) == (0, 3, 2, 1)
    assert w.store_stats().drops == 1 and w.store_stats().entries == 1
    with pytest.raises(ValueError, match="no metadata"):
        w.put(key(4), block(4), {"x": 1})
    w.close()


# -- the folder the store opened: links, a replaced folder, clock steps (issue 38) ---------------

def test_a_shard_swapped_for_a_link_never_reads_or_deletes_outside_the_store(tmp_path):
    """The shard folder of a stored block is replaced by a link to a folder outside the store
    holding a same-named (bad) file after the scan: the store reads nothing there and deletes
    nothing there (it used to read the bad file through the link and delete it as corrupt)."""
    root, outside = tmp_path / "s", tmp_path / "outside"
    s = store(root, Clock())
    k, k2 = key(1), key(1)[:2] + key(2)[2:]
    assert s.put(k, block(1))
    outside.mkdir()
    (outside / f"{k}.blk").write_bytes(b"not a block, and not the store's")
    (root / k[:2] / f"{k}.blk").unlink()
    (root / k[:2]).rmdir()
    (root / k[:2]).symlink_to(outside, target_is_directory=True)
    assert s.get(k) is None
    assert not s.put(k2, block(2)) and not s.drop(k)
    assert sorted(p.name for p in outside.iterdir()) == [f"{k}.blk"]
    assert (outside / f"{k}.blk").read_bytes() == b"not a block, and not the store's"
    st = s.stats()
    assert (st.read_errors, st.write_errors, st.corrupt, st.misses, st.entries) == (1, 1, 0, 1, 0)


def test_a_store_folder_replaced_under_a_running_store_disables_it(tmp_path, caplog):
    """The folder is removed and made again by a new owner while the store is open: the old
    store never writes into the new owner's folder; it disables itself with a logged error."""
    import shutil

    root = tmp_path / "s"
    s = store(root, Clock())
    assert s.put(key(1), block(1))
    shutil.rmtree(root)
    root.mkdir()
    new = store(root, Clock())  # the new owner
    with caplog.at_level("ERROR", logger=kv_store.__name__):
        assert not s.put(key(2), block(2))
        assert s.get(key(1)) is None and not s.contains(key(1)) and not s.drop(key(1))
    assert sorted(p.name for p in root.iterdir()) == [MARKER_NAME]
    assert [r.getMessage() for r in caplog.records] == [
        f"KV store {root}: the folder was removed or replaced since the store opened it; the "
        "SSD tier is disabled (every read misses, every write is refused) until the engine is "
        "restarted on a store folder."]
    st = s.stats()
    assert (st.disabled, st.refused_writes, st.writes, st.misses) == (True, 1, 1, 1)
    assert new.put(key(3), block(3)) and not new.stats().disabled
    assert s.lookup_prefix([key(3)]) == 0  # the new owner's blocks are not the old store's


YEAR = 365 * 24 * 3600.0


def test_a_clock_stepped_ahead_then_back_never_pins_a_full_store(tmp_path):
    """Blocks written while the clock ran a year ahead are of unknown age once it steps back
    (beyond MAX_CLOCK_SKEW_S): evicted first, in this process and after a restart, instead of
    staying 'younger than the lifetime' for a year while the full store refuses every write.
    A stamp within the skew is still trusted."""
    clock = Clock(1000.0)
    probe = store(tmp_path / "probe", clock)
    probe.put(key(0), block(0))
    size = probe.stats().bytes
    s = store(tmp_path / "s", clock, capacity=2 * size)
    clock.t = 1000.0 + YEAR
    assert s.put(key(1), block(0)) and s.put(key(2), block(0))
    clock.t = 1010.0  # stepped back
    assert s.put(key(3), block(0))  # key(1), of unknown age and least recently used, goes
    assert present(s, [key(i) for i in range(5)]) == [key(2), key(3)]
    s.close()
    s2 = store(tmp_path / "s", clock, capacity=2 * size)  # a restart sees the same
    assert s2.put(key(4), block(0))
    assert present(s2, [key(i) for i in range(5)]) == [key(3), key(4)]
    assert s2.stats().evictions == 1 and s2.stats().refused_writes == 0
    # within the skew: trusted, so the minimum lifetime still protects both young entries
    clock.t = 1010.0 + kv_store.MAX_CLOCK_SKEW_S - 10
    s2.drop(key(3))
    assert s2.put(key(1), block(0))
    clock.t = 1011.0
    assert not s2.put(key(2), block(0)) and s2.stats().refused_writes == 1


def test_a_bad_file_at_a_keys_path_is_replaced_by_a_put(tmp_path):
    """Entry files are write-once (a put never replaces another owner's entry), but a file
    whose header is bad is no entry: a put deletes it (counted) and writes the block."""
    s, k, p = put_one(tmp_path)
    other = store(tmp_path, Clock())  # another owner's view: the file is already indexed
    bad = p.with_suffix(".bad")
    bad.write_bytes(p.read_bytes()[:100])
    os.replace(bad, p)  # a truncated file in its place, behind both
    assert not other.contains(k)
    assert other.put(k, block(1))
    st = other.stats()
    assert (st.writes, st.truncated, st.refused_writes) == (1, 1, 0)
    assert_bit_exact(s.get(k), block(1))  # the first owner reads the new file
    assert s.put(k, block(2)) and s.stats().writes == 1  # present: not written again
    assert_bit_exact(other.get(k), block(1))
