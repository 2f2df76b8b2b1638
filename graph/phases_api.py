"""The phase contract every backend implements with one set of signatures: the graph's own
functions (`GraphPhases`, the oracle), a compiled artifact (`runtime.compiled.CompiledPhases`)
and the torch.compile peer of `dsv41 bench` (`CompiledPhases` over its entries). An engine, a
scorer or a benchmark holds a `Phases` and never asks which one it has.

Each phase takes the model it runs (a compiled backend checks it is the model its weights are
bound to), the cache it advances and validated-here tokens; `record` names the blocks whose
outputs the result keeps (a graph-only diagnostic: the compiled backends keep none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dsv41.graph import phases, speculative, vision
from dsv41.graph.cache import ModelCache
from dsv41.graph.dspark import Draft
from dsv41.graph.image_processor import PreparedImage
from dsv41.graph.model import Model
from dsv41.graph.phases import EncoderOutput, Pause, PhaseResult
from dsv41.graph.speculative import Verified
from dsv41.graph.vision import SequenceImages, SpanRows


@dataclass(frozen=True)
class PrefillPacing:
    """How a prefill runs its segment: in chunks of at most `chunk_tokens` tokens (None: one
    pass; the engine reads None as its own `prefill_chunk_tokens`), with `between_chunks` called
    between two pieces (the batcher's decode step of the running batch; it may raise to abandon
    the prefill, whose cache is then dropped), and, chunked, every row of the result kept
    (`keep_rows`: what a one-pass prefill returns; else only the last `window` rows the decoder's
    bounded replay reads). The one value the engine, the `Phases` protocol and every backend
    pass down (`graph.phases` documents each field's effect)."""

    chunk_tokens: int | None = None
    between_chunks: Pause | None = None
    keep_rows: bool = False


DEFAULT_PACING = PrefillPacing()  # every prefill phase's default: one pass (the engine: its chunks)


@runtime_checkable
class Phases(Protocol):
    """What `graph.phases` documents, as methods (see each function there for its contract)."""

    def prefill_exact(self, model: Model, cache: ModelCache, tokens, *,
                      all_logits: bool = False, record: tuple[int, ...] = (),
                      pacing: PrefillPacing = DEFAULT_PACING,
                      image: SpanRows | None = None) -> PhaseResult: ...

    def decode_step(self, model: Model, cache: ModelCache, tokens, *,
                    draft: bool = False) -> PhaseResult: ...

    def draft_after(self, model: Model, cache: ModelCache, token: torch.Tensor) -> Draft: ...

    def verify_step(self, model: Model, cache: ModelCache, tokens) -> Verified: ...

    def encoder_prefill(self, model: Model, cache: ModelCache, tokens,
                        record: tuple[int, ...] = (), *, floor: torch.Tensor | None = None,
                        images: SequenceImages | None = None) -> EncoderOutput: ...

    def encoder_replay(self, model: Model, cache: ModelCache, prefix, suffix,
                       record: tuple[int, ...] = (), *,
                       images: SequenceImages | None = None) -> EncoderOutput: ...

    def encode_cached_tail(self, model: Model, cache: ModelCache, cached, n: int,
                           record: tuple[int, ...] = (), *,
                           images: SequenceImages | None = None) -> EncoderOutput: ...

    def decoder_replay(self, model: Model, cache: ModelCache, enc: EncoderOutput, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       images: SequenceImages | None = None) -> PhaseResult: ...

    def ced_prefill(self, model: Model, cache: ModelCache, tokens, *,
                    all_logits: bool = False, record: tuple[int, ...] = (),
                    pacing: PrefillPacing = DEFAULT_PACING,
                    images: SequenceImages | None = None) -> PhaseResult: ...

    def replay_prefill(self, model: Model, cache: ModelCache, prefix, suffix, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       pacing: PrefillPacing = DEFAULT_PACING,
                       images: SequenceImages | None = None) -> PhaseResult: ...

    def resume_prefill(self, model: Model, cache: ModelCache, cached, fresh, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       pacing: PrefillPacing = DEFAULT_PACING,
                       images: SequenceImages | None = None) -> PhaseResult: ...

    def encode_image(self, model: Model, image: PreparedImage) -> torch.Tensor:
        """One image's aligned rows bf16 (L, d) (`vision.encode_image`'s contract)."""
        ...

    def check_images(self, model: Model) -> None:
        """ValueError (a sentence naming what is missing) unless this backend can take images
        for `model`."""
        ...


class GraphPhases:
    """The PyTorch graph's own phases (the oracle backend): `graph.phases`' functions."""

    def prefill_exact(self, model: Model, cache: ModelCache, tokens, *,
                      all_logits: bool = False, record: tuple[int, ...] = (),
                      pacing: PrefillPacing = DEFAULT_PACING,
                      image: SpanRows | None = None) -> PhaseResult:
        return phases.prefill_exact(model, cache, tokens, all_logits=all_logits, record=record,
                                    chunk_tokens=pacing.chunk_tokens, keep_rows=pacing.keep_rows,
                                    between_chunks=pacing.between_chunks, image=image)

    def decode_step(self, model: Model, cache: ModelCache, tokens, *,
                    draft: bool = False) -> PhaseResult:
        return phases.decode_step(model, cache, tokens, draft=draft)

    def draft_after(self, model: Model, cache: ModelCache, token: torch.Tensor) -> Draft:
        return phases.draft_after(model, cache, token)

    def verify_step(self, model: Model, cache: ModelCache, tokens) -> Verified:
        """Decode steps of the graph over the 1 + k tokens (`speculative.verify_step`)."""
        return speculative.verify_step(model, cache, tokens, step=self.decode_step)

    def encoder_prefill(self, model: Model, cache: ModelCache, tokens,
                        record: tuple[int, ...] = (), *, floor: torch.Tensor | None = None,
                        images: SequenceImages | None = None) -> EncoderOutput:
        return phases.encoder_prefill(model, cache, tokens, record, floor=floor, images=images)

    def encoder_replay(self, model: Model, cache: ModelCache, prefix, suffix,
                       record: tuple[int, ...] = (), *,
                       images: SequenceImages | None = None) -> EncoderOutput:
        return phases.encoder_replay(model, cache, prefix, suffix, record, images=images)

    def encode_cached_tail(self, model: Model, cache: ModelCache, cached, n: int,
                           record: tuple[int, ...] = (), *,
                           images: SequenceImages | None = None) -> EncoderOutput:
        return phases.encode_cached_tail(model, cache, cached, n, record, images=images)

    def decoder_replay(self, model: Model, cache: ModelCache, enc: EncoderOutput, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       images: SequenceImages | None = None) -> PhaseResult:
        return phases.decoder_replay(model, cache, enc, all_logits=all_logits, record=record,
                                     images=images)

    def ced_prefill(self, model: Model, cache: ModelCache, tokens, *,
                    all_logits: bool = False, record: tuple[int, ...] = (),
                    pacing: PrefillPacing = DEFAULT_PACING,
                    images: SequenceImages | None = None) -> PhaseResult:
        return phases.ced_prefill(model, cache, tokens, all_logits=all_logits, record=record,
                                  chunk_tokens=pacing.chunk_tokens, keep_rows=pacing.keep_rows,
                                  between_chunks=pacing.between_chunks, images=images)

    def replay_prefill(self, model: Model, cache: ModelCache, prefix, suffix, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       pacing: PrefillPacing = DEFAULT_PACING,
                       images: SequenceImages | None = None) -> PhaseResult:
        return phases.replay_prefill(model, cache, prefix, suffix, all_logits=all_logits,
                                     record=record, chunk_tokens=pacing.chunk_tokens,
                                     keep_rows=pacing.keep_rows,
                                     between_chunks=pacing.between_chunks, images=images)

    def resume_prefill(self, model: Model, cache: ModelCache, cached, fresh, *,
                       all_logits: bool = False, record: tuple[int, ...] = (),
                       pacing: PrefillPacing = DEFAULT_PACING,
                       images: SequenceImages | None = None) -> PhaseResult:
        return phases.resume_prefill(model, cache, cached, fresh, all_logits=all_logits,
                                     record=record, chunk_tokens=pacing.chunk_tokens,
                                     keep_rows=pacing.keep_rows,
                                     between_chunks=pacing.between_chunks, images=images)

    def encode_image(self, model: Model, image: PreparedImage) -> torch.Tensor:
        """The graph's tower (`vision.encode_image`)."""
        return vision.encode_image(model.w, model.args, image)

    def check_images(self, model: Model) -> None:
        """The graph takes images whenever the model's checkpoint has a vision tower."""
        if not model.vision:
            raise ValueError("This model's checkpoint has no vision tower; it cannot take "
                             "images.")
