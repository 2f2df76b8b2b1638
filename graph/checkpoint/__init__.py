"""The official checkpoint: its tensor layout (`spec`), a memory-mapped loader and the weights'
fingerprint (`load`), and a writer of seeded random checkpoints with the released weight
statistics (`seeded`).

The layout is the single contract between the released files, the conformance checkpoints, the
seeded checkpoints the benches use and the compiled graph; the loader checks every file against
it. The public names are importable from here.
"""

from dsv41.graph.checkpoint.load import (
    checkpoint_config,
    load_checkpoint,
    load_vision,
    weights_fingerprint,
)
from dsv41.graph.checkpoint.seeded import write_seeded_checkpoint
from dsv41.graph.checkpoint.spec import (
    DEFAULT_CHECKPOINTS,
    E8M0,
    FP4,
    FP8,
    FP8_TILE,
    INDEX_FILE,
    RETURNED_DTYPES,
    SINGLE_FILE,
    TensorSpec,
    checkpoint_nbytes,
    param_spec,
    vision_spec,
)

__all__ = [
    "DEFAULT_CHECKPOINTS",
    "E8M0",
    "FP4",
    "FP8",
    "FP8_TILE",
    "INDEX_FILE",
    "RETURNED_DTYPES",
    "SINGLE_FILE",
    "TensorSpec",
    "checkpoint_config",
    "checkpoint_nbytes",
    "load_checkpoint",
    "load_vision",
    "param_spec",
    "vision_spec",
    "weights_fingerprint",
    "write_seeded_checkpoint",
]
