"""What a person sees while `dsv41 compile` (or `dsv41 run`'s first compile) works: one bar over
every phase of every entry, named by the phase now running, and one line per finished phase.

    progress = CompileBar(("encoder", "decode"), PHASES, desc="compile")
    compile_artifact(opts, progress=progress)   # calls started / finished / note
    progress.close()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from tqdm import tqdm


@runtime_checkable
class CompileProgress(Protocol):
    """compile_artifact's progress events (build.PHASES names the phases)."""

    def started(self, entry: str, phase: str) -> None: ...

    def finished(self, entry: str, phase: str, seconds: float, *, phases: int = 1) -> None:
        """`phases`: how many of PHASES this covers (a CUDA child runs four in one)."""

    def note(self, text: str) -> None: ...


class SilentProgress:
    def started(self, entry: str, phase: str) -> None:
        pass

    def finished(self, entry: str, phase: str, seconds: float, *, phases: int = 1) -> None:
        pass

    def note(self, text: str) -> None:
        pass


class LineProgress:
    """A line per finished phase and per note through `say` (a log, where a bar would not do)."""

    def __init__(self, say: Callable[[str], object] = print, prefix: str = "  "):
        self.say, self.prefix = say, prefix

    def started(self, entry: str, phase: str) -> None:
        pass

    def finished(self, entry: str, phase: str, seconds: float, *, phases: int = 1) -> None:
        self.say(f"{self.prefix}{entry}: {phase} {seconds:.1f} s")

    def note(self, text: str) -> None:
        self.say(self.prefix + text)


class CompileBar:
    """A tqdm bar of entries x phases; the running phase and its start time in the bar's text."""

    def __init__(self, entries: tuple[str, ...], phases: tuple[str, ...], *,
                 desc: str = "compile"):

        self.bar = tqdm(total=len(entries) * len(phases), desc=desc, unit="phase")

    def started(self, entry: str, phase: str) -> None:
        self.bar.set_postfix_str(f"{entry}: {phase} since {time.strftime('%H:%M:%S')}")

    def finished(self, entry: str, phase: str, seconds: float, *, phases: int = 1) -> None:
        self.bar.write(f"  {entry}: {phase} {seconds:.1f} s")
        self.bar.update(phases)

    def note(self, text: str) -> None:
        self.bar.write("  " + text)

    def close(self) -> None:
        self.bar.set_postfix_str("")
        self.bar.close()
