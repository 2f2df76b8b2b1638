"""The vision path of the released model (`vision.py` and the VL parts of `model.py`): the ViT
with its 2-D RoPE, the aligner's r x r merge into the backbone's width, the image span's layout
in the prompt, and the per-chunk splice the blocks read (`SpanRows`).

All activations are bf16; every linear is a plain bf16 GEMM with bias; the ViT's RMSNorms use
eps 1e-6 (`VISION_NORM_EPS`), not `norm_eps`. Weights live in `Model.w` under their official
names (`checkpoint.vision_spec`).

Notation: N = n_vit_h * n_vit_w patches, D = vision_dim, h heads, hd = D / h, p patch side,
r = vision_downsample_ratio, L = n_llm_h * n_llm_w aligned tokens, d = dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .config import ModelArgs
from .image_processor import ImageGrid, PreparedImage, TokenType

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


def vit_attention(w: Mapping[str, torch.Tensor], args: ModelArgs, i: int, x: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention over the image's N patches, all head dims 2-D RoPE'd."""
    n, heads = x.size(0), args.vision_n_heads
    qkv = linear(x, w, f"vision.blocks.{i}.attn.wqkv")  # (N, 3D)
    q, k, v = qkv.view(n, 3, heads, -1).unbind(1)  # (N, h, hd) each
    q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return linear(o.transpose(0, 1).reshape(n, -1), w, f"vision.blocks.{i}.attn.wo")  # (N, D)


def vit_mlp(w: Mapping[str, torch.Tensor], i: int, x: torch.Tensor) -> torch.Tensor:
    """w2(silu(gate) * up), [gate | up] = w1(x); no biases, no clamp."""
    gate, up = linear(x, w, f"vision.blocks.{i}.mlp.w1").chunk(2, dim=-1)  # (N, inter) each
    return linear(F.silu(gate) * up, w, f"vision.blocks.{i}.mlp.w2")


def vit(w: Mapping[str, torch.Tensor], args: ModelArgs, patches: torch.Tensor, n_h: int,
        n_w: int) -> torch.Tensor:
    """patches bf16 (N, 3, p, p) -> features bf16 (N, D) after the final RMSNorm."""
    x = linear(patches.flatten(1).to(BF16), w, "vision.patch_embed.proj")  # (N, D)
    cos, sin = rope_2d(n_h, n_w, args.vision_dim // args.vision_n_heads, args.vision_rope_theta)
    for i in range(args.vision_n_layers):
        b = f"vision.blocks.{i}"
        x = x + vit_attention(w, args, i, vit_norm(x, w[f"{b}.norm1.weight"]), cos, sin)
        x = x + vit_mlp(w, i, vit_norm(x, w[f"{b}.norm2.weight"]))
    return vit_norm(x, w["vision.norm.weight"])


def align(w: Mapping[str, torch.Tensor], args: ModelArgs, feats: torch.Tensor,
          grid: ImageGrid) -> torch.Tensor:
    """ViT features (N, D) -> (L, d): zero-pad the grid to multiples of r (bottom, right), take
    the r x r cells in row-major order with features (channel, row, column), then
    w2(gelu(w1(x))) with the exact GELU."""
    r = args.vision_downsample_ratio
    x = feats.view(grid.n_vit_h, grid.n_vit_w, -1).permute(2, 0, 1)  # (D, nh, nw)
    x = F.pad(x, (0, grid.n_llm_w * r - grid.n_vit_w, 0, grid.n_llm_h * r - grid.n_vit_h))
    cells = F.unfold(x.unsqueeze(0), kernel_size=r, stride=r)[0].T  # (L, D r^2)
    return linear(F.gelu(linear(cells, w, "aligner.w1")), w, "aligner.w2")  # (L, d)


def encode_image(w: Mapping[str, torch.Tensor], args: ModelArgs,
                 image: PreparedImage) -> torch.Tensor:
    """One image's aligned embeddings bf16 (L, d), the rows its IMAGE slots take."""
    g = image.grid
    if image.patches.shape != (g.n_patches, 3, args.vision_patch_size, args.vision_patch_size):
        raise ValueError(f"The image's patches have shape {tuple(image.patches.shape)}; its grid "
                         f"needs ({g.n_patches}, 3, {args.vision_patch_size}, "
                         f"{args.vision_patch_size}).")
    return align(w, args, vit(w, args, image.patches, g.n_vit_h, g.n_vit_w), g)


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
