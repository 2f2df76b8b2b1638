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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.image_processor import (
    MAX_PIXELS,
    ImageGrid,
    PreparedImage,
    load_image,
    pil_image,
    plan_image_grid,
    preprocess,
)
from dsv41.graph.model import Model
from dsv41.graph.vision import SequenceImages, encode_image, place_span, span_tokens
from dsv41.runtime.engine.requests import RequestError
from dsv41.runtime.tiers.wire import (
    RecordError,
    RecordFault,
    RecordKind,
    decode_record,
    encode_record,
)

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
        image = pil_image()
    except ValueError as e:
        raise RequestError(str(e)) from None
    try:
        head = image.open(io.BytesIO(raw))  # the header only
    except (image.UnidentifiedImageError, OSError, image.DecompressionBombError) as e:
        raise RequestError(f"The image_url's data could not be decoded as an image: {e}.") \
            from None
    found = head.format
    _check_pixels(head.width, head.height)
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
    """An image of one turn's new tokens: its span's offset in them, and its aligned rows when
    a vision stage already encoded it (None: the tower runs at the turn's prefill)."""

    offset: int
    image: PreparedImage
    digest: bytes
    embeddings: torch.Tensor | None = None


def _digest(image: PreparedImage) -> bytes:
    g = image.grid
    h = hashlib.sha256(b"dsv41-image/1/")
    h.update(np.array([g.width, g.height, g.n_vit_h, g.n_vit_w], "<i8").tobytes())
    h.update(image.patches.contiguous().view(torch.int16).numpy().tobytes())
    return h.digest()


def _check_pixels(width: int, height: int) -> None:
    if width * height > MAX_PIXELS:
        raise RequestError(f"The image is {width} x {height} pixels; at most {MAX_PIXELS:,} "
                           "pixels are decoded.")


def _is_file(text: str) -> bool:
    if text.startswith(("data:", "http://", "https://")):
        return False
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a base64 string too long for a file name
        return False


def image_size(image) -> tuple[int, int] | None:
    """An image's width and height from its header alone (PIL opens lazily: nothing is
    decoded), for what `prepare` takes; None when the header cannot be read (`prepare` then
    says why)."""
    if isinstance(image, PreparedImage):
        return image.grid.width, image.grid.height
    if hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        return tuple(image.size)
    try:
        pil = pil_image()
    except ValueError:  # no Pillow: `prepare` says so
        return None
    try:
        if isinstance(image, Path) or (isinstance(image, str) and _is_file(image)):
            source = io.BytesIO(Path(image).read_bytes())
        elif isinstance(image, bytes):
            source = io.BytesIO(image)
        elif isinstance(image, str):
            source = io.BytesIO(base64.b64decode(image.partition(",")[2] if image.startswith(
                "data:") else image, validate=True))
        else:
            return None
        with pil.open(source) as head:
            return head.width, head.height
    except (pil.UnidentifiedImageError, OSError, ValueError, binascii.Error,
            pil.DecompressionBombError):
        return None


def check_spans_fit(model: Model, token_ids: Sequence[int], where: Sequence[int],
                    images: Sequence) -> None:
    """The turn's length with each placeholder at `where` replaced by its image's span, planned
    from the images' headers, must leave a position to generate within max_seq_len, and each
    image must be within the pixel cap: checked before any image is decoded (decoding one at
    the cap takes hundreds of MB)."""
    a = model.args
    positions = len(token_ids) - len(where)
    for raw in images:
        size = image_size(raw)
        if size is None:
            continue  # prepare() names the problem
        _check_pixels(*size)
        if isinstance(raw, PreparedImage):
            positions += raw.grid.span_length
            continue
        try:
            positions += plan_image_grid(*size, a).span_length
        except ValueError as e:
            raise RequestError(str(e)) from e
    if positions >= a.max_seq_len:
        raise RequestError(f"The prompt with its {len(images)} image span(s) takes {positions} "
                           f"positions, leaving no room to generate within the model's "
                           f"max_seq_len of {a.max_seq_len}.")


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
    check_spans_fit(model, ids, where, images)
    out, turn, prev = [], [], 0
    for pos, raw in zip(where, images, strict=True):
        prepared = prepare(model, raw)
        out += ids[prev:pos]
        turn.append(TurnImage(len(out), prepared, _digest(prepared)))
        out += span_tokens(prepared.grid, a.image_token_id).tolist()
        prev = pos + 1
    return out + ids[prev:], turn


def encode_turn(model: Model, first: int, images: Sequence[TurnImage], *,
                encode: Callable[[PreparedImage], torch.Tensor] | None = None
                ) -> list[SessionImage]:
    """The vision stage: each new image through the ViT and aligner (unless it comes encoded),
    its span placed at `first` (the position of the turn's first new token) plus its offset.
    `encode`: the tower to run (an artifact's `vision` entry); default the graph's."""
    out = []
    for im in images:
        emb = im.embeddings
        if emb is None:
            emb = encode(im.image) if encode is not None else \
                encode_image(model.w, model.args, im.image)
        elif tuple(emb.shape) != (im.image.grid.n_embeddings, model.args.dim):
            raise ValueError(f"An encoded image has rows {tuple(emb.shape)}; its grid needs "
                             f"({im.image.grid.n_embeddings}, {model.args.dim}).")
        out.append(SessionImage(first + im.offset, im.image, im.digest, emb))
    return out


# ---- images as records (the EPD stages' Redis keys, runtime/epd.py) ---------------------------

IMAGE_KIND, FEATURES_KIND = RecordKind.IMAGE, RecordKind.FEATURES


def image_record(image: PreparedImage, digest: bytes, *, fingerprint: bytes,
                 created_at: float) -> bytes:
    """A prepared image (patches as their bf16 bits, the grid) keyed by its content digest."""
    g = image.grid
    return encode_record(kind=IMAGE_KIND, key=digest.hex(), fingerprint=fingerprint,
                         created_at=created_at,
                         meta={"grid": [g.width, g.height, g.n_vit_h, g.n_vit_w, g.n_llm_h,
                                        g.n_llm_w]},
                         arrays={"patches": image.patches.contiguous().view(torch.int16)
                                 .numpy()})


def read_image_record(data: bytes | None, key: str, *, fingerprint: bytes,
                      args) -> PreparedImage:
    """The prepared image of `image_record`; RecordError when it is missing, damaged, another
    model's, or its patches are not the image its key names (the digest is recomputed)."""
    rec = decode_record(data if data is not None else b"", kind=IMAGE_KIND, key=key,
                        fingerprint=fingerprint)
    try:
        grid = ImageGrid(*(int(x) for x in rec.meta["grid"]))
        p = args.vision_patch_size
        patches = torch.from_numpy(np.ascontiguousarray(rec.arrays["patches"])).view(
            torch.bfloat16).reshape(grid.n_patches, 3, p, p)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise RecordError(RecordFault.CORRUPTED, f"The image record is malformed ({e}).") from e
    image = PreparedImage(patches, grid)
    if _digest(image).hex() != key:
        raise RecordError(RecordFault.CORRUPTED, "The image record's patches are not the image "
                          "its key names.")
    return image


def features_record(embeddings: torch.Tensor, key: str, *, fingerprint: bytes,
                    created_at: float) -> bytes:
    """An image's aligned rows (bf16 bits), what the vision stage hands the prefill stage."""
    return encode_record(kind=FEATURES_KIND, key=key, fingerprint=fingerprint,
                         created_at=created_at, meta={},
                         arrays={"rows": embeddings.contiguous().view(torch.int16).numpy()})


def read_features_record(data: bytes | None, key: str, *, fingerprint: bytes,
                         rows: int, dim: int) -> torch.Tensor:
    """The rows of `features_record` (RecordError when missing, damaged or mis-shaped)."""
    rec = decode_record(data if data is not None else b"", kind=FEATURES_KIND, key=key,
                        fingerprint=fingerprint)
    got = rec.arrays.get("rows")
    if got is None or got.shape != (rows, dim):
        raise RecordError(RecordFault.CORRUPTED, f"The image features have shape "
                          f"{None if got is None else got.shape}; the grid needs "
                          f"({rows}, {dim}).")
    return torch.from_numpy(np.ascontiguousarray(got)).view(torch.bfloat16)


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
