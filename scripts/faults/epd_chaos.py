"""The EPD stages under faults, with load: CLIENTS concurrent streams (16 by default) through a
gateway over a real redis-server, one prefill and two decode worker processes, while

  - a prefill-stream entry is delivered twice (a copy added, as a redelivery gives it),
  - a reply event is delivered twice (a copy added to a running request's reply stream),
  - a decode worker that runs requests is killed (SIGKILL),
  - Redis is restarted (no persistence: streams, groups, leases, hand-offs gone).

Every request must end complete (its exact greedy tokens, checked against the single-process
batcher) and unduplicated, or with a clear error, within its timeout; none may hang. The workers
run the PyTorch graph, whose batched decode is not row-invariant (eager GEMMs and reductions
round differently with the batch's rows and capacity: a request's greedy tokens can change with
what it shares a batch with, in one process as in EPD), so the exact check decodes each request
in a batch of its own (`--decode-rows 1`, the default) against each request run alone; with
`--decode-rows N` the decode workers batch, and `wrong` also counts that variation. Prints one
JSON summary as its last line: completed, errored (reason -> count), duplicated (more tokens
than asked for), wrong (tokens that are not the reference's), hung, wall_s, faults.

usage: python epd_chaos.py WORK [--clients 16] [--max-tokens 32] [--timeout-s 120]
                            [--decode-rows 1]
"""
import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import redis
import torch

from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.epd import EpdKeys
from dsv41.runtime.serving.epd_gateway import EpdGateway
from dsv41.runtime.serving.frontend import FinishReason, QueueFull
from dsv41.runtime.tiers.redis_server import RedisServer

HEARTBEAT_S, LEASE_TTL_S = "0.2", "1.0"  # a dead worker's lease is gone within a second

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("work", type=Path)
p.add_argument("--clients", type=int, default=16)
p.add_argument("--max-tokens", type=int, default=32)
p.add_argument("--timeout-s", type=float, default=120.0)
p.add_argument("--decode-rows", type=int, default=1, help="a decode worker's batch (1: exact)")
args = p.parse_args()
logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
torch.set_num_threads(1)
here = Path(__file__).parent
SHARED = Path(os.environ.get("DSV41_SHARED") or here.resolve().parents[2] / "shared")
CHECKPOINT = Path(os.environ.get("DSV41_FAULT_CHECKPOINT",
                                 SHARED / "conformance/shared-small/checkpoint"))
t_start = time.monotonic()
args.work.mkdir(parents=True, exist_ok=True)
server = RedisServer.start(args.work / "redis")
roles = ("prefill", "decode", "decode")
children = [subprocess.Popen(
    [sys.executable, str(here / "epd_worker.py"), role, server.url, str(args.work / f"store-{i}"),
     HEARTBEAT_S, LEASE_TTL_S, str(args.decode_rows)], stdout=subprocess.PIPE, text=True,
    stderr=open(args.work / f"worker-{i}.log", "w"))
    for i, role in enumerate(roles)]
try:
    # the reference while the workers load: the single-process batcher's greedy tokens
    model = Model.from_checkpoint(str(CHECKPOINT))
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, 500, int(n))]
               for n in rng.integers(5, 40, args.clients)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with Engine.from_model(model, weights_hash="w" * 64, page_tokens=8,
                           store_dir=args.work / "ref") as e:
        fingerprint = e.key_salt.fingerprint()
        b = Batcher(e, max_running=args.decode_rows)
        streams = [b.submit(q, params) for q in prompts]
        while b.step():
            pass
        reference = [[ev.token_id for ev in s if ev.token_id is not None] for s in streams]
        b.stop()
    consumers = {}
    for child, role in zip(children, roles, strict=True):
        line = child.stdout.readline().split()
        assert line[:1] == ["ready"], f"a {role} worker did not start (see its log)"
        consumers[line[1]] = child
    client = redis.Redis.from_url(server.url, socket_timeout=5.0)
    keys = EpdKeys(fingerprint)
    gateway = EpdGateway(client, fingerprint, vocab_size=model.args.vocab_size,
                         max_seq_len=model.args.max_seq_len, max_queue=max(64, args.clients),
                         lease_check_s=0.2, lease_grace_s=1.0)

    results: list[dict] = [{} for _ in prompts]

    def ask(i: int) -> None:  # one streaming client: each event as it comes, until the deadline
        deadline = time.monotonic() + args.timeout_s
        out = results[i]
        out.update(tokens=[], finish=None, error=None)
        while True:
            try:
                stream = gateway.submit(prompts[i], params)
                break
            except QueueFull as err:
                if time.monotonic() > deadline:
                    out["error"] = str(err)
                    return
                time.sleep(0.1)
        while (left := deadline - time.monotonic()) > 0:
            ev = stream.get(timeout=left)
            if ev is None:
                break
            if ev.token_id is not None:
                out["tokens"].append(ev.token_id)
            if ev.finish is not None:
                out["finish"], out["error"] = ev.finish, ev.error
                out["s"] = round(time.monotonic() - deadline + args.timeout_s, 2)
                return
        stream.cancel()  # hung: no end within its timeout

    def wait_for(what, timeout_s: float = 60.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                got = what()
            except redis.RedisError:
                got = None
            if got:
                return got
            time.sleep(0.01)
        return None

    faults = {"redis_restarted": 0, "worker_killed": 0, "entries_redelivered": 0,
              "events_redelivered": 0}
    clients = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in clients:
        t.start()
    # a prefill entry delivered twice: a copy of a waiting one
    entry = wait_for(lambda: client.xrange(keys.prefill, count=1))
    if entry:
        client.xadd(keys.prefill, entry[0][1])
        faults["entries_redelivered"] += 1

    def some_reply():
        for k in client.scan_iter(f"{keys.base}:out:*"):
            got = client.xrange(k, count=1)
            if got:
                return k, got[0][1]
        return None

    event = wait_for(some_reply)  # a reply event delivered twice
    if event:
        client.xadd(*event)
        faults["events_redelivered"] += 1

    def busy_decoder():  # a decode worker that holds a request now
        leases = [v.decode() for v in client.mget(list(client.scan_iter(f"{keys.base}:lease:*")))
                  if v is not None]
        return next((c for c in leases if c.startswith("decode-") and c in consumers), None)

    victim = wait_for(busy_decoder)
    if victim:
        time.sleep(0.2)  # mid-generation
        consumers[victim].send_signal(signal.SIGKILL)
        consumers[victim].wait()
        faults["worker_killed"] += 1
    time.sleep(0.3)
    server.restart()
    faults["redis_restarted"] += 1
    for t in clients:
        t.join()
    gateway.close()

    def reason(text: str) -> str:
        return re.sub(r"\b(prefill|decode|vision)-[0-9a-f]{8}\b", r"\1-<id>", text)

    summary = {"clients": len(prompts), "max_tokens": args.max_tokens, "completed": 0,
               "errored": {}, "duplicated": 0, "wrong": 0, "hung": 0}
    for out, ref in zip(results, reference, strict=True):
        toks = out["tokens"]
        summary["duplicated"] += len(toks) > len(ref)
        summary["wrong"] += len(toks) <= len(ref) and toks != ref[:len(toks)]
        if out["finish"] is FinishReason.LENGTH and toks == ref:
            summary["completed"] += 1
        elif out["finish"] is not None or out["error"] is not None:
            why = reason(out["error"] or out["finish"].value)
            summary["errored"][why] = summary["errored"].get(why, 0) + 1
        else:
            summary["hung"] += 1
    summary["slowest_end_s"] = max((o.get("s", 0.0) for o in results), default=0.0)
    summary["wall_s"] = round(time.monotonic() - t_start, 2)
    summary["faults"] = faults
finally:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    server.stop()
print(json.dumps(summary))
