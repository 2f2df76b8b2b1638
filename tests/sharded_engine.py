"""Runs engine turns on a sharded artifact's disco workers, in a process of its own (disco needs
TVM's runtime libraries loaded globally before anything imports tvm, which pytest's process has
done): `python tests/sharded_engine.py ARTIFACT CHECKPOINT STORE TURNS_JSON OUT.npz`.

Three engines of the same options (exact, pages of PAGE positions, 4 greedy tokens a turn):
`live` runs every turn on one session (no store), the later ones on its live cache; `stored`
runs the first two turns with an SSD store and closes; `resumed`, a new engine on that store,
resumes the transcript and runs the third turn from the store. Writes each run's tokens and
greedy logits; prints the tiers and the live engine's traffic per entry
(`ShardedArtifact.traffic`)."""

from __future__ import annotations

import json
import sys

from dsv41.runtime.disco import load_disco

load_disco()  # first: before anything below imports tvm

import numpy as np  # noqa: E402

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


def main(artifact: str, checkpoint: str, store: str, turns_json: str, out: str) -> None:
    turns = json.loads(turns_json)
    opts = {"exact": True, "page_tokens": PAGE, "shards": 2}
    with Engine.load(artifact, checkpoint, **opts) as e:
        live = run_turns(e, e.session(), turns)
        traffic = e.phases.art.traffic()
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
    np.savez(out, **arrays)
    print(json.dumps({"tiers": {"live": live["tiers"], "stored": stored["tiers"],
                                "resumed": resumed["tiers"]}, "traffic": traffic}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
