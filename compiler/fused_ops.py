"""The converters of the fused ops (graph/ops.py): each maps one `dsv41::` op that stands for
several of the unfused ops to its one kernel, or, where the target's kernel cannot take the fused
form, to the unfused kernels. `compiler.kernels` registers them with its registry's `build` (the
scheduled kernel of a key), which they take as an argument (that module imports this one)."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from dsv41.compiler.kernel_keys import (
    BF16,
    Fp8LinearKey,
    Fp8QkvKey,
    HcPostPreMixKey,
    KernelKey,
    RmsNormKey,
    RopeKey,
    RopeQuantKey,
    SparseAttendKey,
)
from dsv41.compiler.relax_ops import (
    Lowering,
    call,
    in_fp32,
    round_to_bf16,
    rows,
    shape,
    static,
    tensor,
    unrows,
)
from dsv41.graph.ops import ENTRY_GROUP, EntryFormat, entry_code_width
from dsv41.schedules import gemm

Builder = Callable[[KernelKey, str], tvm.tirx.PrimFunc]  # key, target name -> scheduled kernel


def normed_linear(ctx: Lowering, build: Builder, importer, x2, nw, eps: float, w, s):
    """fp8_linear of rows x2 RMS-normed by nw: one kernel where the target's fp8_linear norms
    its input (`gemm.fp8_linear_norms`), else the rms_norm kernel and then fp8_linear's."""
    n, k = (static(v) for v in shape(w))
    if gemm.fp8_linear_norms(ctx.target, n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows):
        key = Fp8LinearKey(n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows, norm_eps=eps)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        return call(importer, gv, [x2, nw, w, s], tensor([shape(x2)[0], n], BF16))
    nkey = RmsNormKey(d=k, eps=eps)
    ngv = ctx.kernel(importer, nkey, lambda: build(nkey, ctx.target.name))
    xn = call(importer, ngv, [x2, nw], tensor(shape(x2), BF16))
    key = Fp8LinearKey(n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows)
    gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
    return call(importer, gv, [xn, w, s], tensor([shape(x2)[0], n], BF16))


def paired_linears(ctx: Lowering, build: Builder, importer, x2, w, s, w2, s2) -> list:
    """[fp8_linear(x2, w), fp8_linear(x2, w2)]: one kernel where the target's fp8_linear is
    the AVX-512 BF16 decode GEMV (`gemm.fp8_linear_norms`), else two fp8_linear kernels."""
    n, k = (static(v) for v in shape(w))
    n2 = static(shape(w2)[0])
    m = shape(x2)[0]
    if all(gemm.fp8_linear_norms(ctx.target, n=nt, k=k, m=ctx.rows_hint, rows=ctx.verify_rows)
           for nt in (n, n2)):
        key = Fp8LinearKey(n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows, pair_n=n2)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        res = call(importer, gv, [x2, w, s, w2, s2], [tensor([m, n], BF16), tensor([m, n2], BF16)])
        return [importer.block_builder.emit(relax.TupleGetItem(res, i)) for i in range(2)]
    ys = []
    for wt, st, nt in ((w, s, n), (w2, s2, n2)):
        key = Fp8LinearKey(n=nt, k=k, m=ctx.rows_hint, rows=ctx.verify_rows)
        gv = ctx.kernel(importer, key, lambda key=key: build(key, ctx.target.name))
        ys.append(call(importer, gv, [x2, wt, st], tensor([m, nt], BF16)))
    return ys


def norm_fp8_linear(ctx: Lowering, build: Builder):
    """norm_fp8_linear (`normed_linear`)."""

    def convert(node, importer):
        x, nw = importer.env[node.args[0]], importer.env[node.args[1]]
        w, s = importer.env[node.args[3]], importer.env[node.args[4]]
        x2, lead = rows(importer, x, 1)
        return unrows(importer, normed_linear(ctx, build, importer, x2, nw, float(node.args[2]),
                                              w, s), lead)

    return convert


def fp8_linear_pair(ctx: Lowering, build: Builder):
    """fp8_linear_pair (`paired_linears`)."""

    def convert(node, importer):
        x, w, s, w2, s2 = (importer.env[a] for a in node.args[:5])
        x2, lead = rows(importer, x, 1)
        ys = paired_linears(ctx, build, importer, x2, w, s, w2, s2)
        bb = importer.block_builder
        return bb.emit(relax.Tuple([unrows(importer, y, lead) for y in ys]))

    return convert


def fp8_q_kv(ctx: Lowering, build: Builder):
    """fp8_q_kv: one kernel where `gemm.fp8_q_kv_fuses` (the pair and the normed wq_b GEMVs
    in turn, q_lora an output nothing reads), else `paired_linears` and `normed_linear`."""

    def convert(node, importer):
        x, wa, sa, wkv, skv, nw = (importer.env[a] for a in node.args[:6])
        eps = float(node.args[6])
        wb, sb = importer.env[node.args[7]], importer.env[node.args[8]]
        n_q, k = (static(v) for v in shape(wa))
        n_kv, n_b = static(shape(wkv)[0]), static(shape(wb)[0])
        x2, lead = rows(importer, x, 1)
        m = shape(x2)[0]
        bb = importer.block_builder
        if gemm.fp8_q_kv_fuses(ctx.target, n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, m=ctx.rows_hint,
                               rows=ctx.verify_rows):
            key = Fp8QkvKey(n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, norm_eps=eps, m=ctx.rows_hint,
                            rows=ctx.verify_rows)
            gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
            res = call(importer, gv, [x2, wa, sa, wkv, skv, nw, wb, sb],
                       [tensor([m, n_q], BF16), tensor([m, n_kv], BF16), tensor([m, n_b], BF16)])
            q, kv = (bb.emit(relax.TupleGetItem(res, i)) for i in (2, 1))
        else:
            q_lora, kv = paired_linears(ctx, build, importer, x2, wa, sa, wkv, skv)
            q = normed_linear(ctx, build, importer, q_lora, nw, eps, wb, sb)
        return bb.emit(relax.Tuple([unrows(importer, q, lead), unrows(importer, kv, lead)]))

    return convert


def swiglu_fp8_linear(ctx: Lowering, build: Builder):
    """swiglu_fp8_linear: one kernel where this target's fp8_linear can form its input
    (`gemm.fp8_linear_norms`), else the SwiGLU in Relax ops (the kernel's formula: clamps,
    g / (1 + exp(-g)) * u, bf16 by `round_to_bf16`) and then fp8_linear's kernel."""

    def convert(node, importer):
        gate, up = importer.env[node.args[0]], importer.env[node.args[1]]
        limit = float(node.args[2])
        w, s = importer.env[node.args[3]], importer.env[node.args[4]]
        n, k = (static(v) for v in shape(w))
        g2, lead = rows(importer, gate, 1)
        u2, _ = rows(importer, up, 1)
        m = shape(g2)[0]
        if gemm.fp8_linear_norms(ctx.target, n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows):
            key = Fp8LinearKey(n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows,
                               swiglu_limit=limit)
            gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
            return unrows(importer, call(importer, gv, [g2, u2, w, s], tensor([m, n], BF16)),
                          lead)
        h = round_to_bf16(importer, swiglu_values(importer, in_fp32(importer, g2),
                                                  in_fp32(importer, u2), limit))
        key = Fp8LinearKey(n=n, k=k, m=ctx.rows_hint, rows=ctx.verify_rows)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        return unrows(importer, call(importer, gv, [h, w, s], tensor([m, n], BF16)), lead)

    return convert


def swiglu_values(importer, g: relax.Expr, u: relax.Expr, limit: float) -> relax.Expr:
    """graph.ops.swiglu of fp32 g and u in Relax ops, as `common.silu_times` computes it."""
    bb = importer.block_builder

    def const(v: float) -> relax.Expr:
        return relax.const(v, "float32")

    if limit > 0:
        u = bb.emit(relax.op.maximum(relax.op.minimum(u, const(limit)), const(-limit)))
        g = bb.emit(relax.op.minimum(g, const(limit)))
    silu = bb.emit(relax.op.divide(g, relax.op.add(const(1.0), relax.op.exp(
        relax.op.negative(g)))))
    return bb.emit(relax.op.multiply(silu, u))


def sparse_attend_rope(ctx: Lowering, build: Builder):
    """sparse_attend_rope: on a CPU one kernel (q rotated as it is staged, the output rotated
    back as it is stored); on CUDA the rope, sparse_attend and inverse rope kernels in turn (the
    CUDA schedule reads q from global memory in QK, where a rotation would be redone per
    entry)."""

    def convert(node, importer):
        q, cos, sin = (importer.env[a] for a in node.args[:3])
        rd = int(node.args[3])
        rest = [importer.env[a] for a in node.args[4:11]]  # win.., kv codes, scales, idx, sink
        scale = float(node.args[11])
        _, _, h, d = shape(q)
        dims = dict(h=static(h), d=static(d), w=static(shape(rest[2])[-1]),
                    k=static(shape(rest[5])[-1]), softmax_scale=scale)
        if not ctx.target.is_cuda:
            key = SparseAttendKey(**dims, rope_rd=rd)
            gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
            return call(importer, gv, [q, cos, sin, *rest], tensor(shape(q), BF16))

        def rope_call(x, inverse: bool):
            rkey = RopeKey(h=dims["h"], d=dims["d"], rd=rd, inverse=inverse)
            rgv = ctx.kernel(importer, rkey, lambda: build(rkey, ctx.target.name))
            return call(importer, rgv, [x, cos, sin], tensor(shape(q), BF16))

        key = SparseAttendKey(**dims)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        o = call(importer, gv, [rope_call(q, False), *rest], tensor(shape(q), BF16))
        return rope_call(o, True)

    return convert


def rope_quant(ctx: Lowering, build: Builder):
    """New cache entries: norm (when the op has its weight), RoPE and quantiser, one kernel."""

    def convert(node, importer):
        x, cos, sin = (importer.env[a] for a in node.args[:3])
        rd, form = int(node.args[3]), EntryFormat(str(node.args[4]))
        weight = None if node.args[5] is None else importer.env[node.args[5]]
        b, s, d = shape(x)
        d = static(d)
        key = RopeQuantKey(d=d, rd=rd, form=form.value,
                           eps=None if weight is None else float(node.args[6]))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        out = [tensor([b, s, entry_code_width(form, d)], "uint8"),
               tensor([b, s, d // ENTRY_GROUP[form]], "uint8")]
        res = call(importer, gv, [x, cos, sin] + ([] if weight is None else [weight]), out)
        bb = importer.block_builder
        return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(res, i)) for i in range(2)]))

    return convert


def rope_quant_into(ctx: Lowering, build: Builder, *, window: bool):
    """New cache entries written straight into a cache, the codes and scales updated in place
    (`call_tir_inplace`, as `_scatter_rows`): `rope_quant_rows` (window False) writes only the
    rows idx names; `rope_quant_window` (True) first copies the ring into a new buffer, the
    entries after it (its codes and scales: two new outputs), then writes the ring's slots."""

    def convert(node, importer):
        codes, scales, rows, x, cos, sin = (importer.env[a] for a in node.args[:6])
        rd, form = int(node.args[6]), EntryFormat(str(node.args[7]))
        weight = None if node.args[8] is None else importer.env[node.args[8]]
        key = RopeQuantKey(d=static(shape(x)[2]), rd=rd, form=form.value,
                           eps=None if weight is None else float(node.args[9]),
                           into=not window, window=window)
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        args = [codes, scales, rows, x, cos, sin] + ([] if weight is None else [weight])
        out_ty, inplace = [codes.ty, scales.ty], [0, 1]
        if window:
            b, w, cw = shape(codes)
            buf = w + shape(x)[1]
            out_ty += [tensor([b, buf, cw], "uint8"), tensor([b, buf, shape(scales)[2]], "uint8")]
            inplace += [-1, -1]
        bb = importer.block_builder
        res = bb.emit(relax.call_tir_inplace(gv, args, inplace, out_ty=out_ty))
        return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(res, i))
                                    for i in range(len(out_ty))]))

    return convert


def hc_post_pre_mix(ctx: Lowering, build: Builder):
    """A block's attention exit and FFN entry (hc_post + hc_pre_mix) as one kernel."""

    def convert(node, importer):
        args = [importer.env[a] for a in node.args[:9]]
        hc, iters = int(node.args[9]), int(node.args[10])
        h = args[1]
        b, s, _, d = shape(h)
        key = HcPostPreMixKey(hc=hc, d=static(d), iters=iters, norm_eps=float(node.args[11]),
                              hc_eps=float(node.args[12]))
        gv = ctx.kernel(importer, key, lambda: build(key, ctx.target.name))
        f32 = "float32"
        out = [tensor(shape(h), BF16), tensor([b, s, d], BF16), tensor([b, s, hc], f32),
               tensor([b, s, hc], f32), tensor([b, s, hc, hc], f32)]
        res = call(importer, gv, args, out)
        bb = importer.block_builder
        return bb.emit(relax.Tuple([bb.emit(relax.TupleGetItem(res, i)) for i in range(5)]))

    return convert
