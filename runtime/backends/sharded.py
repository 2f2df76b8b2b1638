"""A sharded artifact on N TVM disco workers, behind the `Artifact` interface the compiled phases
call (`CompiledPhases(ShardedArtifact..., Model.host_half(args))`).

    art = ShardedArtifact.open(artifact_dir, checkpoint_dir)      # a ThreadedSession (CPU test)
    phases = CompiledPhases(art, Model.host_half(args, token_map))
    ...
    art.shutdown()

Everything that can be checked is checked on the controller first (the checkpoint's config,
every worker's shapes): TVM's ThreadedSession does not catch an error raised on a worker
thread, which ends the process. Each worker then loads its own weights on its own thread
(`dsv41.shard.load_weights`: only its slices and experts, read straight from the safetensors
files, `Model.from_checkpoint(..., shard=)`) and the entry's library; the controller holds no
weights. A call copies the entry's inputs (tokens, positions, RoPE tables, Engram ids, and the
cache tensors the workers do not hold) to every worker, runs the entry on all of them, and
returns worker 0's outputs (every worker's logits are checked equal: the collectives give all of
them the same sums). The cache is whole on every worker (`sharding.py`), computed from those
same sums, and the controller keeps its own copy of it (the engine's tiers read it: SSD blocks,
DRAM snapshots); each worker also keeps its cache outputs, so the next call on the same,
unchanged host tensors sends only the step's inputs (`Resident`; `traffic()` counts the bytes
sent, received and kept). `Engine.load` runs this artifact when the manifest says it is one.

The CPU test collective (`CclBackend.CPU_TEST`): the PyPI wheel has no CPU collective library,
so for a `ThreadedSession` (workers are threads of this process) `register_test_ccl` registers
`dsv41.test_ccl.allreduce` / `allgather` as TVM functions over a `ThreadGroup`. It is for tests
and CPU checks only: a `CclBackend.DISCO` artifact calls disco's own functions, which run the
session's NCCL (a TVM built with USE_NCCL=ON; `disco.check_ccl` says so where it is missing);
this runner refuses those for now (GPU workers are not started here yet).

`load_disco()` must have run before anything imported tvm (see `runtime/disco.py`).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsv41.graph import artifact_format as fmt
from dsv41.graph.checkpoint import checkpoint_config
from dsv41.graph.collectives import CclBackend, ExportCollectives, ThreadGroup
from dsv41.graph.config import ModelArgs, args_from_dict
from dsv41.graph.engram import load_token_map
from dsv41.graph.model import Model
from dsv41.graph.sharding import WorkerShard, shard_plan, shard_plan_json
from dsv41.runtime.backends.artifact import (
    ArtifactError,
    EntrySpec,
    TensorSpec,
    check_cpu_features,
    read_manifest_json,
    sha256_file,
    thaw,
    weight_for,
)
from dsv41.runtime.backends.disco import SHARDED_FORMAT, check_ccl, load_disco
from dsv41.runtime.backends.tensors import to_torch, to_tvm


@dataclass
class Traffic:
    """What an entry's calls moved between the controller and the workers, in bytes summed
    over the workers (counted, not timed)."""

    calls: int = 0
    sent_bytes: int = 0  # host tensors copied to the workers
    received_bytes: int = 0  # worker tensors copied back (worker 0's outputs, the others' logits)
    resident_bytes: int = 0  # inputs not sent: the workers still held them (summed over workers)


@dataclass(frozen=True)
class Resident:
    """A cache tensor the workers hold: the output they returned, and the host copy of it (by
    reference and version: the same tensor, not changed in place since, holds the same bytes)."""

    host: weakref.ref
    version: int
    on_workers: object  # DRef: each worker's own output (equal on every worker, see `call`)


def verify_sharded(artifact_dir: str | Path, *,
                   args: ModelArgs | None = None) -> fmt.ShardedManifest:
    """The manifest of a sharded artifact, checked against its files, this TVM and `args`."""
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    d = Path(artifact_dir)
    m = fmt.ShardedManifest.from_json(read_manifest_json(d), where=str(d))
    fmt.check_seal(m, str(d), fmt.artifact_key())  # the digest; with a key, the HMAC
    if m.versions["tvm"] != tvm.__version__:
        raise ArtifactError(f"{d} was built with TVM {m.versions['tvm']}; this process has "
                            f"{tvm.__version__}. Recompile it.")
    check_cpu_features(d, m)  # the workers are this process's threads
    for name, digest in m.files.items():
        if not (d / name).is_file() or sha256_file(d / name) != digest:
            raise ArtifactError(f"{d}: {name} is missing or does not match its checksum.")
    for entry in m.entries:
        if f"{entry}.so" not in m.files:
            raise ArtifactError(f"{d}: entry {entry} has no library in the manifest.")
    config = args_from_dict(thaw(m.config))
    if config.config_hash() != m.config_hash:
        raise ArtifactError(f"{d}: manifest config does not match its config hash.")
    if args is not None and args.config_hash() != config.config_hash():
        raise ArtifactError(f"{d} was compiled for another config.")
    return m


def is_sharded(artifact_dir: str | Path) -> bool:
    """Whether the artifact's manifest is a sharded one (`dsv41 compile --shards N`)."""
    return read_manifest_json(artifact_dir).get("format") == SHARDED_FORMAT


@dataclass(frozen=True)
class ShardedManifest:
    """A verified sharded artifact before its workers start: what can be refused first (its
    entries, its config against the checkpoint's) without reading any weight."""

    path: Path
    manifest: fmt.ShardedManifest

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.manifest.entries)

    @property
    def args(self) -> ModelArgs:
        return args_from_dict(thaw(self.manifest.config))

    @property
    def shards(self) -> int:
        return self.manifest.shards


def read_sharded(artifact_dir: str | Path, *, args: ModelArgs | None = None,
                 shards: int | None = None, device: str | None = None) -> ShardedManifest:
    """The sharded artifact's manifest verified (`verify_sharded`), its plan recomputed from its
    config, and its worker count and device the caller's (`shards`, `device`: None takes the
    artifact's)."""
    m = verify_sharded(artifact_dir, args=args)
    n = m.shards
    if shards is not None and (isinstance(shards, bool) or shards != n):
        raise ArtifactError(f"{artifact_dir} was compiled for {n} workers; {shards!r} were "
                            "asked for. Recompile it with `dsv41 compile --shards "
                            f"{shards}`, or load it without `shards`.")
    if device is not None and device != "cpu":
        raise ArtifactError(f"Sharded artifacts run on CPU disco workers so far; device "
                            f"{device!r} was asked for.")
    config = args_from_dict(thaw(m.config))
    planned = json.loads(json.dumps(shard_plan_json(shard_plan(config, n),
                                                    context=config.max_seq_len)))
    if thaw(m.plan) != planned:
        raise ArtifactError(f"{artifact_dir}: the sharding plan in its manifest is not the plan "
                            f"of its config over {n} workers (built by another planner). "
                            "Recompile it.")
    return ShardedManifest(Path(artifact_dir), m)


def check_worker_shapes(manifest: fmt.ShardedManifest, checkpoint: str | Path) -> None:
    """ArtifactError unless the checkpoint is the artifact's model and every worker's share of
    it has the shapes the library takes. Checked here, before any worker runs: an exception on
    a ThreadedSession's worker thread is not caught by TVM and ends the process."""

    args = args_from_dict(thaw(manifest.config))
    if checkpoint_config(checkpoint).config_hash() != args.config_hash():
        raise ArtifactError(f"The checkpoint {checkpoint} is not the model the sharded artifact "
                            "was compiled for (its config differs).")
    shards = manifest.shards
    for w in range(shards):
        model = Model.placeholder(args, WorkerShard(w, shards, ExportCollectives(shards)))
        for entry, sig in manifest.entries.items():
            for p in sig.params:
                shape = list(weight_for(model, p.param, p).shape)
                if shape != p.dims:
                    raise ArtifactError(f"Worker {w}'s {p.param} has shape {shape}; the "
                                        f"{entry} library takes {list(p.shape)} (uneven shares "
                                        "need a library per worker).")


# ---- functions the workers run -------------------------------------------------------------


def _worker_id() -> int:
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    return int(tvm.get_global_func("runtime.disco.worker_id")()[0])


def register_worker_functions() -> None:
    """`dsv41.shard.load_weights(checkpoint, shards, params_json)`: the calling worker's weights
    for the named parameters, in order (its own share only); `dsv41.shard.item(array, i)`."""
    import tvm_ffi  # order: tvm loads only after disco's libraries (disco.load_disco)

    @tvm_ffi.register_global_func("dsv41.shard.load_weights", override=True)
    def load_weights(checkpoint: str, shards: int, params_json: str):
        w = _worker_id()
        model = Model.from_checkpoint(checkpoint, shard=WorkerShard(
            w, int(shards), ExportCollectives(int(shards))))  # the comm is the graph's
        out = []
        for i, obj in enumerate(json.loads(params_json)):
            p = TensorSpec.from_json(obj, f"parameter {i}", param=True)
            t = weight_for(model, p.param, p)
            if list(t.shape) != p.dims:
                raise ArtifactError(f"Worker {w}: weight {p.param} has shape "
                                    f"{list(t.shape)}, the artifact expects {list(p.shape)}.")
            out.append(to_tvm(t))
        return out

    @tvm_ffi.register_global_func("dsv41.shard.item", override=True)
    def item(array, i: int):
        return array[int(i)]


def register_test_ccl(group: ThreadGroup) -> None:
    """The CPU test collective over `group`, for a ThreadedSession of group.shards workers (see
    the module docstring): disco's signatures, each worker's rank from disco."""
    import tvm_ffi  # order: tvm loads only after disco's libraries (disco.load_disco)

    def member():
        return group.member(_worker_id())

    @tvm_ffi.register_global_func("dsv41.test_ccl.allreduce", override=True)
    def allreduce(send, reduce_kind, in_group, recv) -> None:
        if int(reduce_kind[0]) != 0 or bool(in_group):
            raise ValueError("The CPU test collective sums over all workers only.")
        to_torch(recv).copy_(member().all_reduce(to_torch(send)))

    @tvm_ffi.register_global_func("dsv41.test_ccl.allgather", override=True)
    def allgather(send, in_group, recv) -> None:
        if bool(in_group):
            raise ValueError("The CPU test collective gathers over all workers only.")
        to_torch(recv).copy_(member().all_gather(to_torch(send)))


# ---- the artifact on N workers ----------------------------------------------------------------


class ShardedArtifact:
    """Duck-types `runtime.artifact.Artifact` (manifest, entries, bind, call) for
    `CompiledPhases`; the weights are the workers'."""

    def __init__(self, path: Path, manifest: fmt.ShardedManifest, session,
                 group: ThreadGroup | None, checkpoint: Path):
        self.path, self.manifest, self.session, self.group = path, manifest, session, group
        self.args = args_from_dict(thaw(manifest.config))
        self.shards = manifest.shards
        self._modules: dict = {}
        self._traffic: dict[str, Traffic] = {}
        self._resident: dict[int, Resident] = {}  # by id() of the host tensor
        self._params: dict[str, list] = {}
        params = {}
        for sig in manifest.entries.values():
            for p in sig.params:
                params.setdefault(p.param, p)
        names = list(params)
        load = session.get_global_func("dsv41.shard.load_weights")
        self._weights = load(str(checkpoint), self.shards,
                             json.dumps([p.to_json() for p in params.values()]))
        item = self._item = session.get_global_func("dsv41.shard.item")
        by_name = {n: item(self._weights, i) for i, n in enumerate(names)}
        for entry, sig in manifest.entries.items():
            self._params[entry] = [by_name[p.param] for p in sig.params]
        session._sync_all()  # a worker that failed to load says so here

    @classmethod
    def open(cls, artifact_dir: str | Path, checkpoint: str | Path, *,
             args: ModelArgs | None = None, shards: int | None = None) -> ShardedArtifact:
        """The artifact verified (`read_sharded`) and its workers started (`start`)."""
        load_disco()  # first: a clear error where tvm was imported without disco
        return cls.start(read_sharded(artifact_dir, args=args, shards=shards), checkpoint)

    @classmethod
    def start(cls, spec: ShardedManifest, checkpoint: str | Path) -> ShardedArtifact:
        """A disco session of `spec.shards` workers, each holding its own share of the
        checkpoint's weights (checked against the libraries first)."""
        disco = load_disco()
        m, shards, ccl = spec.manifest, spec.shards, spec.manifest.ccl
        check_worker_shapes(m, checkpoint)  # a worker's own error would end the process
        register_worker_functions()
        if ccl is not CclBackend.CPU_TEST:
            check_ccl("nccl")  # the clear error where this TVM has no NCCL
            raise ArtifactError(f"{spec.path} runs its collectives on NCCL: running it needs "
                                "GPU workers (a ProcessSession per machine), which this runner "
                                "does not start yet; the CPU test artifacts (--ccl cpu-test) "
                                "run here.")
        group = ThreadGroup(shards)
        register_test_ccl(group)
        session = disco.ThreadedSession(num_workers=shards)
        try:
            return cls(spec.path, m, session, group, Path(checkpoint))
        except Exception:
            session.shutdown()
            raise

    def host_model(self, checkpoint: str | Path) -> Model:
        """The controller's model: the host half of the phases (no weights; the Engram tables
        from the checkpoint's token map)."""

        return Model.host_half(self.args, load_token_map(self.args, checkpoint)
                               if self.args.engram_layer_ids else None)

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.manifest.entries)

    @property
    def specs(self) -> Mapping[str, EntrySpec]:
        """Each entry's calling convention (`EntryBackend.specs`)."""
        return self.manifest.entries

    @property
    def target(self) -> str:
        return self.manifest.target.name

    def bind(self, model) -> None:
        """The host model gives the host half only: its config must be the artifact's."""
        if model.args.config_hash() != self.args.config_hash():
            raise ArtifactError("The host model's config differs from the artifact's.")

    def _module(self, entry: str):
        if entry not in self._modules:
            self._modules[entry] = self.session.load_vm_module(str(self.path / f"{entry}.so"))
        return self._modules[entry]

    def _to_workers(self, t: torch.Tensor, count: Traffic):
        """The workers' copy of `t`: the one they hold when `t` is a cache tensor they returned
        and the host has not changed since (torch counts every in-place write in `_version`; the
        runtime never writes a cache tensor through a numpy view: runtime/state.py copies), else
        a fresh copy sent to each. A held copy is lent to this one call: the entry updates its
        cache inputs in place (`inplace_cache`), so it no longer matches `t` after; the call's
        cache output takes it over (`call`)."""
        held = self._resident.pop(id(t), None)
        if held is not None and held.host() is t and held.version == t._version:
            count.resident_bytes += t.nbytes * self.shards
            return held.on_workers
        t = t.detach().cpu().contiguous()
        d = self.session.empty(tuple(t.shape), str(t.dtype).replace("torch.", ""))
        host = to_tvm(t)
        for w in range(self.shards):
            d.debug_copy_from(w, host)
        count.sent_bytes += t.nbytes * self.shards
        return d

    def _keep(self, host: torch.Tensor, on_workers) -> None:
        """Remember that the workers hold `host` (until the host tensor is freed)."""
        key = id(host)

        def forget(_ref, key=key, table=self._resident) -> None:
            table.pop(key, None)

        self._resident[key] = Resident(weakref.ref(host, forget), host._version, on_workers)

    def resident_bytes(self) -> int:
        """Bytes of the cache tensors each worker holds across calls."""
        return sum(r.host().nbytes for r in self._resident.values() if r.host() is not None)

    def call(self, entry: str, inputs) -> list[torch.Tensor]:
        """Run `entry` on every worker; worker 0's outputs (as `Artifact.call` returns them).
        The cache outputs stay on the workers too, so the next call sends only what changed."""
        if self.session is None:
            raise ArtifactError(f"The workers of the sharded artifact {self.path} have been "
                                "shut down; open it again to run it.")
        if entry not in self.manifest.entries:
            raise ArtifactError(f"The sharded artifact {self.path} has no entry {entry!r} (it "
                                f"has {', '.join(self.entries)}).")
        sig = self.manifest.entries[entry]
        count = self._traffic.setdefault(entry, Traffic())
        count.calls += 1
        flat = []
        for x in inputs:
            flat.extend(x if isinstance(x, tuple) else (x,))
        args = [self._to_workers(x, count) for x in flat]
        result = self._module(entry)["main"](*args, *self._params[entry])
        outs = [to_torch(o).clone() for o in result.debug_get_from_remote(0)]
        count.received_bytes += sum(o.nbytes for o in outs)
        logits = self._item(result, 0)
        for w in range(1, self.shards):
            other = to_torch(logits.debug_get_from_remote(w))
            count.received_bytes += other.nbytes
            if not torch.equal(other, outs[0]):
                raise ArtifactError(f"Worker {w}'s {sig.outputs[0]} differs from worker 0's: "
                                    "the collectives did not give every worker the same sums.")
        # every worker's cache is whole and computed from the same sums as its logits (the
        # collectives' results, equal on every worker), so each keeps its own
        for name in sig.cache:
            i = sig.outputs.index(name)
            self._keep(outs[i], self._item(result, i))
        return outs

    def traffic(self) -> dict[str, dict[str, int]]:
        """Per entry: its calls and the bytes they sent to and received from the workers."""
        return {entry: asdict(t) for entry, t in self._traffic.items()}

    def shutdown(self) -> None:
        """End the workers (once; the engine's close calls it)."""
        if self.session is not None:
            self.session.shutdown()
            self.session = None

