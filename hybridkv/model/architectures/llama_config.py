"""Model hyper-parameters read from a Hugging Face ``config.json`` (Llama-2/3, Llama-4 text, Mistral, Qwen2).

One flat, typed record so model code never touches the raw dict. Both spellings of RoPE settings are read:
the old ``rope_theta`` + ``rope_scaling`` keys and the new ``rope_parameters`` dict (transformers >= 5), the
new one winning where both are present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.kv.layer_specs import llama4_rope_layers, text_config

LLAMA_MODEL_TYPES = ("llama", "llama4", "llama4_text", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' default_theta per model type, used only when a config names no theta at all.
_DEFAULT_THETA = {"llama4_text": 500000.0}


@dataclass(slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    model_type: str  # of the text model: llama, llama4_text, mistral, qwen2
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP; in Llama-4 the size of each expert and of the shared expert
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v and o
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2)
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Llama-4 text. For other models: every layer uses RoPE, no MoE, no QK-norm, no temperature tuning.
    intermediate_size_mlp: int | None = None  # dense (non-MoE) layers of Llama-4
    attention_chunk_size: int | None = None
    rope_layers: tuple[bool, ...] = ()  # True: RoPE (chunked in Llama-4); False: NoPE (full attention)
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_layers: tuple[int, ...] = ()

    @property
    def is_llama4(self) -> bool:
        return self.model_type == "llama4_text"

    def uses_rope(self, layer_id: int) -> bool:
        return self.rope_layers[layer_id]

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layers

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        top_type = config.get("model_type")
        if top_type not in LLAMA_MODEL_TYPES:
            raise ValueError(f"model_type {top_type!r} is not supported; supported: {', '.join(LLAMA_MODEL_TYPES)}")
        cfg = text_config(config) if top_type == "llama4" else config
        model_type = "llama4_text" if top_type.startswith("llama4") else top_type
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only silu")
        base = _base_fields(cfg, model_type)
        extra = _llama4_fields(cfg, base["num_layers"]) if model_type == "llama4_text" else _plain_fields(cfg, base)
        return cls(**base, **extra)


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config is missing required field {key!r}")
    return cfg[key]


def _base_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return dict(
        model_type=model_type,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(cfg, _DEFAULT_THETA.get(model_type, 10000.0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _plain_fields(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    # Qwen2 hard-codes bias on q/k/v (not o) without a config key.
    return dict(rope_layers=(True,) * base["num_layers"], qkv_bias=base["model_type"] == "qwen2")


def _llama4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    moe_layers = cfg.get("moe_layers")
    if moe_layers is None:
        step = int(cfg.get("interleave_moe_layer_step", 1))
        moe_layers = list(range(step - 1, num_layers, step))
    chunk = cfg.get("attention_chunk_size", 8192)
    return dict(
        intermediate_size_mlp=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
        attention_chunk_size=None if chunk is None else int(chunk),
        rope_layers=tuple(llama4_rope_layers(cfg)),
        use_qk_norm=bool(cfg.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
        floor_scale=float(cfg.get("floor_scale", 8192)),
        attn_scale=float(cfg.get("attn_scale", 0.1)),
        num_local_experts=int(cfg.get("num_local_experts", 16)),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 1)),
        moe_layers=tuple(int(i) for i in moe_layers),
    )


def rope_from_hf(cfg: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """RoPE settings from ``rope_parameters`` (new) merged over ``rope_scaling`` + ``rope_theta`` (old)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters nested per layer type is not supported by this model")
    theta = params.get("rope_theta", cfg.get("rope_theta")) or default_theta
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    rope = RopeConfig(theta=float(theta), rope_type=rope_type)
    if rope_type in ("linear", "llama3"):
        rope.factor = float(_require(params, "factor"))
    if rope_type == "llama3":
        rope.low_freq_factor = float(_require(params, "low_freq_factor"))
        rope.high_freq_factor = float(_require(params, "high_freq_factor"))
        original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
        if original is None:
            raise ValueError("llama3 rope needs original_max_position_embeddings")
        rope.original_max_position_embeddings = int(original)
    return rope
