"""What a verb needs before it runs, made once and reused: the seeded checkpoint of a preset
(under artifacts/checkpoints/) and an artifact holding the entries a command runs (compiled into
artifacts/ when missing). Used by `dsv41 run`, `bench`, `tune` and `serve`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dsv41.compiler.build import PHASES, CompileOptions, compile_artifact, missing_entries
from dsv41.compiler.progress import CompileBar
from dsv41.graph.checkpoint import DEFAULT_CHECKPOINTS, write_seeded_checkpoint
from dsv41.graph.config import load_config, preset


def ensure_checkpoint(preset_name: str, seed: int = 0) -> Path:
    """The seeded checkpoint for a preset, written once under artifacts/checkpoints/, and
    written again when the preset's config has changed since (its `config.json` differs)."""
    out = DEFAULT_CHECKPOINTS / f"{preset_name}-seed{seed}"
    args = preset(preset_name)
    if (out / "config.json").exists():
        if load_config(out).config_hash() == args.config_hash():
            return out
        print(f"the {preset_name} preset's config has changed: rewriting {out} ...")
        shutil.rmtree(out)
    else:
        print(f"writing a seeded {preset_name} checkpoint to {out} ...")
    write_seeded_checkpoint(args, out, seed=seed, progress=True)
    return out


def ensure_artifact(checkpoint: Path, name: str, target: str, entries: tuple[str, ...],
                    out: Path) -> Path:
    """The artifact for the checkpoint's config, compiling the entries it lacks."""
    args = load_config(checkpoint)
    opts = CompileOptions(args=args, model_name=name, target=target, out=out, entries=entries)
    todo = missing_entries(opts.artifact_dir, args, target, entries)
    if not todo:
        print(f"artifact: {opts.artifact_dir} (entries {', '.join(entries)} present)")
        return opts.artifact_dir
    print(f"artifact: compiling {', '.join(todo)} for {target} into {opts.artifact_dir} "
          "(once; later runs reuse it)")
    bar = CompileBar(todo, PHASES, desc="compile")
    try:
        report = compile_artifact(CompileOptions(args=args, model_name=name, target=target,
                                                 out=out, entries=todo), progress=bar)
    finally:
        bar.close()
    print(f"compiled in {report.total_seconds:.0f} s")
    return report.artifact_dir


class CompilingSource:
    """The `runtime.serving.assembly.ArtifactSource` of `dsv41 serve`, `chat` and `bench serve`:
    a preset's seeded checkpoint written once, an artifact's missing entries compiled."""

    def checkpoint(self, preset: str, seed: int) -> Path:
        """The seeded checkpoint folder of `preset` (written when missing)."""
        return ensure_checkpoint(preset, seed)

    def artifact(self, checkpoint: Path, name: str, target: str, entries: tuple[str, ...],
                 out: Path) -> Path:
        """The artifact folder of `checkpoint`'s config under `out`, with `entries`."""
        return ensure_artifact(checkpoint, name, target, entries, out)


COMPILING = CompilingSource()  # stateless: one for every verb
