"""`dsv41 bench --profile` (compiler/tools/bench/profile.py) on shared-small's artifact, whose
Engram tables are host-resident: the step runs through `Artifact.call` (the gathers posted and
claimed; profiling outside it failed with `no gather was posted`), and every kernel lands in
the layer the artifact's own structure says (the weights it reads, the plan's roles)."""

from __future__ import annotations

import pytest
import torch

from dsv41.compiler.tools.bench.profile import (
    DSPARK,
    ENTRY,
    MODEL,
    CallKind,
    call_kind,
    format_layers,
    param_layer,
    profile_decode,
    profile_prefill,
)
from dsv41.compiler.tools.bench.synthetic import StepState
from dsv41.graph.cache import new_cache
from dsv41.runtime.backends.artifact import Artifact, ArtifactError
from dsv41.runtime.backends.compiled import CompiledPhases

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def phases(small_artifact, small_model):
    art = Artifact.load(small_artifact, args=small_model.args)
    assert art.hosts_engram  # the case the old profiler failed on
    return CompiledPhases(art, small_model)


def independent_layers(art, model, run) -> list[tuple[str, set]]:
    """The test's own record of one run: each kernel and the layers whose bound weights it
    reads (DSpark's mtp__i is layer n_layers + i, MODEL outside the layers), through a plain
    hook; (entry, None) where an entry call starts."""
    n = model.args.n_layers
    owner = {}
    for entry in art.entries:
        for param, t in art.bound_params(entry):
            head, _, rest = param.partition("__")
            layer = (
                int(rest.split("__")[0]) + (n if head == "mtp" else 0)
                if head in ("layers", "mtp", "experts")
                else MODEL
            )
            owner[t.data_ptr()] = layer
    seen: list[tuple[str, set]] = []

    def make(entry):
        seen.append((entry, None))  # a new entry call: its prologue is ENTRY again

        def hook(func, name, before_run, ret_value, *args):
            name = str(name)
            if before_run and not name.startswith("vm.builtin.") and "." not in name:
                seen.append(
                    (
                        name,
                        {
                            owner[a.data_ptr()]
                            for a in args
                            if hasattr(a, "data_ptr") and a.data_ptr() in owner
                        },
                    )
                )
            return 0

        return hook

    with art.instrumented(make):
        run()
    return seen


def expected_names(seen) -> dict[int | str, list[str]]:
    """Kernels per layer by boundaries, in call order: layer L runs from a kernel reading L's
    weights to the next kernel reading another layer's weights (or only weights outside the
    layers: MODEL); before the first layer everything is ENTRY."""
    names: dict[int | str, list[str]] = {}
    current: int | str = ENTRY
    for name, read in seen:
        if read is None:
            current = ENTRY
            continue
        layers = [x for x in read if isinstance(x, int)]
        if layers:
            current = min(layers)
        elif read and current != ENTRY:
            current = MODEL
        names.setdefault(current, []).append(name)
    return names


def expected_counts(seen) -> dict[int | str, int]:
    return {g: len(v) for g, v in expected_names(seen).items()}


def check_profile(prof, seen, model) -> None:
    plan = model.plan
    layers = {int(k): v for k, v in prof["layers"].items() if k.isdigit()}
    kernels = [x for x in seen if x[1] is not None]
    assert prof["kernels"] == len(kernels) == sum(v["kernels"] for v in prof["layers"].values())
    assert {
        (int(k) if k.isdigit() else k): v["kernels"] for k, v in prof["layers"].items()
    } == expected_counts(seen)
    assert {
        (int(k) if k.isdigit() else k): v["names"] for k, v in prof["layers"].items()
    } == expected_names(seen)
    assert set(layers) == set(range(len(plan.layers)))  # every layer, DSpark's included
    for i, row in layers.items():
        assert row["kind"] == (DSPARK if plan.layers[i].stage == DSPARK else plan.layers[i].role)
    for k in prof["by_kind"].values():
        assert k["kernels_per_layer"] == [prof["layers"][str(i)]["kernels"] for i in k["layers"]]
        assert k["max_kernels_per_layer"] == max(k["kernels_per_layer"])
        fewest = prof["layers"][str(k["fewest_layer"])]["kernels"]
        assert fewest == min(k["kernels_per_layer"])
    assert prof["builtins"] > 0 and prof["vm_overhead_ms"] >= 0.0


def test_decode_profile_counts_kernels_per_layer_kind(phases, small_model):
    m = small_model
    cache = new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id)
    phases.decode_step(m, cache, torch.tensor([PROMPT[:1]]))
    state = StepState.of(cache)
    tok = torch.tensor([[5]])
    prof = profile_decode(phases, m, cache, tok, restore=lambda: state.restore(cache), reps=1)
    assert prof["entry_calls"] == ["decode"]
    # shared-small's Engram layers gather on the host, once each per call
    assert prof["host_calls"] == len(m.args.engram_layer_ids)
    assert {k: v["layers"] for k, v in prof["by_kind"].items()} == {
        "local": [0],
        "full": [1, 3],
        "reuse": [2, 4],
        "reindex": [5],
        DSPARK: [6],
        ENTRY: [ENTRY],
        MODEL: [MODEL],
    }
    state.restore(cache)
    seen = independent_layers(phases.art, m, lambda: phases.decode_step(m, cache, tok))
    check_profile(prof, seen, m)
    text = "\n".join(format_layers("decode", prof))
    reuse = prof["by_kind"]["reuse"]["kernels_per_layer"]
    assert f"reuse    layers [2, 4]: kernels per layer {reuse}" in text
    fewest = prof["by_kind"]["reuse"]["fewest_layer"]
    named = " ".join(prof["layers"][str(fewest)]["names"])
    assert f"      layer {fewest}: {named}" in text  # a Reuse layer's kernels, in call order


def test_prefill_profile_runs_encoder_and_decoder(phases, small_model):
    m = small_model
    tokens = torch.tensor([PROMPT])
    prof = profile_prefill(phases, m, tokens, chunk_tokens=len(PROMPT), reps=1)
    assert prof["entry_calls"] == ["encoder", "decoder"] and prof["tokens"] == len(PROMPT)
    cache = new_cache(m.plan, 1, len(PROMPT) + 64, engram_pad=m.engram.pad_id)
    seen = independent_layers(phases.art, m, lambda: phases.ced_prefill(m, cache, tokens))
    check_profile(prof, seen, m)


def test_instrumented_is_one_at_a_time_and_cleans_up(phases):
    art = phases.art
    with (
        art.instrumented(lambda entry: None),
        pytest.raises(ArtifactError, match="already instrumented"),
    ):
        with art.instrumented(lambda entry: None):
            pass
    assert art._instrument is None and art._vms == {}


def test_names_and_params():
    assert call_kind("vm.builtin.alloc_tensor") == CallKind.BUILTIN
    assert call_kind("dsv41.engram_rows") == CallKind.HOST
    assert call_kind("k_fp8_linear_64_256_") == CallKind.KERNEL
    assert param_layer("layers__3__attn__wq_a__weight", 6) == 3
    assert param_layer("mtp__0__attn__wkv__weight", 6) == 6
    assert param_layer("experts__4__w1", 6) == 4
    assert param_layer("head__weight", 6) is None


def test_bench_profile_report_of_the_artifact(phases, small_model):
    """`dsv41 bench --profile`'s artifact part (e2e.profile_artifact) and its text report."""
    from dsv41.compiler.tools.bench.e2e import BenchOptions, profile_artifact
    from dsv41.compiler.tools.bench.e2e_report import format_profile

    m = small_model
    cache = new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id)
    phases.decode_step(m, cache, torch.tensor([PROMPT[:1]]))
    state = StepState.of(cache)
    opts = BenchOptions(prefill_tokens=8, prefill_chunk_tokens=8, profile_top=3)
    layers = profile_artifact(phases, m, cache, state, opts)
    assert set(layers) == {"decode", "prefill"}
    assert layers["prefill"]["tokens"] == 8  # one chunk: min(chunk, max(prompt, 16))
    assert len(layers["decode"]["top"]) == 3
    text = format_profile(
        {"context": 64, "artifact": layers["decode"]["top"], "artifact_layers": layers}
    )
    assert "artifact kernels per layer kind (decode; prefill: one chunk of 8 tokens):" in text
    for phase in ("decode", "prefill"):
        k = layers[phase]["by_kind"]["reindex"]
        assert f"reindex  layers [5]: kernels per layer {k['kernels_per_layer']}" in text
