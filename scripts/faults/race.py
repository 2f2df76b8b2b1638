"""Two processes race for one store folder, 20 rounds: both load the model, then open an engine
on the same folder at about the same moment and play a turn. Several owners per folder: both
open it and finish; never a traceback, never a corrupt or partial entry (checked by opening the
store after each round).

usage: python race.py STORE [ROUNDS]
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine

store, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20
here = Path(__file__).parent
CHECKPOINT = Path(os.environ.get("DSV41_FAULT_CHECKPOINT", Path(__file__).resolve()
                                  .parents[3] / "shared/conformance/shared-small/checkpoint"))
model = Model.from_checkpoint(str(CHECKPOINT))
outcomes: dict[str, int] = {}
for r in range(rounds):
    kids = [subprocess.Popen([sys.executable, str(here / "child.py"), str(store), "race",
                              str(10 * r + k), "2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for k in range(2)]
    res = [(k.wait(), *k.communicate()) for k in kids]
    for rc, out, err in res:
        assert rc == 0 and "Traceback" not in err, (rc, out, err[-2000:])
    key = "+".join(sorted("ok" for rc, _, _ in res))
    outcomes[key] = outcomes.get(key, 0) + 1
    with Engine.from_model(model, weights_hash="w" * 64, page_tokens=8,
                           store_dir=store) as e:  # the children's salt: their entries
        st = e.store.stats()
        assert (st.corrupt, st.truncated, st.foreign, st.read_errors) == (0, 0, 0, 0), st
        assert all(e.store.get(k) is not None for k in list(e.store._index)
                   if e.store.contains(k))
    assert not list(store.glob("*/.*.tmp"))
    print(f"round {r}: {key}; store {st.entries} entries, all whole", flush=True)
print(json.dumps(outcomes))
