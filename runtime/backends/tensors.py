"""torch <-> TVM tensors: the one converter the runtime, the compiler's benchmarks and the kernel
tests share. On the tensor's own device it is a zero-copy DLPack view (a copy only when the
data is not contiguous and 64-byte aligned, which DLPack import needs); onto another device
(a host tensor for a GPU kernel) it copies through the host, so no CUDA build of torch is
needed to feed a CUDA kernel. Nothing here needs TVM's compiler.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64  # bytes: TVM's DLPack import refuses less aligned data
_KDL_CPU = 1  # DLPack's device type of the host


def to_tvm(t: torch.Tensor, device=None):
    """`t` as a `tvm.runtime.Tensor`: a view of its data (made contiguous and aligned first when
    it is not), or with `device` (a `tvm.runtime.Device`) other than the host and `t` on the
    host, a copy there."""
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    t = t.contiguous()
    if t.numel() == 0:  # torch gives an empty tensor strides TVM does not take as compact
        if device is None:
            device = tvm.cpu() if t.device.type == "cpu" else tvm.cuda(t.device.index or 0)
        return tvm.runtime.empty(tuple(t.shape), str(t.dtype).removeprefix("torch."), device)
    if device is not None and device.dlpack_device_type() != _KDL_CPU and t.device.type == "cpu":
        return tvm.runtime.tensor(host_array(t), device)
    if t.data_ptr() % _ALIGN:
        t = t.clone()
    return tvm.runtime.from_dlpack(t)


def to_torch(a) -> torch.Tensor:
    """A `tvm.runtime.Tensor` as a torch tensor on the same device, sharing its data."""
    return torch.from_dlpack(a)


def host_torch(a) -> torch.Tensor:
    """A `tvm.runtime.Tensor`'s data as a host torch tensor: a view of a host tensor, else a
    copy through the host (no CUDA build of torch needed)."""
    if a.device.dlpack_device_type() == _KDL_CPU:
        return torch.from_dlpack(a)
    arr = a.numpy()
    if arr.dtype.name == "bfloat16":  # ml_dtypes' bf16, which torch.from_numpy does not take
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor's data as numpy (bf16 as `ml_dtypes.bfloat16`, which numpy lacks), for the
    copy onto another device."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # heavy: ml_dtypes (~0.7 s), for bf16 host copies only

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()
