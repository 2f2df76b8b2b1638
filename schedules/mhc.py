"""mHC (manifold-constrained hyper-connections) as two fused TIR kernels (oracles: graph/layers.py
`hc_mixes`, `hc_pre`, `hc_post`, `rms_norm`).

A block reads the residual streams h (b, s, hc, d) twice per sublayer, once per kernel:

* `hc_pre_mix(h, fn, scale, base, pre_in[, weight]) -> (x, pre, post, comb)`: the mixes of h
  (`hc_mixes`: the 24 fp32 logits, sigmoid pre/post, softmax + Sinkhorn comb) and the collapse
  `x = hc_pre(h, pre_in)` with the *lagged* pre of the previous sublayer (the single-pass lag of
  V4.1; block 0 passes the one-hot `identity_pre`), optionally followed by the sublayer's
  RMSNorm (`with_norm`: x = rms_norm(hc_pre(h, pre_in), weight), as `block` uses it).
* `hc_post(f, h, post, comb) -> h'`: `h'_j = post_j * f + sum_i comb[i, j] * h_i`.

Agreement with the oracle, and why:

* `hc_pre` (x without the norm) and `hc_post` are bit-exact: the oracle sums its hc = 4 terms
  in order (((t0 + t1) + t2) + t3), fp32, then rounds to bf16 once; the kernel does the same,
  with each bf16 x fp32 product formed by `norm.mul_bf16` so FMA contraction cannot change it.
* With the norm, x is the RMSNorm of that bf16 value, with the sum of squares in `norm_lanes`
  strided partial sums: within one bf16 ulp of the oracle, almost always equal (as
  schedules/norm.py's rms_norm).
* pre, post and comb come from a 24 x (hc*d) fp32 dot product per token; the kernel sums it in
  `lanes` strided partial sums (torch's GEMM has its own order), so the logits differ by fp32
  rounding (~1e-7 relative to the sum of |terms|), and exp / sigmoid are libm's, not torch's
  vectorised ones (an ulp or so). Everything after follows the oracle's order exactly (row max,
  exp, row sum in order, `/ sum + eps`, column normalisation, then iters - 1 rounds of row and
  column normalisation with `/ (sum + eps)`). Tests bound the difference at 2e-6 absolute
  (values are in [0, 2]).

Structure: the 24 dot products are one stage over all tokens (`dot`, in tiles of `token_tile`
tokens, the last tile padded, so the CPU schedule can reuse each fn vector across a tile of
tokens); everything else is per token, in one `task` block (the Sinkhorn state is updated in
place across the serial round loop, as schedules/attention.py does with its online softmax).
The schedules only distribute loops: CPU, token tiles and tokens in parallel, vectors over the
lanes / d (the dot stage's partial sums pass through a (b, s, 24, lanes) fp32 workspace, 1.5 KB
per token); CUDA, a thread block per token with the dot stage moved into it (shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.config import preset
from dsv41.graph.layers import hc_mixes, hc_post, hc_pre, rms_norm
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import round_bf16
from dsv41.schedules.common.stages import lane_sum_of_squares, sinkhorn_pass
from dsv41.schedules.norm import BenchCase, BenchData, check_lanes, f32_of_bf16, mul_bf16, neg


def _sigmoid(x):
    """1 / (1 + exp(-x)), torch's form."""
    return T.float32(1) / (T.float32(1) + T.exp(neg(x)))


def _collapse(h, w, vb, vs, vc, tail, hc: int):
    """sum_i w[vb, vs, i, *tail] * h[vb, vs, i, vc] as (((t0 + t1) + t2) + t3) in fp32 (the
    oracle's order), h bf16 and w fp32."""
    acc = None
    for i in range(hc):
        iv = T.int64(i)
        t = mul_bf16(f32_of_bf16(h[vb, vs, iv, vc]), w[(vb, vs, iv, *tail)])
        acc = t if acc is None else acc + t
    return acc


def post_stage(hc: int, d: int):
    """A fresh macro (see common.stages) of hc_post's one block, `out`: out_j = post_j * f +
    sum_i comb[i, j] * h_i over b x s tokens."""
    HC, D = T.int64(hc), T.int64(d)

    @T.macro
    def post_stage_(f, h, post, comb, out, b, s):
        for bb, ss, j, c in T.grid(b, s, HC, D):
            with T.sblock("out"):
                vb, vs, vj, vc = T.axis.remap("SSSS", [bb, ss, j, c])
                out[vb, vs, vj, vc] = T.Cast("bfloat16", mul_bf16(
                    f32_of_bf16(f[vb, vs, vc]), post[vb, vs, vj])
                    + _collapse(h, comb, vb, vs, vc, (vj,), hc))

    return post_stage_


def _check(hc: int, d: int, iters: int, lanes: int, norm_lanes: int) -> None:
    if hc <= 0 or d <= 0:
        raise ValueError(f"mHC needs hc > 0 and d > 0, got hc={hc}, d={d}.")
    if iters < 1:
        raise ValueError(f"mHC needs at least one Sinkhorn iteration, got {iters}.")
    check_lanes(hc * d, lanes, "hc_pre_mix (hc * d)")
    check_lanes(d, norm_lanes, "hc_pre_mix norm (d)")


def make_hc_pre_mix(*, hc: int, d: int, iters: int, norm_eps: float, hc_eps: float,
                    with_norm: bool = False, lanes: int = 16, norm_lanes: int = 32,
                    token_tile: int = 1, with_post: bool = False) -> tvm.tirx.PrimFunc:
    """`hc_pre_mix`. Buffers: h bf16 (b, s, hc, d); fn fp32 (mix, hc*d) with mix = (2 + hc) * hc;
    scale fp32 (3,); base fp32 (mix,); pre_in fp32 (b, s, hc); [weight bf16 (d,) if with_norm];
    outputs x bf16 (b, s, d), pre fp32 (b, s, hc), post fp32 (b, s, hc), comb fp32
    (b, s, hc, hc). b and s are symbolic. norm_eps is both the mixes' and the norm's eps (the
    model's `norm_eps`). lanes / norm_lanes: the strided partial sums of the dots / the norm;
    token_tile: tokens per tile of the dot stage (1: untiled, as the CUDA schedule needs).

    with_post (with the norm): `hc_post_pre_mix(f, h, post_in, comb_in, fn, scale, base, pre_in,
    weight) -> (h', x, pre, post, comb)`, the previous sublayer's hc_post into h' (an output:
    the stream goes on) and then this kernel on h', in one function: the block's two mHC
    kernels between its sublayers as one (the `out` block, then the stages above)."""
    _check(hc, d, iters, lanes, norm_lanes)
    if with_post and not with_norm:
        raise ValueError("hc_post_pre_mix is the block's form: with_post needs with_norm.")
    if token_tile < 1:
        raise ValueError(f"hc_pre_mix needs token_tile >= 1, got {token_tile}.")
    mix, k = (2 + hc) * hc, hc * d
    HC, D, MX, K = T.int64(hc), T.int64(d), T.int64(mix), T.int64(k)
    L, KL = T.int64(lanes), T.int64(k // lanes)
    NL, DL = T.int64(norm_lanes), T.int64(d // norm_lanes)
    HC2 = T.int64(2 * hc)
    TT = T.int64(token_tile)
    rounds = iters - 1

    def hval(h, vb, vs, kk):  # element kk of the flattened (hc, d) stream, fp32
        return f32_of_bf16(h[vb, vs, kk // D, kk % D])

    def vector_of(xr, vb, vs, kk):
        return xr[kk]

    # one macro object per expansion (see common.stages)
    sum_of_squares, norm_sum_of_squares = lane_sum_of_squares(), lane_sum_of_squares()
    sinkhorn_first, sinkhorn_round = sinkhorn_pass(), sinkhorn_pass()

    @T.macro
    def body(h, fn, scale, base, pre_in, weight, x, pre, post, comb):
        b = h.shape[0]
        s = h.shape[1]
        # ---- the mixes' 24 dot products over hc*d, in `lanes` strided partial sums. A stage
        # of its own (not inside the per-token task) so the CPU schedule can share each fn
        # load between several tokens; the CUDA schedule moves it into the token's block.
        # Tokens come in tiles of `token_tile`; the last tile is padded (its extra rows read
        # the last token again and are never used), so no loop needs a bounds predicate.
        part = T.sblock_alloc_buffer((b, (s + TT - T.int64(1)) // TT * TT, MX, L), "float32")
        if token_tile > 1:
            for bb, so, si, j, ln, kk in T.grid(b, (s + TT - T.int64(1)) // TT, TT, MX, L, KL):
                with T.sblock("dot"):
                    vb, vo, vi, vj, vl, vk = T.axis.remap("SSSSSR", [bb, so, si, j, ln, kk])
                    with T.init():
                        part[vb, vo * TT + vi, vj, vl] = T.float32(0)
                    part[vb, vo * TT + vi, vj, vl] = part[vb, vo * TT + vi, vj, vl] + hval(
                        h, vb, T.min(vo * TT + vi, s - T.int64(1)), vk * L + vl) \
                        * fn[vj, vk * L + vl]
        else:
            for bb, ss, j, ln, kk in T.grid(b, s, MX, L, KL):
                with T.sblock("dot"):
                    vb, vs, vj, vl, vk = T.axis.remap("SSSSR", [bb, ss, j, ln, kk])
                    with T.init():
                        part[vb, vs, vj, vl] = T.float32(0)
                    part[vb, vs, vj, vl] = part[vb, vs, vj, vl] + hval(h, vb, vs, vk * L + vl) \
                        * fn[vj, vk * L + vl]
        for bb, ss in T.grid(b, s):
            with T.sblock("task"):
                vb, vs = T.axis.remap("SS", [bb, ss])
                sqp = T.sblock_alloc_buffer((L,), "float32")  # sum of squares partials
                ssq = T.sblock_alloc_buffer((1,), "float32")
                msum = T.sblock_alloc_buffer((MX,), "float32")
                z = T.sblock_alloc_buffer((MX,), "float32")  # scaled logits
                rmax = T.sblock_alloc_buffer((HC,), "float32")
                cb = T.sblock_alloc_buffer((HC, HC), "float32")  # Sinkhorn state
                rs0 = T.sblock_alloc_buffer((HC,), "float32")  # row sums (softmax)
                cs0 = T.sblock_alloc_buffer((HC,), "float32")  # column sums (first round)
                rs = T.sblock_alloc_buffer((HC,), "float32")  # row sums (later rounds)
                cs = T.sblock_alloc_buffer((HC,), "float32")  # column sums (later rounds)
                xr = T.sblock_alloc_buffer((D,), "float32")  # bf16-rounded hc_pre (norm)
                xsp = T.sblock_alloc_buffer((NL,), "float32")
                xss = T.sblock_alloc_buffer((1,), "float32")
                # ---- the sum of squares over hc*d, the logits
                sum_of_squares(sqp, ssq, L, KL, hval, h, vb, vs, ("sq", "ssq"))
                for j, ln in T.grid(MX, L):
                    with T.sblock("msum"):
                        vj, vl = T.axis.remap("SR", [j, ln])
                        with T.init():
                            msum[vj] = T.float32(0)
                        msum[vj] = msum[vj] + part[vb, vs, vj, vl]
                for j in range(MX):
                    with T.sblock("z"):
                        vj = T.axis.remap("S", [j])
                        z[vj] = msum[vj] * T.rsqrt(ssq[0] / T.float32(k) + T.float32(norm_eps)) \
                            * scale[T.min(vj // HC, T.int64(2))] + base[vj]
                for i in range(HC):
                    with T.sblock("pre"):
                        vi = T.axis.remap("S", [i])
                        pre[vb, vs, vi] = _sigmoid(z[vi]) + T.float32(hc_eps)
                for i in range(HC):
                    with T.sblock("post"):
                        vi = T.axis.remap("S", [i])
                        post[vb, vs, vi] = T.float32(2) * _sigmoid(z[HC + vi])
                # ---- comb: row softmax + eps, column normalisation, then `rounds` rounds
                for i, j in T.grid(HC, HC):
                    with T.sblock("rmax"):
                        vi, vj = T.axis.remap("SR", [i, j])
                        with T.init():
                            rmax[vi] = T.float32(-3.4028234663852886e38)
                        rmax[vi] = T.max(rmax[vi], z[HC2 + vi * HC + vj])
                for i, j in T.grid(HC, HC):
                    with T.sblock("cexp"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        cb[vi, vj] = T.exp(z[HC2 + vi * HC + vj] - rmax[vi])
                sinkhorn_first(cb, rs0, cs0, HC, hc_eps, True, "0")
                for _it in range(rounds):
                    sinkhorn_round(cb, rs, cs, HC, hc_eps, False, "")
                for i, j in T.grid(HC, HC):
                    with T.sblock("comb"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        comb[vb, vs, vi, vj] = cb[vi, vj]
                # ---- the collapse with the lagged pre (and the sublayer's norm)
                if with_norm:
                    for c in range(D):
                        with T.sblock("xr"):
                            vc = T.axis.remap("S", [c])
                            xr[vc] = round_bf16(_collapse(h, pre_in, vb, vs, vc, (), hc))
                    norm_sum_of_squares(xsp, xss, NL, DL, vector_of, xr, vb, vs, ("xsq", "xss"))
                    for c in range(D):
                        with T.sblock("x"):
                            vc = T.axis.remap("S", [c])
                            x[vb, vs, vc] = T.Cast("bfloat16", f32_of_bf16(weight[vc]) * (
                                xr[vc] * T.rsqrt(xss[0] / T.float32(d) + T.float32(norm_eps))))
                else:
                    for c in range(D):
                        with T.sblock("x"):
                            vc = T.axis.remap("S", [c])
                            x[vb, vs, vc] = T.Cast("bfloat16",
                                                   _collapse(h, pre_in, vb, vs, vc, (), hc))

    if with_post:
        post_of = post_stage(hc, d)

        @T.prim_func(s_tir=True)
        def hc_post_pre_mix(f_h: T.handle, h_h: T.handle, post_in_h: T.handle,
                            comb_in_h: T.handle, fn: T.Buffer((MX, K), "float32"),
                            scale: T.Buffer((T.int64(3),), "float32"),
                            base: T.Buffer((MX,), "float32"), pin_h: T.handle,
                            weight: T.Buffer((D,), "bfloat16"), hn_h: T.handle, x_h: T.handle,
                            pre_h: T.handle, post_h: T.handle, comb_h: T.handle):
            T.func_attr({"global_symbol": "hc_post_pre_mix", "tirx.noalias": True})
            b, s = T.int64(), T.int64()
            f = T.match_buffer(f_h, (b, s, D), "bfloat16")
            h = T.match_buffer(h_h, (b, s, HC, D), "bfloat16")
            post_in = T.match_buffer(post_in_h, (b, s, HC), "float32")
            comb_in = T.match_buffer(comb_in_h, (b, s, HC, HC), "float32")
            pre_in = T.match_buffer(pin_h, (b, s, HC), "float32")
            hn = T.match_buffer(hn_h, (b, s, HC, D), "bfloat16")
            x = T.match_buffer(x_h, (b, s, D), "bfloat16")
            pre = T.match_buffer(pre_h, (b, s, HC), "float32")
            post = T.match_buffer(post_h, (b, s, HC), "float32")
            comb = T.match_buffer(comb_h, (b, s, HC, HC), "float32")
            post_of(f, h, post_in, comb_in, hn, b, s)
            body(hn, fn, scale, base, pre_in, weight, x, pre, post, comb)

        return hc_post_pre_mix

    if with_norm:
        @T.prim_func(s_tir=True)
        def hc_pre_mix_norm(h_h: T.handle, fn: T.Buffer((MX, K), "float32"),
                            scale: T.Buffer((T.int64(3),), "float32"),
                            base: T.Buffer((MX,), "float32"), pin_h: T.handle,
                            weight: T.Buffer((D,), "bfloat16"), x_h: T.handle, pre_h: T.handle,
                            post_h: T.handle, comb_h: T.handle):
            T.func_attr({"global_symbol": "hc_pre_mix", "tirx.noalias": True})
            b, s = T.int64(), T.int64()
            h = T.match_buffer(h_h, (b, s, HC, D), "bfloat16")
            pre_in = T.match_buffer(pin_h, (b, s, HC), "float32")
            x = T.match_buffer(x_h, (b, s, D), "bfloat16")
            pre = T.match_buffer(pre_h, (b, s, HC), "float32")
            post = T.match_buffer(post_h, (b, s, HC), "float32")
            comb = T.match_buffer(comb_h, (b, s, HC, HC), "float32")
            body(h, fn, scale, base, pre_in, weight, x, pre, post, comb)

        return hc_pre_mix_norm

    @T.prim_func(s_tir=True)
    def hc_pre_mix(h_h: T.handle, fn: T.Buffer((MX, K), "float32"),
                   scale: T.Buffer((T.int64(3),), "float32"), base: T.Buffer((MX,), "float32"),
                   pin_h: T.handle, x_h: T.handle, pre_h: T.handle, post_h: T.handle,
                   comb_h: T.handle):
        T.func_attr({"global_symbol": "hc_pre_mix", "tirx.noalias": True})
        b, s = T.int64(), T.int64()
        h = T.match_buffer(h_h, (b, s, HC, D), "bfloat16")
        pre_in = T.match_buffer(pin_h, (b, s, HC), "float32")
        x = T.match_buffer(x_h, (b, s, D), "bfloat16")
        pre = T.match_buffer(pre_h, (b, s, HC), "float32")
        post = T.match_buffer(post_h, (b, s, HC), "float32")
        comb = T.match_buffer(comb_h, (b, s, HC, HC), "float32")
        body(h, fn, scale, base, pre_in, None, x, pre, post, comb)

    return hc_pre_mix


def make_hc_post(*, hc: int, d: int) -> tvm.tirx.PrimFunc:
    """`hc_post(f, h, post, comb) -> out`: f bf16 (b, s, d), h bf16 (b, s, hc, d), post fp32
    (b, s, hc), comb fp32 (b, s, hc, hc) -> out bf16 (b, s, hc, d). Block: `out`."""
    if hc <= 0 or d <= 0:
        raise ValueError(f"hc_post needs hc > 0 and d > 0, got hc={hc}, d={d}.")
    HC, D = T.int64(hc), T.int64(d)
    stage = post_stage(hc, d)

    @T.prim_func(s_tir=True)
    def hc_post(f_h: T.handle, h_h: T.handle, post_h: T.handle, comb_h: T.handle,
                o_h: T.handle):
        T.func_attr({"global_symbol": "hc_post", "tirx.noalias": True})
        b, s = T.int64(), T.int64()
        f = T.match_buffer(f_h, (b, s, D), "bfloat16")
        h = T.match_buffer(h_h, (b, s, HC, D), "bfloat16")
        post = T.match_buffer(post_h, (b, s, HC), "float32")
        comb = T.match_buffer(comb_h, (b, s, HC, HC), "float32")
        out = T.match_buffer(o_h, (b, s, HC, D), "bfloat16")
        stage(f, h, post, comb, out, b, s)

    return hc_post


# ---- config and schedules -------------------------------------------------------------------


@dataclass(frozen=True)
class MhcConfig:
    """lanes: strided partial sums of the mixes' dot products (part of the definition).

    CPU: 16 lanes (one fp32 vector). The dot stage runs over tiles of `token_tile` tokens x
    `mix_tile` mix rows, whose token_tile * mix_tile partial-sum vectors stay in registers
    while the k loop streams h and fn: each fn vector is loaded once per tile of tokens (the
    24 x hc*d fp32 fn is 384 KB at dim 1024, so per-token streaming is bound by L2). The
    per-token stages run tokens in parallel, `vec` wide over d.
    CUDA: 32 lanes, one thread block of `threads` per token for hc_pre_mix (the dot stage
    moved into it); hc_post a thread block per token."""

    lanes: int = 16
    norm_lanes: int = 32
    vec: int = 16
    threads: int = 1
    token_tile: int = 4
    mix_tile: int = 6


def mhc_config(target: TargetSpec, *, hc: int, d: int, **_dims) -> MhcConfig:
    def fit(want: int, n: int) -> int:
        while n % want:
            want //= 2
        return want

    mix = (2 + hc) * hc
    if target.is_cuda:
        return MhcConfig(lanes=fit(32, hc * d), norm_lanes=fit(32, d), vec=1, threads=256,
                         token_tile=1, mix_tile=1)
    mix_tile = max(t for t in range(1, 7) if mix % t == 0)  # 6 for hc = 4 (24 rows)
    return MhcConfig(lanes=fit(16, hc * d), norm_lanes=fit(32, d), vec=16, token_tile=4,
                     mix_tile=mix_tile)


def _blocks(sch: s_tir.Schedule) -> dict[str, list]:
    """The blocks inside `task`, by name (a name can repeat: none does here)."""
    out: dict[str, list] = {}
    pending = sch.get_child_blocks(sch.get_sblock("task"))
    while pending:
        blk, pending = pending[0], pending[1:]
        out.setdefault(sch.get(blk).name_hint, []).append(blk)
        pending = sch.get_child_blocks(blk) + pending
    return out


def _inner(sch: s_tir.Schedule, blk) -> list:
    """The block's loops below the task block (not the token loops nor the Sinkhorn round
    loop)."""
    return [lp for lp in sch.get_loops(blk)
            if sch.get(lp).loop_var.name not in ("bb", "ss", "_it")
            and not sch.get(lp).thread_binding]


def _vectorize_tail(sch: s_tir.Schedule, loop, vec: int) -> None:
    extent = int(sch.get(loop).extent)
    if extent <= vec:
        sch.vectorize(loop)
    elif extent % vec == 0:
        sch.vectorize(sch.split(loop, [None, vec])[1])


def schedule_hc_pre_mix(func: tvm.tirx.PrimFunc, config: MhcConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """`make_hc_pre_mix`'s function; with_post's too (its `out` block as `schedule_hc_post`'s)."""
    # In-place Sinkhorn updates across the round loop are not "compact dataflow"; the loops
    # transformed here are independent by construction and the tests compare with the oracle.
    sch = s_tir.Schedule(func, enable_check=False)
    if any(sch.get(b).name_hint == "out" for b in sch.get_child_blocks(sch.get_sblock("root"))):
        _schedule_post(sch, config, target)
    _schedule_pre_mix(sch, config, target)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_pre_mix(sch: s_tir.Schedule, config: MhcConfig, target: TargetSpec) -> None:
    dot = sch.get_sblock("dot")
    dot_loops = sch.get_loops(dot)  # (b, s, mix, lane, k) or (b, tiles, tile, mix, lane, k)
    tile = int(sch.get(dot_loops[2]).extent) if len(dot_loops) == 6 else 1
    built = (int(sch.get(dot_loops[-2]).extent), tile)
    if built != (config.lanes, config.token_tile):
        raise ValueError(f"The kernel was built with lanes, token_tile = {built} but the config "
                         f"asks for {config.lanes}, {config.token_tile}; build it with "
                         "make_hc_pre_mix(..., lanes=config.lanes, "
                         "token_tile=config.token_tile).")
    task = sch.get_sblock("task")
    bb, ss = sch.get_loops(task)
    if target.is_cuda:
        sch.compute_at(dot, ss)  # the token's partial sums, in its own thread block
        blocks = _blocks(sch)
        blocks["dot"] = [dot]
        sch.bind(bb, "blockIdx.y")
        sch.bind(ss, "blockIdx.x")
        scratch = ("dot", "sq", "ssq", "msum", "z", "rmax", "cexp", "rsum0", "rnorm0", "csum0",
                   "cnorm0", "rsum", "rnorm", "csum", "cnorm", "xr", "xsq", "xss")
        for name in scratch:
            for blk in blocks.get(name, []):
                sch.set_scope(blk, 0, "shared")
        reduce = {"dot", "sq", "ssq", "msum", "rmax", "rsum0", "csum0", "rsum", "csum", "xsq",
                  "xss"}
        for name, blks in blocks.items():
            for blk in blks:
                loops = _inner(sch, blk)
                spatial = loops[:-1] if name in reduce else loops
                if not spatial:  # a full reduction (ssq, xss): one thread
                    spatial = [sch.add_unit_loop(loops[0])]
                _, tx = sch.split(sch.fuse(*spatial), [None, config.threads])
                sch.bind(tx, "threadIdx.x")
                if name in reduce:  # accumulate in a register, then publish (no shared
                    # read-modify-write inside the serial reduction loop)
                    sch.reverse_compute_at(sch.cache_write(blk, 0, "local"), tx)
        return
    blocks = _blocks(sch)
    sch.parallel(sch.fuse(bb, ss))
    # dot: tiles of token_tile tokens x mix_tile rows; per k step, each fn vector is used by
    # every token of the tile and each decoded h vector by every row of the tile
    if tile == 1:  # untiled definition: a unit tile loop, so both forms schedule alike
        db, ds = dot_loops[:2]
        so, si = sch.split(ds, [None, 1])
        j, ln, dk = dot_loops[2:]
    else:
        db, so, si, j, ln, dk = dot_loops
    jo, ji = sch.split(j, [None, config.mix_tile])
    sch.reorder(db, so, jo, dk, si, ji, ln)
    # the mix tiles in parallel too: a decode token is one token tile, whose 24 x hc*d fp32
    # fn (384 KB, read from memory) one core read alone (Xeon model 207, 2 threads, fn cycled
    # through 600 MB: median 37-38 -> 27-31 us a call; 512 tokens 926 -> 931 us, the same)
    sch.parallel(sch.fuse(db, so, jo))
    sch.vectorize(ln)
    sch.unroll(ji)
    sch.unroll(si)
    (sq,) = blocks["sq"]
    ln, kk = _inner(sch, sq)
    sch.reorder(kk, ln)
    sch.vectorize(ln)
    for name in ("x", "xr"):
        for blk in blocks.get(name, []):
            _vectorize_tail(sch, _inner(sch, blk)[-1], config.vec)
    # (the Sinkhorn's 4 x 4 steps stay scalar: vectorising them measured no faster)
    for blk in blocks.get("xsq", []):
        ln, kk = _inner(sch, blk)
        sch.reorder(kk, ln)
        sch.vectorize(ln)
    sch.decompose_reduction(dot, dk)  # last: init before the k loop
    for name in ("sq", "xsq"):
        for blk in blocks.get(name, []):
            sch.decompose_reduction(blk, _inner(sch, blk)[0])


def schedule_hc_post(func: tvm.tirx.PrimFunc, config: MhcConfig,
                     target: TargetSpec) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    _schedule_post(sch, config, target)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_post(sch: s_tir.Schedule, config: MhcConfig, target: TargetSpec) -> None:
    blk = sch.get_sblock("out")
    bb, ss, j, c = sch.get_loops(blk)
    if target.is_cuda:  # a thread block per token; only static extents are divided
        sch.bind(bb, "blockIdx.y")
        sch.bind(ss, "blockIdx.x")
        _, tx = sch.split(sch.fuse(j, c), [None, config.threads])
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(sch.fuse(bb, ss))
        _vectorize_tail(sch, c, config.vec)


def build_hc_pre_mix(target_name: str, *, hc: int, d: int, iters: int, norm_eps: float,
                     hc_eps: float, with_norm: bool = False,
                     with_post: bool = False) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = mhc_config(target, hc=hc, d=d)
    func = make_hc_pre_mix(hc=hc, d=d, iters=iters, norm_eps=norm_eps, hc_eps=hc_eps,
                           with_norm=with_norm, lanes=cfg.lanes, norm_lanes=cfg.norm_lanes,
                           token_tile=cfg.token_tile, with_post=with_post)
    return schedule_hc_pre_mix(func, cfg, target)


def build_hc_post(target_name: str, *, hc: int, d: int) -> tvm.tirx.PrimFunc:
    target = get_target(target_name)
    return schedule_hc_post(make_hc_post(hc=hc, d=d), mhc_config(target, hc=hc, d=d), target)


# ---- example inputs and benchmark cases -----------------------------------------------------


def example_inputs_hc_pre_mix(*, b: int, s: int, hc: int, d: int, with_norm: bool = False,
                              seed: int = 0) -> list[torch.Tensor]:
    """[h, fn, scale, base, pre_in(, weight)] as the model has them: a bf16 stream with a
    per-token scale spread, fn ~ N(0, 1/sqrt(hc*d)) (the seeded checkpoint's fan-in init),
    small scale and base, and a pre_in from the sigmoid range (positive, ~0.5)."""
    g = torch.Generator().manual_seed(seed)
    mix = (2 + hc) * hc
    h = torch.randn(b, s, hc, d, generator=g) * torch.exp(0.5 * torch.randn(b, s, 1, 1,
                                                                           generator=g))
    fn = torch.randn(mix, hc * d, generator=g) * (hc * d) ** -0.5
    scale = 0.5 + torch.rand(3, generator=g)
    base = 0.1 * torch.randn(mix, generator=g)
    pre_in = torch.sigmoid(torch.randn(b, s, hc, generator=g)) + 1e-6
    out = [h.to(torch.bfloat16), fn, scale, base, pre_in]
    if with_norm:
        out.append((1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16))
    return out


def example_inputs_hc_post(*, b: int, s: int, hc: int, d: int, seed: int = 0
                           ) -> list[torch.Tensor]:
    """[f, h, post, comb]: post in (0, 2), comb doubly stochastic-ish (from hc_mixes itself)."""

    h, fn, scale, base, _ = example_inputs_hc_pre_mix(b=b, s=s, hc=hc, d=d, seed=seed)
    _, post, comb = hc_mixes(h, fn, scale, base, hc, 20, 1e-20, 1e-6)
    g = torch.Generator().manual_seed(seed + 1)
    f = torch.randn(b, s, d, generator=g).to(torch.bfloat16)
    return [f, h, post, comb]


def hc_pre_mix_oracle(h, fn, scale, base, pre_in, weight, hc, iters, norm_eps, hc_eps):
    """The graph's functions as `block` composes them: (x, pre, post, comb)."""

    pre, post, comb = hc_mixes(h, fn, scale, base, hc, iters, norm_eps, hc_eps)
    x = hc_pre(h, pre_in)
    if weight is not None:
        x = rms_norm(x, weight, norm_eps)
    return x, pre, post, comb


def _post_oracle(f, h, post, comb):

    return hc_post(f, h, post, comb)


def bench_cases(preset_name: str = "bench", tokens: tuple[int, ...] = (1, 128, 2048)
                ) -> list[BenchCase]:
    """hc_pre_mix (with the norm, as `block` uses it) and hc_post at the preset's dim and
    hc_mult, b = 1 and s tokens. bytes: h once (2*s*hc*d) + fn (4*mix*hc*d) + x out (2*s*d) for
    pre_mix; f + h in, h' out (2*s*d*(1 + 2*hc)) for post. flops: 2*mix*hc*d per token (the
    dots) for pre_mix, 4*hc*hc*d per token for post (the other terms are negligible)."""

    a = preset(preset_name)
    hc, d = a.hc_mult, a.dim
    mix = (2 + hc) * hc
    dims = dict(hc=hc, d=d, iters=a.hc_sinkhorn_iters, norm_eps=a.norm_eps, hc_eps=a.hc_eps)
    cases = []
    for n in tokens:
        def prep_mix(n=n):
            ins = example_inputs_hc_pre_mix(b=1, s=n, hc=hc, d=d, with_norm=True, seed=n)
            outs = (torch.empty(1, n, d, dtype=torch.bfloat16), torch.empty(1, n, hc),
                    torch.empty(1, n, hc), torch.empty(1, n, hc, hc))
            return BenchData(tuple(ins), outs, hc_pre_mix_oracle,
                             (*ins, hc, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps),
                             lambda r: r[0])

        def prep_post(n=n):
            ins = example_inputs_hc_post(b=1, s=n, hc=hc, d=d, seed=n)
            return BenchData(tuple(ins), (torch.empty_like(ins[1]),), _post_oracle, tuple(ins),
                             lambda r: r)

        cases.append(BenchCase(
            name=f"hc_pre_mix-s{n}", family="mhc", static=(*dims.items(), ("with_norm", True)),
            build=lambda t: build_hc_pre_mix(t, **dims, with_norm=True), prepare=prep_mix,
            bytes=2 * n * hc * d + 4 * mix * hc * d + 2 * n * d, flops=2 * n * mix * hc * d,
            note="bytes = 2*s*hc*d + 4*mix*hc*d + 2*s*d"))
        cases.append(BenchCase(
            name=f"hc_post-s{n}", family="mhc", static=(("hc", hc), ("d", d)),
            build=lambda t: build_hc_post(t, hc=hc, d=d), prepare=prep_post,
            bytes=2 * n * d * (1 + 2 * hc), flops=4 * n * hc * hc * d,
            note="bytes = 2*s*d*(1 + 2*hc)"))
    return cases
