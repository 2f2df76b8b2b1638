"""Bounds on oneDNN's shape-keyed primitive caches, which the PyTorch backend fills.

PyTorch runs bf16 matmuls on the CPU (the graph's bf16 linears and einsums) through oneDNN, which
JIT-compiles one primitive per distinct problem shape and keeps it in two LRU caches: oneDNN's
own (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's, PyTorch's wrapper around it
(`LRU_CACHE_CAPACITY`), both 1024 entries by default; a primitive lives while either cache holds
it. An engine's shapes change with every prefill length and every context length (the indexer's
scores are queries x context, a new shape at each decode step), so with the defaults each new
shape keeps its code, about 0.6 MiB on an AMX machine, until both caches hold 1024: the 500-turn
soak's RSS grew from 464 MiB at turn 50 to 858 MiB at turn 500. A bound of 64 keeps at most
~40 MiB and still holds the fixed shapes a decode step reuses (a miss recompiles the same kernel,
~1 ms, so results do not change).

Both capacities are read once, when the process creates its first oneDNN primitive, and PyTorch
has no call to change them later: `bound_onednn_caches` sets the environment variables (a value
the user set is kept) and takes effect only when it runs before the first bf16 matmul. The CLI
calls it first thing and every `Engine` at construction.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
DEFAULT_ONEDNN_CACHE_CAPACITY = 64


def bound_onednn_caches(capacity: int = DEFAULT_ONEDNN_CACHE_CAPACITY) -> dict[str, int]:
    """Both caches at `capacity` primitives, unless the environment already sets a variable (the
    user's value wins). Returns the capacities now in the environment, by variable."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"The oneDNN cache capacity must be a positive int, got {capacity!r}.")
    out = {}
    for name in ONEDNN_CACHE_VARIABLES:
        value = os.environ.setdefault(name, str(capacity))
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} in the environment is not an integer; set it to "
                             "a number of cached primitives or unset it.") from None
    return out
