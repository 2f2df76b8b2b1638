"""Lower: a captured phase (torch.export) -> Relax, with `dsv41::` ops calling our TIR kernels.

`from_exported_program` translates the plain aten ops. The converters here:

- map every `dsv41::` custom op to its kernel in `schedules/` through `call_tir` (leading dims
  flattened to the kernel's row dim, then restored);
- override the few aten translations whose numerics differ from torch's: bf16 `linear`, `einsum`
  and `mean` accumulate in fp32 and round once to bf16, as torch does (TVM would accumulate in
  bf16 or return fp32);
- supply ops the importer lacks (`amax`, `copysign`, stable `sort`).

Kernels are built once per (kernel, static dims) and shared by every call site.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from dsv41.graph.collectives import CclBackend
from dsv41.graph.targets import TargetSpec

BF16 = "bfloat16"


@dataclass
class Lowering:
    """Per-module state: the target, a row-count hint for GEMM schedules, and the kernels already
    added (so each static shape is built and added once)."""

    target: TargetSpec
    rows_hint: int | None = None  # decode: 1; drafts: a few; prefill: None (large)
    kernels: dict[tuple, relax.GlobalVar] = field(default_factory=dict)
    ccl: CclBackend = CclBackend.DISCO  # a sharded entry's collectives
    null_expert: bool = False  # a sharded worker's expert stacks end with the null expert
    bounded_rows: bool = False  # rows per call bounded (decode, verify, draft, the CED decoder)

    def kernel(self, importer, key: tuple, make) -> relax.GlobalVar:
        if key not in self.kernels:
            func = make().without_attr("global_symbol")  # named by the module, not the kernel
            func = func.with_attr("op_pattern", 8)  # kOpaque: a whole kernel, never fused
            name = "k_" + "_".join(str(k).replace(".", "p").replace("-", "m") for k in key)
            self.kernels[key] = importer.block_builder.add_func(func, name)
        return self.kernels[key]


# ---- small Relax helpers ----------------------------------------------------------------------


def _shape(x: relax.Expr) -> list:
    return list(x.ty.shape.values)


def _static(v) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, tvm.tirx.IntImm):
        return int(v.value)
    raise ValueError(f"Expected a static dimension, got {v}.")


def _rows(importer, x: relax.Expr, keep: int) -> tuple[relax.Expr, list]:
    """Flatten all but the last `keep` dims into one row dim. Returns (x2, leading dims)."""
    shape = _shape(x)
    lead, tail = shape[: len(shape) - keep], shape[len(shape) - keep :]
    n = tvm.tirx.IntImm("int64", 1)
    for v in lead:
        n = n * v
    return importer.block_builder.emit(relax.op.reshape(x, [n, *tail])), lead


def _tensor(shape, dtype) -> relax.TensorType:
    return relax.TensorType(shape, dtype)


def _call(importer, gv, args, out):
    return importer.block_builder.emit(relax.call_tir(gv, args, out_ty=out))


def _unrows(importer, y: relax.Expr, lead: list) -> relax.Expr:
    shape = _shape(y)
    return importer.block_builder.emit(relax.op.reshape(y, [*lead, *shape[1:]]))


# ---- dsv41 ops ----------------------------------------------------------------------------------


def _fp8_linear(ctx: Lowering, out_dtype: str = BF16):
    """fp8_linear (bf16 out) or fp8_linear_f32 (fp32: a row-parallel partial sum)."""
    from dsv41.schedules import gemm

    name = "fp8_linear" if out_dtype == BF16 else "fp8_linear_f32"

    def convert(node, importer):
        x, w, s = (importer.env[a] for a in node.args[:3])
        n, k = (_static(v) for v in _shape(w))
        gv = ctx.kernel(importer, (name, n, k, ctx.rows_hint),
                        lambda: gemm.build_fp8_linear(ctx.target.name, n=n, k=k,
                                                      m=ctx.rows_hint, out_dtype=out_dtype))
        x2, lead = _rows(importer, x, 1)
        y = _call(importer, gv, [x2, w, s], _tensor([_shape(x2)[0], n], out_dtype))
        return _unrows(importer, y, lead)

    return convert


def _collective(ctx: Lowering, op: str):
    """dsv41::all_reduce / all_gather -> a destination-passing call of the sharded entry's
    collective (`ctx.ccl`): disco's own functions, which run the session's NCCL, or the CPU
    test collective. Both take disco's arguments (a sum; not within a group)."""

    def convert(node, importer):
        x = importer.env[node.args[0]]
        shards = int(node.args[1])
        not_in_group = relax.prim_value(tvm.tirx.IntImm("bool", 0))
        if op == "allreduce":
            args, out = [x, relax.ShapeExpr([0]), not_in_group], x.ty
        else:
            shape = _shape(x)
            args, out = [x, not_in_group], _tensor([shape[0] * shards, *shape[1:]], x.ty.dtype)
        return importer.block_builder.emit(
            relax.call_dps_packed(ctx.ccl.function(op), args, out_ty=out))

    return convert


def _fp8_dequant(ctx: Lowering):
    from dsv41.schedules import gemm

    def convert(node, importer):
        codes, scales = (importer.env[a] for a in node.args[:2])
        d = _static(_shape(codes)[-1])
        gv = ctx.kernel(importer, ("fp8_dequant", d),
                        lambda: gemm.build_fp8_dequant(ctx.target.name, d=d))
        c2, lead = _rows(importer, codes, 1)
        s2, _ = _rows(importer, scales, 1)
        y = _call(importer, gv, [c2, s2], _tensor([_shape(c2)[0], d], "float32"))
        return _unrows(importer, y, lead)

    return convert


def _sparse_attend(ctx: Lowering, kind: str):
    """sparse_attend (FP4 global entries: codes + scales) or sparse_attend_bf16 (a bf16 global
    cache, `kv_dtype="bf16"`): the same kernel body over either store."""
    from dsv41.schedules import attention

    n_tensors, build = {"fp4": (8, attention.build_sparse_attend),
                        "bf16": (7, attention.build_sparse_attend_bf16)}[kind]

    def convert(node, importer):
        args = [importer.env[a] for a in node.args[:n_tensors]]
        scale = float(node.args[n_tensors])
        q, win_idx, kv_idx = args[0], args[3], args[n_tensors - 2]
        _, _, h, d = _shape(q)
        dims = dict(h=_static(h), d=_static(d), w=_static(_shape(win_idx)[-1]),
                    k=_static(_shape(kv_idx)[-1]), softmax_scale=scale)
        name = "sparse_attend" if kind == "fp4" else "sparse_attend_bf16"
        gv = ctx.kernel(importer, (name, *dims.values()),
                        lambda: build(ctx.target.name, **dims))
        return _call(importer, gv, args, _tensor(_shape(q), BF16))

    return convert


def _indexer(ctx: Lowering, kind: str):
    from dsv41.schedules import indexer

    def convert(node, importer):
        q, kc, ks, wts, lens = (importer.env[a] for a in node.args[:5])
        b, s, heads, dim = _shape(q)
        heads, dim = _static(heads), _static(dim)
        t = _shape(kc)[1]
        pad = indexer.SCORE_PAD
        scores_ty = _tensor([b, s, (t + pad - 1) // pad * pad], BF16)
        if kind == "pool":
            blocks = importer.env[node.args[5]]
            topk, block_size = int(node.args[6]), int(node.args[7])
            mod = indexer.build_pool_topk(ctx.target.name, heads=heads, dim=dim, topk=topk,
                                          block_size=block_size, gather=ctx.bounded_rows)
            key = ("pool", heads, dim, topk, block_size)
            names = {"pool_scores": (*key, "scores"), "select_pool": (*key, "select"),
                     "pool_gather": (*key, "gather"), "pool_mask": (*key, "mask"),
                     "index_scores": ("index_scores", heads, dim)}  # the flat sweep's own

            def kernel(name):
                return ctx.kernel(importer, names[name], lambda: mod[name])

            scores = indexer.emit_pool_scores(importer.block_builder, mod, kernel,
                                              [q, kc, ks, wts, lens, blocks],
                                              block_size=block_size)
            return _call(importer, kernel("select_pool"), [scores, blocks],
                         _tensor([b, s, topk], "int32"))
        topk = int(node.args[5])
        flat = {}

        def flat_mod():
            if not flat:
                flat["mod"] = indexer.build_indexer_topk(ctx.target.name, heads=heads, dim=dim,
                                                         topk=topk)
            return flat["mod"]

        sweep = ctx.kernel(importer, ("index_scores", heads, dim),
                           lambda: flat_mod()["index_scores"])
        pick = ctx.kernel(importer, ("select_positions", topk),
                          lambda: flat_mod()["select_positions"])
        scores = _call(importer, sweep, [q, kc, ks, wts, lens], scores_ty)
        idx = _call(importer, pick, [scores], _tensor([b, s, topk], "int32"))
        if kind == "flat":
            return idx
        topk_blocks, block_size = int(node.args[6]), int(node.args[7])
        blk = ctx.kernel(importer, ("select_blocks", topk_blocks, block_size),
                         lambda: indexer.build_hier_topk(
                             ctx.target.name, heads=heads, dim=dim, topk=topk,
                             topk_blocks=topk_blocks, block_size=block_size)["select_blocks"])
        blocks = _call(importer, blk, [scores, lens], _tensor([b, s, topk_blocks], "int32"))
        return importer.block_builder.emit(relax.Tuple([idx, blocks]))

    return convert


def _indexer_shared(ctx: Lowering):
    """indexer_topk_shared: the sweep takes the own store, the alternates (unused slots get the
    own store again, never read) and the per-sequence pick; no store is copied."""
    from dsv41.schedules import indexer

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
        b, s, heads, dim = _shape(q)
        heads, dim = _static(heads), _static(dim)
        t = _shape(kc)[1]
        pad = indexer.SCORE_PAD
        mod = {}

        def module():
            if not mod:
                mod["m"] = indexer.build_indexer_topk(ctx.target.name, heads=heads, dim=dim,
                                                      topk=topk, n_alt=n_alt)
            return mod["m"]

        sweep = ctx.kernel(importer, ("index_scores_shared", heads, dim, n_alt),
                           lambda: module()["index_scores_shared"])
        pick_fn = ctx.kernel(importer, ("select_positions", topk),
                             lambda: module()["select_positions"])
        slots = []
        for i in range(indexer.MAX_ALT):
            slots += [alt_c[i], alt_s[i]] if i < n_alt else [kc, ks]
        scores = _call(importer, sweep, [q, kc, ks, *slots, pick, wts, lens],
                       _tensor([b, s, (t + pad - 1) // pad * pad], BF16))
        return _call(importer, pick_fn, [scores], _tensor([b, s, topk], "int32"))

    return convert


def _moe_experts(ctx: Lowering):
    """The routed experts as the six-kernel chain of `schedules.moe` (Relax allocates the
    token-sized intermediates between the calls, which CUDA needs)."""
    from dsv41.schedules import moe

    def convert(node, importer):
        args = [importer.env[a] for a in node.args[:9]]
        limit = float(node.args[9])
        x, w1 = args[0], args[3]
        n_experts, inter = (_static(v) for v in _shape(w1)[:2])
        dim = _static(_shape(x)[-1])
        topk = _static(_shape(args[2])[-1])
        dims = dict(dim=dim, inter=inter, n_experts=n_experts, topk=topk)
        key = ("moe", *dims.values(), limit, ctx.rows_hint) + (("null",) if ctx.null_expert
                                                                 else ())
        mod = None

        def module():
            nonlocal mod
            if mod is None:
                mod = moe.build_moe_experts_split(ctx.target.name, **dims, swiglu_limit=limit,
                                                  n=ctx.rows_hint, null_expert=ctx.null_expert)
            return mod

        plan = moe.moe_experts_plan(ctx.target.name, **dims, n=_shape(x)[0],
                                    n_hint=ctx.rows_hint)
        return moe.emit_moe_experts(
            importer.block_builder, plan, args,
            lambda f: ctx.kernel(importer, (*key, f), lambda: module()[f]))

    return convert


def _scatter_rows(ctx: Lowering):
    """A cache write, in place: the kernel writes the new rows into the store or ring the
    entry was given (`call_tir_inplace`), and the result aliases that input. The graph never
    reads a cache tensor's old value after writing it (each write replaces the tensor), which is
    what an in-place call requires."""
    from dsv41.schedules import cache_write

    def convert(node, importer):
        dst, idx, rows = (importer.env[a] for a in node.args[:3])
        width, dtype = _static(_shape(dst)[-1]), dst.ty.dtype
        gv = ctx.kernel(importer, ("scatter_rows", width, dtype),
                        lambda: cache_write.build_scatter_rows(ctx.target.name, width=width,
                                                               dtype=dtype))
        return importer.block_builder.emit(
            relax.call_tir_inplace(gv, [dst, idx, rows], [0], out_ty=dst.ty))

    return convert


def _rms_norm(ctx: Lowering):
    from dsv41.schedules import norm

    def convert(node, importer):
        x, weight = importer.env[node.args[0]], importer.env[node.args[1]]
        eps = float(node.args[2])
        d = _static(_shape(x)[-1])
        gv = ctx.kernel(importer, ("rms_norm", d, eps),
                        lambda: norm.build_rms_norm(ctx.target.name, d=d, eps=eps))
        x2, lead = _rows(importer, x, 1)
        y = _call(importer, gv, [x2, weight], _tensor(_shape(x2), BF16))
        return _unrows(importer, y, lead)

    return convert


def _hc_pre_mix(ctx: Lowering):
    """A sublayer's mHC entry (mixes + lagged collapse + RMSNorm) as one kernel."""
    from dsv41.schedules import mhc

    def convert(node, importer):
        h, fn, scale, base, pre_in, weight = (importer.env[a] for a in node.args[:6])
        hc, iters = int(node.args[6]), int(node.args[7])
        norm_eps, hc_eps = float(node.args[8]), float(node.args[9])
        b, s, _, d = _shape(h)
        dims = dict(hc=hc, d=_static(d), iters=iters, norm_eps=norm_eps, hc_eps=hc_eps)
        gv = ctx.kernel(importer, ("hc_pre_mix", *dims.values()),
                        lambda: mhc.build_hc_pre_mix(ctx.target.name, **dims, with_norm=True))
        f32 = "float32"
        out = [_tensor([b, s, d], BF16), _tensor([b, s, hc], f32), _tensor([b, s, hc], f32),
               _tensor([b, s, hc, hc], f32)]
        res = _call(importer, gv, [h, fn, scale, base, pre_in, weight], out)
        bb = importer.block_builder
        return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(res, i)) for i in range(4)]))

    return convert


def _hc_post(ctx: Lowering):
    from dsv41.schedules import mhc

    def convert(node, importer):
        f, h, post, comb = (importer.env[a] for a in node.args[:4])
        hc, d = (_static(v) for v in _shape(h)[2:])
        gv = ctx.kernel(importer, ("hc_post", hc, d),
                        lambda: mhc.build_hc_post(ctx.target.name, hc=hc, d=d))
        return _call(importer, gv, [f, h, post, comb], _tensor(_shape(h), BF16))

    return convert


def _quant(ctx: Lowering, op: str):
    from dsv41.schedules import quant

    build = {"quant_fp8": quant.build_quant_fp8, "quant_fp4_kv": quant.build_quant_fp4_kv,
             "quant_mxfp4": quant.build_quant_mxfp4, "qdq_mxfp4": quant.build_qdq_mxfp4}[op]

    def convert(node, importer):
        x = importer.env[node.args[0]]
        d = _static(_shape(x)[-1])
        x2, lead = _rows(importer, x, 1)
        n = _shape(x2)[0]
        gv = ctx.kernel(importer, (op, d), lambda: build(ctx.target.name, d=d))
        if op == "qdq_mxfp4":
            y = _call(importer, gv, [x2], _tensor([n, d], BF16))
            return _unrows(importer, y, lead)
        code_w, scale_w = {"quant_fp8": (d, d // 32), "quant_fp4_kv": (d // 2, d // 16),
                           "quant_mxfp4": (d // 2, d // 32)}[op]
        out = [_tensor([n, code_w], "uint8"), _tensor([n, scale_w], "uint8")]
        pair = _call(importer, gv, [x2], out)
        bb = importer.block_builder
        codes = _unrows(importer, bb.emit(relax.TupleGetItem(pair, 0)), lead)
        scales = _unrows(importer, bb.emit(relax.TupleGetItem(pair, 1)), lead)
        return bb.emit(relax.Tuple([codes, scales]))

    return convert


# ---- aten overrides and additions ------------------------------------------------------------


def _in_fp32(importer, x: relax.Expr) -> relax.Expr:
    if x.ty.dtype == "float32":
        return x
    return importer.block_builder.emit(relax.op.astype(x, "float32"))


def _round_to_bf16(importer, x: relax.Expr) -> relax.Expr:
    """fp32 -> bf16, round to nearest even, on the bits. A plain cast is folded away by TVM's
    simplifier when a fused kernel immediately casts back to fp32 (Cast(f32, Cast(bf16, v)) ->
    v), which silently drops torch's bf16 rounding; bit arithmetic cannot be folded."""
    from tvm import te, tirx

    def rnd(v):
        u = tirx.reinterpret("uint32", v)
        one, half = tirx.const(1, "uint32"), tirx.const(0x7FFF, "uint32")
        r = (u + ((u >> tirx.const(16, "uint32")) & one) + half) >> tirx.const(16, "uint32")
        r = tirx.Select(v != v, (u >> tirx.const(16, "uint32")) | tirx.const(0x40, "uint32"),
                        r)  # NaN stays a quiet NaN
        return tirx.reinterpret("bfloat16", r.astype("uint16"))

    def compute(a):
        return te.compute(a.shape, lambda *i: rnd(a(*i)), name="round_bf16")

    return importer.block_builder.emit_te(compute, x, primfunc_name_hint="round_bf16")


def _cast(importer, x: relax.Expr, dtype: str) -> relax.Expr:
    if x.ty.dtype == dtype:
        return x
    if dtype == "bfloat16" and x.ty.dtype == "float32":
        return _round_to_bf16(importer, x)
    return importer.block_builder.emit(relax.op.astype(x, dtype))


def _to_dtype(node, importer):
    """aten.to(dtype) / _to_copy / type_as, with the exact fp32 -> bf16 rounding."""
    import torch

    x = importer.env[node.args[0]]
    target = node.kwargs.get("dtype")
    if target is None and len(node.args) > 1:
        other = node.args[1]
        target = other.meta["val"].dtype if isinstance(other, torch.fx.Node) else other
    if target is None:
        return x
    dtype = str(target).replace("torch.", "")
    return _cast(importer, x, dtype)


GEMV_ROWS = 4  # row hints up to this (decode, drafts) lower dense linears to `dense_gemv`


def _use_gemv(ctx: Lowering) -> bool:
    return (not ctx.target.is_cuda and ctx.rows_hint is not None
            and ctx.rows_hint <= GEMV_ROWS)


def _widened_source(arg, importer) -> relax.Expr:
    """The operand before a bf16 -> fp32 cast (`x.float()`), else the operand itself: the GEMV
    widens in registers, so the cast copy is never made (for a weight, a full fp32 copy per
    call)."""
    import torch

    src = importer.env[arg]
    if not isinstance(arg, torch.fx.Node) or str(arg.target) not in (
            "aten._to_copy.default", "aten.to.dtype"):
        return src
    inner = arg.args[0]
    if not isinstance(inner, torch.fx.Node) or inner not in importer.env:
        return src
    before = importer.env[inner]
    if before.ty.dtype == BF16 and src.ty.dtype == "float32":
        return before
    return src


def _weight_2d(arg, w: relax.Expr, importer) -> relax.Expr:
    """w as a 2-D [rows, k] tensor: for a `view` of a 2-D tensor (the grouped o-projection's
    `wo_a.view(g, r, -1)`), the tensor before the view. A Relax reshape of a function parameter
    is legalised into a full copy on every call; the kernel indexes the stored layout instead."""
    import torch

    if len(_shape(w)) == 2:
        return w
    rows = 1
    for v in _shape(w)[:-1]:
        rows *= _static(v)
    if isinstance(arg, torch.fx.Node) and str(arg.target) in (
            "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"):
        src = importer.env.get(arg.args[0])
        if src is not None and len(_shape(src)) == 2 and src.ty.dtype == w.ty.dtype and \
                [_static(v) for v in _shape(src)] == [rows, _static(_shape(w)[-1])]:
            return src
    return importer.block_builder.emit(relax.op.reshape(w, [rows, _shape(w)[-1]]))


def _gemv_call(ctx: Lowering, importer, x3: relax.Expr, w2: relax.Expr) -> relax.Expr:
    """x (m, g, k) times w (g * n, k) -> fp32 (m, g, n): dense_gemv in entries with a small row
    hint (decode, drafts), dense_gemm (register-tiled over rows) in the others (prefill)."""
    from dsv41.schedules import gemm

    groups, k = (_static(v) for v in _shape(x3)[1:])
    n = _static(_shape(w2)[0]) // groups
    kind = "dense_gemv" if _use_gemv(ctx) else "dense_gemm"
    build = gemm.build_dense_gemv if kind == "dense_gemv" else gemm.build_dense_gemm
    key = (kind, groups, n, k, x3.ty.dtype, w2.ty.dtype)
    gv = ctx.kernel(importer, key, lambda: build(
        ctx.target.name, groups=groups, n=n, k=k, x_dtype=x3.ty.dtype, w_dtype=w2.ty.dtype))
    m = _shape(x3)[0]
    return _call(importer, gv, [x3, w2], _tensor([m, groups, n], "float32"))


def _gemv_operands_ok(*xs: relax.Expr) -> bool:
    return all(x.ty.dtype in (BF16, "float32") for x in xs)


def _linear(ctx: Lowering):
    def convert(node, importer):
        x, w = importer.env[node.args[0]], importer.env[node.args[1]]
        bias = (importer.env[node.args[2]]
                if len(node.args) > 2 and node.args[2] is not None else None)
        dtype = x.ty.dtype
        bb = importer.block_builder
        if _use_gemv(ctx) and bias is None and len(_shape(w)) == 2:
            xs = _widened_source(node.args[0], importer)
            ws = _widened_source(node.args[1], importer)
            if _gemv_operands_ok(xs, ws):
                n, k = (_static(v) for v in _shape(ws))
                x2, lead = _rows(importer, xs, 1)
                x3 = bb.emit(relax.op.reshape(x2, [_shape(x2)[0], 1, k]))
                y = _gemv_call(ctx, importer, x3, ws)
                y = bb.emit(relax.op.reshape(y, [*lead, n]))
                return _cast(importer, y, dtype)
        if bias is not None:  # added in fp32 before the one rounding (the vision tower's)
            bias = _in_fp32(importer, bias)
        y = bb.emit(relax.op.linear(_in_fp32(importer, x), _in_fp32(importer, w), bias,
                                    "float32"))
        return _cast(importer, y, dtype)

    return convert


def _grouped_einsum(eq: str) -> bool:
    """eq is `P g d, g r d -> P g r` (a grouped linear: per group g, d -> r) for some lead
    letters P and distinct g, r, d."""
    lhs, _, out = eq.replace(" ", "").partition("->")
    ops = lhs.split(",")
    if len(ops) != 2 or len(ops[1]) != 3 or len(ops[0]) < 2:
        return False
    (a, (g, r, d)) = ops[0], ops[1]
    lead = a[:-2]
    letters = a + r
    return a[-2:] == g + d and out == lead + g + r and len(set(letters)) == len(letters)


def _einsum(ctx: Lowering):
    def convert(node, importer):
        eq = node.args[0]
        ops = [importer.env[a] for a in node.args[1]]
        dtype = ops[0].ty.dtype
        # The grouped o-projection on the CPU, at any row count: the generic einsum is an
        # unscheduled loop nest over an fp32 copy of the weight (1.6 s a layer at 128 prefill
        # rows); dense_gemv (decode) / dense_gemm (prefill) read the stored weight in place.
        if not ctx.target.is_cuda and _grouped_einsum(eq):
            xs, ws = (_widened_source(a, importer) for a in node.args[1])
            if _gemv_operands_ok(xs, ws):
                x3, lead = _rows(importer, xs, 2)
                w2 = _weight_2d(node.args[1][1], ws, importer)
                y = _unrows(importer, _gemv_call(ctx, importer, x3, w2), lead)
                return _cast(importer, y, dtype)
        y = importer.block_builder.emit(relax.op.einsum([_in_fp32(importer, o) for o in ops],
                                                        eq))
        return _cast(importer, y, dtype)

    return convert


def _mean(node, importer):
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dtype = x.ty.dtype
    y = importer.block_builder.emit(relax.op.mean(_in_fp32(importer, x), dim, keepdims=keep))
    return _cast(importer, y, dtype)


def _amax(node, importer):
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return importer.block_builder.emit(relax.op.max(x, dim, keepdims=keep))


def _copysign(node, importer):
    """|a| with b's sign (b < 0; a -0.0 b counts as positive, the only difference from torch)."""
    a, b = importer.env[node.args[0]], importer.env[node.args[1]]
    bb = importer.block_builder
    mag = bb.emit(relax.op.abs(a))
    neg = bb.emit(relax.op.less(b, relax.const(0.0, b.ty.dtype)))
    return bb.emit(relax.op.where(neg, bb.emit(relax.op.negative(mag)), mag))


def _sort_stable(node, importer):
    x = importer.env[node.args[0]]
    dim = node.kwargs.get("dim", -1)
    desc = node.kwargs.get("descending", False)
    bb = importer.block_builder
    idx = bb.emit(relax.op.argsort(x, dim, desc, dtype="int64"))
    vals = bb.emit(relax.op.gather_elements(x, idx, axis=dim))
    return bb.emit(relax.Tuple([vals, idx]))


def _where_scalar(scalar_pos: int):
    """where(cond, tensor, scalar) / where(cond, scalar, tensor) with the tensor's dtype."""

    def convert(node, importer):
        cond = importer.env[node.args[0]]
        t = importer.env[node.args[2 if scalar_pos == 1 else 1]]
        c = relax.const(node.args[scalar_pos], t.ty.dtype)
        a, b = (c, t) if scalar_pos == 1 else (t, c)
        return importer.block_builder.emit(relax.op.where(cond, a, b))

    return convert


def _scalar_tensor(importer, v, dtype: str) -> relax.Expr:
    """A 0-d tensor from a Python number or a symbolic PrimValue (via a 1-long arange)."""
    if isinstance(v, int | float):
        return relax.const(v, dtype)
    bb = importer.block_builder
    p = v.value if hasattr(v, "value") else v  # a PrimValue wraps the symbolic expression
    one = bb.emit(relax.op.arange(p, p + 1, 1, dtype=dtype))
    return bb.emit(relax.op.reshape(one, []))


def _clamp(node, importer):
    """clamp with bounds that may be symbolic (e.g. tokens - 1)."""
    args = importer.retrieve_args(node)
    x = args[0]
    lo = args[1] if len(args) > 1 else node.kwargs.get("min")
    hi = args[2] if len(args) > 2 else node.kwargs.get("max")
    dtype = x.ty.dtype
    bb = importer.block_builder
    if lo is not None:
        x = bb.emit(relax.op.maximum(x, _scalar_tensor(importer, lo, dtype)))
    if hi is not None:
        x = bb.emit(relax.op.minimum(x, _scalar_tensor(importer, hi, dtype)))
    return x


def convert_map(ctx: Lowering) -> dict:
    return {
        "fp8_linear.default": _fp8_linear(ctx),
        "fp8_linear_f32.default": _fp8_linear(ctx, "float32"),
        "all_reduce.default": _collective(ctx, "allreduce"),
        "all_gather.default": _collective(ctx, "allgather"),
        "fp8_dequant.default": _fp8_dequant(ctx),
        "sparse_attend.default": _sparse_attend(ctx, "fp4"),
        "sparse_attend_bf16.default": _sparse_attend(ctx, "bf16"),
        "indexer_topk.default": _indexer(ctx, "flat"),
        "indexer_topk_shared.default": _indexer_shared(ctx),
        "hier_topk.default": _indexer(ctx, "hier"),
        "pool_topk.default": _indexer(ctx, "pool"),
        "moe_experts.default": _moe_experts(ctx),
        "scatter_rows.default": _scatter_rows(ctx),
        "rms_norm.default": _rms_norm(ctx),
        "hc_pre_mix.default": _hc_pre_mix(ctx),
        "hc_post.default": _hc_post(ctx),
        "quant_fp8.default": _quant(ctx, "quant_fp8"),
        "quant_fp4_kv.default": _quant(ctx, "quant_fp4_kv"),
        "quant_mxfp4.default": _quant(ctx, "quant_mxfp4"),
        "qdq_mxfp4.default": _quant(ctx, "qdq_mxfp4"),
        "linear.default": _linear(ctx),
        "einsum.default": _einsum(ctx),
        "mean.dim": _mean,
        "amax.default": _amax,
        "copysign.Tensor": _copysign,
        "sort.stable": _sort_stable,
        "where.ScalarOther": _where_scalar(2),
        "where.ScalarSelf": _where_scalar(1),
        "clamp.default": _clamp,
        "to.dtype": _to_dtype,
        "_to_copy.default": _to_dtype,
        "type_as.default": _to_dtype,
    }


def lower(ep, target: TargetSpec, *, rows_hint: int | None = None,
          kernels: dict | None = None, bounds: dict[str, int] | None = None,
          ccl: CclBackend = CclBackend.DISCO, null_expert: bool = False,
          bounded_rows: bool = False) -> tvm.IRModule:
    """ExportedProgram -> Relax IRModule with one function `main`; weights stay parameters
    (`keep_params_as_input`), in the program's parameter order. `kernels`, when given, receives
    each kernel's key -> GlobalVar (what `dsv41 tune` maps back to the kernels' factories).
    `ccl`: the functions a sharded worker's collectives call; `null_expert`: a sharded worker's
    graph, whose expert stacks end with the null expert (its pairs skip the GEMMs);
    `bounded_rows`: the entry's calls have few rows (`build.BOUNDED_ROWS`), so the pool sweep
    may gather per query (`indexer.build_pool_topk`)."""
    from tvm.relax.frontend.torch import from_exported_program
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    ctx = Lowering(target, rows_hint, {} if kernels is None else kernels, ccl, null_expert,
                   bounded_rows)
    convert = ExportedProgramImporter._convert_pytorch_tensor_to_tvm

    def no_weight_copies(t):
        """Weights are captured as storage-less placeholders (`Model.placeholder`): keep them
        out of the module (the importer would copy every parameter into an attribute)."""
        if t.numel() > 1 and all(st == 0 for st in t.stride()):
            return tvm.runtime.empty((0,), str(t.dtype).replace("torch.", ""))
        return convert(t)

    ExportedProgramImporter._convert_pytorch_tensor_to_tvm = staticmethod(no_weight_copies)
    try:
        mod = from_exported_program(ep, keep_params_as_input=True, run_ep_decomposition=False,
                                    unwrap_unit_return_tuple=False,
                                    custom_convert_map=convert_map(ctx))
    finally:
        ExportedProgramImporter._convert_pytorch_tensor_to_tvm = staticmethod(convert)
    # The export's dim ranges (up to 1M tokens, 2M context, batch 64) would make Relax plan
    # every buffer statically at its upper bound; without them buffers are sized per call.
    # `bounds` (TIR var name -> upper bound; single-token entries, see capture.static_bounds)
    # instead plans every intermediate once, at those bounds: nothing sized by the context is
    # allocated per call.
    main = mod["main"]
    for attr in ("tir_var_upper_bound", "tir_var_lower_bound"):
        if main.attrs and attr in main.attrs:
            main = main.without_attr(attr)
    if bounds:
        main = main.with_attr("tir_var_upper_bound", bounds)
    mod["main"] = main
    return clip_takes(mod)


def clip_takes(mod: tvm.IRModule) -> tvm.IRModule:
    """Every `relax.take` in mode "fast" (the importer's default: an index out of range reads
    past the buffer, and TVM warns once per call site while building) becomes mode "clip". The
    runtime validates the ids and positions it feeds the entries, so in range nothing changes;
    an index the checks missed would read the nearest row, never outside the tensor."""
    take = tvm.ir.Op.get("relax.take")

    @relax.expr_functor.mutator
    class ClipTakes(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(take) and call.attrs.mode == "fast":
                return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
            return call

    out = mod
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            out[gv] = ClipTakes(mod).visit_expr(func)
    return out
