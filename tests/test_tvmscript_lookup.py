"""`schedules.common.tvmscript`: TVMScript's macro parser lookup over `frame.f_back` builds the
same kernels as TVM's own `inspect.getouterframes` walk, and fails the same way outside a parse."""

from __future__ import annotations

import pytest
import tvm
from tvm.script import tirx as T
from tvm.script.parser.core.parser import ScriptMacro

from dsv41.schedules.common.tvmscript import TVM_FIND_PARSER_DEF, find_parser_by_frames
from dsv41.schedules.gemm.bf16_gemv import make_fp8_gemv_bf16


def test_installed_on_import():
    assert ScriptMacro._find_parser_def is find_parser_by_frames


def _kernels():
    """A kernel whose body nests macros (the verify GEMV: macros calling macros)."""
    return [make_fp8_gemv_bf16(n=64, k=128, rows=2)]


def test_same_kernels_as_tvms_own_lookup(monkeypatch):
    fast = _kernels()
    monkeypatch.setattr(ScriptMacro, "_find_parser_def", TVM_FIND_PARSER_DEF)
    slow = _kernels()
    assert ScriptMacro._find_parser_def is TVM_FIND_PARSER_DEF
    for a, b in zip(fast, slow, strict=True):
        tvm.ir.assert_structural_equal(a, b, map_free_vars=True)


@T.macro
def _store_one(buf):
    buf[0] = T.float32(1)


def test_a_macro_outside_a_parse_fails_as_in_tvm(monkeypatch):
    for lookup in (find_parser_by_frames, TVM_FIND_PARSER_DEF):
        monkeypatch.setattr(ScriptMacro, "_find_parser_def", lookup)
        with pytest.raises(RuntimeError, match="__current_script_parser__ not available"):
            _store_one(None)
