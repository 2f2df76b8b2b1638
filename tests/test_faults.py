"""The fault suite: the engine, the SSD store, the artifact loader and `dsv41 run` under hostile
and unlucky use (issue 18). One test per break found; each failed before its fix.

Fast by design: the store tests use the store alone, the argument tests are refused before any
work, and the turns that must run use the torch graph (`Engine.from_model`) on shared-small with
prompts of a page or two (pages of 8 positions). Artifacts are manifests written by the compiler's
own `write_manifest` over placeholder libraries: every check here runs before a library loads.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from dsv41.compiler.build import CompileOptions, CompileReport, write_manifest
from dsv41.compiler.tools.cli import main as cli
from dsv41.graph.artifact_format import EntrySpec
from dsv41.graph.config import load_config
from dsv41.runtime.backends.artifact import Artifact, ArtifactError, check_checkpoint_config, verify
from dsv41.runtime.engine import CacheFullError, Engine
from dsv41.runtime.engine.requests import RequestError
from dsv41.runtime.tiers import ssd_store as kv_store
from dsv41.runtime.tiers.ssd_store import KVStore, model_fingerprint
from dsv41.runtime.tiers.store_folder import MARKER_NAME, StoreFolderError

PAGE = 8
FP = model_fingerprint("cfg", "weights", 1)
W = "w" * 64


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _engine(model, store=None, **kw) -> Engine:
    return Engine.from_model(model, weights_hash=kw.pop("weights_hash", W), page_tokens=kw.pop(
        "page_tokens", PAGE), store_dir=store, **kw)


def _store(root: Path, **kw) -> KVStore:
    return KVStore(root, capacity_bytes=kw.pop("capacity_bytes", 1 << 30), fingerprint=FP, **kw)


def _block(seed: int = 0) -> dict[str, np.ndarray]:
    return {"kv": np.random.default_rng(seed).standard_normal(32).astype(np.float32)}


def _key(i: int) -> str:
    import hashlib

    return hashlib.sha256(f"k{i}".encode()).hexdigest()


def _key_in_shard(shard: str) -> str:
    return next(k for k in map(_key, range(10_000)) if k[:2] == shard)


@pytest.fixture(scope="module")
def ckpt(small_case) -> Path:
    return Path(small_case.checkpoint)


# ---- 1. nothing deleted that the runtime did not create -------------------------------------

def _run(ckpt: Path, *extra: str) -> int:
    return cli.main(["run", "--backend", "torch", "--checkpoint", str(ckpt), "--context", "9",
                     "--turns", "1", "--suffix", "2", "--decode", "1", "--page-tokens", "8",
                     *extra])


def test_run_never_deletes_a_user_folder(ckpt, tmp_path, capsys):
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "thesis.tex").write_text("irreplaceable")
    (user / "sub" / "data.bin").write_bytes(b"\x01\x02")
    assert _run(ckpt, "--store", str(user)) == 2
    assert "not a dsv41 store" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # refused for an argument, while parsing
        _run(ckpt, "--store", str(user), "--turns", "0")
    assert _run(ckpt, "--store", str(user), "--keep-store") == 2
    assert (user / "thesis.tex").read_text() == "irreplaceable"
    assert (user / "sub" / "data.bin").read_bytes() == b"\x01\x02"


def test_run_store_that_is_a_file_is_a_clear_error(ckpt, tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert _run(ckpt, "--store", str(f)) == 2
    assert "is not a directory" in capsys.readouterr().err and f.read_text() == "x"


def test_run_uses_its_own_store_and_refuses_to_reuse_one_without_keep(ckpt, tmp_path, capsys):
    store = tmp_path / "store"
    assert _run(ckpt, "--store", str(store)) == 0
    assert (store / MARKER_NAME).is_file()
    blocks = sorted(store.rglob("*.blk"))
    assert blocks
    assert _run(ckpt, "--store", str(store)) == 2  # a store from an earlier run: not cleared
    assert "--keep-store" in capsys.readouterr().err
    assert sorted(store.rglob("*.blk")) == blocks
    assert _run(ckpt, "--store", str(store), "--keep-store") == 0


def test_store_refuses_an_unmarked_non_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreFolderError, match="not a dsv41 store"):
        _store(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    fresh = tmp_path / "fresh"
    _store(fresh).close()
    assert json.loads((fresh / MARKER_NAME).read_text()) == {"kind": "dsv41-kv-store",
                                                             "version": kv_store.FORMAT_VERSION}
    (fresh / MARKER_NAME).write_text(json.dumps({"kind": "dsv41-kv-store", "version": 99}))
    with pytest.raises(StoreFolderError, match="format version 99"):
        _store(fresh)


def test_scan_never_follows_a_link_out_of_the_store(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    k = _key_in_shard("ab")
    victims = {outside / f"{k}.blk": b"garbage that looks like a corrupt block",
               outside / f".{k}.1.00000000.tmp": b"looks like a temporary file",
               outside / f"{_key_in_shard('cd')}.blk": b"misplaced-looking"}
    for p, data in victims.items():
        p.write_bytes(data)
    root = tmp_path / "store"
    root.mkdir()
    (root / MARKER_NAME).write_text(json.dumps({"kind": "dsv41-kv-store",
                                                "version": kv_store.FORMAT_VERSION}))
    (root / "ab").symlink_to(outside, target_is_directory=True)
    (root / "cd").mkdir()
    (root / "cd" / f"{_key_in_shard('cd')}.blk").symlink_to(outside / f"{k}.blk")
    s = _store(root)
    assert all(p.read_bytes() == data for p, data in victims.items())
    assert s.stats().entries == 0 and (s.stats().corrupt, s.stats().truncated) == (0, 0)
    assert not s.put(k, _block())  # never written through the link either
    assert sorted(p.name for p in outside.iterdir()) == sorted(p.name for p in victims)
    assert s.stats().write_errors == 1


# ---- 2. keys salted with everything that changes a record's meaning --------------------------

def test_key_salt_covers_page_policy_switches_weights(small_model):
    import copy

    ids = _prompt(32)
    base = _engine(small_model)
    switched = copy.copy(small_model)
    switched.full_reindex = not small_model.full_reindex
    others = [_engine(small_model, page_tokens=16), _engine(small_model, exact=True),
              _engine(small_model, weights_hash="v" * 64), _engine(switched)]
    state = base.history_key(ids, "state")
    for other in others:
        assert other.key_salt.fingerprint() != base.key_salt.fingerprint()
        assert other.history_key(ids, "state") != state
        assert other.block_keys(ids)[:1] != base.block_keys(ids)[:1]


def test_state_record_of_another_page_size_is_not_served(small_model, tmp_path):
    """Exact mode writes the state record to the SSD store; an engine with pages of 16 must not
    restore a record laid out in pages of 8 (it was served as tier snapshot-ssd)."""
    store = tmp_path / "store"
    with _engine(small_model, store, exact=True) as e8:
        s = e8.session()
        list(s.send(_prompt(12, 1), max_new_tokens=2))
        transcript = s.transcript
    with _engine(small_model, store, exact=True, page_tokens=16) as e16:
        assert e16.stats().store.others > 0  # page-8 records are another engine's: kept
        r = e16.session(transcript=transcript)
        got = list(r.send([7], max_new_tokens=2, keep_logits=True))
        assert r.turns[-1].tier == "cold"
    with _engine(small_model, tmp_path / "ref", exact=True, page_tokens=16) as ref:
        want = list(ref.session(transcript=transcript).send([7], max_new_tokens=2))
    assert got == want


def test_an_engine_refuses_another_engines_session(small_model, tmp_path):
    a = _engine(small_model, tmp_path / "a")
    b = _engine(small_model, tmp_path / "b", weights_hash="x" * 64)
    theirs, mine = b.session(), a.session()
    with pytest.raises(RequestError, match="another engine"):
        a.send_many([(mine, _prompt(5), {"max_new_tokens": 2}),
                     (theirs, _prompt(5), {"max_new_tokens": 2})])
    assert (mine.history, theirs.history, a.stats().tiers["cold"]) == ([], [], 0)
    assert a.stats().store.writes == b.stats().store.writes == 0


def test_two_sessions_with_one_history_keep_their_own_snapshots(small_model, tmp_path):
    p1, p2, p3 = _prompt(9, 1), [11], [12]
    e = _engine(small_model, tmp_path / "s")
    a, b = e.session(), e.session()
    out_a = list(a.send(p1, max_new_tokens=1))
    out_b = list(b.send(p1, max_new_tokens=1))
    assert out_a == out_b and a.history == b.history
    list(a.send(p2, max_new_tokens=1))  # a moves on (and drops its previous snapshot)
    got = list(b.send(p3, max_new_tokens=2))
    assert b.turns[-1].tier == "snapshot"  # was "prefix": a had dropped the shared key
    ref = _engine(small_model, tmp_path / "ref").session()
    list(ref.send(p1, max_new_tokens=1))
    assert got == list(ref.send(p3, max_new_tokens=2))


# ---- 3. mismatches refused: the manifest, the checkpoint, the entries ------------------------

def _fake_artifact(root: Path, args, entries=("encoder", "decoder", "encoder_replay", "decode",
                                               "prefill")) -> Path:
    """A manifest written by the compiler's writer over placeholder libraries: verify() and the
    engine's checks run on it, no library is ever loaded."""
    opts = CompileOptions(args=args, model_name="faults", target="cpu", out=root)
    d = opts.artifact_dir
    d.mkdir(parents=True)
    sig = {"inputs": [{"name": "x", "dtype": "int64", "shape": ["b", "s"]}],
           "params": [{"name": "p_a", "param": "layers__0__attn__wq_a__weight",
                       "dtype": "float8_e4m3fn", "shape": ["64", "256"]},
                      {"name": "p_b", "param": "layers__1__attn__wq_a__weight",
                       "dtype": "float8_e4m3fn", "shape": ["64", "256"]}],
           "cache": [], "outputs": ["logits"]}
    for e in entries:
        (d / f"{e}.so").write_bytes(f"placeholder library {e}".encode())
    spec = EntrySpec.from_json(sig, "the fake entry")
    write_manifest(opts, {e: spec for e in entries}, CompileReport(d))
    return d


def _edit_manifest(d: Path, edit) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m, indent=1))


def test_manifest_edits_are_refused(ckpt, tmp_path):
    args = load_config(ckpt)
    d = _fake_artifact(tmp_path / "art", args)
    verify(d)

    def swap(m):  # two same-shape weights trade places in an entry
        p = m["entries"]["decode"]["params"]
        p[0]["param"], p[1]["param"] = p[1]["param"], p[0]["param"]

    def config(m):  # another config, its hash recomputed to match
        m["config"]["route_scale"] = 2.5
        m["config_hash"] = dataclasses.replace(args, route_scale=2.5).config_hash()

    for edit in (swap, config):
        d = _fake_artifact(tmp_path / edit.__name__, args)
        _edit_manifest(d, edit)
        with pytest.raises(ArtifactError, match="manifest_sha256"):
            verify(d)


def _checkpoint_copy(ckpt: Path, root: Path, config) -> Path:
    root.mkdir()
    for p in ckpt.iterdir():
        if p.name != "config.json":
            (root / p.name).symlink_to(p)
    if config is not None:
        (root / "config.json").write_text(config)
    return root


def test_engine_load_refuses_a_checkpoint_of_another_config(ckpt, tmp_path):
    art = _fake_artifact(tmp_path / "art", load_config(ckpt))
    cfg = json.loads((ckpt / "config.json").read_text())
    cases = {"other": (json.dumps({**cfg, "route_scale": 2.0}), "route_scale"),
             "missing": (None, "no config.json"), "invalid": ("{not json", "invalid")}
    for name, (text, msg) in cases.items():
        bad = _checkpoint_copy(ckpt, tmp_path / name, text)
        with pytest.raises(ArtifactError, match=msg):
            Engine.load(art, bad, store_dir=tmp_path / "never")
        assert not (tmp_path / "never").exists()
    check_checkpoint_config(Artifact.load(art), ckpt)  # its own config passes


def test_ced_engine_on_an_artifact_without_encoder_names_the_entries(ckpt, tmp_path):
    art = _fake_artifact(tmp_path / "art", load_config(ckpt), entries=("prefill", "decode"))
    with pytest.raises(ArtifactError, match="lacks the entries encoder, decoder, encoder_replay"):
        Engine.load(art, ckpt)
    a = Artifact.load(art)
    with pytest.raises(ArtifactError, match="no entry 'encoder'"):
        a.call("encoder", [])


# ---- 4. store failures are misses or refused writes, counted, logged once --------------------

def test_directory_at_a_block_path_is_a_miss_left_alone(tmp_path):
    s = _store(tmp_path)
    k = _key(1)
    assert s.put(k, _block())
    p = tmp_path / k[:2] / f"{k}.blk"
    p.unlink()
    p.mkdir()
    (p / "inside").write_text("someone's")
    assert s.get(k) is None
    st = s.stats()
    assert (st.misses, st.read_errors, st.entries, st.corrupt) == (1, 1, 0, 0)
    assert (p / "inside").read_text() == "someone's"
    assert not s.put(k, _block()) and s.stats().write_errors == 1  # cannot replace a folder
    s.close()
    s2 = _store(tmp_path)  # the scan skips it, deletes nothing
    assert s2.stats().entries == 0 and (p / "inside").exists()


def test_fifo_at_a_block_path_never_blocks_a_read(tmp_path):
    s = _store(tmp_path)
    k = _key(2)
    assert s.put(k, _block())
    p = tmp_path / k[:2] / f"{k}.blk"
    p.unlink()
    os.mkfifo(p)
    result = []
    t = threading.Thread(target=lambda: result.append(s.get(k)), daemon=True)
    t.start()
    t.join(60)  # a hang guard, not a timing: the read returns at once or never
    assert result == [None] and s.stats().read_errors == 1
    assert p.exists()  # not ours to delete
    s.close()
    s2 = _store(tmp_path)
    assert s2.stats().entries == 0 and p.exists()


def test_file_where_a_shard_folder_should_be_is_a_refused_write(tmp_path):
    s = _store(tmp_path)
    k = _key(3)
    (tmp_path / k[:2]).write_text("a file")
    assert not s.put(k, _block())
    st = s.stats()
    assert (st.write_errors, st.refused_writes, st.writes, st.entries) == (1, 1, 0, 0)
    assert (tmp_path / k[:2]).read_text() == "a file"


def test_full_disk_is_a_refused_write_logged_once(tmp_path, monkeypatch, caplog):
    s = _store(tmp_path)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_store.os, "fsync", full)
    with caplog.at_level(logging.WARNING, logger="dsv41.runtime.tiers.ssd_store"):
        assert not s.put(_key(4), _block(4))
        assert not s.put(_key(5), _block(5))
    monkeypatch.undo()
    st = s.stats()
    assert (st.write_errors, st.refused_writes, st.entries, st.bytes) == (2, 2, 0, 0)
    assert len([r for r in caplog.records if "No space" in r.getMessage()]) == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name != MARKER_NAME]
    assert s.put(_key(4), _block(4))  # space again: writes again


def test_read_only_store_the_turn_completes_and_keeps_its_tokens(small_model, tmp_path,
                                                                  monkeypatch):
    """Every write of the store fails with EACCES (what a read-only folder gives a non-root
    user): the turns complete, their tokens are kept, the refusals are counted."""
    real_open = open

    def read_only(path, mode="r", *a, **kw):
        if any(c in mode for c in "wxa+"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *a, **kw)

    e = _engine(small_model, tmp_path / "s")
    monkeypatch.setattr(kv_store, "open", read_only, raising=False)
    s = e.session()
    first = list(s.send(_prompt(10, 3), max_new_tokens=2))
    second = list(s.send([9], max_new_tokens=2))
    e.flush()  # the blocks are written in the background
    st = e.stats().store
    assert len(first) == len(second) == 2 and s.transcript[-1] == second[-1]
    # every write attempted failed and was counted (how many: the background writer and the
    # next turn's walk decide whether a refused block is tried again)
    assert st.writes == 0 and st.write_errors >= 1 and st.refused_writes == st.write_errors
    assert [r.decoded for r in s.turns] == [1, 1]


# ---- 5. several owners per store folder -----------------------------------------------------

OPEN_IN_CHILD = r"""
import sys
import numpy as np
from dsv41.runtime.tiers.ssd_store import KVStore, model_fingerprint
s = KVStore(sys.argv[1], capacity_bytes=1 << 30, fingerprint=model_fingerprint("cfg", "weights", 1))
got = s.get(sys.argv[2])
print("read", got["kv"].tobytes().hex())
s.put(sys.argv[3], {"kv": np.arange(32, dtype=np.float32)})
print("wrote")
"""


def test_several_owners_share_a_store_folder(tmp_path):
    s = _store(tmp_path)
    mine, theirs = _key(6), _key(7)
    assert s.put(mine, _block())
    same = _store(tmp_path)  # a second store in this process too
    child = subprocess.run([sys.executable, "-c", OPEN_IN_CHILD, str(tmp_path), mine, theirs],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["read", _block()["kv"].tobytes().hex(), "wrote"]
    for store in (s, same):
        assert store.get(theirs)["kv"].tobytes() == np.arange(32, dtype=np.float32).tobytes()
        assert store.get(mine)["kv"].tobytes() == _block()["kv"].tobytes()
    assert (s.stats().adopted, same.stats().adopted) == (1, 1)  # `same` scanned `mine` at start
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.get(mine)
    assert same.get(mine) is not None  # the other owner goes on
    same.close()


# ---- 6. the runtime-cache budget covers every allocation -------------------------------------

def test_budget_covers_each_sessions_first_page(small_model):
    one = sum(_engine(small_model).new_cache().nbytes().values())  # a session, one page
    e = _engine(small_model, cache_budget_bytes=2 * one + one // 2)
    a, b, c = e.session(), e.session(), e.session()
    list(a.send(_prompt(4, 1), max_new_tokens=1))  # 4 + 1 + 1 positions: one page
    list(b.send(_prompt(4, 2), max_new_tokens=1))
    assert e.runtime_bytes() == 2 * one
    with pytest.raises(CacheFullError, match="runtime cache needs"):
        c.send(_prompt(4, 3), max_new_tokens=1)
    assert c.history == [] and e.runtime_bytes() == 2 * one <= e.options.cache_budget_bytes
    # in send_many, a turn already begun when another is refused ends as usual: nothing lost
    e = _engine(small_model, cache_budget_bytes=one + one // 2)
    x, y = e.session(), e.session()
    with pytest.raises(CacheFullError):
        e.send_many([(x, _prompt(4, 1), {"max_new_tokens": 2}),
                     (y, _prompt(4, 2), {"max_new_tokens": 2})])
    assert (len(x.turns), len(x.history), y.history) == (1, 4, [])
    assert x.pending is not None and e.runtime_bytes() == one
    # the batch decodes every cache at the longest one's capacity: that is what is counted
    per_page = e.cache_bytes(2 * PAGE) - one
    e = _engine(small_model, cache_budget_bytes=2 * one + 2 * per_page + per_page // 2)
    long, short = e.session(), e.session()
    with pytest.raises(CacheFullError):  # 3 + 3 pages at the longest; 3 + 1 fit alone
        e.send_many([(long, _prompt(20, 1), {"max_new_tokens": 2}),
                     (short, _prompt(3, 2), {"max_new_tokens": 1})])
    assert e.runtime_bytes() == one + 2 * per_page <= e.options.cache_budget_bytes


@pytest.mark.parametrize("budget", [0, 1000])
def test_budget_below_one_page_is_a_configuration_error(small_model, budget):
    with pytest.raises(ValueError, match="cannot hold one session's first page"):
        _engine(small_model, cache_budget_bytes=budget)


# ---- 7. every public argument checked before any work ----------------------------------------

BAD_ARGS = [
    ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"max_new_tokens": "3"}, "max_new_tokens"),
    ({"max_new_tokens": None}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": float("nan")}, "finite"), ({"temperature": float("inf")}, "finite"),
    ({"temperature": -0.5}, "finite"), ({"temperature": "1"}, "number"),
    ({"temperature": True}, "number"),
    ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": "ab"}, "stop"), ({"stop": [1.5]}, "stop"),
    ({"stop": [10**9]}, "stop"), ({"stop": [True]}, "stop"),
    ({"keep_logits": "yes"}, "keep_logits"),
]


def test_bad_arguments_are_refused_before_any_work(small_model):
    e = _engine(small_model)
    s = e.session()
    for kw, msg in BAD_ARGS:
        with pytest.raises(RequestError, match=msg):
            s.send(_prompt(5), **kw)
    for bad in ("abc", [True, False], [1.0], {1: 2}, None, [[1]], [10**30]):
        with pytest.raises(RequestError, match="token ids"):
            s.send(bad)
    with pytest.raises(RequestError, match="max_seq_len"):
        s.send(_prompt(100), max_new_tokens=29)
    with pytest.raises(RequestError, match="transcript"):
        e.session(transcript=_prompt(129))
    with pytest.raises(RequestError, match="needs an SSD store"):
        e.session(transcript=_prompt(9))  # nothing else could hold its history
    assert s.history == [] and s.cache is None and sum(e.stats().tiers.values()) == 0
    assert e.stats().tokens["prefilled"] == 0


def test_send_many_checks_every_request_before_prefilling_any(small_model):
    e = _engine(small_model)
    good, bad = e.session(), e.session()
    for kw, msg in [*BAD_ARGS[:3], ({"top_p": 0.9}, "Unknown request option")]:
        with pytest.raises(RequestError, match=msg):
            e.send_many([(good, _prompt(5), {"max_new_tokens": 2}), (bad, _prompt(5), kw)])
    with pytest.raises(RequestError, match="once"):
        e.send_many([(good, _prompt(5), {"max_new_tokens": 1}), (good, [3], {})])
    assert good.history == [] and good.pending is None and good.turns == []
    assert e.stats().tokens["prefilled"] == 0


def test_zero_new_tokens_prefills_only_and_an_unread_turn_keeps_its_token(small_model):
    e = _engine(small_model)
    s = e.session()
    assert list(s.send(_prompt(6, 1), max_new_tokens=0)) == []
    assert (len(s.history), s.pending, s.turns[-1].decoded) == (6, None, 0)
    s.send([8], max_new_tokens=3)  # never iterated: its sampled token is still not lost
    nxt = list(s.send([9], max_new_tokens=1))
    assert len(s.turns) == 3 and s.turns[1].decoded == 0
    assert len(s.history) == 6 + 1 + 1 + 1 and s.pending == nxt[0]
