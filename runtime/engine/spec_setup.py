"""What an engine's `speculative` mode (`SpecMode`) comes to: the length policy its decode steps
run with (None: plain steps), decided once at construction (`Engine.load`: before any weight is
read), never at the first decode step.

- off: plain decode steps.
- auto: plain without DSpark layers, and on an artifact without the `draft` and `verify` entries
  (logged, with the command that compiles them); else `SpecPolicy`, which drops to k = 0 while
  speculation does not pay.
- on: ValueError without DSpark layers, ArtifactError (naming the entries and the command) on
  an artifact without them; else `SpecPolicy(floor=1)`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dsv41.graph.config import PRESETS
from dsv41.graph.entry_names import Entry
from dsv41.runtime.backends.artifact import Artifact, ArtifactError
from dsv41.runtime.backends.sharded import ShardedManifest
from dsv41.runtime.engine.options import EngineOptions, SpecMode, has_dspark
from dsv41.runtime.engine.speculative import ENGINE_MIN_GAIN, SpecPolicy

log = logging.getLogger(__name__)

SPEC_ENTRIES = (Entry.DRAFT, Entry.VERIFY)  # what a speculating artifact engine calls


def compiled_entries(entries: tuple[str, ...], speculative: SpecMode,
                     args) -> tuple[str, ...]:
    """The entries an on-demand compile makes for an engine of `entries` (CED or exact):
    with DSpark's `draft` and `verify` unless speculation is off or the model (ModelArgs)
    has no DSpark layers."""
    if speculative == SpecMode.OFF or not has_dspark(args):
        return tuple(entries)
    return tuple(entries) + SPEC_ENTRIES


def compile_command(artifact_dir: Path, checkpoint_dir: Path, entries) -> str:
    """The `dsv41 compile` command that adds `entries` to this artifact folder
    (`<out>/<name>-<config hash>/<target>`, as `dsv41 compile` names it)."""
    folder = Path(artifact_dir)
    name = folder.parent.name.rsplit("-", 1)[0]
    model = f"--preset {name}" if name in PRESETS else \
        f"--config {Path(checkpoint_dir) / 'config.json'}"
    return (f"dsv41 compile {model} --target {folder.name} --out {folder.parent.parent} "
            f"--entries {','.join(entries)}")


def check_spec_entries(art: Artifact | ShardedManifest, checkpoint_dir: Path,
                       options: EngineOptions) -> bool:
    """Whether an artifact engine of these options speculates: False for `off`, for a model
    without DSpark layers under `auto`, and for an artifact without the `draft` and `verify`
    entries under `auto` (logged); under `on` that artifact is refused (ArtifactError naming
    the missing entries and the command that compiles them)."""
    mode = options.speculative
    if mode == SpecMode.OFF or (mode == SpecMode.AUTO and not has_dspark(art.args)):
        return False
    missing = [e for e in SPEC_ENTRIES if e not in art.entries]
    if not missing:
        return True
    cmd = compile_command(art.path, checkpoint_dir, missing)
    if mode == SpecMode.ON:
        raise ArtifactError(f"speculative=on needs the artifact's {' and '.join(missing)} "
                            f"entries, which {art.path} lacks; compile them with `{cmd}` (or "
                            f"run with speculative=auto or off).")
    log.warning("speculative=auto: %s lacks the %s entries, so this engine decodes without "
                "speculation; `%s` compiles them.", art.path, " and ".join(missing), cmd)
    return False


def spec_policy(model, options: EngineOptions, *, entries_ok: bool = True) -> SpecPolicy | None:
    """The policy of an engine of these options on `model` (None: plain decode steps);
    `entries_ok`: what `check_spec_entries` said (an artifact engine), True for the graph."""
    mode = options.speculative
    if mode == SpecMode.OFF or not entries_ok:
        return None
    if not model.plan.dspark:
        if mode == SpecMode.AUTO:
            return None
        raise ValueError("speculative=on needs a model with DSpark layers; this one has none.")
    a = model.args
    top = min(a.dspark_block_size, a.window_size - 1)
    low = 1 if mode == SpecMode.ON else 0
    if options.max_draft is None:
        return SpecPolicy(top, floor=low, min_gain=ENGINE_MIN_GAIN)
    if isinstance(options.max_draft, bool) or not isinstance(options.max_draft, int) \
            or not low <= options.max_draft <= top:
        raise ValueError(f"max_draft must be a whole number from {low} to {top} (the DSpark "
                         f"block){' with speculative=on' if low else ''}, got "
                         f"{options.max_draft!r}.")
    return SpecPolicy(options.max_draft, floor=low, min_gain=ENGINE_MIN_GAIN)
