"""Child process for epd_chaos.py: one EPD stage worker (prefill or decode) on its own engine
over REDIS_URL, until SIGTERM (or SIGKILL: the chaos kills one mid-generation).

usage: python epd_worker.py ROLE REDIS_URL STORE [HEARTBEAT_S LEASE_TTL_S [DECODE_ROWS]]
Prints `ready CONSUMER` once it reads its stream.
"""
import os
import signal
import sys
import threading
from pathlib import Path

import redis
import torch

from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.serving.epd_prefill import PrefillWorker
from dsv41.runtime.serving.epd_stages import DecodeWorker

torch.set_num_threads(1)
role, url, store = sys.argv[1], sys.argv[2], sys.argv[3]
heartbeat_s, lease_ttl_s = (float(x) for x in (sys.argv[4:6] or (1.0, 5.0)))
decode_rows = int(sys.argv[6]) if len(sys.argv) > 6 else 16
SHARED = Path(os.environ.get("DSV41_SHARED") or Path(__file__).resolve().parents[3] / "shared")
CHECKPOINT = Path(os.environ.get("DSV41_FAULT_CHECKPOINT",
                                 SHARED / "conformance/shared-small/checkpoint"))
model = Model.from_checkpoint(str(CHECKPOINT))
engine = Engine.from_model(model, weights_hash="w" * 64, page_tokens=8, store_dir=store,
                           redis_url=url)
client = redis.Redis.from_url(url, socket_timeout=5.0)
kind = {"prefill": PrefillWorker, "decode": DecodeWorker}[role]
extra = {"max_running": decode_rows} if role == "decode" else {}
worker = kind(engine, client, heartbeat_s=heartbeat_s, lease_ttl_s=lease_ttl_s, **extra)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
worker.start()
print("ready", worker.consumer, flush=True)
done.wait()
worker.stop()
engine.close()
