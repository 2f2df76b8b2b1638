"""Indexer kernels (schedules/indexer/) against the torch oracles in graph/ops.py.

Tolerance: none. The sweep reproduces the oracle's bf16 roundings and torch's head-sum order, so
scores are compared bit for bit, and selections (positions, blocks) must be identical. This holds
while each q.k dot product is exact in fp32, which it is for MXFP4 data whose product exponents
span fewer than ~9 binades (all inputs here: unit-scale activations, as in the model); beyond that
the oracle's GEMM summation order would decide bf16 rounding ties. The VNNI sweep (int8 dot
products per 32-block, exact, then scaled and summed in fp32) is held to the same bits.
"""

from __future__ import annotations

import functools

import pytest
import torch
import tvm

from dsv41.graph import ops
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.runtime.backends.tensors import host_torch, to_torch, to_tvm
from dsv41.schedules import indexer as ix
from dsv41.schedules.common import has_avx512, has_features

H, D, TOPK, TOPK_BLOCKS, BS = 4, 64, 8, 3, 4


def build_indexer_kernels(target_name: str = "cpu", *, heads: int, dim: int, topk: int,
                          topk_blocks: int, block_size: int) -> tvm.IRModule:
    """The five PrimFuncs of the three ops (the production builders `build_hier_topk` and
    `build_pool_topk`) in one module: one compile serves every test."""
    mod = ix.build_hier_topk(target_name, heads=heads, dim=dim, topk=topk,
                             topk_blocks=topk_blocks, block_size=block_size)
    pool = ix.build_pool_topk(target_name, heads=heads, dim=dim, topk=topk,
                              block_size=block_size)
    have = {gv.name_hint for gv in mod.get_global_vars()}
    for gv, func in pool.functions.items():  # the pool chain's index_scores is the same sweep
        if gv.name_hint not in have:
            mod[gv.name_hint] = func
    return mod


def _empty(shape, dtype, device):
    out = torch.empty(shape, dtype=dtype)
    return out, to_tvm(out, device)


def run_indexer_topk(ex, q, k_packed, k_scales, weights, lens, topk: int, *, device=None):
    """Run a compiled build_indexer_topk module on torch tensors (the op's arguments)."""
    b, s = q.shape[:2]
    args = [to_tvm(x, device) for x in (q, k_packed, k_scales, weights, lens)]
    _, scores = _empty((b, s, ix.padded(k_packed.shape[1])), torch.bfloat16, device)
    _, pos = _empty((b, s, topk), torch.int32, device)
    ex["index_scores"](*args, scores)
    ex["select_positions"](scores, pos)
    return host_torch(pos)


def run_hier_topk(ex, q, k_packed, k_scales, weights, lens, topk: int, topk_blocks: int,
                  block_size: int, *, device=None):
    """Run a compiled build_hier_topk module; returns (positions, blocks)."""
    del block_size  # baked into the module
    b, s = q.shape[:2]
    args = [to_tvm(x, device) for x in (q, k_packed, k_scales, weights, lens)]
    _, scores = _empty((b, s, ix.padded(k_packed.shape[1])), torch.bfloat16, device)
    _, pos = _empty((b, s, topk), torch.int32, device)
    _, blk = _empty((b, s, topk_blocks), torch.int32, device)
    ex["index_scores"](*args, scores)
    ex["select_positions"](scores, pos)
    ex["select_blocks"](scores, args[4], blk)
    return host_torch(pos), host_torch(blk)


def run_pool_topk(ex, q, k_packed, k_scales, weights, lens, blocks, topk: int,
                  block_size: int, *, device=None):
    """Run a compiled build_pool_topk module on the op's arguments."""
    b, s, heads, dim = q.shape
    args = [to_tvm(x, device) for x in (q, k_packed, k_scales, weights, lens, blocks)]
    p = ix.padded(blocks.shape[-1] * block_size)
    _, scores = _empty((b, s, p), torch.bfloat16, device)
    _, pos = _empty((b, s, topk), torch.int32, device)
    if ex.jit().implements_function("pool_gather", query_imports=True):  # emit_pool_scores
        outs = [_empty(shape, dtype, device)[1] for shape, dtype in (
            ((b * s, 1, heads, dim), torch.bfloat16), ((b * s, p, dim // 2), torch.uint8),
            ((b * s, p, dim // 32), torch.uint8), ((b * s, 1, heads), torch.bfloat16),
            ((b * s, 1), torch.int64), ((b, s, p), torch.int8))]
        _, raw = _empty((b * s, 1, p), torch.bfloat16, device)
        ex["pool_gather"](*args, *outs)
        ex["index_scores"](*outs[:5], raw)
        ex["pool_mask"](raw, outs[5], scores)
    else:
        ex["pool_scores"](*args, scores)
    ex["select_pool"](scores, args[5], pos)
    return host_torch(pos)


def _cpu(heads: int = H, dim: int = D, topk: int = TOPK, topk_blocks: int = TOPK_BLOCKS,
         block_size: int = BS):
    """The compiled indexer module, once per shape however the call names its arguments."""
    return _cpu_compiled(heads, dim, topk, topk_blocks, block_size)


@functools.cache
def _cpu_compiled(heads: int, dim: int, topk: int, topk_blocks: int, block_size: int):
    mod = build_indexer_kernels("cpu", heads=heads, dim=dim, topk=topk,
                                topk_blocks=topk_blocks, block_size=block_size)
    return tvm.compile(mod, target=get_target("cpu").tvm_target())


def _inputs(b, s, t, *, lens=None, seed=0, heads=H, dim=D, weight_scale=8.0):
    q, kp, ks, w, causal = ix.example_inputs_indexer_topk(b=b, s=s, heads=heads, dim=dim, t=t,
                                                          seed=seed)
    # larger weights than the model's so that many heads contribute at bf16 resolution
    w = (w.float() * weight_scale).bfloat16()
    return [q, kp, ks, w, causal if lens is None else lens]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


SHAPES = [  # (b, s, t): 1 token, T < topk, partial tiles, batch 2, several tiles
    (1, 1, 1), (1, 2, 5), (2, 3, 37), (1, 4, 300), (2, 2, 129),
]


@pytest.mark.parametrize("b,s,t", SHAPES)
def test_scores_bit_exact(b, s, t):
    args = _inputs(b, s, t, seed=t)
    ex = _cpu()
    scores = torch.empty(b, s, ix.padded(t), dtype=torch.bfloat16)
    ex["index_scores"](*[to_tvm(x) for x in args],
                       to_tvm(scores))
    ref = ops.index_scores(*args)
    assert torch.equal(_bits(scores[..., :t]), _bits(ref))
    assert torch.all(scores[..., t:] == float("-inf"))


@pytest.mark.parametrize("b,s,t", SHAPES)
def test_three_ops_match_oracle(b, s, t):
    args = _inputs(b, s, t, seed=100 + t)
    ex = _cpu()
    pos = run_indexer_topk(ex, *args, TOPK)
    assert torch.equal(pos, ops.indexer_topk(*args, TOPK))
    hpos, hblk = run_hier_topk(ex, *args, TOPK, TOPK_BLOCKS, BS)
    rpos, rblk = ops.hier_topk(*args, TOPK, TOPK_BLOCKS, BS)
    assert torch.equal(hpos, rpos) and torch.equal(hblk, rblk)
    got = run_pool_topk(ex, *args, rblk, TOPK, BS)
    assert torch.equal(got, ops.pool_topk(*args, rblk, TOPK, BS))


def test_varying_lens_and_all_masked():
    """Per-query visible counts, including 0 (every output -1) and a lens inside a block."""
    t = 50
    lens = torch.tensor([[0, 1, 7, 50], [13, 0, 49, 2]])
    args = _inputs(2, 4, t, lens=lens, seed=7)
    ex = _cpu()
    pos = run_indexer_topk(ex, *args, TOPK)
    assert torch.equal(pos, ops.indexer_topk(*args, TOPK))
    assert torch.all(pos[0, 0] == -1) and torch.all(pos[1, 1] == -1)
    assert pos[0, 1].tolist() == [0] + [-1] * (TOPK - 1)
    hpos, hblk = run_hier_topk(ex, *args, TOPK, TOPK_BLOCKS, BS)
    rpos, rblk = ops.hier_topk(*args, TOPK, TOPK_BLOCKS, BS)
    assert torch.equal(hpos, rpos) and torch.equal(hblk, rblk)
    assert torch.all(hblk[0, 0] == -1)
    for bi in range(2):  # the newest visible entry's block is always a candidate
        for si in range(4):
            if lens[bi, si] > 0:
                assert (lens[bi, si].item() - 1) // BS in hblk[bi, si].tolist()
    got = run_pool_topk(ex, *args, rblk, TOPK, BS)
    assert torch.equal(got, ops.pool_topk(*args, rblk, TOPK, BS))


def test_ties_go_to_lower_positions():
    """Zero weights make every visible score 0: the first topk visible positions win."""
    t = 40
    lens = torch.tensor([[40, 20, 3]])
    q, kp, ks, w, lens = _inputs(1, 3, t, lens=lens, seed=3)
    w = torch.zeros_like(w)
    ex = _cpu()
    pos = run_indexer_topk(ex, q, kp, ks, w, lens, TOPK)
    assert torch.equal(pos, ops.indexer_topk(q, kp, ks, w, lens, TOPK))
    assert pos[0, 0].tolist() == list(range(TOPK))
    assert pos[0, 2].tolist() == [0, 1, 2] + [-1] * (TOPK - 3)
    _, blk = run_hier_topk(ex, q, kp, ks, w, lens, TOPK, TOPK_BLOCKS, BS)
    assert blk[0, 0].tolist() == [0, 1, 9]  # ties -> lowest blocks, plus the pinned newest


def test_pool_with_padding_and_partial_last_block():
    """-1 padded pools, the partial last block (positions 28..31 with T=30), blocks past lens."""
    t = 30
    args = _inputs(2, 2, t, seed=11)
    blocks = torch.tensor([[[0, 3, 7, -1], [2, 5, -1, -1]], [[1, 5, 6, 7], [-1, -1, -1, -1]]],
                          dtype=torch.int32)
    got = run_pool_topk(_cpu(), *args, blocks, TOPK, BS)
    assert torch.equal(got, ops.pool_topk(*args, blocks, TOPK, BS))
    assert torch.all(got[1, 1] == -1)


def test_scheduled_pool_sweep_for_entries_with_many_rows():
    """Entries whose calls carry many rows (an exact prefill chunk) keep the scheduled pool
    sweep (`gather=False`: no per-query gathered store); it matches the oracle too. The
    compiler gathers only for the bounded entries (`build.BOUNDED_ROWS`)."""
    from dsv41.compiler.build import BOUNDED_ROWS

    assert {"decode", "verify", "draft", "decoder"} == BOUNDED_ROWS
    mod = ix.build_pool_topk("cpu", heads=H, dim=D, topk=TOPK, block_size=BS, gather=False)
    assert {gv.name_hint for gv in mod.get_global_vars()} == {"pool_scores", "select_pool"}
    ex = tvm.compile(mod, target=get_target("cpu").tvm_target())
    for b, s, t in ((1, 1, 60), (2, 3, 37)):
        args = _inputs(b, s, t, seed=40 + t)
        _, rblk = ops.hier_topk(*args, TOPK, TOPK_BLOCKS, BS)
        assert torch.equal(run_pool_topk(ex, *args, rblk, TOPK, BS),
                           ops.pool_topk(*args, rblk, TOPK, BS))


def test_pool_emission_matches_oracle():
    """The Relax emission the lowering uses (`ix.emit_pool_scores` + select_pool, symbolic
    shapes), on the CPU target's chain, against the oracle; the chain is the one picked for
    AVX-512 CPUs (the scheduled pool sweep elsewhere)."""
    from tvm import relax, tirx

    mod = ix.build_pool_topk("cpu", heads=H, dim=D, topk=TOPK, block_size=BS)
    b, s, t, nb = (tirx.Var(n, "int64") for n in ("b", "s", "t", "nb"))
    shapes = [((b, s, H, D), "bfloat16"), ((b, t, D // 2), "uint8"), ((b, t, D // 32), "uint8"),
              ((b, s, H), "bfloat16"), ((b, s), "int64"), ((b, s, nb), "int32")]
    params = [relax.Var(f"a{i}", relax.TensorType(sh, dt)) for i, (sh, dt) in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            scores = ix.emit_pool_scores(bb, mod, lambda f: bb.add_func(mod[f], f), params,
                                         block_size=BS)
            out = bb.emit_output(relax.call_tir(bb.add_func(mod["select_pool"], "select_pool"),
                                                [scores, params[5]],
                                                relax.TensorType((b, s, TOPK), "int32")))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=get_target("cpu").tvm_target()),
                              tvm.cpu())
    for bsz, sq, tt, seed in ((1, 1, 60, 1), (2, 3, 37, 2)):
        args = _inputs(bsz, sq, tt, seed=seed)
        _, rblk = ops.hier_topk(*args, TOPK, TOPK_BLOCKS, BS)
        got = to_torch(vm["main"](*[to_tvm(x, None) for x in (*args, rblk)]))
        assert torch.equal(got, ops.pool_topk(*args, rblk, TOPK, BS))


def _select_ref(kind, scores, aux):
    if kind == "positions":
        return ops._select(scores, 8)
    if kind == "blocks":
        return ops.candidate_blocks(scores, aux, 8, 4)
    score = scores.masked_fill(~ops.pool_mask(aux, scores.size(-1), 4), float("-inf"))
    return ops._select(score, 8)


@functools.cache
def _select_ex(kind):
    f = ix.make_select(topk=8, kind=kind, block_size=4)
    return tvm.compile(f, target=get_target("cpu").tvm_target())


@pytest.mark.parametrize("kind", ["positions", "blocks", "pool"])
def test_select_heavy_ties_and_signed_zeros(kind):
    """Integer-valued bf16 scores (many exact ties), -inf runs, and -0.0 == +0.0."""
    g = torch.Generator().manual_seed(5)
    b, s, p = 2, 3, 256
    scores = torch.randint(-4, 5, (b, s, p), generator=g).float()
    scores[0, 0] = torch.where(scores[0, 0] > 0, -0.0, 0.0)  # only signed zeros: pure ties
    scores[0, 1, 100:] = float("-inf")
    scores[1, 2] = float("-inf")
    scores = scores.bfloat16()
    lens = torch.tensor([[256, 100, 3], [255, 17, 1]])
    aux = None
    if kind == "blocks":
        aux = lens
        scores = scores.masked_fill(torch.arange(p) >= lens.unsqueeze(-1), float("-inf"))
    elif kind == "pool":
        aux = ops.candidate_blocks(scores.float(), lens, 12, 4)
        scores_pool = torch.full((b, s, ix.padded(12 * 4)), float("-inf"), dtype=torch.bfloat16)
        pos = aux.long().unsqueeze(-1) * 4 + torch.arange(4)
        ok = (aux >= 0).unsqueeze(-1).expand_as(pos)
        vals = torch.gather(scores, 2, pos.clamp(min=0).flatten(-2))
        scores_pool[..., :48] = torch.where(ok.flatten(-2), vals, float("-inf"))
    out = torch.empty(b, s, 8, dtype=torch.int32)
    inp = scores_pool if kind == "pool" else scores
    args = [inp] + ([aux.contiguous()] if aux is not None else []) + [out]
    _select_ex(kind)(*[to_tvm(x) for x in args])
    assert torch.equal(out, _select_ref(kind, scores, aux))


@pytest.mark.slow  # 22 s; each kernel is also checked at these heads/dims on smaller T
def test_model_sizes_match():
    """H=32, D=128, topk 512 at T=3000 with causal prefill queries (two of them)."""
    t, topk = 3000, 512
    ex = _cpu(heads=32, dim=128, topk=topk, topk_blocks=64, block_size=8)
    args = ix.example_inputs_indexer_topk(b=1, s=2, heads=32, dim=128, t=t, seed=1)
    assert torch.equal(run_indexer_topk(ex, *args, topk), ops.indexer_topk(*args, topk))
    hpos, hblk = run_hier_topk(ex, *args, topk, 64, 8)
    rpos, rblk = ops.hier_topk(*args, topk, 64, 8)
    assert torch.equal(hpos, rpos) and torch.equal(hblk, rblk)
    assert torch.equal(run_pool_topk(ex, *args, rblk, topk, 8),
                       ops.pool_topk(*args, rblk, topk, 8))


# ---- the AVX-512 sweep and the portable (scheduled) one --------------------------------------

HAS_AVX512 = has_avx512(get_target("cpu"))
HAS_VNNI = has_features(get_target("cpu"), "avx512f", "avx512bw", "avx512vnni")
HAS_AVX2 = has_features(get_target("cpu"), "avx2")
HAS_AMX_INT8 = has_features(get_target("cpu"), "amx-tile", "amx-int8", "avx512vbmi", "avx512vnni")
HAS_VBMI = has_features(get_target("cpu"), "avx512f", "avx512bw", "avx512vnni", "avx512vbmi")


def _sweep_ex(kind: str, heads: int, dim: int, max_tasks: int = 32):
    """The compiled sweep of `kind`, once per shape however the call names its arguments."""
    return _sweep_compiled(kind, heads, dim, max_tasks)


@functools.cache
def _sweep_compiled(kind: str, heads: int, dim: int, max_tasks: int):
    if kind in ("avx512", "vnni"):
        vnni = kind == "vnni"
        f = ix.make_index_scores_avx512(heads=heads, dim=dim, max_tasks=max_tasks, vnni=vnni,
                                        tile=32 if vnni else 64,
                                        head_block=min(8 if vnni else 4, heads))
        return tvm.compile(f, target=get_target("cpu").tvm_target())
    if kind == "amx":  # the dot on AMX-INT8 tiles where the keys allow, else VNNI
        f = ix.make_index_scores_avx512(heads=heads, dim=dim, max_tasks=max_tasks, vnni=True,
                                        tile=32, head_block=8, amx=True)
        return tvm.compile(f, target=get_target("cpu").tvm_target())
    if kind == "vbmi":  # the shifted operands of the AMX dot on vpdpbusd, else VNNI
        f = ix.make_index_scores_avx512(heads=heads, dim=dim, max_tasks=max_tasks, vnni=True,
                                        tile=32, head_block=min(8, heads), vbmi=True)
        return tvm.compile(f, target=get_target("cpu").tvm_target())
    if kind == "avx2":  # the 256-bit form with the vpmaddubsw int8 dot
        f = ix.make_index_scores_avx512(heads=heads, dim=dim, max_tasks=max_tasks, vnni=True,
                                        lanes=8, tile=16, head_block=min(8, heads))
        return tvm.compile(f, target=get_target("cpu").tvm_target())
    mod = ix.build_indexer_topk("cpu-x86-64", heads=heads, dim=dim, topk=TOPK)
    return tvm.compile(tvm.IRModule({"index_scores": mod["index_scores"]}),
                       target=get_target("cpu-x86-64").tvm_target())


def _sweep_matches(ex, b, s, t, heads, dim, seed, q=None, ks=None):
    """The kernel's scores are the oracle's bits (NaN where the oracle's are: its payload is
    not compared); q / ks: changes to the inputs."""
    args = _inputs(b, s, t, seed=seed, heads=heads, dim=dim)
    if q is not None:
        args[0] = q(args[0])
    if ks is not None:
        args[2] = ks(args[2])
    scores = torch.empty(b, s, ix.padded(t), dtype=torch.bfloat16)
    ex["index_scores"](*[to_tvm(x) for x in args],
                       to_tvm(scores))
    ref = ops.index_scores(*args)
    nan = ref.isnan()
    assert torch.equal(scores[..., :t].isnan(), nan)
    assert torch.equal(_bits(scores[..., :t])[~nan], _bits(ref)[~nan])
    assert torch.all(scores[..., t:] == float("-inf"))


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512")
@pytest.mark.parametrize("heads,dim,b,s,t,max_tasks", [
    (4, 32, 2, 3, 37, 32),  # 4 entries per transpose row, one partial tile
    # 2 entries per row; heads < 16 (one chunk of 8) (slow: a compile, ~9 s)
    pytest.param(8, 64, 1, 2, 200, 32, marks=pytest.mark.slow),
    (16, 128, 2, 1, 1000, 3),  # ragged tasks: 16 tiles in runs of 6, 6, 4
    (32, 256, 1, 2, 129, 32),  # two 16-word chunks per entry; 2 head chunks
])
def test_avx512_sweep_is_bit_exact(heads, dim, b, s, t, max_tasks):
    _sweep_matches(_sweep_ex("avx512", heads, dim, max_tasks), b, s, t, heads, dim, seed=t)


INT8_SWEEP_CASES = [  # (heads, dim, b, s, t, max_tasks) of the int8 dots (VNNI, AVX2)
    (16, 128, 2, 1, 1000, 3),  # ragged tasks; one head chunk
    (32, 128, 1, 3, 300, 32),  # the model's dims, prefill-like s, a partial last tile
    # 1 token; 4 head chunks; heads < 8: a 4-head block (slow: a compile each, ~10 s)
    pytest.param(64, 128, 1, 1, 1, 32, marks=pytest.mark.slow),
    pytest.param(4, 128, 2, 2, 37, 32, marks=pytest.mark.slow),
    (32, 256, 1, 2, 129, 32),  # two 16-word (AVX2: 2 x 2 8-word) chunks per entry
]


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("heads,dim,b,s,t,max_tasks", INT8_SWEEP_CASES)
def test_vnni_sweep_is_bit_exact(heads, dim, b, s, t, max_tasks):
    _sweep_matches(_sweep_ex("vnni", heads, dim, max_tasks), b, s, t, heads, dim, seed=t)


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2")
@pytest.mark.parametrize("heads,dim,b,s,t,max_tasks", INT8_SWEEP_CASES)
def test_avx2_sweep_is_bit_exact(heads, dim, b, s, t, max_tasks):
    _sweep_matches(_sweep_ex("avx2", heads, dim, max_tasks), b, s, t, heads, dim, seed=t)


AMX_SWEEP_CASES = [  # (heads, dim, b, s, t, max_tasks): heads a multiple of 32, dim 128
    (32, 128, 1, 1, 5000, 4),  # decode: runs of 40 tiles per task, a partial last tile
    (32, 128, 1, 3, 300, 32),  # prefill-like s: items pipelined within a tile
    # 1 token; 2 passes of 32 heads, 4 head chunks (slow: a compile, ~17 s)
    pytest.param(64, 128, 1, 1, 1, 32, marks=pytest.mark.slow),
    (32, 128, 2, 2, 1000, 32),  # batch 2 (ragged tasks: the first case)
]


@pytest.mark.skipif(not HAS_AMX_INT8, reason="this CPU has no AMX-INT8")
@pytest.mark.parametrize("heads,dim,b,s,t,max_tasks", AMX_SWEEP_CASES)
def test_amx_sweep_is_bit_exact(heads, dim, b, s, t, max_tasks):
    _sweep_matches(_sweep_ex("amx", heads, dim, max_tasks), b, s, t, heads, dim, seed=t)


# the folded-scale forms: AMX, and its operands on vpdpbusd (VBMI, a CPU without AMX)
SHIFTED = [pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX_INT8,
                                                        reason="this CPU has no AMX-INT8")),
           pytest.param("vbmi", marks=pytest.mark.skipif(not HAS_VBMI,
                                                         reason="this CPU has no AVX-512 VBMI"))]


@pytest.mark.skipif(not HAS_VBMI, reason="this CPU has no AVX-512 VBMI")
@pytest.mark.parametrize("heads,dim,b,s,t,max_tasks", [  # 3 kernels (a compile is ~6 s)
    (32, 128, 1, 1, 5000, 32),  # decode: runs of 5 tiles, a shorter last run, a partial tile
    (32, 128, 1, 3, 300, 32),  # prefill-like s
    pytest.param(64, 128, 1, 1, 1, 32, marks=pytest.mark.slow),  # 1 token; 4 head chunks
    (32, 128, 2, 2, 1000, 32),  # batch 2
    # heads < 8: a 4-head block, one partial tile
    pytest.param(4, 128, 2, 2, 37, 32, marks=pytest.mark.slow),
])
def test_vbmi_sweep_is_bit_exact(heads, dim, b, s, t, max_tasks):
    _sweep_matches(_sweep_ex("vbmi", heads, dim, max_tasks), b, s, t, heads, dim, seed=t)


def _wide_key_span(ks):  # every 7th entry's block 2 code 5 over its others: that tile on VNNI
    ks = ks.clone()
    ks[:, ::7, 2] = (ks[:, ::7, :].int().max(dim=-1).values + 5).clamp(max=254).to(torch.uint8)
    return ks


def _some_wide_tiles(ks):  # the first entry of every third 32-entry tile: AMX and VNNI tiles mix
    ks = ks.clone()
    ks[:, ::96, 0] = (ks[:, ::96, 0].int() + 6).clamp(max=254).to(torch.uint8)
    return ks


def _nan_code(ks):  # an E8M0 NaN scale (code 255) in a few entries
    ks = ks.clone()
    ks[:, 33, 1] = 255
    ks[:, 700, 3] = 255
    return ks


def _wide_q_span(q):  # one head's first block 2^-6 of the others: the whole call on VNNI
    q = q.clone()
    q[..., 3, :32] = (q[..., 3, :32].float() * 2.0**-6).bfloat16()
    return q


def _q_span_3(q):  # a span of exactly 3 binades still takes AMX
    q = q.clone()
    q[..., 5, 32:64] = (q[..., 5, 32:64].float() * 2.0**-3).bfloat16()
    return q


@pytest.mark.parametrize("kind", SHIFTED)
@pytest.mark.parametrize("ks", [_wide_key_span, _some_wide_tiles])
def test_shifted_sweep_key_fallbacks(kind, ks):
    """Tiles whose keys the shifted int8 operands cannot hold (a block code 4+ over the entry's
    least) take the VNNI dot, between AMX (VBMI) tiles; the same bits either way."""
    _sweep_matches(_sweep_ex(kind, 32, 128), 1, 2, 3000, 32, 128, seed=9, ks=ks)


@pytest.mark.parametrize("kind", SHIFTED)
def test_shifted_sweep_nan_code_as_vnni(kind):
    """A NaN scale code sends its tile to the VNNI dot: the VNNI kernel's scores exactly (both
    take relu(NaN) as 0 where the oracle keeps NaN: a code the quantiser emits only for NaN
    activations)."""
    args = _inputs(1, 2, 3000, seed=9, heads=32, dim=128)
    args[2] = _nan_code(args[2])
    out = {}
    for k in (kind, "vnni"):
        out[k] = torch.empty(1, 2, ix.padded(3000), dtype=torch.bfloat16)
        _sweep_ex(k, 32, 128)["index_scores"](*[to_tvm(x) for x in args], to_tvm(out[k]))
    assert torch.equal(_bits(out[kind]), _bits(out["vnni"]))


@pytest.mark.parametrize("kind", SHIFTED)
@pytest.mark.parametrize("change", [_wide_q_span, _q_span_3])
def test_shifted_sweep_q_spans(kind, change):
    _sweep_matches(_sweep_ex(kind, 32, 128), 1, 2, 700, 32, 128, seed=5, q=change)


def _zero_block(q):  # a q block of 32 zeros (no exponent to take)
    q = q.clone()
    q[..., 0, 32:64] = 0
    return q


def _not_qdq(q):  # one value off the MXFP4 grid: not int8 x 2^e, so the int8 dot would be wrong
    q = q.clone()
    q[0, -1, 1, 7] = (q[0, -1, 1, 7].float() * (1 + 2**-6) + 2**-5).bfloat16()
    return q


def _tiny_block(q):  # a block near fp32's smallest exponents
    q = q.clone()
    q[0, 0, 2, 96:] = (q[0, 0, 2, 96:].float() * 2.0**-125).bfloat16()
    return q


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("change", [_zero_block, _not_qdq, _tiny_block])
def test_vnni_sweep_q_off_the_grid(change):
    """Zero q blocks stay on the int8 path; a q the int8 path cannot hold exactly (not QDQ'd,
    exponents at fp32's end) sends the call to the fp32 dot, with the same bits as the oracle."""
    _sweep_matches(_sweep_ex("vnni", 32, 128), 1, 2, 700, 32, 128, seed=5, q=change)


@pytest.mark.parametrize("kind", SHIFTED)
@pytest.mark.parametrize("change", [_zero_block, _not_qdq, _tiny_block])
def test_shifted_sweep_q_off_the_grid(kind, change):
    """As on VNNI: a zero block stays on the int8 (AMX, VBMI) path, the others go to the fp32
    dot."""
    _sweep_matches(_sweep_ex(kind, 32, 128), 1, 2, 700, 32, 128, seed=5, q=change)


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2")
@pytest.mark.parametrize("change", [_zero_block, _not_qdq, _tiny_block])
def test_avx2_sweep_q_off_the_grid(change):
    """As on VNNI: the AVX2 kernel's fp32 dot (E2M1 by a select chain) takes such a q."""
    _sweep_matches(_sweep_ex("avx2", 32, 128), 1, 2, 700, 32, 128, seed=5, q=change)


def test_portable_cpu_sweep_is_bit_exact():
    """cpu-x86-64 (no AVX-512) keeps the scheduled sweep; it runs on any x86-64."""
    assert not ix.sweep_config(get_target("cpu-x86-64"), heads=32, dim=128).avx512
    _sweep_matches(_sweep_ex("scheduled", 32, 128), 1, 2, 300, 32, 128, seed=4)


def test_sweep_config_choices():
    cuda = ix.sweep_config(get_target("cuda-sm90"), heads=32, dim=128)
    assert not cuda.avx512 and cuda.tile == 128
    assert not ix.sweep_config(get_target("cpu"), heads=32, dim=128, pool=True).avx512
    assert not ix.sweep_config(get_target("cpu"), heads=32, dim=96).avx512  # 12-word rows
    host = ix.sweep_config(get_target("cpu"), heads=32, dim=128)
    assert host.avx512 == (HAS_AVX512 or HAS_AVX2)
    assert host.vnni == (HAS_VNNI if HAS_AVX512 else HAS_AVX2)
    assert host.lanes == (16 if HAS_AVX512 else 8 if HAS_AVX2 else 16)
    assert not ix.sweep_config(get_target("cpu"), heads=8, dim=64).vnni  # dim % 128
    assert host.amx == HAS_AMX_INT8
    assert not ix.sweep_config(get_target("cpu"), heads=16, dim=128).amx  # heads % 32
    if HAS_AMX_INT8:
        asm = _host_sweep(32, 128).mod.inspect_source("s")
        assert "tdpbssd" in asm and "vpermb" in asm and "vpdpbusd" in asm  # + the VNNI fallback
    assert host.vbmi == (HAS_VBMI and not HAS_AMX_INT8)
    if host.vbmi:
        asm = _host_sweep(32, 128).mod.inspect_source("s")
        assert "vpermb" in asm and "vpdpbusd" in asm and "tdpbssd" not in asm
    # Zen 4 (AVX-512 VNNI + VBMI, no AMX): the VBMI dot; Ice Lake has VBMI too
    zen4 = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "znver4"})
    assert ix.sweep_config(zen4, heads=32, dim=128).vbmi
    assert not ix.sweep_config(zen4, heads=32, dim=256).vbmi  # dim 128 only
    with pytest.raises(ValueError, match="AMX"):
        ix.make_index_scores_avx512(heads=32, dim=128, vnni=True, tile=64, amx=True)
    with pytest.raises(ValueError, match="AMX"):
        ix.make_index_scores_avx512(heads=16, dim=128, vnni=True, tile=32, head_block=8,
                                    amx=True)
    with pytest.raises(ValueError, match="The VBMI sweep needs vnni, lanes 16 and dim 128"):
        ix.make_index_scores_avx512(heads=32, dim=128, tile=32, head_block=8, vbmi=True)
    with pytest.raises(ValueError, match="and not amx"):
        ix.make_index_scores_avx512(heads=32, dim=128, vnni=True, tile=32, head_block=8,
                                    amx=True, vbmi=True)
    # AVX2 without AVX-512 (Zen 3): the 256-bit kernel with the vpmaddubsw dot, no zmm
    zen = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "znver3"})
    cfg = ix.sweep_config(zen, heads=32, dim=128)
    assert cfg.avx512 and cfg.vnni and (cfg.lanes, cfg.tile, cfg.head_block) == (8, 16, 8)
    asm = tvm.compile(ix.index_sweep(zen, 32, 128), target=zen.tvm_target()) \
        .mod.inspect_source("s")
    assert "vpmaddubsw" in asm and "ymm" in asm and "zmm" not in asm
    assert not ix.sweep_config(zen, heads=32, dim=64).avx512  # AVX2 needs dim % 128
    with pytest.raises(ValueError, match="lanes"):
        ix.make_index_scores_avx512(heads=32, dim=128, lanes=8)  # AVX2 has the int8 dot only
    # AVX-512 without VNNI (Skylake-SP): the fp32 dot, and its kernel has no VNNI code
    skx = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "skylake-avx512"})
    cfg = ix.sweep_config(skx, heads=32, dim=128)
    assert cfg.avx512 and not cfg.vnni and (cfg.tile, cfg.head_block) == (64, 4)
    asm = tvm.compile(ix.index_sweep(skx, 32, 128), target=skx.tvm_target()) \
        .mod.inspect_source("s")
    assert "vpdpbusd" not in asm and "zmm" in asm
    with pytest.raises(ValueError, match="VNNI"):
        ix.make_index_scores_avx512(heads=32, dim=64, vnni=True)
    with pytest.raises(ValueError, match="head block"):
        ix.make_index_scores_avx512(heads=32, dim=96)
    with pytest.raises(ValueError, match="tile"):
        ix.make_index_scores_avx512(heads=32, dim=128, tile=48)


@pytest.mark.parametrize("group,chunks", [(16, 32), (128, 3)])
def test_select_group_sizes(group, chunks):
    """The group-maximum prefilter at small and large groups, with more runs of groups than
    groups and with ragged runs: ties spread over many groups, rows with fewer finite entries
    than topk, a row that is entirely -inf, and a partial last group (blocks kind: 67 blocks)."""
    g = torch.Generator().manual_seed(group)
    b, s, p = 2, 3, 268
    scores = torch.randint(-3, 4, (b, s, p), generator=g).float()
    scores[0, 1, 5:] = float("-inf")  # 5 finite entries < topk
    scores[1, 0] = float("-inf")
    scores = scores.bfloat16()
    lens = torch.tensor([[268, 5, 100], [1, 200, 267]])
    for kind in ("positions", "blocks"):
        f = tvm.compile(ix.make_select(topk=8, kind=kind, block_size=4, group=group,
                                       chunks=chunks),
                        target=get_target("cpu").tvm_target())
        inp = scores
        aux = None
        if kind == "blocks":
            aux = lens
            inp = scores.masked_fill(torch.arange(p) >= lens.unsqueeze(-1), float("-inf"))
        out = torch.empty(b, s, 8, dtype=torch.int32)
        f(*[to_tvm(x) for x in [inp] + ([aux] if aux is not None else [])
            + [out]])
        assert torch.equal(out, _select_ref(kind, inp, aux)), kind


@functools.cache
def _host_sweep(heads: int, dim: int):
    """The sweep this CPU's build compiles (`index_sweep` on the host target), once."""
    return tvm.compile(ix.index_sweep(get_target("cpu"), heads, dim),
                       target=get_target("cpu").tvm_target())


@pytest.mark.parametrize("heads,dim", [(H, D), (32, 128)])  # (32, 128): this CPU's int8 sweep
def test_empty_context(heads, dim):
    """T = 0 (no index keys yet): the sweep writes nothing and every selection is -1. At the
    model's dims, the sweep this CPU's build takes (AMX, VBMI, VNNI, AVX2 or AVX-512); the
    selections are the same kernels at any dims."""
    import ml_dtypes
    import numpy as np

    ex = _cpu()
    sweep = ex if (heads, dim) == (H, D) else _host_sweep(heads, dim)
    dev = tvm.cpu()
    q = tvm.runtime.tensor(np.ones((1, 2, heads, dim), ml_dtypes.bfloat16))
    w = tvm.runtime.tensor(np.ones((1, 2, heads), ml_dtypes.bfloat16))
    kp = tvm.runtime.empty((1, 0, dim // 2), "uint8", dev)
    ks = tvm.runtime.empty((1, 0, dim // 32), "uint8", dev)
    lens = tvm.runtime.tensor(np.zeros((1, 2), np.int64))
    scores = tvm.runtime.empty((1, 2, 0), "bfloat16", dev)
    pos = tvm.runtime.tensor(np.zeros((1, 2, TOPK), np.int32))
    blk = tvm.runtime.tensor(np.zeros((1, 2, TOPK_BLOCKS), np.int32))
    sweep["index_scores"](q, kp, ks, w, lens, scores)
    ex["select_positions"](scores, pos)
    ex["select_blocks"](scores, lens, blk)
    assert (pos.numpy() == -1).all() and (blk.numpy() == -1).all()


def test_bad_static_dims_are_rejected():
    with pytest.raises(ValueError, match="multiple of 16"):
        ix.make_index_scores(heads=24, dim=64)
    with pytest.raises(ValueError, match="dim"):
        ix.make_index_scores(heads=4, dim=48)
    with pytest.raises(ValueError, match="kind"):
        ix.make_select(topk=8, kind="heap")
    with pytest.raises(ValueError, match="group"):
        ix.make_select(topk=8, group=24)
    with pytest.raises(ValueError, match="chunks"):
        ix.make_select(topk=8, chunks=0)


@pytest.mark.slow
def test_cpu_128k_matches_oracle():
    t = 131072
    ex = _cpu(heads=32, dim=128, topk=512, topk_blocks=2048, block_size=8)
    args = ix.example_inputs_indexer_topk(b=1, s=1, heads=32, dim=128, t=t, seed=2)
    assert torch.equal(run_indexer_topk(ex, *args, 512), ops.indexer_topk(*args, 512))
    hpos, hblk = run_hier_topk(ex, *args, 512, 2048, 8)
    rpos, rblk = ops.hier_topk(*args, 512, 2048, 8)
    assert torch.equal(hpos, rpos) and torch.equal(hblk, rblk)


# ---- CUDA ----------------------------------------------------------------------------------------

CUDA_KW = dict(heads=H, dim=D, topk=TOPK, topk_blocks=TOPK_BLOCKS, block_size=BS)


@pytest.mark.parametrize("target", [
    pytest.param("cuda-sm80", marks=pytest.mark.slow), "cuda-sm90",
    pytest.param("cuda-sm100", marks=pytest.mark.slow)])
def test_cuda_build_has_device_code(target, tmp_path):
    from dsv41.schedules.cuda_build import build_cuda, has_device_code, toolchain_problem

    if toolchain_problem():
        pytest.skip(toolchain_problem())
    pool_kw = {k: v for k, v in CUDA_KW.items() if k != "topk_blocks"}
    for builder, kw in (("build_hier_topk", CUDA_KW), ("build_pool_topk", pool_kw)):
        out = tmp_path / f"{builder}_{target}.so"
        build_cuda(f"dsv41.schedules.indexer:{builder}", dict(target_name=target, **kw), target,
                   out)
        assert has_device_code(out, get_target(target).arch), f"{builder} for {target}"


def _gpu_device():
    dev = tvm.cuda(0)
    if not dev.exist:
        pytest.skip("no CUDA GPU on this machine")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,t", [(1, 1, 1), (2, 3, 37), (1, 4, 1000)])
def test_gpu_matches_oracle(b, s, t):
    dev = _gpu_device()
    arch = "sm_" + "".join(dev.compute_version.split("."))
    name = {"sm_80": "cuda-sm80", "sm_90": "cuda-sm90", "sm_100": "cuda-sm100"}.get(arch,
                                                                                  "cuda-sm80")
    tgt = get_target(name).tvm_target()
    with tgt:
        ex = tvm.compile(build_indexer_kernels(name, **CUDA_KW), target=tgt)
    args = _inputs(b, s, t, seed=t)
    assert torch.equal(run_indexer_topk(ex, *args, TOPK, device=dev),
                       ops.indexer_topk(*args, TOPK))
    hpos, hblk = run_hier_topk(ex, *args, TOPK, TOPK_BLOCKS, BS, device=dev)
    rpos, rblk = ops.hier_topk(*args, TOPK, TOPK_BLOCKS, BS)
    assert torch.equal(hpos, rpos) and torch.equal(hblk, rblk)
    assert torch.equal(run_pool_topk(ex, *args, rblk, TOPK, BS, device=dev),
                       ops.pool_topk(*args, rblk, TOPK, BS))


# ---- the shared index-K pointer ---------------------------------------------------------------


@functools.cache
def _shared(n_alt: int, kind: str, dim: int = D):
    """index_scores_shared: the AVX-512 sweep this CPU lowers, or the scheduled generic one."""
    target = get_target("cpu")
    if kind == "generic":
        cfg = ix.SweepConfig(tile=32, head_block=4, kdec_vector_d=True)
        func = ix.schedule_index_scores(ix.make_index_scores(heads=H, dim=dim, n_alt=n_alt),
                                        cfg, target)
    else:
        if not ix.sweep_config(target, heads=H, dim=dim).avx512:
            pytest.skip("this CPU has no AVX-512 full sweep")
        func = ix.index_sweep(target, H, dim, n_alt)
    return tvm.compile(func, target=target.tvm_target())


@pytest.mark.parametrize("kind", ["avx512", "generic"])
@pytest.mark.parametrize("n_alt,t", [(1, 37), (3, 37), (3, 300)])
def test_shared_sweep_reads_the_store_the_pointer_names(kind, n_alt, t):
    """Each batch row scores the keys of the store its pick names (own, or the first T rows of
    a longer alternate), bit-exact against the oracle over the materialised keys."""
    b, s = n_alt + 1, 2
    q, kp, ks, w, lens = _inputs(b, s, t, seed=n_alt * 10 + t)
    alts = [ix.example_inputs_indexer_topk(b=b, s=1, heads=H, dim=D, t=2 * t, seed=50 + i)[1:3]
            for i in range(n_alt)]
    alt_c, alt_s = [a[0] for a in alts], [a[1] for a in alts]
    pick = torch.arange(b, dtype=torch.int64)  # row 0 own, row i alternate i
    kc, ksc = ops.shared_index_k(kp, ks, alt_c, alt_s, pick)
    pick = pick.unsqueeze(1).expand(b, s).contiguous()  # every token of a row: the row's pick
    ref = ops.index_scores(q, kc, ksc, w, lens)
    slots = []
    for i in range(ix.MAX_ALT):
        slots += [alt_c[i], alt_s[i]] if i < n_alt else [kp, ks]
    scores = torch.empty(b, s, ix.padded(t), dtype=torch.bfloat16)
    _shared(n_alt, kind)(*[to_tvm(x) for x in (q, kp, ks, *slots, pick, w, lens,
                                                                scores)])
    assert torch.equal(_bits(scores[..., :t]), _bits(ref))
    assert torch.all(scores[..., t:] == float("-inf"))
    # the pointer matters: an alternate's keys differ from the own store's
    assert not torch.equal(_bits(ref[1]), _bits(ops.index_scores(q, kp, ks, w, lens)[1]))
    want = ops.indexer_topk_shared(q, kp, ks, alt_c, alt_s, pick, w, lens, TOPK)
    assert torch.equal(want, ops.indexer_topk(q, kc, ksc, w, lens, TOPK))


def test_shared_sweep_refuses_too_many_alternates():
    with pytest.raises(ValueError, match="n_alt must lie in"):
        ix.make_index_scores(heads=H, dim=D, n_alt=ix.MAX_ALT + 1)


# ---- the per-token pick (a verify pass: one sweep, each token over the store it names) -------

PER_TOKEN_PICK = torch.tensor([[0, 0, 1, 1, 1], [3, 2, 2, 0, 3]])  # mixed within each sequence


def _decode_step_scores(q, kp, ks, alt_c, alt_s, pick, w, lens):
    """Each token's scores as its decode step computes them: s = 1, the sequence's pick."""
    b, s = pick.shape
    out = torch.empty(b, s, kp.size(1), dtype=torch.bfloat16)
    for j in range(s):
        kc, ksc = ops.shared_index_k(kp, ks, alt_c, alt_s, pick[:, j])
        out[:, j : j + 1] = ops.index_scores(q[:, j : j + 1], kc, ksc, w[:, j : j + 1],
                                             lens[:, j : j + 1])
    return out


def _shared_inputs(b, s, t, n_alt, heads, dim, seed):
    q, kp, ks, w, lens = _inputs(b, s, t, seed=seed, heads=heads, dim=dim)
    alts = [ix.example_inputs_indexer_topk(b=b, s=1, heads=heads, dim=dim, t=2 * t,
                                           seed=seed + 50 + i)[1:3] for i in range(n_alt)]
    return q, kp, ks, [a[0] for a in alts], [a[1] for a in alts], w, lens


@functools.cache
def _shared_kind(kind: str, n_alt: int, heads: int, dim: int):
    """index_scores_shared of one sweep variant: the scheduled generic one or the AVX-512 fp32
    one (`_shared`), or the x86 kernel's VNNI / AVX2 / AMX / VBMI form."""
    if kind in ("generic", "avx512"):
        assert (heads, dim) == (H, D), "the generic and AVX-512 fp32 forms are built at (H, D)"
        return _shared(n_alt, kind)
    if not {"vnni": HAS_VNNI, "avx2": HAS_AVX2, "amx": HAS_AMX_INT8, "vbmi": HAS_VBMI}[kind]:
        pytest.skip(f"this CPU cannot run the {kind} sweep")
    form = {"vnni": dict(tile=32, head_block=8), "avx2": dict(lanes=8, tile=16, head_block=8),
            "amx": dict(tile=32, head_block=8, amx=True),
            "vbmi": dict(tile=32, head_block=8, vbmi=True)}[kind]
    func = ix.make_index_scores_avx512(heads=heads, dim=dim, n_alt=n_alt, max_tasks=4,
                                       vnni=True, **form)
    return tvm.compile(func, target=get_target("cpu").tvm_target())


def _run_shared(ex, q, kp, ks, alt_c, alt_s, pick, w, lens):
    slots = []
    for i in range(ix.MAX_ALT):
        slots += [alt_c[i], alt_s[i]] if i < len(alt_c) else [kp, ks]
    scores = torch.full((*q.shape[:2], ix.padded(kp.size(1))), 7.0, dtype=torch.bfloat16)
    ex["index_scores_shared"](*[to_tvm(x) for x in (q, kp, ks, *slots, pick, w, lens, scores)])
    return scores


@pytest.mark.parametrize("kind,heads,dim,n_alt", [
    ("generic", H, D, 3), ("avx512", H, D, 3), ("vnni", 8, 128, 1), ("avx2", 8, 128, 1),
    ("amx", 32, 128, 1), ("vbmi", 32, 128, 1),
])
def test_shared_sweep_per_token_pick_equals_decode_steps(kind, heads, dim, n_alt):
    """One sweep with a pick per (sequence, token): each token's scores are, bit for bit, those
    of its own decode step (s = 1 with that pick), including tokens of one sequence reading
    different stores, a row whose tokens all read one store (row 2), and T = 37 (one partial
    tile, alternates of 600 rows)."""
    b, s, t = 3, 5, 300
    args = _shared_inputs(b, s, t, n_alt, heads, dim, seed=11)
    pick = torch.cat([PER_TOKEN_PICK, torch.full((1, s), 2)]).clamp(max=n_alt)
    ex = _shared_kind(kind, n_alt, heads, dim)
    scores = _run_shared(ex, *args[:5], pick, *args[5:])
    want = _decode_step_scores(*args[:5], pick, *args[5:])
    assert torch.equal(_bits(scores[..., :t]), _bits(want))
    assert torch.all(scores[..., t:] == float("-inf"))
    short = [x[:, :37] for x in args[1:3]]
    args = [args[0], *short, *args[3:6], args[6].clamp(max=37)]
    scores = _run_shared(ex, *args[:5], pick, *args[5:])
    assert torch.equal(_bits(scores[..., :37]), _bits(_decode_step_scores(*args[:5], pick,
                                                                          *args[5:])))


@pytest.mark.parametrize("kind", ["generic", "avx512"])
def test_shared_sweep_pick_outside_the_stores_reads_the_own_store(kind):
    """The compiled sweep never leaves a score unwritten: a pick past n_alt (or -1) reads the
    own store, as pick 0 does (the host refuses such picks before: `ops.check_pick`)."""
    args = _shared_inputs(1, 4, 100, 1, H, D, seed=3)
    ex = _shared_kind(kind, 1, H, D)
    got = _run_shared(ex, *args[:5], torch.tensor([[-1, 2, 0, 1]]), *args[5:])
    want = _run_shared(ex, *args[:5], torch.tensor([[0, 0, 0, 1]]), *args[5:])
    assert torch.equal(_bits(got), _bits(want))


def test_shared_oracle_per_token_pick_equals_decode_steps_and_the_four_sweeps():
    """The op with a (b, s) pick: each token's top-k equals its decode step's (s = 1, the op
    with that token's picks) and the composition the verify pass ran before (one sweep per
    store with every sequence's pick there, each token keeping the one it names)."""
    b, s, t, n_alt = 2, 5, 300, 3
    q, kp, ks, alt_c, alt_s, w, lens = _shared_inputs(b, s, t, n_alt, H, D, seed=21)
    got = ops.indexer_topk_shared(q, kp, ks, alt_c, alt_s, PER_TOKEN_PICK, w, lens, TOPK)
    for j in range(s):
        step = ops.indexer_topk_shared(q[:, j : j + 1], kp, ks, alt_c, alt_s,
                                       PER_TOKEN_PICK[:, j : j + 1], w[:, j : j + 1],
                                       lens[:, j : j + 1], TOPK)
        assert torch.equal(got[:, j : j + 1], step)
    old = None
    for option in range(n_alt + 1):
        idx = ops.indexer_topk_shared(q, kp, ks, alt_c, alt_s, torch.full((b, s), option), w,
                                      lens, TOPK)
        old = idx if old is None else torch.where((PER_TOKEN_PICK == option).unsqueeze(-1),
                                                  idx, old)
    assert torch.equal(got, old)
    # the picks matter: the tokens of sequence 0 that read alternate 1 differ from their own
    own = ops.indexer_topk(q, kp, ks, w, lens, TOPK)
    assert not torch.equal(got[0, 2:], own[0, 2:]) and torch.equal(got[0, :2], own[0, :2])


@pytest.mark.parametrize("pick,message", [
    (torch.tensor([[0, -1], [0, 0]]),
     r"pick must lie in 0\.\.1 \(the own store or one of the 1 alternates\); got -1 at "
     r"\(sequence, token\) \(0, 1\)\."),
    (torch.tensor([[0, 0], [2, 0]]),
     r"pick must lie in 0\.\.1 \(the own store or one of the 1 alternates\); got 2 at "
     r"\(sequence, token\) \(1, 0\)\."),
    (torch.tensor([0, 1]),
     r"pick must be int64 of shape \(2, 2\) \(one store per sequence and token\); got "
     r"torch\.int64 of shape \(2,\)\."),
    (torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
     r"pick must be int64 of shape \(2, 2\) \(one store per sequence and token\); got "
     r"torch\.int32 of shape \(2, 2\)\."),
])
def test_shared_oracle_refuses_bad_picks(pick, message):
    q, kp, ks, alt_c, alt_s, w, lens = _shared_inputs(2, 2, 40, 1, H, D, seed=1)
    with pytest.raises(ValueError, match=message):
        ops.indexer_topk_shared(q, kp, ks, alt_c, alt_s, pick, w, lens, TOPK)
