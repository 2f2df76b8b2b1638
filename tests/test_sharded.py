"""The sharded graph (graph/sharded.py, graph/collectives.py): each worker's slices read straight
from the checkpoint, the collectives against their oracles, and 2 workers on shared-small equal
to the one-worker graph.

Tolerance of the 2-worker run: the only arithmetic that changes is the order of the fp32
additions in the two row-parallel GEMMs (wo_b and the shared expert's w2: K added in two halves,
then the halves), before the same single bf16 rounding. On shared-small that leaves the
teacher-forced logits within 1e-5 relative L2 of the one-worker graph (the same bound
test_graph.py holds the graph to against the reference), every indexer selection identical, and
the run conformant on the pack's bounds."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dsv41.graph import ops
from dsv41.graph.checkpoint import load_checkpoint, param_spec
from dsv41.graph.collectives import (
    CollectiveError,
    ThreadGroup,
    all_gather,
    all_reduce,
    gather_in_worker_order,
    sum_in_worker_order,
)
from dsv41.graph.config import load_config
from dsv41.graph.conformance import evaluate
from dsv41.graph.score import GraphBackend, score
from dsv41.graph.sharded import ShardedBackend, load_workers, run_workers
from dsv41.graph.sharding import expert_block, shard_plan, worker_slices


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


# ---- the collectives ---------------------------------------------------------------------------


def test_thread_group_collectives_equal_their_oracles():
    group = ThreadGroup(3)
    parts = [torch.randn(4, 5, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    out = run_workers([lambda w=w: (group.member(w).all_reduce(parts[w]),
                                    group.member(w).all_gather(parts[w][:2]))
                       for w in range(3)], group)
    total = parts[0] + parts[1] + parts[2]  # worker order
    for red, gat in out:
        assert torch.equal(red, total) and torch.equal(red, sum_in_worker_order(parts))
        assert torch.equal(gat, torch.cat([p[:2] for p in parts]))
        assert torch.equal(gat, gather_in_worker_order([p[:2] for p in parts]))
    # bf16 parts are added in fp32 and rounded once
    b = [torch.tensor([1.0, 0.0], dtype=torch.bfloat16), torch.tensor([2.0**-9, 3.0],
                                                                      dtype=torch.bfloat16)]
    assert sum_in_worker_order(b).tolist() == [1.0, 3.0]


def test_a_failing_worker_aborts_the_group_with_a_clear_error():
    group = ThreadGroup(2, timeout_s=30)

    def fails():
        raise ValueError("worker 1 broke")

    with pytest.raises(ValueError, match="worker 1 broke"):
        run_workers([lambda: group.member(0).all_reduce(torch.ones(2)), fails], group)
    group = ThreadGroup(2, timeout_s=30)
    seen = []

    def mismatched(w):
        try:
            group.member(w).all_reduce(torch.ones(2 + w))
        except CollectiveError as e:
            seen.append(str(e))

    threads = [threading.Thread(target=mismatched, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 2 and "different shapes" in seen[0]
    with pytest.raises(ValueError, match="whole number"):
        ThreadGroup(0)
    with pytest.raises(ValueError, match="not in a group of 2"):
        ThreadGroup(2).member(2)


def test_export_collectives_exist_eagerly_for_one_worker_only():
    x = torch.randn(3, 2)
    assert torch.equal(all_reduce(x, 1), x) and torch.equal(all_gather(x, 1), x)
    with pytest.raises(ValueError, match="compiled sharded entry"):
        all_reduce(x, 2)


def test_fp8_linear_f32_is_fp8_linear_before_rounding_and_splits_by_columns():
    g = torch.Generator().manual_seed(3)
    codes, scales = _quant_weight(torch.randn(64, 128, generator=g) * 0.05)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    full = ops.fp8_linear_f32(x, codes, scales)
    assert full.dtype == torch.float32
    assert torch.equal(full.to(torch.bfloat16), ops.fp8_linear(x, codes, scales))
    halves = [ops.fp8_linear_f32(x[:, c], codes[:, c], scales[:, s]) for c, s in
              ((slice(0, 64), slice(0, 2)), (slice(64, 128), slice(2, 4)))]
    # the fp32 reduction order is the only difference: a few ulp
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-6, atol=1e-6)


def _quant_weight(w: torch.Tensor):
    from dsv41.graph.formats import np_quant_fp8_weight

    codes, scales = np_quant_fp8_weight(w.numpy())
    return torch.from_numpy(codes), torch.from_numpy(scales)


# ---- one worker's share --------------------------------------------------------------------------


def test_expert_blocks_follow_the_plan_owners():
    for n_routed, shards in ((4, 2), (384, 8), (6, 4), (3, 4)):
        blocks = [expert_block(w, shards, n_routed) for w in range(shards)]
        assert [e for b in blocks for e in b] == list(range(n_routed))
        for w, b in enumerate(blocks):
            assert all(e * shards // n_routed == w for e in b)


def test_a_worker_reads_only_its_slices(small_case):
    path = small_case.checkpoint
    args = load_config(path)
    plan = shard_plan(args, 2)
    whole = load_checkpoint(path, args)
    models, _ = load_workers(path, 2, args)
    for w, model in enumerate(models):
        cuts = worker_slices(plan, w)
        assert set(model.w) == {n for n in cuts if ".ffn.experts." not in n} | {"shard.rank"}
        assert model.w["shard.rank"].tolist() == [w]
        for name, cut in cuts.items():
            if ".ffn.experts." in name:
                continue
            want = whole[name] if cut is None else whole[name].narrow(cut[0], cut[1],
                                                                      cut[2] - cut[1])
            got = model.w[name]
            assert got.shape == want.shape, name
            assert torch.equal(got.to(want.dtype), want), name
        held = expert_block(w, 2, args.n_routed_experts)
        ex = model.experts[1]
        assert ex.w1.size(0) == len(held) + 1  # + the null expert
        for i, e in enumerate(held):
            assert torch.equal(ex.w1[i], whole[f"layers.1.ffn.experts.{e}.w1.weight"])
        assert not ex.w1[-1].any() and not ex.s2[-1].any()
    # the split tensors are half size on each worker
    assert models[1].w["layers.1.attn.wo_b.weight"].shape == (256, 64)
    assert models[1].w["embed.weight"].shape == (256, 256)
    spec = param_spec(args)
    assert models[0].w["layers.1.attn.wq_b.weight"].shape[0] == \
        spec["layers.1.attn.wq_b.weight"].shape[0] // 2


# ---- 2 workers against one ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_worker(small_case, small_model):
    return score(GraphBackend(small_model), small_case.tokens, prefill=small_case.prefill)


def test_two_workers_equal_one_on_shared_small(small_case, one_worker):
    models, group = load_workers(small_case.checkpoint, 2)
    two = score(ShardedBackend(models, group), small_case.tokens, prefill=small_case.prefill)
    rel = _rel(two.logits, one_worker.logits)
    print(f"2 workers vs 1: logits rel L2 max {rel.max():.3g}, median {np.median(rel):.3g}; "
          f"bit-equal rows {int((rel == 0).sum())}/{len(rel)}")
    assert rel.max() < 1e-5
    assert set(two.selections) == set(one_worker.selections)
    for k, v in one_worker.selections.items():
        np.testing.assert_array_equal(two.selections[k], v, err_msg=k)
    rep = evaluate(small_case, two)
    assert rep.conformant, rep.failures


def test_sharded_backend_refuses_models_of_no_group(small_model):
    with pytest.raises(ValueError, match="worker models of one group"):
        ShardedBackend([small_model, small_model], ThreadGroup(2))


@pytest.mark.parametrize("hint", [None, 1])  # the gemm and (CPU decode) gemv kernels
def test_fp8_linear_f32_kernel_matches_its_oracle(hint):
    """The fp32-output kernel (a row-parallel partial sum): the fp8_linear kernel's stages with
    no bf16 rounding; its fp32 additions follow the kernel's order (the gemv adds all of K at
    once), so outputs are within a few fp32 ulp of the oracle's: 1e-6 of the largest output."""
    import tvm

    from dsv41.graph.targets import get_target
    from dsv41.runtime.backends.tensors import to_tvm
    from dsv41.schedules import gemm

    n, k = 64, 128
    ex = tvm.compile(gemm.build_fp8_linear("cpu", n=n, k=k, m=hint, out_dtype="float32"),
                     target=get_target("cpu").tvm_target())
    for m in (1, 5):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        out = tvm.runtime.tensor(np.zeros((m, n), np.float32))
        ex(to_tvm(x), to_tvm(weight), to_tvm(scale), out)
        ref = ops.fp8_linear_f32(x, weight, scale)
        got = torch.from_numpy(out.numpy())
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="bfloat16 .* or float32"):
        gemm.make_fp8_linear(n=n, k=k, out_dtype="float16")


def test_dsv41_compile_shards_refuses_what_it_cannot_build(tmp_path, capsys):
    from dsv41.compiler.tools.cli.main import main

    assert main(["compile", "--preset", "small", "--shards", "3", "--out", str(tmp_path)]) == 2
    assert "do not split over 3" in capsys.readouterr().err
    assert main(["compile", "--preset", "small", "--shards", "2", "--target", "cuda-sm90",
                 "--out", str(tmp_path)]) == 2
    assert "CPU targets only" in capsys.readouterr().err
    assert main(["compile", "--preset", "small", "--shards", "1", "--out", str(tmp_path)]) == 2
    assert "2 or more workers" in capsys.readouterr().err
    assert not any(tmp_path.rglob("*.so"))


def test_uneven_expert_blocks_need_a_library_per_worker():
    from dsv41.compiler.sharded import check_even_split
    from dsv41.graph.config import preset

    args = preset("small")
    check_even_split(args, 2)  # 4 experts over 2
    with pytest.raises(ValueError, match="do not split evenly over 2 workers"):
        check_even_split(args.replace(n_routed_experts=3), 2)


def test_the_placeholder_worker_has_the_loaded_workers_shapes(small_case):
    """What a sharded compile captures (a placeholder worker) is what a worker loads."""
    from dsv41.graph.collectives import ExportCollectives
    from dsv41.graph.model import Model
    from dsv41.graph.sharding import WorkerShard

    models, _ = load_workers(small_case.checkpoint, 2)
    for w, loaded in enumerate(models):
        ghost = Model.placeholder(loaded.args, WorkerShard(w, 2, ExportCollectives(2)))
        assert {n: tuple(t.shape) for n, t in ghost.w.items()} == \
            {n: tuple(t.shape) for n, t in loaded.w.items()}
        for layer, ex in loaded.experts.items():
            assert ghost.experts[layer].w2.shape == ex.w2.shape


def test_a_slice_outside_the_tensor_is_refused(small_case):
    args = load_config(small_case.checkpoint)
    with pytest.raises(ValueError, match="is not a slice of dims 0 or 1"):
        load_checkpoint(small_case.checkpoint, args, only={"embed.weight"},
                        slices={"embed.weight": (0, 256, 1024)})
    got = load_checkpoint(small_case.checkpoint, args, only={"embed.weight", "head.weight"},
                          slices={"embed.weight": (1, 8, 24)})
    whole = load_checkpoint(small_case.checkpoint, args)
    assert set(got) == {"embed.weight", "head.weight"}
    assert torch.equal(got["embed.weight"], whole["embed.weight"][:, 8:24])
