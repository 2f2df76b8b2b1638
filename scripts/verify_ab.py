"""Two or more compiled artifacts of one model (each with `decode` and `verify`), their one-row
decode step and their verify of 1 + k rows timed call by call in one process, in alternation,
at one context: on a machine whose speed wanders from minute to minute, separate runs of each
compare the machine's phases as much as the code.

    python scripts/verify_ab.py --preset bench --context 65536 --rounds 20 [--k 4] \\
        ART_DIR_A ART_DIR_B [...] [--json out.json]

Each artifact directory is one `dsv41 compile --out` folder (its `<model>-<hash>/cpu` inside, or
that folder itself). One synthetic cache serves all (`bench.synthetic`); every call is cut back
to its first token as `dsv41 bench spec` does, so each round advances the cache by one token per
call. One untimed round first; medians and the fastest of each are printed, each against its
own artifact's decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dsv41.compiler.tools.assets import ensure_checkpoint
from dsv41.compiler.tools.bench.measure import interleaved_times
from dsv41.compiler.tools.bench.spec import artifact_backend, verify_once
from dsv41.compiler.tools.bench.synthetic import synthetic_cache
from dsv41.graph.config import args_from_dict
from dsv41.graph.model import Model


def artifact_dir(path: Path) -> Path:
    """The folder with the manifest: `path` itself or its single `*/cpu` child."""
    if (path / "manifest.json").exists():
        return path
    found = sorted(path.glob("*/cpu/manifest.json"))
    if len(found) != 1:
        raise SystemExit(f"{path}: no artifact (or several) under it; give the folder that "
                         f"holds manifest.json.")
    return found[0].parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--k", type=int, default=4, help="drafts per verify (1 + k rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.k < 1:
        raise SystemExit("--rounds and --k must be >= 1.")
    torch.set_num_threads(a.threads)
    ckpt = ensure_checkpoint(a.preset, 0)
    model = Model.from_checkpoint(ckpt)
    if a.k > model.args.dspark_block_size:
        raise SystemExit(f"--k must be at most the DSpark block, {model.args.dspark_block_size}.")
    # an artifact of another storage config of the same weights (an older build's `wo_a` in
    # BF16) gets the checkpoint loaded under its own config: the same values, its own layout
    models = {model.args.config_hash(): model}
    backends, owners = {}, {}
    for p in a.artifacts:
        d = artifact_dir(p)
        args = args_from_dict(json.loads((d / "manifest.json").read_text())["config"])
        if args.config_hash() not in models:
            models[args.config_hash()] = Model.from_checkpoint(ckpt, args)
        owners[str(p)] = models[args.config_hash()]
        backends[str(p)] = artifact_backend(owners[str(p)], d)
    cache = synthetic_cache(model, a.context, seed=0,
                            margin=64 + 2 * len(backends) * (a.rounds + 1))
    toks = torch.randint(3, model.args.vocab_size, (1, 1 + a.k),
                         generator=torch.Generator().manual_seed(0))

    # a decode step: the one token by decode steps; a verify: 1 + k tokens by the entry
    forms = {"decode": (toks[:, :1], False), "verify": (toks, True)}
    times = interleaved_times(
        {(name, form): (lambda be=be, t=t, one=one, m=owners[name]: verify_once(
            be, m, cache, t, one_pass=one))
         for name, be in backends.items() for form, (t, one) in forms.items()}, a.rounds)
    report = {}
    for name in backends:
        d, v = times[name, "decode"], times[name, "verify"]
        row = {"decode_median_s": statistics.median(d), "verify_median_s": statistics.median(v),
               "decode_best_s": min(d), "verify_best_s": min(v), "decode_s": d, "verify_s": v}
        row["steps_median"] = row["verify_median_s"] / row["decode_median_s"]
        row["steps_best"] = row["verify_best_s"] / row["decode_best_s"]
        report[name] = row
        print(f"{name}: decode step {row['decode_median_s'] * 1e3:.1f} ms, verify of 1 + {a.k} "
              f"{row['verify_median_s'] * 1e3:.1f} ms = {row['steps_median']:.2f} steps "
              f"(medians of {a.rounds}); fastest {row['decode_best_s'] * 1e3:.1f} / "
              f"{row['verify_best_s'] * 1e3:.1f} ms = {row['steps_best']:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"context": a.context, "k": a.k, "rounds": a.rounds,
                                      "artifacts": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
