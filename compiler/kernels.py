"""The kernel registry: for every kernel kind the lowering emits, where it is chosen, built,
tuned and benchmarked, in one table (`REGISTRY`).

An entry is one op family of `schedules/`: the typed keys of the kernels it adds
(`kernel_keys`), its factory (the `build_*` that makes, configures and schedules it), the config
chooser and schedule function the factory applies, the lowering converter of each torch op that
emits it, how a tuning task gets the unscheduled function behind a key (`task`), and which
`dsv41 bench kernels` family times it (`bench`, with the static dims -> kernel build).

`compiler.lower` takes the custom ops' converters from here (`converters`), `compiler.tune`
makes its kernel tasks from here (`unscheduled`, `kernel_task`), and `bench kernels` compiles
its cases from here (`bench_kernel`). The converters below map each `dsv41::` op to its kernel
through `call_tir` (leading dims flattened to the kernel's row dim, then restored); each kernel
is built once per key and shared by every call site (`Lowering.kernel`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import tvm
import tvm_ffi
from tvm import relax

from dsv41.compiler import fused_ops
from dsv41.compiler.kernel_keys import (
    BF16,
    DenseGemmKey,
    DenseGemvKey,
    Fp8DequantKey,
    Fp8LinearKey,
    Fp8QkvKey,
    HcPostKey,
    HcPostPreMixKey,
    HcPreMixKey,
    IndexScoresKey,
    IndexScoresSharedKey,
    KernelKey,
    MoeKey,
    PoolKey,
    QuantKey,
    RmsNormKey,
    RopeKey,
    RopeQuantKey,
    RouteTopkKey,
    ScatterRowsKey,
    SelectBlocksKey,
    SelectPositionsKey,
    SparseAttendKey,
)
from dsv41.compiler.relax_ops import (
    Lowering,
    call,
    cast_to,
    in_fp32,
    rows,
    shape,
    static,
    tensor,
    unrows,
    widened_source,
)
from dsv41.graph.checkpoint.spec import FP8_TILE
from dsv41.graph.ops import ENGRAM_ROWS_FUNC, ENTRY_GROUP, EntryFormat, entry_code_width
from dsv41.graph.targets import TargetSpec
from dsv41.schedules import (
    attention,
    cache_write,
    gemm,
    indexer,
    mhc,
    moe,
    norm,
    quant,
    rope,
    rope_quant,
    router,
)
from dsv41.schedules.tuning_space import Task, as_module_kernel, signature

Converter = Callable[[Lowering], Callable]  # the per-module converter of one torch op


# ---- the custom ops' converters -----------------------------------------------------------------


def _fp8_linear(ctx: Lowering, out_dtype: str = BF16):
    """fp8_linear (bf16 out) or fp8_linear_f32 (fp32: a row-parallel partial sum)."""

    def convert(node, importer):
        x, w, s = (importer.env[a] for a in node.args[:3])
        n, k = (static(v) for v in shape(w))
        key = Fp8LinearKey(n=n, k=k, m=ctx.rows_hint, out_dtype=out_dtype,
                           rows=ctx.verify_rows)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        x2, lead = rows(importer, x, 1)
        y = call(importer, gv, [x2, w, s], tensor([shape(x2)[0], n], out_dtype))
        return unrows(importer, y, lead)

    return convert


def _collective(ctx: Lowering, op: str):
    """dsv41::all_reduce / all_gather -> a destination-passing call of the sharded entry's
    collective (`ctx.ccl`): disco's own functions, which run the session's NCCL, or the CPU
    test collective. Both take disco's arguments (a sum; not within a group). No kernel."""

    def convert(node, importer):
        x = importer.env[node.args[0]]
        shards = int(node.args[1])
        not_in_group = relax.prim_value(tvm.tirx.IntImm("bool", 0))
        if op == "allreduce":
            args, out = [x, relax.ShapeExpr([0]), not_in_group], x.ty
        else:
            dims = shape(x)
            args, out = [x, not_in_group], tensor([dims[0] * shards, *dims[1:]], x.ty.dtype)
        return importer.block_builder.emit(
            relax.call_dps_packed(ctx.ccl.function(op), args, out_ty=out))

    return convert


def _engram_rows(ctx: Lowering):
    """dsv41::engram_rows -> a call of the host runtime's `ENGRAM_ROWS_FUNC` with the hash ids,
    the slot and the two tables, which stay in host memory (`runtime.engram_host` gathers the
    rows ahead, on its own thread, and hands them over on the entry's device). No kernel. A
    sharded worker's entry (`ctx.host_engram` False) gathers them itself with `take`."""

    def convert(node, importer):
        bb = importer.block_builder
        ids, table, scale = (importer.env[a] for a in (node.args[0], node.args[2], node.args[3]))
        slot = int(node.args[1])
        b, s, _, cols = shape(ids)
        out = [tensor([b, s, cols, shape(t)[1]], t.ty.dtype) for t in (table, scale)]
        if ctx.host_engram:
            pair = bb.emit(relax.op.call_pure_packed(
                ENGRAM_ROWS_FUNC, ids, relax.prim_value(slot), table, scale,
                ty_args=relax.TupleType(out)))
            return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(pair, i)) for i in (0, 1)]))
        own = bb.emit(relax.op.squeeze(relax.op.strided_slice(ids, axes=[2], begin=[slot],
                                                               end=[slot + 1]), axis=[2]))
        return bb.emit(relax.Tuple([bb.emit(relax.op.take(t, own, axis=0))
                                    for t in (table, scale)]))

    return convert


def _fp8_dequant(ctx: Lowering):
    def convert(node, importer):
        codes, scales = (importer.env[a] for a in node.args[:2])
        key = Fp8DequantKey(d=static(shape(codes)[-1]))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        c2, lead = rows(importer, codes, 1)
        s2, _ = rows(importer, scales, 1)
        y = call(importer, gv, [c2, s2], tensor([shape(c2)[0], key.d], "float32"))
        return unrows(importer, y, lead)

    return convert


def _sparse_attend(ctx: Lowering, kv: str):
    """sparse_attend (FP4 global entries: codes + scales) or sparse_attend_bf16 (a bf16 global
    cache, `kv_dtype="bf16"`): the same kernel body over either store."""
    n_tensors = {"fp4": 8, "bf16": 7}[kv]

    def convert(node, importer):
        args = [importer.env[a] for a in node.args[:n_tensors]]
        scale = float(node.args[n_tensors])
        q, win_idx, kv_idx = args[0], args[3], args[n_tensors - 2]
        _, _, h, d = shape(q)
        key = SparseAttendKey(h=static(h), d=static(d), w=static(shape(win_idx)[-1]),
                              k=static(shape(kv_idx)[-1]), softmax_scale=scale, kv=kv)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        return call(importer, gv, args, tensor(shape(q), BF16))

    return convert


def _indexer(ctx: Lowering, kind: str):
    def convert(node, importer):
        q, kc, ks, wts, lens = (importer.env[a] for a in node.args[:5])
        b, s, heads, dim = shape(q)
        heads, dim = static(heads), static(dim)
        t = shape(kc)[1]
        pad = indexer.SCORE_PAD
        scores_ty = tensor([b, s, (t + pad - 1) // pad * pad], BF16)
        if kind == "pool":
            blocks = importer.env[node.args[5]]
            topk, block_size = int(node.args[6]), int(node.args[7])
            mod = indexer.build_pool_topk(ctx.target.name, heads=heads, dim=dim, topk=topk,
                                          block_size=block_size, gather=ctx.bounded_rows)

            def pool(func):
                return PoolKey(heads=heads, dim=dim, topk=topk, block_size=block_size, func=func)

            keys = {"pool_scores": pool("scores"), "select_pool": pool("select"),
                    "pool_gather": pool("gather"), "pool_mask": pool("mask"),
                    "index_scores": IndexScoresKey(heads=heads, dim=dim)}  # the flat sweep's

            def kernel(name):
                return ctx.kernel(importer, keys[name], lambda: mod[name])

            scores = indexer.emit_pool_scores(importer.block_builder, mod, kernel,
                                              [q, kc, ks, wts, lens, blocks],
                                              block_size=block_size)
            return call(importer, kernel("select_pool"), [scores, blocks],
                        tensor([b, s, topk], "int32"))
        topk = int(node.args[5])
        flat = {}

        def flat_mod():
            if not flat:
                flat["mod"] = indexer.build_indexer_topk(ctx.target.name, heads=heads, dim=dim,
                                                         topk=topk)
            return flat["mod"]

        sweep = ctx.kernel(importer, IndexScoresKey(heads=heads, dim=dim),
                           lambda: flat_mod()["index_scores"])
        pick = ctx.kernel(importer, SelectPositionsKey(topk=topk),
                          lambda: flat_mod()["select_positions"])
        scores = call(importer, sweep, [q, kc, ks, wts, lens], scores_ty)
        idx = call(importer, pick, [scores], tensor([b, s, topk], "int32"))
        if kind == "flat":
            return idx
        topk_blocks, block_size = int(node.args[6]), int(node.args[7])
        blk = ctx.kernel(importer, SelectBlocksKey(topk_blocks=topk_blocks,
                                                   block_size=block_size),
                         lambda: indexer.build_hier_topk(
                             ctx.target.name, heads=heads, dim=dim, topk=topk,
                             topk_blocks=topk_blocks, block_size=block_size)["select_blocks"])
        blocks = call(importer, blk, [scores, lens], tensor([b, s, topk_blocks], "int32"))
        return importer.block_builder.emit(relax.Tuple([idx, blocks]))

    return convert


def _indexer_shared(ctx: Lowering):
    """indexer_topk_shared: the sweep takes the own store, the alternates (unused slots get the
    own store again, never read) and the pick per (sequence, token); no store is copied."""

    def convert(node, importer):
        q, kc, ks = (importer.env[a] for a in node.args[:3])
        alt_c = [importer.env[a] for a in node.args[3]]
        alt_s = [importer.env[a] for a in node.args[4]]
        pick, wts, lens = (importer.env[a] for a in node.args[5:8])
        topk = int(node.args[8])
        n_alt = len(alt_c)
        if n_alt > indexer.MAX_ALT:
            raise ValueError(f"An indexer shares its index-K pointer with {n_alt} other stores; "
                             f"the compiled sweep takes at most {indexer.MAX_ALT}.")
        b, s, heads, dim = shape(q)
        heads, dim = static(heads), static(dim)
        t = shape(kc)[1]
        pad = indexer.SCORE_PAD
        mod = {}

        def module():
            if not mod:
                mod["m"] = indexer.build_indexer_topk(ctx.target.name, heads=heads, dim=dim,
                                                      topk=topk, n_alt=n_alt)
            return mod["m"]

        sweep = ctx.kernel(importer, IndexScoresSharedKey(heads=heads, dim=dim, n_alt=n_alt),
                           lambda: module()["index_scores_shared"])
        pick_fn = ctx.kernel(importer, SelectPositionsKey(topk=topk),
                             lambda: module()["select_positions"])
        slots = []
        for i in range(indexer.MAX_ALT):
            slots += [alt_c[i], alt_s[i]] if i < n_alt else [kc, ks]
        scores = call(importer, sweep, [q, kc, ks, *slots, pick, wts, lens],
                      tensor([b, s, (t + pad - 1) // pad * pad], BF16))
        return call(importer, pick_fn, [scores], tensor([b, s, topk], "int32"))

    return convert


def _moe_experts(ctx: Lowering, plus: bool = False):
    """The routed experts as the six-kernel chain of `schedules.moe` (Relax allocates the
    token-sized intermediates between the calls, which CUDA needs), on CPU two calls
    (`moe.fused_chain`: decode's GEMVs on AVX-512, prefill's tiles on every CPU); `plus`
    (moe_experts_plus): its last kernel adds the shared expert's output and stores bf16
    (`moe_combine_plus`). In the two-call decode form (`moe.fused_decode`; prefill's leaves the
    router to its own kernel), when the weights and ids are those of a `route_topk_logits`
    that nothing else reads (`logits_route`), the first call takes the
    gate's logits and routes them itself, and where those logits are the gate's bf16 GEMV of
    the same x, read by nothing else, that the decode dense GEMV would sum as
    `gemm.bf16_dot_rows` does (`gate_weight`), it takes the gate's weight and forms them too
    (the calls it replaces are then unused: DCE)."""

    def convert(node, importer):
        args = [importer.env[a] for a in node.args[:9]]
        limit = float(node.args[9])
        if plus:
            args.append(importer.env[node.args[10]])
        x, w1 = args[0], args[3]
        n_experts, inter = (static(v) for v in shape(w1)[:2])
        dims = dict(dim=static(shape(x)[-1]), inter=inter, n_experts=n_experts,
                    topk=static(shape(args[2])[-1]))
        config = moe.moe_split_config(ctx.target, **dims, n=ctx.rows_hint, rows=ctx.verify_rows)
        route = logits_route(node) if moe.fused_decode(config) else None
        routing, gate = None, None
        if route is not None:
            logits, bias = importer.env[route.args[0]], importer.env[route.args[1]]
            routing = router.TopkRouting(
                e=n_experts, k=dims["topk"], normalize=bool(route.args[3]),
                route_scale=float(route.args[4]), bias_rows=len(shape(bias)) == 2,
                gate_temp=float(route.args[5]))
            gate = gate_weight(ctx, route, node, importer)
            args = [x, logits if gate is None else gate, bias, *args[3:]]
        mod = None

        def module():
            nonlocal mod
            if mod is None:
                mod = moe.build_moe_experts_split(ctx.target.name, **dims, swiglu_limit=limit,
                                                  n=ctx.rows_hint, null_expert=ctx.null_expert,
                                                  rows=ctx.verify_rows, routing=routing,
                                                  gate=gate is not None)
            return mod

        def kernel(func):
            key = MoeKey(**dims, swiglu_limit=limit, n_hint=ctx.rows_hint,
                         null_expert=ctx.null_expert, func=func, rows=ctx.verify_rows,
                         routing=routing, gate=gate is not None)
            return ctx.kernel(importer, key, lambda: module()[func])

        plan = moe.moe_experts_plan(ctx.target.name, **dims, n=shape(x)[0],
                                    n_hint=ctx.rows_hint, rows=ctx.verify_rows, plus=plus,
                                    routing=routing, gate=gate is not None)
        return moe.emit_moe_experts(importer.block_builder, plan, args, kernel)

    return convert


def logits_route(node):
    """The `route_topk_logits` FX node whose (weights, ids) are the MoE op `node`'s arguments 1
    and 2 and are read by nothing else, else None."""
    w, ids = node.args[1], node.args[2]
    if not all(getattr(a, "target", None) is operator.getitem for a in (w, ids)):
        return None
    route = w.args[0]
    if ids.args[0] is not route or (w.args[1], ids.args[1]) != (0, 1) \
            or route.target is not torch.ops.dsv41.route_topk_logits.default:
        return None
    if set(route.users) != {w, ids} or set(w.users) != {node} or set(ids.users) != {node}:
        return None
    return route


def selected_bias(arg, e: int) -> tuple | None:
    """(mask, bias_vl, bias) FX nodes where a router's bias `arg` is `torch.where(mask, bias_vl,
    bias)` of a [n, 1] bool mask and two fp32 [E] biases (the image-span rows' bias, which
    the router kernel then picks per row itself: `RouteTopkKey.bias_select`), else None."""
    if getattr(arg, "target", None) is not torch.ops.aten.where.self:
        return None
    mask, on, off = arg.args[:3]
    vals = [getattr(a, "meta", {}).get("val") for a in (mask, on, off)]
    if any(v is None for v in vals):
        return None
    m, b1, b0 = vals
    if m.dtype != torch.bool or m.dim() != 2 or m.shape[1] != 1:
        return None
    if any(b.dtype != torch.float32 or tuple(b.shape) != (e,) for b in (b1, b0)):
        return None
    return mask, on, off


def gate_weight(ctx: Lowering, route, node, importer) -> relax.Expr | None:
    """The gate's bf16 weight [E, dim] where the logits `route` (a `route_topk_logits` FX
    node) scores are `linear(x.float(), w.float())` of the MoE op `node`'s own x, read by
    nothing else, and this module's dense GEMV of them is the one-row bf16_dot form
    (`gemm.dense_gemv_is_bf16_dot`, whose sums the fused kernel repeats), else None."""
    lin = route.args[0]
    if getattr(lin, "target", None) is not torch.ops.aten.linear.default \
            or (len(lin.args) > 2 and lin.args[2] is not None) or set(lin.users) != {route}:
        return None
    x, w = widened_source(lin.args[0], importer), widened_source(lin.args[1], importer)
    ex, ew = shape(importer.env[node.args[0]]), shape(w)
    if not x.same_as(importer.env[node.args[0]]) or x.ty.dtype != BF16 \
            or w.ty.dtype != BF16 or len(ew) != 2 or not use_gemv(ctx):
        return None
    e, k = (static(v) for v in ew)
    if k != static(ex[-1]) or not gemm.dense_gemv_is_bf16_dot(ctx.target, n=e, k=k,
                                                             rows=ctx.verify_rows):
        return None
    return w


def _scatter_rows(ctx: Lowering):
    """A cache write, in place: the kernel writes the new rows into the store or ring the
    entry was given (`call_tir_inplace`), and the result aliases that input. The graph never
    reads a cache tensor's old value after writing it (each write replaces the tensor), which is
    what an in-place call requires."""

    def convert(node, importer):
        dst, idx, new = (importer.env[a] for a in node.args[:3])
        key = ScatterRowsKey(width=static(shape(dst)[-1]), dtype=str(dst.ty.dtype))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        return importer.block_builder.emit(
            relax.call_tir_inplace(gv, [dst, idx, new], [0], out_ty=dst.ty))

    return convert


def _rms_norm(ctx: Lowering):
    def convert(node, importer):
        x, weight = importer.env[node.args[0]], importer.env[node.args[1]]
        key = RmsNormKey(d=static(shape(x)[-1]), eps=float(node.args[2]))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        x2, lead = rows(importer, x, 1)
        y = call(importer, gv, [x2, weight], tensor(shape(x2), BF16))
        return unrows(importer, y, lead)

    return convert


def _route_topk(ctx: Lowering, logits: bool = False):
    """route_topk; `logits` (route_topk_logits): the kernel scores the gate's logits first."""

    def convert(node, importer):
        scores, bias = importer.env[node.args[0]], importer.env[node.args[1]]
        n, e = shape(scores)
        picked = selected_bias(node.args[1], static(e))
        key = RouteTopkKey(e=static(e), k=int(node.args[2]), normalize=bool(node.args[3]),
                           route_scale=float(node.args[4]),
                           bias_rows=picked is None and len(shape(bias)) == 2,
                           gate_temp=float(node.args[5]) if logits else None,
                           bias_select=picked is not None)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        out = [tensor([n, key.k], "float32"), tensor([n, key.k], "int64")]
        biases = [bias] if picked is None else [importer.env[a] for a in picked]
        res = call(importer, gv, [scores, *biases], out)
        bb = importer.block_builder
        return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(res, i)) for i in range(2)]))

    return convert


def _rope(ctx: Lowering):
    """x (b, s, d) is the kernel's (b, s, 1, d) (a reshape: a view)."""

    def convert(node, importer):
        x, cos, sin = (importer.env[a] for a in node.args[:3])
        dims = shape(x)
        key = RopeKey(h=static(dims[2]) if len(dims) == 4 else 1, d=static(dims[-1]),
                      rd=int(node.args[3]), inverse=bool(node.args[4]))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        x4 = x if len(dims) == 4 else importer.block_builder.emit(
            relax.op.reshape(x, [dims[0], dims[1], 1, dims[2]]))
        y = call(importer, gv, [x4, cos, sin], tensor(shape(x4), BF16))
        return y if len(dims) == 4 else importer.block_builder.emit(relax.op.reshape(y, dims))

    return convert


def _hc_pre_mix(ctx: Lowering):
    """A sublayer's mHC entry (mixes + lagged collapse + RMSNorm) as one kernel."""

    def convert(node, importer):
        h, fn, scale, base, pre_in, weight = (importer.env[a] for a in node.args[:6])
        hc, iters = int(node.args[6]), int(node.args[7])
        b, s, _, d = shape(h)
        key = HcPreMixKey(hc=hc, d=static(d), iters=iters, norm_eps=float(node.args[8]),
                          hc_eps=float(node.args[9]))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        f32 = "float32"
        out = [tensor([b, s, d], BF16), tensor([b, s, hc], f32), tensor([b, s, hc], f32),
               tensor([b, s, hc, hc], f32)]
        res = call(importer, gv, [h, fn, scale, base, pre_in, weight], out)
        bb = importer.block_builder
        return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(res, i)) for i in range(4)]))

    return convert


def _hc_post(ctx: Lowering):
    def convert(node, importer):
        f, h, post, comb = (importer.env[a] for a in node.args[:4])
        hc, d = (static(v) for v in shape(h)[2:])
        key = HcPostKey(hc=hc, d=d)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        return call(importer, gv, [f, h, post, comb], tensor(shape(h), BF16))

    return convert


def _quant(ctx: Lowering, op: str):
    def convert(node, importer):
        x = importer.env[node.args[0]]
        key = QuantKey(op=op, d=static(shape(x)[-1]))
        d = key.d
        x2, lead = rows(importer, x, 1)
        n = shape(x2)[0]
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        if op == "qdq_mxfp4":
            y = call(importer, gv, [x2], tensor([n, d], BF16))
            return unrows(importer, y, lead)
        form = {"quant_fp8": EntryFormat.FP8, "quant_fp4_kv": EntryFormat.FP4_KV,
                "quant_mxfp4": EntryFormat.MXFP4}[op]
        out = [tensor([n, entry_code_width(form, d)], "uint8"),
               tensor([n, d // ENTRY_GROUP[form]], "uint8")]
        pair = call(importer, gv, [x2], out)
        bb = importer.block_builder
        codes = unrows(importer, bb.emit(relax.TupleGetItem(pair, 0)), lead)
        scales = unrows(importer, bb.emit(relax.TupleGetItem(pair, 1)), lead)
        return bb.emit(relax.Tuple([codes, scales]))

    return convert


GEMV_ROWS = 4  # row hints up to this (decode, drafts) lower dense linears to `dense_gemv`


def use_gemv(ctx: Lowering) -> bool:
    """Dense linears of this module lower to `dense_gemv` (CPU, a small row hint)."""
    return (not ctx.target.is_cuda and ctx.rows_hint is not None
            and ctx.rows_hint <= GEMV_ROWS)


def dense_call(ctx: Lowering, importer, x3: relax.Expr, w2: relax.Expr,
               out_dtype: str = "float32", scale: relax.Expr | None = None) -> relax.Expr:
    """x (m, g, k) times w (g * n, k) -> fp32 (m, g, n): dense_gemv in entries with a small row
    hint (decode, drafts), dense_gemm (register-tiled over rows) in the others (prefill). The
    aten `linear` / `einsum` overrides of `compiler.lower` emit it. out_dtype "bfloat16": the
    result the caller wants; the GEMV and the GEMM store it rounded where their forms can
    (`gemm.dense_gemv_rounds`, `gemm.dense_gemm_rounds`), else the result is fp32 and the
    caller rounds. `scale`: w is
    FP8 (E4M3 codes, these E8M0 scales per 32 x 32 tile), which dense_gemv reads as stored
    (decode, drafts, verify), and the prefill GEMM too where its form can
    (`gemm.dense_gemm_reads_fp8`), else its bf16 (`fp8_weight_values`)."""
    groups, k = (static(v) for v in shape(x3)[1:])
    n = static(shape(w2)[0]) // groups
    if scale is not None and not use_gemv(ctx) and not gemm.dense_gemm_reads_fp8(
            ctx.target, n=n, k=k):  # the values, exact in bf16, for the bf16 GEMM
        w2 = importer.block_builder.emit(relax.op.astype(
            fp8_weight_values(ctx, importer, w2, scale), BF16))
        scale = None
    w_dtype = gemm.FP8_WEIGHT if scale is not None else str(w2.ty.dtype)
    dims = dict(groups=groups, n=n, k=k, x_dtype=str(x3.ty.dtype), w_dtype=w_dtype)
    m = shape(x3)[0]
    weight = [w2] if scale is None else [w2, scale]
    if not use_gemv(ctx):
        rounds = out_dtype == BF16 and gemm.dense_gemm_rounds(
            ctx.target, n=n, k=k, x_dtype=dims["x_dtype"], w_dtype=dims["w_dtype"])
        dtype = BF16 if rounds else "float32"
        key = DenseGemmKey(**dims, out_dtype=dtype)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        return call(importer, gv, [x3, *weight], tensor([m, groups, n], dtype))
    # verify / draft: the rows of a group share each weight load (bit-identical per row)
    rounds = out_dtype == BF16 and gemm.dense_gemv_rounds(
        ctx.target, n=n, k=k, rows=ctx.verify_rows, x_dtype=dims["x_dtype"],
        w_dtype=dims["w_dtype"])
    dtype = BF16 if rounds else "float32"
    key = DenseGemvKey(**dims, rows=ctx.verify_rows, out_dtype=dtype)
    gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
    return call(importer, gv, [x3, *weight], tensor([m, groups, n], dtype))


def fp8_weight_values(ctx: Lowering, importer, codes: relax.Expr, scale: relax.Expr
                      ) -> relax.Expr:
    """The fp32 values of an FP8 weight [rows, k] with E8M0 scales per 32 x 32 tile, made once
    per call (a prefill's, where the GEMM's rows amortise it; CUDA's generic path): each tile's
    scale repeated over its rows, then the fp8_dequant kernel (exact; bf16 holds them exactly
    too: 4 significant bits)."""
    bb = importer.block_builder
    rows_, k = (static(v) for v in shape(codes))
    per_row = bb.emit(relax.op.repeat(scale, FP8_TILE, axis=0))
    if rows_ % FP8_TILE:
        per_row = bb.emit(relax.op.strided_slice(per_row, axes=[0], begin=[0], end=[rows_]))
    key = Fp8DequantKey(d=k)
    gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
    return call(importer, gv, [codes, per_row], tensor([rows_, k], "float32"))


def _fp8_grouped_linear(ctx: Lowering):
    """dsv41::fp8_grouped_linear (the grouped o-projection over the hub's FP8 `wo_a`): on the CPU
    `dense_call` over the codes and tile scales (the GEMV reads them as stored, the prefill
    GEMM too where its form can); on CUDA the generic einsum over the weight's bf16 values."""

    def convert(node, importer):
        x, w, s = (importer.env[a] for a in node.args[:3])
        dtype = x.ty.dtype
        if not ctx.target.is_cuda:
            x3, lead = rows(importer, x, 2)
            y = unrows(importer, dense_call(ctx, importer, x3, w, out_dtype=dtype, scale=s),
                       lead)
            return cast_to(importer, y, dtype)  # nothing where the GEMV stored bf16
        g, d = (static(v) for v in shape(x)[-2:])
        bb = importer.block_builder
        w3 = bb.emit(relax.op.reshape(fp8_weight_values(ctx, importer, w, s),
                                      [g, static(shape(w)[0]) // g, d]))
        y = bb.emit(relax.op.einsum([in_fp32(importer, x), w3], "bsgd,grd->bsgr"))
        return cast_to(importer, y, dtype)

    return convert


# ---- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchKernel:
    """How `dsv41 bench kernels` builds one family's kernel from a case's static dims (its
    inputs and oracle are `bench_kernels.prepare`'s, per family)."""

    family: str  # the bench family name (`bench_kernels.FAMILIES`)
    build: Callable[[str, dict], object]  # (target name, static dims) -> PrimFunc / IRModule


@dataclass(frozen=True)
class KernelEntry:
    """One op family: its keys, factory, config, schedule, converters, tuning task, bench."""

    name: str
    keys: tuple[type[KernelKey], ...]  # the kernel kinds its converters add
    factory: Callable  # schedules' build_* (make + config + schedule)
    config: Callable | None  # schedules' config chooser (None: no choices)
    schedule: Callable | None  # schedules' schedule function (None: hand-written TIR)
    converters: Mapping[str, Converter] = field(default_factory=dict)  # torch op -> converter
    # the scheduled kernel from its key alone (one-function families; the others are parts of
    # a module their converter builds from the node's dims)
    build: Callable[[KernelKey, str], tvm.tirx.PrimFunc] | None = None
    # the unscheduled function a tuning task tunes for a key (None: the kind is not tuned)
    task: Callable[[KernelKey, TargetSpec], tvm.tirx.PrimFunc | None] | None = None
    bench: BenchKernel | None = None


def _quant_factory(op: str) -> Callable:
    return {"quant_fp8": quant.build_quant_fp8, "quant_fp4_kv": quant.build_quant_fp4_kv,
            "quant_mxfp4": quant.build_quant_mxfp4, "qdq_mxfp4": quant.build_qdq_mxfp4}[op]


def _quant_unscheduled(op: str) -> Callable:
    return {"quant_fp8": quant.make_quant_fp8, "quant_fp4_kv": quant.make_quant_fp4_kv,
            "quant_mxfp4": quant.make_quant_mxfp4, "qdq_mxfp4": quant.make_qdq_mxfp4}[op]


def _fp8_build(key: Fp8LinearKey | Fp8QkvKey, target_name: str) -> tvm.tirx.PrimFunc:
    if isinstance(key, Fp8QkvKey):
        return gemm.build_fp8_q_kv(target_name, n_q=key.n_q, n_kv=key.n_kv, k=key.k,
                                   n_b=key.n_b, norm_eps=key.norm_eps, m=key.m, rows=key.rows)
    return gemm.build_fp8_linear(target_name, n=key.n, k=key.k, m=key.m,
                                 out_dtype=key.out_dtype, rows=key.rows, norm_eps=key.norm_eps,
                                 pair_n=key.pair_n, swiglu_limit=key.swiglu_limit)


def _fp8_linear_task(key: Fp8LinearKey | Fp8QkvKey, target: TargetSpec):
    if isinstance(key, Fp8QkvKey) or key.out_dtype != BF16 or key.norm_eps is not None \
            or key.pair_n is not None or key.swiglu_limit is not None:  # written scheduled
        return None  # fp8_linear_f32 (sharded partial sums) is not a tuned family
    func, config = gemm.unscheduled_fp8_linear(target, n=key.n, k=key.k, m=key.m,
                                               rows=key.rows)
    return None if config.prescheduled else func  # written scheduled: nothing to search


def _sparse_attend_build(key: SparseAttendKey, target_name: str):
    factory = attention.build_sparse_attend if key.kv == "fp4" else \
        attention.build_sparse_attend_bf16
    return factory(target_name, **key.dims())


def _sparse_attend_task(key: SparseAttendKey, target: TargetSpec):
    if key.kv != "fp4" or key.rope_rd:  # the RoPE form is not a tuned kind
        return None
    cfg = attention.sparse_attend_config(target, h=key.h, d=key.d, w=key.w, k=key.k)
    return attention.make_sparse_attend(**key.dims(), heads_per_group=cfg.heads_per_group,
                                        stage_rows=cfg.stage_rows,
                                        vector_decode=cfg.vector_decode,
                                        decode_lanes=cfg.decode_lanes)


def _index_scores_task(key: KernelKey, target: TargetSpec):
    if not isinstance(key, IndexScoresKey):
        return None  # the selects and the pool chain are not tuned (tuning_space docstring)
    return indexer.make_index_scores(heads=key.heads, dim=key.dim)


def _bench_attend(target_name: str, kw: dict):
    return attention.build_sparse_attend(target_name, **kw, softmax_scale=kw["d"] ** -0.5)


def _bench_fp8(target_name: str, kw: dict):
    return gemm.build_fp8_linear(target_name, n=kw["n"], k=kw["k"], m=kw["hint"],
                                 rows=kw.get("rows", 1))


def _bench_moe(target_name: str, kw: dict):  # the split chain `_moe_experts` emits
    rest = {k: v for k, v in kw.items() if k != "hint"}
    return moe.build_moe_experts_split(target_name, **rest, n=kw["hint"])  # verify: rows too


def _dense_build(key: DenseGemvKey, target_name: str):
    factory = gemm.build_dense_gemm if isinstance(key, DenseGemmKey) else gemm.build_dense_gemv
    return factory(target_name, **key.dims())


REGISTRY: tuple[KernelEntry, ...] = (
    KernelEntry(
        "fp8_linear", (Fp8LinearKey, Fp8QkvKey), gemm.build_fp8_linear, gemm.fp8_linear_config,
        gemm.schedule_fp8_linear,
        {"fp8_linear.default": _fp8_linear,
         "fp8_linear_f32.default": lambda ctx: _fp8_linear(ctx, "float32"),
         "norm_fp8_linear.default": lambda ctx: fused_ops.norm_fp8_linear(ctx, build),
         "fp8_linear_pair.default": lambda ctx: fused_ops.fp8_linear_pair(ctx, build),
         "swiglu_fp8_linear.default": lambda ctx: fused_ops.swiglu_fp8_linear(ctx, build),
         "fp8_q_kv.default": lambda ctx: fused_ops.fp8_q_kv(ctx, build)},
        build=lambda key, t: _fp8_build(key, t),
        task=_fp8_linear_task, bench=BenchKernel("fp8", _bench_fp8)),
    KernelEntry(
        "fp8_dequant", (Fp8DequantKey,), gemm.build_fp8_dequant, gemm.dequant_config,
        gemm.schedule_dequant, {"fp8_dequant.default": _fp8_dequant},
        build=lambda key, t: gemm.build_fp8_dequant(t, d=key.d),
        task=lambda key, _t: gemm.make_fp8_dequant(d=key.d)),
    KernelEntry(
        "sparse_attend", (SparseAttendKey,), attention.build_sparse_attend,
        attention.sparse_attend_config, attention.schedule_sparse_attend,
        {"sparse_attend.default": lambda ctx: _sparse_attend(ctx, "fp4"),
         "sparse_attend_bf16.default": lambda ctx: _sparse_attend(ctx, "bf16"),
         "sparse_attend_rope.default": lambda ctx: fused_ops.sparse_attend_rope(ctx, build)},
        build=_sparse_attend_build, task=_sparse_attend_task,
        bench=BenchKernel("attend", _bench_attend)),
    KernelEntry(
        "indexer", (IndexScoresKey, IndexScoresSharedKey, SelectPositionsKey, SelectBlocksKey,
                    PoolKey),
        indexer.build_indexer_topk, indexer.sweep_config, indexer.schedule_index_scores,
        {"indexer_topk.default": lambda ctx: _indexer(ctx, "flat"),
         "indexer_topk_shared.default": _indexer_shared,
         "hier_topk.default": lambda ctx: _indexer(ctx, "hier"),
         "pool_topk.default": lambda ctx: _indexer(ctx, "pool")},
        task=_index_scores_task,
        bench=BenchKernel("indexer", lambda t, kw: indexer.build_indexer_topk(t, **kw))),
    KernelEntry(
        "moe", (MoeKey,), moe.build_moe_experts_split, moe.moe_split_config,
        moe.schedule_moe_gemm, {"moe_experts.default": _moe_experts,
                                "moe_experts_plus.default": lambda ctx: _moe_experts(ctx, True)},
        bench=BenchKernel("moe", _bench_moe)),
    KernelEntry(
        "scatter_rows", (ScatterRowsKey,), cache_write.build_scatter_rows, None,
        cache_write.schedule_scatter_rows, {"scatter_rows.default": _scatter_rows},
        build=lambda key, t: cache_write.build_scatter_rows(t, width=key.width,
                                                            dtype=key.dtype)),
    KernelEntry(
        "rms_norm", (RmsNormKey,), norm.build_rms_norm, norm.norm_config,
        norm.schedule_rms_norm, {"rms_norm.default": _rms_norm},
        build=lambda key, t: norm.build_rms_norm(t, d=key.d, eps=key.eps)),
    KernelEntry(
        "route_topk", (RouteTopkKey,), router.build_route_topk, router.router_config,
        router.schedule_route_topk,
        {"route_topk.default": _route_topk,
         "route_topk_logits.default": lambda ctx: _route_topk(ctx, logits=True)},
        build=lambda key, t: router.build_route_topk(
            t, e=key.e, k=key.k, normalize=key.normalize, route_scale=key.route_scale,
            bias_rows=key.bias_rows, gate_temp=key.gate_temp, bias_select=key.bias_select)),
    KernelEntry(
        "rope", (RopeKey,), rope.build_rope, rope.rope_config, rope.schedule_rope,
        {"rope.default": _rope},
        build=lambda key, t: rope.build_rope(t, h=key.h, d=key.d, rd=key.rd,
                                             inverse=key.inverse)),
    KernelEntry(
        "rope_quant", (RopeQuantKey,), rope_quant.build_rope_quant, rope_quant.rope_quant_config,
        rope_quant.schedule_rope_quant,
        {"rope_quant.default": lambda ctx: fused_ops.rope_quant(ctx, build),
         "rope_quant_rows.default": lambda ctx: fused_ops.rope_quant_into(ctx, build,
                                                                          window=False),
         "rope_quant_window.default": lambda ctx: fused_ops.rope_quant_into(ctx, build,
                                                                            window=True)},
        build=lambda key, t: rope_quant.build_rope_quant(t, d=key.d, rd=key.rd, fmt=key.form,
                                                         eps=key.eps, into=key.into,
                                                         window=key.window)),
    KernelEntry(
        "mhc", (HcPreMixKey, HcPostKey, HcPostPreMixKey), mhc.build_hc_pre_mix, mhc.mhc_config,
        mhc.schedule_hc_pre_mix,
        {"hc_pre_mix.default": _hc_pre_mix, "hc_post.default": _hc_post,
         "hc_post_pre_mix.default": lambda ctx: fused_ops.hc_post_pre_mix(ctx, build)},
        build=lambda key, t: (
            mhc.build_hc_post(t, hc=key.hc, d=key.d) if isinstance(key, HcPostKey)
            else mhc.build_hc_pre_mix(t, hc=key.hc, d=key.d, iters=key.iters,
                                      norm_eps=key.norm_eps, hc_eps=key.hc_eps, with_norm=True,
                                      with_post=isinstance(key, HcPostPreMixKey)))),
    KernelEntry(
        "quant", (QuantKey,), quant.build_quant_fp8, quant.quant_config, quant.schedule_quant,
        {f"{op}.default": (lambda ctx, op=op: _quant(ctx, op))
         for op in ("quant_fp8", "quant_fp4_kv", "quant_mxfp4", "qdq_mxfp4")},
        build=lambda key, t: _quant_factory(key.op)(t, d=key.d),
        task=lambda key, _t: _quant_unscheduled(key.op)(d=key.d)),
    KernelEntry(
        "dense", (DenseGemvKey, DenseGemmKey), gemm.build_dense_gemv, gemm.dense_gemv_config,
        gemm.schedule_dense_gemv,  # also emitted by lower's aten linear / einsum overrides
        {"fp8_grouped_linear.default": _fp8_grouped_linear},
        build=_dense_build,
        bench=BenchKernel("gemv", lambda t, kw: gemm.build_dense_gemv(t, **kw))),
)

COLLECTIVES: dict[str, Converter] = {  # dsv41 ops without a kernel: calls of the entry's ccl
    "all_reduce.default": lambda ctx: _collective(ctx, "allreduce"),
    "all_gather.default": lambda ctx: _collective(ctx, "allgather"),
}
HOST_CALLS: dict[str, Converter] = {  # dsv41 ops without a kernel: calls of the host runtime
    "engram_rows.default": _engram_rows,
}


def entry_of(key: KernelKey) -> KernelEntry:
    """The registry entry of a key's kind."""
    for entry in REGISTRY:
        if type(key) in entry.keys:
            return entry
    raise AssertionError(f"no registry entry for {type(key).__name__}")


def build(key: KernelKey, target_name: str) -> tvm.tirx.PrimFunc:
    """The scheduled kernel of a one-function kind, from its key."""
    entry = entry_of(key)
    assert entry.build is not None, f"{entry.name} kernels are built by their converter"
    return entry.build(key, target_name)


def converters(ctx: Lowering) -> dict:
    """torch op -> converter, for every custom op (`compiler.lower.convert_map` adds the aten
    overrides)."""
    out = {op: make(ctx) for op, make in (*COLLECTIVES.items(), *HOST_CALLS.items())}
    for entry in REGISTRY:
        out.update({op: make(ctx) for op, make in entry.converters.items()})
    return out


def unscheduled(key: KernelKey, target: TargetSpec) -> tvm.tirx.PrimFunc | None:
    """The factory output behind a key before its schedule (the config's structural choices
    applied), or None for a kind that is not tuned."""
    entry = entry_of(key)
    return None if entry.task is None else entry.task(key, target)


def kernel_label(key: KernelKey) -> str:
    """A short description of a tuned kernel (the tuning table's task column)."""
    if isinstance(key, Fp8LinearKey):
        return f"fp8_linear n={key.n} k={key.k}"
    if isinstance(key, SparseAttendKey):
        return f"sparse_attend h={key.h} d={key.d} w={key.w} k={key.k}"
    if isinstance(key, IndexScoresKey):
        return f"index_scores heads={key.heads} dim={key.dim}"
    return f"{key.family} d={key.parts()[1]}"


def kernel_task(key: KernelKey, target: TargetSpec, *, entry: str, values: dict[str, int],
                calls: int = 1):
    """A tuning task for one kernel key at the given values of its symbolic dims (no graph
    needed): the unscheduled function against the hand kernel `build` makes."""


    func = as_module_kernel(unscheduled(key, target))
    hand = as_module_kernel(build(key, target.name))
    assert signature(func) == signature(hand), f"no hand kernel for {key}"
    name = key.function_name
    return Task(name=f"{entry}.{name}", entry=entry, kind="kernel", family=key.family,
                function=name, key=str(tvm_ffi.structural_hash(hand)), func=func, hand=hand,
                values=dict(values), calls=calls, flops=math.nan,
                label=f"{kernel_label(key)} [{','.join(f'{k}={v}' for k, v in values.items())}]")


def bench_kernel(family: str) -> BenchKernel:
    """The registry's builder for a `bench kernels` family."""
    for entry in REGISTRY:
        if entry.bench is not None and entry.bench.family == family:
            return entry.bench
    raise ValueError(f"No kernel benchmark family {family!r}; the registry has "
                     f"{', '.join(e.bench.family for e in REGISTRY if e.bench)}.")
