"""The fused entry kernel (schedules/rope_quant.py) against the graph's op `dsv41::rope_quant`
(graph/ops.py: `quant(rope(rms_norm(x)).float())`) and against the chain of unfused kernels the
compiled entries ran before (rms_norm, rope, quant_*).

Tolerance: none against the chain (codes and scale bytes bit-identical, every form, with and
without the norm, vector and scalar loops). Against the oracle: none without the norm (RoPE and
the quantisers are bit-exact); with it the norm's lane sums differ from torch's in the last fp32
bit now and then, which can move a value by one bf16 ulp, so the codes must agree at least 99.5%
and the scale bytes 99%. Inputs: a layer's value range, a row of large values (products near
the top of fp32), signed zeros, an all-zero row (the scale floors)."""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import cuda_build, tv

from dsv41.graph import ops
from dsv41.graph.ops import EntryFormat
from dsv41.graph.targets import get_target
from dsv41.schedules import norm, quant, rope
from dsv41.schedules import rope_quant as RQ

CPU = get_target("cpu")
EPS = 1e-6
CASES = [  # form, d, rd, norm: the window's KV, the main KV, the index keys, the small preset's
    (EntryFormat.FP8, 512, 64, True), (EntryFormat.FP4_KV, 512, 64, False),
    (EntryFormat.MXFP4, 128, 64, True), (EntryFormat.FP8, 64, 16, True),
    (EntryFormat.FP4_KV, 64, 16, False), (EntryFormat.MXFP4, 64, 16, True)]
QUANT_OP = {EntryFormat.FP8: "quant_fp8", EntryFormat.FP4_KV: "quant_fp4_kv",
            EntryFormat.MXFP4: "quant_mxfp4"}


@functools.cache
def _fused(form: EntryFormat, d: int, rd: int, with_norm: bool, vec: bool):
    cfg = RQ.rope_quant_config(CPU, d=d)
    func = RQ.make_rope_quant(d=d, rd=rd, fmt=form, eps=EPS if with_norm else None,
                              norm_lanes=cfg.norm_lanes, vec=vec)
    return tvm.compile(RQ.schedule_rope_quant(func, cfg, CPU), target=CPU.tvm_target())


@functools.cache
def _compiled(func):
    return tvm.compile(func, target=CPU.tvm_target())


def _inputs(b: int, s: int, d: int, rd: int, with_norm: bool, cos_batch: int, seed: int):
    x, cos, sin, *w = RQ.example_inputs_rope_quant(b=b, s=s, d=d, rd=rd, norm=with_norm,
                                                   cos_batch=cos_batch, seed=seed)
    x[0, 0, ::7] *= 1e18  # one row whose products and sums come near the top of fp32
    x[0, 0, 3] = -0.0
    x[-1, -1] = 0.0  # an all-zero row: the scale byte's floor
    return x, cos, sin, (w[0] if with_norm else None)


def _run_fused(form, d, rd, x, cos, sin, weight, vec: bool = True):
    b, s, _ = x.shape
    codes = torch.empty(b, s, ops.entry_code_width(form, d), dtype=torch.uint8)
    scales = torch.empty(b, s, d // ops.ENTRY_GROUP[form], dtype=torch.uint8)
    args = [x, cos, sin] + ([] if weight is None else [weight])
    _fused(form, d, rd, weight is not None, vec)(*[tv(t) for t in args], tv(codes), tv(scales))
    return codes, scales


def _run_chain(form, d, rd, x, cos, sin, weight):
    """The kernels the compiled entries ran before the fusion: rms_norm, rope, quant_*."""
    b, s, _ = x.shape
    y = x
    if weight is not None:
        rows, y = x.reshape(-1, d).contiguous(), torch.empty(b * s, d, dtype=torch.bfloat16)
        _compiled(norm.build_rms_norm("cpu", d=d, eps=EPS))(tv(rows), tv(weight), tv(y))
        y = y.reshape(b, s, d)
    r = torch.empty(b, s, 1, d, dtype=torch.bfloat16)
    _compiled(rope.build_rope("cpu", h=1, d=d, rd=rd))(tv(y.reshape(b, s, 1, d).contiguous()),
                                                        tv(cos), tv(sin), tv(r))
    op = QUANT_OP[form]
    codes = torch.empty(b * s, ops.entry_code_width(form, d), dtype=torch.uint8)
    scales = torch.empty(b * s, d // ops.ENTRY_GROUP[form], dtype=torch.uint8)
    _compiled(getattr(quant, f"build_{op}")("cpu", d=d))(tv(r.reshape(-1, d).float()),
                                                          tv(codes), tv(scales))
    return codes.reshape(b, s, -1), scales.reshape(b, s, -1)


@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].value}-{c[1]}-{c[2]}-{c[3]}")
def test_bit_identical_to_the_unfused_kernels(case, vec):
    form, d, rd, with_norm = case
    for cos_batch in (2, 1):
        x, cos, sin, w = _inputs(2, 5, d, rd, with_norm, cos_batch, seed=d + rd + cos_batch)
        got = _run_fused(form, d, rd, x, cos, sin, w, vec)
        want = _run_chain(form, d, rd, x, cos, sin, w)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].value}-{c[1]}-{c[2]}-{c[3]}")
def test_against_the_oracle(case):
    form, d, rd, with_norm = case
    x, cos, sin, w = _inputs(3, 40, d, rd, with_norm, 3, seed=7)
    codes, scales = _run_fused(form, d, rd, x, cos, sin, w)
    ref_codes, ref_scales = ops.rope_quant(x, cos, sin, rd, form, w, EPS)
    assert codes.shape == ref_codes.shape and scales.shape == ref_scales.shape
    if not with_norm:
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
        return
    assert (codes == ref_codes).float().mean() >= 0.995
    assert (scales == ref_scales).float().mean() >= 0.99


@functools.cache
def _rows(form: EntryFormat, d: int, rd: int, with_norm: bool, vec: bool):
    cfg = RQ.rope_quant_config(CPU, d=d)
    func = RQ.make_rope_quant(d=d, rd=rd, fmt=form, eps=EPS if with_norm else None,
                              norm_lanes=cfg.norm_lanes, vec=vec, into=True)
    return tvm.compile(RQ.schedule_rope_quant(func, cfg, CPU), target=CPU.tvm_target())


@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].value}-{c[1]}-{c[2]}-{c[3]}")
def test_rows_written_in_place_are_the_entries_scattered(case, vec):
    """rope_quant_rows (the entries quantised straight into a cache's rows, in place): the
    cache afterwards equals the fused kernel's entries scattered by `scatter_rows`'s oracle,
    byte for byte: the named rows rewritten, every other byte (rows -1, past the end, negative
    below -1) untouched; the op's oracle is the two ops in turn."""
    form, d, rd, with_norm = case
    b, s, n = 2, 5, 9
    x, cos, sin, w = _inputs(b, s, d, rd, with_norm, 2, seed=d + 3)
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 256, (b, n, ops.entry_code_width(form, d)), generator=gen,
                          dtype=torch.uint8)
    scales = torch.randint(0, 256, (b, n, d // ops.ENTRY_GROUP[form]), generator=gen,
                           dtype=torch.uint8)
    idx = torch.tensor([[3, -1, 8, 0, n], [2, 7, -5, 4, 1]], dtype=torch.int64)
    new_codes, new_scales = _run_fused(form, d, rd, x, cos, sin, w, vec)
    want = (ops.scatter_rows(codes, idx, new_codes), ops.scatter_rows(scales, idx, new_scales))
    got = [codes.clone(), scales.clone()]
    args = [got[0], got[1], idx, x, cos, sin] + ([] if w is None else [w])
    _rows(form, d, rd, with_norm, vec)(*[tv(t) for t in args])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = ops.rope_quant_rows(codes, scales, idx, x, cos, sin, rd, form, w, EPS)
    chain = ops.rope_quant(x, cos, sin, rd, form, w, EPS)
    assert torch.equal(ref[0], ops.scatter_rows(codes, idx, chain[0]))
    assert torch.equal(ref[1], ops.scatter_rows(scales, idx, chain[1]))


@functools.cache
def _window(form: EntryFormat, d: int, rd: int, with_norm: bool, vec: bool):
    cfg = RQ.rope_quant_config(CPU, d=d)
    func = RQ.make_rope_quant(d=d, rd=rd, fmt=form, eps=EPS if with_norm else None,
                              norm_lanes=cfg.norm_lanes, vec=vec, window=True)
    return tvm.compile(RQ.schedule_rope_quant(func, cfg, CPU), target=CPU.tvm_target())


@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].value}-{c[1]}-{c[2]}-{c[3]}")
def test_window_form_is_the_copy_the_entries_and_the_scatter(case, vec):
    """rope_quant_window (a prefill chunk's window entries, one kernel): buf = the ring as it
    was, then the fused kernel's entries (the concatenation), and the ring afterwards = those
    entries scattered into the slots (`scatter_rows`' oracle: -1, past the ring and negative
    slots write nothing), byte for byte; the op's oracle is the chain of ops."""
    form, d, rd, with_norm = case
    b, s, w = 2, 5, 4
    x, cos, sin, wt = _inputs(b, s, d, rd, with_norm, 2, seed=d + 5)
    gen = torch.Generator().manual_seed(d + 1)
    codes = torch.randint(0, 256, (b, w, ops.entry_code_width(form, d)), generator=gen,
                          dtype=torch.uint8)
    scales = torch.randint(0, 256, (b, w, d // ops.ENTRY_GROUP[form]), generator=gen,
                           dtype=torch.uint8)
    slot = torch.tensor([[-1, 3, 0, 2, 1], [2, -1, w, -3, 0]], dtype=torch.int64)
    new_codes, new_scales = _run_fused(form, d, rd, x, cos, sin, wt, vec)
    want = (ops.scatter_rows(codes, slot, new_codes), ops.scatter_rows(scales, slot, new_scales),
            torch.cat([codes, new_codes], 1), torch.cat([scales, new_scales], 1))
    ring = [codes.clone(), scales.clone()]
    buf = [torch.zeros_like(want[2]), torch.zeros_like(want[3])]
    args = [ring[0], ring[1], slot, x, cos, sin] + ([] if wt is None else [wt]) + buf
    _window(form, d, rd, with_norm, vec)(*[tv(t) for t in args])
    for got, ref in zip([*ring, *buf], want, strict=True):
        assert torch.equal(got, ref)
    oracle = ops.rope_quant_window(codes, scales, slot, x, cos, sin, rd, form, wt, EPS)
    chain = ops.rope_quant(x, cos, sin, rd, form, wt, EPS)
    assert torch.equal(oracle[0], ops.scatter_rows(codes, slot, chain[0]))
    assert torch.equal(oracle[1], ops.scatter_rows(scales, slot, chain[1]))
    assert torch.equal(oracle[2], torch.cat([codes, chain[0]], 1))
    assert torch.equal(oracle[3], torch.cat([scales, chain[1]], 1))


def test_the_oracle_is_the_chain_of_ops():
    x, cos, sin, w = _inputs(2, 3, 512, 64, True, 1, seed=3)
    want = ops.quant_fp8(ops.rope(ops.rms_norm(x, w, EPS), cos, sin, 64, False).float())
    got = ops.rope_quant(x, cos, sin, 64, EntryFormat.FP8, w, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="bf16 x"):
        ops.rope_quant(x.float(), cos, sin, 64, EntryFormat.FP8, w, EPS)
    with pytest.raises(ValueError):
        ops.rope_quant(x, cos, sin, 64, "fp6", w, EPS)


def test_refusals():
    for kw, msg in ((dict(d=512, rd=63), "even rd"), (dict(d=512, rd=0), "even rd"),
                    (dict(d=48, rd=16), "multiple of the fp8 group"),
                    (dict(d=512, rd=64, norm_lanes=24), "lanes"),
                    (dict(d=512, rd=64, into=True, window=True), "not both")):
        with pytest.raises(ValueError, match=msg):
            RQ.make_rope_quant(**{"fmt": EntryFormat.FP8, "eps": EPS, **kw})


@pytest.mark.parametrize("target", ["cuda-sm90"])
@pytest.mark.parametrize("form", ["entries", "into", "window"])
def test_cuda_build_has_device_code(tmp_path, target, form):
    cuda_build(tmp_path, "rope_quant", "build_rope_quant",
               dict(d=512, rd=64, fmt="fp8", eps=EPS, into=form == "into",
                    window=form == "window"), target)
