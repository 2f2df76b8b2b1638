"""Load a compiled artifact: verify its manifest, bind weights, call entries on torch tensors.

Nothing is compiled here, and nothing here needs TVM's compiler (`TVM_USE_RUNTIME_LIB=1` runs
it). A tampered or missing file, an edited manifest, another model's config, an unknown target, a
target this process cannot run (a CUDA artifact without a GPU, a GPU of another arch), or a
different TVM version is an `ArtifactError` that says which. The VM runs on the artifact's device
(`runtime.device`): the weights bound are on it, inputs go there, outputs stay there (DLPack, no
host copies).

`manifest.json` (`graph.artifact_format.Manifest`, typed) carries `manifest_sha256`: the sha256
of the canonical JSON of every other field (`manifest_digest`), so each field the runtime trusts
(the config, each entry's inputs, outputs, cache names and parameter order, the file checksums)
is covered; the loader recomputes it. The digest is unkeyed (it catches corruption and mismatched
files, not a writer of the folder); with `DSV41_ARTIFACT_KEY_FILE` set the manifest's
`manifest_hmac` is required and verified under that key (`artifact_format.check_seal`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.graph.artifact_format import (  # noqa: F401 (the format's names, re-exported)
    FORMAT_VERSION,
    ArtifactError,
    EntrySpec,
    Manifest,
    ShardedManifest,
    TensorSpec,
    artifact_key,
    check_seal,
    manifest_digest,
    sha256_file,
    thaw,
)
from dsv41.graph.checkpoint import checkpoint_config
from dsv41.graph.config import ModelArgs, args_from_dict
from dsv41.graph.engram import engram_table_layer
from dsv41.graph.entries import (  # noqa: F401 (the entry sets, re-exported)
    CED_ENTRIES,
    ENTRY_ARGS,
    EXACT_ENTRIES,
    HASH_IDS,
    Entry,
)
from dsv41.graph.targets import missing_cpu_features, request_amx, uses_amx
from dsv41.runtime.backends.device import Device, DeviceError, DeviceKind, device_for_target
from dsv41.runtime.backends.engram_host import EngramPrefetcher, EngramTable, EngramTiming
from dsv41.runtime.backends.launcher import (
    LAUNCHER_FILE,
    LauncherError,
    launchers,
    use_artifact_launcher,
)
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.runtime.backends.threads import tvm_num_threads


def read_manifest_json(artifact_dir: str | Path) -> dict:
    """The manifest's JSON object as written (any format), or ArtifactError saying why not."""
    path = Path(artifact_dir) / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{artifact_dir} is not a dsv41 artifact: no manifest.json.")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}).") from e
    if not isinstance(m, dict):
        raise ArtifactError(f"{path} does not hold a manifest (a JSON object).")
    return m


def read_manifest(artifact_dir: str | Path) -> Manifest:
    """A one-worker artifact's manifest, typed (not verified against its files: `verify`)."""
    return Manifest.from_json(read_manifest_json(artifact_dir), where=str(artifact_dir))


def check_cpu_features(d: Path, m: Manifest | ShardedManifest) -> None:
    """An artifact built with AMX kernels runs only in a process that holds AMX permission (it
    is asked for here: for every thread of the process, a ThreadedSession's disco workers
    included), and one built for a CPU's vector features (a `cpu` artifact of an AVX-512
    machine, a `cpu-avx2` one) only on a CPU that has them (`missing_cpu_features`); elsewhere
    its first such instruction would kill the process (SIGILL)."""
    tvm_target = thaw(m.target.tvm)
    if not isinstance(tvm_target, dict):
        return
    if uses_amx(tvm_target) and not request_amx():
        raise ArtifactError(f"{d} was compiled with AMX kernels, which this CPU or OS does not "
                            "offer to this process. Recompile it on this machine.")
    missing = missing_cpu_features(tvm_target, m.target.cpu_features)
    if missing:
        raise ArtifactError(
            f"{d} was compiled for a CPU with {', '.join(missing)}, which this CPU lacks (its "
            "code would stop at the first such instruction). Recompile it here (`dsv41 compile "
            "--target cpu`), or portably: `--target cpu-avx2` (any AVX2 CPU) or `--target "
            "cpu-x86-64`.")


def verify(artifact_dir: str | Path, *, args: ModelArgs | None = None,
           check_device: bool = True) -> Manifest:
    """Check the manifest against the files, this process's TVM, and (optionally) a config."""
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    d = Path(artifact_dir)
    m = read_manifest(d)  # the format version and the target's name first, then every key
    if check_device:
        try:
            device_for_target(m.target.name)
        except DeviceError as e:
            raise ArtifactError(f"{d}: {e}") from e
        check_cpu_features(d, m)
    built = m.versions["tvm"]
    if built != tvm.__version__:
        raise ArtifactError(f"{d} was built with TVM {built}; this process has "
                            f"{tvm.__version__}. Recompile it.")
    # every field accepted below is covered (the refusals above hold whatever the digest says);
    # with an artifact key configured, its HMAC too (`graph.artifact_format.check_seal`)
    check_seal(m, str(d), artifact_key())
    for name, digest in m.files.items():
        p = d / name
        if not p.is_file():
            raise ArtifactError(f"{d}: {name} is missing.")
        if sha256_file(p) != digest:
            raise ArtifactError(f"{d}: {name} does not match its checksum in manifest.json "
                                "(modified or corrupted). Recompile or restore it.")
    config = args_from_dict(thaw(m.config))
    if config.config_hash() != m.config_hash:
        raise ArtifactError(f"{d}: manifest config does not match its config hash.")
    if args is not None and args.config_hash() != config.config_hash():
        diff = [k for k, v in args.to_dict().items() if thaw(m.config.get(k)) != v]
        raise ArtifactError(f"{d} was compiled for another config (differs in: "
                            f"{', '.join(diff[:8]) or 'fields'}).")
    for entry in m.entries:
        if f"{entry}.so" not in m.files:
            raise ArtifactError(f"{d}: entry {entry} has no library in the manifest.")
    return m


def engine_entries(art: Artifact, *, exact: bool) -> tuple[str, ...]:
    """The entries an engine of this mode runs, or ArtifactError naming the missing ones."""
    have = set(art.entries)
    wanted = EXACT_ENTRIES if exact else CED_ENTRIES
    got = tuple(Entry.PREFILL_ALL if e == Entry.PREFILL and e not in have
                and Entry.PREFILL_ALL in have else e for e in wanted)
    missing = [e for e in got if e not in have]
    if missing:
        mode = "an exact engine" if exact else "a CED engine (exact=False)"
        raise ArtifactError(f"{art.path} lacks the entries {', '.join(missing)} that {mode} "
                            f"runs (it has {', '.join(sorted(have))}); compile them with "
                            f"`dsv41 compile --entries {','.join(missing)}`.")
    return got


def check_checkpoint_config(art: Artifact, checkpoint_dir: str | Path) -> None:
    """The checkpoint's own config.json must be the artifact's config: ArtifactError naming the
    differing fields, or saying it is missing or unreadable. `wo_a_dtype` is the artifact's
    choice, not the checkpoint's: the loader converts either form of `wo_a` to the artifact's
    exactly, or refuses it by name (`checkpoint.fp8_tiles`)."""

    path = Path(checkpoint_dir)
    if not (path / "config.json").is_file() and not (path.is_file() and
                                                      (path.parent / "config.json").is_file()):
        raise ArtifactError(f"Checkpoint {path} has no config.json; the runtime does not load "
                            "weights whose config it cannot compare with the artifact's.")
    try:
        ckpt = checkpoint_config(path)
    except ValueError as e:
        raise ArtifactError(f"Checkpoint {path}: its config.json is invalid ({e}).") from e
    ckpt = ckpt.replace(wo_a_dtype=art.args.wo_a_dtype)
    if ckpt.config_hash() != art.args.config_hash():
        mine, theirs = ckpt.to_dict(), art.args.to_dict()
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        shown = ", ".join(f"{k} (checkpoint {mine.get(k)!r}, artifact {theirs.get(k)!r})"
                          for k in diff[:6])
        raise ArtifactError(f"Checkpoint {path} has another config than artifact {art.path}: "
                            f"{shown or 'fields'}{' ...' if len(diff) > 6 else ''}.")


def weight_for(model, param: str, spec: TensorSpec | None = None) -> torch.Tensor:
    """The checkpoint tensor behind a compiled entry's parameter name (see capture.PhaseGraph).

    A model loaded without a vision tower has no gate `bias_vl`, which the span entries of a
    config with one take as a parameter: the route reads it only at image-span positions, and
    such a model refuses images, so zeros of the declared shape stand in (`spec`: the entry's
    parameter record) and never reach an output."""
    if param.startswith("experts__"):
        _, layer, k = param.split("__")
        return getattr(model.experts[int(layer)], k)
    name = param.replace("__", ".")
    if name.endswith(".gate.bias_vl") and not model.vision and spec is not None:
        return torch.zeros(spec.dims, dtype=getattr(torch, spec.dtype),
                           device=model.w[name.removesuffix("_vl")].device)
    return model.w[name]


@dataclass
class Artifact:
    path: Path
    manifest: Manifest
    args: ModelArgs
    device: Device = Device(DeviceKind.CPU)
    engram_prefetch: bool = True  # gather the host Engram rows ahead (`runtime.engram_host`)
    _vms: dict = field(default_factory=dict)
    _params: dict = field(default_factory=dict)
    _engram: dict = field(default_factory=dict)  # entry -> its EngramTables (host-resident)
    _prefetcher: EngramPrefetcher | None = None
    _instrument: Callable[[str], Callable] | None = None  # entry -> a VM hook for one call

    @classmethod
    def load(cls, artifact_dir: str | Path, *, args: ModelArgs | None = None,
             device: str | Device | None = None) -> Artifact:
        """Verify and open an artifact to run on `device` (default: its target's kind, `cpu` or
        `cuda:0`); ArtifactError when this process cannot run it there."""
        m = verify(artifact_dir, args=args, check_device=False)
        try:
            dev = device_for_target(m.target.name, device)
        except DeviceError as e:
            raise ArtifactError(f"{artifact_dir}: {e}") from e
        if dev.kind == DeviceKind.CPU:
            check_cpu_features(Path(artifact_dir), m)
        return cls(Path(artifact_dir), m, args_from_dict(thaw(m.config)), dev)

    @property
    def target(self) -> str:
        return self.manifest.target.name

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.manifest.entries)

    @property
    def specs(self) -> Mapping[str, EntrySpec]:
        """Each entry's calling convention (`EntryBackend.specs`)."""
        return self.manifest.entries

    def bind(self, model) -> None:
        """Weights for every entry (TVM views of the model's tensors; no copies when aligned).
        Parameters the manifest marks `host` (the Engram tables) stay in host memory."""
        if model.args.config_hash() != self.args.config_hash():
            raise ArtifactError("The weights' config differs from the artifact's.")
        cache: dict[str, object] = {}
        for entry, sig in self.manifest.entries.items():
            params = []
            for p in sig.params:
                if p.param not in cache:
                    t = weight_for(model, p.param, p)
                    if list(t.shape) != p.dims:
                        raise ArtifactError(f"Weight {p.param} has shape {list(t.shape)}, "
                                            f"the artifact expects {list(p.shape)}.")
                    where = torch.device("cpu") if p.on_host else self.device.torch
                    if t.device != where:
                        raise ArtifactError(f"Weight {p.param} is on {t.device}, the "
                                            f"artifact runs on {self.device} and reads it on "
                                            f"{where}: load the model with "
                                            "Model.from_checkpoint(..., device=...).")
                    cache[p.param] = to_tvm(t)
                params.append(cache[p.param])
            self._params[entry] = params
            self._engram[entry] = self._engram_tables(model, sig, cache)
        self._prefetcher = EngramPrefetcher(self.device, prefetch=self.engram_prefetch)

    def bound_params(self, entry: str) -> tuple[tuple[str, torch.Tensor], ...]:
        """(checkpoint parameter name, the tensor bound) of each of the entry's parameters, in
        its order: the very buffers its kernels read (a profiler maps calls to layers by them)."""
        if entry not in self._params:
            raise ArtifactError("Call Artifact.bind(model) before reading its bound weights.")
        specs = self.manifest.entries[entry].params
        return tuple((p.param, to_torch(t)) for p, t in zip(specs, self._params[entry],
                                                            strict=True))

    def _engram_tables(self, model, sig: EntrySpec, bound: dict) -> tuple[EngramTable, ...]:
        """The host Engram tables an entry's host calls read, as the very buffers bound."""
        out = []
        for p in sig.host_params:
            layer = engram_table_layer(p.param)
            if layer is not None:
                scales = p.param.removesuffix("weight") + "scale"
                out.append(EngramTable(model.args.engram_layer_ids.index(layer),
                                       to_torch(bound[p.param]), to_torch(bound[scales])))
        return tuple(out)

    @property
    def hosts_engram(self) -> bool:
        """Whether its entries read Engram tables in host memory (compiled by a dsv41 with the
        host-resident Engram; an older artifact gathers them on its device)."""
        return any(sig.host_params for sig in self.manifest.entries.values())

    def set_engram_prefetch(self, on: bool) -> None:
        """Gather the host Engram rows ahead on a background thread (on), or when the entry
        reaches its first Engram layer (off): the same rows either way."""
        self.engram_prefetch = bool(on)
        if self._prefetcher is not None:
            self._prefetcher.prefetch = self.engram_prefetch

    def engram_timing(self, *, reset: bool = False) -> EngramTiming:
        """The Engram gathers' time and the part of it the entries did not wait for."""
        if self._prefetcher is None:
            return EngramTiming()
        return self._prefetcher.reset_timing() if reset else self._prefetcher.timing

    def _vm(self, entry: str):
        # order: tvm loads only after disco's libraries (disco.load_disco)
        import tvm
        from tvm.runtime.vm import VirtualMachine  # (relax's own needs TVM's compiler)

        if entry not in self._vms:
            if entry not in self.manifest.entries:
                raise ArtifactError(f"The artifact has no entry {entry!r} (it has "
                                    f"{', '.join(self.entries)}).")
            library = self.path / f"{entry}.so"
            lib = tvm.runtime.load_module(str(library))
            self._install_launcher(library)
            self._vms[entry] = VirtualMachine(lib, self.device.tvm())
        return self._vms[entry]

    def _install_launcher(self, library: Path) -> None:
        """A CPU entry's kernels on the artifact's launcher (`runtime.backends.launcher`), when
        it has one and DSV41_LAUNCHER does not ask for TVM's pool (for the whole process: the
        library is loaded once)."""
        digest = self.manifest.files.get(LAUNCHER_FILE)
        if self.device.kind != DeviceKind.CPU or digest is None:
            return
        if not use_artifact_launcher():  # the library may be loaded already, and installed
            for launcher in launchers().all():
                launcher.uninstall(library)
            return
        try:
            launcher = launchers().get(self.path / LAUNCHER_FILE, digest, tvm_num_threads())
        except LauncherError as e:  # the same results on TVM's pool, only slower
            warnings.warn(f"{self.path}: the artifact's launcher cannot be used ({e}); its "
                          "entries run on TVM's thread pool.", RuntimeWarning, stacklevel=3)
            return
        launcher.install(library)

    @contextmanager
    def instrumented(self, hook_for_call: Callable[[str], Callable]) -> Iterator[None]:
        """Within the block, every `call` first asks `hook_for_call(entry)` for a hook and sets
        it as the entry VM's instrument (TVM's: called before and after each call the VM makes,
        kernels, builtins and host functions alike). A profiler goes through here so that it
        runs the entries the way `call` does, host Engram gathers included. The instrumented VMs
        are dropped at the end (the next call loads a plain one)."""
        if self._instrument is not None:
            raise ArtifactError("The artifact is already instrumented.")
        self._instrument = hook_for_call
        try:
            yield
        finally:
            self._instrument = None
            self._vms.clear()

    def call(self, entry: str, inputs) -> list[torch.Tensor]:
        """Run an entry on its user inputs (torch tensors, nested pairs flattened in order)."""
        if entry not in self.manifest.entries:
            raise ArtifactError(f"The artifact {self.path} has no entry {entry!r} (it has "
                                f"{', '.join(self.entries)}).")
        if entry not in self._params:
            raise ArtifactError("Call Artifact.bind(model) before running entries.")
        flat = []
        for x in inputs:
            flat.extend(x if isinstance(x, tuple) else (x,))
        dev = self.device.torch
        tables = self._engram.get(entry, ())  # host Engram tables: the hash ids stay on the host
        at = self._hash_ids_at(entry, inputs) if tables else -1
        args = [to_tvm(x.cpu() if i == at else x.to(dev)) for i, x in enumerate(flat)]
        vm = self._vm(entry)
        if self._instrument is not None:
            vm.set_instrument(self._instrument(entry))
        keys = ()
        if tables:  # the rows' gathers, posted for the very ids buffer the entry receives
            keys = self._prefetcher.post(to_torch(args[at]), tables)
        try:
            out = vm["main"](*args, *self._params[entry])
        finally:
            if keys:
                self._prefetcher.finish(keys)
        return [to_torch(o) for o in out]

    def _hash_ids_at(self, entry: str, inputs) -> int:
        """Where the hash ids stand among the flat inputs: by name, in the entry's declared
        inputs, or (none declared) in the calling convention after x's tensors."""
        spec = self.manifest.entries[entry]
        if spec.inputs is not None:
            return spec.input_index(HASH_IDS)
        return (len(inputs[0]) if isinstance(inputs[0], tuple) else 1) + ENTRY_ARGS.index(HASH_IDS)
