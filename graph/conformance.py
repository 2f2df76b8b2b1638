"""Conformance against the released reference's outputs (`shared/conformance/<case>`).

Metrics and acceptance rule exactly as the pack's README: teacher-forced rows (the P prompt rows
of one prefill, then the K decode rows), compared with the golden; conformant when every metric
is within `case.json["noise_floor"]["acceptance"]["bounds"]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.score import ScoreResult


@dataclass
class Case:
    name: str
    root: Path
    golden: dict[str, np.ndarray]
    info: dict

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.golden["prompt_ids"], self.golden["decode_input_tokens"]])

    @property
    def prefill(self) -> int:
        return len(self.golden["prompt_ids"])

    @property
    def bounds(self) -> dict:
        return self.info["noise_floor"]["acceptance"]["bounds"]

    @property
    def noise_worst(self) -> dict:
        """The reference's own worst spread: its teacher-forced reruns with only the GEMM
        summation order changed (other thread counts, reversed and shuffled contractions),
        elementwise worst over them (`case.json["noise_floor"]["worst"]`)."""
        return self.info["noise_floor"]["worst"]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(int(k.rsplit("L", 1)[1]) for k in self.golden if
                     k.startswith("hidden_after_L"))


def golden_arithmetic_here() -> bool:
    """Whether torch's CPU GEMMs on this machine sum in the goldens' order, so that the graph can
    reproduce them bit for bit. The goldens were computed with torch 2.13 on CPU, 2 threads
    (`case.json["thread_sensitivity"]`: bit-reproducible only with that count, since MKL's fp32
    GEMM order depends on it); the graph matched them bit for bit on an Intel CPU with AVX-512
    (hidden states before the first indexer, the small case's selections and logits). On a CPU
    without AVX-512 (AMD Zen 3: torch's capability AVX2) MKL and oneDNN run other kernels, whose
    last bits differ: there the graph is as close as the reference's own reruns
    (`within_noise_floor`), e.g. shared-v41-small's hidden state after block 0 at rel L2
    2.1e-4 against the reruns' 3.9e-4."""

    intel = "GenuineIntel" in _cpuinfo()
    return intel and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def within_noise_floor(case: Case, m: dict, *, hidden: tuple[str, ...] = ()) -> list[str]:
    """The metrics of `evaluate` against the reference's own worst spread (`Case.noise_worst`,
    factor 1 where the acceptance bounds allow 2): what a machine whose GEMMs sum in another
    order (see `golden_arithmetic_here`) must still meet. Only the hidden states named in
    `hidden` are checked (the later blocks follow selection flips, which the floor's few
    reruns do not bound elementwise)."""
    w = case.noise_worst
    bounds = {k: w[k] for k in ("rel_l2_max", "rel_l2_p90", "rel_l2_median", "kl_mean", "kl_max")}
    bounds |= {f"{k}_min": w[k] for k in ("top1_agreement", "top1_agreement_confident")}
    bounds["index_jaccard_mean_min"] = dict(w["index_jaccard_mean"])
    bounds["hidden_states_rel_l2_max"] = {k: w["hidden_states"][k]["rel_l2_max"] for k in hidden}
    bounds["hidden_states_rel_l2_median"] = {k: w["hidden_states"][k]["rel_l2_median"]
                                             for k in hidden}
    return _failures(m, bounds)


def load_case(root: str | Path) -> Case:
    root = Path(root)
    g = np.load(root / "golden.npz")
    return Case(root.name, root, {k: g[k] for k in g.files},
                json.loads((root / "case.json").read_text()))


def _rel_l2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def _kl(golden: np.ndarray, mine: np.ndarray) -> np.ndarray:
    def logsm(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lg, lm = logsm(golden), logsm(mine)
    return (np.exp(lg) * (lg - lm)).sum(-1)


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    out = []
    for ra, rb in zip(a, b, strict=True):
        sa, sb = set(ra[ra >= 0].tolist()), set(rb[rb >= 0].tolist())
        out.append(1.0 if not sa and not sb else len(sa & sb) / len(sa | sb))
    return float(np.mean(out))


@dataclass
class Report:
    metrics: dict
    failures: list[str] = field(default_factory=list)

    @property
    def conformant(self) -> bool:
        return not self.failures


def evaluate(case: Case, result: ScoreResult) -> Report:
    """Every metric of the README, checked against the precomputed bounds."""
    g = case.golden
    golden = np.concatenate([g["prompt_logits_all"], g["decode_logits"]])
    mine = result.logits
    rows = np.isfinite(mine).all(-1)
    rel, kl = _rel_l2(mine[rows], golden[rows]), _kl(golden[rows], mine[rows])
    top_g, top_m = golden[rows].argmax(-1), mine[rows].argmax(-1)
    srt = np.sort(golden[rows], -1)
    confident = (srt[:, -1] - srt[:, -2]) > 0.1
    m = {
        "rows": int(rows.sum()),
        "rel_l2_max": float(rel.max()), "rel_l2_p90": float(np.percentile(rel, 90)),
        "rel_l2_median": float(np.median(rel)),
        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
        "top1_agreement": float((top_g == top_m).mean()),
        "top1_agreement_confident": float((top_g == top_m)[confident].mean()),
        "index_jaccard_mean": {}, "hidden_states": {},
    }
    for key in case.bounds["index_jaccard_mean_min"]:
        if key.startswith("cand_blocks_L"):
            c = key.split("L")[1]
            gk, mk = (f"cand_blocks_prefill_L{c}", f"cand_blocks_decode_L{c}"), (
                "cand_blocks_prefill", "cand_blocks_decode")
        else:
            gk, mk = (f"idx_prefill_{key}", f"idx_decode_{key}"), (f"idx_prefill_{key}",
                                                                   f"idx_decode_{key}")
        if all(k in result.selections for k in mk):
            # CED replays only the last window of the prompt: compare the rows it has
            n_pre = min(len(result.selections[mk[0]]), len(g[gk[0]]))
            ga = np.concatenate([g[gk[0]][-n_pre:], g[gk[1]]])
            ma = np.concatenate([result.selections[k] for k in mk])
            m["index_jaccard_mean"][key] = _jaccard(ga, ma)
    for key in case.bounds.get("hidden_states_rel_l2_max", {}):
        if key not in g:  # a golden `against` another engine holds no hidden states
            continue
        p = len(g[key])  # the prompt's rows (vision: the patches or aligned tokens)
        if key in result.hidden and len(result.hidden[key]) == p:  # CED: replay rows only
            e = _rel_l2(result.hidden[key].reshape(p, -1), g[key].reshape(p, -1))
            m["hidden_states"][key] = {"rel_l2_max": float(e.max()),
                                       "rel_l2_median": float(np.median(e))}
    return Report(m, _failures(m, case.bounds))


def against(case: Case, reference: ScoreResult) -> Case:
    """The case with another engine's teacher-forced outputs as its golden (e.g. the graph's,
    to hold a compiled artifact to the graph with the same metrics and bounds). Hidden states
    are left out."""
    p = case.prefill
    g = {k: v for k, v in case.golden.items() if not k.startswith("hidden_after_L")
         and k != "final_hidden"}
    g["prompt_logits_all"], g["decode_logits"] = reference.logits[:p], reference.logits[p:]
    for key, sel in reference.selections.items():
        if key.startswith("cand_blocks_"):
            for gk in [k for k in g if k.startswith(key + "_L")]:
                g[gk] = sel
        else:
            g[key] = sel
    return Case(f"{case.name} (against another engine)", case.root, g, case.info)


def _failures(m: dict, b: dict) -> list[str]:
    out = []
    for k in ("rel_l2_max", "rel_l2_p90", "rel_l2_median", "kl_mean", "kl_max"):
        if not m[k] <= b[k]:
            out.append(f"{k} {m[k]:.6g} > {b[k]:.6g}")
    for k in ("top1_agreement", "top1_agreement_confident"):
        if not m[k] >= b[f"{k}_min"]:
            out.append(f"{k} {m[k]:.6g} < {b[f'{k}_min']:.6g}")
    for k, lim in b["index_jaccard_mean_min"].items():
        v = m["index_jaccard_mean"].get(k)
        if v is None or not v >= lim:
            out.append(f"index jaccard {k} {v} < {lim:.6g}")
    for k, lim in b.get("hidden_states_rel_l2_max", {}).items():
        h = m["hidden_states"].get(k)
        if h is None:
            continue
        if not h["rel_l2_max"] <= lim:
            out.append(f"{k} max {h['rel_l2_max']:.6g} > {lim:.6g}")
        med = b["hidden_states_rel_l2_median"][k]
        if not h["rel_l2_median"] <= med:
            out.append(f"{k} median {h['rel_l2_median']:.6g} > {med:.6g}")
    return out
