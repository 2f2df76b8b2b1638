"""Images in a session: the span layout of a turn's placeholders, the image-span rows of a
prefill segment, and the tokens the tiers' keys hash (image content, not just image ids).

A turn's token ids hold one `image_token_id` placeholder per image, as the released
`prepare_vl_inputs` takes them; the runtime replaces each by that image's span (the image id at
every span position, `graph.vision.span_tokens`). The session keeps its images (their position,
grid, content digest and aligned embeddings), so any later prefill over its history (a cold
restart, a prefix of another turn) splices the same rows again.

Phases: exact mode splices the new tokens' rows (`SequenceImages.rows`); the CED phases take
the whole sequence's spans by position (`sequence_images`), so the encoder's chunks, the
decoder's bounded replay and the encoder's bounded replays (a cached tail, a prefix hit's last
window) each splice, route (`bias_vl`) and mark dead (Engram) exactly their own span positions.
The OpenAI server's `image_url` parts arrive as data URIs, checked here (`data_uri_image`).

Keys: every span position's id is the image id, so two images with one grid would give one key.
`key_tokens` puts a negative value derived from the image's content digest at each span
position instead (text ids are >= 0), so a block or snapshot key covering a span names the
image: an image prompt never hits a text prompt's records, nor another image's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from dsv41.graph.image_processor import PreparedImage, load_image, preprocess
from dsv41.graph.model import Model
from dsv41.graph.vision import SequenceImages, encode_image, place_span, span_tokens

from .requests import RequestError

_KEY_SPACE = (1 << 62) - 1
# what an OpenAI `image_url` data URI may hold: its declared type -> PIL's format name
DATA_URI_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
MAX_IMAGE_BYTES = 20 << 20  # of one image's decoded data


def data_uri_image(url: str) -> bytes:
    """The bytes of an OpenAI `image_url` data URI (`data:image/png;base64,...` or
    `image/jpeg`), checked before the request is queued: the type, the size, valid base64 and
    data PIL recognises as the declared format (a RequestError, a 400's sentence, otherwise).
    URLs are never fetched."""
    if not isinstance(url, str):
        raise RequestError("An image_url must be a string.")
    if url.startswith(("http://", "https://")):
        raise RequestError("Image URLs are not fetched by this server; send the image inline "
                           "as a data URI (data:image/png;base64,...).")
    head, sep, body = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise RequestError("An image_url must be a base64 data URI: data:image/png;base64,... "
                           "or data:image/jpeg;base64,....")
    mime = head[len("data:"): -len(";base64")].strip().lower()
    if mime not in DATA_URI_FORMATS:
        raise RequestError(f"An image_url must hold a PNG or JPEG image (image/png, "
                           f"image/jpeg), not {mime or 'no type'!r}.")
    if len(body) > 4 * (MAX_IMAGE_BYTES // 3 + 1):
        raise RequestError(f"The image is too large: about {len(body) * 3 // 4:,} bytes, "
                           f"the limit is {MAX_IMAGE_BYTES:,}.")
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("The image_url's data is not valid base64.") from None
    try:
        found = Image.open(io.BytesIO(raw)).format  # the header only
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise RequestError(f"The image_url's data could not be decoded as an image: {e}.") \
            from None
    if found != DATA_URI_FORMATS[mime]:
        raise RequestError(f"The image_url declares {mime} but holds {found or 'unknown'} "
                           "data.")
    return raw


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


def sequence_images(model: Model, images: Sequence[SessionImage]) -> SequenceImages | None:
    """The session's images as the phases take them: each span's rows at its position in the
    sequence (None without images). Any segment a prefill runs (new tokens, a replayed window,
    a cached tail, a chunk) reads its rows from here (`SequenceImages.rows`)."""
    if not images:
        return None
    return SequenceImages(tuple(place_span(model.w, im.start, im.image.grid, im.embeddings)
                                for im in images))
