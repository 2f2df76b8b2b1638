"""`dsv41 score`: teacher-forced logits of a token sequence on the PyTorch graph or on a compiled
artifact (the scorer itself is `graph/score.py`; an artifact's phases come from `runtime/`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dsv41.graph.image_processor import load_image
from dsv41.graph.model import Model
from dsv41.graph.score import GraphBackend, read_tokens, score
from dsv41.graph.vision import find_spans
from dsv41.runtime.backends.artifact import Artifact
from dsv41.runtime.backends.compiled import CompiledPhases


@dataclass(frozen=True)
class ScoreOptions:
    checkpoint: Path
    tokens: Path  # .npy or whitespace-separated ids
    out: Path  # the .npz written
    prefill: int | None = None  # tokens prefilled at position 0 (None: all)
    mode: str = "exact"  # exact | ced
    backend: str = "torch"  # torch, or an artifact folder
    kv_dtype: str = "fp4"  # fp4 | bf16
    hidden_states: tuple[int, ...] = ()  # blocks whose hidden states are kept
    images: tuple[Path, ...] = ()  # image files whose spans the prompt holds, in order


def score_command(opts: ScoreOptions) -> int:
    """Load, check the options against the model, score, write the .npz and print a line."""
    tokens = read_tokens(opts.tokens)
    hidden = opts.hidden_states
    t0 = time.time()
    model = Model.from_checkpoint(opts.checkpoint)
    for h in hidden:
        if not 0 <= h < model.args.n_layers:
            raise ValueError(f"--hidden-states {h} is not a block of 0..{model.args.n_layers - 1}.")
    phases, label = None, "the PyTorch graph"
    if opts.backend != "torch":
        if not Path(opts.backend).is_dir():
            raise ValueError(f"--backend {opts.backend!r} is neither 'torch' nor an artifact "
                             "directory.")
        if hidden:
            raise ValueError("--hidden-states needs --backend torch (artifacts return logits, "
                             "selections and cache state only).")
        if opts.kv_dtype != "fp4":
            raise ValueError("Compiled artifacts hold the FP4 cache; --kv-dtype bf16 needs "
                             "--backend torch.")
        phases = CompiledPhases(Artifact.load(opts.backend, args=model.args), model)
        label = f"artifact {opts.backend}"
    images = _score_images(opts.images, model, tokens, opts.prefill)
    print(f"backend: {label}")
    res = score(GraphBackend(model, kv_dtype=opts.kv_dtype, phases=phases), tokens,
                prefill=opts.prefill, mode=opts.mode, hidden_layers=hidden, progress=tqdm,
                images=images)
    res.to_npz(opts.out, tokens)
    finite = np.isfinite(res.logits).all(-1).sum()
    if images:
        print(f"images: {len(images)}, spans of "
              f"{', '.join(str(im.grid.span_length) for im in images)} positions")
    print(f"scored {len(tokens)} tokens ({res.prefill} prefilled, mode {opts.mode}) in "
          f"{time.time() - t0:.1f} s: {finite} logit rows, perplexity "
          f"{res.perplexity(tokens):.4f}, {res.token_layers} token-layers -> {opts.out}")
    return 0


def _score_images(paths: tuple[Path, ...], model, tokens, prefill: int | None) -> list:
    """Each image preprocessed, its span found in the prompt (laid out as the released
    `prepare_vl_inputs` writes it) and checked against its planned grid."""
    if not paths:
        return []
    if not model.vision:
        raise ValueError("--images needs a checkpoint with a vision tower; this one holds no "
                         "vision.* tensors.")
    images = [load_image(p, model.args) for p in paths]
    spans = find_spans(tokens, [im.grid for im in images], model.args.image_token_id)
    p = len(tokens) if prefill is None else prefill
    if spans[-1].end > p:
        raise ValueError(f"Image {len(spans) - 1}'s span ends at {spans[-1].end}, past the "
                         f"{p} prefilled tokens: image spans must lie in the prompt.")
    return images
