"""The routed experts as a module and its call plan (buffers, calls), the Relax emitter and
example inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import tvm
from tvm import relax

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.gemm import BLOCK
from dsv41.schedules.moe.avx512_gemv import make_moe_down_gemv_avx512, make_moe_gate_up_gemv_avx512
from dsv41.schedules.moe.avx512_rows import make_moe_down_rows_avx512, make_moe_gate_up_rows_avx512
from dsv41.schedules.moe.configs import (
    MoeSplitConfig,
    moe_split_config,
    schedule_moe_combine,
    schedule_moe_gemm,
    schedule_moe_gemv,
    schedule_moe_qdq,
    schedule_moe_route,
)
from dsv41.schedules.moe.experts import (
    make_moe_down,
    make_moe_down_gemv,
    make_moe_gate_up,
    make_moe_gate_up_gemv,
)
from dsv41.schedules.moe.route import (
    check_dims,
    make_moe_combine,
    make_moe_qdq,
    make_moe_route,
    num_tiles,
)
from dsv41.schedules.moe.tiles_pair import fused_tiles_funcs
from dsv41.schedules.router import TopkRouting

# ---- the module and its call plan ------------------------------------------------------------


@dataclass(frozen=True)
class MoeBuffer:
    """One tensor of the chain: an op input, an intermediate the caller allocates, or y."""

    name: str
    shape: tuple  # ints or int64 PrimExprs of the token count n
    dtype: str


@dataclass(frozen=True)
class MoeCall:
    """One call_tir: `func` (a global symbol of the module) reads `args`, writes `outs`."""

    func: str
    args: tuple[str, ...]
    outs: tuple[str, ...]


@dataclass(frozen=True)
class MoePlan:
    """What the compiler needs to emit the chain: the op's inputs (the torch op's order), the
    intermediates to allocate, the final output `y`, and the calls in order."""

    inputs: tuple[MoeBuffer, ...]
    intermediates: tuple[MoeBuffer, ...]
    output: MoeBuffer
    calls: tuple[MoeCall, ...]

    def buffers(self) -> dict[str, MoeBuffer]:
        return {b.name: b for b in (*self.inputs, *self.intermediates, self.output)}


def fused_decode(config: MoeSplitConfig) -> bool:
    """Whether the chain is the two-call decode form: the hand-vectorised GEMVs
    (`moe_gate_up_route`: route, QDQ and gate/up; `moe_down_combine(_plus)`: QDQ, down and
    combine), each bit for bit the three kernels it replaces."""
    return config.kind == "gemv" and config.hand and not config.rows


def fused_tiles(config: MoeSplitConfig, target: TargetSpec) -> bool:
    """Whether the chain is the two-call prefill form: the CPU tile kernels' stages in
    `moe_gate_up_route` and `moe_down_combine(_plus)` (`tiles_pair`), bit for bit the six
    calls; CUDA keeps the six, its kernels cannot allocate the token-sized buffers."""
    return config.kind == "tiles" and not target.is_cuda


def fused_chain(config: MoeSplitConfig, target: TargetSpec) -> bool:
    """Whether `moe_experts_plan(fuse=True)` emits the chain as two calls (`fused_decode`,
    `fused_tiles`)."""
    return fused_decode(config) or fused_tiles(config, target)


def _tiles_pair_buffers(n, topk: int, inter: int, nt) -> tuple[MoeBuffer, ...]:
    """The two-call prefill form's intermediates (`fused_tiles`): what its first call writes
    for the second (row_pair too, which only the first reads: 4 bytes a pair, the six calls'
    table, for tests and tools that read it)."""
    p = n * topk
    return (MoeBuffer("row_pair", (p,), "int32"), MoeBuffer("token_rows", (n, topk), "int32"),
            MoeBuffer("tiles", (nt, 3), "int32"), MoeBuffer("h", (p, inter), "bfloat16"))


def _tiles_pair_calls(plus: bool) -> tuple[MoeCall, MoeCall]:
    """The two-call prefill form's calls (`tiles_pair`): route + QDQ + gate/up, then QDQ +
    down + combine (plus: `moe_down_combine_plus`, the shared output added)."""
    shared = ("shared",) if plus else ()
    return (MoeCall("moe_gate_up_route", ("x", "weights", "ids", "w1", "s1", "w3", "s3"),
                    ("row_pair", "token_rows", "tiles", "h")),
            MoeCall("moe_down_combine_plus" if plus else "moe_down_combine",
                    ("h", "tiles", "token_rows", "w2", "s2", *shared), ("y",)))


def moe_experts_plan(target_name: str, *, dim: int, inter: int, n_experts: int, topk: int, n,
                     n_hint: int | None = None, rows: int = 1, plus: bool = False,
                     fuse: bool = True, routing: TopkRouting | None = None,
                     gate: bool = False) -> MoePlan:
    """The call_tir chain of `build_moe_experts_split(target_name, ..., n=n_hint, rows=rows)`
    for n tokens (an int, or an int64 tirx Var for a symbolic batch). Shapes use the same row
    tile as the module, so pass the same target, hint and rows. `plus`: the chain of
    `moe_experts_plus` (a tenth input, `shared` bf16 [n, dim], added by `moe_combine_plus`,
    which stores y as bf16). `fuse` (default): the two-call form where the config has it
    (`fused_chain`: decode's GEMVs, CPU prefill's tiles); False: the six calls always (tests
    compare the two). `routing`: the chain of the gate's logits (the two-call decode form
    only): the inputs (x, logits, bias, w1, .., s2[, shared]) of `route_topk_logits` and the
    op, its first call `moe_gate_up_route_topk` (the top-k too), weights and ids
    intermediates; with `gate`, the gate's weight (bf16 [E, dim]) in place of the logits and
    `moe_gate_up_route_gate` (their GEMV too)."""
    target = get_target(target_name)
    config = moe_split_config(target, dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                              n=n_hint, rows=rows)
    p = n * topk
    nt = num_tiles(p, config.row_tile, n_experts)
    E = n_experts

    def buf(name, shape, dtype):
        return MoeBuffer(name, tuple(shape), dtype)

    inputs = (
        buf("x", (n, dim), "bfloat16"), buf("weights", (n, topk), "float32"),
        buf("ids", (n, topk), "int64"),
        buf("w1", (E, inter, dim // 2), "uint8"), buf("s1", (E, inter, dim // BLOCK), "uint8"),
        buf("w3", (E, inter, dim // 2), "uint8"), buf("s3", (E, inter, dim // BLOCK), "uint8"),
        buf("w2", (E, dim, inter // 2), "uint8"), buf("s2", (E, dim, inter // BLOCK), "uint8"),
    ) + ((buf("shared", (n, dim), "bfloat16"),) if plus else ())
    y = buf("y", (n, dim), "bfloat16" if plus else "float32")
    fused = fuse and fused_decode(config)
    if routing is not None and not fused:
        raise ValueError("The MoE chain routes from the gate's logits only in its two-call "
                         "decode form (moe.fused_decode).")
    if gate and routing is None:
        raise ValueError("The MoE chain takes the gate's weight only when it routes (routing).")
    if fuse and fused_tiles(config, target):
        return MoePlan(inputs, _tiles_pair_buffers(n, topk, inter, nt), y,
                       _tiles_pair_calls(plus))
    if fused:
        combine = "moe_down_combine_plus" if plus else "moe_down_combine"
        pairs = (buf("row_pair", (p,), "int32"), buf("token_rows", (n, topk), "int32"),
                 buf("h", (p, inter), "bfloat16"))
        down = MoeCall(combine, ("h", "ids", "row_pair", "token_rows", "w2", "s2")
                       + (("shared",) if plus else ()), ("y",))
        if routing is None:
            return MoePlan(inputs, pairs, y, (
                MoeCall("moe_gate_up_route", ("x", "weights", "ids", "w1", "s1", "w3", "s3"),
                        ("row_pair", "token_rows", "h")), down))
        bias = (n, n_experts) if routing.bias_rows else (n_experts,)
        scores = (buf("gate_w", (n_experts, dim), "bfloat16") if gate
                  else buf("logits", (n, n_experts), "float32"))
        first = "moe_gate_up_route_gate" if gate else "moe_gate_up_route_topk"
        return MoePlan(
            (inputs[0], scores, buf("bias", bias, "float32"), *inputs[3:]),
            (inputs[1], inputs[2], *pairs), y,
            (MoeCall(first, ("x", scores.name, "bias", "w1", "s1", "w3", "s3"),
                     ("weights", "ids", "row_pair", "token_rows", "h")), down))
    intermediates = (
        buf("row_pair", (p,), "int32"), buf("token_rows", (n, topk), "int32"),
        buf("tiles", (nt, 3), "int32"), buf("xq", (n, dim), "float32"),
        buf("h", (p, inter), "bfloat16"), buf("hq", (p, inter), "float32"),
        buf("o", (p, dim), "bfloat16"),
    )
    # which rows each GEMM reads: the GEMV form its pairs' experts, the tiles their runs
    gate_rows, down_rows = ((("ids", "row_pair"),) * 2
                            if config.kind == "gemv" and not config.rows
                            else (("row_pair", "tiles"), ("tiles",)))
    calls = (
        MoeCall("moe_route", ("ids",), ("row_pair", "token_rows", "tiles")),
        MoeCall("moe_qdq_x", ("x",), ("xq",)),
        MoeCall("moe_gate_up", ("xq", "weights", *gate_rows, "w1", "s1", "w3", "s3"), ("h",)),
        MoeCall("moe_qdq_h", ("h",), ("hq",)),
        MoeCall("moe_down", ("hq", *down_rows, "w2", "s2"), ("o",)),
        MoeCall("moe_combine_plus", ("token_rows", "o", "shared"), ("y",)) if plus
        else MoeCall("moe_combine", ("token_rows", "o"), ("y",)),
    )
    return MoePlan(inputs, intermediates, y, calls)


def build_moe_experts_split(target_name: str, *, dim: int, inter: int, n_experts: int,
                            topk: int, swiglu_limit: float, n: int | None = None,
                            null_expert: bool = False, rows: int = 1,
                            routing: TopkRouting | None = None, gate: bool = False
                            ) -> tvm.IRModule:
    """The scheduled PrimFuncs of the chain (global symbols as in `moe_experts_plan`: its six,
    `moe_combine_plus` for the chain of `moe_experts_plus`, and the two-call form's where the
    config has it, `fused_chain`),
    thread-bound on CUDA, parallel/vectorised on CPU. n is the token-count hint; null_expert:
    the last expert is a sharded worker's null expert, whose pairs cost no GEMM work
    (`make_moe_route`); rows > 1: the verify entry's (`moe_split_config`); `routing`: the
    two-call form's `moe_gate_up_route_topk` too, and with `gate` its
    `moe_gate_up_route_gate` (`moe_experts_plan`)."""
    check_dims(dim, inter)
    target = get_target(target_name)
    cfg = moe_split_config(target, dim=dim, inter=inter, n_experts=n_experts, topk=topk, n=n,
                           rows=rows)
    funcs = {
        "moe_route": schedule_moe_route(
            make_moe_route(n_experts=n_experts, topk=topk, row_tile=cfg.row_tile,
                           null_expert=null_expert), cfg, target),
        "moe_qdq_x": schedule_moe_qdq(make_moe_qdq(k=dim, name="moe_qdq_x"), cfg, target),
        "moe_qdq_h": schedule_moe_qdq(make_moe_qdq(k=inter, name="moe_qdq_h"), cfg, target),
        "moe_combine": schedule_moe_combine(make_moe_combine(dim=dim, topk=topk), cfg, target),
        "moe_combine_plus": schedule_moe_combine(make_moe_combine(dim=dim, topk=topk, plus=True),
                                                 cfg, target),
    }
    if cfg.rows:
        funcs["moe_gate_up"] = make_moe_gate_up_rows_avx512(
            dim=dim, inter=inter, n_experts=n_experts, topk=topk, swiglu_limit=swiglu_limit,
            row_tile=cfg.row_tile, dot=cfg.dot)
        funcs["moe_down"] = make_moe_down_rows_avx512(dim=dim, inter=inter,
                                                      n_experts=n_experts, topk=topk,
                                                      row_tile=cfg.row_tile, dot=cfg.dot)
    elif cfg.kind == "gemv" and cfg.hand:
        funcs["moe_gate_up_route"] = make_moe_gate_up_gemv_avx512(
            dim=dim, inter=inter, n_experts=n_experts, topk=topk, swiglu_limit=swiglu_limit,
            dot=cfg.dot, route=True, null_expert=null_expert, lanes=cfg.lanes)
        routed = dict(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                      swiglu_limit=swiglu_limit, dot=cfg.dot, route=True,
                      null_expert=null_expert, routing=routing, lanes=cfg.lanes)
        if routing is not None:
            funcs["moe_gate_up_route_topk"] = make_moe_gate_up_gemv_avx512(**routed)
        if routing is not None and gate:
            funcs["moe_gate_up_route_gate"] = make_moe_gate_up_gemv_avx512(**routed, gate=True)
        for plus in (False, True):
            funcs["moe_down_combine_plus" if plus else "moe_down_combine"] = \
                make_moe_down_gemv_avx512(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                                          dot=cfg.dot, combine=True, plus=plus,
                                          lanes=cfg.lanes)
        funcs["moe_gate_up"] = make_moe_gate_up_gemv_avx512(
            dim=dim, inter=inter, n_experts=n_experts, topk=topk, swiglu_limit=swiglu_limit,
            dot=cfg.dot, lanes=cfg.lanes)
        funcs["moe_down"] = make_moe_down_gemv_avx512(dim=dim, inter=inter,
                                                      n_experts=n_experts, topk=topk,
                                                      dot=cfg.dot, lanes=cfg.lanes)
    elif cfg.kind == "gemv":
        funcs["moe_gate_up"] = schedule_moe_gemv(
            make_moe_gate_up_gemv(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                                  swiglu_limit=swiglu_limit), cfg, target, "h")
        funcs["moe_down"] = schedule_moe_gemv(
            make_moe_down_gemv(dim=dim, inter=inter, n_experts=n_experts, topk=topk),
            cfg, target, "o")
    else:
        funcs["moe_gate_up"] = schedule_moe_gemm(
            make_moe_gate_up(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                             swiglu_limit=swiglu_limit, row_tile=cfg.row_tile), cfg, target, "h")
        funcs["moe_down"] = schedule_moe_gemm(
            make_moe_down(dim=dim, inter=inter, n_experts=n_experts, row_tile=cfg.row_tile),
            cfg, target, "o")
    if fused_tiles(cfg, target):
        funcs.update(fused_tiles_funcs(cfg, target, dim=dim, inter=inter, n_experts=n_experts,
                                       topk=topk, swiglu_limit=swiglu_limit,
                                       null_expert=null_expert))
    return tvm.IRModule({tvm.ir.GlobalVar(name): f.with_attr("global_symbol", name)
                         for name, f in funcs.items()})


def emit_moe_experts(bb, plan: MoePlan, inputs: list, kernel) -> object:
    """Emit the chain into a Relax BlockBuilder `bb`: one `call_tir` per plan call (Relax
    allocates the intermediates); `inputs` are the op's nine tensor arguments as Relax
    expressions, `kernel(name)` returns the GlobalVar of the chain's PrimFunc `name` (added to
    the module once by the caller). Returns the y [n, dim] fp32 expression. The lowering of
    `dsv41::moe_experts` is this function."""

    if len(inputs) != len(plan.inputs):
        raise ValueError(f"moe_experts takes {len(plan.inputs)} tensors, got {len(inputs)}.")
    env = {b.name: v for b, v in zip(plan.inputs, inputs, strict=True)}
    bufs = plan.buffers()
    for call in plan.calls:
        gv = kernel(call.func)
        out_ty = [relax.TensorType(bufs[o].shape, bufs[o].dtype) for o in call.outs]
        res = bb.emit(relax.call_tir(gv, [env[a] for a in call.args],
                                     out_ty if len(out_ty) > 1 else out_ty[0]))
        if len(call.outs) == 1:
            env[call.outs[0]] = res
        else:
            for i, o in enumerate(call.outs):
                env[o] = bb.emit(relax.TupleGetItem(res, i))
    return env[plan.output.name]


# ---- example inputs for tests and benchmarks ----------------------------------------------


def example_inputs_moe_experts(*, n: int, dim: int, inter: int, n_experts: int, topk: int,
                               seed: int = 0) -> list[torch.Tensor]:
    """[x, weights, ids, w1, s1, w3, s3, w2, s2] as the model routes: distinct ids per token
    drawn from a skewed distribution (some experts popular, some unused at small n), weights
    normalised per token, MXFP4 expert weights quantised from Gaussians."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g).to(torch.bfloat16)
    popularity = torch.rand(n_experts, generator=g) ** 2 + 0.05
    ids = torch.multinomial(popularity.expand(n, n_experts), topk, replacement=False,
                            generator=g).to(torch.int64)
    weights = torch.rand(n, topk, generator=g) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True) * 1.5

    def expert_weights(rows: int, cols: int):
        w = torch.randn(n_experts * rows, cols, generator=g) * cols**-0.5
        packed, scales = fmt.torch_quant_fp4_weight(w)
        return (packed.view(n_experts, rows, cols // 2),
                scales.view(n_experts, rows, cols // BLOCK))

    w1, s1 = expert_weights(inter, dim)
    w3, s3 = expert_weights(inter, dim)
    w2, s2 = expert_weights(dim, inter)
    return [x, weights, ids, w1, s1, w3, s3, w2, s2]
