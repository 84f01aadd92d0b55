"""Gemma-3 text decoder (``Gemma3ForCausalLM``, model_type ``gemma3_text``) in plain torch.

A ``CausalLM`` (``model/causal_lm.py``) like ``LlamaForCausalLM``, split over tensor-parallel ranks the same way
(heads, MLP intermediate dimension, vocabulary; norms replicated). Parameter names are transformers' with ``model.``
dropped, so ``loading.weights.load_weights`` takes HF-named tensors unchanged.

What differs from Llama (checked against transformers 5.x ``modeling_gemma3.py``):

- RMSNorm multiplies by ``1 + w`` (HF weights are stored zero-centred), computed in float32 then cast back.
- Four norms per layer ("sandwich"): input -> attention -> post_attention_layernorm -> residual add,
  pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> residual add.
- QK-norm: a weighted (1 + w) RMSNorm over head_dim on q and k, *before* RoPE.
- RoPE per layer type: ``full_attention`` layers use ``rope_theta`` (1e6, plus optional linear scaling),
  ``sliding_attention`` layers ``rope_local_base_freq`` (1e4); both rotate halves like Llama-3.
- Attention scale ``query_pre_attn_scalar ** -0.5`` (not head_dim's).
- MLP ``down(gelu_tanh(gate(x)) * up(x))``.
- Embeddings are multiplied by ``sqrt(hidden_size)`` (a float32 scalar cast to the weight dtype), and the LM head
  is tied to them. Optional final logit soft-capping ``tanh(l / c) * c``.

Which layers slide (and the window) is the attention backend's business; here the layer type only picks the RoPE
base. Layer types come from ``hybridkv.kv.layer_specs.layer_kinds`` -- the same source the KV cache uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kv.layer_specs import layer_kinds, text_config
from hybridkv.model.attention.base import AttentionBackend, OutputRows, PagedAttentionBackend
from hybridkv.model.architectures.llama_config import ROPE_TYPES, RopeConfig
from hybridkv.model.architectures.parallel import (
    ColumnParallelLinear,
    FusedColumns,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from hybridkv.model.architectures.device_ops import bind_ops
from hybridkv.model.architectures.position_encoding import rope_cos_sin, rope_halves, rope_inv_freq
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.quantization.quantized_layers import move_model

GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
_GLOBAL_THETA = 1_000_000.0  # transformers' Gemma3TextConfig.default_theta
_LOCAL_THETA = 10_000.0


@dataclass(slots=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_full: RopeConfig
    rope_sliding: RopeConfig
    layer_kinds: tuple[str, ...]  # "full" / "sliding" per layer
    query_pre_attn_scalar: float = 256.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)
    model_type: str = "gemma3_text"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Gemma3Config:
        if config.get("model_type") not in GEMMA3_MODEL_TYPES:
            raise ValueError(f"model_type {config.get('model_type')!r} is not a Gemma-3 model")
        cfg = text_config(config)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported; only gelu_pytorch_tanh")
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma-3 checkpoints do not set it)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id", 1)
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        rope_full, rope_sliding = _gemma3_ropes(cfg)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or 256),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_full=rope_full,
            rope_sliding=rope_sliding,
            layer_kinds=tuple(layer_kinds(_with_gemma3_pattern(cfg))),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", True))),
            attention_bias=bool(cfg.get("attention_bias", False)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            bos_token_id=cfg.get("bos_token_id", 2),
            eos_token_ids=eos_ids,
        )


def _with_gemma3_pattern(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' Gemma3TextConfig default: without ``layer_types``, every 6th layer is full."""
    if cfg.get("layer_types") or cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern"):
        return cfg
    return {**cfg, "sliding_window_pattern": 6, "sliding_window": cfg.get("sliding_window", 4096)}


def _gemma3_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(full, sliding) RoPE from ``rope_parameters`` nested per layer type (transformers >= 5) or the old keys
    ``rope_theta`` + ``rope_scaling`` (full layers) and ``rope_local_base_freq`` (sliding layers)."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    sliding = dict(params.get("sliding_attention") or {})
    if cfg.get("rope_scaling"):
        full = {**cfg["rope_scaling"], **full}
    full.setdefault("rope_theta", cfg.get("rope_theta") or _GLOBAL_THETA)
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq") or _LOCAL_THETA)
    return _rope(full), _rope(sliding)


def _rope(params: dict[str, Any]) -> RopeConfig:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear"):
        raise ValueError(f"Gemma-3 rope_type {rope_type!r} is not supported; supported: default, linear")
    assert rope_type in ROPE_TYPES
    return RopeConfig(theta=float(params["rope_theta"]), rope_type=rope_type, factor=float(params.get("factor", 1.0)))


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, cast back (transformers' Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_id: int, dtype: torch.dtype | None, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.sliding = cfg.layer_kinds[layer_id] == "sliding"
        self.scale = cfg.query_pre_attn_scalar**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        tp.part(cfg.num_heads, "attention heads")
        h, bias = cfg.hidden_size, cfg.attention_bias
        q_part, kv_part = (tp.rank, tp.size), tp.kv_head_part(cfg.num_kv_heads)
        self.q_proj = ColumnParallelLinear(h, q_size, bias, dtype, q_part)
        self.k_proj = ColumnParallelLinear(h, kv_size, bias, dtype, kv_part)
        self.v_proj = ColumnParallelLinear(h, kv_size, bias, dtype, kv_part)
        self.o_proj = RowParallelLinear(q_size, h, bias, dtype, tp)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.qkv = FusedColumns(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self._encode(x, rope)
        return self.o_proj(attn.attend(self.layer_id, q, k, v, self.scale).flatten(-2))

    def store(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              attn: PagedAttentionBackend) -> torch.Tensor:
        """``forward``'s first half (``OutputRows``): every row's K/V stored; returns every row's encoded queries."""
        q, k, v = self._encode(x, rope)
        attn.write(self.layer_id, k, v)
        return q

    def attend_rows(self, q: torch.Tensor, attn: PagedAttentionBackend, outputs: OutputRows) -> torch.Tensor:
        """Its second half: the output rows' queries attend, and go through the output projection."""
        return self.o_proj(outputs.attend(attn, self.layer_id, q, self.scale).flatten(-2))

    def _encode(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        d = self.cfg.head_dim
        q, k, v = (part.unflatten(-1, (-1, d)) for part in self.qkv(x))
        q, k = self.q_norm(q), self.k_norm(k)
        return rope_halves(q, *rope), rope_halves(k, *rope), v


class Gemma3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None, tp: TPGroup) -> None:
        super().__init__()
        tp.part(intermediate, "MLP intermediate size")
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, False, dtype, (tp.rank, tp.size))
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, dtype, (tp.rank, tp.size))
        self.down_proj = RowParallelLinear(intermediate, hidden, False, dtype, tp)
        self.gate_up = FusedColumns(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_id: int, dtype: torch.dtype | None, tp: TPGroup) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = Gemma3Attention(cfg, layer_id, dtype, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = Gemma3MLP(h, cfg.intermediate_size, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, attn))
        return self._mlp_block(x)

    def output_rows(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: PagedAttentionBackend,
                    outputs: OutputRows) -> torch.Tensor:
        """``forward`` for ``outputs``' rows alone, past storing every row's K/V (``LlamaForCausalLM._output_layer``)."""
        q = self.self_attn.store(self.input_layernorm(x), rope, attn)
        if outputs.state is None:
            return x[:0]
        x = x[outputs.rows]
        x = x + self.post_attention_layernorm(self.self_attn.attend_rows(q[outputs.rows], attn, outputs))
        return self._mlp_block(x)

    def _mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    """``tp``: which tensor-parallel shard this is (default: the whole), split as ``LlamaForCausalLM`` is."""

    def __init__(self, cfg: Gemma3Config, dtype: torch.dtype | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        # A float32 scalar cast to the weight dtype, as transformers does (bf16 rounds sqrt(640) to 25.25).
        self.embed_scale = cfg.hidden_size**0.5
        # RoPE frequencies per layer kind and the embedding scale, on the model's device (``place``): the steady
        # state copies nothing from the host (a CUDA graph could not hold such a copy)
        self._constants = self._device_constants(torch.device("cpu"))

    supports_cuda_graphs = True
    residual_branch_ends = ()  # its post-attention and post-MLP norms read o_proj's and down_proj's outputs first
    supports_step_halves = False  # its layers run whole steps (only Llama's overlap their all-reduces)
    decodes_apart = False
    max_graph_tokens = 1 << 30  # no MoE: nothing in the forward limits a graph's batch

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for flattened tokens ``input_ids`` [T] at ``positions`` [T]; of
        ``outputs``' rows only if given, its last layer computing only them (``OutputRows``)."""
        inv_freqs, scale = self._constants
        ropes = {kind: rope_cos_sin(inv_freq, positions) for kind, inv_freq in inv_freqs.items()}
        x = self.embed_tokens(input_ids) * scale
        layers = [(layer, ropes["sliding" if kind == "sliding" else "full"])
                  for layer, kind in zip(self.layers, self.cfg.layer_kinds)]
        for layer, rope in layers if outputs is None else layers[:-1]:
            x = layer(x, rope, attn)
        if outputs is not None:
            layer, rope = layers[-1]
            x = layer.output_rows(x, rope, attn, outputs)
        return self.norm(x)

    def place(self, device: torch.device | str, dtype: torch.dtype | None = None) -> CausalLM:
        """This model on ``device`` (in ``dtype``; None: as it is), its linears' GEMMs bound for the device."""
        move_model(self, device, dtype)
        self.eval()
        bind_ops(self, device)
        self._constants = self._device_constants(torch.device(device))
        return self

    def _device_constants(self, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        cfg, dtype = self.cfg, self.embed_tokens.weight.dtype
        inv_freqs = {"full": rope_inv_freq(cfg.rope_full, cfg.head_dim).to(device),
                     "sliding": rope_inv_freq(cfg.rope_sliding, cfg.head_dim).to(device)}
        return inv_freqs, torch.tensor(self.embed_scale, dtype=torch.float32, device=device).to(dtype)

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor | None:
        """float32 logits [N, vocab] for the hidden rows the caller picked (e.g. each sequence's last token).

        Under TP each rank computes its vocabulary slice; rank 0 gets them all, the other ranks None. ``argmax_only``:
        the caller reads only each row's argmax (``vocab_parallel_logits``)."""
        logits = vocab_parallel_logits(hidden, self.embed_tokens, self.lm_head, self.tp, self.cfg.vocab_size,
                                       argmax_only)
        if logits is None:
            return None
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
