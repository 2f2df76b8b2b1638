"""The FP8 decode GEMV on AVX-512 BF16 (`gemm.make_fp8_gemv_bf16`) and its verify form.

Tolerance against the oracle (`ops.fp8_linear`): every product is exact in both, only the order
of the fp32 additions differs (all of K in vdpbf16ps pairs against 32-block partials times
scales), so >= 99% of outputs are bit-equal and the rest within 1 bf16 ulp (measured: n 32768
k 512, 1 of 32768 outputs 1 ulp off; n 1024 k 4096, all equal). The verify form (rows > 1) is
bit-identical, row by row, to the single-row kernel."""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import SKX, SPR, ZEN4, bf16_ulps, run_fp8_linear, swiglu_relax

from dsv41.graph import formats as fmt
from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.schedules import gemm
from dsv41.schedules.common import has_avx512_bf16, has_features
from dsv41.schedules.gemm.bf16_gemv import chunk_slot_source, make_fp8_gemv_bf16

CPU = get_target("cpu")
needs_bf16 = pytest.mark.skipif(
    not (has_avx512_bf16(CPU) and has_features(CPU, "avx512vbmi")),
    reason="this CPU has no AVX-512 BF16 + VBMI (vdpbf16ps, vpermi2b)")


@functools.cache
def _compiled(**kwargs):
    return tvm.compile(make_fp8_gemv_bf16(**kwargs), target=CPU.tvm_target())


def test_chunk_slots_are_a_permutation_in_32_blocks():
    """Each chunk's 64 slots take each code offset once; slots 16 g .. 16 g + 15 of either half
    come from 32-block g (the xs stage multiplies them by one scale)."""
    src = [chunk_slot_source(j) for j in range(64)]
    assert sorted(src) == list(range(64))
    assert src[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 16, 17]
    assert src[32:34] == [8, 9]
    for j in range(64):
        assert src[j] // 32 == (j % 32) // 16


@needs_bf16
@pytest.mark.parametrize("n,k", [(100, 64), (64, 512), (96, 4096)])
def test_bf16_gemv_matches_oracle(n, k):
    """>= 99% bit-equal, the rest 1 bf16 ulp; n 100: a partial last 32-column tile."""
    ex = _compiled(n=n, k=k, prefetch=2)
    for seed in (1, 2):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=seed)
        ulps = bf16_ulps(run_fp8_linear(ex, x, weight, scale), ops.fp8_linear(x, weight, scale))
        assert int(ulps.max()) <= 1
        assert float((ulps == 0).float().mean()) >= 0.99


@needs_bf16
def test_bf16_gemv_every_code_nan_and_subnormal_weights():
    """Column c holds E4M3 code c at every K (all 256 codes: subnormals, -0, the two NaNs);
    exact products and a sum of equal terms: every finite output equals the oracle's bits, the
    NaN codes' columns are the canonical NaN (0x7fc0), and nothing else is NaN."""
    n, k = 256, 128
    x, _, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=5)
    weight = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, k)
    out = run_fp8_linear(_compiled(n=n, k=k), x, weight, scale)
    ref = ops.fp8_linear(x, weight, scale)
    nan = torch.zeros(1, n, dtype=torch.bool)
    nan[0, 0x7F] = nan[0, 0xFF] = True
    assert torch.equal(out.isnan(), nan)
    assert out.view(torch.int16)[0, 0x7F] == 0x7FC0 and out.view(torch.int16)[0, 0xFF] == 0x7FC0
    assert int(bf16_ulps(out[~nan], ref[~nan]).max()) <= 1


@needs_bf16
@pytest.mark.parametrize("rows,k,out_dtype,fma_rows", [
    (6, 256, "bfloat16", False),  # the verify entry's (block 5)
    (6, 256, "bfloat16", True),  # ... its groups by FMA pairs (Intel with AMX)
    (2, 4096, "bfloat16", False),  # wo_b's K
    # groups of 5 rows: 20 KB of activations, columns in pairs (slow: ~15 s of compiles)
    pytest.param(5, 2048, "bfloat16", False, marks=pytest.mark.slow),
    pytest.param(3, 256, "float32", True, marks=pytest.mark.slow),
    # FMA pairs: columns one at a time for 2 and 6..8 rows, in pairs for 3..5
    pytest.param(8, 4096, "bfloat16", True, marks=pytest.mark.slow),
    pytest.param(6, 4096, "bfloat16", False, marks=pytest.mark.slow)])
def test_bf16_gemv_rows_bit_identical_to_single_row(rows, k, out_dtype, fma_rows):
    """Every row of the verify form equals the decode kernel on that row alone, bit for bit:
    m = 1..7 and 13 (one group, full or partial; several groups, a partial last one), n not a
    multiple of 32, a NaN column, an all-zero row (the amax floor), a row near the bf16 top;
    fma_rows: groups of 2+ rows by FMA pairs (`dpbf16ps_by_fma`) against vdpbf16ps alone."""
    n = 100
    dtype = torch.bfloat16 if out_dtype == "bfloat16" else torch.float32
    bits = torch.int16 if out_dtype == "bfloat16" else torch.int32
    one = _compiled(n=n, k=k, out_dtype=out_dtype, prefetch=3)
    multi = _compiled(n=n, k=k, out_dtype=out_dtype, prefetch=3, rows=rows, fma_rows=fma_rows)
    for m in (1, 2, 3, 5, 6, 7, 13):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        weight[40, 77] = 0x7F  # a NaN column
        x[m // 2] = 0
        x[-1, :32] = torch.tensor(3.0e38).to(torch.bfloat16)
        out = run_fp8_linear(multi, x, weight, scale, dtype)
        for i in range(m):
            ref = run_fp8_linear(one, x[i:i + 1].clone(), weight, scale, dtype)
            assert torch.equal(out[i:i + 1].view(bits), ref.view(bits)), (m, i)
        assert int(out.isnan().sum()) == m  # column 40 of every row, nothing else


def test_bf16_gemv_refuses_bad_shapes():
    for rows in (0, 9):
        with pytest.raises(ValueError, match=f"The fp8 GEMV takes 1..8 rows per group; got "
                                             f"rows={rows}."):
            make_fp8_gemv_bf16(n=64, k=256, rows=rows)
    with pytest.raises(ValueError, match="The bf16 fp8 GEMV needs k a multiple of 64, got 96."):
        make_fp8_gemv_bf16(n=64, k=96)
    with pytest.raises(ValueError, match="prefetch must be >= 0 columns; got -1."):
        make_fp8_gemv_bf16(n=64, k=64, prefetch=-1)


def test_config_picks_the_bf16_gemv_where_the_target_has_it():
    """AVX-512 BF16 + VBMI (Zen 4): the bf16 kernel for decode, verify and draft at every K a
    multiple of 64 (k 4096 included: wo_b's verify form); AVX-512 without BF16 and the baseline
    x86-64 keep their kernels."""
    cfg = gemm.fp8_linear_config(ZEN4, n=32768, k=512, m=1)
    assert (cfg.kind, cfg.dot, cfg.rows, cfg.prefetch) == ("gemv_avx512", "bf16", 1, 16)
    cfg = gemm.fp8_linear_config(ZEN4, n=1024, k=4096, m=1, rows=6)
    assert (cfg.kind, cfg.dot, cfg.rows, cfg.prefetch) == ("gemv_avx512", "bf16", 6, 2)
    assert gemm.fp8_linear_config(ZEN4, n=64, k=512, m=1, rows=9).rows == 8
    assert gemm.fp8_linear_config(ZEN4, n=64, k=96, m=1).kind == "gemv"  # k % 64
    assert gemm.fp8_linear_config(ZEN4, n=64, k=512, m=4).kind == "gemm"
    assert gemm.fp8_linear_config(SKX, n=64, k=512, m=1).dot == "fp32"
    assert gemm.fp8_linear_config(get_target("cpu-x86-64"), n=64, k=512, m=1).kind == "gemv"


@needs_bf16
@pytest.mark.parametrize("rows", [1, 6])
def test_normed_gemv_is_the_rms_norm_kernel_then_the_gemv(rows):
    """norm_fp8_linear's kernel (the bf16 GEMV norming its input rows first): every output the
    rms_norm kernel's rows fed to the plain GEMV, bit for bit, one row and the verify's groups
    (m 1..7 against a group of 6), with a row of large values and a zero row (the norm's eps
    alone), and the op's oracle is the two ops in turn."""
    from dsv41.schedules import norm

    n, k, eps = 96, 512, 1e-6
    lanes = norm.norm_config(get_target("cpu"), d=k).lanes
    fused = _compiled(n=n, k=k, rows=rows, norm_eps=eps, norm_lanes=lanes)
    plain = _compiled(n=n, k=k, rows=rows)
    rms = tvm.compile(norm.build_rms_norm("cpu", d=k, eps=eps),
                      target=get_target("cpu").tvm_target())
    weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=5)[1:]
    g = torch.Generator().manual_seed(rows)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16)
    for m in (1, 5, 7):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[0, ::11] *= 1e15
        x[-1] = 0.0
        xn = torch.empty_like(x)
        rms(tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(w),
            tvm.runtime.from_dlpack(xn))
        want = run_fp8_linear(plain, xn, weight, scale)
        got = torch.zeros(m, n, dtype=torch.bfloat16)
        fused(*[tvm.runtime.from_dlpack(t) for t in (x, w, weight, scale, got)])
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
    ref = ops.norm_fp8_linear(x, w, eps, weight, scale)
    assert torch.equal(ref, ops.fp8_linear(ops.rms_norm(x, w, eps), weight, scale))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_gemv_is_the_swiglu_then_the_gemv(rows, limit):
    """swiglu_fp8_linear's kernel (the bf16 GEMV forming bf16(swiglu(gate, up)) as it stages its
    rows): every output the plain GEMV's on the lowering's own SwiGLU (`swiglu_relax`, what
    other targets run), bit for bit, one row and the verify's groups (m 1..7 against a group of
    6), with clamped values (|x| > limit), large negative gates (silu -> -0) and a zero row;
    against the op's oracle (torch's exp) within 1 bf16 ulp, 99% of outputs exact."""
    n, k = 96, 512
    fused = _compiled(n=n, k=k, rows=rows, swiglu_limit=limit)
    plain = _compiled(n=n, k=k, rows=rows)
    weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=8)[1:]
    g = torch.Generator().manual_seed(rows + int(limit))
    swiglu = swiglu_relax(limit, k)
    for m in (1, 5, 7):
        gate = (torch.randn(m, k, generator=g) * 6).to(torch.bfloat16)
        up = (torch.randn(m, k, generator=g) * 6).to(torch.bfloat16)
        gate[0, ::13] = -200.0
        up[-1] = 0.0
        h = torch.from_dlpack(swiglu["main"](tvm.runtime.from_dlpack(gate),
                                             tvm.runtime.from_dlpack(up)))
        want = run_fp8_linear(plain, h, weight, scale)
        got = torch.zeros(m, n, dtype=torch.bfloat16)
        fused(*[tvm.runtime.from_dlpack(t) for t in (gate, up, weight, scale, got)])
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
        ref = ops.swiglu_fp8_linear(gate, up, limit, weight, scale)
        ulps = bf16_ulps(got, ref)
        assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) >= 0.99, m
    assert torch.equal(ref, ops.fp8_linear(
        ops.swiglu(gate.float(), up.float(), limit).to(torch.bfloat16), weight, scale))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 6])
def test_q_kv_kernel_is_the_pair_then_the_normed_gemv(rows):
    """fp8_q_kv's kernel (the paired wq_a / wkv GEMV, then q_lora normed into the wq_b GEMV,
    one call): q_lora, kv and q the decode `fp8_linear_pair` and `norm_fp8_linear` kernels'
    (each row of the verify's groups equals them: tests above), bit for bit, m 1..7 against
    groups of 1 and 6, partial 32-column tiles in every matrix; the op's oracle is the two ops
    in turn."""
    n_q, n_kv, k, n_b, eps = 64, 40, 256, 72, 1e-6
    assert gemm.fp8_q_kv_fuses(CPU, n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, m=1, rows=rows)
    target = CPU.tvm_target()
    fused = tvm.compile(gemm.build_fp8_q_kv("cpu", n_q=n_q, n_kv=n_kv, k=k, n_b=n_b,
                                            norm_eps=eps, m=1, rows=rows), target=target)
    pair = tvm.compile(gemm.build_fp8_linear("cpu", n=n_q, k=k, m=1, pair_n=n_kv),
                       target=target)
    normed = tvm.compile(gemm.build_fp8_linear("cpu", n=n_b, k=n_q, m=1, norm_eps=eps),
                         target=target)
    wa, sa = gemm.example_inputs_fp8_linear(m=1, n=n_q, k=k, seed=11)[1:]
    wkv, skv = gemm.example_inputs_fp8_linear(m=1, n=n_kv, k=k, seed=12)[1:]
    wb, sb = gemm.example_inputs_fp8_linear(m=1, n=n_b, k=n_q, seed=13)[1:]
    g = torch.Generator().manual_seed(rows)
    nw = (1 + 0.1 * torch.randn(n_q, generator=g)).to(torch.bfloat16)

    def run(f, *ts):
        f(*[tvm.runtime.from_dlpack(t) for t in ts])

    for m in (1, 5, 7):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[-1] = 0.0
        q_lora, kv, q = (torch.zeros(m, c, dtype=torch.bfloat16) for c in (n_q, n_kv, n_b))
        run(fused, x, wa, sa, wkv, skv, nw, wb, sb, q_lora, kv, q)
        ql2, kv2, q2 = (torch.zeros(m, c, dtype=torch.bfloat16) for c in (n_q, n_kv, n_b))
        run(pair, x, wa, sa, wkv, skv, ql2, kv2)
        run(normed, ql2, nw, wb, sb, q2)
        for got, want in ((q_lora, ql2), (kv, kv2), (q, q2)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
    ref_q, ref_kv = ops.fp8_q_kv(x, wa, sa, wkv, skv, nw, eps, wb, sb)
    ql, kvr = ops.fp8_linear_pair(x, wa, sa, wkv, skv)
    assert torch.equal(ref_kv, kvr)
    assert torch.equal(ref_q, ops.norm_fp8_linear(ql, nw, eps, wb, sb))
    with pytest.raises(ValueError, match="only where the hand decode GEMV"):
        gemm.build_fp8_q_kv("cpu-x86-64", n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, norm_eps=eps, m=1)


def test_only_the_hand_gemvs_and_the_bf16_gemm_norm_their_input():
    base = get_target("cpu-x86-64")
    assert gemm.fp8_linear_norms(ZEN4, n=32768, k=512, m=1)
    assert gemm.fp8_linear_norms(ZEN4, n=32768, k=512, m=1, rows=6)
    assert gemm.fp8_linear_norms(SKX, n=32768, k=512, m=1)  # the hand GEMV (fp32 sums)
    assert not gemm.fp8_linear_norms(SKX, n=32768, k=4096, m=1)  # the scheduled one
    assert gemm.fp8_q_kv_fuses(SKX, n_q=512, n_kv=576, k=1024, n_b=32768, m=1)
    assert not gemm.fp8_q_kv_fuses(SKX, n_q=512, n_kv=576, k=4096, n_b=32768, m=1)
    assert gemm.fp8_linear_norms(ZEN4, n=32768, k=512, m=None)  # prefill: the bf16 GEMM
    assert not gemm.fp8_linear_norms(SPR, n=32768, k=512, m=None)  # AMX: its own GEMM
    with pytest.raises(ValueError, match="norms its input .or pairs two matrices, or forms a "
                                         "SwiGLU. only"):
        gemm.unscheduled_fp8_linear(base, n=64, k=512, m=1, norm_eps=1e-6)
    with pytest.raises(ValueError, match="lanes dividing"):
        make_fp8_gemv_bf16(n=64, k=512, norm_eps=1e-6, norm_lanes=24)
    with pytest.raises(ValueError, match="forms a SwiGLU"):
        gemm.unscheduled_fp8_linear(base, n=64, k=512, m=1, swiglu_limit=10.0)
    with pytest.raises(ValueError, match="SwiGLU fp8 GEMV takes no norm"):
        make_fp8_gemv_bf16(n=64, k=512, norm_eps=1e-6, swiglu_limit=10.0)


@needs_bf16
@pytest.mark.parametrize("rows,n,n2", [(1, 512, 512), (6, 512, 512), (1, 96, 200), (6, 40, 64)])
def test_paired_gemv_is_the_two_gemvs(rows, n, n2):
    """fp8_linear_pair's kernel (one activation quantisation, the first matrix's 32-column tiles
    then the second's): both outputs the plain GEMV's on each matrix, bit for bit, one row and
    the verify's groups, matrices of different heights with partial tiles; the op's oracle is
    the two fp8_linear ops."""
    k = 512
    pair = _compiled(n=n, k=k, rows=rows, pair_n=n2)
    one, two = _compiled(n=n, k=k, rows=rows), _compiled(n=n2, k=k, rows=rows)
    w, s = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=6)[1:]
    g2 = torch.Generator().manual_seed(7)  # another scale per tile than the first matrix's
    w2, s2 = (torch.from_numpy(a).clone() for a in fmt.np_quant_fp8_weight(
        (torch.randn(n2, k, generator=g2) * torch.exp2(torch.randint(-6, 7, (n2, 1),
                                                                     generator=g2))).numpy()))
    assert not torch.equal(s2[: s.size(0)], s[: s2.size(0)])
    g = torch.Generator().manual_seed(rows + n2)
    for m in (1, 5, 7):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        y, y2 = torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n2, dtype=torch.bfloat16)
        pair(*[tvm.runtime.from_dlpack(t) for t in (x, w, s, w2, s2, y, y2)])
        assert torch.equal(y.view(torch.int16), run_fp8_linear(one, x, w, s).view(torch.int16))
        assert torch.equal(y2.view(torch.int16), run_fp8_linear(two, x, w2, s2).view(torch.int16))
    ref = ops.fp8_linear_pair(x, w, s, w2, s2)
    assert torch.equal(ref[0], ops.fp8_linear(x, w, s))
    assert torch.equal(ref[1], ops.fp8_linear(x, w2, s2))
    with pytest.raises(ValueError, match="pair_n > 0 and no norm"):
        make_fp8_gemv_bf16(n=n, k=k, pair_n=n2, norm_eps=1e-6)
