"""`bench.macs`: one decode row's dense multiply-adds (the verify floor of `dsv41 bench spec`),
counted by hand for the bench preset."""

from __future__ import annotations

import pytest

from dsv41.compiler.tools.bench.macs import RowMacs, row_macs, verify_floor_steps
from dsv41.graph.config import preset
from dsv41.graph.plan import build_plan


def test_bench_presets_row_macs_by_hand():
    # dim 1024, q_lora 512, 64 heads x 512, o-groups 8 x o_lora 512, 40 layers (2 local), MoE
    # 2 activated + 1 shared of 1024 x 512 (x3), window 128, top-k 512, vocab 8192
    per_layer = 1024 * 512 + 512 * 64 * 512 + 1024 * 512 + 64 * 512 * 512 + 8 * 512 * 1024
    got = row_macs(build_plan(preset("bench")))
    assert got == RowMacs(projections=40 * per_layer, experts=40 * 3 * 3 * 1024 * 512,
                          attention=2 * 2 * 64 * 128 * 512 + 38 * 2 * 64 * 640 * 512,
                          head=1024 * 8192)
    assert got.total == 3_359_637_504


def test_verify_floor_in_decode_steps():
    macs = RowMacs(projections=60, experts=20, attention=15, head=5)  # 100 per row
    assert verify_floor_steps(0, decode_s=2.0, macs=macs, macs_per_s=10.0) == 1.0
    assert verify_floor_steps(4, decode_s=2.0, macs=macs, macs_per_s=10.0) == 21.0
    with pytest.raises(ValueError, match="decode_s > 0"):
        verify_floor_steps(1, decode_s=0.0, macs=macs, macs_per_s=10.0)


def test_an_artifacts_floor_takes_the_rate_of_the_dots_its_code_runs():
    """`bench spec`'s floor for an artifact: bf16 dot products only where its compiler recorded
    AVX-512 BF16 or AMX-BF16 (a `cpu-avx2` artifact sums in fp32 whatever the CPU has)."""
    from types import SimpleNamespace

    from dsv41.compiler.tools.bench.spec import artifact_dots, best_macs_per_s

    def manifest(features):
        return SimpleNamespace(target=SimpleNamespace(cpu_features=features))

    assert artifact_dots(manifest(("avx2", "bmi2", "f16c", "fma"))) == ("fp32",)
    assert artifact_dots(manifest(("avx2", "avx512_bf16", "avx512f"))) == ("fp32", "bf16")
    assert artifact_dots(manifest(("amx_bf16", "avx512f"))) == ("fp32", "bf16")
    assert artifact_dots(manifest(None)) == ("fp32", "bf16")  # an older manifest
    roof = {"gflops": {"fp32": 190.0, "bf16": 420.0, "int8": 880.0}}
    assert best_macs_per_s(roof, ("fp32",)) == pytest.approx(95e9)
    assert best_macs_per_s(roof, ("fp32", "bf16")) == pytest.approx(210e9)
