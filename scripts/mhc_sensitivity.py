"""How much the seeded checkpoint amplifies fp32 rounding in the mHC mixes: the graph engine's
first-turn logits (rel L2) when `dsv41::hc_pre_mix`'s post and comb outputs are perturbed by a
relative 2e-7 (the fused kernel's measured difference, tests/test_kernel_mhc.py), one seed per
run, and when they carry real bugs, for scale.

    python scripts/mhc_sensitivity.py [--case ../shared/conformance/shared-small] [--seeds 8]

Session 10 measured on shared-small: perturbations 0.013-0.252 over 8 seeds; a transposed
comb 0.139; one Sinkhorn round less 0.0. So first-turn logits cannot tell rounding from a bug,
and tests/test_engine_artifact.py compares the compiled engine with the graph run on the
artifact's own kernels instead (`kernel_numerics.patch_fused_ops`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from dsv41.graph import ops
from dsv41.graph.conformance import load_case
from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine

PROMPT = [int(x) for x in np.random.default_rng(1).integers(3, 500, 37)]  # the test's turn 1


def first_turn_logits(model: Model) -> np.ndarray:
    session = Engine.from_model(model, weights_hash="sensitivity", page_tokens=8).session()
    list(session.send(PROMPT, max_new_tokens=2, keep_logits=True))
    return session.turns[0].logits[0]


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default=str(root.parent / "shared/conformance/shared-small"))
    p.add_argument("--seeds", type=int, default=8)
    ns = p.parse_args()
    model = Model.from_checkpoint(load_case(ns.case).checkpoint)
    ref = first_turn_logits(model)
    exact = ops.hc_pre_mix
    try:
        for seed in range(ns.seeds):
            gen = torch.Generator().manual_seed(seed)

            def perturbed(*args, gen=gen):
                x, pre, post, comb = exact(*args)
                return (x, pre, post * (1 + 2e-7 * torch.randn(post.shape, generator=gen)),
                        comb * (1 + 2e-7 * torch.randn(comb.shape, generator=gen)))

            ops.hc_pre_mix = perturbed
            print(f"post and comb x (1 + 2e-7 N(0, 1)), seed {seed}: rel L2 "
                  f"{rel_l2(first_turn_logits(model), ref):.4f}", flush=True)
        def comb_transposed(*args):
            x, pre, post, comb = exact(*args)
            return x, pre, post, comb.transpose(-1, -2)

        bugs = {
            "comb transposed": comb_transposed,
            "one Sinkhorn round less": lambda *a: exact(*a[:7], a[7] - 1, *a[8:]),
        }
        for name, bug in bugs.items():
            ops.hc_pre_mix = bug
            print(f"{name}: rel L2 {rel_l2(first_turn_logits(model), ref):.4f}", flush=True)
    finally:
        ops.hc_pre_mix = exact


if __name__ == "__main__":
    main()
