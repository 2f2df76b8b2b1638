"""Sparse gather-attend kernels (schedules/attention.py) against the torch oracles
`dsv41::sparse_attend` and `dsv41::sparse_attend_bf16`.

Tolerance: the kernels keep the oracle's block structure (64-entry online-softmax blocks, the
same running max and rescale points, p rounded to bf16 before PV, the sink in the denominator
only, acc * rescale + pv), so the only differences are fp32 summation orders inside the dot
products and sums (torch's einsum/BLAS order is not reproducible). A logit a few fp32 ulps off
can flip the bf16 rounding of its p (a relative change of up to 2^-8), which moves the output
by up to 2^-9 * (p_j / denom) * |v_j|; with a peaked distribution that approaches 2^-9 of the
row's scale (measured: up to 2^-12 of the row's largest value at the bench size). So we require
every element within one bf16 ulp of the oracle's value plus 2^-10 of the largest |value| of its
(b, s, h) row, and at least 99% of elements bit-identical (measured 99.6-99.9% at the bench
size, 100% at the small one).
Rows with no valid entry must be exactly 0.

On a CPU with AVX-512 BF16 the kernels' QK and PV run on vdpbf16ps (schedules/attention/
bf16_dot.py) wherever a task has a multiple of 16 heads: the same exact products, summed in
pairs, denormals flushed. The same tolerance holds (measured at the bench size: 99.98% of
elements bit-identical at s = 1, 99.7% at s = 4; at most one bf16 ulp off). The edge cases run
at h = 4 (the fp32 FMA path on every CPU) and at h = 16 (the bf16-dot path where the CPU has it).
On a CPU with AMX-BF16 they run on tiles (amx_dot.py) wherever a task has a multiple of 32
heads (the bench size, and the 32-head cases below): the same products, the same tolerance
(measured on a Xeon with AMX at the bench size: 99.8% bit-identical at s = 1, 99.9% at s = 5,
at most one bf16 ulp off).
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_tvm
from dsv41.schedules import attention as A
from dsv41.schedules.common import (
    e4m3_to_f32_select,
    fp4_to_f32,
    has_amx_bf16,
    has_avx512,
    has_avx512_bf16,
)

SMALL = dict(h=4, d=64)
BENCH = dict(h=64, d=512, w=128, k=512)
CPU_BF16_DOT = has_avx512_bf16(get_target("cpu"))
CPU_AMX_DOT = CPU_BF16_DOT and has_amx_bf16(get_target("cpu"))


@pytest.fixture(params=[4, 16], ids=["fp32-dot", "bf16-dot"])
def small(request) -> dict:
    """The small size at 4 heads (QK and PV on fp32 FMAs) and at 16 (one task of 16 heads:
    vdpbf16ps on a CPU with AVX-512 BF16)."""
    return dict(h=request.param, d=64)


@functools.cache
def _kernel(kind: str, h: int, d: int, w: int, k: int, heads_per_group: int | None = None,
            stage_rows: int | None = None, fp32_dot: bool = False,
            chunk_rows: int | None = None):
    """Compiled CPU kernel, once per test session. Without explicit structure the config
    chooser's; with it (stage_rows < 64) the CUDA-like restaging structure runs on the CPU;
    fp32_dot: the chooser's config with QK and PV on fp32 FMAs (bf16_dot, amx_dot off);
    chunk_rows: the chooser's config with that many rows prestaged at a time (bf16-dot path)."""
    target = get_target("cpu")
    dims = dict(h=h, d=d, w=w, k=k, softmax_scale=d**-0.5)
    if chunk_rows is not None:
        cfg = A.sparse_attend_config(target, h=h, d=d)
        make = A.make_sparse_attend if kind == "fp4" else A.make_sparse_attend_bf16
        func = A.schedule_sparse_attend(
            make(**dims, heads_per_group=cfg.heads_per_group, stage_rows=cfg.stage_rows,
                 vector_decode=cfg.vector_decode, bf16_dot=cfg.bf16_dot,
                 chunk_rows=chunk_rows, amx_dot=cfg.amx_dot), cfg, target)
    elif fp32_dot:
        cfg = dataclasses.replace(A.sparse_attend_config(target, h=h, d=d), bf16_dot=False,
                                  amx_dot=False)
        make = A.make_sparse_attend if kind == "fp4" else A.make_sparse_attend_bf16
        func = A.schedule_sparse_attend(
            make(**dims, heads_per_group=cfg.heads_per_group, stage_rows=cfg.stage_rows,
                 vector_decode=cfg.vector_decode), cfg, target)
    elif heads_per_group is None:
        func = (A.build_sparse_attend if kind == "fp4" else A.build_sparse_attend_bf16)(
            "cpu", **dims)
    else:
        cfg = dataclasses.replace(A.sparse_attend_config(target, h=h, d=d),
                                  heads_per_group=heads_per_group, stage_rows=stage_rows,
                                  vector_decode=False)
        make = A.make_sparse_attend if kind == "fp4" else A.make_sparse_attend_bf16
        func = A.schedule_sparse_attend(
            make(**dims, heads_per_group=heads_per_group, stage_rows=stage_rows), cfg, target)
    return tvm.compile(func, target=target.tvm_target())


def _run(ex, inputs: list[torch.Tensor]) -> torch.Tensor:
    b, s, h, d = inputs[0].shape
    out = tvm.runtime.tensor(np.zeros((b, s, h, d), ml_dtypes.bfloat16))
    ex(*[to_tvm(x) for x in inputs], out)
    return torch.from_numpy(out.numpy().view(np.int16)).view(torch.bfloat16)


def _oracle(kind: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    op = ops.sparse_attend if kind == "fp4" else ops.sparse_attend_bf16
    return op(*inputs, inputs[0].size(-1) ** -0.5)


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, min_exact: float = 0.99) -> None:
    g, r = got.float(), ref.float()
    assert torch.isfinite(g).all(), "kernel produced non-finite values"
    _, exp = torch.frexp(r)  # |r| = m * 2^exp, m in [0.5, 1): one bf16 ulp is 2^(exp - 8)
    row = r.abs().amax(dim=-1, keepdim=True)  # (b, s, h, 1)
    bound = torch.ldexp(torch.ones_like(r), exp - 8) + row * 2.0**-10
    over = (g - r).abs() > bound
    assert not over.any(), (f"{int(over.sum())} elements differ by more than one bf16 ulp; "
                            f"max abs diff {(g - r).abs().max().item():.3g}")
    exact = (got == ref).float().mean().item()
    assert exact >= min_exact, f"only {exact:.4f} of elements are bit-identical"


def _check(kind: str, dims: dict, inputs: list[torch.Tensor], **structure) -> torch.Tensor:
    got = _run(_kernel(kind, **dims, **structure), inputs)
    ref = _oracle(kind, inputs)
    _assert_matches(got, ref)
    return got


def _inputs(kind: str = "fp4", **kw) -> list[torch.Tensor]:
    return A.example_inputs_sparse_attend(global_format=kind, **kw)


# ---- numerics at the small size --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp4", "bf16"])
@pytest.mark.parametrize("k", [8, 16])
def test_small_batch2_different_patterns(kind, k, small):
    dims = dict(**small, w=16, k=k)
    inputs = _inputs(kind, b=2, s=3, **dims, n=40, context=20, seed=1)
    idx = inputs[-2]  # kv_idx: give batch 1 a different, partly skipped selection
    idx[1] = torch.flip(idx[1], dims=[-1])
    idx[1, :, ::3] = -1
    win = inputs[3]
    win[1, :, :5] = -1
    got = _check(kind, dims, inputs)
    assert not torch.equal(got[0], got[1])


def test_one_token(small):
    dims = dict(**small, w=16, k=8)
    _check("fp4", dims, _inputs(b=1, s=1, **dims, n=12, seed=2))


def test_context_shorter_than_window(small):
    """A young sequence: most window rows are -1 (and the first query sees a single entry)."""
    dims = dict(**small, w=16, k=8)
    inputs = _inputs(b=1, s=4, **dims, n=5, context=0, seed=3)
    assert (inputs[3] < 0).any() and (inputs[-2] < 0).any()
    _check("fp4", dims, inputs)


def test_partial_last_block(small):
    """70 entries per query: one full 64-block and a 6-entry block (window + global mixed in
    the first block)."""
    dims = dict(**small, w=16, k=54)
    _check("fp4", dims, _inputs(b=2, s=2, **dims, n=100, seed=4))


def test_empty_global_selection(small):
    """All global indices -1, from a global store with no rows at all (N = 0). The oracle's
    gather cannot index an empty table, so it sees one zero row instead (never selected)."""
    dims = dict(**small, w=16, k=8)
    inputs = _inputs(b=2, s=2, **dims, n=0, seed=5)
    assert (inputs[-2] == -1).all() and inputs[4].size(1) == 0
    got = _run(_kernel("fp4", **dims), inputs)
    padded = list(inputs)
    padded[4] = torch.zeros(2, 1, inputs[4].size(2), dtype=torch.uint8)
    padded[5] = torch.zeros(2, 1, inputs[5].size(2), dtype=torch.uint8)
    _assert_matches(got, _oracle("fp4", padded))


def test_window_only_kernel(small):
    """k = 0: no global list at all (a local-only layer)."""
    dims = dict(**small, w=16, k=0)
    inputs = _inputs(b=1, s=2, **dims, n=4, seed=6)
    assert inputs[-2].shape[-1] == 0
    _check("fp4", dims, inputs)


def test_global_only_kernel(small):
    dims = dict(**small, w=0, k=16)
    _check("fp4", dims, _inputs(b=1, s=2, **dims, n=30, seed=7))


@pytest.mark.parametrize("kind", ["fp4", "bf16"])
def test_all_skipped_gives_zero(kind, small):
    dims = dict(**small, w=16, k=8)
    inputs = _inputs(kind, b=2, s=2, **dims, n=10, seed=8)
    inputs[3].fill_(-1)
    inputs[-2].fill_(-1)
    got = _run(_kernel(kind, **dims), inputs)
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(got, _oracle(kind, inputs))


def test_some_rows_fully_skipped(small):
    """Query 0 of batch 1 has no valid entry (zero row), its neighbours do."""
    dims = dict(**small, w=16, k=8)
    inputs = _inputs(b=2, s=2, **dims, n=10, seed=9)
    inputs[3][1, 0] = -1
    inputs[-2][1, 0] = -1
    got = _check("fp4", dims, inputs)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))
    assert got[1, 1].abs().sum() > 0


@pytest.mark.parametrize("kind", ["fp4", "bf16"])
def test_restaged_structure(kind):
    """The CUDA kernel's structure (2 heads per group, 8 staged rows, PV restaging the rows)
    run on the CPU, so its arithmetic is checked here even without a GPU."""
    dims = dict(**SMALL, w=16, k=54)
    _check(kind, dims, _inputs(kind, b=2, s=2, **dims, n=80, seed=10),
           heads_per_group=2, stage_rows=8)


# ---- numerics at the bench size (h = 64, d = 512, 128 window + 512 selected) ---------------


@pytest.mark.parametrize("s", [1, 4])
def test_bench_size_fp4(s):
    inputs = _inputs(b=1, s=s, **BENCH, seed=11)
    _check("fp4", BENCH, inputs)


def test_bench_size_bf16():
    _check("bf16", BENCH, _inputs("bf16", b=1, s=2, **BENCH, seed=12))


def test_bench_size_fp32_dot():
    """QK and PV on fp32 FMAs (CPUs without AVX-512 BF16) at the bench size."""
    _check("fp4", BENCH, _inputs(b=1, s=1, **BENCH, seed=11), fp32_dot=True)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64")
                    or "avx2" not in Path("/proc/cpuinfo").read_text(),
                    reason="runs the cpu-avx2 target's code")
def test_bench_size_avx2_target():
    """The `cpu-avx2` target's kernel (ymm registers: QK 2 entries x 32 heads, PV 4 heads x 16
    values of d; the vector staging with its FP4 lookup in 8-lane halves) at the bench size:
    the per-element staging's outputs bit for bit, the oracle's numbers, and each row of a
    2-row call bit for bit that row alone."""
    avx2 = get_target("cpu-avx2")
    cfg = A.sparse_attend_config(avx2, h=64, d=512)
    assert (cfg.vector_decode, cfg.decode_lanes, cfg.bf16_dot, cfg.unroll_rows) == (
        True, 8, False, 2)
    assert (cfg.pv_heads, cfg.pv_cols) == (4, 16)
    base = A.sparse_attend_config(get_target("cpu-x86-64"), h=64, d=512)
    assert (base.pv_cols, base.vector_decode) == (16, False)
    dims = dict(**BENCH, softmax_scale=512 ** -0.5)
    ex = tvm.compile(A.build_sparse_attend("cpu-avx2", **dims), target=avx2.tvm_target())
    plain = dataclasses.replace(cfg, vector_decode=False)
    per_element = tvm.compile(A.schedule_sparse_attend(A.make_sparse_attend(
        **dims, heads_per_group=plain.heads_per_group, stage_rows=plain.stage_rows), plain,
        avx2), target=avx2.tvm_target())
    inputs = _inputs(b=1, s=2, **BENCH, seed=15)
    inputs[4][0, inputs[6][0, 0, :4].long()] = 0x88  # -0 in both nibbles of some entries
    got = _run(ex, inputs)
    assert torch.equal(got.view(torch.int16), _run(per_element, inputs).view(torch.int16))
    _assert_matches(got, _oracle("fp4", inputs))
    per_row = (0, 3, len(inputs) - 2)  # q, win_idx, kv_idx
    for si in range(2):
        row = [x[:, si:si + 1].contiguous() if i in per_row else x for i, x in enumerate(inputs)]
        assert torch.equal(_run(ex, row), got[:, si:si + 1]), si


@pytest.mark.parametrize("kind", ["fp4", "bf16"])
def test_each_row_equals_its_decode_step(kind, small):
    """Verify (1 + k rows) and decode (1 row) run this one kernel: each row of a 4-row call is,
    bit for bit, that row called alone, so greedy with speculation equals greedy without."""
    dims = dict(**small, w=16, k=54)
    inputs = _inputs(kind, b=2, s=4, **dims, n=80, seed=14)
    ex = _kernel(kind, **dims)
    got = _run(ex, inputs)
    per_row = (0, 3, len(inputs) - 2)  # q, win_idx, kv_idx
    for si in range(4):
        row = [x[:, si:si + 1].contiguous() if i in per_row else x for i, x in enumerate(inputs)]
        assert torch.equal(_run(ex, row), got[:, si:si + 1]), si


# ---- the bf16-dot path (schedules/attention/bf16_dot.py) -------------------------------------


def test_dequantised_entries_are_exact_in_bf16():
    """The bf16-dot path stages each dequantised entry as its fp32 value's high 16 bits. That is
    exact for every E4M3 code times every E8M0 scale down to 2^-117 (below, a product can fall
    under 2^-126: a denormal, which vdpbf16ps flushes to zero), and for every E2M1 value times
    every E4M3 scale (always 0 or at least 2^-10)."""
    e4m3 = torch.from_numpy(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                            .astype(np.float32))
    e4m3 = e4m3[e4m3.isfinite()]
    e8m0 = torch.ldexp(torch.ones(255), torch.arange(-127, 128))  # codes 0..254 (255: NaN)
    win = e4m3[:, None] * e8m0[None, :]
    low = (win.view(torch.int32) & 0xFFFF) != 0
    assert not low[:, 10:].any()  # scales from 2^-117 on
    assert (win[low].abs() < 2.0**-126).all() and low.any()
    e2m1 = torch.from_numpy(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
                            .astype(np.float32))
    glob = (e2m1[:, None] * e4m3[None, :]).flatten()
    assert ((glob.view(torch.int32) & 0xFFFF) == 0).all()
    assert ((glob == 0) | (glob.abs() >= 2.0**-10)).all()


def test_bf16_dot_config_and_checks():
    cpu = get_target("cpu")
    cfg = A.sparse_attend_config(cpu, h=64, d=512)
    assert (cfg.bf16_dot, cfg.heads_per_group) == (CPU_BF16_DOT, 32)
    assert not A.sparse_attend_config(cpu, h=4, d=64).bf16_dot  # 4 heads: not 16 lanes
    assert not A.sparse_attend_config(get_target("cpu-x86-64"), h=64, d=512).bf16_dot
    assert not A.sparse_attend_config(get_target("cuda-sm90"), h=64, d=512).bf16_dot
    dims = dict(w=16, k=8, softmax_scale=0.125)
    with pytest.raises(ValueError, match="^bf16_dot needs heads_per_group a multiple of 16 and "
                       "d a multiple of 32; got heads_per_group=4, d=64.$"):
        A.make_sparse_attend(**SMALL, **dims, vector_decode=True, bf16_dot=True)
    with pytest.raises(ValueError, match="^bf16_dot needs vector_decode and stage_rows=64 "
                       r"\(whole blocks staged once\); got vector_decode=False, stage_rows=64.$"):
        A.make_sparse_attend(h=16, d=64, **dims, bf16_dot=True)
    func = A.make_sparse_attend(h=16, d=64, **dims, vector_decode=True)
    asks = dataclasses.replace(A.sparse_attend_config(cpu, h=16, d=64), vector_decode=True,
                               bf16_dot=True)
    with pytest.raises(ValueError, match="built with bf16_dot=False but the config asks for True"):
        A.schedule_sparse_attend(func, asks, cpu)


@pytest.mark.skipif(not CPU_BF16_DOT, reason="this CPU has no AVX-512 BF16 (vdpbf16ps)")
def test_bf16_dot_kernel_calls_vdpbf16ps():
    """The chooser's kernel on this CPU: QK and PV are the vdpbf16ps blocks, not FMA loops."""
    text = A.build_sparse_attend("cpu", h=16, d=64, w=16, k=8, softmax_scale=0.125).script()
    assert text.count("dsv41_dpbf16ps_512") == 2
    assert 'T.sblock("qk_vec")' in text and 'T.sblock("pv_vec")' in text
    assert 'T.sblock("qk")' not in text and 'T.sblock("pv")' not in text


# ---- the AMX path (schedules/attention/amx_dot.py) -------------------------------------------


def test_amx_dot_config_and_checks():
    """AMX where the CPU has it, with groups of 32 heads (the tiles' 2 x 2 step); the factory
    refuses AMX without the bf16-dot staging or with a group that is not a multiple of 32."""
    cpu = get_target("cpu")
    cfg = A.sparse_attend_config(cpu, h=64, d=512)
    assert cfg.amx_dot == CPU_AMX_DOT and (not cfg.amx_dot or cfg.bf16_dot)
    assert not A.sparse_attend_config(cpu, h=16, d=64).amx_dot  # 16 heads: half a tile step
    assert not A.sparse_attend_config(get_target("cpu-x86-64"), h=64, d=512).amx_dot
    assert not A.sparse_attend_config(get_target("cuda-sm90"), h=64, d=512).amx_dot
    dims = dict(w=16, k=8, softmax_scale=0.125, vector_decode=True)
    with pytest.raises(ValueError, match="^amx_dot runs on the bf16_dot path's staging"):
        A.make_sparse_attend(h=32, d=64, **dims, amx_dot=True)
    with pytest.raises(ValueError, match="^The AMX attention needs heads_per_group, d and the "
                       "block a multiple of 32; got heads_per_group=16, d=64, block=64.$"):
        A.make_sparse_attend(h=32, d=64, **dims, heads_per_group=16, bf16_dot=True,
                             amx_dot=True)
    func = A.make_sparse_attend(h=32, d=64, **dims, bf16_dot=True)
    asks = dataclasses.replace(A.sparse_attend_config(cpu, h=32, d=64), heads_per_group=32,
                               vector_decode=True, bf16_dot=True, amx_dot=True)
    with pytest.raises(ValueError, match="built with amx_dot=False but the config asks for True"):
        A.schedule_sparse_attend(func, asks, cpu)


@pytest.mark.skipif(not CPU_AMX_DOT, reason="this CPU has no AMX-BF16 tiles")
@pytest.mark.parametrize("kind", ["fp4", "bf16"])
def test_amx_dot_kernel_matches_the_oracle_and_each_row_its_decode_step(kind):
    """The chooser's kernel at 32 heads on this CPU: QK and PV are tile blocks (no vdpbf16ps
    left), within the oracle's tolerance, and each row of a 2 x 4-row call equals, bit for bit,
    that row called alone (the verify entry's rows are its decode steps)."""
    dims = dict(h=32, d=64, w=16, k=54)
    text = (A.build_sparse_attend if kind == "fp4" else A.build_sparse_attend_bf16)(
        "cpu", **dims, softmax_scale=0.125).script()
    assert 'T.sblock("qk_amx")' in text and 'T.sblock("pv_amx")' in text
    assert "tdpbf16ps" in text and "dsv41_dpbf16ps_512" not in text
    inputs = _inputs(kind, b=2, s=4, **dims, n=80, seed=16)
    ex = _kernel(kind, **dims)
    got = _run(ex, inputs)
    _assert_matches(got, _oracle(kind, inputs))
    per_row = (0, 3, len(inputs) - 2)  # q, win_idx, kv_idx
    for bi, si in ((0, 0), (0, 3), (1, 1), (1, 2)):
        row = [x[bi:bi + 1, si:si + 1].contiguous() if i in per_row else x[bi:bi + 1]
               for i, x in enumerate(inputs[:-1])] + [inputs[-1]]  # sink: [h]
        assert torch.equal(_run(ex, row), got[bi:bi + 1, si:si + 1]), (bi, si)


@pytest.mark.skipif(not CPU_BF16_DOT, reason="this CPU has no AVX-512 BF16 (vdpbf16ps)")
@pytest.mark.parametrize("kind", ["fp4", "bf16"])
def test_prestage_chunks_give_the_same_rows(kind):
    """The bf16-dot kernel stages a chunk of rows (all their blocks, once for every head group)
    and then runs the chunk's tasks: with 3 rows a chunk, 2 x 4 rows run as chunks of 3, 3 and
    2 (one of them across the batch boundary), and every row equals, bit for bit, the one-chunk
    kernel's row and that row called alone (one row: one chunk of 1)."""
    dims = dict(h=32, d=64, w=16, k=54)  # 2 head groups of 16 where the cores are 2
    inputs = _inputs(kind, b=2, s=4, **dims, n=80, seed=15)
    whole = _run(_kernel(kind, **dims), inputs)
    chunked = _kernel(kind, **dims, chunk_rows=3)
    got = _run(chunked, inputs)
    assert torch.equal(got, whole)
    _assert_matches(got, _oracle(kind, inputs))
    per_row = (0, 3, len(inputs) - 2)  # q, win_idx, kv_idx
    for bi, si in ((0, 0), (0, 3), (1, 2)):
        row = [x[bi:bi + 1, si:si + 1].contiguous() if i in per_row else x[bi:bi + 1]
               for i, x in enumerate(inputs[:-1])] + [inputs[-1]]  # sink: [h]
        assert torch.equal(_run(chunked, row), got[bi:bi + 1, si:si + 1]), (bi, si)


def test_prestage_rows():
    """The rows prestaged at a time: as many as PRESTAGE_BYTES (2.5 MiB) holds, both layouts
    in bf16 (the bench size: 10 blocks of 64 entries x 512 x 4 bytes = 1.25 MiB a row: 2 rows,
    so a verify's 1 + 4 rows are three chunks); at least 1; an explicit 0 is refused."""
    assert A.PRESTAGE_BYTES == 5 * 1024 * 1024 // 2
    assert A.prestage_rows(d=512, w=128, k=512) == 2
    assert A.prestage_rows(d=512, w=128, k=1 << 16) == 1
    assert A.prestage_rows(d=64, w=16, k=54) == 5 * 1024 * 1024 // 2 // (2 * 64 * 64 * 4)
    with pytest.raises(ValueError, match="^chunk_rows must be at least 1; got 0.$"):
        A.make_sparse_attend(h=16, d=64, w=16, k=8, softmax_scale=0.125, vector_decode=True,
                             bf16_dot=True, chunk_rows=0)


# ---- the CPU vector staging's pieces ---------------------------------------------------------


def _cpu_ex(func):
    return tvm.compile(func, target=get_target("cpu").tvm_target())


def test_vector_e4m3_is_bit_exact():
    """All 256 E4M3 codes through the 16-lane decoder (NaN for 0x7f/0xff, -0.0 for 0x80,
    subnormals), against ml_dtypes."""
    from tvm.script import tirx as T

    @T.prim_func
    def dec(codes: T.Buffer((256,), "uint8"), out: T.Buffer((256,), "float32")):
        for i in range(16):
            out[T.ramp(i * 16, 1, 16)] = e4m3_to_f32_select(T.Cast("uint32x16",
                                                        codes.vload([i * 16], "uint8x16")))

    codes = np.arange(256, dtype=np.uint8)
    out = tvm.runtime.tensor(np.zeros(256, np.float32))
    _cpu_ex(dec)(tvm.runtime.tensor(codes), out)
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = out.numpy()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(got[ok].view(np.uint32), ref[ok].view(np.uint32))


@pytest.mark.skipif(not has_avx512(get_target("cpu")), reason="this CPU has no AVX-512")
def test_vector_fp4_lookup_is_bit_exact():
    """All 256 packed bytes (both nibbles, low first) through _nibbles and the E2M1 table."""
    from tvm.script import tirx as T

    @T.prim_func
    def dec(codes: T.Buffer((256,), "uint8"), out: T.Buffer((512,), "float32")):
        tbl = T.alloc_buffer((16,), "float32", scope="local")
        for i in T.unroll(16):
            tbl[i] = fp4_to_f32(T.Cast("uint32", i))
        for i in range(32):
            out[T.ramp(i * 16, 1, 16)] = T.call_llvm_pure_intrin(
                "float32x16", "llvm.x86.avx512.permvar.sf.512", tbl.vload([0], "float32x16"),
                T.reinterpret("int32x16", A._nibbles(T.Cast("uint32x8",
                                                            codes.vload([i * 8], "uint8x8")))))

    codes = np.arange(256, dtype=np.uint8)
    out = tvm.runtime.tensor(np.zeros(512, np.float32))
    _cpu_ex(dec)(tvm.runtime.tensor(codes), out)
    nib = np.stack([codes & 15, codes >> 4], axis=-1).reshape(-1).astype(np.uint8)
    ref = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


def test_polynomial_exp():
    """At most 1 ulp from exp (float64, rounded) over the softmax's range, exact at 0, 0 for
    -inf and below the fp32 range, NaN kept, +inf above it."""
    from tvm.script import tirx as T

    n = 1 << 16

    @T.prim_func
    def ex(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in range(n // 16):
            for j in T.vectorized(16):
                y[i * 16 + j] = A._exp(x[i * 16 + j])

    gen = np.random.default_rng(0)
    body = np.maximum(-np.abs(gen.standard_normal(n - 8) * 20), -87.0)
    x = np.concatenate([body, [0.0, -0.0, -np.inf, -87.2, -90.0, -1e30, np.nan, 100.0]])
    x = x.astype(np.float32)
    y = tvm.runtime.tensor(np.zeros(n, np.float32))
    _cpu_ex(ex)(tvm.runtime.tensor(x), y)
    got = y.numpy()
    ref = np.exp(x[:-8].astype(np.float64)).astype(np.float32)
    ulp = np.abs(got[:-8].view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulp.max() <= 1 and (ulp == 0).mean() > 0.85
    assert got[-8] == 1.0 and got[-7] == 1.0
    assert got[-6] == 0.0 and got[-4] == 0.0 and got[-3] == 0.0
    assert abs(got[-5] / np.exp(np.float64(x[-5])) - 1) < 1e-6  # near the smallest normal
    assert np.isnan(got[-2]) and got[-1] == np.inf


def test_vector_decode_config_is_checked():
    target = get_target("cpu")
    cfg = dataclasses.replace(A.sparse_attend_config(target, **SMALL), vector_decode=True)
    func = A.make_sparse_attend(**SMALL, w=16, k=8, softmax_scale=0.125,
                                heads_per_group=cfg.heads_per_group)
    with pytest.raises(ValueError, match="vector_decode=False"):
        A.schedule_sparse_attend(func, cfg, target)
    cuda = get_target("cuda-sm90")
    assert not A.sparse_attend_config(cuda, **SMALL).vector_decode
    vec = A.make_sparse_attend(**SMALL, w=16, k=8, softmax_scale=0.125, vector_decode=True,
                               **{"heads_per_group": A.sparse_attend_config(cuda, **SMALL)
                                  .heads_per_group,
                                  "stage_rows": A.sparse_attend_config(cuda, **SMALL)
                                  .stage_rows})
    with pytest.raises(ValueError, match="CUDA"):
        A.schedule_sparse_attend(vec, dataclasses.replace(A.sparse_attend_config(cuda, **SMALL),
                                                          vector_decode=True), cuda)


# ---- host-side index check -------------------------------------------------------------------


def test_check_indices():
    win = torch.tensor([[[0, 3, -1]]], dtype=torch.int32)
    glob = torch.tensor([[[-1, 9]]], dtype=torch.int32)
    A.check_sparse_attend_indices(win, 4, glob, 10)  # valid, -1 included
    A.check_sparse_attend_indices(win, 4, glob[..., :0], 0)  # empty selection, N = 0
    with pytest.raises(ValueError, match="win_idx holds 3"):
        A.check_sparse_attend_indices(win, 3, glob, 10)
    with pytest.raises(ValueError, match="kv_idx holds 9"):
        A.check_sparse_attend_indices(win, 4, glob, 9)
    with pytest.raises(ValueError, match="kv_idx holds -2"):
        A.check_sparse_attend_indices(win, 4, glob - 1, 10)
    with pytest.raises(ValueError, match="kv_idx holds 0"):
        A.check_sparse_attend_indices(win, 4, torch.zeros(1, 1, 1, dtype=torch.int32), 0)


def test_example_inputs_are_valid():
    inputs = _inputs(b=2, s=3, **BENCH, seed=0)
    q, win_codes, _, win_idx, kv_codes, kv_scales, kv_idx, sink = inputs
    A.check_sparse_attend_indices(win_idx, win_codes.size(1), kv_idx, kv_codes.size(1))
    assert kv_codes.shape == (2, 2048, 256) and kv_scales.shape == (2, 2048, 32)
    assert q.dtype == torch.bfloat16 and sink.shape == (64,)
    sel = kv_idx[0, 0]
    assert torch.all(sel[1:] > sel[:-1])  # distinct, ascending


# ---- factory, config and schedule ------------------------------------------------------------


def test_factory_rejects_bad_dims():
    with pytest.raises(ValueError, match="must divide h"):
        A.make_sparse_attend(h=6, d=64, w=8, k=8, softmax_scale=0.1, heads_per_group=4)
    with pytest.raises(ValueError, match="stage_rows"):
        A.make_sparse_attend(h=4, d=64, w=8, k=8, softmax_scale=0.1, stage_rows=24)
    with pytest.raises(ValueError, match="multiple of 32"):
        A.make_sparse_attend(h=4, d=48, w=8, k=8, softmax_scale=0.1)
    with pytest.raises(ValueError, match="w \\+ k > 0"):
        A.make_sparse_attend(h=4, d=64, w=0, k=0, softmax_scale=0.1)


def test_buffer_signature():
    """Argument names, order and dtypes of the torch ops, then the output; int64 dims."""
    f = A.make_sparse_attend(**SMALL, w=16, k=8, softmax_scale=0.125)
    assert [p.name for p in f.params] == ["q", "win_codes", "win_scales", "win_idx", "kv_codes",
                                          "kv_scales", "kv_idx", "sink", "out"]
    assert [p.dtype for p in f.params] == ["bfloat16", "uint8", "uint8", "int32", "uint8",
                                           "uint8", "int32", "float32", "bfloat16"]
    assert all(str(dim.ty) == "int64" for p in f.params for dim in p.shape)
    g = A.make_sparse_attend_bf16(**SMALL, w=16, k=8, softmax_scale=0.125)
    assert [(p.name, p.dtype) for p in g.params] == [
        ("q", "bfloat16"), ("win_codes", "uint8"), ("win_scales", "uint8"), ("win_idx", "int32"),
        ("kv", "bfloat16"), ("kv_idx", "int32"), ("sink", "float32"), ("out", "bfloat16")]


@pytest.mark.parametrize("d", [64, 512])
def test_cuda_config_fits_shared_memory(d):
    cfg = A.sparse_attend_config(get_target("cuda-sm90"), h=64, d=d)
    shared = 4 * (cfg.heads_per_group * d + cfg.stage_rows * d + 2 * 64 * cfg.heads_per_group)
    assert shared <= 48 * 1024
    assert 64 % cfg.stage_rows == 0 and 64 % cfg.heads_per_group == 0


def test_schedule_rejects_a_mismatched_config():
    target = get_target("cpu")
    cfg = A.sparse_attend_config(target, **SMALL)
    func = A.make_sparse_attend(**SMALL, w=16, k=8, softmax_scale=0.125, stage_rows=8)
    with pytest.raises(ValueError, match="stage_rows=8"):
        A.schedule_sparse_attend(func, cfg, target)


def test_cpu_schedule_is_parallel_and_vectorised():
    func = A.build_sparse_attend("cpu", **SMALL, w=16, k=8, softmax_scale=0.125)
    assert func.attrs["tirx.is_scheduled"]
    text = func.script()
    assert "T.parallel(" in text and "T.vectorized(" in text


# ---- CUDA ------------------------------------------------------------------------------------


# one arch in the default run (a child-process build each, 20-35 s here); the others `slow`
@pytest.mark.parametrize("arch", [pytest.param("sm80", marks=pytest.mark.slow), "sm90",
                                  pytest.param("sm100", marks=pytest.mark.slow)])
def test_cuda_builds_have_device_code(arch, tmp_path):
    from dsv41.schedules.cuda_build import build_cuda, has_device_code, toolchain_problem

    if toolchain_problem():
        pytest.skip(f"cannot build CUDA here: {toolchain_problem()}")
    builders = ["build_sparse_attend"] + (["build_sparse_attend_bf16"] if arch == "sm90" else [])
    for name in builders:
        out = tmp_path / f"{name}_{arch}.so"
        build_cuda(f"dsv41.schedules.attention:{name}",
                   dict(target_name=f"cuda-{arch}", **BENCH, softmax_scale=512**-0.5),
                   f"cuda-{arch}", out)
        assert has_device_code(out, f"sm_{arch[2:]}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp4", "bf16"])
def test_gpu_numerics(kind):
    if not tvm.cuda().exist:
        pytest.skip("no CUDA GPU on this machine")
    major, minor = tvm.cuda().compute_version.split(".")
    arch = {"8": "sm80", "9": "sm90", "10": "sm100"}.get(major)
    if arch is None:
        pytest.skip(f"no target for compute capability {major}.{minor}")
    target = get_target(f"cuda-{arch}")
    build = A.build_sparse_attend if kind == "fp4" else A.build_sparse_attend_bf16
    dev = tvm.cuda()
    for dims, kw in ((BENCH, dict(b=2, s=4)), (dict(**SMALL, w=16, k=54), dict(b=2, s=3, n=80))):
        with target.tvm_target():
            ex = tvm.compile(build(f"cuda-{arch}", **dims, softmax_scale=dims["d"] ** -0.5),
                             target=target.tvm_target())
        inputs = _inputs(kind, **kw, **dims, seed=13)
        inputs[-2][1, 0] = -1  # one row of batch 1 without global entries
        b, s, h, d = inputs[0].shape
        out = tvm.runtime.tensor(np.zeros((b, s, h, d), ml_dtypes.bfloat16), dev)
        ex(*[to_tvm(x, dev) for x in inputs], out)
        got = torch.from_numpy(out.numpy().view(np.int16)).view(torch.bfloat16)
        _assert_matches(got, _oracle(kind, inputs))
