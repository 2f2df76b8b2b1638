"""Runs engine turns on a sharded artifact's disco workers, in a process of its own (disco needs
TVM's runtime libraries loaded globally before anything imports tvm, which pytest's process has
done): `python tests/sharded_engine.py ARTIFACT CHECKPOINT STORE TURNS_JSON OUT.npz`.

Three engines of the same options (exact, pages of PAGE positions, 4 greedy tokens a turn):
`live` runs every turn on one session (no store), the later ones on its live cache; `stored`
runs the first two turns with an SSD store and closes; `resumed`, a new engine on that store,
resumes the transcript and runs the third turn from the store. Writes each run's tokens and
greedy logits, and the logits of `resident_steps`; prints the tiers, the live engine's traffic
per entry over its turns (`ShardedArtifact.traffic`) and the bytes each resident step sent."""

from __future__ import annotations

import json
import sys

from dsv41.runtime.backends.disco import load_disco

load_disco()  # first: before anything below imports tvm

import copy  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dsv41.graph.entries import cache_tensors, load_cache_tensors  # noqa: E402
from dsv41.runtime.backends.artifact import ArtifactError  # noqa: E402
from dsv41.runtime.engine import Engine  # noqa: E402

PAGE = 8
NEW_TOKENS = 4


def run_turns(engine: Engine, session, turns) -> dict:
    tokens, logits, tiers = [], [], []
    for ids in turns:
        tokens.append(list(session.send(ids, max_new_tokens=NEW_TOKENS, keep_logits=True)))
        logits.append(np.stack(session.turns[-1].logits))
        tiers.append(str(session.turns[-1].tier))
    return {"tokens": tokens, "logits": logits, "tiers": tiers}


def resident_steps(e: Engine, session) -> tuple[dict, dict]:
    """Decode steps on the live session's cache, whose tensors the workers hold, against the
    same steps on deep copies of it (new tensors: sent whole). `same`: the resident step;
    `lent`: a step on the tensors the resident step lent to the workers (their buffers updated
    in place: sent again); `changed`: a step after one of the cache's tensors changed in place
    on the host (sent again), `unchanged` the step without that change. Returns the logits by
    case, and the bytes each step sent to the workers (with the sizes of the whole cache and of
    the changed tensor)."""
    phases, model, cache, art = e.phases, e.model, session.cache, e.phases.art
    e.reserve(cache, int(cache.pos.max()) + 3)  # grown (new tensors) before the steps
    tok = torch.tensor([[session.transcript[-1]]])
    logits, sent = {}, {}

    def step(name: str, c) -> None:
        before = art.traffic()["decode"]["sent_bytes"]
        logits[name] = phases.decode_step(model, c, tok).logits.numpy()
        sent[name] = art.traffic()["decode"]["sent_bytes"] - before

    step("first", cache)  # the grown tensors sent; its outputs stay on the workers
    fresh, lent = copy.deepcopy(cache), copy.deepcopy(cache)
    load_cache_tensors(lent, cache_tensors(cache))  # the very tensors the workers hold
    sizes = {"cache": sum(t.nbytes for t in cache_tensors(cache)),
             "ring": next(iter(cache.windows.values())).codes.nbytes}
    step("same.resident", cache)
    step("same.sent", fresh)
    step("lent.resident", lent)
    unchanged, changed = copy.deepcopy(cache), copy.deepcopy(cache)
    ring = next(iter(cache.windows.values()))
    ring.codes.add_(1)  # on the host, in place: the workers' copy is stale
    next(iter(changed.windows.values())).codes.add_(1)
    step("changed.resident", cache)
    step("changed.sent", changed)
    step("unchanged.sent", unchanged)
    return logits, {**sent, **sizes}


def main(artifact: str, checkpoint: str, store: str, turns_json: str, out: str) -> None:
    turns = json.loads(turns_json)
    opts = {"exact": True, "page_tokens": PAGE, "shards": 2}
    with Engine.load(artifact, checkpoint, **opts) as e:
        s = e.session()
        live = run_turns(e, s, turns)
        traffic = e.phases.art.traffic()
        steps, step_bytes = resident_steps(e, s)
        art = e.phases.art
    try:  # the engine's close ended its workers
        art.call("decode", ())
        closed = "ran"
    except ArtifactError as err:
        closed = str(err)
    with Engine.load(artifact, checkpoint, store_dir=store, **opts) as e:
        s = e.session()
        stored = run_turns(e, s, turns[:2])
        transcript = s.transcript
    with Engine.load(artifact, checkpoint, store_dir=store, **opts) as e:
        resumed = run_turns(e, e.session(transcript=transcript), turns[2:])
    arrays = {}
    for name, run in (("live", live), ("stored", stored), ("resumed", resumed)):
        for k, (toks, lg) in enumerate(zip(run["tokens"], run["logits"], strict=True)):
            arrays[f"{name}.{k}.tokens"] = np.array(toks)
            arrays[f"{name}.{k}.logits"] = lg
    arrays.update({f"step.{k}": v for k, v in steps.items()})
    np.savez(out, **arrays)
    print(json.dumps({"tiers": {"live": live["tiers"], "stored": stored["tiers"],
                                "resumed": resumed["tiers"]}, "traffic": traffic,
                      "step_bytes": step_bytes, "after_close": closed}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
