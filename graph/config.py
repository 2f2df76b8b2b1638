"""Model configuration: `ModelArgs` with the field names of the released `inference/config.json`.

Two file forms are accepted: the inference config (flat, the checkpoint's own keys) and the
Hugging Face style `config.json` (fields nested under `text_config`, with renamed keys). Any
unknown or inconsistent field is a `ValueError` that names it: a silently ignored key would give a
different model with the same weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Token ids of the released vocabulary (SPEC section 1).
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


@dataclass(frozen=True)
class ModelArgs:
    """Every field is an inference `config.json` key, grouped by concern."""

    # runtime limits: they size caches, not weights
    max_batch_size: int = 1
    max_seq_len: int = 1_048_576
    temperature: float = 0.0
    # storage formats
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    # trunk
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention: low-rank q, one shared 512-dim latent per token, grouped low-rank output
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # CSA2: one ratio per layer, DSpark layers included (0 = window only)
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    # rope (YaRN on compressed layers when original_seq_len > 0)
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16_000_000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # vision tower (graph/vision.py); used when the checkpoint holds its tensors
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    # DSpark draft blocks
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3

    def __post_init__(self) -> None:
        validate(self)

    # ---- derived views -------------------------------------------------------------------
    @property
    def n_total_layers(self) -> int:
        """Backbone plus DSpark layers: the length of `compress_ratios`."""
        return self.n_layers + (self.n_mtp_layers if self.dspark_block_size else 0)

    def moe_config(self, layer_id: int) -> tuple[int, int]:
        """(routed, activated) experts of a layer; DSpark layers may have their own counts."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def to_dict(self) -> dict[str, Any]:
        """The inference `config.json` form (lists for tuples)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of every field: names artifacts and salts cache keys."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)


_TUPLE_FIELDS = tuple(
    f.name for f in fields(ModelArgs) if str(f.type).startswith("tuple")
)
_FIELD_NAMES = tuple(f.name for f in fields(ModelArgs))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def validate(a: ModelArgs) -> None:
    """Reject configs that no layer plan or kernel can serve, naming the offending field."""
    for name in ("dim", "n_layers", "n_heads", "head_dim", "vocab_size", "window_size",
                 "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult", "max_seq_len"):
        _check(getattr(a, name) > 0, f"ModelArgs.{name} must be positive, got {getattr(a, name)}.")
    _check(a.dtype in ("fp8", "bf16"), f"ModelArgs.dtype must be 'fp8' or 'bf16', got {a.dtype!r}.")
    _check(a.expert_dtype in ("fp4", None),
           f"ModelArgs.expert_dtype must be 'fp4' or null, got {a.expert_dtype!r}.")
    _check(a.score_func in ("softmax", "sigmoid", "sqrtsoftplus"),
           f"ModelArgs.score_func {a.score_func!r} is not one of softmax, sigmoid, sqrtsoftplus.")
    _check(a.n_shared_experts == 1,
           f"ModelArgs.n_shared_experts must be 1 (as released), got {a.n_shared_experts}.")
    _check(0 < a.rope_head_dim <= a.head_dim and a.rope_head_dim % 2 == 0,
           f"ModelArgs.rope_head_dim {a.rope_head_dim} must be even and within head_dim.")
    _check(a.head_dim % 32 == 0 and a.dim % 32 == 0,
           "ModelArgs.head_dim and dim must be multiples of 32 (FP8 blocks of 32).")
    _check((a.n_heads * a.head_dim) % a.o_groups == 0,
           f"ModelArgs.o_groups {a.o_groups} must divide n_heads * head_dim.")
    _check(a.index_head_dim % 32 == 0,
           f"ModelArgs.index_head_dim {a.index_head_dim} must be a multiple of 32 (MXFP4).")
    _check(a.moe_inter_dim % 32 == 0,
           f"ModelArgs.moe_inter_dim {a.moe_inter_dim} must be a multiple of 32 (FP4 scales).")
    _check(0 < a.n_activated_experts <= a.n_routed_experts,
           "ModelArgs.n_activated_experts must be in 1..n_routed_experts.")
    _check(len(a.compress_ratios) == a.n_total_layers,
           f"ModelArgs.compress_ratios has {len(a.compress_ratios)} entries but n_layers "
           f"+ DSpark layers = {a.n_total_layers}.")
    _check(all(r in (0, 1, 2, 4, 128) for r in a.compress_ratios),
           "ModelArgs.compress_ratios holds an unsupported ratio: "
           f"{sorted(set(a.compress_ratios))}.")
    if a.dspark_block_size:
        _check(all(r == 0 for r in a.compress_ratios[a.n_layers:]),
               "ModelArgs.compress_ratios: DSpark layers are window-only and must have ratio 0.")
        _check(len(a.dspark_target_layer_ids) > 0
               and all(0 <= t < a.n_layers for t in a.dspark_target_layer_ids),
               f"ModelArgs.dspark_target_layer_ids {a.dspark_target_layer_ids} must name "
               "backbone layers.")
        _check(0 <= a.dspark_noise_token_id < a.vocab_size,
               "ModelArgs.dspark_noise_token_id must be a token id.")
    if a.engram_layer_ids:
        _check(a.engram_max_ngram_size >= 2 and a.engram_n_heads > 0 and a.engram_head_dim > 0,
               "ModelArgs.engram_* sizes must be positive when engram_layer_ids is set.")
        _check(a.engram_head_dim % 32 == 0,
               "ModelArgs.engram_head_dim must be a multiple of 32 (FP8 row scales).")
        _check(len(a.engram_num_embeddings) == len(a.engram_layer_ids),
               "ModelArgs.engram_num_embeddings needs one entry per Engram layer.")
        _check(a.engram_compressed_vocab_size > 0,
               "ModelArgs.engram_compressed_vocab_size must be set when Engram is on.")
        _check(all(0 <= i < a.n_layers for i in a.engram_layer_ids),
               f"ModelArgs.engram_layer_ids {a.engram_layer_ids} must name backbone layers.")
    _check(a.candidate_source_layer < 0
           or (a.candidate_topk_blocks > 0 and a.candidate_block_size > 0),
           "ModelArgs.candidate_topk_blocks and candidate_block_size must be positive when "
           "candidate_source_layer is set.")


def _coerce(name: str, value: Any) -> Any:
    if name in _TUPLE_FIELDS:
        _check(isinstance(value, (list, tuple)),
               f"Config field {name!r} must be a list, got {type(value).__name__}.")
        return tuple(int(v) for v in value)
    return value


def args_from_dict(d: dict[str, Any], *, source: str = "config") -> ModelArgs:
    """Build from the inference form. Unknown keys are an error naming them."""
    unknown = sorted(set(d) - set(_FIELD_NAMES))
    _check(not unknown, f"{source}: unknown config field(s) {unknown}; not a ModelArgs key.")
    return ModelArgs(**{k: _coerce(k, v) for k, v in d.items()})


# Hugging Face `text_config` key -> inference key. Keys not listed here but equal to a ModelArgs
# field name are taken as they are.
HF_RENAMES: dict[str, str] = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_nextn_predict_layers": "n_mtp_layers",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "max_position_embeddings": "max_seq_len",
    "engram_pad_token_id": "engram_pad_id",
}
# HF keys that carry no model information for dsv41 (bookkeeping of the HF loader).
HF_IGNORED = frozenset({
    "architectures", "model_type", "torch_dtype", "transformers_version", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "use_cache",
    "num_key_value_heads", "initializer_range", "attention_bias", "attention_dropout",
    "quantization_config", "hidden_act", "dtype",
})


def args_from_hf(cfg: dict[str, Any], *, source: str = "config") -> ModelArgs:
    """Build from the Hugging Face form: fields under `text_config`, renamed keys, YaRN under
    `rope_scaling`. A key that maps to nothing, or two keys that map to one field with different
    values, is an error naming them."""
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = dict(cfg.get("text_config", {}))
    # vision_config describes the ViT, which dsv41 does not serve (text model only)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def put(name: str, value: Any, key: str) -> None:
        if name in out and out[name] != _coerce(name, value):
            raise ValueError(f"{source}: {key!r} = {value!r} contradicts {origin[name]!r} = "
                             f"{out[name]!r} (both set ModelArgs.{name}).")
        out[name] = _coerce(name, value)
        origin[name] = key

    for scope in (top, text):
        for key, value in scope.items():
            if key == "rope_scaling":
                if value is None:
                    continue
                rs = dict(value)
                kind = rs.pop("rope_type", rs.pop("type", "yarn"))
                _check(kind == "yarn", f"{source}: rope_scaling type {kind!r} is not 'yarn'.")
                for rk, name in (("factor", "rope_factor"), ("beta_fast", "beta_fast"),
                                 ("beta_slow", "beta_slow"),
                                 ("original_max_position_embeddings", "original_seq_len")):
                    if rk in rs:
                        put(name, rs.pop(rk), f"rope_scaling.{rk}")
                rs.pop("mscale", None)
                rs.pop("mscale_all_dim", None)
                _check(not rs, f"{source}: unknown rope_scaling field(s) {sorted(rs)}.")
                continue
            if key in HF_IGNORED:
                continue
            name = HF_RENAMES.get(key, key)
            if name not in _FIELD_NAMES:
                raise ValueError(f"{source}: unknown config field {key!r}; it maps to no "
                                 "ModelArgs field.")
            put(name, value, key)
    return ModelArgs(**out)


def load_config(path: str | Path) -> ModelArgs:
    """Read an inference or Hugging Face `config.json` (the form is told by `text_config`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(f"Config file {path} does not exist.")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"Config file {path} is not valid JSON: {e}.") from e
    _check(isinstance(d, dict), f"Config file {path} must hold a JSON object.")
    if "text_config" in d or "hidden_size" in d:
        return args_from_hf(d, source=str(path))
    return args_from_dict(d, source=str(path))


def save_config(args: ModelArgs, path: str | Path) -> None:
    Path(path).write_text(json.dumps(args.to_dict(), indent=4) + "\n")


# ---- presets ---------------------------------------------------------------------------------


def engram_prime_buckets(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int,
                         vocab_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per Engram layer, per n-gram size, per head: the bucket modulus. Primes above
    `vocab_size - 1`, handed out in order and never reused, so bucket ranges stay disjoint."""
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_n = []
        for _ in range(max_ngram - 1):
            sizes, cur = [], vocab_size - 1
            for _ in range(n_heads):
                cur = _next_prime(cur, seen)
                seen.add(cur)
                sizes.append(cur)
            per_n.append(tuple(sizes))
        out.append(tuple(per_n))
    return tuple(out)


def _next_prime(start: int, seen: set[int]) -> int:
    c = start + 1
    while not _is_prime(c) or c in seen:
        c += 1
    return c


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _engram_rows(layer_ids, max_ngram, n_heads, vocab) -> tuple[int, ...]:
    buckets = engram_prime_buckets(layer_ids, max_ngram, n_heads, vocab)
    return tuple(sum(sum(per_n) for per_n in layer) for layer in buckets)


def _full() -> ModelArgs:
    """The released `inference/config.json`; runtime limits (batch, context) are dsv41's."""
    return ModelArgs()


def _bench() -> ModelArgs:
    # The released attention and indexer sizes at dim 1024 with a small MoE, so CPU benchmarks
    # run at real cache sizes. Vocab is kept small: the head is not what the benches measure.
    vocab = 4096
    return ModelArgs(
        max_seq_len=1_048_576,
        vocab_size=8192,
        dim=1024,
        moe_inter_dim=512,
        n_routed_experts=16,
        n_activated_experts=2,
        dspark_n_routed_experts=16,
        dspark_n_activated_experts=2,
        q_lora_rank=512,
        o_lora_rank=512,
        dspark_markov_rank=64,
        dspark_noise_token_id=8191,
        engram_vocab_size=vocab,
        engram_n_heads=8,
        engram_head_dim=64,
        engram_compressed_vocab_size=4096,
        engram_num_embeddings=_engram_rows((1, 14), 4, 8, vocab),
    )


SMALL_CONFIG_JSON = Path(__file__).with_name("presets") / "small.json"


def _small() -> ModelArgs:
    return args_from_dict(json.loads(SMALL_CONFIG_JSON.read_text()), source=str(SMALL_CONFIG_JSON))


def _long() -> ModelArgs:
    """The released window, top-k, candidate pool, RoPE scaling and layer schedule (which `small`
    already has) at `small`'s widths, with the released 1M context: prompts of 128K-1M tokens
    prefill on a CPU in minutes, with the selection sizes that decide long-context behaviour."""
    full = _full()
    return _small().replace(
        max_seq_len=full.max_seq_len,
        window_size=full.window_size,
        index_topk=full.index_topk,
        candidate_topk_blocks=full.candidate_topk_blocks,
        candidate_block_size=full.candidate_block_size,
        original_seq_len=full.original_seq_len,
        rope_factor=full.rope_factor,
        compress_rope_theta=full.compress_rope_theta,
        rope_theta=full.rope_theta,
    )


PRESETS = ("small", "bench", "full", "long")


def preset(name: str) -> ModelArgs:
    """The named preset: `small` (the conformance case's config, the default), `bench`, `full`,
    `long` (released selection sizes and context at small widths)."""
    makers = {"small": _small, "bench": _bench, "full": _full, "long": _long}
    if name not in makers:
        raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return makers[name]()


def resolve_args(preset_name: str | None = None, config: str | Path | None = None) -> ModelArgs:
    """CLI helper: a config file wins over a preset; neither gives `small`."""
    if config is not None:
        return load_config(config)
    return preset(preset_name or "small")


__all__ = [
    "ModelArgs", "PRESETS", "preset", "load_config", "save_config", "args_from_dict",
    "args_from_hf", "resolve_args", "engram_prime_buckets",
]
