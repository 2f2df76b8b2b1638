"""The torch.compile peer of the compiled artifact: the artifact's own entry graphs, captured as
`dsv41 compile` captures them and compiled by Inductor instead of TVM, behind the artifact's
calling convention (`bind`, `call`, `specs`), so `runtime.backends.compiled.CompiledPhases`
runs both with the same host half (`dsv41 bench`'s compile column; tests/test_contracts.py holds
it to the convention)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dsv41.compiler.capture import capture
from dsv41.graph.artifact_format import EntrySpec
from dsv41.graph.cache import new_cache
from dsv41.graph.entries import cache_names, entry_outputs


class TorchCompiledEntries:
    """The artifact's calling convention (`bind`, `call`, `specs`) over `torch.compile` of the
    artifact's own entry graphs: each entry is captured exactly as `dsv41 compile` captures it
    (`capture.capture`, symbolic batch, tokens and context), and the exported program is
    compiled by Inductor with dynamic shapes instead of by TVM, so one compilation serves every
    context, and `runtime.compiled.CompiledPhases` runs it with the same host half. (Compiling
    the eager phase code instead graph-breaks at every data-dependent slice and recompiles per
    layer.) Capture and compile happen at an entry's first call; their seconds are kept."""

    def __init__(self, model, entries: tuple[str, ...]):
        self.model = model
        template = new_cache(model.plan, 1, 64)  # structure only
        names = tuple(cache_names(template))
        self.specs = {e: EntrySpec(outputs=tuple(entry_outputs(model.plan, e, template)),
                                   cache=names) for e in entries}  # inputs: none declared
        self._fns: dict[str, Callable] = {}
        self.seconds: dict[str, dict[str, float]] = {}  # entry -> capture / first call

    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self.specs)

    def bind(self, model) -> None:
        assert model is self.model, "TorchCompiledEntries is built for one model"

    def call(self, entry: str, inputs) -> list[torch.Tensor]:
        first = entry not in self._fns
        if first:
            t0 = time.perf_counter()
            ep, _ = capture(self.model, entry)
            self.seconds[entry] = {"capture": time.perf_counter() - t0}
            self._fns[entry] = torch.compile(ep.module(), dynamic=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = list(self._fns[entry](*inputs))
        if first:
            self.seconds[entry]["first_call"] = time.perf_counter() - t0
        return out
