"""Image preprocessing as the released `image_processor.py` does it (PIL + numpy): decode, plan
the patch grid from the size alone, resize-and-pad onto a gray canvas, normalise to [-1, 1] in
bf16, cut into patches. The span an image takes in the prompt follows from its grid.

Notation: p = vision_patch_size, r = vision_downsample_ratio, W x H the image's size.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv41.graph.config import ModelArgs

if TYPE_CHECKING:  # the annotations only; PIL itself is imported when an image is handled
    from PIL import Image

PAD_COLOR = (127, 127, 127)
# the most pixels an image may have before it is decoded (its header is read first): the planning
# shrinks any image to vision_max_n_token positions, so this bounds only the decoder's memory
MAX_PIXELS = 1 << 26


def pil_image() -> ModuleType:
    """`PIL.Image`, imported when an image is first handled, so that a runtime without Pillow
    (a `dsv41 bundle`'s, text only) runs; ValueError saying what to install where it is
    missing."""
    try:
        from PIL import Image
    except ModuleNotFoundError as e:
        raise ValueError("Images need Pillow, which this Python does not have "
                         "(`pip install pillow`).") from e
    return Image


class TokenType(IntEnum):
    """`token_types` of the released `prepare_vl_inputs`: -1 outside image spans."""

    TEXT = -1
    IMAGE_START = 0
    IMAGE = 1
    IMAGE_NEW_LINE = 2
    IMAGE_END = 3


@dataclass(frozen=True)
class ImageGrid:
    """The planned size and grids of one image."""

    width: int  # best_W: the resized-and-padded width, a multiple of p
    height: int  # best_H
    n_vit_h: int  # patch rows = best_H / p
    n_vit_w: int  # patch columns
    n_llm_h: int  # aligner token rows = ceil(n_vit_h / r)
    n_llm_w: int  # aligner token columns

    @property
    def n_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def n_embeddings(self) -> int:
        return self.n_llm_h * self.n_llm_w

    @property
    def span_length(self) -> int:
        """START + n_llm_h rows of (n_llm_w IMAGE + NEW_LINE) + END."""
        return self.n_llm_h * (self.n_llm_w + 1) + 2

    def span_types(self) -> np.ndarray:
        """int64 [span_length]: the token type of every span position, in order."""
        row = [TokenType.IMAGE] * self.n_llm_w + [TokenType.IMAGE_NEW_LINE]
        types = [TokenType.IMAGE_START, *row * self.n_llm_h, TokenType.IMAGE_END]
        return np.array([int(t) for t in types], dtype=np.int64)


def _grid(width: int, height: int, p: int, r: int) -> ImageGrid:
    n_vit_h, n_vit_w = height // p, width // p
    return ImageGrid(width, height, n_vit_h, n_vit_w, math.ceil(n_vit_h / r),
                     math.ceil(n_vit_w / r))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan_image_grid(width: int, height: int, args: ModelArgs) -> ImageGrid:
    """The released planning: an optional width cap, scale-up of small images to about
    min_pixels (sides truncated), sides rounded up to multiples of p, then a shrink when the
    span would exceed vision_max_n_token."""
    if width < 1 or height < 1:
        raise ValueError(f"An image must be at least 1 x 1 pixels, got {width} x {height}.")
    p, r, n_max = args.vision_patch_size, args.vision_downsample_ratio, args.vision_max_n_token
    w, h = width, height
    if args.vision_max_wh_ratio is not None and w > h * args.vision_max_wh_ratio:
        w = int(h * args.vision_max_wh_ratio)
    if 0 < w * h < args.vision_min_pixels:
        s = math.sqrt(args.vision_min_pixels / (w * h))
        w, h = int(w * s), int(h * s)
    grid = _grid(_round_up(w, p), _round_up(h, p), p, r)
    if grid.span_length <= n_max:
        return grid
    a, cell = h / w, p * r
    m_w = math.sqrt((n_max - 2) / a + 0.25) - 0.5
    m_h = m_w * a
    if m_w < 1:
        best_h, best_w = ((n_max - 2) // 2) * cell, cell
    elif m_h < 1:
        best_h, best_w = cell, (n_max - 3) * cell
    else:
        b = min(math.floor(m_w) * cell / w, math.floor(m_h) * cell / h)
        best_h, best_w = math.floor(h * b / p) * p, math.floor(w * b / p) * p
    grid = _grid(best_w, best_h, p, r)
    if grid.span_length > n_max or grid.n_patches == 0:
        raise ValueError(f"A {width} x {height} image cannot be planned within "
                         f"vision_max_n_token = {n_max} positions.")
    return grid


def decode_image(data: bytes | str | Path) -> Image.Image:
    """An RGB image from raw bytes, a base64 string, a `data:image/...;base64,` URL or a path.
    (The released loader also fetches http(s) URLs; dsv41 never reaches the network.)"""
    if isinstance(data, Path):
        raw = _read_path(data)
    elif isinstance(data, bytes):
        raw = data
    elif data.startswith("data:"):
        head, sep, body = data.partition(",")
        if not sep or ";base64" not in head:
            raise ValueError("An image data URL must look like data:image/png;base64,<data>.")
        raw = _b64(body)
    elif data.startswith(("http://", "https://")):
        raise ValueError("Image URLs are not fetched; send the image as a base64 data URL.")
    elif Path(data).is_file():
        raw = _read_path(Path(data))
    else:
        raw = _b64(data)
    image = pil_image()
    try:
        img = image.open(io.BytesIO(raw))  # reads the header only
        if img.width * img.height > MAX_PIXELS:
            raise ValueError(f"The image is {img.width} x {img.height} pixels; at most "
                             f"{MAX_PIXELS:,} pixels are decoded.")
        img.load()
    except (image.UnidentifiedImageError, OSError, image.DecompressionBombError) as e:
        raise ValueError(f"The image data could not be decoded by PIL: {e}.") from e
    return img.convert("RGB")


def _read_path(path: Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"Image file {path} does not exist.")
    return path.read_bytes()


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError("The image is neither a file, a data URL nor valid base64.") from e


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: its patches (bf16 values) and its grid."""

    patches: torch.Tensor  # bf16 (N, 3, p, p), row-major over the patch grid
    grid: ImageGrid


def preprocess(image: Image.Image, args: ModelArgs) -> PreparedImage:
    """Resize-and-pad (PIL bicubic, centred on gray), x / 255 -> (x - 0.5) / 0.5 in fp32, bf16,
    then the [3, n_vit_h, p, n_vit_w, p] -> [N, 3, p, p] patching."""
    from PIL import Image, ImageOps  # `image` is a PIL image: Pillow is here

    p = args.vision_patch_size
    image = image.convert("RGB")
    grid = plan_image_grid(image.width, image.height, args)
    ratio = args.vision_max_wh_ratio
    if ratio is not None and image.width > image.height * ratio:
        image = image.resize((grid.width, grid.height), Image.Resampling.BICUBIC)
    else:
        image = ImageOps.pad(image, (grid.width, grid.height), color=PAD_COLOR)
    x = np.asarray(image, dtype=np.float32) / 255.0  # (H, W, 3)
    x = (x - 0.5) / 0.5
    t = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))).to(torch.bfloat16)  # (3,H,W)
    t = t.view(3, grid.n_vit_h, p, grid.n_vit_w, p).permute(1, 3, 0, 2, 4)  # (nh, nw, 3, p, p)
    return PreparedImage(t.reshape(grid.n_patches, 3, p, p).contiguous(), grid)


def load_image(data: bytes | str | Path, args: ModelArgs) -> PreparedImage:
    return preprocess(decode_image(data), args)
