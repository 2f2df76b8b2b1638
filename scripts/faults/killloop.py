"""kill -9 during a turn's writes, 20 rounds: a child plays exact-mode turns on one store (each
turn end writes prefix blocks and the state record: temp file, fsync, rename); the parent kills
it with SIGKILL (even rounds: the moment a writer's temp file appears, i.e. mid-write; odd
rounds: a random moment of a turn), then opens the store as the next process would and
checks that nothing partial is visible: no corrupt or truncated entry, every indexed entry reads
back whole (payload checksum), temp files of the killed writer removed by the scan, and the last
complete transcript resumes (exact: tier snapshot-ssd) without a crash.

usage: python killloop.py STORE [ROUNDS]
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine

torch.set_num_threads(1)
store, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20
here = Path(__file__).parent
CHECKPOINT = Path(os.environ.get("DSV41_FAULT_CHECKPOINT", Path(__file__).resolve()
                                  .parents[3] / "shared/conformance/shared-small/checkpoint"))
model = Model.from_checkpoint(str(CHECKPOINT))
random.seed(0)
summary = {"rounds": 0, "killed_mid_write": 0, "tmp_files_removed": 0, "resumed_tiers": {}}
for r in range(rounds):
    child = subprocess.Popen([sys.executable, str(here / "child.py"), str(store), "loop", str(r),
                              "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().startswith("ready"), child.stderr.read()
    first = child.stdout.readline()  # one turn done: the next is under way
    assert first.startswith("turn"), (first, child.stderr.read())
    # kill while a block or state record is being written: poll for the writer's temp file
    # (it lives from creation to rename, fsync included); half the rounds at a random moment
    deadline = time.time() + (random.uniform(0.0, 2.5) if r % 2 else 30.0)
    while time.time() < deadline and not (r % 2 == 0 and list(store.glob("*/.*.tmp"))):
        time.sleep(0.0005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    tmps = list(store.glob("*/.*.tmp"))
    summary["killed_mid_write"] += bool(tmps)
    summary["tmp_files_removed"] += len(tmps)
    e = Engine.from_model(model, weights_hash="w" * 64, page_tokens=8, store_dir=store,
                          exact=True)
    st = e.store.stats()
    assert (st.corrupt, st.truncated, st.foreign, st.read_errors) == (0, 0, 0, 0), st
    assert not list(store.glob("*/.*.tmp")), "the scan left a temp file"
    for key in list(e.store._index):
        assert e.store.get(key) is not None, f"entry {key} did not read back whole"
    transcript = json.loads((store / "transcript.json").read_text())
    s = e.session(transcript=transcript)
    out = list(s.send([5, 6], max_new_tokens=1))
    assert len(out) == 1
    tier = s.turns[-1].tier
    summary["resumed_tiers"][tier] = summary["resumed_tiers"].get(tier, 0) + 1
    e.close()
    summary["rounds"] += 1
    print(f"round {r}: killed after {first.split()[1]}+ turns, {len(tmps)} temp file(s) at the "
          f"kill, {st.entries} entries all whole, resumed tier {tier}", flush=True)
print(json.dumps(summary))
