"""Where an engine runs: the device its weights, runtime cache and compiled entries live on.

One code path for every device: the CPU is `Device(DeviceKind.CPU)`, a GPU `Device(DeviceKind.
CUDA, index)`; torch tensors on it go to TVM and back by DLPack (no host copies), and the Relax
VM runs there. The checks refuse, with a sentence naming what is missing, a device that cannot
run an artifact: a CUDA artifact on a host without a GPU (or without a CUDA build of torch, or
without TVM's CUDA runtime), a GPU of another architecture than the artifact's, a CPU artifact
asked to run on a GPU. Nothing here needs TVM's compiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from dsv41.graph.targets import target_arch


class DeviceError(ValueError):
    """This device cannot run the artifact (or does not exist here)."""


class DeviceKind(Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class Device:
    kind: DeviceKind
    index: int = 0

    @classmethod
    def parse(cls, text: str | Device) -> Device:
        """`cpu`, `cuda` or `cuda:N`."""
        if isinstance(text, Device):
            return text
        kind, _, index = str(text).partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (
                kind == "cpu" and index not in ("", "0")):
            raise DeviceError(f"Unknown device {text!r}; use 'cpu', 'cuda' or 'cuda:N'.")
        return cls(DeviceKind(kind), int(index or 0))

    def __str__(self) -> str:
        return "cpu" if self.kind is DeviceKind.CPU else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind is DeviceKind.CUDA

    @property
    def torch(self) -> torch.device:
        return torch.device(str(self))

    def tvm(self):  # -> tvm.runtime.Device
        import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

        return tvm.cuda(self.index) if self.is_cuda else tvm.cpu(0)


def device_for_target(target: str, requested: str | Device | None = None) -> Device:
    """The device an artifact built for `target` runs on: `requested`, else the target's kind
    (`cuda:0` for a CUDA target), with TVM's runtime libraries for it loaded; DeviceError when
    this process cannot run it there."""
    arch = target_arch(target)
    dev = Device.parse(requested) if requested is not None else (
        Device(DeviceKind.CUDA) if arch else Device(DeviceKind.CPU))
    if dev.is_cuda != (arch is not None):
        raise DeviceError(f"An artifact built for {target} runs on "
                          f"{'a CUDA GPU' if arch else 'the CPU'}, not on {dev}; compile it "
                          f"with `dsv41 compile --target {'cpu' if dev.is_cuda else 'cuda-smXX'}`"
                          " for that device.")
    load_tvm_runtime_lib("tvm_runtime_extra")  # the CPU externs (sort, top-k) the VM calls
    if dev.is_cuda:
        check_cuda(dev, arch, target)
    return dev


def gpu_arch(dev: Device) -> str | None:
    """`sm_90` for the GPU `dev`, None when this process cannot use a GPU there."""
    if not torch.cuda.is_available() or dev.index >= torch.cuda.device_count():
        return None
    major, minor = torch.cuda.get_device_capability(dev.index)
    return f"sm_{major}{minor}"


def check_cuda(dev: Device, arch: str, target: str) -> None:
    """DeviceError unless `dev` is a GPU of `arch` that torch and TVM's runtime can both use."""
    if not torch.cuda.is_available():
        raise DeviceError(f"{target} runs on a CUDA GPU, and this machine has no CUDA GPU "
                          f"that torch {torch.__version__} can use (a CUDA build of torch and a "
                          "GPU driver are needed).")
    if dev.index >= torch.cuda.device_count():
        raise DeviceError(f"Device {dev} does not exist: this machine has "
                          f"{torch.cuda.device_count()} CUDA GPU(s).")
    have = gpu_arch(dev)
    if have != arch:
        raise DeviceError(f"The artifact is built for {target} ({arch}), and {dev} is "
                          f"{torch.cuda.get_device_name(dev.index)} ({have}); compile it with "
                          f"`dsv41 compile --target cuda-{have.replace('_', '')}`.")
    load_tvm_runtime_lib("tvm_runtime_cuda")
    if not dev.tvm().exist:
        raise DeviceError(f"TVM's CUDA runtime cannot open {dev} (torch can).")


def load_tvm_runtime_lib(name: str) -> None:
    """Load TVM's runtime sidecar `lib<name>` (tvm_runtime_extra: the CPU externs such as sort;
    tvm_runtime_cuda: the CUDA device) next to `libtvm_runtime`, if the import of TVM did not:
    it does not when TVM runs runtime-only (`TVM_USE_RUNTIME_LIB=1`). DeviceError when it cannot
    load."""
    # order: tvm loads only after disco's libraries (disco.load_disco)
    import tvm
    from tvm_ffi.libinfo import load_lib_ctypes

    libs = tvm.base._LOADED_LIBS  # TVM's own record of the libraries it loaded (public use)
    if name in libs:
        return
    runtime_dir = Path(libs["tvm_runtime"]._name).resolve().parent
    try:
        libs[name] = load_lib_ctypes(package="tvm", target_name=name,
                                     extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
    except (OSError, RuntimeError) as e:
        raise DeviceError(f"TVM's runtime library lib{name} does not load: {e}") from e


def compiler_available() -> bool:
    """Whether this process loaded TVM's compiler (False when TVM runs runtime-only)."""
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    return "tvm_compiler" in tvm.base._LOADED_LIBS
