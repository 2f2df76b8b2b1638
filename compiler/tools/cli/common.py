"""What the verb modules share: the model arguments (`--preset` / `--config`), printing a verb's
arguments, the artifact's name and target, comma-separated lists, and the argparse types of
every numeric option (`count`, `natural`, `seconds`, `positive_seconds`, `probability`), so a
NaN, a negative count or a zero where zero means nothing is refused while parsing, before any
work."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dsv41.graph.config import resolve_args
from dsv41.graph.targets import target_names

HIDDEN = ("func", "options", "error_prog")  # parser plumbing, never printed as an argument


def args_from(ns):
    """--preset / --config, with --wo-a (the storage of the grouped o-projection's weight, the
    artifact's choice: `ModelArgs.wo_a_dtype`) where given."""
    args = resolve_args(getattr(ns, "preset", None), getattr(ns, "config", None))
    wo_a = getattr(ns, "wo_a", None)
    return args if wo_a is None else args.replace(wo_a_dtype=wo_a)


def print_args(verb: str, ns: argparse.Namespace, hide: tuple[str, ...] = ()) -> None:
    shown = {k: v for k, v in vars(ns).items() if k not in (*HIDDEN, *hide)}
    print(f"dsv41 {verb} " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in shown.items()))


def model_opts(sp: argparse.ArgumentParser, default="small") -> None:
    sp.add_argument("--preset", default=default, help="small | bench | full | long")
    sp.add_argument("--config", default=None, help="a config.json (inference or HF form)")
    sp.add_argument("--wo-a", default=None, choices=("fp8", "bf16"),
                    help="wo_a as the hub ships it (fp8: half its bytes, the same values) or "
                         "as convert.py writes it (bf16); default: the config's wo_a_dtype "
                         "(presets bench and full: fp8)")


def check_target(target: str) -> None:
    if target not in target_names():
        raise ValueError(f"Unknown target {target!r}; targets: {', '.join(target_names())}.")


def model_name(ns) -> str:
    """The preset, or a --config's folder name (a checkpoint's config.json is named after its
    folder): how `compile` and `tune` name the artifact."""
    if not ns.config:
        return ns.preset
    cfg = Path(ns.config)
    name = cfg.parent.name if cfg.name == "config.json" else cfg.stem
    return cfg.parent.parent.name if name == "checkpoint" else name


def out_folder(value: str, flag: str = "--out") -> Path:
    """A folder a verb writes into: new (made later) or an existing folder; ValueError when it,
    or the nearest part of it that exists, is a file or anything else but a folder."""
    path = Path(value)
    for part in (path, *path.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                what = "it is" if part == path else f"{part} is"
                raise ValueError(f"{flag} {value} cannot be a folder: {what} an existing file "
                                 "(or a broken link), not a folder.")
            break
    return path


def split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def path_or_none(value: str | None) -> Path | None:
    return Path(value) if value else None


# ---- numeric option types: argparse's `type=`; a bad value is argparse's usage error (exit 2) ----


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def count(text: str) -> int:
    """A count, a size or a length: a whole number of at least 1."""
    v = _integer(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return v


def natural(text: str) -> int:
    """A seed, or a count where 0 means none (or a default): a whole number of at least 0."""
    v = _integer(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 0, got {text!r}")
    return v


def positive_seconds(text: str) -> float:
    """A duration or budget: a finite number of seconds above 0."""
    v = _finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return v


def seconds(text: str) -> float:
    """A duration where 0 means none (or a temperature where 0 means greedy): finite, >= 0."""
    v = _finite(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text!r}")
    return v


def probability(text: str) -> float:
    """A probability mass such as top-p: finite, above 0 and at most 1."""
    v = _finite(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 1, got {text!r}")
    return v


def counts(text: str) -> tuple[int, ...]:
    """Comma-separated counts (`--clients 1,4,16`): at least one, each a whole number >= 1."""
    parts = [c.strip() for c in text.split(",") if c.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"must be comma-separated counts, got {text!r}")
    try:
        return tuple(count(c) for c in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated counts of at least 1, got "
                                         f"{text!r}") from None


def gibibytes(text: str) -> int:
    """A size in GiB (a fraction allowed), above 0 -> bytes."""
    v = _finite(text)
    if not 0 < v * (1 << 30) < 1 << 62:
        raise argparse.ArgumentTypeError(f"must be a size in GiB above 0, got {text!r}")
    return max(1, int(v * (1 << 30)))


NUMERIC_TYPES = (count, natural, positive_seconds, seconds, probability, counts, gibibytes)
