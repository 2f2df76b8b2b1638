"""A roofline that is a property of the machine, not of one noisy sample.

- Bandwidth: `passes` STREAM-like passes (copy and triad over float32 arrays of `n_bytes` each,
  one warm-up call, then each pass times one call of each); every pass is reported and the roof
  is the best pass. A shared machine makes single samples wander (one bench run measured 22.0
  GB/s, the next 14.4): the best of several passes is the machine's bus, the spread is the noise.
- Compute: the best matrix rate of each dtype the step's kernels can use on this CPU: fp32 FMA
  always, bf16 dot products where lscpu lists `avx512_bf16` or `amx_bf16`, int8 dot products
  (VNNI) where it lists `avx512_vnni`, `avx_vnni` or `amx_int8`. Measured with torch matmuls
  (`torch.mm` in fp32 and bf16, oneDNN; int8 the faster of `torch._int_mm` and FBGEMM's
  quantized linear), best of `reps`; the roof is the fastest of them (a step whose FLOPs all
  ran at that rate could not be faster).

torch is imported where it is used: the CLI's parser reads this module without it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from enum import StrEnum

BANDWIDTH_PASSES = 5  # STREAM-like passes of `dsv41 bench` (each reported)
COMPUTE_METHOD = (
    "torch matmuls: torch.mm fp32 / bf16 (oneDNN), int8 the faster of "
    "torch._int_mm and FBGEMM's quantized.linear"
)


class Dtype(StrEnum):
    """The arithmetic a compute roof is measured in."""

    FP32 = "fp32"  # FMA
    BF16 = "bf16"  # bf16 dot products (AVX512-BF16 or AMX-BF16)
    INT8 = "int8"  # int8 dot products into int32 (VNNI or AMX-INT8)


# lscpu flags that give a dtype its dot-product instructions (fp32 FMA needs none here)
DTYPE_FLAGS = {
    Dtype.BF16: ("avx512_bf16", "amx_bf16"),
    Dtype.INT8: ("avx512_vnni", "avx_vnni", "amx_int8"),
}


def step_dtypes(flags: set[str]) -> tuple[Dtype, ...]:
    """The dtypes whose dot products this CPU has (fp32 always first)."""
    return (Dtype.FP32, *(d for d, need in DTYPE_FLAGS.items() if flags & set(need)))


@dataclass(frozen=True)
class StreamPass:
    """One STREAM-like pass: copy moves 2 x n bytes, triad 3 x n (write-allocate not counted)."""

    copy_gbs: float
    triad_gbs: float
    at_s: float  # seconds since the first pass started

    @property
    def best_gbs(self) -> float:
        return max(self.copy_gbs, self.triad_gbs)


def stream_passes(n_bytes: int, passes: int = BANDWIDTH_PASSES) -> tuple[StreamPass, ...]:
    """`passes` timed copy + triad passes over float32 arrays of n_bytes each (multi-threaded
    torch ops), after one warm-up call of each."""
    import torch  # heavy: torch; dsv41 --help imports this module

    if passes < 1:
        raise ValueError(f"A bandwidth measurement needs at least 1 pass, got {passes}.")
    n = n_bytes // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    a.copy_(b)
    torch.add(b, c, alpha=3.0, out=a)
    out = []
    t0 = time.perf_counter()
    for _ in range(passes):
        t = time.perf_counter()
        at, t0 = (t - t0, t0) if out else (0.0, t)
        a.copy_(b)
        t_copy = time.perf_counter() - t
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        t_triad = time.perf_counter() - t
        out.append(StreamPass(2 * 4 * n / t_copy / 1e9, 3 * 4 * n / t_triad / 1e9, at))
    return tuple(out)


def fastest_s(fn, reps: int) -> float:
    """The fastest of `reps` timed calls of fn, after one warm-up call (measure.best_time's rule;
    this module sits below measure.py, which reads its roof from here)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def int8_rates(size: int, reps: int = 5) -> dict[str, float]:
    """GOP/s of a size^3 int8 matmul two ways: `torch._int_mm` (int32 out; not VNNI-tuned on
    every build) and FBGEMM's quantized linear (VNNI where the CPU has it, with requantisation
    on top); the roof takes the faster."""
    import warnings

    import torch  # heavy: torch; dsv41 --help imports this module

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (size, size), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (size, size), generator=g, dtype=torch.int8)
    out = {"torch._int_mm": 2 * size**3 / fastest_s(lambda: torch._int_mm(a, b), reps) / 1e9}
    if "fbgemm" in torch.backends.quantized.supported_engines:
        with warnings.catch_warnings():  # quantized tensors are deprecated; FBGEMM is not
            warnings.simplefilter("ignore")
            engine, torch.backends.quantized.engine = torch.backends.quantized.engine, "fbgemm"
            x = torch.randn(size, size, generator=g)
            qx = torch.quantize_per_tensor(x, 0.05, 128, torch.quint8)
            qw = torch.quantize_per_tensor(
                torch.randn(size, size, generator=g), 0.05, 0, torch.qint8
            )
            packed = torch.ops.quantized.linear_prepack(qw, None)
            t = fastest_s(lambda: torch.ops.quantized.linear(qx, packed, 0.1, 128), reps)
            torch.backends.quantized.engine = engine
        out["fbgemm quantized.linear"] = 2 * size**3 / t / 1e9
    return out


def measure_matmul(dtype: Dtype, size: int, reps: int = 5) -> float:
    """GFLOP/s (GOP/s for int8) of a size^3 matmul in `dtype`, best of `reps`."""
    import torch  # heavy: torch; dsv41 --help imports this module

    g = torch.Generator().manual_seed(0)
    if dtype == Dtype.INT8:
        return max(int8_rates(size, reps).values())
    dt = torch.float32 if dtype == Dtype.FP32 else torch.bfloat16
    a = torch.randn(size, size, generator=g).to(dt)
    b = torch.randn(size, size, generator=g).to(dt)
    out = torch.empty(size, size, dtype=dt)
    t = fastest_s(lambda: torch.mm(a, b, out=out), reps)
    return 2 * size**3 / t / 1e9


@dataclass(frozen=True)
class ComputeRoof:
    """The best matrix rate per dtype this CPU has dot products for, and the roof (the fastest)."""

    gflops: dict[str, float]  # dtype -> GFLOP/s (int8: GOP/s)
    size: int  # the matmuls' size (size^3)
    method: str = COMPUTE_METHOD

    @property
    def best_dtype(self) -> str:
        return max(self.gflops, key=self.gflops.__getitem__)

    @property
    def best_gflops(self) -> float:
        return self.gflops[self.best_dtype]

    def to_dict(self) -> dict:
        return {**asdict(self), "best_dtype": self.best_dtype, "best_gflops": self.best_gflops}


def measure_compute(flags: set[str], size: int, reps: int = 5) -> ComputeRoof:
    """The matrix rate of every dtype in `step_dtypes(flags)`."""
    return ComputeRoof({d.value: measure_matmul(d, size, reps) for d in step_dtypes(flags)}, size)


def best_bandwidth(passes) -> float:
    """The roof's bandwidth: the best pass (copy or triad) of all the passes given."""
    passes = list(passes)
    if not passes:
        raise ValueError("No bandwidth passes to take the best of.")
    return max(
        p.best_gbs if isinstance(p, StreamPass) else max(p["copy_gbs"], p["triad_gbs"])
        for p in passes
    )
