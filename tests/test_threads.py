"""TVM's CPU pool: sized to torch's threads on artifact load unless the user chose a size."""

import pytest
import torch

from dsv41.runtime.backends.threads import default_tvm_pool, size_tvm_pool, tvm_num_threads


def test_pool_follows_torch_unless_chosen(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    try:
        assert default_tvm_pool() == n == tvm_num_threads()
        assert default_tvm_pool(1) == 1 == tvm_num_threads()  # the engine's `threads` option
        monkeypatch.setenv("TVM_NUM_THREADS", "1")
        assert default_tvm_pool() == 1  # an explicit TVM_NUM_THREADS is kept
        with pytest.raises(ValueError, match="at least 1"):
            size_tvm_pool(0)
    finally:
        size_tvm_pool(n)


def test_engine_option_sizes_the_pool(small_artifact, small_model):
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases

    n = torch.get_num_threads()
    try:
        CompiledPhases(Artifact.load(small_artifact, args=small_model.args), small_model,
                       threads=1)
        assert tvm_num_threads() == 1
    finally:
        size_tvm_pool(n)
