"""What sessions and decode batches use of their engine: its public face alone (`Engine`
implements it). Typed here, below `session` and `batch`, so neither imports the engine module
that makes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from dsv41.graph.cache import ModelCache
from dsv41.graph.image_processor import PreparedImage
from dsv41.graph.model import Model
from dsv41.graph.phases_api import Phases
from dsv41.runtime.engine.images import TurnImage
from dsv41.runtime.engine.options import EngineOptions
from dsv41.runtime.engine.planner import TurnPlanner
from dsv41.runtime.engine.turn import Row, SpecStep


class EngineHost(Protocol):
    model: Model
    options: EngineOptions
    phases: Phases
    planner: TurnPlanner
    tier_counts: dict[str, int]  # turns served per tier
    token_counts: dict[str, int]  # prefilled, replayed, decoder_replayed, decoded

    def check_open(self) -> None: ...

    def session(self, transcript: Sequence[int] = ()) -> Any: ...

    def expand_images(self, token_ids: Sequence[int],
                      images: Sequence = ()) -> tuple[Sequence[int], list[TurnImage]]: ...

    def encode_image(self, image: PreparedImage) -> torch.Tensor: ...

    def admit(self, session: Any, tokens: int) -> None: ...

    def reserve(self, cache: ModelCache, tokens: int) -> None: ...

    def new_cache(self, rows: int = 1, tokens: int | None = None) -> ModelCache: ...

    def cache_bytes(self, tokens: int) -> int: ...

    def runtime_bytes(self) -> int: ...

    def fits(self, extra: int) -> bool: ...

    def make_room(self, extra: int) -> None: ...

    def step(self, cache: ModelCache, rows: Sequence[Row]) -> list[SpecStep]: ...

    def forget(self, session: Any) -> None: ...

    def track(self, batch: Any) -> None: ...

    def untrack(self, batch: Any) -> None: ...
