"""DSpark speculative decoding on the graph: draft, verify, cut back.

One speculative step of a sequence whose cache holds positions [0, p] and whose next token t
(position p+1) is sampled but not yet fed:

    d = phases.draft_after(model, cache, t)                  # DSpark: B guesses for p+2..p+1+B
    v = verify_step(model, cache, [t, d_1..d_k])      # the backbone over 1+k tokens, one pass
    ... accept a prefix of the draft from v.logits (runtime/speculative.py) ...
    cut_back(model, cache, v, keep)                   # the cache as if `keep` decode steps ran

The verify pass gives every token its own decode step's semantics, so its logits, and after
`cut_back` the cache, equal those of `keep` consecutive decode steps. What it writes beyond the
kept tokens is staged first (the ring slots and store rows it can touch, the compressor tails,
the pointer, the Engram lookback, the positions: O(k) rows, never a cache copy) and put back by
`cut_back`.

Two forms. `one_pass=False` (the default, the oracle): the 1+k tokens as consecutive decode
steps inside the call, bit-identical to decoding by construction. `one_pass=True`: one forward
over the 1+k tokens (weights read once), split as the compiled `verify` entry runs it:
`begin_verify` (checks, staging) and `verify_chunk` (RoPE, Engram ids, each token's index-K
pointer) on the host, `verify_forward` the graph the entry captures, `finish_verify` on the host
again (tails and Engram lookback per kept count). The released index-K pointer moves per token,
not per chunk (`Chunk.token_owner`). Eagerly the head and the fp32 compressor GEMMs run per
position; the other GEMMs run at M = b(1+k) rows, and eager CPU GEMMs are not row-invariant
(measured on shared-small: a 1-ulp change in an expert GEMM moves a logit by ~1e-3), so the
eager one-pass form agrees with decoding to rounding (equal selections and caches). Compiled,
every row keeps the decode entry's reduction order: on x86 the FP8 GEMVs (the hand AVX2 /
AVX-512 GEMV) and the AVX-512 routed experts run the verify rows in groups that share each
weight load and decode (`rows` forms, bit-identical per row to the decode kernels), the
shared index sweep runs all 1+k tokens in one pass (each token's pick naming its store), while
attention and the other kernels run row by row, so the entry's logits equal compiled decode
steps' (tests/test_speculative_compiled.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dsv41.graph import dspark
from dsv41.graph.cache import ModelCache, ensure_capacity
from dsv41.graph.engram import engram_history_after
from dsv41.graph.layers import identity_pre
from dsv41.graph.model import FULL, Chunk, Model, final_norm, head, rope_window, run_layers
from dsv41.graph.phases import PhaseResult, check_tokens, embed, engram_ids, prefill_exact

# one decode step of a phase backend: (model, cache, tokens (b, 1)) -> PhaseResult
Step = Callable[[Model, ModelCache, torch.Tensor], PhaseResult]


@dataclass
class Staged:
    """What a verify pass may overwrite, as it was before the pass."""

    start: torch.Tensor  # int64 (b,): the first verified position
    tokens: torch.Tensor  # int64 (b, n): the verified tokens
    rings: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> rows at slots (b, n, ...)
    rows: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]  # source -> (row ids, saved)
    tails: dict[int, tuple[torch.Tensor, torch.Tensor]]  # source -> (tail_kv, tail_score)
    owner_after: torch.Tensor | None  # int64 (b, n): the index-K pointer after each token
    history_after: list[np.ndarray | None]  # the Engram lookback after each token
    tails_after: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]  # after each token


@dataclass
class Verified:
    logits: torch.Tensor  # fp32 (b, n, vocab): position start+i's next-token logits
    staged: Staged
    work: dict[int, int]


_STORE_FIELDS = ("kv_codes", "kv_scales", "k_codes", "k_scales")


def step_owners(model: Model, owner: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The index-K pointer after each decode step of `positions` (b, n), from `owner` (b,)
    before the first: in layer order, every index-K source whose group completes at the
    token takes it."""
    sources = [p for p in model.plan.layers if p.role == FULL and p.owns_index_k]
    out = []
    for j in range(positions.size(1)):
        for p in sources:
            done = torch.remainder(positions[:, j] + 1, p.ratio) == 0
            owner = torch.where(done, p.layer, owner)
        out.append(owner)
    return torch.stack(out, dim=1)


def _stage(model: Model, cache: ModelCache, tokens: torch.Tensor) -> Staged:
    b, n = tokens.shape
    start = cache.pos.clone()
    w = model.args.window_size
    slots = torch.remainder(start.unsqueeze(1) + torch.arange(n), w)  # (b, n)
    bi = torch.arange(b).unsqueeze(1)
    rings = {lay: (r.codes[bi, slots].clone(), r.scales[bi, slots].clone())
             for lay, r in cache.windows.items()}
    rows, tails = {}, {}
    for lay, st in cache.stores.items():
        m = st.ratio
        ids = (start // m).unsqueeze(1) + torch.arange(n // m + 2)  # every row the pass can set
        ids = ids.clamp(max=st.capacity - 1)
        saved = {f: getattr(st, f)[bi, ids].clone() for f in _STORE_FIELDS
                 if getattr(st, f) is not None and getattr(st, f).size(-1)}
        rows[lay] = (ids, saved)
        if st.tail_kv is not None:
            tails[lay] = (st.tail_kv.clone(), st.tail_score.clone())
    return Staged(start, tokens, rings, rows, tails, None, [], [])


def _tails(cache: ModelCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {lay: (st.tail_kv, st.tail_score) for lay, st in cache.stores.items()
            if st.tail_kv is not None}


def begin_verify(model: Model, cache: ModelCache, tokens) -> tuple[torch.Tensor, Staged]:
    """The checks and the staging of a verify pass over `tokens` (b, n): validated tokens and
    what the pass may overwrite (capacity for all n ensured first)."""
    tokens = check_tokens(model, tokens)
    a = model.args
    b, n = tokens.shape
    if b != cache.batch:
        raise ValueError(f"Batch of {b} sequences does not match the cache's {cache.batch}.")
    if not 1 <= n <= verify_tokens(a):
        raise ValueError(f"A verify pass takes 1..{1 + a.dspark_block_size} tokens (and at most "
                         f"the window, {a.window_size}), got {n}.")
    if int(cache.pos.min()) < 1:
        raise ValueError("A verify pass continues a cache: every sequence needs a prefill first.")
    end = int(cache.pos.max()) + n
    if end > a.max_seq_len:
        raise ValueError(f"The sequence would reach {end} tokens; this model's max_seq_len is "
                         f"{a.max_seq_len}.")
    ensure_capacity(cache, end)
    return tokens, _stage(model, cache, tokens)


def verify_tokens(args) -> int:
    """The most tokens one verify pass takes: the sampled token and a DSpark block (within the
    window)."""
    return min(1 + args.dspark_block_size, args.window_size)


def verify_chunk(model: Model, cache: ModelCache, tokens: torch.Tensor,
                 staged: Staged) -> tuple[Chunk, np.ndarray | None]:
    """The host half of a one-pass verify: the chunk (RoPE tables, Engram ids, each token's
    index-K pointer before it, the compressors' rows kept in its trace) and the Engram
    lookback before the pass (the ids advance the cache's). Sets `staged.owner_after`."""
    start, n = staged.start, tokens.size(1)
    staged.owner_after = step_owners(model, cache.index_owner, start.unsqueeze(1)
                                     + torch.arange(n))
    hist = cache.engram_history
    chunk = Chunk(start=start, length=n, rope=rope_window(model, start, n),
                  hash_ids=engram_ids(model, cache, tokens),
                  token_owner=torch.cat([cache.index_owner.unsqueeze(1),
                                         staged.owner_after[:, :-1]], dim=1),
                  keep_tail_rows=True)
    return chunk, hist


def verify_forward(model: Model, cache: ModelCache, tokens: torch.Tensor,
                   chunk: Chunk) -> torch.Tensor:
    """The graph half of a one-pass verify (what the compiled `verify` entry captures): every
    block once over the n tokens, each with its decode step's semantics (per-token index-K
    pointer, the compressors' rows kept in `chunk.trace.tail_rows`), the DSpark rings seeded.
    Returns fp32 logits (b, n, vocab)."""
    h = embed(model, tokens)  # (b, n, hc, d)
    pre = identity_pre(h)
    h, pre = run_layers(model, cache, h, pre, range(model.args.n_layers), chunk)
    x = final_norm(model, h, pre)  # (b, n, d)
    cache.pos = chunk.end
    if torch.compiler.is_exporting():  # compiled: each row through the decode step's GEMV
        logits = head(model, x)
    else:  # eager: per position, at the GEMM shape of a decode step of this batch
        logits = torch.cat([head(model, x[:, i:i + 1]) for i in range(chunk.length)], dim=1)
    if chunk.trace.taps and model.plan.dspark:
        dspark.seed(model, cache, torch.cat(chunk.trace.taps, dim=-1), chunk)
    return logits


def finish_verify(model: Model, cache: ModelCache, tokens: torch.Tensor, staged: Staged,
                  hist: np.ndarray | None,
                  tail_rows: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  logits: torch.Tensor, work: dict[int, int]) -> Verified:
    """After a one-pass verify (graph or compiled): the cache as after all n tokens (position,
    index-K pointer), and what `cut_back` needs for each kept count (tails, Engram lookback)."""
    start, n = staged.start, tokens.size(1)
    cache.pos = start + n
    cache.index_owner = staged.owner_after[:, -1].clone()
    for j in range(n):
        kept = start + j + 1
        staged.tails_after.append({
            lay: _tail_at(*staged.tails[lay], *tail_rows[lay], start, kept,
                          cache.stores[lay].ratio) for lay in staged.tails})
        staged.history_after.append(None if hist is None else engram_history_after(
            model.engram, hist, tokens[:, : j + 1].numpy()))
    return Verified(logits, staged, work)


def verify_step(model: Model, cache: ModelCache, tokens, *, one_pass: bool = False,
                step: Step | None = None) -> Verified:
    """The backbone over `tokens` (b, n), 1 <= n <= 1 + dspark_block_size: the last sampled
    token and a draft prefix, at positions cache.pos.. (every sequence at its own). Logits at
    every position; the cache then holds all n (DSpark rings seeded), until `cut_back`.
    `step`: the decode step of the backend the decode steps run on (default the graph's)."""
    tokens, staged = begin_verify(model, cache, tokens)
    n = tokens.size(1)
    if not one_pass:
        step = step or (lambda m, c, t: prefill_exact(m, c, t))
        logits, owners, work = [], [], {}
        for j in range(n):  # decode steps (each seeds the DSpark rings)
            res = step(model, cache, tokens[:, j:j + 1])
            logits.append(res.logits)
            owners.append(cache.index_owner.clone())
            staged.tails_after.append(_tails(cache))
            staged.history_after.append(None if cache.engram_history is None
                                        else cache.engram_history.copy())
            work = {k: work.get(k, 0) + v for k, v in res.work.items()}
        staged.owner_after = torch.stack(owners, dim=1)
        return Verified(torch.cat(logits, dim=1), staged, work)
    chunk, hist = verify_chunk(model, cache, tokens, staged)
    logits = verify_forward(model, cache, tokens, chunk)
    return finish_verify(model, cache, tokens, staged, hist, chunk.trace.tail_rows, logits,
                         chunk.trace.work)


def _tail_at(old_kv, old_score, kv, score, start, end, m):
    """The partial group at `end` (b,): members before `start` from the old tail, the others
    from the pass's rows (the rule `model.compress` applies)."""
    t_pos = (end // m).unsqueeze(1) * m + torch.arange(m)  # (b, m)
    t_ok = (t_pos < end.unsqueeze(1)).unsqueeze(-1)
    before = (t_pos < start.unsqueeze(1)).unsqueeze(-1)
    src = (t_pos - start.unsqueeze(1)).clamp(0, kv.size(1) - 1).unsqueeze(-1)
    src = src.expand(-1, -1, kv.size(-1))
    new_kv = torch.where(t_ok, torch.where(before, old_kv, kv.gather(1, src)), 0.0)
    new_score = torch.where(t_ok, torch.where(before, old_score, score.gather(1, src)),
                            float("-inf"))
    return new_kv, new_score


def cut_back(model: Model, cache: ModelCache, verified: Verified, keep) -> None:
    """Keep the first keep[i] (1..n) verified tokens of sequence i and undo the rest: ring
    slots and store rows of rejected positions as they were, tails and index-K pointer those
    after the last kept token, Engram lookback advanced by the kept tokens, positions."""
    st = verified.staged
    b, n = st.tokens.shape
    keep = torch.as_tensor(keep, dtype=torch.int64).reshape(-1)
    if keep.numel() != b or int(keep.min()) < 1 or int(keep.max()) > n:
        raise ValueError(f"cut_back keeps 1..{n} tokens of each of {b} sequences, got "
                         f"{keep.tolist()}.")
    end = st.start + keep  # (b,)
    w = model.args.window_size
    j = torch.arange(n)
    rejected = j.unsqueeze(0) >= keep.unsqueeze(1)  # (b, n)
    slots = torch.remainder(st.start.unsqueeze(1) + j, w)
    bi, ji = rejected.nonzero(as_tuple=True)
    for lay, (codes, scales) in st.rings.items():
        ring = cache.windows[lay]
        ring.codes[bi, slots[bi, ji]] = codes[bi, ji]
        ring.scales[bi, slots[bi, ji]] = scales[bi, ji]
    for lay, (ids, saved) in st.rows.items():
        store = cache.stores[lay]
        stale = (ids + 1) * store.ratio > end.unsqueeze(1)  # groups the kept tokens leave open
        ri, gi = stale.nonzero(as_tuple=True)
        for f, before in saved.items():
            getattr(store, f)[ri, ids[ri, gi]] = before[ri, gi]
    rows = torch.arange(b)
    for lay in st.tails:
        store = cache.stores[lay]
        kv = torch.stack([t[lay][0] for t in st.tails_after], dim=1)  # (b, n, m, d)
        score = torch.stack([t[lay][1] for t in st.tails_after], dim=1)
        store.tail_kv, store.tail_score = kv[rows, keep - 1], score[rows, keep - 1]
    cache.index_owner = st.owner_after[rows, keep - 1].clone()
    if st.history_after and st.history_after[0] is not None:
        cache.engram_history = np.stack([st.history_after[k - 1][i]
                                         for i, k in enumerate(keep.tolist())])
    cache.pos = end
