"""The agent-loop workload behind `dsv41 run`: a long system-plus-repository context, then turns
of short tool output and a few decoded tokens, all in one live cache.

This first version drives the PyTorch graph's phase functions directly (turn 1 cold: CED prefill,
or exact; later turns: the live cache holds everything, so only the new suffix is prefilled).
Compiled artifacts and the SSD / DRAM tiers replace the in-process cache in the runtime issue."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dsv41.graph.bill import make_bill
from dsv41.graph.cache import new_cache
from dsv41.graph.model import Model
from dsv41.graph.phases import ced_prefill, decode_step, prefill_exact


@dataclass(frozen=True)
class AgentLoopConfig:
    checkpoint: Path
    context: int = 512  # tokens of system + repository context
    turns: int = 3
    suffix: int = 32  # new tool-output tokens per turn
    decode: int = 16  # greedy tokens per turn
    exact: bool = False
    seed: int = 0

    def validate(self) -> None:
        for name in ("context", "turns", "suffix", "decode"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}.")


@dataclass
class TurnRecord:
    turn: int
    prefilled: int
    replayed: int
    decoded: int
    tier: str
    cache_bytes: int
    seconds: dict


def run_agent_loop(cfg: AgentLoopConfig) -> list[TurnRecord]:
    cfg.validate()
    t0 = time.time()
    model = Model.from_checkpoint(cfg.checkpoint)
    a = model.args
    print(f"model: {cfg.checkpoint} ({a.n_layers} layers, dim {a.dim}); load "
          f"{time.time() - t0:.1f} s; backend: PyTorch graph")
    rng = np.random.default_rng(cfg.seed)
    total = cfg.context + cfg.turns * (cfg.suffix + cfg.decode)
    pad = model.engram.pad_id if model.engram is not None else None
    cache = new_cache(model.plan, 1, total + 1, engram_pad=pad)
    low, high = 3, a.vocab_size - 1  # never the special ids or the DSpark noise token
    records = []
    for turn in range(cfg.turns):
        n_new = cfg.context if turn == 0 else cfg.suffix
        new = torch.from_numpy(rng.integers(low, high, size=(1, n_new)))
        secs = {}
        t = time.time()
        if turn == 0 and not cfg.exact:
            res = ced_prefill(model, cache, new)
            tier, replayed = "cold: CED prefill", min(n_new, a.window_size)
        else:
            res = prefill_exact(model, cache, new)
            tier = "cold: exact prefill" if turn == 0 else "live cache: suffix only"
            replayed = 0
        secs["prefill"] = time.time() - t
        t = time.time()
        token = int(res.logits[0, -1].argmax())
        for _ in tqdm(range(cfg.decode), desc=f"turn {turn + 1} decode", leave=False):
            token = int(decode_step(model, cache, torch.tensor([[token]])).logits[0, -1].argmax())
        secs["decode"] = time.time() - t
        rec = TurnRecord(turn + 1, n_new, replayed, cfg.decode, tier,
                         sum(cache.nbytes().values()), secs)
        records.append(rec)
        print(f"turn {rec.turn}: prefilled {rec.prefilled}, replayed {rec.replayed}, decoded "
              f"{rec.decoded} [{rec.tier}] cache {rec.cache_bytes:,} B; prefill "
              f"{secs['prefill']:.2f} s ({res.token_layers} token-layers), decode "
              f"{secs['decode']:.2f} s ({cfg.decode / max(secs['decode'], 1e-9):.1f} tok/s)")
    bill = make_bill(a, contexts=(int(cache.pos[0]),))
    print(f"summary: {cfg.turns} turns, {int(cache.pos[0])} tokens in cache; global KV "
          f"{bill.global_bytes_per_token:g} B/token by the bill, live "
          f"{cache.nbytes()['main_kv'] + cache.nbytes()['index_k']:,} B allocated for "
          f"{cache.stores and max(s.capacity * s.ratio for s in cache.stores.values())} "
          f"token slots; total {time.time() - t0:.1f} s")
    return records
