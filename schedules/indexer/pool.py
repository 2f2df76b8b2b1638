"""The pool sweep (scores of a hier_topk candidate pool only) and its AVX-512 chain: gather the
pool's keys, sweep them with the full sweep, mask what is not visible."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec
from dsv41.schedules.indexer.configs import sweep_config
from dsv41.schedules.indexer.sweep import (
    SCORE_PAD,
    check_dim,
    chunk_sum,
    decode_key,
    head_chunks,
    head_term,
    neg_inf_bf16,
    pad_expr,
)


def _pool_block(BL, vb, vs, vj, nb, bs):
    """Block id of pool entry j of query (vb, vs) (-1 past the pool's nb blocks)."""
    return T.Select(vj < nb * bs, BL[vb, vs, T.min(vj // bs, nb - T.int64(1))], -1)


def _pool_position(BL, vb, vs, vj, nb, bs):
    """Key position of pool entry j: its block times bs plus j's offset in the block."""
    return T.Cast("int64", _pool_block(BL, vb, vs, vj, nb, bs)) * bs + vj % bs


def _pool_row(BL, vb, vs, vj, nb, bs, t):
    """The key row entry j reads: its position clamped into the store of t rows (an invalid
    entry reads a valid row and is masked by `_pool_visible`)."""
    return T.max(T.min(_pool_position(BL, vb, vs, vj, nb, bs), t - T.int64(1)), T.int64(0))


def _pool_visible(BL, L, vb, vs, vj, nb, bs, t):
    """Entry j is scored: its block is not -1 and its position is visible (below lens and t)."""
    return (_pool_block(BL, vb, vs, vj, nb, bs) >= 0) \
        & (_pool_position(BL, vb, vs, vj, nb, bs) < T.min(L[vb, vs], t))


def make_pool_scores(*, heads: int, dim: int, block_size: int) -> tvm.tirx.PrimFunc:
    """Pool sweep: (q, k_packed, k_scales, weights, lens, blocks) -> scores bf16
    [b, s, pad(B * block_size)]; entry j is position blocks[j // bs] * bs + j % bs, -inf where
    the block is -1 or the position is not visible. Only the pool is decoded and scored."""
    check_dim(dim)
    che, nc = head_chunks(heads)
    H, D, C, NC = T.int64(heads), T.int64(dim), T.int64(che), T.int64(nc)
    BS = T.int64(block_size)

    @T.prim_func(s_tir=True)
    def pool_scores(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, w_h: T.handle,
                    lens_h: T.handle, blocks_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "pool_scores", "tirx.noalias": True})
        b, s, t, nb = T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        BL = T.match_buffer(blocks_h, (b, s, nb), "int32")
        O = T.match_buffer(out_h, (b, s, pad_expr(nb * BS)), "bfloat16")
        qf = T.sblock_alloc_buffer((b, s, H, D), "float32")
        kd = T.sblock_alloc_buffer((b, s, pad_expr(nb * BS), D), "float32")
        dot = T.sblock_alloc_buffer((b, s, H, pad_expr(nb * BS)), "float32")
        part = T.sblock_alloc_buffer((b, s, NC, pad_expr(nb * BS)), "float32")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("q_f32"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                qf[vb, vs, vh, vd] = T.Cast("float32", Q[vb, vs, vh, vd])
        for i0, i1, i2, i3 in T.grid(b, s, pad_expr(nb * BS), D):
            with T.sblock("k_dec"):  # invalid entries decode a clamped position (masked later)
                vb, vs, vj, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                kd[vb, vs, vj, vd] = decode_key(
                    KP, KS, vb, _pool_row(BL, vb, vs, vj, nb, BS, t),
                    vd)
        for i0, i1, i2, i3, i4 in T.grid(b, s, H, pad_expr(nb * BS), D):
            with T.sblock("dot"):
                vb, vs, vh, vj, vd = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    dot[vb, vs, vh, vj] = T.float32(0)
                dot[vb, vs, vh, vj] = (dot[vb, vs, vh, vj]
                                       + qf[vb, vs, vh, vd] * kd[vb, vs, vj, vd])
        for i0, i1, i2, i3, i4 in T.grid(b, s, NC, pad_expr(nb * BS), C):
            with T.sblock("chunk"):
                vb, vs, vc, vj, vk = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    part[vb, vs, vc, vj] = T.float32(0)
                part[vb, vs, vc, vj] = part[vb, vs, vc, vj] + head_term(dot, W, vb, vs, vc * C + vk,
                                                                    vj)
        for i0, i1, i2 in T.grid(b, s, pad_expr(nb * BS)):
            with T.sblock("score"):
                vb, vs, vj = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vj] = T.Select(
                    _pool_visible(BL, L, vb, vs, vj, nb, BS, t),
                    T.Cast("bfloat16", chunk_sum(part, vb, vs, vj, nc)),
                    neg_inf_bf16())

    return pool_scores


# ---- the pool sweep as a gather + the AVX-512 full sweep + a mask (CPU with AVX-512) -----------
#
# The pool's B * block_size positions are gathered into a contiguous key store per query (1.1 MB
# at the released pool of 2048 x 8 and dim 128), the hand-vectorised full sweep scores it
# (each (b, s) query a batch row of its own, every gathered entry visible), and a mask puts -inf
# where the block is -1 or the position is not visible. Each score depends only on q, the key
# and the weights, and both sweeps are bit-identical to `ops.index_scores`, so the result is the
# bits of `make_pool_scores`; the scheduled pool sweep decoded keys into fp32 per tile and ran
# the dot in fp32 (11.5 ms per call on the bench preset, 2 cores) where the full sweep's int8
# dot runs at ~1M entries per 30 ms.


def pool_gathers(target: TargetSpec, *, heads: int, dim: int) -> bool:
    """Whether pool_scores lowers to the gather chain on `target` (`emit_pool_scores`)."""
    return sweep_config(target, heads=heads, dim=dim).avx512


def make_pool_gather(*, heads: int, dim: int, block_size: int) -> tvm.tirx.PrimFunc:
    """(q, k_packed, k_scales, weights, lens, blocks) -> qg [b*s, 1, H, D], kg [b*s, P, D/2],
    sg [b*s, P, D/32], wg [b*s, 1, H], lg [b*s, 1] (= P: every entry visible to the sweep),
    valid int8 [b, s, P]; P = pad128(B * block_size). Entry j of query (b, s) is key row
    blocks[b, s, j // bs] * bs + j % bs (clamped into the store; invalid entries are masked by
    `valid`: block -1, past the pool, or not visible)."""
    check_dim(dim)
    H, D, BS = T.int64(heads), T.int64(dim), T.int64(block_size)

    @T.prim_func(s_tir=True)
    def pool_gather(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, w_h: T.handle,
                    lens_h: T.handle, blocks_h: T.handle, qg_h: T.handle, kg_h: T.handle,
                    sg_h: T.handle, wg_h: T.handle, lg_h: T.handle, valid_h: T.handle):
        T.func_attr({"global_symbol": "pool_gather", "tirx.noalias": True})
        b, s, t, nb = T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        BL = T.match_buffer(blocks_h, (b, s, nb), "int32")
        QG = T.match_buffer(qg_h, (b * s, T.int64(1), H, D), "bfloat16")
        KG = T.match_buffer(kg_h, (b * s, pad_expr(nb * BS), D // 2), "uint8")
        SG = T.match_buffer(sg_h, (b * s, pad_expr(nb * BS), D // 32), "uint8")
        WG = T.match_buffer(wg_h, (b * s, T.int64(1), H), "bfloat16")
        LG = T.match_buffer(lg_h, (b * s, T.int64(1)), "int64")
        V = T.match_buffer(valid_h, (b, s, pad_expr(nb * BS)), "int8")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("qg"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                QG[vb * s + vs, T.int64(0), vh, vd] = Q[vb, vs, vh, vd]
        for i0, i1, i2 in T.grid(b, s, H):
            with T.sblock("wg"):
                vb, vs, vh = T.axis.remap("SSS", [i0, i1, i2])
                WG[vb * s + vs, T.int64(0), vh] = W[vb, vs, vh]
        for i0, i1 in T.grid(b, s):
            with T.sblock("lg"):
                vb, vs = T.axis.remap("SS", [i0, i1])
                LG[vb * s + vs, T.int64(0)] = pad_expr(nb * BS)
        for i0, i1, i2, i3 in T.grid(b, s, pad_expr(nb * BS), D // 2):
            with T.sblock("kg"):
                vb, vs, vj, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                KG[vb * s + vs, vj, vd] = KP[
                    vb, _pool_row(BL, vb, vs, vj, nb, BS, t), vd]
        for i0, i1, i2, i3 in T.grid(b, s, pad_expr(nb * BS), D // 32):
            with T.sblock("sg"):
                vb, vs, vj, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                SG[vb * s + vs, vj, vd] = KS[
                    vb, _pool_row(BL, vb, vs, vj, nb, BS, t), vd]
        for i0, i1, i2 in T.grid(b, s, pad_expr(nb * BS)):
            with T.sblock("valid"):
                vb, vs, vj = T.axis.remap("SSS", [i0, i1, i2])
                V[vb, vs, vj] = T.Cast("int8", _pool_visible(BL, L, vb, vs, vj, nb, BS, t))

    return pool_gather


def make_pool_mask() -> tvm.tirx.PrimFunc:
    """(raw bf16 [b*s, 1, P] from the full sweep over the gathered store, valid int8 [b, s, P])
    -> scores bf16 [b, s, P]: raw where valid, -inf elsewhere (`make_pool_scores`'s result)."""

    @T.prim_func(s_tir=True)
    def pool_mask(raw_h: T.handle, valid_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "pool_mask", "tirx.noalias": True})
        b, s, p = T.int64(), T.int64(), T.int64()
        R = T.match_buffer(raw_h, (b * s, T.int64(1), p), "bfloat16")
        V = T.match_buffer(valid_h, (b, s, p), "int8")
        O = T.match_buffer(out_h, (b, s, p), "bfloat16")
        for i0, i1, i2 in T.grid(b, s, p):
            with T.sblock("mask"):
                vb, vs, vj = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vj] = T.Select(V[vb, vs, vj] != T.int8(0),
                                         R[vb * s + vs, T.int64(0), vj], neg_inf_bf16())

    return pool_mask


def schedule_pool_gather(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """CPU: the key rows copied in parallel over (query, entry), bytes vectorised; the rest is
    tiny (q, weights, one length per query) or one vector pass (valid)."""
    sch = s_tir.Schedule(func, enable_check=False)
    for name in ("kg", "valid"):
        loops = sch.get_loops(sch.get_sblock(name))
        sch.parallel(sch.fuse(*loops[:2]))
    sch.vectorize(sch.get_loops(sch.get_sblock("kg"))[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_pool_mask(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    i0, i1, i2 = sch.get_loops(sch.get_sblock("mask"))
    sch.parallel(sch.fuse(i0, i1))
    sch.vectorize(sch.split(i2, [None, 64])[1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def emit_pool_scores(bb, mod: tvm.IRModule, kernel, args: list, *, block_size: int):
    """Emit pool_scores(q, k_packed, k_scales, weights, lens, blocks) into a Relax BlockBuilder:
    one call of the scheduled sweep `pool_scores`, or (on the targets `pool_gathers` names) the
    chain `pool_gather` -> `index_scores` -> `pool_mask`, as `mod` (`build_pool_topk`) holds
    them; `kernel(name)` returns the GlobalVar of its PrimFunc `name`. Returns the bf16 scores
    [b, s, pad128(B * block_size)] expression. The lowering of `dsv41::pool_topk`'s sweep is
    this function, and the kernel tests run it."""

    q, kp, ks, w, lens, blocks = args
    b, s, heads, dim = q.ty.shape.values
    nb = blocks.ty.shape.values[-1]
    p = (nb * block_size + SCORE_PAD - 1) // SCORE_PAD * SCORE_PAD

    def ty(shape, dtype):
        return relax.TensorType(shape, dtype)

    if not any(gv.name_hint == "pool_gather" for gv in mod.get_global_vars()):
        return bb.emit(relax.call_tir(kernel("pool_scores"), args, ty([b, s, p], "bfloat16")))
    outs = bb.emit(relax.call_tir(kernel("pool_gather"), args, [
        ty([b * s, 1, heads, dim], "bfloat16"), ty([b * s, p, dim // 2], "uint8"),
        ty([b * s, p, dim // 32], "uint8"), ty([b * s, 1, heads], "bfloat16"),
        ty([b * s, 1], "int64"), ty([b, s, p], "int8")]))
    qg, kg, sg, wg, lg, valid = (bb.emit(relax.TupleGetItem(outs, i)) for i in range(6))
    raw = bb.emit(relax.call_tir(kernel("index_scores"), [qg, kg, sg, wg, lg],
                                 ty([b * s, 1, p], "bfloat16")))
    return bb.emit(relax.call_tir(kernel("pool_mask"), [raw, valid], ty([b, s, p], "bfloat16")))
