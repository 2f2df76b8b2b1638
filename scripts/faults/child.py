"""Child process for killloop.py / race.py: an engine on STORE playing turns.

usage: python child.py STORE MODE SEED TURNS     (MODE: loop = exact turns until killed;
race = one CED turn; several engines may share the store)
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine

torch.set_num_threads(1)
store, mode, seed, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
CHECKPOINT = Path(os.environ.get("DSV41_FAULT_CHECKPOINT", Path(__file__).resolve()
                                  .parents[3] / "shared/conformance/shared-small/checkpoint"))
model = Model.from_checkpoint(str(CHECKPOINT))
e = Engine.from_model(model, weights_hash="w" * 64, page_tokens=8, store_dir=store,
                      exact=(mode == "loop"))
print("ready", flush=True)
rng = np.random.default_rng(seed)
s = e.session()
for t in range(turns):
    if len(s.transcript) + 40 > model.args.max_seq_len:
        s.close()
        s = e.session()
    ids = [int(x) for x in rng.integers(3, 500, 30 if not s.history else 6)]
    out = list(s.send(ids, max_new_tokens=3))
    tmp = store + "/transcript.json.tmp"
    with open(tmp, "w") as f:
        json.dump(s.transcript, f)
    os.replace(tmp, store + "/transcript.json")
    print(f"turn {t} {s.turns[-1].tier} {out}", flush=True)
e.close()
print("ok", flush=True)
