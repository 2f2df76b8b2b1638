"""`dsv41 bench soak`: many turns over rotating sessions with every tier evicting, and the
process's RSS sampled along the way (a leak shows as growth between the baseline turn and the
last).

Session `turn % sessions` takes each turn: a few random new tokens, then a few decoded. The DRAM
pool's budget holds about `pool_snapshots` snapshots (the layout's encoder snapshot plus one page
of entries not yet in a block; its TTL runs on a clock that advances `turn_seconds` per turn, so
a session that comes back after `sessions` turns finds its snapshot, or finds it expired or
evicted), and the SSD store's capacity about `store_blocks` block files (one page of global
entries plus ~1 KiB of header and index) with no minimum lifetime, so blocks are evicted least
recently used first. A session whose next turn would pass max_seq_len is closed and a new one
takes its place. The report says whether both tiers evicted.

    dsv41 bench soak [--checkpoint DIR | --preset small] [--artifact DIR] [--turns 500]
                     [--sessions 4] [--baseline-turn 50] [--sample-every 50] [--threads N]
                     [--json out.json]

torch, the engine and the graph modules that import torch are imported where the soak runs:
`dsv41 --help` reads `SoakOptions`' defaults without them.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import psutil

from dsv41.compiler.tools.bench.measure import write_json
from dsv41.graph.plan import build_plan


@dataclass(frozen=True)
class SoakOptions:
    checkpoint: Path | None = None  # default: the preset's seeded checkpoint
    preset: str = "small"
    artifact: Path | None = None  # None: the PyTorch graph
    turns: int = 500
    sessions: int = 4
    baseline_turn: int = 50
    sample_every: int = 50
    seed: int = 0
    page_tokens: int = 8
    pool_snapshots: int = 4  # the pool's budget, in snapshots
    pool_ttl_s: float = 100.0
    turn_seconds: float = 20.0  # the pool's clock per turn
    store_blocks: int = 60  # the store's capacity, in block files
    threads: int | None = None  # torch's intra-op threads (None: as torch chose)
    json: Path | None = None

    def validate(self) -> None:
        for name in ("turns", "sessions", "baseline_turn", "sample_every", "page_tokens",
                     "pool_snapshots", "store_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {v!r}.")
        if self.threads is not None and (not isinstance(self.threads, int)
                                         or isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"--threads must be a positive integer, got {self.threads!r}.")
        if self.baseline_turn > self.turns:
            raise ValueError(f"--baseline-turn {self.baseline_turn} is past the last turn "
                             f"({self.turns}).")
        for name in ("pool_ttl_s", "turn_seconds"):
            v = getattr(self, name)
            if not np.isfinite(v) or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {v!r}.")


@dataclass(frozen=True)
class SoakSample:
    turn: int
    rss_bytes: int  # after gc.collect()
    elapsed_s: float
    tiers: dict[str, int]  # turns served per tier so far
    pool_entries: int
    pool_evictions: int
    pool_expired: int
    store_entries: int
    store_evictions: int
    sessions_started: int


@dataclass
class SoakReport:
    options: SoakOptions
    samples: list[SoakSample] = field(default_factory=list)

    def rss_at(self, turn: int) -> int:
        return next(s.rss_bytes for s in self.samples if s.turn == turn)

    @property
    def ratio(self) -> float:
        """RSS at the last turn over RSS at the baseline turn."""
        return self.rss_at(self.samples[-1].turn) / self.rss_at(self.options.baseline_turn)

    @property
    def tiers_evicting(self) -> bool:
        last = self.samples[-1]
        return last.pool_evictions + last.pool_expired > 0 and last.store_evictions > 0


BLOCK_FILE_OVERHEAD = 1024  # a block file's header and array index, about (runtime/kv_store.py)


def tier_bytes(opts: SoakOptions, checkpoint: Path) -> tuple[int, int]:
    """(pool budget, store capacity) in bytes for the soak's counts of snapshots and blocks."""
    # heavy: torch (see the module docstring)
    from dsv41.graph.checkpoint import checkpoint_config
    from dsv41.graph.layout import KVLayout, encoder_snapshot_bytes

    plan = build_plan(checkpoint_config(checkpoint))
    page = KVLayout.from_plan(plan).global_bytes(opts.page_tokens)
    return (opts.pool_snapshots * (encoder_snapshot_bytes(plan) + page),
            opts.store_blocks * (page + BLOCK_FILE_OVERHEAD))


class _TurnClock:
    """The pool's clock: seconds the soak has advanced it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_soak(opts: SoakOptions, store_dir: Path, say=print) -> SoakReport:
    import torch  # heavy: torch (see the module docstring)

    from dsv41.runtime.engine import Engine  # heavy: torch (see the module docstring)

    if opts.checkpoint is None:
        raise ValueError("The soak needs a checkpoint folder (`main` resolves --preset to one).")
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    ckpt = opts.checkpoint
    pool_bytes, store_bytes = tier_bytes(opts, ckpt)
    clock = _TurnClock()
    engine_opts = dict(page_tokens=opts.page_tokens, store_dir=store_dir,
                       pool_budget_bytes=pool_bytes, pool_ttl_s=opts.pool_ttl_s,
                       pool_clock=clock, store_capacity_bytes=store_bytes,
                       store_min_lifetime_s=0.0)
    if opts.artifact is not None:
        engine = Engine.load(opts.artifact, ckpt, **engine_opts)
    else:
        # heavy: torch (see the module docstring)
        from dsv41.graph.checkpoint import weights_fingerprint
        from dsv41.graph.model import Model

        engine = Engine.from_model(Model.from_checkpoint(ckpt),
                                   weights_hash=weights_fingerprint(ckpt), **engine_opts)
    report = SoakReport(options=opts)
    say(f"soak: {engine.backend}, checkpoint {ckpt}, {opts.turns} turns over {opts.sessions} "
        f"sessions, {torch.get_num_threads()} torch threads; pool budget {pool_bytes:,} B, "
        f"store capacity {store_bytes:,} B")
    a = engine.model.args
    rng = np.random.default_rng(opts.seed)
    proc = psutil.Process()
    samples = {opts.baseline_turn, opts.turns} | set(range(opts.sample_every, opts.turns + 1,
                                                           opts.sample_every))
    with engine:
        sessions = [engine.session() for _ in range(opts.sessions)]
        started, t0 = opts.sessions, time.perf_counter()
        for turn in range(1, opts.turns + 1):
            i = turn % opts.sessions
            n_new, n_out = int(rng.integers(3, 12)), int(rng.integers(1, 5))
            if len(sessions[i].transcript) + n_new + n_out + 1 > a.max_seq_len:
                sessions[i].close()
                sessions[i] = engine.session()
                started += 1
            ids = [int(x) for x in rng.integers(3, a.vocab_size, n_new)]
            if not list(sessions[i].send(ids, max_new_tokens=n_out)):
                raise RuntimeError(f"Soak turn {turn} produced no token.")
            clock.now += opts.turn_seconds
            if turn in samples:
                gc.collect()
                st = engine.stats()
                report.samples.append(SoakSample(
                    turn=turn, rss_bytes=proc.memory_info().rss,
                    elapsed_s=round(time.perf_counter() - t0, 1), tiers=dict(st.tiers),
                    pool_entries=st.pool.entries, pool_evictions=st.pool.evictions,
                    pool_expired=st.pool.expired, store_entries=st.store.entries,
                    store_evictions=st.store.evictions, sessions_started=started))
                say(format_sample(report.samples[-1]))
    return report


def format_sample(s: SoakSample) -> str:
    tiers = " ".join(f"{k} {v}" for k, v in s.tiers.items() if v)
    return (f"turn {s.turn:5d}  rss {s.rss_bytes / 2**20:8.1f} MiB  {s.elapsed_s:7.1f} s  "
            f"tiers: {tiers}  pool {s.pool_entries} (evicted {s.pool_evictions}, expired "
            f"{s.pool_expired})  store {s.store_entries} (evicted {s.store_evictions})  "
            f"sessions {s.sessions_started}")


def report_json(report: SoakReport) -> dict:
    base, last = report.options.baseline_turn, report.samples[-1].turn
    options = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(report.options).items()}
    return {"options": options, "samples": [asdict(s) for s in report.samples],
            "rss_baseline_bytes": report.rss_at(base), "rss_last_bytes": report.rss_at(last),
            "rss_ratio": report.ratio, "tiers_evicting": report.tiers_evicting}


def run_command(opts: SoakOptions, *,
                default_checkpoint: Callable[[str, int], Path] | None = None) -> int:
    """`dsv41 bench soak`. `default_checkpoint(preset, seed)`: the checkpoint folder when
    `opts.checkpoint` is None (default: the preset's seeded checkpoint, written once)."""
    opts.validate()
    if default_checkpoint is None:
        # assets imports torch: `dsv41 --help` reads SoakOptions' defaults without it
        from dsv41.compiler.tools.assets import ensure_checkpoint as default_checkpoint
    if opts.checkpoint is None:
        opts = replace(opts, checkpoint=default_checkpoint(opts.preset, opts.seed))
    with tempfile.TemporaryDirectory(prefix="dsv41-soak-") as tmp:
        report = run_soak(opts, Path(tmp) / "store")
    base, last = opts.baseline_turn, report.samples[-1].turn
    print(f"RSS turn {base} {report.rss_at(base) / 2**20:.1f} MiB, turn {last} "
          f"{report.rss_at(last) / 2**20:.1f} MiB, ratio {report.ratio:.4f} "
          f"({(report.ratio - 1) * 100:+.2f}%); tiers evicting: {report.tiers_evicting}")
    if opts.json:
        write_json(opts.json, report_json(report))
        print(f"json: {opts.json}")
    return 0
