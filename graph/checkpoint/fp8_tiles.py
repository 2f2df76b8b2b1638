"""FP8 weights in square tiles (E4M3 codes, one E8M0 scale per tile: the hub's `wo_a`): their
exact dequantization to BF16, the exact way back to 32 x 32 tiles, and the range in which the
kernels that decode them to bf16 on the fly (an exponent add) reproduce that BF16 bit for bit."""

from __future__ import annotations

import torch

from dsv41.graph.checkpoint.spec import FP8_TILE
from dsv41.graph.formats import torch_e4m3_decode, torch_e4m3_encode, torch_e8m0_decode

# Scale bytes u for which every nonzero finite E4M3 value times 2^(u - 127) is a normal bf16
# (2^-9 * 2^(u - 127) >= 2^-126, and 448 * 2^(u - 127) below 2^128: exponent field 15 + u - 7 <=
# 254), so that adding u - 127 to the exponent of a code's bf16 is its exact scaled value.
EXACT_SCALE_BYTES = range(10, 247)


def dequantize_fp8_tiles(codes: torch.Tensor, scales: torch.Tensor, tile: int) -> torch.Tensor:
    """BF16 of FP8 E4M3 `codes` [out, in] times the E8M0 `scales` [ceil(out/tile),
    ceil(in/tile)] (uint8 bytes both): each code to fp32, times its tile's 2^e (exact), rounded
    once to bf16 -- `inference/convert.py`'s dequantization, bit for bit."""
    rows, cols = codes.shape
    grid_rows, grid_cols = scales.shape
    values = torch_e4m3_decode(codes)
    scale = torch_e8m0_decode(scales)
    if (grid_rows * tile, grid_cols * tile) == (rows, cols):  # whole tiles: scale in place
        tiles = values.view(grid_rows, tile, grid_cols, tile)
        return tiles.mul_(scale[:, None, :, None]).view(rows, cols).to(torch.bfloat16)
    scale = scale.repeat_interleave(tile, 0)[:rows].repeat_interleave(tile, 1)[:, :cols]
    return values.mul_(scale).to(torch.bfloat16)


def check_fp8_tiles(codes: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """ValueError unless every code is finite (no 0x7f / 0xff) and every scale byte is in
    `EXACT_SCALE_BYTES`: the FP8 form the kernels read in place of the BF16."""
    nan = (codes & 0x7F) == 0x7F
    if bool(nan.any()):
        r, c = (int(v) for v in nan.nonzero()[0])
        raise ValueError(f"{name}: E4M3 code {int(codes[r, c]):#04x} at [{r}, {c}] is a NaN; "
                         "a weight of NaNs cannot be served (set wo_a_dtype to 'bf16' in the "
                         "checkpoint's config.json to load its values as they are).")
    lo, hi = EXACT_SCALE_BYTES.start, EXACT_SCALE_BYTES.stop - 1
    bad = (scales < lo) | (scales > hi)
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}: tile [{r}, {c}] has the scale 2^{int(scales[r, c]) - 127}, "
                         f"outside 2^{lo - 127} .. 2^{hi - 127}, where its values stop being "
                         "normal bf16 numbers; set wo_a_dtype to 'bf16' in the checkpoint's "
                         "config.json to load it as BF16.")


def quantize_fp8_tiles_exact(values: torch.Tensor, name: str
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes [rows, cols] and E8M0 scales of 32 x 32 tiles (uint8 both) that dequantize to
    `values` (bf16 or fp32; rows and cols whole tiles) exactly, or ValueError naming the first
    tile no such pair holds. Per tile the smallest power of two with amax / 2^e <= 448 (the
    finest grid that holds the tile: a value that a coarser tile scale holds, as the hub's FP8
    in 128 x 128 or the BF16 `convert.py` made of it, is held by it too); an all-zero tile
    takes 2^0. Not `formats.torch_quant_fp8_weight`: its 1e-4 amax floor and rounded amax / 448
    can pick a coarser scale than the finest that holds the tile, and lose its last bits."""
    v = values.float()
    rows, cols = v.shape
    if rows % FP8_TILE or cols % FP8_TILE:
        raise ValueError(f"{name}: [{rows}, {cols}] is not whole {FP8_TILE} x {FP8_TILE} tiles.")
    tiles = v.view(rows // FP8_TILE, FP8_TILE, cols // FP8_TILE, FP8_TILE)
    amax = tiles.abs().amax(dim=(1, 3))
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    # amax <= 448 * 2^(u - 127) = 0.875 * 2^(u - 118)
    u = torch.where(mant <= 0.875, exp + 118, exp + 119)
    u = torch.where(amax > 0, u, torch.full_like(u, 127)).clamp(0, 254)
    scale = torch.exp2((u - 127).float())[:, None, :, None]
    codes = torch_e4m3_encode(tiles / scale)
    exact = (torch_e4m3_decode(codes) * scale == tiles).all(dim=3).all(dim=1) & torch.isfinite(
        amax)
    if not bool(exact.all()):
        r, c = (int(t) for t in (~exact).nonzero()[0])
        raise ValueError(f"{name}: tile [{r}, {c}] holds values that no FP8 E4M3 code times a "
                         "power of two per 32 x 32 tile represents exactly, so this is not the "
                         "hub's FP8 weight (or BF16 made of it); set wo_a_dtype to 'bf16' in the "
                         "checkpoint's config.json to load it as it is.")
    scales = u.to(torch.uint8)
    codes = codes.view(rows, cols)
    check_fp8_tiles(codes, scales, name)
    return codes, scales
