"""TVMScript's macro expansion without its stack-walk cost.

Every `@T.macro` call inside a `@T.prim_func` body finds the parser that is expanding it by
walking the Python stack for a frame whose globals hold the parser object (the parser puts it
into the globals of every expression it evaluates). TVM 0.27 walks it with
`inspect.getouterframes`, which also reads a line of source for every frame: `inspect.getmodule`
per frame, a scan of `sys.modules` for the frames of evaluated expressions that map to no file
(CPython issue 92041). With the stack depth of a nested macro expansion that was 19 of the 22 s
it took to build the 6-row FP8 verify GEMV (`make_fp8_gemv_bf16(n=100, k=256, rows=6)`).

`fast_macro_parser_lookup` replaces that one method with the same search over `frame.f_back`:
the same frames, in the same order, the same first match, the same error when there is none; no
source is read. The kernels it builds are the same IR (`tests/test_tvmscript_lookup.py` checks a
kernel's structural equality with and without it). It is installed when `dsv41.schedules.common`
is imported, which every kernel factory does; installing it twice changes nothing.
"""

from __future__ import annotations

import sys

from tvm.script.parser.core.parser import ScriptMacro

# TVM's own lookup, taken before `fast_macro_parser_lookup` replaces it (the tests compare them)
TVM_FIND_PARSER_DEF = ScriptMacro.__dict__["_find_parser_def"]


def find_parser_by_frames(self: ScriptMacro):  # noqa: ANN201 (TVM's Parser, untyped there)
    """ScriptMacro._find_parser_def over `f_back` (the caller's frame outwards)."""
    del self
    frame = sys._getframe(1)
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def fast_macro_parser_lookup() -> None:
    """Install `find_parser_by_frames` as TVM's macro parser lookup (idempotent)."""
    ScriptMacro._find_parser_def = find_parser_by_frames
