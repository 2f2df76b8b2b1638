"""The phase functions over a compiled artifact: the host half of each phase (validation, Engram
hashing, RoPE tables, capacity) from `dsv41.graph.phases`, the graph half from the artifact's
entries. Same signatures and results as the graph's phases, so the two can be compared anywhere.
"""

from __future__ import annotations

import torch

from dsv41.compiler.capture import entry_inputs, load_cache_tensors, selection_keys
from dsv41.graph.cache import ModelCache, restore_local_state, save_local_state
from dsv41.graph.dspark import Draft
from dsv41.graph.model import Model
from dsv41.graph.phases import PhaseResult, _chunk, check_tokens, prepare_replay, resume_tail

from .artifact import Artifact
from .threads import default_tvm_pool


class CompiledPhases:
    def __init__(self, artifact: Artifact, model: Model, *, threads: int | None = None):
        """threads: TVM's CPU pool size (None: TVM_NUM_THREADS if set, else torch's thread
        count; TVM alone would take half the hardware threads)."""
        default_tvm_pool(threads)
        artifact.bind(model)
        self.art, self.model = artifact, model
        self.plan = model.plan

    def _check_inputs(self, entry: str, cache: ModelCache, inputs) -> None:
        """Every id and position that reaches a compiled gather is checked here (TVM's gathers
        do not bound-check)."""
        from dsv41.graph.cache import capacity_tokens

        x, start, floor, hash_ids = inputs[0], inputs[1], inputs[2], inputs[7]
        a = self.model.args
        if entry == "draft":
            if int(x.min()) < 0 or int(x.max()) >= a.vocab_size:
                raise ValueError("Draft token id out of range.")
            s = a.dspark_block_size
        else:
            s = (x[0] if isinstance(x, tuple) else x).size(1)
        if int(start.min()) < 0 or int((floor > start).sum()) or int(floor.min()) < 0:
            raise ValueError(f"Bad positions: start {start.tolist()}, floor {floor.tolist()}.")
        if entry != "draft" and int(start.max()) + s > capacity_tokens(cache):
            raise ValueError(f"Positions up to {int(start.max()) + s} exceed the cache capacity "
                             f"of {capacity_tokens(cache)} tokens.")
        bounds = self.art.manifest["entries"][entry].get("static_bounds")
        if bounds is not None:
            if start.size(0) > bounds["batch"]:
                raise ValueError(f"The {entry} entry is planned for batches of up to "
                                 f"{bounds['batch']} sequences; got {start.size(0)}.")
            if capacity_tokens(cache) > bounds["context_tokens"] and cache.stores:
                raise ValueError(f"The {entry} entry is planned for caches of up to "
                                 f"{bounds['context_tokens']} tokens; this cache holds "
                                 f"{capacity_tokens(cache)}.")
        if hash_ids.numel():
            for slot, layer in enumerate(a.engram_layer_ids):
                rows = self.model.p(layer, "engram.embed.weight").size(0)
                ids = hash_ids[:, :, slot]
                if int(ids.min()) < 0 or int(ids.max()) >= rows:
                    raise ValueError(f"Engram ids of layer {layer} outside its {rows} rows.")

    def _run(self, entry: str, cache: ModelCache, x, **kw) -> dict[str, torch.Tensor]:
        inputs = entry_inputs(self.model, cache, entry, x, **kw)
        self._check_inputs(entry, cache, inputs)
        out = self.art.call(entry, inputs)
        names = self.art.manifest["entries"][entry]["outputs"]
        named = dict(zip(names, out, strict=True))
        if entry != "draft":
            load_cache_tensors(cache, [named[n] for n in self.art.manifest["entries"][entry]
                                       ["cache"]])
        return named

    def _work(self, layers, n: int) -> dict[int, int]:
        return {lay: n for lay in layers}

    def _check(self, model: Model) -> None:
        if model is not self.model:
            raise ValueError("These compiled phases are bound to another model's weights.")

    def prefill_exact(self, model: Model, cache: ModelCache, tokens, *,
                      all_logits: bool = False, record=()) -> PhaseResult:
        del record  # hidden states are a graph-only diagnostic
        self._check(model)
        tokens = check_tokens(self.model, tokens)
        chunk = _chunk(self.model, cache, tokens)
        entry = "prefill_all" if all_logits else "prefill"
        if entry not in self.art.entries and "prefill_all" in self.art.entries:
            entry = "prefill_all"  # the same graph, with every position's logits
        if tokens.size(1) == 1 and not all_logits and "decode" in self.art.entries:
            entry = "decode"
        named = self._run(entry, cache, tokens, start=chunk.start, hash_ids=chunk.hash_ids,
                          rope=chunk.rope)
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

    def _encode(self, cache: ModelCache, tokens, *, replay_from=None):
        entry = "encoder" if replay_from is None else "encoder_replay"
        floor = replay_from
        start = replay_from if entry == "encoder_replay" else None
        chunk = _chunk(self.model, cache, tokens, start=start, floor=floor)
        named = self._run(entry, cache, tokens, start=chunk.start, floor=chunk.floor,
                          hash_ids=chunk.hash_ids, rope=chunk.rope)
        return named["h"], named["pre"], chunk

    def _decode_replay(self, cache: ModelCache, h, pre, ids, start, all_logits: bool):
        n = min(h.size(1), self.model.args.window_size)
        first = start + h.size(1) - n
        named = self._run("decoder", cache, (h[:, -n:], pre[:, -n:]), start=first, floor=first,
                          hash_ids=None if ids is None else ids[:, -n:])
        logits = named["logits"] if all_logits else named["logits"][:, -1:]
        return logits, n

    def ced_prefill(self, model: Model, cache: ModelCache, tokens, *,
                    all_logits: bool = False, record=()) -> PhaseResult:
        del record
        self._check(model)
        tokens = check_tokens(self.model, tokens)
        h, pre, chunk = self._encode(cache, tokens)
        cache.pos = chunk.end
        logits, n = self._decode_replay(cache, h, pre, chunk.hash_ids, chunk.start, all_logits)
        d = self.plan.decoder_start
        work = {**self._work(range(d), tokens.size(1)),
                **self._work(range(d, self.model.args.n_layers), n)}
        return PhaseResult(logits, work)

    def replay_prefill(self, model: Model, cache: ModelCache, prefix, suffix, *,
                       all_logits: bool = False) -> PhaseResult:
        """Snapshot miss: encoder bounded replay, then decoder bounded replay."""
        self._check(model)
        m = self.model
        prefix, suffix = check_tokens(m, prefix), check_tokens(m, suffix)
        n, first = prepare_replay(m, cache, prefix)
        h1, p1, c1 = self._encode(cache, prefix[:, -n:], replay_from=first)
        chunk = _chunk(m, cache, suffix, floor=first)
        named = self._run("encoder", cache, suffix, start=chunk.start, floor=chunk.floor,
                          hash_ids=chunk.hash_ids, rope=chunk.rope)
        cache.pos = chunk.end
        h, pre = torch.cat([h1, named["h"]], 1), torch.cat([p1, named["pre"]], 1)
        ids = None if chunk.hash_ids is None else torch.cat([c1.hash_ids, chunk.hash_ids], 1)
        logits, nd = self._decode_replay(cache, h, pre, ids, first, all_logits)
        d = self.plan.decoder_start
        work = {**self._work(range(d), h.size(1)),
                **self._work(range(d, m.args.n_layers), nd)}
        return PhaseResult(logits, work)

    def resume_prefill(self, model: Model, cache: ModelCache, cached, fresh, *,
                       all_logits: bool = False) -> PhaseResult:
        """Decoder bounded replay on a continued cache (`phases.resume_prefill`): the tail of
        cached tokens through the `encoder_replay` entry with the cache's local state put back
        afterwards, the new tokens through `encoder`, then the decoder over both."""
        self._check(model)
        m = self.model
        cached, fresh = check_tokens(m, cached), check_tokens(m, fresh)
        t = resume_tail(m, cache, fresh.size(1))
        if t == 0:
            return self.ced_prefill(model, cache, fresh, all_logits=all_logits)
        saved = save_local_state(cache)
        try:
            n, first = prepare_replay(m, cache, cached, replay=t)
            h1, p1, c1 = self._encode(cache, cached[:, -n:], replay_from=first)
        finally:
            restore_local_state(cache, saved)
        h2, p2, c2 = self._encode(cache, fresh)
        cache.pos = c2.end
        h, pre = torch.cat([h1, h2], 1), torch.cat([p1, p2], 1)
        ids = None if c2.hash_ids is None else torch.cat([c1.hash_ids, c2.hash_ids], 1)
        logits, nd = self._decode_replay(cache, h, pre, ids, first, all_logits)
        d = self.plan.decoder_start
        work = {**self._work(range(d), h.size(1)),
                **self._work(range(d, m.args.n_layers), nd)}
        return PhaseResult(logits, work)
