"""Per-layer attention specs read from a Hugging Face ``config.json``.

Recognised ways configs say which layers are local (checked in this order):

- ``layer_types``: ``full_attention`` / ``sliding_attention`` / ``chunked_attention`` per layer (new transformers,
  GPT-OSS, Gemma-2/3, Qwen2, Llama-4 all write it now).
- Llama-4: ``no_rope_layers`` (1 = RoPE layer -> chunked, 0 = NoPE layer -> full) or ``no_rope_layer_interval``
  with ``attention_chunk_size``.
- Gemma-3: ``sliding_window_pattern`` (layer i is full when (i + 1) % pattern == 0); Gemma-2 alternates, even
  layers sliding.
- Qwen2: ``use_sliding_window`` + ``max_window_layers`` (layers at or above it slide).
- Mistral and others: ``sliding_window`` set means every layer slides.

Tensor parallelism divides KV heads across ranks; with fewer KV heads than ranks each rank keeps one
replicated head (Llama-4 Scout: 8 KV heads, TP 8 -> 1 per rank; TP 16 -> still 1).
"""

from __future__ import annotations

from typing import Any

from hybridkv.kv.dtypes import canonical_dtype, resolve_kv_dtype, resolve_model_dtype
from hybridkv.kv.specs import SPEC_TYPES, AttentionSpec


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal checkpoints nest it under ``text_config``)."""
    return config.get("text_config") or config


def llama4_rope_layers(cfg: dict[str, Any]) -> list[bool]:
    """Llama-4 text config: True for each RoPE layer (chunked attention), False for a NoPE one (full attention),
    from ``no_rope_layers`` (1 = RoPE) or, when that is empty, every ``no_rope_layer_interval``-th layer NoPE."""
    n = int(cfg["num_hidden_layers"])
    rope = cfg.get("no_rope_layers")
    if not rope:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(rope) < n:
        raise ValueError(f"no_rope_layers has {len(rope)} entries but num_hidden_layers is {n}")
    return [bool(r) for r in rope[:n]]


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """``full`` / ``sliding`` / ``chunked`` for each layer of the text model."""
    cfg = text_config(config)
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        names = {spec.hf_layer_type: kind for kind, spec in SPEC_TYPES.items()}
        kinds = [names.get(t, t) for t in cfg["layer_types"]]
        unknown = sorted(set(kinds) - set(names.values()))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; expected {sorted(names)}")
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries but num_hidden_layers is {n}")
        return _drop_unset_local(kinds, cfg)
    if cfg.get("attention_chunk_size") and (
        "no_rope_layers" in cfg or "no_rope_layer_interval" in cfg or cfg.get("model_type", "").startswith("llama4")
    ):
        return ["chunked" if r else "full" for r in llama4_rope_layers(cfg)]
    model_type = cfg.get("model_type", "")
    window = cfg.get("sliding_window")
    if window:
        if model_type.startswith("qwen2") or "max_window_layers" in cfg:
            if not cfg.get("use_sliding_window", False):
                return ["full"] * n
            start = int(cfg.get("max_window_layers", 0))
            return ["sliding" if i >= start else "full" for i in range(n)]
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if pattern:
            return ["full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(n)]
        if model_type == "gemma2":
            return ["sliding" if i % 2 == 0 else "full" for i in range(n)]
        return ["sliding"] * n
    return ["full"] * n


def _drop_unset_local(kinds: list[str], cfg: dict[str, Any]) -> list[str]:
    # Some configs list local layers while disabling them (Qwen2 with use_sliding_window false, no chunk size).
    if "sliding" in kinds and (not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False):
        kinds = ["full" if k == "sliding" else k for k in kinds]
    if "chunked" in kinds and not cfg.get("attention_chunk_size"):
        kinds = ["full" if k == "chunked" else k for k in kinds]
    return kinds


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if num_kv_heads >= tensor_parallel_size:
        if num_kv_heads % tensor_parallel_size:
            raise ValueError(
                f"{num_kv_heads} KV heads cannot be split evenly over tensor_parallel_size {tensor_parallel_size}"
            )
        return num_kv_heads // tensor_parallel_size
    if tensor_parallel_size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads cannot be replicated evenly over tensor_parallel_size {tensor_parallel_size}"
        )
    return 1


def checkpoint_dtype(config: dict[str, Any]) -> str:
    """The dtype the config says the weights are in (``torch_dtype``, or newer ``dtype``); bfloat16 if unsaid or
    unknown. ``{"torch_dtype": "float16"}`` -> ``"float16"``."""
    cfg = text_config(config)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return canonical_dtype(dtype) or "bfloat16"


def layer_specs_from_hf_config(
    config: dict[str, Any], tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto"
) -> list[AttentionSpec]:
    """One spec per layer, sized for one tensor-parallel rank. ``kv_cache_dtype`` ``auto``: as the engine on a GPU
    resolves it (``dtypes.resolve_kv_dtype``: bfloat16, what the model computes in there)."""
    cfg = text_config(config)
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    heads = kv_heads_per_rank(num_kv_heads, tensor_parallel_size)
    dtype = resolve_kv_dtype(kv_cache_dtype, resolve_model_dtype("auto", "cuda"))
    return [SPEC_TYPES[kind].from_hf_config(heads, head_dim, dtype, cfg) for kind in layer_kinds(config)]
