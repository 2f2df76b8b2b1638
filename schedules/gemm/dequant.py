"""The FP8 weight dequantisation kernel (E4M3 x E8M0 -> bf16): block, config, schedule."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import (
    e4m3_to_f32,
    e8m0_byte,
    i64,
)
from dsv41.schedules.gemm.fp8 import BLOCK

# ---- fp8_dequant ------------------------------------------------------------------------------


def make_fp8_dequant(*, d: int) -> tvm.tirx.PrimFunc:
    """`fp8_dequant(codes, scales) -> out`: E4M3 uint8 [r, d] with E8M0 uint8 [r, d/32] ->
    fp32 [r, d] (symbolic r; the compiler flattens the op's leading dims). Bit-exact."""
    if d % BLOCK:
        raise ValueError(f"fp8_dequant needs d a multiple of {BLOCK}, got {d}.")
    D, DB = i64(d), i64(d // BLOCK)

    @T.prim_func(s_tir=True)
    def fp8_dequant(codes_h: T.handle, scales_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "fp8_dequant", "tirx.noalias": True})
        r = T.int64()
        codes = T.match_buffer(codes_h, (r, D), "uint8")
        scales = T.match_buffer(scales_h, (r, DB), "uint8")
        out = T.match_buffer(out_h, (r, D), "float32")
        for i, j in T.grid(r, D):
            with T.sblock("dequant"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = e4m3_to_f32(T.Cast("uint32", codes[vi, vj])) * e8m0_byte(
                    scales[vi, vj // BLOCK])

    return fp8_dequant


@dataclass(frozen=True)
class DequantConfig:
    """Elementwise: CPU `vec` lanes over the row, parallel over rows; CUDA `threads` per block
    over the flattened (row, column) space."""

    vec: int = 16
    threads: int = 256


def dequant_config(target: TargetSpec, *, d: int) -> DequantConfig:
    vec = 16
    while d % vec:
        vec //= 2
    return DequantConfig(vec=vec, threads=256)


def schedule_dequant(func: tvm.tirx.PrimFunc, config: DequantConfig,
                     target: TargetSpec) -> tvm.tirx.PrimFunc:
    """One `dequant` block over [r, d]."""
    sch = s_tir.Schedule(func)
    i, j = sch.get_loops(sch.get_sblock("dequant"))
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, j), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        _, jv = sch.split(j, [None, config.vec])
        sch.parallel(i)
        sch.vectorize(jv)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_fp8_dequant(target_name: str, *, d: int) -> tvm.tirx.PrimFunc:
    target = get_target(target_name)
    return schedule_dequant(make_fp8_dequant(d=d), dequant_config(target, d=d), target)
