"""Images in a session: the span layout of a turn's placeholders, the image-span rows of a
prefill segment, and the tokens the tiers' keys hash (image content, not just image ids).

A turn's token ids hold one `image_token_id` placeholder per image, as the released
`prepare_vl_inputs` takes them; the runtime replaces each by that image's span (the image id at
every span position, `graph.vision.span_tokens`). The session keeps its images (their position,
grid, content digest and aligned embeddings), so any later prefill over its history (a cold
restart, a prefix of another turn) splices the same rows again.

Keys: every span position's id is the image id, so two images with one grid would give one key.
`key_tokens` puts a negative value derived from the image's content digest at each span
position instead (text ids are >= 0), so a block or snapshot key covering a span names the
image: an image prompt never hits a text prompt's records, nor another image's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.image_processor import PreparedImage, load_image, preprocess
from dsv41.graph.model import Model
from dsv41.graph.vision import SpanRows, encode_image, span_rows, span_tokens

from .requests import RequestError

_KEY_SPACE = (1 << 62) - 1


@dataclass(frozen=True)
class SessionImage:
    """One image of a session's sequence: span start position, its prepared input, content
    digest (sha256 of the patches and grid) and aligned embeddings bf16 (L, d)."""

    start: int
    image: PreparedImage
    digest: bytes
    embeddings: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.image.grid.span_length


@dataclass(frozen=True)
class TurnImage:
    """An image of one turn's new tokens: its span's offset in them, before it is encoded."""

    offset: int
    image: PreparedImage
    digest: bytes


def _digest(image: PreparedImage) -> bytes:
    g = image.grid
    h = hashlib.sha256(b"dsv41-image/1/")
    h.update(np.array([g.width, g.height, g.n_vit_h, g.n_vit_w], "<i8").tobytes())
    h.update(image.patches.contiguous().view(torch.int16).numpy().tobytes())
    return h.digest()


def prepare(model: Model, image) -> PreparedImage:
    """A PIL image, raw bytes, a path, a base64 string or data URL -> the tower's input."""
    if isinstance(image, PreparedImage):
        return image
    try:
        if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
            return preprocess(image, model.args)
        return load_image(Path(image) if isinstance(image, Path) else image, model.args)
    except ValueError as e:
        raise RequestError(str(e)) from e


def expand_placeholders(model: Model, token_ids: Sequence[int],
                        images: Sequence) -> tuple[list[int], list[TurnImage]]:
    """The turn's ids with each image placeholder replaced by its image's span, and where each
    span stands in them. The placeholders must number the images."""
    a = model.args
    if not model.vision:
        raise RequestError("This model's checkpoint has no vision tower; it cannot take images.")
    ids = [int(t) for t in token_ids]
    where = [i for i, t in enumerate(ids) if t == a.image_token_id]
    if len(where) != len(images):
        raise RequestError(f"The tokens hold {len(where)} image placeholder(s) (id "
                           f"{a.image_token_id}) for {len(images)} image(s); each image needs "
                           "exactly one.")
    out, turn, prev = [], [], 0
    for pos, raw in zip(where, images, strict=True):
        prepared = prepare(model, raw)
        out += ids[prev:pos]
        turn.append(TurnImage(len(out), prepared, _digest(prepared)))
        out += span_tokens(prepared.grid, a.image_token_id).tolist()
        prev = pos + 1
    return out + ids[prev:], turn


def encode_turn(model: Model, first: int, images: Sequence[TurnImage]) -> list[SessionImage]:
    """The vision stage: each new image through the ViT and aligner, its span placed at
    `first` (the position of the turn's first new token) plus its offset."""
    return [SessionImage(first + im.offset, im.image, im.digest,
                         encode_image(model.w, model.args, im.image)) for im in images]


def key_tokens(tokens: Sequence[int], images: Sequence[SessionImage]) -> Sequence[int]:
    """`tokens` with each span position replaced by a negative value naming its image's content
    and the position in the span (what the tiers' keys hash); `tokens` itself without images."""
    if not images:
        return tokens
    out = list(tokens)
    for im in images:
        base = int.from_bytes(im.digest[:8], "little") & _KEY_SPACE
        for j in range(max(0, im.start), min(len(out), im.end)):
            out[j] = -1 - ((base + j - im.start) % _KEY_SPACE)
    return out


def check_spans(tokens: Sequence[int], images: Sequence[SessionImage], image_token_id: int,
                begin: int) -> None:
    """Every image id in tokens[begin:] lies in a span the session holds an image for."""
    arr = np.asarray(tokens[begin:], dtype=np.int64)
    covered = np.zeros(len(arr), bool)
    for im in images:
        covered[max(0, im.start - begin): max(0, im.end - begin)] = True
    stray = np.flatnonzero((arr == image_token_id) & ~covered)
    if stray.size:
        raise RequestError(f"Token {begin + int(stray[0])} is the image id {image_token_id} "
                           "but the session has no image for it; send images with "
                           "images=[...] and one placeholder each.")


def segment_rows(model: Model, images: Sequence[SessionImage], begin: int,
                 end: int) -> SpanRows | None:
    """The image-span rows of positions [begin, end) of the session's sequence (None when no
    span reaches into it); a span cut by the segment contributes its part."""
    a = model.args
    inside = [im for im in images if im.start < end and im.end > begin]
    if not inside:
        return None
    mask = torch.zeros(1, end - begin, dtype=torch.bool)
    rows = torch.zeros(1, end - begin, a.dim, dtype=torch.bfloat16)
    for im in inside:
        full = span_rows(model.w, im.image.grid.span_types(), [im.embeddings])  # whole span
        lo, hi = max(begin, im.start), min(end, im.end)
        mask[0, lo - begin: hi - begin] = True
        rows[0, lo - begin: hi - begin] = full.rows[0, lo - im.start: hi - im.start]
    return SpanRows(mask, rows)
