"""The deployment targets: our names for them and the TVM target each stands for. Shared by
the kernels (`schedules/`), the compiler and the runtime's artifact check; TVM is imported only
when a target is built.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class TargetName(StrEnum):
    """Our name of a deployment target (an artifact's `target.name`, `dsv41 compile --target`)."""

    CPU = "cpu"
    CPU_AVX2 = "cpu-avx2"
    CPU_X86_64 = "cpu-x86-64"
    CUDA_SM80 = "cuda-sm80"
    CUDA_SM90 = "cuda-sm90"
    CUDA_SM100 = "cuda-sm100"


@dataclass(frozen=True)
class TargetSpec:
    name: str  # our name: cpu, cpu-avx2, cpu-x86-64, cuda-sm80, cuda-sm90, cuda-sm100
    target: dict  # the TVM target as a dict
    arch: str | None = None  # sm_80 ... for CUDA

    @property
    def is_cuda(self) -> bool:
        return self.arch is not None

    def tvm_target(self):  # -> tvm.target.Target
        import tvm  # heavy: TVM (~4 s); the CLI and the runtime read targets without it

        return tvm.target.Target(self.target)


def _cuda(arch: str) -> TargetSpec:
    return TargetSpec(
        name=f"cuda-{arch.replace('_', '')}",
        target={"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                "max_shared_memory_per_block": 49152, "thread_warp_size": 32},
        arch=arch,
    )


def target_names() -> tuple[TargetName, ...]:
    return tuple(TargetName)


def target_arch(name: str) -> str | None:
    """The CUDA arch of a target (`sm_90`), None for a CPU target; needs no TVM (the runtime
    checks an artifact's target with it without TVM's compiler)."""
    if name not in target_names():
        raise ValueError(f"Unknown target {name!r}; known targets: {', '.join(target_names())}.")
    return "sm_" + name.removeprefix("cuda-sm") if name.startswith("cuda-") else None


AMX_MATTR = ("+amx-tile", "+amx-int8", "+amx-bf16")
_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl: ask for an extended state component
_XFEATURE_XTILEDATA = 18  # the AMX tile data
_SYS_ARCH_PRCTL = 158  # x86-64


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def request_amx() -> bool:
    """Ask Linux for this process's permission to use AMX tile data (needed before the first AMX
    instruction, or it faults; granted once for every thread of the process, asking again is a
    no-op). False where the CPU, the OS or the kernel version does not offer it."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    if not {"amx_tile", "amx_bf16", "amx_int8"} <= cpu_flags():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def uses_amx(target: dict) -> bool:
    """Whether code built for a TVM target dict may run AMX instructions."""
    return any(f in AMX_MATTR for f in target.get("mattr", ()))


# LLVM's name of an x86 feature our kernels may use -> Linux's (/proc/cpuinfo); AMX apart
# (`request_amx`: the OS must grant it)
LINUX_FLAG = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi2": "bmi2",
              "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
              "avx512vl": "avx512vl", "avx512cd": "avx512cd", "avx512bf16": "avx512_bf16",
              "avx512vnni": "avx512_vnni", "avx512vbmi": "avx512vbmi",
              "avx512vbmi2": "avx512_vbmi2", "avxvnni": "avx_vnni"}


def target_cpu_features(target: dict) -> tuple[str, ...] | None:
    """The x86 features (Linux names) code built for an LLVM target dict may use, whatever this
    CPU has; None for a non-LLVM target or without TVM's LLVM target support (a runtime-only
    TVM, `dsv41 bundle`)."""
    if not isinstance(target, dict) or target.get("kind") != "llvm":
        return None
    import tvm  # heavy: TVM (~4 s); only when an artifact is built or loaded

    try:
        from tvm.target import codegen

        t = tvm.target.Target(target)
    except (ImportError, AttributeError):  # a runtime-only TVM: no LLVM targets
        return None
    return tuple(sorted(linux for llvm, linux in LINUX_FLAG.items()
                        if codegen.target_has_features(llvm, t)))


def missing_cpu_features(target: dict, recorded: Sequence[str] | None = None) -> list[str]:
    """The x86 features code built for an LLVM target dict may use that this CPU lacks (Linux
    names; empty off x86-64 Linux or when /proc/cpuinfo says nothing): such code stops at its
    first such instruction (SIGILL). Those the target's features name (`target_cpu_features`,
    where this TVM has LLVM) and those the artifact recorded at compile time (`recorded`, its
    manifest's `cpu_features`), so a runtime-only TVM still checks what the manifest says."""
    flags = cpu_flags()
    if platform.machine() != "x86_64" or not flags:
        return []
    if isinstance(target, dict) and target.get("kind") not in (None, "llvm"):
        return []
    needed = set(recorded or ()) | set(target_cpu_features(target) or ())
    return sorted(f for f in needed if f not in flags)


def get_target(name: str) -> TargetSpec:
    """`cpu` is this machine's LLVM features; `cpu-avx2` any x86-64 with AVX2, FMA and F16C
    (LLVM's x86-64-v3: Haswell, EPYC Naples and later; the kernels' AVX2 paths); `cpu-x86-64`
    a portable baseline."""
    import tvm  # heavy: TVM (~4 s); the CLI and the runtime read targets without it

    cores = os.cpu_count() or 1
    # no FMA contraction: a*b - c*d must round like torch's separate multiply and subtract
    # (RoPE, the head and every elementwise chain would otherwise drift by an ulp)
    strict = {"fast-math-contract": False}
    if name == "cpu":
        # LLVM splits 512-bit vectors in two on CPUs it tunes to prefer 256 bits (Sapphire Rapids
        # among them); our kernels vectorise for the full width, so the preference is turned off
        # (a no-op on CPUs without AVX-512)
        # AMX where this process may use it (LLVM names the CPU of a VM by its AVX-512 subset,
        # without AMX, even when the host grants it): asking for the permission here lets any
        # process that builds for `cpu` also run what it built
        amx = list(AMX_MATTR) if request_amx() else []
        return TargetSpec("cpu", {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                  "mattr": ["-prefer-256-bit", *amx], "num-cores": cores,
                                  **strict})
    if name == "cpu-avx2":
        return TargetSpec("cpu-avx2", {"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                       "mcpu": "x86-64-v3", "num-cores": cores, **strict})
    if name == "cpu-x86-64":
        return TargetSpec("cpu-x86-64", {"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                         "mcpu": "x86-64", "num-cores": cores, **strict})
    for arch in ("sm_80", "sm_90", "sm_100"):
        if name == f"cuda-{arch.replace('_', '')}":
            return _cuda(arch)
    raise ValueError(f"Unknown target {name!r}; known targets: {', '.join(target_names())}.")
