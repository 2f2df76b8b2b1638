"""The phase functions over a compiled artifact: the host half of each phase (validation, Engram
hashing, RoPE tables, capacity) from `dsv41.graph.phases`, the graph half from the artifact's
entries. Same signatures and results as the graph's phases (`graph.phases_api.Phases`, which
both implement), so the two can be compared anywhere. The entries come from an `EntryBackend`:
a loaded artifact (`runtime.artifact.Artifact`), or `dsv41 bench`'s torch.compile peer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from dsv41.graph.artifact_format import EntrySpec
from dsv41.graph.cache import ModelCache, capacity_tokens, restore_local_state, save_local_state
from dsv41.graph.dspark import Draft
from dsv41.graph.entries import (
    ENTRY_ARGS,
    VISION_ENTRY,
    entry_inputs,
    load_cache_tensors,
    selection_keys,
    takes_spans,
)
from dsv41.graph.image_processor import PreparedImage
from dsv41.graph.model import Model
from dsv41.graph.phases import (
    EncoderOutput,
    PhaseResult,
    check_tokens,
    chunked_encoder,
    chunked_exact,
    chunked_replay,
    join_encoder,
    new_chunk,
    prepare_replay,
    resume_tail,
    rows_at,
)
from dsv41.graph.phases_api import DEFAULT_PACING, PrefillPacing
from dsv41.graph.speculative import (
    Verified,
    begin_verify,
    finish_verify,
    verify_chunk,
    verify_step,
)
from dsv41.graph.vision import SequenceImages, SpanRows, tower_inputs
from dsv41.runtime.backends.artifact import ArtifactError
from dsv41.runtime.backends.threads import default_tvm_pool


@runtime_checkable
class EntryBackend(Protocol):
    """Compiled entries by name: their calling conventions (`specs`: inputs, outputs, cache),
    bound once to a model's weights, each called on its user inputs (torch tensors, nested
    pairs flattened in order)."""

    specs: Mapping[str, EntrySpec]

    @property
    def entries(self) -> tuple[str, ...]: ...

    def bind(self, model) -> None: ...

    def call(self, entry: str, inputs) -> list[torch.Tensor]: ...


class CompiledPhases:
    """`Phases` over compiled entries: the host half here, the graph half in the entries."""

    def __init__(self, artifact: EntryBackend, model: Model, *, threads: int | None = None):
        """threads: TVM's CPU pool size (None: TVM_NUM_THREADS if set, else torch's thread
        count; TVM alone would take half the hardware threads)."""
        default_tvm_pool(threads)
        artifact.bind(model)
        self.art, self.model = artifact, model
        self.plan = model.plan

    def _check_inputs(self, entry: str, cache: ModelCache, inputs) -> None:
        """Every id and position that reaches a compiled gather is checked here (TVM's gathers
        do not bound-check)."""

        x, start, floor, hash_ids = inputs[0], inputs[1], inputs[2], inputs[7]
        a = self.model.args
        if entry == "draft":
            if int(x.min()) < 0 or int(x.max()) >= a.vocab_size:
                raise ValueError("Draft token id out of range.")
            s = a.dspark_block_size
        else:
            s = (x[0] if isinstance(x, tuple) else x).size(1)
        if takes_spans(a, entry):
            span_index, span_rows = x[-2], x[-1]
            b = start.size(0)
            if tuple(span_index.shape) != (b, s) or span_rows.dim() != 2 \
                    or span_rows.size(1) != a.dim or span_rows.dtype != torch.bfloat16:
                raise ValueError(f"The span inputs have shapes {tuple(span_index.shape)} and "
                                 f"{tuple(span_rows.shape)} ({span_rows.dtype}); the chunk needs "
                                 f"({b}, {s}) and (n + 1, {a.dim}) bf16.")
            if int(span_index.min()) < 0 or int(span_index.max()) >= span_rows.size(0):
                raise ValueError(f"Span row indices must lie in 0..{span_rows.size(0) - 1}; got "
                                 f"{int(span_index.min())}..{int(span_index.max())}.")
        if int(start.min()) < 0 or int((floor > start).sum()) or int(floor.min()) < 0:
            raise ValueError(f"Bad positions: start {start.tolist()}, floor {floor.tolist()}.")
        if entry != "draft" and int(start.max()) + s > capacity_tokens(cache):
            raise ValueError(f"Positions up to {int(start.max()) + s} exceed the cache capacity "
                             f"of {capacity_tokens(cache)} tokens.")
        bounds = self.art.specs[entry].static_bounds
        if bounds is not None:
            if start.size(0) > bounds.batch:
                raise ValueError(f"The {entry} entry is planned for batches of up to "
                                 f"{bounds.batch} sequences; got {start.size(0)}.")
            if capacity_tokens(cache) > bounds.context_tokens and cache.stores:
                raise ValueError(f"The {entry} entry is planned for caches of up to "
                                 f"{bounds.context_tokens} tokens; this cache holds "
                                 f"{capacity_tokens(cache)}.")
        if hash_ids.numel():
            for slot, layer in enumerate(a.engram_layer_ids):
                rows = self.model.p(layer, "engram.embed.weight").size(0)
                ids = hash_ids[:, :, slot]
                if int(ids.min()) < 0 or int(ids.max()) >= rows:
                    raise ValueError(f"Engram ids of layer {layer} outside its {rows} rows.")

    def _run(self, entry: str, cache: ModelCache, x, **kw) -> dict[str, torch.Tensor]:
        inputs = entry_inputs(self.model, cache, entry, x, **kw)
        given = sum(len(t) if isinstance(t, tuple) else 1 for t in inputs)
        # an artifact's manifest lists the inputs; the torch.compile peer captures the same
        # entry graph at its first call from these very inputs, so it declares none
        declared = self.art.specs[entry].inputs
        if declared is not None and given != len(declared):  # else TVM stops with an
            # argument-count InternalError
            raise ArtifactError(
                f"The {entry} entry of {self.art.path} takes {len(declared)} inputs; this runtime "
                f"calls it with {given} (the artifact was compiled by another version of dsv41, "
                "e.g. before the prefill entries of a model with a vision tower took image-span "
                "rows): recompile it.")
        self._check_inputs(entry, cache, inputs)
        out = self.art.call(entry, inputs)
        names = self.art.specs[entry].outputs
        named = dict(zip(names, out, strict=True))
        if entry != "draft":
            load_cache_tensors(cache, [named[n] for n in self.art.specs[entry].cache])
        # logits, selections and drafts go to the host (a no-op on the CPU); the cache, the
        # encoder stream (h, pre: the decoder's input) and a verify's compressor rows (cut back
        # against the cache's tails) stay on the artifact's device
        stays = set(self.art.specs[entry].cache) | {"h", "pre"}
        return {k: v if k in stays or k.startswith("tail.") else v.cpu()
                for k, v in named.items()}

    def check_images(self, model: Model) -> None:
        """ValueError unless this artifact can take images: the `vision` entry, and backbone
        entries that take span rows (compiled from a model with a vision tower)."""
        self._check(model)
        a = self.model.args
        if a.vision_n_layers <= 0 or not self.model.vision:
            raise ValueError("This model has no vision tower; it cannot take images.")
        if VISION_ENTRY not in self.art.entries:
            raise ValueError(f"The artifact {self.art.path} has no `vision` entry; compile it "
                             f"with `dsv41 compile --entries {','.join(self.art.entries)},"
                             "vision` to take images.")
        old = [e for e in self.art.entries if takes_spans(a, e)
               and len(self.art.specs[e].inputs) != self._span_inputs(e)]
        if old:
            raise ValueError(f"The artifact's entries {', '.join(old)} take no image-span rows "
                             "(compiled before they did); compile them again to take images.")

    def _span_inputs(self, entry: str) -> int:
        """The user inputs a span-taking entry has: x's tensors, ENTRY_ARGS, the cache."""
        x = 4 if entry == "decoder" else 3
        return x + len(ENTRY_ARGS) + len(self.art.specs[entry].cache)

    def _work(self, layers, n: int) -> dict[int, int]:
        return {lay: n for lay in layers}

    def _check(self, model: Model) -> None:
        if model is not self.model:
            raise ValueError("These compiled phases are bound to another model's weights.")

    def prefill_exact(self, model: Model, cache: ModelCache, tokens, *,
                      all_logits: bool = False, record: tuple[int, ...] = (),
                      pacing: PrefillPacing = DEFAULT_PACING,
                      image: SpanRows | None = None) -> PhaseResult:
        """`phases.prefill_exact`'s contract; `image`: the new tokens' span rows."""
        del record  # hidden states are a graph-only diagnostic
        self._check(model)
        tokens = check_tokens(self.model, tokens)
        if pacing.chunk_tokens is not None:
            first = cache.pos.clone()

            def run(t: torch.Tensor) -> PhaseResult:
                b = int(cache.pos[0] - first[0])  # every sequence advances alike
                return self.prefill_exact(model, cache, t, all_logits=all_logits,
                                          image=None if image is None
                                          else image.piece(b, b + t.size(1)))

            return chunked_exact(run, tokens, pacing.chunk_tokens, all_logits=all_logits,
                                 keep_rows=pacing.keep_rows,
                                 between_chunks=pacing.between_chunks)
        chunk = new_chunk(self.model, cache, tokens, image=image)
        entry = "prefill_all" if all_logits else "prefill"
        if entry not in self.art.entries and "prefill_all" in self.art.entries:
            entry = "prefill_all"  # the same graph, with every position's logits
        if tokens.size(1) == 1 and not all_logits and "decode" in self.art.entries \
                and image is None:
            entry = "decode"
        named = self._run(entry, cache, tokens, start=chunk.start, hash_ids=chunk.hash_ids,
                          rope=chunk.rope, image=image)
        cache.pos = chunk.end
        sel = {k: named[f"sel.{k}"] for k in selection_keys(self.plan) if f"sel.{k}" in named}
        logits = named["logits"] if all_logits else named["logits"][:, -1:]
        return PhaseResult(logits, self._work(range(self.model.args.n_layers),
                                                       tokens.size(1)), selections=sel)

    def decode_step(self, model: Model, cache: ModelCache, tokens, *,
                    draft: bool = False) -> PhaseResult:
        tokens = check_tokens(self.model, tokens)
        if tokens.size(1) != 1:
            raise ValueError(f"decode_step takes one token per sequence, got {tokens.size(1)}.")
        res = self.prefill_exact(model, cache, tokens)
        if draft:
            nxt = res.logits[:, -1].argmax(dim=-1)
            named = self._run("draft", cache, nxt, start=cache.pos)
            res.draft = Draft(named["draft_ids"], named["draft_logits"], named["confidence"])
        return res

    def draft_after(self, model: Model, cache: ModelCache, token: torch.Tensor) -> Draft:
        """DSpark's block after the sampled `token` (b,) at position cache.pos (the `draft`
        entry; `graph.phases.draft_after`'s contract)."""
        self._check(model)
        token = torch.as_tensor(token).reshape(-1).long()
        if token.numel() != cache.batch:
            raise ValueError(f"draft_after takes one token per sequence ({cache.batch}), got "
                             f"{token.numel()}.")
        if "draft" not in self.art.entries:
            raise ValueError("This artifact has no `draft` entry; compile it with --entries "
                             "draft (and the others) to speculate.")
        named = self._run("draft", cache, token, start=cache.pos)
        return Draft(named["draft_ids"], named["draft_logits"], named["confidence"])

    def encode_image(self, model: Model, image: PreparedImage) -> torch.Tensor:
        """One image's aligned rows bf16 (L, d) through the `vision` entry (`vision.tower`'s
        contract; the host half is `vision.tower_inputs`)."""
        self._check(model)
        if VISION_ENTRY not in self.art.entries:
            raise ValueError("This artifact has no `vision` entry; compile it with --entries "
                             "vision (a model with a vision tower).")
        patches, cos, sin, cells = tower_inputs(model.args, image)
        n = patches.size(0)
        if int(cells.min()) < 0 or int(cells.max()) > n:  # TVM's gathers do not bound-check
            raise ValueError(f"Cell indices must lie in 0..{n} (n_patches is the zero row).")
        (aligned,) = self.art.call(VISION_ENTRY, (patches.contiguous(), cos, sin, cells))
        return aligned.cpu()

    def verify_step(self, model: Model, cache: ModelCache, tokens) -> Verified:
        """`graph.speculative.verify_step`'s contract (logits at every position; staged for
        `cut_back`) in one call of the `verify` entry: the 1+k tokens of every sequence as rows
        of decode's own kernels, the weights read once. Without the entry, 1+k calls of the
        decode entry (the same logits)."""
        self._check(model)
        if "verify" not in self.art.entries:
            return verify_step(model, cache, tokens, step=self.decode_step)
        tokens, staged = begin_verify(self.model, cache, tokens)
        chunk, hist = verify_chunk(self.model, cache, tokens, staged)
        named = self._run("verify", cache, (tokens, chunk.token_owner), start=chunk.start,
                          hash_ids=chunk.hash_ids, rope=chunk.rope)
        tails = {lay: (named[f"tail.{lay}.kv"], named[f"tail.{lay}.score"])
                 for lay in staged.tails}
        return finish_verify(self.model, cache, tokens, staged, hist, tails, named["logits"],
                             self._work(range(self.model.args.n_layers), tokens.size(1)))

    def _encode(self, cache: ModelCache, tokens, *, replay_from=None, floor=None,
                images: SequenceImages | None = None):
        entry = "encoder" if replay_from is None else "encoder_replay"
        floor = replay_from if replay_from is not None else floor
        start = replay_from if entry == "encoder_replay" else None
        image = rows_at(images, cache.pos if start is None else start, tokens.size(1))
        chunk = new_chunk(self.model, cache, tokens, start=start, floor=floor, image=image)
        named = self._run(entry, cache, tokens, start=chunk.start, floor=chunk.floor,
                          hash_ids=chunk.hash_ids, rope=chunk.rope, image=image)
        return named["h"], named["pre"], chunk

    def encoder_prefill(self, model: Model, cache: ModelCache, tokens,
                        record: tuple[int, ...] = (), *, floor: torch.Tensor | None = None,
                        images: SequenceImages | None = None) -> EncoderOutput:
        """The `encoder` entry over the new tokens (windows cut below `floor`; `images`: the
        sequence's spans by position, as every CED phase takes them)."""
        del record
        self._check(model)
        tokens = check_tokens(self.model, tokens)
        h, pre, chunk = self._encode(cache, tokens, floor=floor, images=images)
        cache.pos = chunk.end
        return EncoderOutput(h, pre, chunk.hash_ids, chunk.start,
                             self._work(self.plan.encoder_layers, tokens.size(1)), {}, {})

    def encoder_replay(self, model: Model, cache: ModelCache, prefix, suffix,
                       record: tuple[int, ...] = (), *,
                       images: SequenceImages | None = None) -> EncoderOutput:
        """Snapshot miss: the `encoder_replay` entry over the prefix's last window, then the
        `encoder` entry over the suffix (windows cut at the replay's first position)."""
        del record
        self._check(model)
        m = self.model
        prefix, suffix = check_tokens(m, prefix), check_tokens(m, suffix)
        n, first = prepare_replay(m, cache, prefix, images=images)
        h1, p1, c1 = self._encode(cache, prefix[:, -n:], replay_from=first, images=images)
        h2, p2, c2 = self._encode(cache, suffix, floor=first, images=images)
        cache.pos = c2.end
        ids = None if c2.hash_ids is None else torch.cat([c1.hash_ids, c2.hash_ids], 1)
        return EncoderOutput(torch.cat([h1, h2], 1), torch.cat([p1, p2], 1), ids, first,
                             self._work(self.plan.encoder_layers, n + suffix.size(1)), {}, {})

    def decoder_replay(self, model: Model, cache: ModelCache, enc: EncoderOutput, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       images: SequenceImages | None = None) -> PhaseResult:
        """The `decoder` entry over the last `window` encoded tokens."""
        del record
        self._check(model)
        n = min(enc.h.size(1), self.model.args.window_size)
        first = enc.start + enc.h.size(1) - n
        named = self._run("decoder", cache, (enc.h[:, -n:], enc.pre[:, -n:]), start=first,
                          floor=first,
                          hash_ids=None if enc.hash_ids is None else enc.hash_ids[:, -n:],
                          image=rows_at(images, first, n))
        logits = named["logits"] if all_logits else named["logits"][:, -1:]
        work = {**enc.work, **self._work(self.plan.decoder_layers, n)}
        return PhaseResult(logits, work)

    def resume_prefill(self, model: Model, cache: ModelCache, cached, fresh, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       pacing: PrefillPacing = DEFAULT_PACING,
                       images: SequenceImages | None = None) -> PhaseResult:
        """Decoder bounded replay on a continued cache (`phases.resume_prefill`): the tail of
        cached tokens through the `encoder_replay` entry with the cache's local state put back
        afterwards, the new tokens through `encoder`, then the decoder over both."""
        del record
        self._check(model)
        m = self.model
        cached, fresh = check_tokens(m, cached), check_tokens(m, fresh)
        t = resume_tail(m, cache, fresh.size(1))
        if t == 0:  # S >= window: a CED prefill of the new tokens (chunked)
            return self.ced_prefill(model, cache, fresh, all_logits=all_logits, pacing=pacing,
                                    images=images)
        enc = join_encoder(self.encode_cached_tail(model, cache, cached, t, images=images),
                           # S < window: one chunk
                           self.encoder_prefill(model, cache, fresh, images=images),
                           window=m.args.window_size, keep_rows=pacing.keep_rows)
        return self.decoder_replay(model, cache, enc, all_logits=all_logits, images=images)

    def encode_cached_tail(self, model: Model, cache: ModelCache, cached, n: int,
                           record: tuple[int, ...] = (), *,
                           images: SequenceImages | None = None) -> EncoderOutput:
        """`phases.encode_cached_tail`: the last n cached tokens through the `encoder_replay`
        entry, with the cache's local state put back afterwards."""
        del record
        self._check(model)
        saved = save_local_state(cache)
        try:
            n, first = prepare_replay(self.model, cache, cached, replay=n, images=images)
            h, pre, chunk = self._encode(cache, cached[:, -n:], replay_from=first,
                                         images=images)
        finally:
            restore_local_state(cache, saved)
        return EncoderOutput(h, pre, chunk.hash_ids, first,
                             self._work(self.plan.encoder_layers, n), {}, {})

    def ced_prefill(self, model: Model, cache: ModelCache, tokens, *,
                    all_logits: bool = False, record: tuple[int, ...] = (),
                    pacing: PrefillPacing = DEFAULT_PACING,
                    images: SequenceImages | None = None) -> PhaseResult:
        """CED prefill: the encoder (in chunks with `chunk_tokens`), then the decoder's bounded
        replay."""
        chunk_tokens, between_chunks = pacing.chunk_tokens, pacing.between_chunks
        del record
        tokens = check_tokens(self.model, tokens)
        if chunk_tokens is None:
            enc = self.encoder_prefill(model, cache, tokens, images=images)
        else:
            enc = chunked_encoder(lambda t: self.encoder_prefill(model, cache, t, images=images),
                                  tokens, chunk_tokens, window=self.model.args.window_size,
                                  keep_rows=pacing.keep_rows, between_chunks=between_chunks)
            if between_chunks is not None and tokens.size(1) > chunk_tokens + 1:
                between_chunks()  # after two or more chunks, the decoder's replay is a piece
        return self.decoder_replay(model, cache, enc, all_logits=all_logits, images=images)

    def replay_prefill(self, model: Model, cache: ModelCache, prefix, suffix, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       pacing: PrefillPacing = DEFAULT_PACING,
                       images: SequenceImages | None = None) -> PhaseResult:
        """Snapshot miss: encoder bounded replay (the suffix in chunks with `chunk_tokens`),
        then decoder bounded replay."""
        chunk_tokens, between_chunks = pacing.chunk_tokens, pacing.between_chunks
        del record
        suffix = check_tokens(self.model, suffix)
        if chunk_tokens is None:
            enc = self.encoder_replay(model, cache, prefix, suffix, images=images)
        else:
            enc = chunked_replay(
                lambda t: self.encoder_replay(model, cache, prefix, t, images=images),
                lambda t, floor: self.encoder_prefill(model, cache, t, floor=floor,
                                                      images=images),
                suffix, chunk_tokens, window=self.model.args.window_size,
                keep_rows=pacing.keep_rows,
                between_chunks=between_chunks)
            if between_chunks is not None and suffix.size(1) > chunk_tokens + 1:
                between_chunks()  # after two or more chunks, the decoder's replay is a piece
        return self.decoder_replay(model, cache, enc, all_logits=all_logits, images=images)
