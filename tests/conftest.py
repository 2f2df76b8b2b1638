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
