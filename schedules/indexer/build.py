"""The per-op builders (`indexer_topk`, `hier_topk`, `pool_topk` as IRModules of sweep +
select) and realistic example inputs."""

from __future__ import annotations

import torch
import tvm

from dsv41.graph import formats as fmt
from dsv41.graph import ops
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.indexer.configs import schedule_index_scores, select_config, sweep_config
from dsv41.schedules.indexer.pool import (
    make_pool_gather,
    make_pool_mask,
    make_pool_scores,
    pool_gathers,
    schedule_pool_gather,
    schedule_pool_mask,
)
from dsv41.schedules.indexer.select import make_select
from dsv41.schedules.indexer.sweep import make_index_scores
from dsv41.schedules.indexer.x86_sweep import make_index_scores_avx512

# ---- per-op builders ---------------------------------------------------------------------------


def index_sweep(target: TargetSpec, heads: int, dim: int, n_alt: int = 0) -> tvm.tirx.PrimFunc:
    """The full sweep for `target`: hand-vectorised (AVX-512) or scheduled; with n_alt > 0 the
    shared-pointer variant (`index_scores_shared`)."""
    cfg = sweep_config(target, heads=heads, dim=dim)
    if cfg.avx512:
        return make_index_scores_avx512(
            heads=heads, dim=dim, tile=cfg.tile, head_block=cfg.head_block,
            max_tasks=cfg.max_tasks, vnni=cfg.vnni, lanes=cfg.lanes, amx=cfg.amx, vbmi=cfg.vbmi,
            n_alt=n_alt).with_attr("tirx.is_scheduled", True)
    return schedule_index_scores(make_index_scores(heads=heads, dim=dim, n_alt=n_alt), cfg,
                                 target)


def _pool_sweep(target: TargetSpec, heads: int, dim: int, block_size: int):
    cfg = sweep_config(target, heads=heads, dim=dim, pool=True)
    return schedule_index_scores(make_pool_scores(heads=heads, dim=dim, block_size=block_size),
                                 cfg, target)


def _select(target: TargetSpec, **kwargs) -> tvm.tirx.PrimFunc:
    cfg = select_config(target)
    return make_select(lanes=cfg.lanes, group=cfg.group, chunks=cfg.chunks, gpu=target.is_cuda,
                       **kwargs)


def build_indexer_topk(target_name: str = "cpu", *, heads: int, dim: int,
                       topk: int, n_alt: int = 0) -> tvm.IRModule:
    """indexer_topk = index_scores(q, k_packed, k_scales, weights, lens) -> scores
    [b, s, pad128(T)] bf16, then select_positions(scores) -> int32 [b, s, topk]. n_alt > 0:
    indexer_topk_shared, the sweep `index_scores_shared` (alternate stores + pick) instead."""
    target = get_target(target_name)
    name = "index_scores_shared" if n_alt else "index_scores"
    return tvm.IRModule({
        name: index_sweep(target, heads, dim, n_alt),
        "select_positions": _select(target, topk=topk, kind="positions"),
    })


def build_hier_topk(target_name: str = "cpu", *, heads: int, dim: int, topk: int,
                    topk_blocks: int, block_size: int) -> tvm.IRModule:
    """hier_topk = index_scores -> scores, then select_positions(scores) -> positions and
    select_blocks(scores, lens) -> candidate blocks."""
    target = get_target(target_name)
    return tvm.IRModule({
        "index_scores": index_sweep(target, heads, dim),
        "select_positions": _select(target, topk=topk, kind="positions"),
        "select_blocks": _select(target, topk=topk_blocks, kind="blocks",
                                 block_size=block_size),
    })


def build_pool_topk(target_name: str = "cpu", *, heads: int, dim: int, topk: int,
                    block_size: int, gather: bool = True) -> tvm.IRModule:
    """pool_topk = pool_scores(q, k_packed, k_scales, weights, lens, blocks) -> scores
    [b, s, pad128(B * block_size)], then select_pool(scores, blocks) -> positions. On AVX-512
    CPUs the sweep is the chain pool_gather / index_scores / pool_mask (`emit_pool_scores`)
    unless `gather` is False: the gathered store is 68 B per pool entry and query (1.1 MB per
    query at the released pool), so entries with many rows per call (an exact prefill chunk:
    2048 rows, 2.3 GB) keep the scheduled sweep, which decodes per tile."""
    target = get_target(target_name)
    select = _select(target, topk=topk, kind="pool", block_size=block_size)
    if gather and pool_gathers(target, heads=heads, dim=dim):
        return tvm.IRModule({
            "pool_gather": schedule_pool_gather(
                make_pool_gather(heads=heads, dim=dim, block_size=block_size)),
            "index_scores": index_sweep(target, heads, dim),
            "pool_mask": schedule_pool_mask(make_pool_mask()),
            "select_pool": select,
        })
    return tvm.IRModule({
        "pool_scores": _pool_sweep(target, heads, dim, block_size),
        "select_pool": select,
    })


# ---- realistic inputs ---------------------------------------------------------------------------


def example_inputs_indexer_topk(*, b: int = 1, s: int = 1, heads: int = 32, dim: int = 128,
                                t: int = 8192, causal: bool = True,
                                seed: int = 0) -> list[torch.Tensor]:
    """[q, k_packed, k_scales, weights, lens] as the model makes them: q MXFP4-QDQ'd bf16, keys
    MXFP4-quantised from unit-scale activations, weights ~ N(0, 1) * D^-0.5 * H^-0.5 in bf16,
    lens = the causal visible counts of the last s positions of a T-long context."""
    g = torch.Generator().manual_seed(seed)
    q = fmt.torch_qdq_mxfp4(torch.randn(b, s, heads, dim, generator=g))
    k_packed, k_scales = fmt.torch_quant_mxfp4(torch.randn(b, t, dim, generator=g))
    weights = (torch.randn(b, s, heads, generator=g) * (dim**-0.5 * heads**-0.5)).bfloat16()
    if causal:
        lens = (torch.arange(t - s, t) + 1).clamp(min=0).expand(b, s).contiguous()
    else:
        lens = torch.full((b, s), t, dtype=torch.int64)
    return [q, k_packed, k_scales, weights, lens.to(torch.int64)]


def example_inputs_hier_topk(**kwargs) -> list[torch.Tensor]:
    """Same tensors as indexer_topk (topk, topk_blocks, block_size are kernel kwargs)."""
    return example_inputs_indexer_topk(**kwargs)


def example_inputs_pool_topk(*, topk_blocks: int = 2048, block_size: int = 8,
                             **kwargs) -> list[torch.Tensor]:
    """[q, k_packed, k_scales, weights, lens, blocks] with blocks = a hier_topk candidate pool
    (ascending, -1 padded) computed by the oracle from an independent set of scores."""

    q, kp, ks, w, lens = example_inputs_indexer_topk(**kwargs)
    src = example_inputs_indexer_topk(**{**kwargs, "seed": kwargs.get("seed", 0) + 1})
    score = ops.index_scores(*src[:4], lens)
    blocks = ops.candidate_blocks(score, lens, topk_blocks, block_size)
    return [q, kp, ks, w, lens, blocks]
