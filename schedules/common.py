"""What every kernel shares: named targets, the uint8 bit route for low-precision decoding, and a
bf16 rounding helper.

LLVM's fp8/fp4 casts are wrong near zero and at NaN (../shared/TVM.md §2), so every decode goes
through integer bit manipulation on uint32 lanes; the results are bit-exact to `graph.formats`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T


@dataclass(frozen=True)
class TargetSpec:
    name: str  # our name: cpu, cpu-x86-64, cuda-sm80, cuda-sm90, cuda-sm100
    target: dict  # the TVM target as a dict
    arch: str | None = None  # sm_80 ... for CUDA

    @property
    def is_cuda(self) -> bool:
        return self.arch is not None

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target(self.target)


def _cuda(arch: str) -> TargetSpec:
    return TargetSpec(
        name=f"cuda-{arch.replace('_', '')}",
        target={"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                "max_shared_memory_per_block": 49152, "thread_warp_size": 32},
        arch=arch,
    )


def target_names() -> tuple[str, ...]:
    return ("cpu", "cpu-x86-64", "cuda-sm80", "cuda-sm90", "cuda-sm100")


def get_target(name: str) -> TargetSpec:
    """`cpu` is this machine's LLVM features; `cpu-x86-64` a portable baseline."""
    cores = os.cpu_count() or 1
    # no FMA contraction: a*b - c*d must round like torch's separate multiply and subtract
    # (RoPE, the head and every elementwise chain would otherwise drift by an ulp)
    strict = {"fast-math-contract": False}
    if name == "cpu":
        # LLVM splits 512-bit vectors in two on CPUs it tunes to prefer 256 bits (Sapphire Rapids
        # among them); our kernels vectorise for the full width, so the preference is turned off
        # (a no-op on CPUs without AVX-512)
        return TargetSpec("cpu", {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                  "mattr": ["-prefer-256-bit"], "num-cores": cores, **strict})
    if name == "cpu-x86-64":
        return TargetSpec("cpu-x86-64", {"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                         "mcpu": "x86-64", "num-cores": cores, **strict})
    for arch in ("sm_80", "sm_90", "sm_100"):
        if name == f"cuda-{arch.replace('_', '')}":
            return _cuda(arch)
    raise ValueError(f"Unknown target {name!r}; known targets: {', '.join(target_names())}.")


# ---- the uint8 bit route (TIR expressions; arguments are uint32 lanes) -------------------------


def fp4_to_f32(n):
    """E2M1 nibble (0..15) -> fp32, exact for all 16 codes."""
    s = (n >> T.uint32(3)) & T.uint32(1)
    e = (n >> T.uint32(1)) & T.uint32(3)
    m = n & T.uint32(1)
    normal = T.reinterpret("float32", (s << T.uint32(31)) | ((e + T.uint32(126)) << T.uint32(23))
                           | (m << T.uint32(22)))
    sign = T.if_then_else(s == T.uint32(1), T.float32(-1), T.float32(1))
    sub = T.Cast("float32", m) * T.float32(0.5) * sign
    return T.if_then_else(e == T.uint32(0), sub, normal)


def e4m3_to_f32(b):
    """E4M3 byte -> fp32, exact for all finite codes; 0x7f/0xff give NaN."""
    s = (b >> T.uint32(7)) & T.uint32(1)
    e = (b >> T.uint32(3)) & T.uint32(15)
    m = b & T.uint32(7)
    normal = T.reinterpret("float32", (s << T.uint32(31)) | ((e + T.uint32(120)) << T.uint32(23))
                           | (m << T.uint32(20)))
    sign = T.if_then_else(s == T.uint32(1), T.float32(-1), T.float32(1))
    sub = T.Cast("float32", m) * T.float32(2.0**-9) * sign
    val = T.if_then_else(e == T.uint32(0), sub, normal)
    return T.if_then_else((b & T.uint32(0x7F)) == T.uint32(0x7F),
                          T.reinterpret("float32", T.uint32(0x7FC00000)), val)


def e4m3_to_f32_via_f16(b):
    """E4M3 byte -> fp32 through the hardware fp16 -> fp32 conversion; same values as
    `e4m3_to_f32` for all 256 codes, in about half the vector instructions (CPU decode loops).

    The byte's exponent and mantissa bits, shifted into an fp16 (sign to bit 15, eeeemmm to bits
    13..7), are the E4M3 value times 2^-8 for every code: fp16's bias is 8 above E4M3's, and fp16
    subnormals (E4M3 exponent 0) keep E4M3's subnormal spacing. The conversion to fp32 is exact
    and the product by 2^8 is exact (results are normal fp32), so no denormal fp32 arithmetic is
    involved (a denormal operand makes x86 multiplies microcode-assisted, ~4x slower here)."""
    h = ((b & T.uint32(0x80)) << T.uint32(8)) | ((b & T.uint32(0x7F)) << T.uint32(7))
    val = T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", h))) * T.float32(256.0)
    return T.if_then_else((b & T.uint32(0x7F)) == T.uint32(0x7F),
                          T.reinterpret("float32", T.uint32(0x7FC00000)), val)


def e8m0_to_f32(b):
    """E8M0 byte -> 2^(b-127) fp32; code 0 is 2^-127 (a subnormal), 0xff is NaN."""
    val = T.reinterpret("float32", b << T.uint32(23))
    val = T.if_then_else(b == T.uint32(0), T.reinterpret("float32", T.uint32(0x00400000)), val)
    return T.if_then_else(b == T.uint32(0xFF), T.reinterpret("float32", T.uint32(0x7FC00000)),
                          val)


def round_bf16(x):
    """fp32 -> nearest bf16 (ties to even) -> fp32, as torch's `.to(bfloat16).float()`.

    Done on the bits: TVM folds a Cast(f32, Cast(bf16, x)) pair away. NaN stays NaN."""
    u = T.reinterpret("uint32", x)
    r = (u + ((u >> T.uint32(16)) & T.uint32(1)) + T.uint32(0x7FFF)) & T.uint32(0xFFFF0000)
    return T.if_then_else(x != x, x, T.reinterpret("float32", r))
