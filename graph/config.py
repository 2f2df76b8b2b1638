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
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

# Token ids of the released vocabulary (SPEC section 1).
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
_log = logging.getLogger(__name__)


OMITTED_AT_DEFAULT: Mapping[str, Any] = MappingProxyType({"wo_a_dtype": "bf16"})
_NOTHING = object()


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
    # dsv41's key: the grouped o-projection's weight (`wo_a`) kept as the hub ships it, FP8 E4M3
    # with an E8M0 scale per 32 x 32 tile ("fp8"), or as `inference/convert.py` writes it, BF16
    # (the reference's demo layout). The same values either way (the BF16 is the FP8
    # dequantized); "fp8" reads half the bytes. A checkpoint in the other form is converted at
    # load, exactly or not at all (`checkpoint.load`).
    wo_a_dtype: str = "bf16"
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
        """The inference `config.json` form (lists for tuples). A key dsv41 added after configs
        and artifacts were made is left out at its default (`OMITTED_AT_DEFAULT`), so their
        `config_hash` (artifact names, KV tier keys) is what it was."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if OMITTED_AT_DEFAULT.get(f.name, _NOTHING) == v:
                continue
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
    _check(a.wo_a_dtype in ("fp8", "bf16"),
           f"ModelArgs.wo_a_dtype must be 'fp8' or 'bf16', got {a.wo_a_dtype!r}.")
    _check(a.wo_a_dtype == "bf16" or (a.o_groups * a.o_lora_rank) % 32 == 0
           and (a.n_heads * a.head_dim // a.o_groups) % 32 == 0,
           "ModelArgs.wo_a_dtype 'fp8' needs wo_a's rows (o_groups * o_lora_rank) and columns "
           "(n_heads * head_dim / o_groups) in whole 32 x 32 tiles.")
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
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
# `vision_config` key -> ModelArgs field (the ViT of graph/vision.py).
HF_VISION_RENAMES: Mapping[str, str] = MappingProxyType({
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
})
# HF keys that no ModelArgs field holds but whose value decides the math: dsv41 accepts only
# the value it implements. key -> (accepted values, what dsv41 implements).
HF_FIXED: Mapping[str, tuple[tuple[Any, ...], str]] = MappingProxyType({
    "topk_method": (("noaux_tc",), "routing by top-k of score + bias, weighted by the unbiased "
                    "scores (noaux_tc)"),
    "n_group": ((1, None), "no group-limited routing"),
    "topk_group": ((1, None), "no group-limited routing"),
    "hidden_act": (("silu",), "SwiGLU experts"),
    "num_key_value_heads": ((1,), "one latent KV entry per token shared by every head"),
    "attention_bias": ((False, None), "attention projections without bias"),
    "tie_word_embeddings": ((False, None), "an output head of its own (head.weight)"),
    "first_k_dense_replace": ((0, None), "a MoE FFN in every layer"),
    "moe_layer_freq": ((1, None), "a MoE FFN in every layer"),
    "num_hash_layers": ((0, None), "no hash-routed layers"),
    "bos_token_id": ((BOS_ID,), f"BOS id {BOS_ID}"),
    "eos_token_id": ((EOS_ID, [EOS_ID]), f"EOS id {EOS_ID}"),
    "pad_token_id": ((PAD_ID, None), f"PAD id {PAD_ID}"),
})
# HF keys that do not change what dsv41 computes: accepted, each recorded as a note saying why.
HF_NOTED: Mapping[str, str] = MappingProxyType({
    "architectures": "the HF model class",
    "model_type": "the HF model class",
    "transformers_version": "the writer's transformers version",
    "auto_map": "HF remote-code classes",
    "_name_or_path": "where HF loaded it from",
    "use_cache": "an HF generation switch",
    "initializer_range": "training initialisation",
    "attention_dropout": "dropout, off at inference",
    "ep_size": "HF's expert-parallel world size (dsv41 shards with its own plan)",
    "intermediate_size": "the dense-MLP width; dsv41's layers have none (first_k_dense_replace 0)",
    "torch_dtype": "the dtype HF casts unquantised parameters to; dsv41 reads each tensor's "
                   "dtype from the files",
})
# keys whose value dsv41 derives from ModelArgs: key -> the value dsv41 implements
_HF_DERIVED = MappingProxyType({
    "qk_nope_head_dim": lambda a: a.head_dim - a.rope_head_dim,
    "v_head_dim": lambda a: a.head_dim,
    "kv_lora_rank": lambda a: a.head_dim,
})
# graph.formats.WEIGHT_TILE, the one FP8 weight tile the kernels read (not imported: this
# module stays free of torch, which graph.formats loads)
_FP8_WEIGHT_TILE = 32
_TORCH_DTYPES = ("bfloat16", "float16", "float32")  # an HF `dtype`; fp8/bf16 is ModelArgs.dtype


def args_from_hf(cfg: dict[str, Any], *, source: str = "config",
                 notes: list[str] | None = None) -> ModelArgs:
    """Build from the Hugging Face form (the hub's `config.json`): fields under `text_config`
    and `vision_config`, renamed keys, YaRN under `rope_scaling`, storage formats under
    `quantization_config`. Every key is mapped to its ModelArgs field (`HF_RENAMES`), checked
    to hold the value dsv41 implements (`HF_FIXED`, `_HF_DERIVED`, the quantisation), or
    accepted as bookkeeping that does not change the math (`HF_NOTED`; one line per key is
    appended to `notes`). Anything else -- an unknown key, a value dsv41 cannot honour, two
    keys that set one field differently -- is a ValueError naming the key and its value."""
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = dict(cfg.get("text_config") or {})
    vision = dict(cfg.get("vision_config") or {})
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    derived: dict[str, Any] = {}
    notes = [] if notes is None else notes

    def put(name: str, value: Any, key: str) -> None:
        if name in out and out[name] != _coerce(name, value):
            raise ValueError(f"{source}: {key!r} = {value!r} contradicts {origin[name]!r} = "
                             f"{out[name]!r} (both set ModelArgs.{name}).")
        out[name] = _coerce(name, value)
        origin[name] = key

    for scope in (top, text):
        for key, value in scope.items():
            if key == "rope_scaling":
                _hf_rope_scaling(value, put, source)
            elif key == "quantization_config":
                _hf_quantization(value, put, source)
            elif key in ("dtype", "torch_dtype") and value in _TORCH_DTYPES:
                notes.append(f"{key} = {value!r}: {HF_NOTED['torch_dtype']}")
            elif key in HF_FIXED:
                allowed, meaning = HF_FIXED[key]
                _check(value in allowed, f"{source}: {key!r} = {value!r} cannot be honoured: "
                       f"dsv41 implements {meaning} ({key} = {allowed[0]!r}).")
            elif key in _HF_DERIVED:
                derived[key] = value
            elif key in HF_NOTED:
                notes.append(f"{key} = {value!r}: {HF_NOTED[key]}")
            else:
                name = HF_RENAMES.get(key, key)
                if name not in _FIELD_NAMES:
                    raise ValueError(f"{source}: unknown config field {key!r} = {value!r}; it "
                                     "maps to no ModelArgs field and dsv41 cannot tell whether "
                                     "it changes the model.")
                put(name, value, key)
    for key, value in vision.items():
        if key == "model_type":
            notes.append(f"vision_config.{key} = {value!r}: {HF_NOTED[key]}")
            continue
        _check(key in HF_VISION_RENAMES, f"{source}: unknown vision_config field {key!r} = "
               f"{value!r}; it maps to no ModelArgs field.")
        put(HF_VISION_RENAMES[key], value, f"vision_config.{key}")
    args = ModelArgs(**out)
    for key, value in derived.items():
        want = _HF_DERIVED[key](args)
        _check(value == want, f"{source}: {key!r} = {value!r} cannot be honoured: dsv41 "
               f"derives it from the other fields as {want}.")
    return args


def _hf_rope_scaling(value: Any, put, source: str) -> None:
    if value is None:
        return
    rs = dict(value)
    kind = rs.pop("rope_type", rs.pop("type", "yarn"))
    _check(kind == "yarn", f"{source}: rope_scaling type {kind!r} is not 'yarn'.")
    for rk, name in (("factor", "rope_factor"), ("beta_fast", "beta_fast"),
                     ("beta_slow", "beta_slow"),
                     ("original_max_position_embeddings", "original_seq_len"),
                     ("rope_theta", "rope_theta")):
        if rk in rs:
            put(name, rs.pop(rk), f"rope_scaling.{rk}")
    rs.pop("mscale", None)
    rs.pop("mscale_all_dim", None)
    _check(not rs, f"{source}: unknown rope_scaling field(s) {sorted(rs)}.")


def _hf_quantization(value: Any, put, source: str) -> None:
    """The storage formats: FP8 E4M3 weights in 32x32 tiles with power-of-two (ue8m0) scales,
    activations quantised on the fly, routed experts as `expert_dtype`."""
    if value is None:
        return
    q = dict(value)
    method = q.pop("quant_method", "fp8")
    _check(method == "fp8", f"{source}: quantization_config.quant_method = {method!r} cannot "
           "be honoured: dsv41 reads the FP8 release ('fp8').")
    put("dtype", "fp8", "quantization_config.quant_method")
    if "expert_dtype" in q:
        put("expert_dtype", q.pop("expert_dtype"), "quantization_config.expert_dtype")
    for key, want in (("fmt", "e4m3"), ("scale_fmt", "ue8m0"), ("activation_scheme", "dynamic"),
                      ("weight_block_size", [_FP8_WEIGHT_TILE, _FP8_WEIGHT_TILE])):
        if key in q:
            got = q.pop(key)
            got = list(got) if isinstance(got, (list, tuple)) else got
            _check(got == want, f"{source}: quantization_config.{key} = {got!r} cannot be "
                   f"honoured: dsv41 implements {want!r}.")
    _check(not q, f"{source}: unknown quantization_config field(s) {sorted(q)}.")


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """The hub's `config.json` form of `args` (the inverse of `args_from_hf`): the HF
    bookkeeping keys, the storage formats under `quantization_config`, the text model under
    `text_config` with the hub's names, the ViT under `vision_config`."""
    d = args.to_dict()
    text_names = {v: k for k, v in HF_RENAMES.items()}
    vision_names = {v: k for k, v in HF_VISION_RENAMES.items()}
    text: dict[str, Any] = {"model_type": "deepseek_v41_text"}
    vision: dict[str, Any] = {"model_type": "deepseek_v41_vision"}
    for name, value in d.items():
        if name in ("dtype", "expert_dtype", "image_token_id") or name in (
                "rope_factor", "beta_fast", "beta_slow", "original_seq_len"):
            continue
        if name in vision_names:
            vision[vision_names[name]] = value
        else:
            text[text_names.get(name, name)] = value
    text.update(topk_method="noaux_tc", hidden_act="silu", num_key_value_heads=1,
                tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
                initializer_range=0.02,
                rope_scaling={"type": "yarn", "factor": args.rope_factor,
                              "beta_fast": args.beta_fast, "beta_slow": args.beta_slow,
                              "original_max_position_embeddings": args.original_seq_len})
    out: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "transformers_version": "4.57.0", "dtype": "bfloat16",
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "image_token_id": args.image_token_id, "tie_word_embeddings": False,
    }
    if args.dtype == "fp8":
        out["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [_FP8_WEIGHT_TILE, _FP8_WEIGHT_TILE],
            "expert_dtype": args.expert_dtype}
    else:
        text["dtype"] = args.dtype
        text["expert_dtype"] = args.expert_dtype
    out["text_config"] = text
    out["vision_config"] = vision
    return out


def load_config(path: str | Path, *, notes: list[str] | None = None) -> ModelArgs:
    """Read an inference or Hugging Face `config.json` (the form is told by `text_config`).
    The HF form's bookkeeping keys are appended to `notes` (and logged at INFO)."""
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
        notes = [] if notes is None else notes
        args = args_from_hf(d, source=str(path), notes=notes)
        for note in notes:
            _log.info("%s: accepted %s", path, note)
        return args
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
    """The released `inference/config.json`; runtime limits (batch, context) are dsv41's, and
    `wo_a` is read in the FP8 the hub ships (`wo_a_dtype`)."""
    return ModelArgs(wo_a_dtype="fp8")


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
        wo_a_dtype="fp8",  # as the hub ships it: half the o-projection's bytes
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
    "args_from_hf", "hf_config", "resolve_args", "engram_prime_buckets",
]
