"""Teacher-forced scoring: prefill the first P tokens at position 0, then feed the rest one at a
time, keeping the fp32 logits of every fed position. `dsv41 score` and the conformance tests use
it, so any backend (this graph, a compiled artifact) is measured the same way."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from dsv41.graph import vision
from dsv41.graph.cache import new_cache
from dsv41.graph.image_processor import PreparedImage


class Backend(Protocol):
    """What scoring needs from an engine: one sequence, exact or CED prefill, then decode."""

    def prefill(self, tokens: np.ndarray, *, mode: str, record: tuple[int, ...]) -> dict: ...

    def decode(self, token: int) -> dict: ...


@dataclass
class ScoreResult:
    logits: np.ndarray  # fp32 [N, V]: row i is the distribution after token i
    prefill: int
    selections: dict[str, np.ndarray] = field(default_factory=dict)  # golden-style keys
    hidden: dict[str, np.ndarray] = field(default_factory=dict)
    token_layers: int = 0

    def perplexity(self, tokens: np.ndarray) -> float:
        """exp(mean NLL of token i+1 under row i), over the N-1 predicted tokens."""
        if len(tokens) < 2:
            return float("nan")
        x = torch.from_numpy(self.logits[:-1]).double()
        nll = torch.nn.functional.cross_entropy(x, torch.from_numpy(tokens[1:]).long())
        return float(torch.exp(nll))

    def to_npz(self, path: str | Path, tokens: np.ndarray) -> None:
        np.savez(path, logits=self.logits, tokens=tokens, prefill=np.int64(self.prefill),
                 perplexity=np.float64(self.perplexity(tokens)), **self.selections, **self.hidden)

    @classmethod
    def from_npz(cls, path: str | Path) -> ScoreResult:
        """What `to_npz` wrote (the token-layer count is not stored)."""
        z = np.load(path)
        fixed = {"logits", "tokens", "prefill", "perplexity"}
        sel = {k: z[k] for k in z.files if k.startswith(("idx_", "cand_blocks_"))}
        hidden = {k: z[k] for k in z.files if k not in fixed and k not in sel}
        return cls(z["logits"], int(z["prefill"]), sel, hidden)


MAX_TOKEN_FILE_BYTES = 64 << 20  # a token file is read whole; above this it is refused


def read_tokens(path: str | Path, max_bytes: int = MAX_TOKEN_FILE_BYTES) -> np.ndarray:
    """A `.npy` array or a text file of whitespace-separated integer ids: a regular file of at
    most `max_bytes` (a folder, a device such as /dev/zero or a pipe is refused before any
    read, and no more than `max_bytes` + 1 bytes are ever read)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"Token file {path} does not exist.")
    if not path.is_file():
        raise ValueError(f"Token file {path} is not a regular file (a folder, device or pipe); "
                         "give a .npy file or a text file of ids.")
    with path.open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"Token file {path} is larger than {max_bytes} bytes; a token file "
                         "that large is refused.")
    if path.suffix == ".npy":
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{path} is not a valid .npy file ({e}).") from e
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
            raise ValueError(f"{path} holds {getattr(arr, 'dtype', type(arr).__name__)}, not "
                             "integer token ids.")
    else:
        try:
            arr = np.array([int(t) for t in data.decode("ascii").split()], dtype=np.int64)
        except (ValueError, OverflowError) as e:
            raise ValueError(f"{path} must hold whitespace-separated integer ids: {e}.") from e
    arr = np.asarray(arr, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{path} holds no tokens.")
    return arr


def score(backend: Backend, tokens: np.ndarray, *, prefill: int | None = None, mode: str = "exact",
          hidden_layers: tuple[int, ...] = (), progress=None,
          images: Sequence[PreparedImage] = ()) -> ScoreResult:
    """Teacher-forced logits of every position of `tokens`. `images`: the images whose spans
    the prompt holds, in order (laid out as the released `prepare_vl_inputs` writes them; the
    backend checks each span against its image's grid); decode steps are text only."""
    n = len(tokens)
    p = n if prefill is None else prefill
    if not 1 <= p <= n:
        raise ValueError(f"--prefill must be in 1..{n} (the token count), got {p}.")
    if mode not in ("exact", "ced"):
        raise ValueError(f"mode must be 'exact' or 'ced', got {mode!r}.")
    extra = {"images": list(images)} if images else {}
    out = backend.prefill(tokens[:p], mode=mode, record=hidden_layers, **extra)
    rows = [out["logits"]]
    sel = {f"idx_prefill_L{k}" if k >= 0 else "cand_blocks_prefill": v
           for k, v in out.get("selections", {}).items()}
    dec_sel: dict[str, list[np.ndarray]] = {}
    work = out.get("token_layers", 0)
    steps = range(p, n)
    for i in progress(steps) if progress else steps:
        o = backend.decode(int(tokens[i]))
        rows.append(o["logits"])
        work += o.get("token_layers", 0)
        for k, v in o.get("selections", {}).items():
            key = f"idx_decode_L{k}" if k >= 0 else "cand_blocks_decode"
            dec_sel.setdefault(key, []).append(v)
    sel.update({k: np.concatenate(v, axis=0) for k, v in dec_sel.items()})
    return ScoreResult(np.concatenate(rows, axis=0).astype(np.float32), p, sel,
                       out.get("hidden", {}), work)


def _pad(idx: torch.Tensor, width: int) -> np.ndarray:
    """(1, s, w) int32 selection -> (s, width) with -1 padding, the goldens' layout."""
    a = idx[0].numpy()
    if a.shape[1] < width:
        a = np.concatenate([a, np.full((a.shape[0], width - a.shape[1]), -1, a.dtype)], axis=1)
    return a.astype(np.int32)


class GraphBackend:
    """Scores with the PyTorch graph itself (the oracle the compiled artifacts are held to)."""

    def __init__(self, model, *, kv_dtype: str = "fp4", capacity: int = 4096, phases=None,
                 chunk_tokens: int | None = None):
        """`phases`: an object with prefill_exact / ced_prefill / decode_step (default: the
        graph's own; `dsv41.runtime.backends.compiled.CompiledPhases` scores a compiled artifact).
        `chunk_tokens`: the prefill runs in chunks of at most that many tokens (every row's
        selections kept, as a one-shot prefill returns them)."""
        # heavy: loads the model and checkpoint code (~1 s) that ScoreResult's importers skip
        from dsv41.graph.phases_api import GraphPhases, Phases

        self.model, self.kv_dtype, self.capacity = model, kv_dtype, capacity
        self.chunk_tokens = chunk_tokens
        self.phases: Phases = phases or GraphPhases()
        self.cache = None

    def _out(self, res, n_rows: int | None = None) -> dict:
        a = self.model.args
        widths = {-1: a.candidate_topk_blocks}
        sel = {k: _pad(v, widths.get(k, a.index_topk)) for k, v in res.selections.items()}
        logits = res.logits[0].numpy()
        if n_rows is not None and logits.shape[0] < n_rows:  # CED: no logits before the replay
            logits = np.concatenate([np.full((n_rows - logits.shape[0], logits.shape[1]),
                                             np.nan, np.float32), logits])
        hidden = {f"hidden_after_L{k}": v[0].float().numpy() for k, v in res.hidden.items()}
        if res.final_hidden is not None and n_rows is not None:
            hidden["final_hidden"] = res.final_hidden[0].float().numpy()
        return {"logits": logits, "selections": sel, "hidden": hidden,
                "token_layers": res.token_layers}

    def prefill(self, tokens: np.ndarray, *, mode: str, record: tuple[int, ...] = (),
                images: Sequence[PreparedImage] = ()) -> dict:
        # heavy: loads the model and checkpoint code (~1 s) that ScoreResult's importers skip
        from dsv41.graph.phases_api import GraphPhases, PrefillPacing

        m = self.model
        image, vis = None, {}
        if images:
            if mode != "exact":
                raise ValueError("Images are scored in exact mode only (the released "
                                 "reference's own path); use --mode exact.")
            encode = None
            # another backend than the graph (which also records the tower's `vit_output`):
            # its own encoder (a compiled artifact's `vision` entry)
            if not isinstance(self.phases, GraphPhases):
                self.phases.check_images(m)

                def encode(im):
                    return self.phases.encode_image(m, im)
            image, vis = image_rows(m, tokens, images, encode=encode)
        pad = m.engram.pad_id if m.engram is not None else None
        self.cache = new_cache(m.plan, 1, max(self.capacity, len(tokens) + 1),
                               kv_dtype=self.kv_dtype, engram_pad=pad)
        t = torch.from_numpy(np.asarray(tokens, np.int64))[None]
        run = self.phases.prefill_exact if mode == "exact" else self.phases.ced_prefill
        chunked = {} if self.chunk_tokens is None else {
            "pacing": PrefillPacing(chunk_tokens=self.chunk_tokens, keep_rows=True)}
        if image is not None:
            chunked["image"] = image
        out = self._out(run(m, self.cache, t, all_logits=True, record=record, **chunked),
                        len(tokens))
        out["hidden"].update(vis)
        return out

    def decode(self, token: int) -> dict:
        return self._out(self.phases.decode_step(self.model, self.cache,
                                                 torch.tensor([[token]])))


def image_rows(model, tokens: np.ndarray, images: Sequence[PreparedImage], *, encode=None):
    """A prompt's image-span rows (each span checked against its image's planned grid) and the
    vision intermediates under the goldens' keys: `vit_output` (graph tower only),
    `aligner_embeddings` (rows of every image, in order) and `input_embeddings` (the prompt's
    spliced embeddings). `encode(image)` -> aligned rows replaces the graph's tower (a compiled
    artifact's `vision` entry: `CompiledPhases.encode_image`)."""

    if not model.vision:
        raise ValueError("This model's checkpoint has no vision tower; it cannot score images.")
    a = model.args
    spans = vision.find_spans(tokens, [im.grid for im in images], a.image_token_id)
    vis = {}
    if encode is None:
        feats = [vision.vit(model.w, a, im.patches, im.grid.n_vit_h, im.grid.n_vit_w)
                 for im in images]
        aligned = [vision.align(model.w, a, f, im.grid)
                   for f, im in zip(feats, images, strict=True)]
        vis["vit_output"] = torch.cat(feats).float().numpy()
    else:
        aligned = [encode(im) for im in images]
    rows = vision.span_rows(model.w, vision.token_types(len(tokens), spans), aligned)
    embedded = vision.splice(model.w["embed.weight"][torch.from_numpy(
        np.asarray(tokens, np.int64))][None], rows)
    return rows, {**vis, "aligner_embeddings": torch.cat(aligned).float().numpy(),
                  "input_embeddings": embedded[0].float().numpy()}
