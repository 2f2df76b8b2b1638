"""The vision path of the released model (`vision.py` and the VL parts of `model.py`): the ViT
with its 2-D RoPE, the aligner's r x r merge into the backbone's width, the image span's layout
in the prompt, and the per-chunk splice the blocks read (`SpanRows`).

All activations are bf16; every linear is a plain bf16 GEMM with bias; the ViT's RMSNorms use
eps 1e-6 (`VISION_NORM_EPS`), not `norm_eps`. Weights live in `Model.w` under their official
names (`checkpoint.vision_spec`). Each op that torch computes in fp32 inside a bf16 op (the
attention's scores, softmax and sum; GELU, SiLU) is written out in fp32 with one rounding, and
the aligner's r x r merge is a gather (`cell_index`), so `tower` is a pure tensor function of
(patches, RoPE tables, cell indices): the graph the compiled `vision` entry captures, and the one
`encode_image` runs.

Notation: N = n_vit_h * n_vit_w patches, D = vision_dim, h heads, hd = D / h, p patch side,
r = vision_downsample_ratio, L = n_llm_h * n_llm_w aligned tokens, d = dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dsv41.graph.config import ModelArgs
from dsv41.graph.image_processor import ImageGrid, PreparedImage, TokenType

BF16 = torch.bfloat16
VISION_NORM_EPS = 1e-6  # hard-coded in the released ViT (not a config field)
DELIMITERS = {TokenType.IMAGE_START: "image_start", TokenType.IMAGE_NEW_LINE: "image_newline",
              TokenType.IMAGE_END: "image_end"}


def has_vision(w: Mapping[str, torch.Tensor]) -> bool:
    return "vision.patch_embed.proj.weight" in w


def check_vision_args(args: ModelArgs) -> None:
    """The vision fields a tower needs, checked when one is loaded."""
    if args.vision_n_layers <= 0:
        raise ValueError("This model's vision_n_layers is 0: it has no vision tower.")
    hd, rem = divmod(args.vision_dim, args.vision_n_heads)
    if rem or hd % 4:
        raise ValueError(f"vision_dim {args.vision_dim} must split into {args.vision_n_heads} "
                         "heads of a head_dim divisible by 4 (the 2-D RoPE's two axes).")
    if not 0 <= args.image_token_id < args.vocab_size:
        raise ValueError(f"image_token_id {args.image_token_id} is not an id of this model's "
                         f"{args.vocab_size}-token vocabulary.")


# ---- ViT -----------------------------------------------------------------------------------------


def vit_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in fp32 with the fp32 weight and eps 1e-6, back to bf16."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + VISION_NORM_EPS)
    return (xf * weight).to(BF16)


def linear(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def rope_2d(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin fp32 (N, hd/2): the patch at (i, j) has angles [i * inv_freq, j * inv_freq],
    inv_freq[k] = theta^(-2k / rope_dim) for k < rope_dim / 2, rope_dim = hd / 2."""
    rope_dim = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)  # (N,) grid row i
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)  # (N,) grid column j
    angles = torch.cat([torch.outer(rows, inv_freq), torch.outer(cols, inv_freq)], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, h, hd) bf16: halves a = x[:hd/2], b = x[hd/2:] -> [a cos - b sin, b cos + a sin],
    in fp32, back to bf16."""
    a, b = x.float().chunk(2, dim=-1)  # (N, h, hd/2) each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (N, 1, hd/2)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v per head over all N patches (bidirectional, no mask), q, k,
    v bf16 (N, h, hd): scores, softmax and sum in fp32, rounded once to bf16 (torch's CPU
    scaled_dot_product_attention accumulates in fp32 likewise)."""
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * q.size(-1) ** -0.5
    return torch.einsum("hnm,mhd->nhd", scores.softmax(dim=-1), v.float()).to(BF16)


def vit_attention(w: Mapping[str, torch.Tensor], args: ModelArgs, i: int, x: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention over the image's N patches, all head dims 2-D RoPE'd."""
    n, heads = x.size(0), args.vision_n_heads
    qkv = linear(x, w, f"vision.blocks.{i}.attn.wqkv")  # (N, 3D)
    q, k, v = qkv.view(n, 3, heads, -1).unbind(1)  # (N, h, hd) each
    q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
    return linear(attend(q, k, v).reshape(n, -1), w, f"vision.blocks.{i}.attn.wo")  # (N, D)


def vit_mlp(w: Mapping[str, torch.Tensor], i: int, x: torch.Tensor) -> torch.Tensor:
    """w2(silu(gate) * up), [gate | up] = w1(x); no biases, no clamp."""
    gate, up = linear(x, w, f"vision.blocks.{i}.mlp.w1").chunk(2, dim=-1)  # (N, inter) each
    return linear(F.silu(gate.float()).to(BF16) * up, w, f"vision.blocks.{i}.mlp.w2")


def vit_rows(w: Mapping[str, torch.Tensor], args: ModelArgs, patches: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """patches bf16 (N, 3, p, p), the grid's RoPE tables (`rope_2d`) -> features bf16 (N, D)
    after the final RMSNorm."""
    x = linear(patches.flatten(1).to(BF16), w, "vision.patch_embed.proj")  # (N, D)
    for i in range(args.vision_n_layers):
        b = f"vision.blocks.{i}"
        x = x + vit_attention(w, args, i, vit_norm(x, w[f"{b}.norm1.weight"]), cos, sin)
        x = x + vit_mlp(w, i, vit_norm(x, w[f"{b}.norm2.weight"]))
    return vit_norm(x, w["vision.norm.weight"])


def vit(w: Mapping[str, torch.Tensor], args: ModelArgs, patches: torch.Tensor, n_h: int,
        n_w: int) -> torch.Tensor:
    """patches bf16 (N, 3, p, p) of an n_h x n_w grid -> features bf16 (N, D)."""
    cos, sin = rope_2d(n_h, n_w, args.vision_dim // args.vision_n_heads, args.vision_rope_theta)
    return vit_rows(w, args, patches, cos, sin)


def cell_index(grid: ImageGrid, r: int) -> torch.Tensor:
    """int64 (L, r^2): for each aligned token (the r x r cells in row-major order), the patch
    index of each of its positions in (row, column) order, or n_patches where the grid is
    padded (bottom, right) to multiples of r."""
    ky, kx = np.meshgrid(np.arange(r), np.arange(r), indexing="ij")  # (r, r)
    rows = np.arange(grid.n_llm_h)[:, None, None, None] * r + ky  # (Lh, 1, r, r)
    cols = np.arange(grid.n_llm_w)[None, :, None, None] * r + kx  # (1, Lw, r, r)
    idx = np.where((rows < grid.n_vit_h) & (cols < grid.n_vit_w), rows * grid.n_vit_w + cols,
                   grid.n_patches)  # (Lh, Lw, r, r)
    return torch.from_numpy(idx.reshape(grid.n_embeddings, r * r).astype(np.int64))


def align_cells(w: Mapping[str, torch.Tensor], feats: torch.Tensor,
                cells: torch.Tensor) -> torch.Tensor:
    """ViT features (N, D), `cell_index` (L, r^2) -> (L, d): each token's r x r features with
    the channel slowest (F.unfold's order: c r^2 + ky r + kx), zeros at padded positions, then
    w2(gelu(w1(x))) with the exact GELU."""
    padded = torch.cat([feats, feats.new_zeros(1, feats.size(1))])  # (N + 1, D): N is zeros
    x = padded[cells].transpose(1, 2).reshape(cells.size(0), -1)  # (L, D r^2)
    x = F.gelu(linear(x, w, "aligner.w1").float()).to(BF16)
    return linear(x, w, "aligner.w2")  # (L, d)


def align(w: Mapping[str, torch.Tensor], args: ModelArgs, feats: torch.Tensor,
          grid: ImageGrid) -> torch.Tensor:
    """ViT features (N, D) -> (L, d): the grid zero-padded to multiples of r, its r x r cells
    merged (`align_cells`)."""
    return align_cells(w, feats, cell_index(grid, args.vision_downsample_ratio))


def tower(w: Mapping[str, torch.Tensor], args: ModelArgs, patches: torch.Tensor,
          cos: torch.Tensor, sin: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """The graph of `encode_image` (what the compiled `vision` entry captures): patches bf16
    (N, 3, p, p), RoPE tables fp32 (N, hd/2), cell indices int64 (L, r^2) in [0, N] ->
    aligned rows bf16 (L, d)."""
    return align_cells(w, vit_rows(w, args, patches, cos, sin), cells)


def tower_inputs(args: ModelArgs, image: PreparedImage
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host half of encoding one image: its patches checked against its grid, the grid's
    RoPE tables and cell indices (what `tower` and the compiled entry take)."""
    g = image.grid
    if image.patches.shape != (g.n_patches, 3, args.vision_patch_size, args.vision_patch_size):
        raise ValueError(f"The image's patches have shape {tuple(image.patches.shape)}; its grid "
                         f"needs ({g.n_patches}, 3, {args.vision_patch_size}, "
                         f"{args.vision_patch_size}).")
    cos, sin = rope_2d(g.n_vit_h, g.n_vit_w, args.vision_dim // args.vision_n_heads,
                       args.vision_rope_theta)
    return image.patches, cos, sin, cell_index(g, args.vision_downsample_ratio)


def encode_image(w: Mapping[str, torch.Tensor], args: ModelArgs,
                 image: PreparedImage) -> torch.Tensor:
    """One image's aligned embeddings bf16 (L, d), the rows its IMAGE slots take."""
    return tower(w, args, *tower_inputs(args, image))


# ---- the span in the prompt ------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpan:
    """Where one image stands in a token sequence: its first position and its grid."""

    start: int
    grid: ImageGrid

    @property
    def end(self) -> int:
        return self.start + self.grid.span_length


def span_tokens(grid: ImageGrid, image_token_id: int) -> np.ndarray:
    """int64 [span_length]: the ids of one image's span (the image id at every position)."""
    return np.full(grid.span_length, image_token_id, dtype=np.int64)


def find_spans(tokens: np.ndarray, grids: Sequence[ImageGrid], image_token_id: int,
               offset: int = 0) -> list[ImageSpan]:
    """The spans of `grids`, in order, in a token sequence laid out as `prepare_vl_inputs`
    writes it (every span position holds the image id; spans may be adjacent). Each must be
    exactly its grid's length, and no image id may stand outside a span. `offset`: the position
    of tokens[0]."""
    tokens = np.asarray(tokens).reshape(-1)
    is_img = tokens == image_token_id
    spans, cursor = [], 0
    for n, grid in enumerate(grids):
        found = np.flatnonzero(is_img[cursor:])
        if not found.size:
            raise ValueError(f"Image {n} ({grid.width} x {grid.height} after planning) has no "
                             f"span in the tokens: {len(spans)} span(s) found for {len(grids)} "
                             "image(s).")
        start = cursor + int(found[0])
        run = is_img[start: start + grid.span_length]
        if len(run) < grid.span_length or not run.all():
            got = int(np.argmin(np.append(run, False)))
            raise ValueError(f"Image {n}'s span at position {offset + start} holds {got} "
                             f"image-id positions; its planned {grid.n_llm_h} x {grid.n_llm_w} "
                             f"grid needs {grid.span_length}.")
        spans.append(ImageSpan(offset + start, grid))
        cursor = start + grid.span_length
    extra = np.flatnonzero(is_img[cursor:])
    if extra.size:
        raise ValueError(f"Token {offset + cursor + int(extra[0])} is the image id "
                         f"{image_token_id} but lies outside every image's span "
                         f"({len(grids)} image(s) given).")
    return spans


def token_types(n: int, spans: Sequence[ImageSpan], offset: int = 0) -> np.ndarray:
    """int64 [n]: the `token_types` of positions offset..offset+n-1."""
    types = np.full(n, int(TokenType.TEXT), dtype=np.int64)
    for s in spans:
        b, e = s.start - offset, s.end - offset
        if b < 0 or e > n:
            raise ValueError(f"The image span [{s.start}, {s.end}) does not lie inside "
                             f"positions [{offset}, {offset + n}).")
        types[b:e] = s.grid.span_types()
    return types


@dataclass(frozen=True)
class SpanRows:
    """What the blocks of one chunk read about image spans: which positions are span
    positions (the released image_mask: delimiters included) and the embedding each takes."""

    mask: torch.Tensor  # bool (b, s)
    rows: torch.Tensor  # bf16 (b, s, d): zeros outside the spans

    def piece(self, begin: int, end: int) -> SpanRows | None:
        """The rows of chunk positions [begin, end), or None when none is a span position."""
        mask = self.mask[:, begin:end]
        return SpanRows(mask, self.rows[:, begin:end]) if bool(mask.any()) else None


def span_rows(w: Mapping[str, torch.Tensor], types: np.ndarray,
              embeddings: Sequence[torch.Tensor]) -> SpanRows:
    """One sequence's chunk (types int64 [s]) with the aligned embeddings of the images whose
    spans it holds, in order: START / NEW_LINE / END take the learned vectors, IMAGE slots the
    aligner rows in reading order."""
    types = np.asarray(types, dtype=np.int64)
    dim = w["image_start"].numel()
    rows = torch.zeros(len(types), dim, dtype=BF16)
    for kind, name in DELIMITERS.items():
        rows[torch.from_numpy(types == int(kind))] = w[name].to(BF16)
    slots = torch.from_numpy(np.flatnonzero(types == int(TokenType.IMAGE)))
    flat = torch.cat([e.to(BF16) for e in embeddings]) if embeddings else rows[:0]
    if len(flat) != len(slots):
        raise ValueError(f"The chunk holds {len(slots)} image slots but its images give "
                         f"{len(flat)} aligned embeddings.")
    rows[slots] = flat
    mask = torch.from_numpy(types >= 0)
    return SpanRows(mask[None], rows[None])


@dataclass(frozen=True)
class PlacedSpan:
    """One image's span at its place in a sequence: the row every span position takes
    (`span_rows`: learned delimiters and the aligner rows)."""

    start: int  # position of the span's first (IMAGE_START) token
    rows: torch.Tensor  # bf16 (span_length, d)

    @property
    def end(self) -> int:
        return self.start + self.rows.size(0)


def place_span(w: Mapping[str, torch.Tensor], start: int, grid: ImageGrid,
               embeddings: torch.Tensor) -> PlacedSpan:
    """An image's span at `start`, from its grid and its aligned embeddings (L, d)."""
    return PlacedSpan(start, span_rows(w, grid.span_types(), [embeddings]).rows[0])


@dataclass(frozen=True)
class SequenceImages:
    """The image spans of one sequence at their absolute positions, in order and disjoint: the
    rows of any segment of it (a prefill chunk, the window a bounded replay runs again) come
    from here, so a phase that runs positions [b, e) splices exactly the rows they hold."""

    spans: tuple[PlacedSpan, ...]

    def __post_init__(self) -> None:
        for a, b in zip(self.spans, self.spans[1:], strict=False):
            if b.start < a.end:
                raise ValueError(f"Image spans [{a.start}, {a.end}) and [{b.start}, {b.end}) "
                                 "overlap; a sequence's spans must be disjoint and in order.")

    def rows(self, begin: int, end: int) -> SpanRows | None:
        """The span rows of positions [begin, end) as one sequence's chunk (None when no span
        reaches into it); a span cut by the segment contributes its part."""
        inside = [s for s in self.spans if s.start < end and s.end > begin]
        if not inside:
            return None
        mask = torch.zeros(1, end - begin, dtype=torch.bool)  # (1, s)
        rows = torch.zeros(1, end - begin, inside[0].rows.size(1), dtype=BF16)  # (1, s, d)
        for s in inside:
            lo, hi = max(begin, s.start), min(end, s.end)
            mask[0, lo - begin: hi - begin] = True
            rows[0, lo - begin: hi - begin] = s.rows[lo - s.start: hi - s.start]
        return SpanRows(mask, rows)

    def dead(self, begin: int, end: int) -> np.ndarray | None:
        """bool (1, end - begin): the span positions of [begin, end) (Engram's dead ones), or
        None when there are none."""
        mask = np.zeros((1, max(0, end - begin)), dtype=bool)
        for s in self.spans:
            lo, hi = max(begin, s.start), min(end, s.end)
            if lo < hi:
                mask[0, lo - begin: hi - begin] = True
        return mask if mask.any() else None


def splice(h: torch.Tensor, image: SpanRows | None) -> torch.Tensor:
    """Token embeddings (b, s, d) with the span positions overwritten."""
    if image is None:
        return h
    return torch.where(image.mask.unsqueeze(-1), image.rows.to(h.dtype), h)


# ---- the compiled entries' span inputs ---------------------------------------------------------


def packed_rows(image: SpanRows | None, batch: int, length: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's span rows as the compiled entries take them: `span_index` int64 (b, s), 0 off
    the spans and k at the position taking row k of `span_rows` bf16 (n + 1, d), whose row 0 is
    zeros (so a text chunk passes one zero row and an all-zero index)."""
    index = torch.zeros(batch * length, dtype=torch.int64)  # (b s,)
    if image is None:
        return index.view(batch, length), torch.zeros(1, dim, dtype=BF16)
    if tuple(image.mask.shape) != (batch, length):
        raise ValueError(f"The image rows cover {tuple(image.mask.shape)} positions; the chunk "
                         f"holds ({batch}, {length}).")
    mask = image.mask.reshape(-1)  # (b s,)
    index[mask] = torch.arange(1, int(mask.sum()) + 1)
    rows = torch.cat([torch.zeros(1, dim, dtype=BF16), image.rows.reshape(-1, dim)[mask].to(BF16)])
    return index.view(batch, length), rows


def unpacked_rows(span_index: torch.Tensor, span_rows: torch.Tensor) -> SpanRows:
    """The graph half of `packed_rows`: span_index int64 (b, s) in [0, n] (validated by the
    caller: the gather does not bound-check), span_rows bf16 (n + 1, d) -> the chunk's
    `SpanRows` (mask: index > 0; rows: zeros off the spans, as `span_rows` builds them)."""
    return SpanRows(span_index > 0, span_rows[span_index])  # (b, s), (b, s, d)
