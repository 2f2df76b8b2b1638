"""Plain-aten building blocks: norms, RoPE, the mHC mixes, Engram's gate, the compressor pool.

Activations are bf16 between blocks, as in the released model; each function states where it
computes in fp32. The rounding points follow the released reference, because this model is
discontinuous (FP8/FP4 steps, top-k) and a moved rounding shows up as a moved selection.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, scaled by the (bf16) weight, back to the input dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(dtype)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float())


# ---- RoPE ------------------------------------------------------------------------------------


def rope_freqs(dim: int, original_seq_len: int, base: float, factor: float, beta_fast: int,
               beta_slow: int) -> torch.Tensor:
    """Per-pair inverse wavelengths (fp32 [dim/2]); YaRN when original_seq_len > 0: pairs whose
    wavelength fits the training context keep their frequency, those far beyond are divided by
    `factor`, with a linear ramp between beta_fast and beta_slow rotations."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            turns = original_seq_len / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3))
        smooth = 1 - ramp.clamp(0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * freq, fp32 [..., dim/2]."""
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs
    cis = torch.polar(torch.ones_like(angles), angles)
    return cis.real.contiguous(), cis.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rd` dims of x as interleaved (re, im) pairs, in fp32, back to x's dtype.
    x: (b, s, [h,] d); cos/sin: (b or 1, s, rd/2). `inverse` conjugates the rotation. The pair is
    multiplied as the released model's complex product, (a + ib)(c + id) = (ac - bd) + i(ad + bc),
    written in real arithmetic (bit-identical in torch, and compilable)."""
    nope, rot = x[..., :-rd], x[..., -rd:].float()
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if inverse:
        sin = -sin
    pair = rot.unflatten(-1, (-1, 2))
    re, im = pair[..., 0], pair[..., 1]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


# ---- mHC -------------------------------------------------------------------------------------


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             hc: int, iters: int, norm_eps: float, hc_eps: float):
    """pre [b,s,hc], post [b,s,hc], comb [b,s,hc,hc] from the flattened stream, all fp32.
    `comb` is made doubly stochastic by Sinkhorn (softmax rows, then alternating column/row
    normalisation, `iters` rounds of column normalisation in all)."""
    x = h.flatten(2).float()  # (b, s, hc*d)
    m = F.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = sum_i pre_i * h_i: (b, s, hc, d) -> (b, s, d), fp32 sum, bf16 out."""
    return torch.sum(pre.unsqueeze(-1) * h.float(), dim=2).to(h.dtype)


def hc_post(f: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """h'_j = post_j * f + sum_i comb[i, j] * h_i: (b, s, d) -> (b, s, hc, d), bf16 out."""
    mixed = torch.sum(comb.unsqueeze(-1) * h.unsqueeze(-2), dim=2)
    return (post.unsqueeze(-1) * f.unsqueeze(-2) + mixed).type_as(f)


def identity_pre(h: torch.Tensor) -> torch.Tensor:
    """Block 0's attention collapses with a one-hot [1, 0, 0, 0] mix: (b, s, hc) fp32 for a
    stream h (b, s, hc, d). Built from h's shape (no size arithmetic, so it compiles)."""
    onehot = (torch.arange(h.size(2)) == 0).to(torch.float32)
    return torch.full_like(h[..., 0], 0.0, dtype=torch.float32) + onehot


# ---- Engram ------------------------------------------------------------------------------------


def engram_gate(h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h + gate * value per copy, gate = sigmoid(signed_sqrt(<h, qw*kw*key> * rstd(h) * rstd(key)
    / sqrt(dim))). h (b,s,hc,d) bf16; key (b,s,hc,d) fp32; value (b,s,d) bf16. Normalised per
    (token, copy) over dim, not jointly over the copies."""
    dim = h.size(-1)
    hf = h.float()
    w = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hf * w * key).sum(-1) * rstd * dim**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)


# ---- compressor --------------------------------------------------------------------------------


def softmax_pool(kv: torch.Tensor, score: torch.Tensor, m: int) -> torch.Tensor:
    """kv_j = sum_t softmax_t(score)[t, c] * kv[t, c] over groups of m tokens, fp32 per channel.
    kv, score: (b, n*m, d) -> (b, n, d)."""
    kv, score = kv.unflatten(1, (-1, m)), score.unflatten(1, (-1, m))
    return (kv * score.softmax(dim=2)).sum(dim=2)
