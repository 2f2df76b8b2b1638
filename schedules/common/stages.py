"""TIR stages several kernels repeat, as `@T.macro`s: a block amax and its E8M0 scale byte, a
sum of squares in strided lane partials, one row's RMSNorm in plain loops, one Sinkhorn
normalisation pass, a sum over K in padded row groups.

Each macro emits exactly the blocks (names, loop order, dtypes) its callers wrote inline, so a
kernel's TIR is the same with the macro as without; what varies between callers (how an element
is read, how the amax becomes a byte) comes in as a plain Python function of buffers and
indices, called while the macro is expanded.

Each function here returns a fresh macro, to be expanded once: TVM counts the expansions of one
macro object (process-wide) and suffixes the block names of the second and later ones (`amax_1`),
which the schedules, looking blocks up by name, would not find.
"""

from __future__ import annotations

from tvm.script import tirx as T

from dsv41.schedules.common.exprs import bf16_to_f32, round_bf16


def abs_bits_amax_scale_byte():
    """Row i, group g: amax[i, g] = the largest `abs_bits(x, i, col)` (int32 bits of |value|,
    which order as the values do) over the group's `block` columns, then sbyte[i, g] =
    `scale_byte(amax as fp32)` (blocks `amax`, `sbyte`)."""

    @T.macro
    def abs_bits_amax_scale_byte_(amax, sbyte, x, i, g, block, abs_bits, scale_byte):
        for j in range(block):
            with T.sblock("amax"):
                vi, vg, vj = T.axis.remap("SSR", [i, g, j])
                with T.init():
                    amax[vi, vg] = T.int32(0)
                amax[vi, vg] = T.max(amax[vi, vg], abs_bits(x, vi, vg * block + vj))
        with T.sblock("sbyte"):
            vi, vg = T.axis.remap("SS", [i, g])
            sbyte[vi, vg] = scale_byte(T.reinterpret("float32", amax[vi, vg]))

    return abs_bits_amax_scale_byte_


def block_amax():
    """amax[i, b] = max |value(x, i, col)| over the `block` columns of block b, from the lowest
    fp32 (block `amax`): what the E8M0 scale byte of an activation block is taken from."""

    @T.macro
    def block_amax_(amax, x, rows, blocks, block, value):
        for i, b, j in T.grid(rows, blocks, T.int64(block)):
            with T.sblock("amax"):
                vi, vb, vj = T.axis.remap("SSR", [i, b, j])
                with T.init():
                    amax[vi, vb] = T.min_value("float32")
                amax[vi, vb] = T.max(amax[vi, vb], T.fabs(value(x, vi, vb * block + vj)))

    return block_amax_


def lane_sum_of_squares():
    """total[0] = the sum of squares of elem(src, vb, vs, k) for k < lanes * steps, as `lanes`
    strided partials (part[l] sums k = l, l + lanes, ...) added in lane order: blocks names[0]
    (the partials) and names[1] (their sum)."""

    @T.macro
    def lane_sum_of_squares_(part, total, lanes, steps, elem, src, vb, vs, names):
        for ln, kk in T.grid(lanes, steps):
            with T.sblock(names[0]):
                vl, vk = T.axis.remap("SR", [ln, kk])
                with T.init():
                    part[vl] = T.float32(0)
                part[vl] = part[vl] + elem(src, vb, vs, vk * lanes + vl) \
                    * elem(src, vb, vs, vk * lanes + vl)
        for ln in range(lanes):
            with T.sblock(names[1]):
                vl = T.axis.remap("R", [ln])
                with T.init():
                    total[0] = T.float32(0)
                total[0] = total[0] + part[vl]

    return lane_sum_of_squares_


def rms_norm_row(*, vec: int):
    """The RMSNorm of one row in plain loops (no blocks), for a kernel that norms its input
    itself: `norm.make_rms_norm`'s arithmetic step for step, so its bits. part[l] sums the
    squares of value(c) for c = l, l + lanes, .. in order, the partials are added in lane order
    into ssq[0], which becomes rstd = rsqrt(ssq / d + eps), and out[at(c)] takes
    round_bf16(w[c] * (value(c) * rstd)) (the bf16 value as fp32). `vec`: loops of that many
    lanes vectorised (1: scalar; it divides `lanes` and d). value(c) is a plain Python function of
    the element index (fp32), at(c) the indices of out that element c goes to."""

    loop = T.vectorized if vec > 1 else T.serial

    @T.macro
    def rms_norm_row_(out, at, part, ssq, value, weight, d, eps, lanes):
        for l0 in range(T.int64(lanes // vec)):
            for l1 in loop(T.int64(vec)):
                part[l0 * vec + l1] = T.float32(0)
        for k, l0 in T.grid(T.int64(d // lanes), T.int64(lanes // vec)):
            for l1 in loop(T.int64(vec)):
                part[l0 * vec + l1] = part[l0 * vec + l1] \
                    + value(k * lanes + l0 * vec + l1) * value(k * lanes + l0 * vec + l1)
        ssq[0] = T.float32(0)
        for ln in range(T.int64(lanes)):
            ssq[0] = ssq[0] + part[ln]
        ssq[0] = T.rsqrt(ssq[0] / T.float32(d) + T.float32(eps))  # now rstd
        for c0 in range(T.int64(d // vec)):
            for c1 in loop(T.int64(vec)):
                out[at(c0 * vec + c1)] = round_bf16(bf16_to_f32(weight[c0 * vec + c1]) * (
                    value(c0 * vec + c1) * ssq[0]))

    return rms_norm_row_


def sinkhorn_pass():
    """One Sinkhorn pass over the n x n matrix cb: rows divided by their sums, then columns by
    theirs, eps added as the oracle does (the first pass, after the softmax: cb / rs + eps; later
    passes: cb / (rs + eps)). Blocks rsum, rnorm, csum, cnorm, each name + `suffix`."""

    @T.macro
    def sinkhorn_pass_(cb, rs, cs, n, eps, first, suffix):
        for i, j in T.grid(n, n):
            with T.sblock("rsum" + suffix):
                vi, vj = T.axis.remap("SR", [i, j])
                with T.init():
                    rs[vi] = T.float32(0)
                rs[vi] = rs[vi] + cb[vi, vj]
        for i, j in T.grid(n, n):
            with T.sblock("rnorm" + suffix):
                vi, vj = T.axis.remap("SS", [i, j])
                if first:
                    cb[vi, vj] = cb[vi, vj] / rs[vi] + T.float32(eps)
                else:
                    cb[vi, vj] = cb[vi, vj] / (rs[vi] + T.float32(eps))
        for j, i in T.grid(n, n):
            with T.sblock("csum" + suffix):
                vj, vi = T.axis.remap("SR", [j, i])
                with T.init():
                    cs[vj] = T.float32(0)
                cs[vj] = cs[vj] + cb[vi, vj]
        for i, j in T.grid(n, n):
            with T.sblock("cnorm" + suffix):
                vi, vj = T.axis.remap("SS", [i, j])
                cb[vi, vj] = cb[vi, vj] / (cs[vj] + T.float32(eps))

    return sinkhorn_pass_


def padded_row_groups():
    """acc[i, g, c] = the sum over j < k of xval(x, row, g, j) * wval(w, g, c, j) for every row
    i of whole groups of `rows` rows (row = i, except that the last group reads row m - 1 again
    for its missing rows, so no loop carries a predicate), then y[i, g, c] = acc[i, g, c] for
    the m real rows (blocks `acc`, `y`): the row-group definition the dense GEMV's verify form
    and the dense GEMM's row tiles share."""

    @T.macro
    def padded_row_groups_(acc, y, x, w, m, groups, n, k, rows, xval, wval):
        for io, ii, g, c, j in T.grid((m + rows - T.int64(1)) // rows, rows, groups, n, k):
            with T.sblock("acc"):
                vo, vi, vg, vc, vj = T.axis.remap("SSSSR", [io, ii, g, c, j])
                with T.init():
                    acc[vo * rows + vi, vg, vc] = T.float32(0)
                acc[vo * rows + vi, vg, vc] = acc[vo * rows + vi, vg, vc] + xval(
                    x, T.min(vo * rows + vi, m - T.int64(1)), vg, vj) * wval(w, vg, vc, vj)
        for i, g, c in T.grid(m, groups, n):
            with T.sblock("y"):
                vi, vg, vc = T.axis.remap("SSS", [i, g, c])
                y[vi, vg, vc] = acc[vi, vg, vc]

    return padded_row_groups_
