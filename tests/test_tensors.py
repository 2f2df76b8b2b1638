"""The one torch <-> TVM converter (runtime/tensors.py): a view on the tensor's own device, a
copy only when the data must move or is not contiguous and aligned; exact bits both ways."""

from __future__ import annotations

import numpy as np
import torch
import tvm

from dsv41.runtime.backends.tensors import host_array, host_torch, to_torch, to_tvm


def test_a_contiguous_aligned_host_tensor_is_shared_not_copied():
    t = torch.arange(64, dtype=torch.float32)
    a = to_tvm(t)
    assert tuple(a.shape) == (64,) and str(a.dtype) == "float32"
    t[3] = -1.0  # the TVM tensor sees the change: one buffer
    assert a.numpy()[3] == -1.0
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and host_torch(a).data_ptr() == t.data_ptr()


def test_non_contiguous_or_misaligned_data_is_copied_with_the_same_values():
    base = torch.arange(130, dtype=torch.int32)
    odd = base[1:129]  # 4 bytes past an aligned start
    assert odd.data_ptr() % 64
    a = to_tvm(odd)
    np.testing.assert_array_equal(a.numpy(), odd.numpy())
    assert to_torch(a).data_ptr() % 64 == 0
    strided = torch.arange(24, dtype=torch.int64).reshape(4, 6).t()
    np.testing.assert_array_equal(to_tvm(strided).numpy(), strided.numpy())


def test_bf16_and_bytes_keep_their_exact_bits():
    bits = torch.tensor([0, 1, 0x3F80, 0x7F80, -128, 0x7FC1, -32768], dtype=torch.int16)
    x = bits.view(torch.bfloat16)
    assert torch.equal(to_torch(to_tvm(x)).view(torch.int16), bits)
    assert host_array(x).view(np.int16).tolist() == bits.tolist()
    on_host_device = to_tvm(x, tvm.cpu())
    assert torch.equal(host_torch(on_host_device).view(torch.int16), bits)
    codes = torch.tensor([0, 7, 128, 255], dtype=torch.uint8)
    assert to_tvm(codes).numpy().tolist() == [0, 7, 128, 255]


def test_an_empty_tensor_is_a_compact_empty_tvm_tensor():
    """(torch's strides of a size-0 dim are not compact to TVM's argument checks.)"""
    e = torch.zeros(2, 0, 16, dtype=torch.int32)[:, :, :8]
    a = to_tvm(e)
    assert tuple(a.shape) == (2, 0, 8) and str(a.dtype) == "int32"
    assert to_torch(a).shape == (2, 0, 8)
