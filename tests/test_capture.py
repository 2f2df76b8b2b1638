"""torch.export captures every phase graph with symbolic batch, token and context dims, and the
captured programs compute exactly what the eager phases compute (same ops, so bit-identical
logits and cache bytes), at shapes other than the ones they were traced with."""

from __future__ import annotations

import pytest
import torch
import tvm

from dsv41.compiler.capture import capture
from dsv41.graph.cache import drop_local_state, new_cache
from dsv41.graph.entries import ENTRIES, SELECTING, entry_inputs, load_cache_tensors, selection_keys
from dsv41.graph.phases import (
    Chunk,
    check_tokens,
    decode_step,
    decoder_replay,
    encoder_prefill,
    engram_ids,
    prefill_exact,
    replay_prefill,
)


@pytest.fixture(scope="module")
def programs(small_model):
    """Entries are captured on first use, once per module."""
    cache: dict[str, object] = {}

    def get(entry: str):
        if entry not in cache:
            cache[entry] = capture(small_model, entry)[0].module()
        return cache[entry]

    return get


def _fresh(model, capacity=128):
    return new_cache(model.plan, 1, capacity, engram_pad=model.engram.pad_id)


def _same_cache(a, b):
    from dsv41.graph.entries import cache_names, cache_tensors

    for name, x, y in zip(cache_names(a), cache_tensors(a), cache_tensors(b), strict=True):
        assert torch.equal(x[:, : y.size(1)] if x.dim() > 1 else x,
                           y[:, : x.size(1)] if y.dim() > 1 else y), name


def _run(model, prog, cache, entry, x, **kw):
    """Host half + captured graph; writes the returned cache tensors back."""
    out = prog(*entry_inputs(model, cache, entry, x, **kw))
    n_out = {"encoder": 2, "encoder_replay": 2}.get(entry, 1)
    n_sel = len(selection_keys(model.plan)) if entry in SELECTING else 0
    load_cache_tensors(cache, out[n_out + n_sel:])
    return out[:n_out]


def test_every_entry_is_known():
    assert set(ENTRIES) == {"prefill", "prefill_all", "decode", "encoder", "encoder_replay",
                            "decoder", "draft", "verify"}


@pytest.mark.slow
def test_prefill_and_decode_match_eager(small_case, small_model, programs):
    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    eager, comp = _fresh(m), _fresh(m)
    ref = prefill_exact(m, eager, toks[:, :40], all_logits=True)
    ids = engram_ids(m, comp, toks[:, :40])
    (logits,) = _run(m, programs("prefill_all"), comp, "prefill_all", toks[:, :40], hash_ids=ids)
    comp.pos = comp.pos + 40
    assert torch.equal(logits, ref.logits)
    _same_cache(comp, eager)
    for t in (17, 301):
        ref = decode_step(m, eager, torch.tensor([[t]]))
        ids = engram_ids(m, comp, torch.tensor([[t]]))
        (logits,) = _run(m, programs("decode"), comp, "decode", torch.tensor([[t]]),
                         hash_ids=ids)
        comp.pos = comp.pos + 1
        assert torch.equal(logits, ref.logits)
        _same_cache(comp, eager)


@pytest.mark.slow
def test_prefill_continuation_batch_of_two(small_case, small_model, programs):
    """A continuation chunk (start > 0) for two sequences at different positions."""
    from dsv41.graph.cache import select_sequences, stack_caches

    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    parts = []
    for n in (21, 14):
        c = _fresh(m, 96)
        prefill_exact(m, c, toks[:, :n])
        parts.append(select_sequences(c, [0]))
    eager = stack_caches(parts)
    comp = stack_caches([select_sequences(eager, [0]), select_sequences(eager, [1])])
    new = torch.stack([toks[0, 21:26], toks[0, 14:19]])
    ref = prefill_exact(m, eager, new)
    ids = engram_ids(m, comp, new)
    (logits,) = _run(m, programs("prefill"), comp, "prefill", new, hash_ids=ids)
    assert torch.equal(logits, ref.logits)
    _same_cache(comp, eager)


def test_ced_pair_matches_eager(small_case, small_model, programs):
    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    eager, comp = _fresh(m), _fresh(m)
    enc = encoder_prefill(m, eager, toks)
    ref = decoder_replay(m, eager, enc, all_logits=True)
    ids = engram_ids(m, comp, toks)
    h, pre = _run(m, programs("encoder"), comp, "encoder", toks, hash_ids=ids)
    assert torch.equal(h, enc.h) and torch.equal(pre, enc.pre)
    n = min(toks.size(1), m.args.window_size)
    start = comp.pos + toks.size(1) - n
    (logits,) = _run(m, programs("decoder"), comp, "decoder", (h[:, -n:], pre[:, -n:]),
                     start=start, floor=start, hash_ids=ids[:, -n:])
    assert torch.equal(logits, ref.logits)
    comp.pos = comp.pos + toks.size(1)
    _same_cache(comp, eager)


def test_encoder_replay_matches_eager(small_case, small_model, programs):
    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    eager, comp = _fresh(m), _fresh(m)
    for c in (eager, comp):
        prefill_exact(m, c, toks[:, :30])
        drop_local_state(c)
    ref = replay_prefill(m, eager, toks[:, :30], toks[:, 30:34], all_logits=True)
    # the host half of encoder_replay: lookback, then the replay chunk and the suffix chunk
    from dsv41.graph.engram import empty_history, engram_history_after

    w = m.args.window_size
    first = comp.pos - w
    comp.engram_history = engram_history_after(m.engram, empty_history(m.engram, 1),
                                               toks[:, 30 - w - 3 : 30 - w].numpy())
    ids1 = engram_ids(m, comp, toks[:, 30 - w : 30])
    h1, p1 = _run(m, programs("encoder_replay"), comp, "encoder_replay", toks[:, 30 - w : 30],
                  start=first, floor=first, hash_ids=ids1)
    ids2 = engram_ids(m, comp, toks[:, 30:34])
    h2, p2 = _run(m, programs("encoder"), comp, "encoder", toks[:, 30:34], floor=first,
                  hash_ids=ids2)
    h, pre = torch.cat([h1, h2], 1), torch.cat([p1, p2], 1)
    start = first + h.size(1) - w
    (logits,) = _run(m, programs("decoder"), comp, "decoder", (h[:, -w:], pre[:, -w:]),
                     start=start, floor=start, hash_ids=torch.cat([ids1, ids2], 1)[:, -w:])
    assert torch.equal(logits, ref.logits)
    comp.pos = comp.pos + 4
    _same_cache(comp, eager)


def test_draft_matches_eager(small_case, small_model, programs):
    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    c = _fresh(m)
    prefill_exact(m, c, toks[:, :40])
    res = decode_step(m, c, torch.tensor([[9]]), draft=True)
    nxt = res.logits[:, -1].argmax(-1)
    ids, logits, conf = programs("draft")(*entry_inputs(m, c, "draft", nxt))
    assert torch.equal(ids, res.draft.ids) and torch.equal(logits, res.draft.logits)
    assert torch.equal(conf, res.draft.confidence)


def test_tokens_are_validated_before_the_graph(small_model):
    with pytest.raises(ValueError):
        check_tokens(small_model, torch.tensor([[small_model.args.vocab_size]]))
    assert Chunk is not None


@pytest.fixture(scope="module")
def draft_lowered(small_model):
    from dsv41.compiler.build import lowered_module

    return lowered_module(small_model.args.to_dict(), "draft", "cpu")


def test_decode_lowering_reads_dense_weights_in_place(draft_lowered):
    """At decode row counts the bf16/fp32 linears and the grouped o-projection lower to the
    dense_gemv kernel: no weight matrix is cast, transposed or reshaped (a copy) as a whole per
    call (norm vectors are cast inside their fused elementwise kernels)."""
    from tvm import relax

    mod = relax.transform.DeadCodeElimination(["main"])(draft_lowered)
    main = mod["main"]
    params = set(main.params)
    copied = []
    for block in main.body.blocks:
        for b in block.bindings:
            v = b.value
            if (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)
                    and v.op.name in ("relax.astype", "relax.permute_dims", "relax.reshape")
                    and v.args[0] in params and len(v.args[0].ty.shape) >= 2):  # a matrix
                copied.append(f"{v.op.name}({v.args[0]})")
    assert not copied, copied
    gemvs = [gv.name_hint for gv in mod.functions if gv.name_hint.startswith("k_dense_gemv")]
    assert len(gemvs) >= 2, gemvs  # the o-projection and the head at least


def test_lowered_takes_never_read_out_of_bounds(draft_lowered):
    """Every gather the importer writes as `relax.take` is lowered in mode "clip", not "fast"
    (which reads past the buffer on a bad index and makes TVM warn at every call site)."""
    from tvm import relax

    modes = [b.value.attrs.mode for block in draft_lowered["main"].body.blocks
             for b in block.bindings if isinstance(b.value, relax.Call)
             and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == "relax.take"]
    assert modes and set(modes) == {"clip"}, modes


def test_clip_takes_keeps_in_range_gathers_and_clips_the_rest():
    import numpy as np
    from tvm import relax

    from dsv41.compiler.lower import clip_takes

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 3), "float32"))
    i = relax.Var("i", relax.TensorType((2,), "int64"))
    with bb.function("main", [x, i]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(x, i, axis=0))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(clip_takes(bb.get()), target="llvm"), tvm.cpu())
    xs = np.arange(12, dtype="float32").reshape(4, 3)

    def take(ids):
        return vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(np.array(ids))).numpy()

    np.testing.assert_array_equal(take([3, 1]), xs[[3, 1]])
    np.testing.assert_array_equal(take([9, -5]), xs[[3, 0]])


def test_prefill_lowering_has_no_generic_einsum_or_linear(small_model):
    """At prefill row counts too, the grouped o-projection lowers to our kernel on the CPU, the
    row-tiled dense_gemm (dense_gemv reads the weight once per row: 1.4 s against 0.23 s for
    512 rows of the bench shape): the generic einsum is an unscheduled loop over an fp32 weight
    copy (83% of the bench encoder's time before this was fixed). So do the plain linears (the
    head, the compressors' and the gate's): the generic linear is an unscheduled matmul over a
    transposed fp32 copy of the weight (the bench head alone took 217 ms of a 160-token replay
    that way, 14 ms as dense_gemm). The decoder and encoder_replay entries lower through the
    same converters."""
    from tvm import relax

    from dsv41.compiler.build import lowered_module

    mod = lowered_module(small_model.args.to_dict(), "encoder", "cpu")
    generic = [b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
               and b.value.op.name in ("relax.einsum", "relax.linear", "relax.matmul",
                                       "relax.permute_dims")]
    assert not generic
    assert any(gv.name_hint.startswith("k_dense_gemm") for gv in mod.functions)
    assert not any(gv.name_hint.startswith("k_dense_gemv") for gv in mod.functions)
