"""What a compiled step touches: cache tensors are updated where the runtime allocated them (no
entry copies or replaces a store, ring or tail buffer it was given), and a decode step
allocates the same bytes whatever the context (its intermediates are planned once, at the
entry's static bounds). Counted through the Relax VM's instrument hook, on the session's
shared-small artifact at two cache capacities four times apart.

Not counted: scratch a TIR kernel allocates inside itself (TVMBackendAllocWorkspace).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dsv41.graph.cache import new_cache
from dsv41.graph.entries import cache_names, cache_tensors
from dsv41.runtime.backends.artifact import Artifact
from dsv41.runtime.backends.compiled import CompiledPhases

PROMPT = 20  # tokens prefilled before the measured step


@pytest.fixture(scope="module")
def compiled(small_artifact, small_model):
    return CompiledPhases(Artifact.load(small_artifact, args=small_model.args), small_model)


class Allocations:
    """Bytes of every VM storage allocation while installed on an entry's VM."""

    def __init__(self, vm):
        self.vm, self.sizes = vm, []

    def __call__(self, func, name, before, ret, *args):
        if not before and name == "vm.builtin.alloc_storage":
            shape, dtype = args[1], args[3]
            n = int(np.prod([int(v) for v in shape]))
            self.sizes.append(n * np.dtype(dtype if dtype != "bfloat16" else "uint16").itemsize)
        return 0

    def __enter__(self):
        self.vm.set_instrument(self)
        return self

    def __exit__(self, *exc):
        self.vm.set_instrument(lambda *a: 0)


def _pointers(cache):
    return {name: t.data_ptr() for name, t in zip(cache_names(cache), cache_tensors(cache),
                                                  strict=True)}


def _step(compiled, model, capacity: int, entry: str):
    """Prefill PROMPT tokens into a cache of `capacity`, then one measured call of `entry`
    (decode: one token; prefill_all: 8 more tokens). Returns (allocated sizes, cache tensor
    pointers before, after, the cache)."""
    cache = new_cache(model.plan, 1, capacity)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (1, PROMPT + 8), generator=gen)
    compiled.prefill_exact(model, cache, tokens[:, :PROMPT])
    before = _pointers(cache)
    with Allocations(compiled.art._vm(entry)) as alloc:
        if entry == "decode":
            compiled.decode_step(model, cache, tokens[:, PROMPT:PROMPT + 1])
        else:
            compiled.prefill_exact(model, cache, tokens[:, PROMPT:], all_logits=True)
    return alloc.sizes, before, _pointers(cache), cache


def _store_names(cache) -> list[str]:
    return [n for n in cache_names(cache) if n.startswith(("store.", "window."))
            and not n.endswith(("tail_kv", "tail_score"))]


@pytest.mark.parametrize("entry", ["decode", "prefill_all"])
def test_cache_buffers_are_written_in_place(compiled, small_model, entry):
    """Every store and ring the entry was given is still the cache's buffer after the call (the
    entry wrote its rows there: a copy would come back as a new buffer)."""
    _, before, after, cache = _step(compiled, small_model, 64, entry)
    for name in _store_names(cache):
        assert after[name] == before[name], f"{entry} replaced {name}"


def test_decode_allocates_the_same_bytes_at_any_context(compiled, small_model):
    """One decode step at capacity 64 and 256 tokens: the same storage allocations, byte for
    byte (the plan is sized by the entry's static bounds, not by the cache)."""
    small, _, _, cache = _step(compiled, small_model, 64, "decode")
    large, _, _, _ = _step(compiled, small_model, 256, "decode")
    assert sum(small) > 0 and int(cache.pos[0]) == PROMPT + 1
    assert sorted(small) == sorted(large)


def test_decode_beyond_its_static_bounds_is_refused(compiled, small_model, monkeypatch):
    m = compiled.art.manifest
    bounds = m.entries["decode"].static_bounds
    with pytest.raises(ValueError, match="batches of up to"):
        compiled.decode_step(small_model, new_cache(small_model.plan, bounds.batch + 1, 64),
                             torch.zeros(bounds.batch + 1, 1, dtype=torch.int64))
    smaller = dataclasses.replace(m.entries["decode"], static_bounds=dataclasses.replace(
        bounds, context_tokens=128))  # a cache of 256 tokens is then too big
    monkeypatch.setattr(compiled.art, "manifest", dataclasses.replace(
        m, entries={**m.entries, "decode": smaller}))
    with pytest.raises(ValueError, match="planned for caches of up to 128 tokens"):
        compiled.decode_step(small_model, new_cache(small_model.plan, 1, 256),
                             torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.slow
def test_decode_allocations_equal_at_1k_and_16k(small_case, small_model, tmp_path_factory):
    """The same check at the issue's sizes: shared-small's weights under a config whose
    max_seq_len allows 16K, caches of 1K and 16K tokens (its own decode + prefill build)."""
    import dataclasses

    from dsv41.compiler.build import CompileOptions, compile_artifact
    from dsv41.graph.plan import build_plan

    args = dataclasses.replace(small_model.args, max_seq_len=16384)
    model = dataclasses.replace(small_model, args=args, plan=build_plan(args))
    out = tmp_path_factory.mktemp("artifacts-16k")
    art_dir = compile_artifact(CompileOptions(args=args, model_name="small-16k", target="cpu",
                                              out=out, entries=("prefill_all", "decode"))
                               ).artifact_dir
    phases = CompiledPhases(Artifact.load(art_dir, args=args), model)
    small, before, after, cache = _step(phases, model, 1024, "decode")
    large, _, _, _ = _step(phases, model, 16384, "decode")
    assert sum(small) > 0 and sorted(small) == sorted(large)
    for name in _store_names(cache):
        assert after[name] == before[name], f"decode replaced {name}"
