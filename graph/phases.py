"""Phase functions: pure functions of (model, cache, tokens) that advance the cache.

Each runs over a batch of sequences, each at its own cached length, and reports the token-layer
work it did (tokens x blocks), which is what CED saves:

- `prefill_exact`: every block over every new token, at any start position (a cached sequence
  continues; the released reference only starts at 0).
- `decode_step`: one token through every block.
- `encoder_prefill` + `decoder_replay` (CED): the encoder over all new tokens and the decoder's
  global KV from the encoder's output, then only the last `window` tokens through the decoder.
- `encoder_replay`: a prefix hit without its window snapshot: the last `window` cached tokens
  plus the suffix through the encoder, reading cached global entries and never rewriting them.
- `resume_prefill`: a continuation whose cache holds its local state (live, or a snapshot hit),
  with the decoder's bounded replay over the last `window` prompt tokens as at every prefill
  (the cached ones the new tokens do not cover are replayed through the encoder for their
  outputs only).

Chunked prefill (`chunk_tokens`): every prefill kind can run its segment as consecutive chunks
of at most `chunk_tokens` tokens, each continuing from the cache the previous one left, so the
indexer's score rows and the attention's gathers hold O(chunk x entries), not O(N x entries).
The CED kinds keep only the last `window` rows of the encoder's stream between chunks (what the
decoder's bounded replay reads). The drivers (`chunked_exact`, `chunked_encoder`,
`chunked_replay`) take the one-chunk halves as functions, so the compiled backend runs the same
loop over its entries.

Images: `prefill_exact` takes the new tokens' span rows (`image`, a `vision.SpanRows`); the CED
kinds take the sequence's spans by absolute position (`images`, a `vision.SequenceImages`, one
sequence), since they run segments the caller does not lay out itself (the replayed window, the
cached tail, each chunk), and each segment splices the rows of its own positions, marks them
dead for Engram and routes them with `bias_vl` (the decoder replay included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv41.graph import dspark
from dsv41.graph.cache import ModelCache, ensure_capacity, restore_local_state, save_local_state
from dsv41.graph.dspark import Draft
from dsv41.graph.engram import as_tensor, empty_history, engram_hash, engram_history_after
from dsv41.graph.layers import hc_pre, identity_pre, rms_norm
from dsv41.graph.model import (
    Chunk,
    Model,
    embed_rows,
    engram_at,
    final_norm,
    head,
    publish_main_kv,
    rope_window,
    run_compressor,
    run_layers,
)
from dsv41.graph.vision import SequenceImages, SpanRows, splice

DEFAULT_CHUNK_TOKENS = 2048  # the engine's prefill chunk (EngineOptions.prefill_chunk_tokens)
# called between two pieces of a chunked prefill (two chunks, and the CED encoder pass and the
# decoder's bounded replay): the engine's batcher runs a decode step of the running batch there,
# so a long prompt delays running streams by one piece at a time; it may raise to abandon the
# prefill (the caller then drops the cache)
Pause = Callable[[], None]


@dataclass
class PhaseResult:
    logits: torch.Tensor  # fp32 (b, s, vocab) or (b, 1, vocab)
    work: dict[int, int]  # tokens processed per block
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # recorded block outputs
    final_hidden: torch.Tensor | None = None  # (b, s, d) what the head reads
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # layer (-1: blocks)
    main_hidden: torch.Tensor | None = None  # (b, s, n_taps*d) DSpark's inputs
    draft: Draft | None = None  # DSpark's draft after a decode step, when asked for

    @property
    def token_layers(self) -> int:
        return sum(self.work.values())


def check_tokens(model: Model, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids are validated here, before any gather sees them."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(np.asarray(tokens))
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.size(1) == 0:
        raise ValueError("Tokens must be a non-empty (batch, seq) array, got "
                         f"{tuple(tokens.shape)}.")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"Token ids must be integers, got {tokens.dtype}.")
    tokens = tokens.long()
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= model.args.vocab_size:
        raise ValueError(f"Token ids must lie in 0..{model.args.vocab_size - 1}; got {lo}..{hi}.")
    return tokens


def engram_ids(model: Model, cache: ModelCache, tokens: torch.Tensor,
               dead: np.ndarray | None = None) -> torch.Tensor | None:
    """Engram hash ids of the new tokens (on the host), advancing the cache's lookback.
    `dead` bool (b, s): image-span positions, which no n-gram reaches into or across."""
    if model.engram is None:
        return None
    np_tokens = tokens.numpy()
    ids = as_tensor(engram_hash(model.engram, cache.engram_history, np_tokens, dead))
    cache.engram_history = engram_history_after(model.engram, cache.engram_history, np_tokens,
                                                dead)
    return ids


def new_chunk(model: Model, cache: ModelCache, tokens: torch.Tensor, record=(), *,
              start: torch.Tensor | None = None, floor: torch.Tensor | None = None,
              write_global: bool = True, image: SpanRows | None = None) -> Chunk:
    """The host half of one phase call over `tokens` (b, s): batch and length checked against
    the cache and max_seq_len, capacity ensured, RoPE tables and Engram ids for its positions.
    `image`: the chunk's image-span positions and their embeddings (`vision.span_rows`)."""
    if tokens.size(0) != cache.batch:
        raise ValueError(f"Batch of {tokens.size(0)} sequences does not match the cache's "
                         f"{cache.batch}.")
    start = cache.pos.clone() if start is None else start
    end = int(start.max()) + tokens.size(1)
    if end > model.args.max_seq_len:
        raise ValueError(f"The sequence would reach {end} tokens; this model's max_seq_len is "
                         f"{model.args.max_seq_len}.")
    if image is not None:
        check_image_rows(model, tokens, image)
    ensure_capacity(cache, end)
    dead = None if image is None else image.mask.numpy()
    return Chunk(start=start, length=tokens.size(1), rope=rope_window(model, start, tokens.size(1)),
                 hash_ids=engram_ids(model, cache, tokens, dead), window_floor=floor,
                 write_global=write_global, record=tuple(record), image=image)


def rows_at(images: SequenceImages | None, start: torch.Tensor, n: int) -> SpanRows | None:
    """The image-span rows of the n positions from `start` (b,) of one sequence: what a CED
    phase's chunk splices (None without images, or when no span reaches into it)."""
    if images is None:
        return None
    if start.numel() != 1:
        raise ValueError(f"Image spans are placed in one sequence; this phase runs "
                         f"{start.numel()}.")
    first = int(start[0])
    return images.rows(first, first + n)


def check_image_rows(model: Model, tokens: torch.Tensor, image: SpanRows) -> None:
    """Image rows fit the chunk, the model has a tower, and every span position holds the image
    id (as `prepare_vl_inputs` lays spans out)."""
    if not model.vision:
        raise ValueError("This model's checkpoint has no vision tower; it cannot take images.")
    if tuple(image.mask.shape) != tuple(tokens.shape):
        raise ValueError(f"The image rows cover {tuple(image.mask.shape)} positions; the chunk "
                         f"holds {tuple(tokens.shape)}.")
    if bool((tokens[image.mask] != model.args.image_token_id).any()):
        raise ValueError(f"Every image-span position must hold the image id "
                         f"{model.args.image_token_id}.")


def embed(model: Model, tokens: torch.Tensor, image: SpanRows | None = None) -> torch.Tensor:
    """Token embeddings, image-span positions overwritten (`vision.splice`), in hc copies."""
    h = splice(embed_rows(model, tokens), image)  # (b, s, d) bf16
    return h.unsqueeze(2).repeat(1, 1, model.args.hc_mult, 1)  # (b, s, hc, d)


def _main_hidden(chunk: Chunk) -> torch.Tensor | None:
    return torch.cat(chunk.trace.taps, dim=-1) if chunk.trace.taps else None


def _seed_dspark(model: Model, cache: ModelCache, chunk: Chunk) -> torch.Tensor | None:
    main_hidden = _main_hidden(chunk)
    if main_hidden is not None and model.plan.dspark:
        dspark.seed(model, cache, main_hidden, chunk)
    return main_hidden


def forward_all(model: Model, cache: ModelCache, tokens: torch.Tensor, chunk: Chunk,
                all_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The graph of `prefill_exact` / `decode_step`: pure tensor code over validated inputs
    (what torch.export captures). Returns (logits, final hidden, DSpark main hidden)."""
    h = embed(model, tokens, chunk.image)
    pre = identity_pre(h)
    h, pre = run_layers(model, cache, h, pre, range(model.args.n_layers), chunk)
    x = final_norm(model, h, pre)
    cache.pos = chunk.end
    logits = head(model, x if all_logits else x[:, -1:])
    return logits, x, _seed_dspark(model, cache, chunk)


def prefill_exact(model: Model, cache: ModelCache, tokens, *, all_logits: bool = False,
                  record: tuple[int, ...] = (), chunk_tokens: int | None = None,
                  keep_rows: bool = False, between_chunks: Pause | None = None,
                  image: SpanRows | None = None) -> PhaseResult:
    """Every block over every new token, each sequence continuing from its `cache.pos`. With
    `chunk_tokens`, in chunks (see `chunked_exact` for what the result keeps). `image`: the
    new tokens' image-span rows (`vision.span_rows`); a span may cross chunks."""
    tokens = check_tokens(model, tokens)
    if chunk_tokens is not None:
        first = cache.pos.clone()

        def run(t: torch.Tensor) -> PhaseResult:
            b = int(cache.pos[0] - first[0])  # every sequence advances alike
            return prefill_exact(model, cache, t, all_logits=all_logits, record=record,
                                 image=None if image is None else image.piece(b, b + t.size(1)))

        return chunked_exact(run, tokens, chunk_tokens, all_logits=all_logits,
                             keep_rows=keep_rows, between_chunks=between_chunks)
    chunk = new_chunk(model, cache, tokens, record, image=image)
    logits, x, main_hidden = forward_all(model, cache, tokens, chunk, all_logits)
    return PhaseResult(logits, chunk.trace.work, chunk.trace.hidden, x,
                       chunk.trace.keyed_selections(), main_hidden)


def decode_step(model: Model, cache: ModelCache, tokens, *, draft: bool = False) -> PhaseResult:
    """One new token per sequence through every block (sequences may sit at different
    positions). With `draft`, DSpark then drafts its block after the greedy next token."""
    tokens = check_tokens(model, tokens)
    if tokens.size(1) != 1:
        raise ValueError(f"decode_step takes one token per sequence, got {tokens.size(1)}.")
    res = prefill_exact(model, cache, tokens)
    if draft:
        if not model.plan.dspark:
            raise ValueError("This model has no DSpark layers to draft with.")
        nxt = res.logits[:, -1].argmax(dim=-1)
        pos = cache.pos - 1
        n = model.args.dspark_block_size
        chunk = Chunk(start=pos + 1, length=n, rope=rope_window(model, pos + 1, n), hash_ids=None)
        res.draft = dspark.draft(model, cache, nxt, chunk)
    return res


def draft_after(model: Model, cache: ModelCache, token: torch.Tensor) -> Draft:
    """DSpark's block after `token` (b,), the sampled token at position cache.pos (not yet
    fed); the DSpark rings hold position cache.pos - 1 (a prefill, decode or verify seeded
    them). Reads the cache only."""
    if not model.plan.dspark:
        raise ValueError("This model has no DSpark layers to draft with.")
    token = torch.as_tensor(token).reshape(-1).long()
    if token.numel() != cache.batch:
        raise ValueError(f"draft_after takes one token per sequence ({cache.batch}), got "
                         f"{token.numel()}.")
    v = model.args.vocab_size
    if int(token.min()) < 0 or int(token.max()) >= v:
        raise ValueError(f"Token ids must lie in 0..{v - 1}.")
    n = model.args.dspark_block_size
    start = cache.pos.clone()
    chunk = Chunk(start=start, length=n, rope=rope_window(model, start, n), hash_ids=None)
    return dspark.draft(model, cache, token, chunk)


# ---- CED: the Causal Encoder-Decoder pair -------------------------------------------------------


@dataclass
class EncoderOutput:
    """The encoder's stream after the last encoder block, for the positions a replay needs."""

    h: torch.Tensor  # (b, s, hc, d)
    pre: torch.Tensor  # (b, s, hc) the last encoder block's FFN mix
    hash_ids: torch.Tensor | None  # Engram rows of the same positions
    start: torch.Tensor  # int64 (b,) position of h[:, 0]
    work: dict[int, int]
    hidden: dict[int, torch.Tensor]  # recorded encoder block outputs
    selections: dict[int, torch.Tensor]  # encoder index sources' top-k


def encode_layers(model: Model, cache: ModelCache, tokens: torch.Tensor, chunk: Chunk):
    """The graph of `encoder_prefill` (and each half of `encoder_replay`)."""
    h = embed(model, tokens, chunk.image)
    pre = identity_pre(h)
    h, pre = run_layers(model, cache, h, pre, range(model.plan.decoder_start), chunk)
    if model.plan.decoder_start < model.args.n_layers:
        decoder_global_kv(model, cache, h, pre, chunk)
    return h, pre


def encoder_prefill(model: Model, cache: ModelCache, tokens, record: tuple[int, ...] = (), *,
                    floor: torch.Tensor | None = None,
                    images: SequenceImages | None = None) -> EncoderOutput:
    """The encoder blocks over every new token, then the decoder's global KV (the first decoder
    block's compressor and index K) from the encoder's output, without running the decoder.
    `floor`: positions below it are outside every window (a replay segment's later chunks).
    `images`: the sequence's image spans (one sequence), spliced where the new tokens hold
    them; every CED phase takes them so, by absolute position."""
    tokens = check_tokens(model, tokens)
    chunk = new_chunk(model, cache, tokens, record, floor=floor,
                      image=rows_at(images, cache.pos, tokens.size(1)))
    h, pre = encode_layers(model, cache, tokens, chunk)
    cache.pos = chunk.end
    return EncoderOutput(h, pre, chunk.hash_ids, chunk.start, chunk.trace.work,
                         chunk.trace.hidden, chunk.trace.keyed_selections())


def decoder_global_kv(model: Model, cache: ModelCache, h: torch.Tensor, pre: torch.Tensor,
                      chunk: Chunk) -> None:
    """Block D's attention input is the encoder output collapsed with block D-1's FFN mix, so
    its compressor (the decoder's only KV source) runs here for every new token."""
    layer = model.plan.decoder_start
    p = model.plan.layers[layer]
    if p.engram:
        h = engram_at(model, layer, h, chunk)
    x = rms_norm(hc_pre(h, pre), model.p(layer, "attn_norm.weight"), model.args.norm_eps)
    c = run_compressor(model, cache, layer, x, chunk)
    if c is not None and chunk.write_global:
        publish_main_kv(model, cache.stores[layer], c, chunk, cache.kv_dtype)


def decoder_replay(model: Model, cache: ModelCache, enc: EncoderOutput, *,
                   all_logits: bool = False, record: tuple[int, ...] = (),
                   images: SequenceImages | None = None) -> PhaseResult:
    """The last `window` encoded tokens through the decoder blocks, each query's window cut to
    the replay segment (a query at i sees [max(s0, i - window + 1), i]). The decoder's global
    entries were written by `encoder_prefill` and are only read here."""
    n = min(enc.h.size(1), model.args.window_size)
    start = enc.start + enc.h.size(1) - n
    chunk = Chunk(start=start, length=n, rope=rope_window(model, start, n),
                  hash_ids=None if enc.hash_ids is None else enc.hash_ids[:, -n:],
                  window_floor=start, record=tuple(record), write_global=False,
                  update_tails=False, image=rows_at(images, start, n))
    logits, x, main_hidden = decode_layers(model, cache, enc.h[:, -n:], enc.pre[:, -n:], chunk,
                                           all_logits)
    return PhaseResult(logits, chunk.trace.work, chunk.trace.hidden, x,
                       chunk.trace.keyed_selections(), main_hidden)


def decode_layers(model: Model, cache: ModelCache, h: torch.Tensor, pre: torch.Tensor,
                  chunk: Chunk, all_logits: bool):
    """The graph of `decoder_replay`: the decoder blocks, the head and DSpark's rings."""
    h, pre = run_layers(model, cache, h, pre, range(model.plan.decoder_start,
                                                     model.args.n_layers), chunk)
    x = final_norm(model, h, pre)
    logits = head(model, x if all_logits else x[:, -1:])
    return logits, x, _seed_dspark(model, cache, chunk)


def _joined(enc: EncoderOutput, res: PhaseResult) -> PhaseResult:
    res.work = {k: enc.work.get(k, 0) + res.work.get(k, 0) for k in {*enc.work, *res.work}}
    res.hidden = {**enc.hidden, **res.hidden}
    res.selections = {**enc.selections, **res.selections}
    return res


def ced_prefill(model: Model, cache: ModelCache, tokens, *, all_logits: bool = False,
                record: tuple[int, ...] = (), chunk_tokens: int | None = None,
                keep_rows: bool = False, between_chunks: Pause | None = None,
                images: SequenceImages | None = None) -> PhaseResult:
    """CED prefill: `n_encoder * N + n_decoder * min(N, window)` token-layers instead of
    `n_layers * N`. Logits exist only for the replayed (last `window`) positions. With
    `chunk_tokens`, the encoder runs in chunks (see `chunked_encoder`)."""
    if chunk_tokens is None:
        enc = encoder_prefill(model, cache, tokens, record, images=images)
    else:
        tokens = check_tokens(model, tokens)
        enc = chunked_encoder(lambda t: encoder_prefill(model, cache, t, record, images=images),
                              tokens, chunk_tokens,
                              window=model.args.window_size, keep_rows=keep_rows,
                              between_chunks=between_chunks)
        if between_chunks is not None and tokens.size(1) > chunk_tokens + 1:
            between_chunks()  # after two or more chunks, the decoder's replay is a piece too
    return _joined(enc, decoder_replay(model, cache, enc, all_logits=all_logits, record=record,
                                       images=images))


# ---- bounded replay after a snapshot miss -------------------------------------------------------


def prepare_replay(model: Model, cache: ModelCache, prefix: torch.Tensor,
                   replay: int | None = None, images: SequenceImages | None = None):
    """The host half of a snapshot-miss replay: check the cache holds exactly `prefix`, reset
    the lost tails, and restore the Engram lookback from the tokens before the replay. Returns
    (n replayed tokens, first replayed position per sequence); n is min(window, L), or
    min(replay, L) when given. `images`: the prefix's image spans (dead Engram positions)."""
    big = int(cache.pos.max())
    if prefix.size(1) != big or bool((cache.pos != big).any()):
        raise ValueError(f"A replay needs every sequence's cache at the prefix length "
                         f"{prefix.size(1)}; the cache holds {cache.pos.tolist()} tokens.")
    n = min(model.args.window_size if replay is None else replay, prefix.size(1))
    if n < 1:
        raise ValueError(f"A replay needs at least one token, got {n}.")
    for store in cache.stores.values():  # the lost tails are rebuilt by the replay
        if store.tail_kv is not None:
            store.tail_kv = torch.zeros_like(store.tail_kv)
            store.tail_score = torch.full_like(store.tail_score, float("-inf"))
    if model.engram is not None:
        lookback = prefix[:, : prefix.size(1) - n][:, -(model.engram.max_ngram - 1):]
        begin = prefix.size(1) - n - lookback.size(1)
        dead = None if images is None else images.dead(begin, begin + lookback.size(1))
        cache.engram_history = engram_history_after(
            model.engram, empty_history(model.engram, cache.batch), lookback.numpy(), dead)
    return n, cache.pos - n


def encoder_replay(model: Model, cache: ModelCache, prefix, suffix,
                   record: tuple[int, ...] = (), *,
                   images: SequenceImages | None = None) -> EncoderOutput:
    """A prefix hit without its snapshot: the cache holds the global entries of `prefix` (b, L)
    but its encoder rings and compressor tails are lost. The last min(window, L) prefix tokens
    are replayed through the encoder to rebuild them (their windows cut at the replay start,
    cached global entries read and never rewritten), then the suffix runs as usual. Returns the
    encoder output of replay + suffix, for `decoder_replay`."""
    prefix, suffix = check_tokens(model, prefix), check_tokens(model, suffix)
    n, first = prepare_replay(model, cache, prefix, images=images)
    replay = new_chunk(model, cache, prefix[:, -n:], record, start=first, floor=first,
                       write_global=False, image=rows_at(images, first, n))
    h1, pre1 = encode_layers(model, cache, prefix[:, -n:], replay)
    new = new_chunk(model, cache, suffix, record, floor=first,
                    image=rows_at(images, cache.pos, suffix.size(1)))
    h2, pre2 = encode_layers(model, cache, suffix, new)
    cache.pos = new.end
    work = _sum_work(replay.trace.work, new.trace.work)
    ids = None if new.hash_ids is None else torch.cat([replay.hash_ids, new.hash_ids], dim=1)
    return EncoderOutput(torch.cat([h1, h2], dim=1), torch.cat([pre1, pre2], dim=1), ids,
                         first, work, {**replay.trace.hidden, **new.trace.hidden},
                         {**replay.trace.keyed_selections(), **new.trace.keyed_selections()})


def replay_prefill(model: Model, cache: ModelCache, prefix, suffix, *, all_logits: bool = False,
                   record: tuple[int, ...] = (), chunk_tokens: int | None = None,
                   keep_rows: bool = False, between_chunks: Pause | None = None,
                   images: SequenceImages | None = None) -> PhaseResult:
    """Snapshot miss: encoder bounded replay, then decoder bounded replay. Token-layers:
    n_encoder * (min(window, L) + S) + n_decoder * min(window, min(window, L) + S). With
    `chunk_tokens`, the suffix runs in chunks (see `chunked_replay`)."""
    if chunk_tokens is None:
        enc = encoder_replay(model, cache, prefix, suffix, record, images=images)
    else:
        suffix = check_tokens(model, suffix)
        enc = chunked_replay(
            lambda t: encoder_replay(model, cache, prefix, t, record, images=images),
            lambda t, floor: encoder_prefill(model, cache, t, record, floor=floor,
                                             images=images),
            suffix, chunk_tokens, window=model.args.window_size,
            keep_rows=keep_rows, between_chunks=between_chunks)
        if between_chunks is not None and suffix.size(1) > chunk_tokens + 1:
            between_chunks()  # after two or more chunks, the decoder's replay is a piece too
    return _joined(enc, decoder_replay(model, cache, enc, all_logits=all_logits, record=record,
                                       images=images))


# ---- decoder bounded replay on a continued cache ------------------------------------------------


def resume_tail(model: Model, cache: ModelCache, fresh_tokens: int) -> int:
    """Cached tokens a continuation of `fresh_tokens` new tokens replays through the encoder so
    the decoder replay covers the last min(window, L + S) prompt tokens."""
    return min(int(cache.pos.max()), max(0, model.args.window_size - fresh_tokens))


def encode_cached_tail(model: Model, cache: ModelCache, cached, n: int,
                       record: tuple[int, ...] = (), *,
                       images: SequenceImages | None = None) -> EncoderOutput:
    """Encoder outputs of the last n of the `cached` (b, L) tokens the cache holds, by an
    encoder bounded replay cut at their first position (as `encoder_replay` runs it: tails
    reset, global entries read and never rewritten). The cache's own local state (rings, tails,
    pointers, Engram lookback) is left as it was."""
    saved = save_local_state(cache)
    try:
        n, first = prepare_replay(model, cache, cached, replay=n, images=images)
        tail = cached[:, -n:]
        chunk = new_chunk(model, cache, tail, record, start=first, floor=first, write_global=False,
                          image=rows_at(images, first, n))
        h, pre = encode_layers(model, cache, tail, chunk)
    finally:
        restore_local_state(cache, saved)
    return EncoderOutput(h, pre, chunk.hash_ids, first, chunk.trace.work, chunk.trace.hidden,
                         chunk.trace.keyed_selections())


def resume_prefill(model: Model, cache: ModelCache, cached, fresh, *, all_logits: bool = False,
                   record: tuple[int, ...] = (), chunk_tokens: int | None = None,
                   keep_rows: bool = False, between_chunks: Pause | None = None,
                   images: SequenceImages | None = None) -> PhaseResult:
    """A turn continuing a cache that holds its local state (live, or a snapshot restored over
    the prefix blocks) with decoder bounded replay at every prefill: the decoder rings are
    rebuilt from the last min(window, L + S) prompt tokens, whatever the decoder rings held
    before. With S >= window this is `ced_prefill` of the new tokens. Otherwise the encoder
    outputs of the last t = min(L, window - S) cached tokens come from `encode_cached_tail`,
    the S new tokens run through the encoder from the cache's exact local state, and the
    decoder replays the t + S tokens with its window cut at their start. Token-layers:
    n_encoder * (t + S) + n_decoder * min(window, L + S)."""
    cached, fresh = check_tokens(model, cached), check_tokens(model, fresh)
    t = resume_tail(model, cache, fresh.size(1))
    if t == 0:  # S >= window: the new tokens alone fill the decoder's window (chunked)
        return ced_prefill(model, cache, fresh, all_logits=all_logits, record=record,
                           chunk_tokens=chunk_tokens, keep_rows=keep_rows,
                           between_chunks=between_chunks, images=images)
    # S < window: the new tokens are fewer than one window, so one chunk at most
    tail = encode_cached_tail(model, cache, cached, t, record, images=images)
    enc = join_encoder(tail, encoder_prefill(model, cache, fresh, record, images=images),
                       window=model.args.window_size, keep_rows=keep_rows)
    return _joined(enc, decoder_replay(model, cache, enc, all_logits=all_logits, record=record,
                                       images=images))


# ---- chunked prefill -----------------------------------------------------------------------------


def chunk_spans(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[begin, end) pieces of a segment of n tokens, `chunk_tokens` each, in order. A last piece
    of one token joins the one before it: to the released index-K pointer a one-token chunk is a
    decode step (a ratio-2 group still filling makes its indexers read the ratio-1 source's
    keys), which no chunk of a one-shot prefill is; every chunk of two or more tokens completes a
    group of every source, as the one-shot prefill does."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 2:
        raise ValueError(f"The prefill chunk must be an integer of at least 2 tokens, got "
                         f"{chunk_tokens!r}.")
    if n < 1:
        raise ValueError(f"A prefill segment needs at least one token, got {n}.")
    bounds = [*range(0, n, chunk_tokens), n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _cat_rows(old: dict, new: dict) -> dict:
    return {k: torch.cat([old[k], v], dim=1) if k in old else v for k, v in new.items()}


def _sum_work(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


def join_results(prev: PhaseResult | None, new: PhaseResult, *, all_logits: bool,
                 keep_rows: bool) -> PhaseResult:
    """Two consecutive chunks' results as one: logits of every position (all_logits) or the
    last; work summed; recorded hidden states concatenated. Per-position rows (selections,
    final and DSpark hidden) are kept only with `keep_rows`: O(N x top-k) otherwise held."""
    if prev is None:
        prev = PhaseResult(new.logits[:, :0], {})
    logits = torch.cat([prev.logits, new.logits], dim=1) if all_logits else new.logits
    out = PhaseResult(logits, _sum_work(prev.work, new.work), _cat_rows(prev.hidden, new.hidden))
    if keep_rows:
        out.selections = _cat_rows(prev.selections, new.selections)
        rows = [(prev.final_hidden, new.final_hidden), (prev.main_hidden, new.main_hidden)]
        out.final_hidden, out.main_hidden = (
            b if a is None or b is None else torch.cat([a, b], dim=1) for a, b in rows)
    return out


def join_encoder(prev: EncoderOutput | None, new: EncoderOutput, *, window: int,
                 keep_rows: bool) -> EncoderOutput:
    """Two consecutive encoder chunks as one, holding only the last `window` rows of the stream
    (all the decoder's bounded replay reads); work summed, recorded hidden concatenated,
    selections concatenated with `keep_rows` only."""
    if prev is None:
        h, pre, ids = new.h, new.pre, new.hash_ids
    else:
        h, pre = torch.cat([prev.h, new.h], dim=1), torch.cat([prev.pre, new.pre], dim=1)
        ids = None if new.hash_ids is None else torch.cat([prev.hash_ids, new.hash_ids], dim=1)
    n = min(h.size(1), window)
    start = new.start + new.h.size(1) - n  # position of the first kept row
    return EncoderOutput(
        h[:, -n:], pre[:, -n:], None if ids is None else ids[:, -n:], start,
        _sum_work({} if prev is None else prev.work, new.work),
        _cat_rows({} if prev is None else prev.hidden, new.hidden),
        _cat_rows({} if prev is None else prev.selections, new.selections) if keep_rows else {})


def _paused(spans: list[tuple[int, int]], between_chunks: Pause | None):
    """The spans, with `between_chunks()` called between consecutive ones."""
    for n, span in enumerate(spans):
        if n and between_chunks is not None:
            between_chunks()
        yield span


def chunked_exact(run: Callable[[torch.Tensor], PhaseResult], tokens: torch.Tensor,
                  chunk_tokens: int, *, all_logits: bool, keep_rows: bool,
                  between_chunks: Pause | None = None) -> PhaseResult:
    """An exact prefill as consecutive calls of `run` (one chunk's prefill_exact)."""
    out = None
    for b, e in _paused(chunk_spans(tokens.size(1), chunk_tokens), between_chunks):
        out = join_results(out, run(tokens[:, b:e]), all_logits=all_logits, keep_rows=keep_rows)
    return out


def chunked_encoder(encode: Callable[[torch.Tensor], EncoderOutput], tokens: torch.Tensor,
                    chunk_tokens: int, *, window: int, keep_rows: bool,
                    between_chunks: Pause | None = None) -> EncoderOutput:
    """CED's encoder pass as consecutive calls of `encode` (one chunk's encoder_prefill)."""
    out = None
    for b, e in _paused(chunk_spans(tokens.size(1), chunk_tokens), between_chunks):
        out = join_encoder(out, encode(tokens[:, b:e]), window=window, keep_rows=keep_rows)
    return out


def chunked_replay(replay: Callable[[torch.Tensor], EncoderOutput],
                   encode: Callable[[torch.Tensor, torch.Tensor], EncoderOutput],
                   suffix: torch.Tensor, chunk_tokens: int, *, window: int,
                   keep_rows: bool, between_chunks: Pause | None = None) -> EncoderOutput:
    """Encoder bounded replay with a chunked suffix: `replay` (encoder_replay over the prefix's
    last window and the suffix's first chunk), then `encode(chunk, floor)` for the others, each
    with its windows cut at the replay's first position, as the one-shot replay's suffix is."""
    spans = chunk_spans(suffix.size(1), chunk_tokens)
    b, e = spans[0]
    head = replay(suffix[:, b:e])
    first = head.start  # (b,) the replay's first position: the window floor of every chunk
    out = join_encoder(None, head, window=window, keep_rows=keep_rows)
    for b, e in spans[1:]:
        if between_chunks is not None:
            between_chunks()
        out = join_encoder(out, encode(suffix[:, b:e], first), window=window,
                           keep_rows=keep_rows)
    return out
