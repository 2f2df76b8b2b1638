"""What the verb modules share: the model arguments (`--preset` / `--config`), printing a verb's
arguments, the artifact's name and target, comma-separated lists."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv41.graph.config import resolve_args
from dsv41.graph.targets import target_names

HIDDEN = ("func", "options", "error_prog")  # parser plumbing, never printed as an argument


def args_from(ns):
    return resolve_args(getattr(ns, "preset", None), getattr(ns, "config", None))


def print_args(verb: str, ns: argparse.Namespace, hide: tuple[str, ...] = ()) -> None:
    shown = {k: v for k, v in vars(ns).items() if k not in (*HIDDEN, *hide)}
    print(f"dsv41 {verb} " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in shown.items()))


def model_opts(sp: argparse.ArgumentParser, default="small") -> None:
    sp.add_argument("--preset", default=default, help="small | bench | full | long")
    sp.add_argument("--config", default=None, help="a config.json (inference or HF form)")


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


def split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def path_or_none(value: str | None) -> Path | None:
    return Path(value) if value else None
