"""`dsv41 bench engram`: host-resident Engram's gathers against the blocks they run beside.

An artifact compiled by this version reads its Engram tables in host memory: before each entry
call the runtime posts the rows' gathers, which run on a background thread while the entry's
first blocks compute (`runtime.engram_host`). Per prompt length, from a fresh cache, one exact
prefill of the prompt and then decode steps, each with prefetch on and off (interleaved, the
order alternating per repeat), report per phase call:

- `entry_ms`: the entry call (median over repeats);
- `gather_ms`: the gathers' own time (on the prefetch thread; inside the entry with it off);
- `wait_ms`: the time the entry waited at its Engram layers for rows;
- `hidden_ms` = gather - wait, and `hidden_fraction` of the gather;
- `rows`, `bytes` fetched per call;

and `identical`: whether every logit of every repeat is bit-equal with prefetch on and off.

    dsv41 bench engram --artifact DIR [--checkpoint DIR | --preset bench] [--device cpu]
                       [--prompt-tokens 128,512] [--decode-steps 8] [--reps 2] [--threads N]
                       [--json F]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsv41.compiler.tools.assets import ensure_checkpoint
from dsv41.compiler.tools.bench.measure import write_json
from dsv41.graph.cache import new_cache
from dsv41.graph.model import Model
from dsv41.runtime.backends.artifact import Artifact, ArtifactError, check_checkpoint_config
from dsv41.runtime.backends.compiled import CompiledPhases

MODES = (True, False)  # prefetch on, off


@dataclass(frozen=True)
class EngramBenchOptions:
    artifact: Path | None  # None: refused (the bench measures an artifact)
    checkpoint: Path | None = None  # None: the preset's seeded checkpoint
    preset: str = "bench"
    device: str | None = None  # None: the artifact's target kind
    prompt_tokens: tuple[int, ...] = (128, 512)
    decode_steps: int = 8
    reps: int = 2
    threads: int | None = None
    json: Path | None = None


@dataclass(frozen=True)
class EngramRow:
    prompt_tokens: int
    phase: str  # prefill | decode
    prefetch: bool
    calls: int  # entry calls measured (over every repeat)
    entry_ms: float  # median per call
    gather_ms: float  # mean per call
    wait_ms: float
    hidden_ms: float
    hidden_fraction: float  # hidden / gather
    rows: int  # per call
    bytes: int


def _row(n: int, phase: str, prefetch: bool, samples: list) -> EngramRow:
    """samples: (entry seconds, EngramTiming) per call."""
    k = len(samples)
    gather = sum(t.gather_s for _, t in samples) / k
    wait = sum(t.wait_s for _, t in samples) / k
    hidden = max(0.0, gather - wait)
    return EngramRow(n, phase, prefetch, k, round(statistics.median(s for s, _ in samples) * 1e3,
                                                  3),
                     round(gather * 1e3, 4), round(wait * 1e3, 4), round(hidden * 1e3, 4),
                     round(hidden / gather, 4) if gather > 0 else 0.0,
                     samples[0][1].rows, samples[0][1].bytes)


def run_engram_bench(opts: EngramBenchOptions, say=print) -> dict:
    if opts.artifact is None:
        raise ValueError("dsv41 bench engram measures a compiled artifact: give --artifact DIR "
                         "(`dsv41 compile --entries prefill,decode`).")
    art = Artifact.load(opts.artifact, device=opts.device)
    if not art.args.engram_layer_ids:
        raise ArtifactError(f"{opts.artifact} is a model without Engram layers.")
    if "decode" not in art.entries:
        raise ArtifactError(f"{opts.artifact} has no `decode` entry; compile it with "
                            "`dsv41 compile --entries prefill,decode`.")
    if "prefill" not in art.entries and "prefill_all" not in art.entries:
        raise ArtifactError(f"{opts.artifact} has no prefill entry; compile it with "
                            "`dsv41 compile --entries prefill,decode`.")
    if not art.hosts_engram:
        raise ArtifactError(f"{opts.artifact} gathers its Engram rows on the device (compiled "
                            "before the tables were host-resident); recompile it.")
    ckpt = opts.checkpoint or ensure_checkpoint(opts.preset)
    check_checkpoint_config(art, ckpt)
    model = Model.from_checkpoint(ckpt, art.args, device=art.device.torch)
    ph = CompiledPhases(art, model, threads=opts.threads)
    pad = model.engram.pad_id if model.engram is not None else None
    rows: list[EngramRow] = []
    identical = True
    for n in opts.prompt_tokens:
        g = torch.Generator().manual_seed(n)
        tokens = torch.randint(3, art.args.vocab_size - 1, (1, n), generator=g)
        samples = {(m, p): [] for m in MODES for p in ("prefill", "decode")}
        logits = {m: [] for m in MODES}
        for rep in range(opts.reps + 1):  # the first is a warm-up of both modes
            for prefetch in MODES if rep % 2 == 0 else MODES[::-1]:
                art.set_engram_prefetch(prefetch)
                cache = new_cache(model.plan, 1, n + opts.decode_steps + 64, engram_pad=pad,
                                  device=art.device.torch)
                art.engram_timing(reset=True)
                t = time.perf_counter()
                res = ph.prefill_exact(model, cache, tokens)
                took = [("prefill", time.perf_counter() - t, art.engram_timing(reset=True))]
                outs = [res.logits.float().clone()]
                nxt = res.logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(opts.decode_steps):
                    t = time.perf_counter()
                    res = ph.decode_step(model, cache, nxt)
                    took.append(("decode", time.perf_counter() - t,
                                 art.engram_timing(reset=True)))
                    outs.append(res.logits.float().clone())
                    nxt = res.logits[:, -1].argmax(-1, keepdim=True)
                if rep == 0:
                    continue
                for phase, secs, timing in took:
                    samples[(prefetch, phase)].append((secs, timing))
                logits[prefetch].append(outs)
        same = all(torch.equal(a, b) for on, off in zip(logits[True], logits[False],
                                                        strict=True)
                   for a, b in zip(on, off, strict=True))
        identical &= same
        for (prefetch, phase), got in samples.items():
            rows.append(_row(n, phase, prefetch, got))
        say(f"{n} tokens: outputs with prefetch on and off {'identical' if same else 'DIFFER'}")
    art.set_engram_prefetch(True)
    doc = {"engram": {"artifact": str(opts.artifact), "target": art.target,
                      "device": str(art.device), "checkpoint": str(ckpt),
                      "engram_layers": list(art.args.engram_layer_ids),
                      "decode_steps": opts.decode_steps, "reps": opts.reps,
                      "identical": identical, "rows": [asdict(r) for r in rows]}}
    say(format_rows(rows))
    if opts.json is not None:
        write_json(opts.json, doc)
        say(f"wrote {opts.json}")
    return doc


def format_rows(rows: list[EngramRow]) -> str:
    head = (f"{'tokens':>7} {'phase':>7} {'prefetch':>8} {'entry ms':>10} {'gather ms':>10} "
            f"{'wait ms':>9} {'hidden ms':>10} {'hidden':>7} {'rows':>8} {'bytes':>10}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.prompt_tokens:>7} {r.phase:>7} {'on' if r.prefetch else 'off':>8} "
                     f"{r.entry_ms:>10.3f} {r.gather_ms:>10.4f} {r.wait_ms:>9.4f} "
                     f"{r.hidden_ms:>10.4f} {r.hidden_fraction:>7.1%} {r.rows:>8} "
                     f"{r.bytes:>10}")
    return "\n".join(lines)


def run_command(opts: EngramBenchOptions) -> int:
    doc = run_engram_bench(opts)
    return 0 if doc["engram"]["identical"] else 1
