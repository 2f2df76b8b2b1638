"""A long prompt arriving while streams decode, under the continuous batcher: the running
streams' worst per-token gap during its prefill vs their median gap and vs one prefill chunk.

    python scripts/batcher_stall.py --artifact ART_DIR --checkpoint CKPT [--long 896] \\
        [--chunk 128] [--streams 8] [--json out.json]

The measuring is `runtime.serving.stall.measure_long_prompt_stall` (what `dsv41 bench serve` calls).
Without --artifact the PyTorch graph of the checkpoint runs (slow on a CPU)."""

from __future__ import annotations

import argparse
import json

from dsv41.graph.checkpoint import weights_fingerprint
from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.serving.stall import measure_long_prompt_stall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default=None)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--long", type=int, default=896)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.artifact:
        engine = Engine.load(args.artifact, args.checkpoint)
        backend = f"artifact {args.artifact}"
    else:
        engine = Engine.from_model(Model.from_checkpoint(args.checkpoint),
                                   weights_hash=weights_fingerprint(args.checkpoint))
        backend = "PyTorch graph"
    print(f"backend: {backend}; {args.streams} streams, a {args.long}-token prompt in chunks of "
          f"{args.chunk}")
    report = measure_long_prompt_stall(engine, streams=args.streams, long_prompt=args.long,
                                       chunk_tokens=args.chunk,
                                       stream_tokens=args.stream_tokens)
    out = {"backend": backend, **report.to_dict()}
    for k, v in out.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"summary: worst gap {report.worst_gap_s * 1e3:.1f} ms = "
          f"{report.worst_gap_s / report.median_gap_s:.1f}x the median gap "
          f"({report.median_gap_s * 1e3:.1f} ms), "
          f"{report.worst_gap_s / report.chunk_s:.2f}x one chunk ({report.chunk_s * 1e3:.1f} ms); "
          f"extra stall {report.extra_stall_s * 1e3:.1f} ms vs the last piece (decoder "
          f"replay + join) {report.last_piece_s * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    engine.close()


if __name__ == "__main__":
    main()
