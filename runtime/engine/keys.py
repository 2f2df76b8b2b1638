"""The tiers' keys: chained block keys of a token sequence, and the key of the state after any
prefix of it, each salted with everything that changes what a stored record means."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from dsv41.runtime.engine.records import StateKind
from dsv41.runtime.tiers.ssd_store import block_keys


class TierKeys:
    """The keys of one engine's records: `salt` (`KeySalt.fingerprint()`) and its blocks of
    `page_tokens` positions."""

    def __init__(self, salt: bytes, page_tokens: int):
        self.salt, self.page_tokens = salt, page_tokens

    def block_keys(self, tokens: Sequence[int]) -> list[str]:
        return block_keys(tokens, self.page_tokens, self.salt)

    def history_key(self, tokens: Sequence[int], kind: StateKind) -> str:
        """The key of a tier record of the state after `tokens`."""
        b = self.page_tokens
        n = len(tokens) // b
        keys = self.block_keys(tokens[: n * b])
        return self.state_keys(tokens, keys, kind, len(tokens), len(tokens))[0][1]

    def state_keys(self, tokens: Sequence[int], keys: Sequence[str], kind: StateKind, lo: int,
                   hi: int) -> list[tuple[int, str]]:
        """(L, key of the state after tokens[:L]) for L in lo..hi, all within one block: chained
        on the key of the last complete block before L (`keys`: the block keys of `tokens`),
        then the tokens after it, salted with the model and the snapshot's layout. So a lookup
        of every position in a block hashes at most one block of tokens."""
        b = self.page_tokens
        n = lo // b
        if not 0 <= lo <= hi < (n + 1) * b or hi > len(tokens) or len(keys) < n:
            raise ValueError(f"State positions {lo}..{hi} must lie in one block of {b} within "
                             f"the {len(tokens)} tokens.")
        prev = bytes.fromhex(keys[n - 1]) if n else bytes(32)
        h = hashlib.sha256(self.salt + b"/" + kind.encode() + b"/" + n.to_bytes(8, "little")
                           + prev)
        tail = np.asarray(tokens[n * b: hi], dtype="<i8")
        out = []
        for length in range(n * b, hi + 1):
            if length > n * b:
                h.update(tail[length - 1 - n * b].tobytes())
            if length >= lo:
                out.append((length, h.copy().hexdigest()))
        return out
