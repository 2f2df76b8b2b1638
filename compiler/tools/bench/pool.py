"""`dsv41 bench pool`: put / get of one encoder snapshot through the in-process DRAM pool and
through the Redis pool (runtime/redis_pool.py) on a server (`--redis-url`, or a redis-server
this command starts on a free local port in a temporary folder).

The snapshot is the preset's encoder snapshot at its exact byte count (`graph.layout.
encoder_snapshot`, what `dsv41 bill` prints): one FP8 ring (codes + scales as one uint8 array)
per encoder layer, the compressor tails (fp32) and the pointers (int64), random values so
nothing compresses. Each repetition puts the snapshot under a fresh key and gets it back;
medians are reported. The in-process pool copies the arrays on put and on get (private
read-only copies); the Redis pool encodes a checksummed record, sends it, and on get receives,
verifies and decodes it. JSON: `{"pool": {...}}`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsv41.compiler.tools.bench.measure import write_json
from dsv41.graph.config import preset as preset_args
from dsv41.graph.plan import build_plan
from dsv41.runtime.tiers.dram_pool import SnapshotPool
from dsv41.runtime.tiers.redis_pool import RedisSnapshotPool, masked_url
from dsv41.runtime.tiers.redis_server import RedisServer
from dsv41.runtime.tiers.wire import decode_record, encode_record


@dataclass(frozen=True)
class PoolBenchOptions:
    preset: str = "full"
    reps: int = 50
    redis_url: str | None = None  # None: start a local redis-server
    json: Path | None = None

    def validate(self) -> PoolBenchOptions:
        if not isinstance(self.reps, int) or self.reps < 1:
            raise ValueError(f"--reps must be at least 1, got {self.reps!r}.")
        return self


def snapshot_arrays_of(preset: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays laid out as the preset's encoder snapshot, its exact bytes in total."""
    # torch: graph.layout imports it, and `dsv41 --help` reads PoolBenchOptions without it
    from dsv41.graph.layout import encoder_snapshot

    snap = encoder_snapshot(build_plan(preset_args(preset)))
    rng = np.random.default_rng(seed)
    out = {f"ring.{layer}": rng.integers(0, 256, snap.ring_bytes, dtype=np.uint8)
           for layer in snap.ring_layers}
    out["tails"] = rng.standard_normal(snap.tail_bytes // 4).astype(np.float32)
    out["pointers"] = rng.integers(0, 1 << 40, snap.pointer_bytes // 8, dtype=np.int64)
    assert sum(a.nbytes for a in out.values()) == snap.total_bytes, "snapshot bytes drifted"
    return out


def _time_pool(pool, arrays: dict[str, np.ndarray], reps: int, tag: str) -> dict:
    puts, gets = [], []
    for i in range(reps + 1):  # the first is a warm-up (connection, allocator)
        key = f"bench-{tag}-{i}"
        t0 = time.perf_counter()
        ok = pool.put(key, arrays, {"rep": i})
        t1 = time.perf_counter()
        snap = pool.get(key)
        t2 = time.perf_counter()
        if not ok or snap is None:
            raise RuntimeError(f"The {tag} pool did not keep the benchmark's snapshot.")
        pool.drop(key)
        if i:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    nbytes = sum(a.nbytes for a in arrays.values())
    put_s, get_s = statistics.median(puts), statistics.median(gets)
    return {"put_s": put_s, "get_s": get_s, "put_MBps": nbytes / put_s / 1e6,
            "get_MBps": nbytes / get_s / 1e6, "put_per_s": 1 / put_s, "get_per_s": 1 / get_s,
            "put_p90_s": float(np.quantile(puts, 0.9)), "get_p90_s": float(np.quantile(gets, 0.9))}


def _time_codec(arrays: dict[str, np.ndarray], reps: int) -> dict:
    """The record codec alone (runtime/wire.py: the copy and the sha256 each way), so the
    Redis rows split into codec and server round trip."""
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        value = encode_record(kind="snapshot", key="k", fingerprint=bytes(32), created_at=0.0,
                              meta={}, arrays=arrays)
        t1 = time.perf_counter()
        decode_record(value, kind="snapshot", key="k", fingerprint=bytes(32))
        dec.append(time.perf_counter() - t1)
        enc.append(t1 - t0)
    return {"codec_encode_s": statistics.median(enc), "codec_decode_s": statistics.median(dec)}


def run_pool_bench(opts: PoolBenchOptions) -> dict:
    arrays = snapshot_arrays_of(opts.preset)
    nbytes = sum(a.nbytes for a in arrays.values())
    out = {"preset": opts.preset, "snapshot_bytes": nbytes, "arrays": len(arrays),
           "reps": opts.reps}
    out["in_process"] = _time_pool(SnapshotPool(budget_bytes=4 * nbytes, ttl_s=600.0), arrays,
                                   opts.reps, "in-process")
    with tempfile.TemporaryDirectory(prefix="dsv41-pool-bench-") as tmp:
        server = None
        url = opts.redis_url
        if url is None:
            server = RedisServer.start(Path(tmp) / "redis")
            url = server.url
        try:
            pool = RedisSnapshotPool(url, fingerprint=bytes(32), budget_bytes=None, ttl_s=600.0)
            out["redis"] = _time_pool(pool, arrays, opts.reps, "redis")
            out["redis"].update(_time_codec(arrays, opts.reps))
            out["redis"]["url"] = masked_url(url)
            out["redis"]["server_version"] = _server_version(url)
            out["redis"]["started_here"] = server is not None
            pool.close()
        finally:
            if server is not None:
                server.stop()
    return out


def _server_version(url: str) -> str:
    import redis  # optional: only the Redis rows need the client

    r = redis.Redis.from_url(url)
    try:
        return str(r.info("server")["redis_version"])
    finally:
        r.close()


def run_command(opts: PoolBenchOptions) -> int:
    """`dsv41 bench pool`: the rows printed, {"pool": ...} written to the JSON."""
    opts.validate()
    print(f"bench pool: preset={opts.preset} reps={opts.reps} redis_url={opts.redis_url}")
    r = run_pool_bench(opts)
    print(f"snapshot: {r['snapshot_bytes']:,} bytes in {r['arrays']} arrays ({opts.preset})")
    for name in ("in_process", "redis"):
        t = r[name]
        print(f"{name:>10}: put {t['put_s'] * 1e3:.3f} ms ({t['put_MBps']:.0f} MB/s, "
              f"{t['put_per_s']:.0f}/s)  get {t['get_s'] * 1e3:.3f} ms ({t['get_MBps']:.0f} "
              f"MB/s, {t['get_per_s']:.0f}/s)")
    print(f"     codec: encode {r['redis']['codec_encode_s'] * 1e3:.3f} ms, decode "
          f"{r['redis']['codec_decode_s'] * 1e3:.3f} ms (inside the Redis rows)")
    print(f"summary: Redis put {r['redis']['put_s'] / r['in_process']['put_s']:.1f}x, get "
          f"{r['redis']['get_s'] / r['in_process']['get_s']:.1f}x the in-process pool's time")
    if opts.json:
        write_json(opts.json, {"pool": r})
        print(f"json: {opts.json}")
    return 0
