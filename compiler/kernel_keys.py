"""The typed key of every kernel the lowering adds to a module: one frozen dataclass per kernel
kind, whose fields are the static dims the kernel is built for.

A key is what `Lowering.kernel` dedups on (one function per key in a module), what names the
function (`function_name`: `k_` + the key's parts, the names tuning databases record tasks
by), and what `compiler.kernels` maps to the kind's factory, config, schedule, converter and
tuning task. `to_dict` / `key_from_dict` are the one serialised form (JSON-ready).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import ClassVar

from dsv41.schedules.router import TopkRouting

BF16 = "bfloat16"


@dataclass(frozen=True)
class KernelKey:
    """Base of the keys: `kind` names the kernel kind (the first part of the function name)."""

    kind: ClassVar[str]

    def parts(self) -> tuple:
        """kind, then the fields in order: what the function name is made of."""
        return (self.kind, *(getattr(self, f.name) for f in fields(self)))

    @property
    def family(self) -> str:
        """The first part of the name: the tuning family (`tuning_space.KERNEL_FAMILIES`)."""
        return str(self.parts()[0])

    @property
    def function_name(self) -> str:
        return "k_" + "_".join(str(p).replace(".", "p").replace("-", "m") for p in self.parts())

    def to_dict(self) -> dict:
        """JSON-ready: a dataclass field (MoeKey's routing) as its dict."""
        def plain(v):
            return asdict(v) if is_dataclass(v) else v

        return {"kind": self.kind, **{f.name: plain(getattr(self, f.name)) for f in fields(self)}}


@dataclass(frozen=True)
class Fp8LinearKey(KernelKey):
    """fp8_linear (bf16 out) / fp8_linear_f32 (fp32: a row-parallel partial sum)."""

    kind: ClassVar[str] = "fp8_linear"
    n: int
    k: int
    m: int | None  # the rows hint (decode 1, drafts 4, prefill None)
    out_dtype: str = BF16
    rows: int = 1  # the verify entry's rows per sequence (1 + k; 1 elsewhere)
    norm_eps: float | None = None  # norm_fp8_linear: the input RMS-normed in the kernel
    pair_n: int | None = None  # fp8_linear_pair: a second matrix's rows (x quantised once)
    swiglu_limit: float | None = None  # swiglu_fp8_linear: the input the SwiGLU of two

    def parts(self) -> tuple:
        name = "fp8_linear" if self.out_dtype == BF16 else "fp8_linear_f32"
        return (name, self.n, self.k, self.m) + ((f"r{self.rows}",) if self.rows > 1 else ()) + (
            (f"norm{self.norm_eps}",) if self.norm_eps is not None else ()) + (
            (f"pair{self.pair_n}",) if self.pair_n is not None else ()) + (
            (f"swiglu{self.swiglu_limit}",) if self.swiglu_limit is not None else ())


@dataclass(frozen=True)
class Fp8QkvKey(KernelKey):
    """fp8_q_kv's one kernel (`gemm.build_fp8_q_kv`): the pair wq_a / wkv then wq_b."""

    kind: ClassVar[str] = "fp8_q_kv"
    n_q: int
    n_kv: int
    k: int
    n_b: int
    norm_eps: float
    m: int | None
    rows: int = 1

    def parts(self) -> tuple:
        return (self.kind, self.n_q, self.n_kv, self.k, self.n_b, f"norm{self.norm_eps}",
                self.m) + ((f"r{self.rows}",) if self.rows > 1 else ())


@dataclass(frozen=True)
class Fp8DequantKey(KernelKey):
    kind: ClassVar[str] = "fp8_dequant"
    d: int


@dataclass(frozen=True)
class SparseAttendKey(KernelKey):
    """sparse_attend over FP4 global entries (kv "fp4") or a bf16 global cache (kv "bf16");
    `rope_rd`: sparse_attend_rope's form."""

    kind: ClassVar[str] = "sparse_attend"
    h: int
    d: int
    w: int
    k: int
    softmax_scale: float
    kv: str = "fp4"
    rope_rd: int = 0  # sparse_attend_rope: q's RoPE and the output's inverse inside (fp4)

    def parts(self) -> tuple:
        name = "sparse_attend" if self.kv == "fp4" else "sparse_attend_bf16"
        return (name, self.h, self.d, self.w, self.k, self.softmax_scale) + (
            (f"rope{self.rope_rd}",) if self.rope_rd else ())

    def dims(self) -> dict:
        return dict(h=self.h, d=self.d, w=self.w, k=self.k, softmax_scale=self.softmax_scale,
                    **({"rope_rd": self.rope_rd} if self.rope_rd else {}))


@dataclass(frozen=True)
class IndexScoresKey(KernelKey):
    """The indexer's score sweep over one store."""

    kind: ClassVar[str] = "index_scores"
    heads: int
    dim: int


@dataclass(frozen=True)
class IndexScoresSharedKey(KernelKey):
    """The sweep over the own store and `n_alt` alternates (indexer_topk_shared)."""

    kind: ClassVar[str] = "index_scores_shared"
    heads: int
    dim: int
    n_alt: int


@dataclass(frozen=True)
class SelectPositionsKey(KernelKey):
    kind: ClassVar[str] = "select_positions"
    topk: int


@dataclass(frozen=True)
class SelectBlocksKey(KernelKey):
    kind: ClassVar[str] = "select_blocks"
    topk_blocks: int
    block_size: int


POOL_FUNCS = ("scores", "select", "gather", "mask")  # -> pool_scores, select_pool, ...


@dataclass(frozen=True)
class PoolKey(KernelKey):
    """One function of the candidate-pool sweep (`indexer.build_pool_topk`)."""

    kind: ClassVar[str] = "pool"
    heads: int
    dim: int
    topk: int
    block_size: int
    func: str  # one of POOL_FUNCS

    def __post_init__(self):
        assert self.func in POOL_FUNCS, f"pool function {self.func!r} is not one of {POOL_FUNCS}"


@dataclass(frozen=True)
class MoeKey(KernelKey):
    """One kernel of the routed experts' chain (`moe.build_moe_experts_split`)."""

    kind: ClassVar[str] = "moe"
    dim: int
    inter: int
    n_experts: int
    topk: int
    swiglu_limit: float
    n_hint: int | None
    null_expert: bool
    func: str  # the chain's function (moe_route, moe_qdq_x, ...)
    rows: int = 1  # the verify entry's rows per sequence (1 + k; 1 elsewhere)
    routing: TopkRouting | None = None  # the two-call form routing the gate's logits itself
    gate: bool = False  # ... and forming them from the gate's weight

    def __post_init__(self) -> None:
        if isinstance(self.routing, dict):  # as `to_dict` wrote it
            object.__setattr__(self, "routing", TopkRouting(**self.routing))

    def parts(self) -> tuple:
        r = self.routing
        routed = () if r is None else (
            "topk", r.normalize, r.route_scale, *(("rows",) if r.bias_rows else ()),
            f"logits{r.gate_temp}", *(("gate",) if self.gate else ()))
        return ("moe", self.dim, self.inter, self.n_experts, self.topk, self.swiglu_limit,
                self.n_hint, *(("null",) if self.null_expert else ()),
                *((f"r{self.rows}",) if self.rows > 1 else ()), *routed, self.func)

    def dims(self) -> dict:
        return dict(dim=self.dim, inter=self.inter, n_experts=self.n_experts, topk=self.topk)


@dataclass(frozen=True)
class ScatterRowsKey(KernelKey):
    kind: ClassVar[str] = "scatter_rows"
    width: int
    dtype: str


@dataclass(frozen=True)
class RmsNormKey(KernelKey):
    kind: ClassVar[str] = "rms_norm"
    d: int
    eps: float


@dataclass(frozen=True)
class RouteTopkKey(KernelKey):
    kind: ClassVar[str] = "route_topk"
    e: int
    k: int
    normalize: bool
    route_scale: float
    bias_rows: bool  # a bias per row (the image-span rows'), else one for all rows
    gate_temp: float | None = None  # route_topk_logits: the scores from logits / gate_temp
    bias_select: bool = False  # (mask, bias_vl, bias): each row's bias picked by its mask

    def parts(self) -> tuple:
        return (self.kind, self.e, self.k, self.normalize, self.route_scale, self.bias_rows) + (
            (f"logits{self.gate_temp}",) if self.gate_temp is not None else ()) + (
            ("vl",) if self.bias_select else ())


@dataclass(frozen=True)
class RopeKey(KernelKey):
    kind: ClassVar[str] = "rope"
    h: int  # heads per row (1 for a (b, s, d) tensor)
    d: int
    rd: int
    inverse: bool


@dataclass(frozen=True)
class RopeQuantKey(KernelKey):
    """A new cache entry's norm (eps None: none), RoPE and quantiser (`form`: an
    `ops.EntryFormat` value) in one kernel; `into`: written into rows of a cache in place."""

    kind: ClassVar[str] = "rope_quant"
    d: int
    rd: int
    form: str
    eps: float | None
    into: bool = False  # rope_quant_rows: written in place into rows of a cache
    window: bool = False  # rope_quant_window: after a copy of a ring, and into its slots

    def parts(self) -> tuple:
        return (self.kind, self.d, self.rd, self.form, self.eps) + (
            ("rows",) if self.into else ()) + (("window",) if self.window else ())


@dataclass(frozen=True)
class HcPreMixKey(KernelKey):
    kind: ClassVar[str] = "hc_pre_mix"
    hc: int
    d: int
    iters: int
    norm_eps: float
    hc_eps: float


@dataclass(frozen=True)
class HcPostPreMixKey(KernelKey):
    """hc_post then the next sublayer's hc_pre_mix (with its norm), one kernel."""

    kind: ClassVar[str] = "hc_post_pre_mix"
    hc: int
    d: int
    iters: int
    norm_eps: float
    hc_eps: float


@dataclass(frozen=True)
class HcPostKey(KernelKey):
    kind: ClassVar[str] = "hc_post"
    hc: int
    d: int


QUANT_OPS = ("quant_fp8", "quant_fp4_kv", "quant_mxfp4", "qdq_mxfp4")


@dataclass(frozen=True)
class QuantKey(KernelKey):
    """One of the activation / cache quantisers (its op names the kernel)."""

    kind: ClassVar[str] = "quant"
    op: str  # one of QUANT_OPS
    d: int

    def __post_init__(self):
        assert self.op in QUANT_OPS, f"quant op {self.op!r} is not one of {QUANT_OPS}"

    def parts(self) -> tuple:
        return (self.op, self.d)


@dataclass(frozen=True)
class DenseGemvKey(KernelKey):
    """x (m, g, k) times w (g * n, k) -> fp32 (m, g, n), or bf16 (`out_dtype`), one row at a time
    (decode, drafts)."""

    kind: ClassVar[str] = "dense_gemv"
    groups: int
    n: int
    k: int
    x_dtype: str
    w_dtype: str
    rows: int = 1  # dense_gemv: rows per group sharing each weight load (verify 1 + k, draft)
    out_dtype: str = "float32"  # dense_gemv: "bfloat16" where the kernel rounds its stores

    def parts(self) -> tuple:
        return (self.kind, self.groups, self.n, self.k, self.x_dtype, self.w_dtype) + (
            (f"r{self.rows}",) if self.rows > 1 else ()) + (
            ("to_bf16",) if self.out_dtype != "float32" else ())

    def dims(self) -> dict:
        return dict(groups=self.groups, n=self.n, k=self.k, x_dtype=self.x_dtype,
                    w_dtype=self.w_dtype, **({"rows": self.rows} if self.rows > 1 else {}),
                    **({"out_dtype": self.out_dtype} if self.out_dtype != "float32" else {}))


@dataclass(frozen=True)
class DenseGemmKey(DenseGemvKey):
    """The same product register-tiled over rows (prefill)."""

    kind: ClassVar[str] = "dense_gemm"


KEY_KINDS: dict[str, type[KernelKey]] = {
    cls.kind: cls for cls in (Fp8LinearKey, Fp8DequantKey, SparseAttendKey, IndexScoresKey,
                              IndexScoresSharedKey, SelectPositionsKey, SelectBlocksKey, PoolKey,
                              Fp8QkvKey, MoeKey, RouteTopkKey, ScatterRowsKey, RmsNormKey, RopeKey,
                              RopeQuantKey, HcPreMixKey, HcPostKey, HcPostPreMixKey, QuantKey,
                              DenseGemvKey, DenseGemmKey)}


def key_from_dict(d: dict) -> KernelKey:
    """The key `KernelKey.to_dict` wrote."""
    kind = d.get("kind")
    if kind not in KEY_KINDS:
        raise ValueError(f"Unknown kernel kind {kind!r}; the known kinds are "
                         f"{', '.join(KEY_KINDS)}.")
    return KEY_KINDS[kind](**{k: v for k, v in d.items() if k != "kind"})
