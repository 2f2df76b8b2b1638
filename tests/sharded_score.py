"""Scores a case through a sharded artifact on disco workers, in a process of its own (disco
needs TVM's runtime libraries loaded globally before anything imports tvm, which pytest's
process has done): `python tests/sharded_score.py ARTIFACT CASE_DIR OUT.npz`. Writes the
teacher-forced logits and selections (`ScoreResult.to_npz`)."""

from __future__ import annotations

import sys

from dsv41.runtime.backends.disco import load_disco

load_disco()  # first: before anything below imports tvm

from dsv41.graph.conformance import load_case  # noqa: E402
from dsv41.graph.engram import load_token_map  # noqa: E402
from dsv41.graph.model import Model  # noqa: E402
from dsv41.graph.score import GraphBackend, score  # noqa: E402
from dsv41.runtime.backends.compiled import CompiledPhases  # noqa: E402
from dsv41.runtime.backends.sharded import ShardedArtifact  # noqa: E402


def main(artifact: str, case_dir: str, out: str) -> None:
    case = load_case(case_dir)
    art = ShardedArtifact.open(artifact, case.checkpoint)
    try:
        host = Model.host_half(art.args, load_token_map(art.args, case.checkpoint)
                               if art.args.engram_layer_ids else None)
        backend = GraphBackend(host, phases=CompiledPhases(art, host), capacity=256)
        result = score(backend, case.tokens, prefill=case.prefill)
        result.to_npz(out, case.tokens)
        print(f"scored {len(case.tokens)} tokens on {art.shards} workers")
    finally:
        art.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
