"""The artifact format the compiler writes and the runtime reads: `manifest.json` as typed,
frozen records, its digest and the file checksums. Below both packages (as `entries` is), so
neither reads the other's dicts.

    m = Manifest.from_json(json.loads(text))   # ArtifactError naming what is wrong
    m.entries[Entry.DECODE].input_index("hash_ids")
    m.to_json() == json.loads(text)             # the very JSON (same keys, same digest)

`manifest_sha256` is the sha256 of the canonical JSON (sorted keys, no spaces) of every other
field (`manifest_digest`), so each field the runtime trusts (the config, each entry's inputs,
outputs, cache names and parameter order, the file checksums) is covered. A key the format does
not know, a missing one or one of another type is refused when read, never carried along.

What the digest protects, and what it does not (docs/compile-and-targets.md, "Threat model"):
it is unkeyed, so it catches accidental corruption and mismatched files (a manifest edited by
hand, a library of another build, a truncated copy), not a deliberate change by someone who can
write the folder: they can recompute it. With a key configured (`KEY_FILE_ENV` names a file of
secret bytes), the writer also records `manifest_hmac`, HMAC-SHA256 under that key of the same
canonical JSON, and `check_seal` requires and verifies it, so an edit (two same-shape weights'
names swapped in an entry's parameters, the digest recomputed) is refused without the key.
Nested JSON the format does not interpret (the config, the TVM target, the sharding plan) is
kept read-only (`MappingProxyType`, tuples) and given back as plain JSON by `thaw`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dsv41.graph.ccl import CclBackend
from dsv41.graph.entry_names import Entry
from dsv41.graph.targets import TargetName

FORMAT_VERSION = 2  # 2: manifest_sha256
SHARDED_FORMAT = "dsv41-sharded-1"  # a sharded artifact's manifest `format` (runtime/sharded.py)
DIGEST_KEY = "manifest_sha256"
HMAC_KEY = "manifest_hmac"  # present when the writer had an artifact key
KEY_FILE_ENV = "DSV41_ARTIFACT_KEY_FILE"  # a file of secret bytes: seal and verify with HMAC
SEAL_KEYS = (DIGEST_KEY, HMAC_KEY)  # the fields neither seal covers (they are the seals)


class ArtifactError(ValueError):
    """The artifact cannot be used as it is."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(manifest: Mapping) -> bytes:
    """The canonical JSON (sorted keys, no spaces) of every field but the seals."""
    body = {k: v for k, v in thaw(manifest).items() if k not in SEAL_KEYS}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_digest(manifest: Mapping) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of every field but the seals."""
    return hashlib.sha256(_canonical(manifest)).hexdigest()


def manifest_hmac(manifest: Mapping, key: bytes) -> str:
    """HMAC-SHA256 under `key` of the same canonical JSON `manifest_digest` hashes."""
    return hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


def artifact_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The artifact key: the bytes of the file `KEY_FILE_ENV` names (surrounding whitespace
    stripped), None when it is not set; ArtifactError when it names no readable, non-empty
    regular file (a key configured but unusable never means "no key")."""
    env = os.environ if environ is None else environ
    name = env.get(KEY_FILE_ENV)
    if not name:
        return None
    path = Path(name)
    if not path.is_file():
        raise ArtifactError(f"{KEY_FILE_ENV} names {path}, which is not a regular file; point "
                            "it at the artifact key's file, or unset it.")
    try:
        with path.open("rb") as f:
            key = f.read(4097).strip()
    except OSError as e:
        raise ArtifactError(f"{KEY_FILE_ENV} names {path}, which cannot be read ({e}).") from e
    if not key or len(key) > 4096:
        raise ArtifactError(f"{KEY_FILE_ENV} names {path}, which must hold 1 to 4096 bytes of "
                            "key (it is empty or larger).")
    return key


def check_seal(m: Manifest | ShardedManifest, where: str, key: bytes | None) -> None:
    """The manifest's digest, and with a key its HMAC (required then): ArtifactError saying
    which does not match. Without a key a manifest_hmac present is not checked (there is
    nothing to check it with)."""
    if m.manifest_sha256 != m.digest():
        raise ArtifactError(f"{where}: manifest.json does not match its manifest_sha256 (edited "
                            "or corrupted). Recompile or restore it.")
    if key is None:
        return
    if m.manifest_hmac is None:
        raise ArtifactError(f"{where}: manifest.json has no manifest_hmac, and an artifact key "
                            f"is configured ({KEY_FILE_ENV}): compile it with that key set, or "
                            "unset it to load unkeyed artifacts.")
    if not hmac.compare_digest(m.manifest_hmac, manifest_hmac(m.to_json(), key)):
        raise ArtifactError(f"{where}: manifest.json does not match its manifest_hmac under the "
                            f"configured artifact key ({KEY_FILE_ENV}): edited after it was "
                            "sealed, or sealed with another key. Recompile it with this key.")


def freeze(value: Any) -> Any:
    """Read-only JSON: objects as MappingProxyType, arrays as tuples (`thaw` reverses it)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Plain JSON (dicts, lists) of a frozen value."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(v) for v in value]
    return value


# ---- reading JSON with sentences for what is wrong --------------------------------------------


_JSON_TYPES = {str: "a string", int: "an integer", bool: "true or false", list: "an array",
               dict: "an object", float: "a number"}


class _Fields:
    """The keys of one JSON object, taken one by one; what is left over is an error."""

    def __init__(self, obj: Any, where: str):
        if not isinstance(obj, dict):
            raise ArtifactError(f"{where} must be a JSON object, not {type(obj).__name__}.")
        self.obj, self.where, self.left = obj, where, set(obj)

    def take(self, key: str, kind: type | tuple[type, ...], *, required: bool = True,
             nullable: bool = False) -> Any:
        if key not in self.obj:
            if required:
                raise ArtifactError(f"{self.where} has no {key!r} (a manifest written by "
                                    "another dsv41, or edited). Recompile it.")
            return None
        self.left.discard(key)
        v = self.obj[key]
        if v is None and nullable:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            want = " or ".join(_JSON_TYPES.get(k, k.__name__) for k in kinds)
            raise ArtifactError(f"{self.where}: {key!r} must be {want}, not {v!r}.")
        return v

    def strs(self, key: str, **kw) -> tuple[str, ...] | None:
        v = self.take(key, list, **kw)
        if v is None:
            return None
        if not all(isinstance(x, str) for x in v):
            raise ArtifactError(f"{self.where}: {key!r} must be an array of strings.")
        return tuple(v)

    def done(self) -> None:
        if self.left:
            raise ArtifactError(f"{self.where} has unknown key(s) {sorted(self.left)} (a "
                                "manifest written by another dsv41). Recompile it.")


def _put(out: dict, key: str, value: Any) -> None:
    """A JSON key that is written only when present (None: absent)."""
    if value is not None:
        out[key] = value


# ---- the records --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor an entry takes: a user input (x, start, ..., the cache) or a parameter."""

    name: str  # the entry's argument name (`x`, `x_0`, `start`, `hash_ids`, `cache_in_3`, ...)
    dtype: str  # torch's dtype name without `torch.` (`int64`, `bfloat16`)
    shape: tuple[str, ...]  # each dim as text: a number, or a symbol (`s0`) of the capture
    param: str | None = None  # a parameter's model weight (`layers__0__attn__wq_a__weight`)
    host: bool | None = None  # read in host memory whatever the device (None: absent, False)

    @property
    def on_host(self) -> bool:
        return bool(self.host)

    @property
    def dims(self) -> list[int]:
        """The shape as numbers (a parameter's shape is static)."""
        return [int(d) for d in self.shape]

    @classmethod
    def from_json(cls, obj: Any, where: str, *, param: bool) -> TensorSpec:
        f = _Fields(obj, where)
        spec = cls(name=f.take("name", str), dtype=f.take("dtype", str), shape=f.strs("shape"),
                   param=f.take("param", str) if param else None,
                   host=f.take("host", bool, required=False))
        f.done()
        return spec

    def to_json(self) -> dict:
        out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        _put(out, "param", self.param)
        _put(out, "host", self.host)
        return out


@dataclass(frozen=True, slots=True)
class EntryBounds:
    """The bounds an entry is planned for (`capture.StaticBounds`); calls beyond are refused."""

    batch: int
    context_tokens: int

    @classmethod
    def from_json(cls, obj: Any, where: str) -> EntryBounds:
        f = _Fields(obj, where)
        b = cls(batch=f.take("batch", int), context_tokens=f.take("context_tokens", int))
        f.done()
        return b

    def to_json(self) -> dict:
        return {"batch": self.batch, "context_tokens": self.context_tokens}


@dataclass(frozen=True, slots=True)
class EntrySpec:
    """One compiled entry's calling convention (`graph.entries`): its user inputs in order, its
    parameters in order, its cache tensors' names and its outputs' names."""

    outputs: tuple[str, ...]
    cache: tuple[str, ...] = ()  # cache tensor names (`entries.cache_names`), inputs and outputs
    params: tuple[TensorSpec, ...] = ()
    # None: not declared (the torch.compile peer captures from the inputs it is given)
    inputs: tuple[TensorSpec, ...] | None = None
    inplace_cache: bool | None = None  # cache outputs are the input buffers (None: absent)
    static_bounds: EntryBounds | None = None

    def input_index(self, name: str) -> int:
        """The position of the user input `name` among the flat inputs (ArtifactError if the
        entry declares none of that name)."""
        for i, spec in enumerate(self.inputs or ()):
            if spec.name == name:
                return i
        raise ArtifactError(f"The entry declares no input {name!r} (it has "
                            f"{', '.join(s.name for s in self.inputs or ()) or 'none'}).")

    @property
    def host_params(self) -> tuple[TensorSpec, ...]:
        return tuple(p for p in self.params if p.on_host)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> EntrySpec:
        f = _Fields(obj, where)
        inputs = f.take("inputs", list, required=False)
        params = f.take("params", list)
        spec = cls(
            inputs=None if inputs is None else tuple(
                TensorSpec.from_json(x, f"{where} input {i}", param=False)
                for i, x in enumerate(inputs)),
            params=tuple(TensorSpec.from_json(x, f"{where} parameter {i}", param=True)
                         for i, x in enumerate(params)),
            cache=f.strs("cache"), outputs=f.strs("outputs"),
            inplace_cache=f.take("inplace_cache", bool, required=False),
            static_bounds=None if "static_bounds" not in f.obj else EntryBounds.from_json(
                f.take("static_bounds", dict), f"{where} static_bounds"))
        f.done()
        return spec

    def to_json(self) -> dict:
        out = {}
        _put(out, "inputs", None if self.inputs is None else [i.to_json() for i in self.inputs])
        out.update(params=[p.to_json() for p in self.params], cache=list(self.cache),
                   outputs=list(self.outputs))
        _put(out, "inplace_cache", self.inplace_cache)
        _put(out, "static_bounds", None if self.static_bounds is None
             else self.static_bounds.to_json())
        return out


def _entries(obj: Any, where: str) -> Mapping[Entry, EntrySpec]:
    if not isinstance(obj, dict):
        raise ArtifactError(f"{where}: 'entries' must be a JSON object.")
    out = {}
    for name, sig in obj.items():
        if name not in {e.value for e in Entry}:
            raise ArtifactError(f"{where}: unknown entry {name!r} (known: "
                                f"{', '.join(Entry)}).")
        out[Entry(name)] = EntrySpec.from_json(sig, f"{where}: entry {name}")
    return MappingProxyType(out)


@dataclass(frozen=True, slots=True)
class ArtifactTarget:
    """What the artifact was built for: our target name, the TVM target it stood for, and the
    CPU features (Linux's names) its code may use, as the compiler's LLVM read that target
    (`graph.targets.target_cpu_features`; None: not an x86 CPU target, or an artifact written
    before this was recorded). A runtime without LLVM target support (`dsv41 bundle`'s
    runtime-only TVM) checks the loading CPU against this list."""

    name: TargetName
    tvm: Any  # the TVM target as JSON (an object, or a kind's name); frozen
    cpu_features: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, obj: Any, where: str) -> ArtifactTarget:
        name = obj.get("name") if isinstance(obj, dict) else None
        if name not in {t.value for t in TargetName}:
            raise ArtifactError(f"{where}: unknown target {name!r} (known: "
                                f"{', '.join(TargetName)}).")
        f = _Fields(obj, f"{where}: target")
        f.take("name", str)
        t = cls(TargetName(name), freeze(f.take("tvm", (dict, str))),
                f.strs("cpu_features", required=False))
        f.done()
        return t

    def to_json(self) -> dict:
        out = {"name": str(self.name), "tvm": thaw(self.tvm)}
        _put(out, "cpu_features", None if self.cpu_features is None
             else list(self.cpu_features))
        return out


def _header(f: _Fields) -> dict:
    """The fields both manifests share, in the order they are written."""
    return {"model": f.take("model", str), "config": freeze(f.take("config", dict)),
            "config_hash": f.take("config_hash", str)}


@dataclass(frozen=True, slots=True)
class Manifest:
    """`manifest.json` of a one-worker artifact (`compiler.build.write_manifest`)."""

    model: str
    config: Mapping[str, Any]  # `ModelArgs.to_dict()`, frozen
    config_hash: str
    target: ArtifactTarget
    versions: Mapping[str, str]  # tvm, torch
    entries: Mapping[Entry, EntrySpec]  # in the order compiled
    tuning_database_sha256: str | None  # of tuning/ (`tuning_db.database_hash`); None: none
    files: Mapping[str, str]  # file name -> sha256 (every file but the manifest)
    format_version: int = FORMAT_VERSION
    layer_plan: tuple[str, ...] | None = None  # `plan.format_plan`'s lines, for a reader
    tuning_applied: Mapping[str, tuple[str, ...]] | None = None  # entry -> tuned functions
    compile_seconds: Mapping[str, Any] | None = None  # entry -> phase -> seconds
    created_unix: int | None = None
    built_on: str | None = None  # the host name
    manifest_sha256: str | None = None  # None: not yet sealed (`sealed`)
    manifest_hmac: str | None = None  # sealed with an artifact key (`artifact_key`); else None

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest.json") -> Manifest:
        """The typed manifest; ArtifactError naming the first key that is missing, of another
        type or unknown (the format version and the target name first: an artifact of another
        format or target is refused as such)."""
        if not isinstance(obj, dict):
            raise ArtifactError(f"{where} does not hold a manifest (a JSON object).")
        if obj.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{where}: artifact format {obj.get('format_version')}, this "
                                f"runtime reads {FORMAT_VERSION}. Recompile it.")
        f = _Fields(obj, where)
        f.take("format_version", int)
        target = ArtifactTarget.from_json(f.take("target", dict), where)
        head = _header(f)
        versions = f.take("versions", dict)
        if not isinstance(versions.get("tvm"), str):
            raise ArtifactError(f"{where}: 'versions' must name the TVM it was built with.")
        tuned = f.take("tuning_applied", dict, required=False)
        m = cls(**head, target=target, versions=freeze(versions),
                entries=_entries(f.take("entries", dict), where),
                tuning_database_sha256=f.take("tuning_database_sha256", str, nullable=True),
                files=freeze(f.take("files", dict)),
                layer_plan=f.strs("layer_plan", required=False),
                tuning_applied=None if tuned is None else freeze(tuned),
                compile_seconds=freeze(f.take("compile_seconds", dict, required=False)),
                created_unix=f.take("created_unix", int, required=False),
                built_on=f.take("built_on", str, required=False),
                manifest_sha256=f.take(DIGEST_KEY, str, required=False),
                manifest_hmac=f.take(HMAC_KEY, str, required=False))
        f.done()
        return m

    def to_json(self) -> dict:
        """The manifest's JSON, keys in the order the compiler writes them."""
        out = {"format_version": self.format_version, "model": self.model,
               "config": thaw(self.config), "config_hash": self.config_hash}
        _put(out, "layer_plan", None if self.layer_plan is None else list(self.layer_plan))
        out.update(target=self.target.to_json(), versions=thaw(self.versions),
                   entries={str(e): s.to_json() for e, s in self.entries.items()},
                   tuning_database_sha256=self.tuning_database_sha256)
        _put(out, "tuning_applied", thaw(self.tuning_applied))
        out["files"] = thaw(self.files)
        _put(out, "compile_seconds", thaw(self.compile_seconds))
        _put(out, "created_unix", self.created_unix)
        _put(out, "built_on", self.built_on)
        _put(out, DIGEST_KEY, self.manifest_sha256)
        _put(out, HMAC_KEY, self.manifest_hmac)
        return out

    def digest(self) -> str:
        return manifest_digest(self.to_json())

    def sealed(self, key: bytes | None = None) -> Manifest:
        """This manifest with its digest (`manifest_sha256`) over every other field, and with
        `key` its HMAC (`manifest_hmac`) over the same."""
        body = self.to_json()
        return replace(self, manifest_sha256=manifest_digest(body),
                       manifest_hmac=None if key is None else manifest_hmac(body, key))


@dataclass(frozen=True, slots=True)
class ShardedManifest:
    """`manifest.json` of a sharded artifact (`compiler.sharded.compile_sharded`): one worker's
    libraries for every worker, the collectives' backend and the sharding plan."""

    model: str
    config: Mapping[str, Any]
    config_hash: str
    target: ArtifactTarget
    versions: Mapping[str, str]
    shards: int  # workers
    ccl: CclBackend
    plan: Mapping[str, Any]  # `sharding.shard_plan_json`, frozen
    entries: Mapping[Entry, EntrySpec]
    files: Mapping[str, str]
    format: str = SHARDED_FORMAT
    compile_seconds: Mapping[str, float] | None = None
    created_unix: int | None = None
    manifest_sha256: str | None = None
    manifest_hmac: str | None = None

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest.json") -> ShardedManifest:
        if not isinstance(obj, dict) or obj.get("format") != SHARDED_FORMAT:
            raise ArtifactError(f"{where} is not a sharded artifact ({SHARDED_FORMAT}); a "
                                "one-worker artifact loads with Artifact.load.")
        f = _Fields(obj, where)
        f.take("format", str)
        head = _header(f)
        target = ArtifactTarget.from_json(f.take("target", dict), where)
        versions = f.take("versions", dict)
        if not isinstance(versions.get("tvm"), str):
            raise ArtifactError(f"{where}: 'versions' must name the TVM it was built with.")
        shards, ccl = f.take("shards", int), f.take("ccl", str)
        if ccl not in {c.value for c in CclBackend}:
            raise ArtifactError(f"{where}: unknown collectives backend {ccl!r} (known: "
                                f"{', '.join(c.value for c in CclBackend)}).")
        m = cls(**head, target=target, versions=freeze(versions), shards=shards,
                ccl=CclBackend(ccl), plan=freeze(f.take("plan", dict)),
                entries=_entries(f.take("entries", dict), where),
                files=freeze(f.take("files", dict)),
                compile_seconds=freeze(f.take("compile_seconds", dict, required=False)),
                created_unix=f.take("created_unix", int, required=False),
                manifest_sha256=f.take(DIGEST_KEY, str, required=False),
                manifest_hmac=f.take(HMAC_KEY, str, required=False))
        f.done()
        return m

    def to_json(self) -> dict:
        out = {"format": self.format, "model": self.model, "config": thaw(self.config),
               "config_hash": self.config_hash, "target": self.target.to_json(),
               "versions": thaw(self.versions), "shards": self.shards, "ccl": self.ccl.value,
               "plan": thaw(self.plan),
               "entries": {str(e): s.to_json() for e, s in self.entries.items()},
               "files": thaw(self.files)}
        _put(out, "compile_seconds", thaw(self.compile_seconds))
        _put(out, "created_unix", self.created_unix)
        _put(out, DIGEST_KEY, self.manifest_sha256)
        _put(out, HMAC_KEY, self.manifest_hmac)
        return out

    def digest(self) -> str:
        return manifest_digest(self.to_json())

    def sealed(self, key: bytes | None = None) -> ShardedManifest:
        body = self.to_json()
        return replace(self, manifest_sha256=manifest_digest(body),
                       manifest_hmac=None if key is None else manifest_hmac(body, key))


def write_manifest_file(folder: Path, manifest: Manifest | ShardedManifest) -> Path:
    """`folder/manifest.json`, sealed (with an HMAC too when `artifact_key` gives a key) and
    replaced whole (a killed write leaves the old one)."""

    path = folder / "manifest.json"
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest.sealed(artifact_key()).to_json(), indent=1))
    os.replace(tmp, path)
    return path
