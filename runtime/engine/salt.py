"""What salts every tier key: everything that changes what a stored record means.

Two engines share a key only when a record one writes is exactly what the other would write for
the same tokens: the same config, the same weights, the same record layout, the same page (the
SSD block and the state record's split), the same decoder-state policy (exact phases, or CED with
bounded replay, with or without the decoder rings carried), the same model switches, and the
same backend code (the PyTorch graph, or an artifact's libraries: another build computes other
bytes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from dsv41.graph.artifact_format import Manifest, ShardedManifest


@dataclass(frozen=True)
class KeySalt:
    config_hash: str  # ModelArgs.config_hash()
    weights_hash: str  # graph.checkpoint.weights_fingerprint
    record_format: int  # the layout of the tier records (engine.FORMAT_VERSION)
    page_tokens: int  # runtime-cache page = SSD block, in positions
    exact: bool  # decoder-state policy: exact phases, or CED prefill + bounded replay
    decoder_carry: bool  # CED snapshots also carry the decoder / DSpark rings (EngineOptions)
    switches: tuple[tuple[str, bool], ...]  # Model.switches(), sorted by name
    backend: str  # "graph", or "artifact:<target>:<sha256 of its libraries' digests>"

    def __post_init__(self):
        for name in ("config_hash", "weights_hash", "backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"The key salt's {name} must be a non-empty string, got "
                                 f"{value!r}.")

    def fingerprint(self) -> bytes:
        """32 bytes: the store's fingerprint and the prefix of every key's hash."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"dsv41-key-salt\x00" + canon).digest()


def artifact_backend(manifest: Manifest | ShardedManifest, entries: tuple[str, ...]) -> str:
    """The backend name of an artifact: its target and the digests of the libraries of the
    entries an engine runs (adding another entry later does not orphan the store)."""
    files = manifest.files
    libs = {f"{e}.so": files.get(f"{e}.so") for e in sorted(entries)}
    digest = hashlib.sha256(json.dumps(libs, sort_keys=True).encode()).hexdigest()
    return f"artifact:{manifest.target.name}:{digest}"
