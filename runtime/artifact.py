"""Load a compiled artifact: verify its manifest, bind weights, call entries on torch tensors.

Nothing is compiled here. A tampered or missing file, another model's config, an unknown target,
a target this process cannot run, or a different TVM version is an `ArtifactError` that says
which.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.graph.config import ModelArgs, args_from_dict

FORMAT_VERSION = 1


class ArtifactError(ValueError):
    """The artifact cannot be used as it is."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(artifact_dir: str | Path) -> dict:
    path = Path(artifact_dir) / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{artifact_dir} is not a dsv41 artifact: no manifest.json.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}).") from e


def verify(artifact_dir: str | Path, *, args: ModelArgs | None = None,
           check_device: bool = True) -> dict:
    """Check the manifest against the files, this process's TVM, and (optionally) a config."""
    import tvm

    from dsv41.schedules.common import get_target, target_names

    d = Path(artifact_dir)
    m = read_manifest(d)
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{d}: artifact format {m.get('format_version')}, this runtime "
                            f"reads {FORMAT_VERSION}.")
    target = m.get("target", {}).get("name")
    if target not in target_names():
        raise ArtifactError(f"{d}: unknown target {target!r} (known: "
                            f"{', '.join(target_names())}).")
    if check_device and get_target(target).is_cuda and not tvm.cuda().exist:
        raise ArtifactError(f"{d} is built for {target}, and this machine has no CUDA GPU.")
    built = m.get("versions", {}).get("tvm")
    if built != tvm.__version__:
        raise ArtifactError(f"{d} was built with TVM {built}; this process has "
                            f"{tvm.__version__}. Recompile it.")
    for name, digest in m.get("files", {}).items():
        p = d / name
        if not p.is_file():
            raise ArtifactError(f"{d}: {name} is missing.")
        if sha256_file(p) != digest:
            raise ArtifactError(f"{d}: {name} does not match its checksum in manifest.json "
                                "(modified or corrupted). Recompile or restore it.")
    config = args_from_dict(m["config"])
    if config.config_hash() != m.get("config_hash"):
        raise ArtifactError(f"{d}: manifest config does not match its config hash.")
    if args is not None and args.config_hash() != config.config_hash():
        diff = [k for k, v in args.to_dict().items() if m["config"].get(k) != v]
        raise ArtifactError(f"{d} was compiled for another config (differs in: "
                            f"{', '.join(diff[:8]) or 'fields'}).")
    for entry in m.get("entries", {}):
        if f"{entry}.so" not in m.get("files", {}):
            raise ArtifactError(f"{d}: entry {entry} has no library in the manifest.")
    return m


def _to_tvm(t: torch.Tensor):
    import tvm

    t = t.contiguous()
    if t.data_ptr() % 64:  # DLPack import needs 64-byte aligned data
        t = t.clone()
    return tvm.runtime.from_dlpack(t)


def weight_for(model, param: str) -> torch.Tensor:
    """The checkpoint tensor behind a compiled entry's parameter name (see capture.PhaseGraph)."""
    if param.startswith("experts__"):
        _, layer, k = param.split("__")
        return getattr(model.experts[int(layer)], k)
    return model.w[param.replace("__", ".")]


@dataclass
class Artifact:
    path: Path
    manifest: dict
    args: ModelArgs
    _vms: dict = field(default_factory=dict)
    _params: dict = field(default_factory=dict)

    @classmethod
    def load(cls, artifact_dir: str | Path, *, args: ModelArgs | None = None) -> Artifact:
        m = verify(artifact_dir, args=args)
        return cls(Path(artifact_dir), m, args_from_dict(m["config"]))

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.manifest["entries"])

    def bind(self, model) -> None:
        """Weights for every entry (TVM views of the model's tensors; no copies when aligned)."""
        if model.args.config_hash() != self.args.config_hash():
            raise ArtifactError("The weights' config differs from the artifact's.")
        cache: dict[str, object] = {}
        for entry, sig in self.manifest["entries"].items():
            params = []
            for p in sig["params"]:
                if p["param"] not in cache:
                    t = weight_for(model, p["param"])
                    if list(t.shape) != [int(x) for x in p["shape"]]:
                        raise ArtifactError(f"Weight {p['param']} has shape {list(t.shape)}, "
                                            f"the artifact expects {p['shape']}.")
                    cache[p["param"]] = _to_tvm(t)
                params.append(cache[p["param"]])
            self._params[entry] = params

    def _vm(self, entry: str):
        import tvm
        from tvm import relax

        if entry not in self._vms:
            if entry not in self.manifest["entries"]:
                raise ArtifactError(f"The artifact has no entry {entry!r} (it has "
                                    f"{', '.join(self.entries)}).")
            lib = tvm.runtime.load_module(str(self.path / f"{entry}.so"))
            self._vms[entry] = relax.VirtualMachine(lib, tvm.cpu())
        return self._vms[entry]

    def call(self, entry: str, inputs) -> list[torch.Tensor]:
        """Run an entry on its user inputs (torch tensors, nested pairs flattened in order)."""
        if entry not in self._params:
            raise ArtifactError("Call Artifact.bind(model) before running entries.")
        flat = []
        for x in inputs:
            flat.extend(x if isinstance(x, tuple) else (x,))
        out = self._vm(entry)["main"](*[_to_tvm(x) for x in flat], *self._params[entry])
        return [torch.from_dlpack(o) for o in out]
