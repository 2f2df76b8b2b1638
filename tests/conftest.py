"""Shared fixtures: conformance cases and models are loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"
CONFORMANCE = SHARED / "conformance"

# The released goldens were computed with 2 threads; GEMM summation order follows the count.
torch.set_num_threads(2)


def case_dir(name: str) -> Path:
    path = CONFORMANCE / name
    if not path.exists():
        pytest.skip(f"conformance pack {path} is not present")
    return path


@pytest.fixture(scope="session")
def small_case():
    from dsv41.graph.conformance import load_case

    return load_case(case_dir("shared-small"))


@pytest.fixture(scope="session")
def v41_case():
    from dsv41.graph.conformance import load_case

    return load_case(case_dir("shared-v41-small"))


@pytest.fixture(scope="session")
def small_model(small_case):
    from dsv41.graph.model import Model

    return Model.from_checkpoint(small_case.checkpoint)


@pytest.fixture(scope="session")
def v41_model(v41_case):
    from dsv41.graph.model import Model

    return Model.from_checkpoint(v41_case.checkpoint)


# the entries compiled once per session for shared-small (compile, engine and run tests)
ARTIFACT_ENTRIES = ("prefill_all", "decode", "encoder", "decoder", "encoder_replay")


@pytest.fixture(scope="session")
def small_artifact(small_case, tmp_path_factory):
    from dsv41.compiler.build import CompileOptions, compile_artifact
    from dsv41.graph.config import load_config

    args = load_config(small_case.checkpoint)
    opts = CompileOptions(args=args, model_name="shared-small", target="cpu",
                          out=tmp_path_factory.mktemp("artifacts"), entries=ARTIFACT_ENTRIES)
    report = compile_artifact(opts)
    print({e: round(sum(t.values()), 1) for e, t in report.seconds.items()})
    return report.artifact_dir
