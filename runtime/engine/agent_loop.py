"""The agent-loop workload behind `dsv41 run`: a long system-plus-repository context, then turns
of short tool output and a few hundred decoded tokens, on the embedded engine over a compiled
artifact, with the SSD and DRAM tiers.

Per turn it prints the tokens prefilled, replayed and decoded, the tier that served the turn,
the bytes in each tier and the time per phase. `--restart-between-turns` throws the engine away
after every turn (a new process would see the same: only the SSD store survives), so turns are
served by the SSD tier: bounded replay, or in exact mode the SSD state record.

The store: without `store_dir` the run uses a fresh store in a temporary folder of its own,
removed at the end. With `store_dir`, the folder must be new or empty, or with `keep_store` a
store (marked folder) to continue from; anything else is refused before any work, and the run
never deletes a folder."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dsv41.graph.bill import make_bill
from dsv41.graph.checkpoint import checkpoint_config, weights_fingerprint
from dsv41.graph.model import Model
from dsv41.runtime.engine.engine import Engine
from dsv41.runtime.engine.options import SpecMode, spec_mode
from dsv41.runtime.engine.records import TurnRecord
from dsv41.runtime.tiers.ssd_store import FORMAT_VERSION, STORE_KIND
from dsv41.runtime.tiers.store_folder import check_folder


@dataclass(frozen=True)
class AgentLoopConfig:
    checkpoint: Path
    artifact: Path | None  # None: the PyTorch graph's phases
    store_dir: Path | None  # None: a fresh store of its own, removed at the end
    context: int = 512  # tokens of system + repository context
    turns: int = 3
    suffix: int = 32  # new tool-output tokens per turn
    decode: int = 16  # tokens decoded per turn
    exact: bool = False
    restart_between_turns: bool = False
    keep_store: bool = False  # start from the store's current contents
    page_tokens: int = 64  # runtime-cache page and SSD block
    seed: int = 0
    speculative: SpecMode = SpecMode.OFF  # DSpark (EngineOptions.speculative; the CLI's: auto)
    max_draft: int | None = None  # None: the DSpark block

    def __post_init__(self):  # the CLI's string as the enum (a bad one is refused)
        object.__setattr__(self, "speculative", spec_mode(self.speculative))

    def validate(self) -> None:
        """Every argument, the model's length and the store folder, before any work."""
        for name in ("context", "turns", "suffix", "decode", "page_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}.")
        a = checkpoint_config(self.checkpoint)
        total = self.context + self.turns * (self.suffix + self.decode) + 1
        if total > a.max_seq_len:
            raise ValueError(f"--context/--turns/--suffix/--decode reach {total} positions; the "
                             f"model's max_seq_len is {a.max_seq_len}.")
        if self.store_dir is None:
            if self.keep_store:
                raise ValueError("--keep-store needs --store DIR (the store to continue).")
            return
        is_store = check_folder(self.store_dir, kind=STORE_KIND, version=FORMAT_VERSION)
        if is_store and not self.keep_store:
            raise ValueError(f"{self.store_dir} holds a store from an earlier run; pass "
                             "--keep-store to continue from it, or give a new folder (dsv41 run "
                             "never deletes a folder).")


def _engine(cfg: AgentLoopConfig) -> Engine:
    opts = {"exact": cfg.exact, "store_dir": cfg.store_dir, "page_tokens": cfg.page_tokens,
            "speculative": cfg.speculative, "max_draft": cfg.max_draft}
    if cfg.artifact is not None:
        return Engine.load(cfg.artifact, cfg.checkpoint, **opts)
    return Engine.from_model(Model.from_checkpoint(cfg.checkpoint),
                             weights_hash=weights_fingerprint(cfg.checkpoint), **opts)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def run_agent_loop(cfg: AgentLoopConfig) -> list[TurnRecord]:
    cfg.validate()
    if cfg.store_dir is not None:
        return _play(cfg)
    with tempfile.TemporaryDirectory(prefix="dsv41-run-") as tmp:  # ours: removed at the end
        return _play(replace(cfg, store_dir=Path(tmp) / "store"))


def _play(cfg: AgentLoopConfig) -> list[TurnRecord]:
    t0 = time.time()
    engine = _engine(cfg)
    a = engine.model.args
    print(f"model: {cfg.checkpoint} ({a.n_layers} layers, dim {a.dim}, window {a.window_size}); "
          f"backend: {engine.backend}; {'exact' if cfg.exact else 'CED'} mode; SSD store "
          f"{cfg.store_dir}; load {time.time() - t0:.1f} s")
    rng = np.random.default_rng(cfg.seed)
    low, high = 3, a.vocab_size - 1  # never the special ids or the DSpark noise token
    session = engine.session()
    records = []
    for turn in range(cfg.turns):
        if turn and cfg.restart_between_turns:
            transcript = session.transcript
            engine.close()  # drains its SSD writer and lets the folder's lock go: the next
            # engine takes the store over
            engine = _engine(cfg)
            session = engine.session(transcript=transcript)
        n_new = cfg.context if turn == 0 else cfg.suffix
        new = [int(x) for x in rng.integers(low, high, size=n_new)]
        out = []
        for tok in tqdm(session.send(new, max_new_tokens=cfg.decode), total=cfg.decode,
                        desc=f"turn {turn + 1}", unit="tok", leave=False):
            out.append(tok)
        rec = session.turns[-1]
        records.append(rec)
        engine.flush()  # the turn's blocks are written in the background; count them written
        st = engine.stats()
        sec = rec.seconds
        dec_rate = rec.decoded / max(sec.get("decode", 0.0), 1e-9)
        print(f"turn {turn + 1}: [{rec.tier}] prefilled {rec.prefilled}, replayed "
              f"{rec.replayed} (+{rec.decoder_replayed} through the decoder), decoded "
              f"{len(out)}; {rec.token_layers} token-layers")
        print(f"  time: restore {sec.get('restore', 0):.2f} s, prefill {sec['prefill']:.2f} s, "
              f"decode {sec.get('decode', 0):.2f} s ({dec_rate:.1f} tok/s), store "
              f"{sec.get('offload', 0):.2f} s")
        print(f"  bytes: runtime cache {_mb(sum(st.runtime_bytes.values()))} "
              f"({st.sessions_live} live), DRAM pool {_mb(st.pool.bytes)} "
              f"({st.pool.entries} snapshots), SSD {_mb(st.store.bytes)} "
              f"({st.store.entries} records)")
    tokens = len(session.history)
    bill = make_bill(a, contexts=(tokens,))
    blocks = session.stored_blocks * engine.options.page_tokens
    tiers: dict[str, int] = {}
    for r in records:
        tiers[r.tier] = tiers.get(r.tier, 0) + 1
    print(f"summary: {cfg.turns} turns, {tokens} tokens in the conversation; turns per tier "
          f"{tiers}; global KV {bill.global_bytes_per_token:g} B/token by the bill, {blocks} "
          f"tokens in SSD blocks; total {time.time() - t0:.1f} s")
    session.close()
    engine.close()
    return records
