"""The compiled entries' names and the names of their inputs, as the manifest records them: light
(no torch), so the artifact format and the CLI read them without loading the model. The calling
convention itself (the cache as a flat list, each entry's outputs and host inputs) is
`graph.entries`, which re-exports these.
"""

from __future__ import annotations

from enum import StrEnum


class Entry(StrEnum):
    """A compiled entry's name: its library (`<entry>.so`), its manifest key, its CLI word."""

    PREFILL = "prefill"
    PREFILL_ALL = "prefill_all"  # prefill with every position's logits (serves for prefill)
    DECODE = "decode"
    ENCODER = "encoder"
    ENCODER_REPLAY = "encoder_replay"
    DECODER = "decoder"
    DRAFT = "draft"
    VERIFY = "verify"
    VISION = "vision"


ENTRIES = (Entry.PREFILL, Entry.PREFILL_ALL, Entry.DECODE, Entry.ENCODER, Entry.ENCODER_REPLAY,
           Entry.DECODER, Entry.DRAFT, Entry.VERIFY)
# also return the indexers' selections (for scoring)
SELECTING = (Entry.PREFILL_ALL, Entry.DECODE)
# the entry sets an engine runs: a CED engine (what `dsv41 serve` and `chat` compile and load) and
# an exact one (prefill_all serves for prefill); the runtime checks an artifact has them, the
# compiler's tools compile the missing ones
CED_ENTRIES = (Entry.ENCODER, Entry.DECODER, Entry.ENCODER_REPLAY, Entry.DECODE)
EXACT_ENTRIES = (Entry.PREFILL, Entry.DECODE)
# the vision tower (patches -> aligned rows, `vision.tower`): compiled only for a model with one
# (`dsv41 compile --entries vision`); it takes no cache and returns the rows alone
VISION_ENTRY = Entry.VISION
VISION_OUTPUTS = ("aligned",)
VISION_INPUTS = ("patches", "cos", "sin", "cells")
# the entries that prefill take a chunk's image-span rows (`vision.packed_rows`) after their
# tokens, or the decoder after the encoder stream: x = (tokens, span_index, span_rows) or
# (h, pre, span_index, span_rows); only for a model with a vision tower (a text model's entries
# are unchanged)
SPAN_ENTRIES = (Entry.PREFILL, Entry.PREFILL_ALL, Entry.ENCODER, Entry.ENCODER_REPLAY,
                Entry.DECODER)

# the inputs of every cache-taking entry after x (its tensors: `x`, or `x_0`, `x_1`, ... for a
# tuple) and before the cache (`cache_in_0`, ...), by the names the manifest records
# (`capture.PhaseGraph.forward`'s arguments), in the order `entry_inputs` returns them
HASH_IDS = "hash_ids"
ENTRY_ARGS = ("start", "floor", "cos_c", "sin_c", "cos_u", "sin_u", HASH_IDS)
# an entry's input read on the host whatever its device: the hash ids the host Engram call
# receives (with the tables, `engram.host_resident`)
HOST_INPUTS = (HASH_IDS,)
# where the hash ids stand in `entry_inputs`' tuple (x, then ENTRY_ARGS)
HASH_IDS_AT = 1 + ENTRY_ARGS.index(HASH_IDS)


def is_x_input(name: str) -> bool:
    """Whether a manifest input name is one of x's tensors (`x`, or `x_<i>` of a tuple)."""
    return name == "x" or (name.startswith("x_") and name[2:].isdigit())


def is_cache_input(name: str) -> bool:
    """Whether a manifest input name is a cache tensor (`cache_in_<i>`, in `cache_names` order)."""
    return name.startswith("cache_in_") and name[9:].isdigit()
