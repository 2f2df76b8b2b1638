"""The artifact format (`graph.artifact_format`): the typed manifest reads and writes the very
JSON the compiler wrote (same keys, order and digest), refuses a bad one with a sentence, and
finds an entry's inputs by name. No library is compiled: the compiler's own manifest writer runs
over placeholder libraries."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from dsv41.compiler.build import CompileOptions, CompileReport, write_manifest
from dsv41.graph.artifact_format import (
    FORMAT_VERSION,
    KEY_FILE_ENV,
    SHARDED_FORMAT,
    ArtifactError,
    EntrySpec,
    Manifest,
    ShardedManifest,
    artifact_key,
    manifest_digest,
    manifest_hmac,
)
from dsv41.graph.collectives import CclBackend
from dsv41.graph.config import SMALL_CONFIG_JSON, load_config
from dsv41.graph.entries import ENTRIES, ENTRY_ARGS, HASH_IDS, HASH_IDS_AT, Entry
from dsv41.graph.targets import TargetName, target_names
from dsv41.runtime.backends.artifact import CED_ENTRIES, EXACT_ENTRIES, read_manifest, verify

N_CACHE = 3


def _tensor(name: str, dtype: str = "int64", shape=("s0", "s1"), **kw) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), **kw}


def _entry(entry: str, *, x: int = 1, bounds: bool = False) -> dict:
    """An entry's record as `entry_signature` writes it: x's tensors, ENTRY_ARGS (the hash ids
    marked host), the cache; a host Engram table among the parameters."""
    xs = ["x"] if x == 1 else [f"x_{i}" for i in range(x)]
    inputs = ([_tensor(n) for n in xs]
              + [_tensor(n, **({"host": True} if n == HASH_IDS else {})) for n in ENTRY_ARGS]
              + [_tensor(f"cache_in_{i}", "uint8") for i in range(N_CACHE)])
    sig = {"inputs": inputs,
           "params": [_tensor("p_embed__weight", "bfloat16", ("512", "256"),
                              param="embed__weight"),
                      _tensor("p_layers__1__engram__embed__weight", "uint8", ("64", "32"),
                              param="layers__1__engram__embed__weight", host=True)],
           "cache": [f"window.{i}.codes" for i in range(N_CACHE)],
           "outputs": ["logits", *(f"window.{i}.codes" for i in range(N_CACHE))],
           "inplace_cache": True}
    if bounds:
        sig["static_bounds"] = {"batch": 64, "context_tokens": 2097152}
    return sig


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """An artifact folder whose manifest the compiler's writer wrote (placeholder libraries)."""
    args = load_config(SMALL_CONFIG_JSON)
    opts = CompileOptions(args=args, model_name="fmt", target="cpu",
                          out=tmp_path_factory.mktemp("fmt"))
    d = opts.artifact_dir
    d.mkdir(parents=True)
    sigs = {"prefill_all": _entry("prefill_all"), "decode": _entry("decode", bounds=True),
            "decoder": _entry("decoder", x=2)}
    for e in sigs:
        (d / f"{e}.so").write_bytes(f"placeholder library {e}".encode())
    report = CompileReport(d, seconds={"decode": {"capture": 1.5}}, tuned={"decode": ["f"]})
    write_manifest(opts, {e: EntrySpec.from_json(s, e) for e, s in sigs.items()}, report)
    return d


def _raw(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def test_the_typed_manifest_round_trips_the_written_json_exactly(written):
    text = (written / "manifest.json").read_text()
    raw = json.loads(text)
    m = Manifest.from_json(raw)
    assert m.to_json() == raw and list(m.to_json()) == list(raw)  # same keys, same order
    assert json.dumps(m.to_json(), indent=1) == text  # the very bytes the writer wrote
    assert m.digest() == raw["manifest_sha256"] == manifest_digest(raw)
    assert m.format_version == FORMAT_VERSION and m.target.name is TargetName.CPU
    assert list(m.entries) == [Entry.PREFILL_ALL, Entry.DECODE, Entry.DECODER]
    assert m.tuning_applied["decode"] == ("f",) and m.compile_seconds["decode"]["capture"] == 1.5
    assert verify(written) == m == read_manifest(written)


def test_an_entrys_record_is_typed_and_its_absent_keys_stay_absent(written):
    m = Manifest.from_json(_raw(written))
    decode, prefill = m.entries[Entry.DECODE], m.entries["prefill_all"]
    assert (decode.static_bounds.batch, decode.static_bounds.context_tokens) == (64, 2097152)
    assert prefill.static_bounds is None and "static_bounds" not in prefill.to_json()
    assert [p.param for p in decode.host_params] == ["layers__1__engram__embed__weight"]
    assert decode.params[0].dims == [512, 256] and decode.params[0].host is None
    assert "host" not in decode.params[0].to_json()
    old = {k: v for k, v in _entry("decode").items() if k != "inplace_cache"}  # an older one
    assert EntrySpec.from_json(old, "decode").to_json() == old


def test_inputs_are_found_by_name(written):
    m = Manifest.from_json(_raw(written))
    decode, decoder = m.entries["decode"], m.entries["decoder"]
    assert decode.input_index(HASH_IDS) == HASH_IDS_AT == 1 + ENTRY_ARGS.index(HASH_IDS)
    assert decoder.input_index(HASH_IDS) == 2 + ENTRY_ARGS.index(HASH_IDS)  # x is (h, pre)
    assert decoder.input_index("start") == 2 and decode.input_index("cache_in_0") == 8
    assert [i.name for i in decode.inputs if i.on_host] == [HASH_IDS]
    with pytest.raises(ArtifactError, match="declares no input 'tokens'"):
        decode.input_index("tokens")
    peer = EntrySpec(outputs=("logits",))  # the torch.compile peer declares none
    with pytest.raises(ArtifactError, match="declares no input 'start' .*none"):
        peer.input_index("start")


def test_the_manifest_is_frozen(written):
    m = Manifest.from_json(_raw(written))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.model = "other"
    with pytest.raises(TypeError):
        m.config["dim"] = 1
    with pytest.raises(TypeError):
        m.entries["decode"] = m.entries["decoder"]
    assert isinstance(m.layer_plan, tuple) and isinstance(m.entries["decode"].outputs, tuple)


def _bad(raw: dict, edit) -> dict:
    raw = copy.deepcopy(raw)
    edit(raw)
    return raw


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("config_hash"), "has no 'config_hash' .*Recompile it"),
    (lambda m: m.pop("entries"), "has no 'entries'"),
    (lambda m: m["entries"]["decode"].pop("outputs"), "entry decode has no 'outputs'"),
    (lambda m: m["entries"]["decode"]["params"][0].pop("param"),
     "entry decode parameter 0 has no 'param'"),
    (lambda m: m.update(files=["decode.so"]), "'files' must be an object"),
    (lambda m: m.update(created_unix="yesterday"), "'created_unix' must be an integer"),
    (lambda m: m["entries"]["decode"].update(cache=[1, 2]), "'cache' must be an array of str"),
    (lambda m: m["entries"]["decode"]["inputs"][0].update(host="yes"),
     "input 0: 'host' must be true or false"),
    (lambda m: m["entries"].update(decode2=m["entries"]["decode"]),
     "unknown entry 'decode2' \\(known: prefill, prefill_all, decode"),
    (lambda m: m.update(format_version=1), "artifact format 1, this runtime reads 2"),
    (lambda m: m.update(target={"name": "tpu-v9"}), "unknown target 'tpu-v9'"),
    (lambda m: m.update(versions={"torch": "2"}), "must name the TVM it was built with"),
    (lambda m: m.update(extra=1), "unknown key\\(s\\) \\['extra'\\]"),
    (lambda m: m["entries"]["decode"]["static_bounds"].pop("batch"),
     "static_bounds has no 'batch'"),
])
def test_a_bad_manifest_is_a_sentence(written, edit, message):
    with pytest.raises(ArtifactError, match=message):
        Manifest.from_json(_bad(_raw(written), edit))


def test_a_bad_manifest_on_disk_is_refused_by_the_loader(written, tmp_path):
    import shutil

    d = tmp_path / "art"
    shutil.copytree(written, d)
    raw = _bad(_raw(written), lambda m: m["entries"].update(vision2={}))
    raw["manifest_sha256"] = manifest_digest(raw)
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=f"{d}: unknown entry 'vision2'"):
        verify(d)
    assert issubclass(ArtifactError, ValueError)
    with pytest.raises(ArtifactError, match="does not hold a manifest"):
        Manifest.from_json([1, 2])


def test_a_sharded_manifest_round_trips(written):
    one = _raw(written)
    raw = {"format": SHARDED_FORMAT, "model": "fmt", "config": one["config"],
           "config_hash": one["config_hash"], "target": {"name": "cpu", "tvm": "llvm"},
           "versions": {"tvm": "0.1"}, "shards": 2, "ccl": "cpu-test",
           "plan": {"workers": [{"rank": 0}, {"rank": 1}]},
           "entries": {"decode": _entry("decode")}, "files": {"decode.so": "00"},
           "compile_seconds": {"decode": 1.0}, "created_unix": 1}
    raw["manifest_sha256"] = manifest_digest(raw)
    m = ShardedManifest.from_json(raw)
    assert m.to_json() == raw and list(m.to_json()) == list(raw)
    assert m.digest() == raw["manifest_sha256"] and m.ccl is CclBackend.CPU_TEST
    with pytest.raises(ArtifactError, match="is not a sharded artifact"):
        ShardedManifest.from_json(one)
    with pytest.raises(ArtifactError, match="unknown collectives backend 'mpi'"):
        ShardedManifest.from_json({**raw, "ccl": "mpi"})


def test_entry_and_target_names_are_str_enums():
    assert all(isinstance(e, Entry) for e in (*ENTRIES, *CED_ENTRIES, *EXACT_ENTRIES))
    assert isinstance(ENTRIES, tuple) and Entry.VISION not in ENTRIES
    assert ENTRIES[:3] == ("prefill", "prefill_all", "decode")  # equal to the strings
    assert json.dumps({Entry.DECODE: [Entry.ENCODER]}) == '{"decode": ["encoder"]}'
    assert f"{Entry.ENCODER_REPLAY}.so" == "encoder_replay.so"
    assert target_names() == ("cpu", "cpu-avx2", "cpu-x86-64", "cuda-sm80", "cuda-sm90",
                              "cuda-sm100")
    assert all(isinstance(t, TargetName) for t in target_names())


# ---- the seals: the unkeyed digest, and the HMAC under an artifact key ---------------------------


def _keyed_artifact(root: Path, monkeypatch, key: bytes | None) -> Path:
    """The compiler's writer over placeholder libraries, with `key` as the artifact key (None:
    none configured); decode takes two weights of one shape."""
    key_file = root / "artifact.key"
    root.mkdir()
    if key is None:
        monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    else:
        key_file.write_bytes(key + b"\n")
        monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    opts = CompileOptions(args=load_config(SMALL_CONFIG_JSON), model_name="fmt", target="cpu",
                          out=root / "out")
    d = opts.artifact_dir
    d.mkdir(parents=True)
    sig = _entry("decode")
    sig["params"] = [_tensor(f"p_layers__{i}__attn__wq_a__weight", "float8_e4m3fn", ("64", "256"),
                             param=f"layers__{i}__attn__wq_a__weight") for i in (0, 1)]
    (d / "decode.so").write_bytes(b"placeholder library decode")
    write_manifest(opts, {"decode": EntrySpec.from_json(sig, "decode")}, CompileReport(d))
    return d


def _swap_weights_and_reseal(d: Path) -> None:
    """The two same-shape weights trade places; the digest recomputed, the HMAC left as it was
    (whoever edits it has no key)."""
    raw = _raw(d)
    p = raw["entries"]["decode"]["params"]
    p[0]["param"], p[1]["param"] = p[1]["param"], p[0]["param"]
    raw["manifest_sha256"] = manifest_digest(raw)
    (d / "manifest.json").write_text(json.dumps(raw, indent=1))


def test_with_an_artifact_key_a_swap_of_weights_with_the_digest_recomputed_is_refused(
        tmp_path, monkeypatch):
    d = _keyed_artifact(tmp_path / "keyed", monkeypatch, b"secret key")
    raw = _raw(d)
    assert raw["manifest_hmac"] == manifest_hmac(raw, b"secret key")
    assert list(raw)[-2:] == ["manifest_sha256", "manifest_hmac"]
    assert verify(d).manifest_hmac == raw["manifest_hmac"]
    _swap_weights_and_reseal(d)
    with pytest.raises(ArtifactError, match=f"^{d}: manifest.json does not match its "
                       "manifest_hmac under the configured artifact key"):
        verify(d)
    # sealed with another key: refused the same way
    d2 = _keyed_artifact(tmp_path / "other", monkeypatch, b"another key")
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "keyed" / "artifact.key"))
    with pytest.raises(ArtifactError, match="sealed with another key"):
        verify(d2)


def test_without_a_key_the_digest_alone_is_checked(tmp_path, monkeypatch):
    """The threat model's limit: unkeyed, a writer of the folder can recompute the digest."""
    d = _keyed_artifact(tmp_path / "plain", monkeypatch, None)
    assert "manifest_hmac" not in _raw(d)
    _swap_weights_and_reseal(d)
    assert verify(d).entries[Entry.DECODE].params[0].param == "layers__1__attn__wq_a__weight"


def test_a_configured_key_requires_a_keyed_manifest_and_a_usable_key_file(tmp_path,
                                                                          monkeypatch):
    d = _keyed_artifact(tmp_path / "plain", monkeypatch, None)
    key = tmp_path / "k"
    key.write_bytes(b"k")
    monkeypatch.setenv(KEY_FILE_ENV, str(key))
    with pytest.raises(ArtifactError, match=f"^{d}: manifest.json has no manifest_hmac, and an "
                       f"artifact key is configured \\({KEY_FILE_ENV}\\)"):
        verify(d)
    for bad, why in ((tmp_path / "none", "which is not a regular file"),
                     (tmp_path, "which is not a regular file"),
                     (tmp_path / "empty", "which must hold 1 to 4096 bytes")):
        if bad.name == "empty":
            bad.write_bytes(b" \n")
        with pytest.raises(ArtifactError, match=f"^{KEY_FILE_ENV} names {bad}, {why}"):
            artifact_key({KEY_FILE_ENV: str(bad)})
        monkeypatch.setenv(KEY_FILE_ENV, str(bad))  # the loader says so too, never "no key"
        with pytest.raises(ArtifactError, match=why):
            verify(d)
    assert artifact_key({}) is None and artifact_key({KEY_FILE_ENV: str(key)}) == b"k"
