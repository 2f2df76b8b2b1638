"""Engram n-gram hashing on the host: token ids -> table row ids, identical to the released model.

Lookup addresses depend only on token ids, so the runtime computes them before the block that
needs them (and can prefetch the rows). Per Engram layer l and position p, with c_s the compressed
id of the token at p - s (the compressed pad id before the sequence start):
    h_n = XOR_{s<n} c_s * mult[l][s]   for n = 2..max_ngram
    row(n, head j) = h_n % primes[l][n-2][j] + offsets[l][(n-2)*heads + j]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from dsv41.graph.config import ModelArgs, engram_prime_buckets
from dsv41.graph.vocab import find_tokenizer_file

# the tensors that stay in host memory whatever the model's device: the Engram tables (a compiled
# entry gets their rows from the host runtime, `ops.engram_rows`)
HOST_TABLES = ("engram.embed.weight", "engram.embed.scale")


def host_resident(name: str) -> bool:
    """Whether the checkpoint tensor `name` (dotted, or an entry's parameter name with double
    underscores) stays in host memory when the model runs on a GPU."""
    return name.replace("__", ".").endswith(HOST_TABLES)


def engram_table_layer(name: str) -> int | None:
    """The layer of an Engram codes table (`layers.<l>.engram.embed.weight`, dotted or not)."""
    parts = name.replace("__", ".").split(".")
    if parts[0] == "layers" and ".".join(parts[2:]) == HOST_TABLES[0]:
        return int(parts[1])
    return None


@dataclass(frozen=True)
class EngramTables:
    """Everything the hash needs: derived from the config and the tokenizer's compressed map."""

    token_map: np.ndarray  # int64 [vocab]: token id -> compressed id
    pad_id: int  # compressed id of engram_pad_id
    multipliers: np.ndarray  # int64 [n_layers_engram, max_ngram]
    primes: np.ndarray  # int64 [n_layers_engram, max_ngram-1, heads]
    offsets: np.ndarray  # int64 [n_layers_engram, (max_ngram-1)*heads]
    max_ngram: int

    @property
    def n_cols(self) -> int:
        return self.offsets.shape[1]


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int):
    """Odd multipliers from a per-layer RNG, bounded so c * mult cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * lid).integers(0, bound, size=(max_ngram,),
                                                        dtype=np.int64) * 2 + 1
            for lid in layer_ids]
    return np.stack(rows)


def stub_token_map(vocab_size: int) -> np.ndarray:
    """The conformance stub tokenizer's map: ids 2k and 2k+1 spell `w{k}` and ` W{k}`, which
    normalise alike, so compressed(t) = t // 2. Used only for a vocabulary no tokenizer is
    shipped for (the `bench` preset); `presets/small_stub_tokenizer.json` derives to the same map,
    the 512-id models' (`vocab.find_tokenizer_file`)."""
    return np.arange(vocab_size, dtype=np.int64) // 2


@dataclass(frozen=True)
class CompressedTokenMap:
    """The Engram map derived from a tokenizer (see `derive_token_map`)."""

    token_map: np.ndarray  # int64 [tokenizer ids]: token id -> compressed id
    n_compressed: int  # distinct compressed ids; the released code asserts it equals the config's


# The released rule (inference/engram.py, `build_compressed_token_map`), as HF `tokenizers`
# normalizers: NFKC, NFD, strip combining marks, lower-case, runs of [ \t\r\n] to one space, a
# lone space kept through the strip by a private-use sentinel, then the strip.
_LONE_SPACE = "\ue000"


def _engram_normalizer():
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE), normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE, " ")])


def compress_token_texts(texts: Sequence[str], raw_tokens: Sequence[str]) -> CompressedTokenMap:
    """The released map from each id's text decoded alone (`texts[i]`, special tokens included,
    no clean-up of spaces) and its vocabulary entry (`raw_tokens[i]`). A text holding U+FFFD is a
    partial UTF-8 byte token: it is keyed by its raw entry instead. Otherwise the key is the
    normalised text, or the text itself when that normalises to nothing. Compressed ids are the
    keys numbered 0, 1, 2, ... in order of first appearance over ascending token ids."""
    if len(texts) != len(raw_tokens):
        raise ValueError(f"compress_token_texts needs one raw token per text; got {len(texts)} "
                         f"texts and {len(raw_tokens)} raw tokens.")
    norm = _engram_normalizer()
    numbering: dict[str, int] = {}
    out = np.empty(len(texts), dtype=np.int64)
    for i, (text, raw) in enumerate(zip(texts, raw_tokens, strict=True)):
        if "\ufffd" in text:
            key = raw
        else:
            key = norm.normalize_str(text) or text
        out[i] = numbering.setdefault(key, len(numbering))
    return CompressedTokenMap(out, len(numbering))


def derive_token_map(tokenizer) -> CompressedTokenMap:
    """The map of a HF `tokenizers.Tokenizer` (the raw Rust tokenizer the released code decodes
    with), over every id including the added tokens."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    raw = [tokenizer.id_to_token(i) for i in range(n)]
    if any(r is None for r in raw):
        missing = next(i for i, r in enumerate(raw) if r is None)
        raise ValueError(f"The tokenizer has no token for id {missing} below its size {n}: "
                         "its ids must be contiguous for the Engram map.")
    return compress_token_texts(texts, raw)


def check_token_map(args: ModelArgs, cmap: CompressedTokenMap, source: str) -> np.ndarray:
    """The model's int64 [vocab_size] map from a derived one, refusing a tokenizer that does not
    fit: more ids than the vocabulary, or a compressed count other than the config's (every hash
    multiplier is derived from it, so a mismatch would silently rehash every table). Model ids
    past the tokenizer's (a padded vocabulary) map to the compressed pad."""
    n = cmap.token_map.shape[0]
    if n > args.vocab_size:
        raise ValueError(f"The tokenizer from {source} has {n} ids, more than the model's "
                         f"vocab_size {args.vocab_size}.")
    if cmap.n_compressed != args.engram_compressed_vocab_size:
        raise ValueError(
            f"The tokenizer from {source} derives {cmap.n_compressed} Engram compressed ids, "
            f"but the config's engram_compressed_vocab_size is "
            f"{args.engram_compressed_vocab_size}: it is not this model's tokenizer.")
    if args.engram_pad_id >= n:
        raise ValueError(f"engram_pad_id {args.engram_pad_id} is not an id of the tokenizer from "
                         f"{source} ({n} ids).")
    tmap = np.full(args.vocab_size, cmap.token_map[args.engram_pad_id], dtype=np.int64)
    tmap[:n] = cmap.token_map
    return tmap


def load_token_map(args: ModelArgs, checkpoint_dir: str | Path | None) -> np.ndarray:
    """The model's compressed token map, first match wins: `engram_token_map.npy` in the
    checkpoint; the map derived from the model's tokenizer (`vocab.find_tokenizer_file`: the
    checkpoint's tokenizer.json, else the one shipped for its vocabulary), checked against the
    config; else (no tokenizer for this vocabulary) the stub map, valid only when its size
    matches `engram_compressed_vocab_size`."""
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / "engram_token_map.npy"
        if path.exists():
            tmap = np.load(path).astype(np.int64)
            if tmap.shape != (args.vocab_size,):
                raise ValueError(f"{path} has shape {tmap.shape}, expected ({args.vocab_size},).")
            if tmap.min() < 0 or tmap.max() >= args.engram_compressed_vocab_size:
                raise ValueError(f"{path} maps outside 0..{args.engram_compressed_vocab_size - 1}.")
            return tmap
    found = find_tokenizer_file(args, checkpoint_dir)
    if found is not None:
        path = found.engram_source  # the small BPE's model hashes with the stub's map
        return check_token_map(args, derive_token_map(Tokenizer.from_file(str(path))), str(path))
    tmap = stub_token_map(args.vocab_size)
    if int(tmap.max()) + 1 != args.engram_compressed_vocab_size:
        raise ValueError(
            "Engram needs the tokenizer's compressed token map: put tokenizer.json (or "
            f"engram_token_map.npy, int64 [{args.vocab_size}]) in the checkpoint; the stub map "
            f"t // 2 only fits engram_compressed_vocab_size = {int(tmap.max()) + 1}, not "
            f"{args.engram_compressed_vocab_size}.")
    return tmap


def build_tables(args: ModelArgs, token_map: np.ndarray) -> EngramTables:
    ids = tuple(args.engram_layer_ids)
    primes = np.array(engram_prime_buckets(ids, args.engram_max_ngram_size, args.engram_n_heads,
                                           args.engram_vocab_size), dtype=np.int64)
    flat = primes.reshape(len(ids), -1)
    offsets = np.concatenate([np.zeros((len(ids), 1), np.int64), np.cumsum(flat, 1)[:, :-1]], 1)
    rows = flat.sum(1)
    for lid, n, want in zip(ids, rows, args.engram_num_embeddings, strict=True):
        if n != want:
            raise ValueError(f"Engram layer {lid}: the hash buckets need {n} table rows but "
                             f"engram_num_embeddings says {want}.")
    return EngramTables(
        token_map=token_map,
        pad_id=int(token_map[args.engram_pad_id]),
        multipliers=hash_multipliers(ids, args.engram_max_ngram_size,
                                     args.engram_compressed_vocab_size),
        primes=primes, offsets=offsets, max_ngram=args.engram_max_ngram_size)


def _alive_sequence(t: EngramTables, history: np.ndarray, tokens: np.ndarray,
                    dead: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(history + the chunk's compressed ids, the last dead index at or before each entry, -1
    if none), both (b, n-1+s). Dead positions (image spans) read as pad."""
    c = t.token_map[tokens]  # (b, s)
    n1 = t.max_ngram - 1
    last = np.full((tokens.shape[0], n1 + tokens.shape[1]), -1, dtype=np.int64)
    if dead is not None:
        dead = np.asarray(dead, dtype=bool)
        c = np.where(dead, t.pad_id, c)
        idx = np.where(dead, np.arange(n1, n1 + tokens.shape[1]), -1)
        last[:, n1:] = np.maximum.accumulate(idx, axis=1)
    return np.concatenate([history, c], axis=1), last


def engram_hash(t: EngramTables, history: np.ndarray, tokens: np.ndarray,
                dead: np.ndarray | None = None) -> np.ndarray:
    """Row ids for each new position. history: compressed ids of the max_ngram-1 tokens before
    the chunk, oldest first, pad where the sequence had not started ([b, max_ngram-1]);
    tokens: raw ids [b, s]; dead: bool [b, s], positions no n-gram reaches into or across (an
    image span: every entry at or before the latest dead position reads as pad, so a dead
    position hashes the all-pad n-gram, as the released model). Returns int64
    [b, s, n_engram_layers, n_cols]."""
    seq, last = _alive_sequence(t, history, tokens, dead)  # (b, n-1+s)
    n1 = t.max_ngram - 1
    s = tokens.shape[1]
    cut = last[:, n1:]  # (b, s) latest dead index at or before each new position
    # lookback[..., k] = compressed id at p - k (pad at or before the latest dead position)
    look = np.stack([np.where(np.arange(n1 - k, n1 - k + s) > cut, seq[:, n1 - k : n1 - k + s],
                              t.pad_id) for k in range(t.max_ngram)], axis=-1)
    prod = look[:, :, None, :] * t.multipliers[None, None]  # (b, s, L, n)
    rolling = prod[..., 0]
    out = []
    for k in range(1, t.max_ngram):
        rolling = np.bitwise_xor(rolling, prod[..., k])
        out.append(rolling[..., None] % t.primes[None, None, :, k - 1])
    return np.concatenate(out, axis=-1) + t.offsets[None, None]


def engram_history_after(t: EngramTables, history: np.ndarray, tokens: np.ndarray,
                         dead: np.ndarray | None = None) -> np.ndarray:
    """The lookback the next chunk starts from (pad at or before the chunk's last dead
    position, so later chunks never reach back across an image span)."""
    seq, last = _alive_sequence(t, history, tokens, dead)
    seq = np.where(np.arange(seq.shape[1]) > last[:, -1:], seq, t.pad_id)
    return seq[:, -(t.max_ngram - 1) :]


def empty_history(t: EngramTables, batch: int) -> np.ndarray:
    return np.full((batch, t.max_ngram - 1), t.pad_id, dtype=np.int64)


def as_tensor(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids))
