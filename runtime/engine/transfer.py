"""Copies between the tiers' host arrays and a cache on its device, batched per restore or
per offload.

On the CPU a copy is one memcpy into (or out of) the cache tensor. On a GPU every copy of one
restore or one offload goes through pinned host memory on one side stream, enqueued without
waiting:

- a restore (`into`) ends with `ready_for_compute`: the compute stream waits for the copies on
  the device, so the host goes on preparing the prefill that reads them (token checks, hash ids,
  RoPE tables, the replay's inputs) while they run;
- an offload (`out`) ends with `ready_for_host`: one wait for all of the turn's copies before
  the arrays go to the tiers (one stall per turn end, not one per tensor).
"""

from __future__ import annotations

import numpy as np
import torch


class Transfers:
    """One restore's or one offload's copies for a cache on `device`."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._side = None  # the side stream (CUDA), made at the first copy
        self._keep: list[torch.Tensor] = []  # pinned sources, alive until the copies are done
        self._outs: list[tuple[torch.Tensor, np.ndarray]] = []  # pinned staging -> the array

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
            # what the compute stream wrote (or allocated) comes first
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        return self._side

    def out(self, t: torch.Tensor) -> np.ndarray:
        """A host array of `t`'s data (bf16 as its uint16 bits), owned by the caller; on a GPU
        valid once `ready_for_host` returned."""
        if t.dtype == torch.bfloat16:
            t = t.view(torch.uint16)
        t = t.detach()
        if not self._cuda:
            return t.contiguous().numpy().copy()
        staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self._stream()):
            staged.copy_(t, non_blocking=True)
        out = np.empty(tuple(t.shape), dtype=staged.numpy().dtype)
        self._outs.append((staged, out))
        return out

    def into(self, a: np.ndarray, dest: torch.Tensor) -> None:
        """Copy the host array `a` (bf16 as uint16 bits) into `dest`, a view of a cache tensor
        of the same shape; on a GPU done once `ready_for_compute` has been called."""
        src = torch.from_numpy(np.ascontiguousarray(a))
        if dest.dtype == torch.bfloat16:
            src = src.view(torch.bfloat16)
        if src.dtype != dest.dtype or tuple(src.shape) != tuple(dest.shape):
            raise ValueError(f"Stored rows {tuple(src.shape)} {src.dtype} do not fit a cache "
                             f"tensor {tuple(dest.shape)} {dest.dtype}.")
        if not self._cuda:
            dest.copy_(src)
            return
        staged = src.pin_memory()
        with torch.cuda.stream(self._stream()):
            dest.copy_(staged, non_blocking=True)
        dest.record_stream(self._side)
        self._keep.append(staged)

    def ready_for_compute(self) -> None:
        """The compute stream waits for every `into` (no host wait)."""
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._keep.clear()  # the caching host allocator keeps them until the copies end

    def ready_for_host(self) -> None:
        """Every `out` array holds its data (on a GPU copied from the staging once the device
        copies are done: the tiers keep pageable memory, and the pinned staging goes back to
        torch's pinned-memory cache for the next turn's end)."""
        if self._side is not None:
            self._side.synchronize()
        for staged, out in self._outs:
            np.copyto(out, staged.numpy())
        self._outs.clear()
        self._keep.clear()
