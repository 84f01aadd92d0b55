"""A decode step of a 4-bit Llama-2/3 on CPU as one flat loop: ``LlamaForCausalLM.forward``'s arithmetic, bit for
bit, without the modules around it. ``LlamaForCausalLM.place`` returns the model wrapped in ``CpuDecodeLlama``
once its layers are packed 4-bit, so the model's own forward never asks which path to take.

A decode step of SmolLM2-135M (30 layers, one token) on one core spends ~3.5 ms in the 4-bit kernels (our Q4_1
kernel: ``q4_1_cpu.py``), ~1.5 ms in the int8 head, and the rest in ~30 small torch calls a layer and the Python
between them. Going through the
modules (each layer, its attention and MLP, every linear's ``nn.Module`` call, the fused groups' wrappers, each
linear's prefill branch) cost ~1.1 ms more a step. This loop calls the same helpers as the layers' own
forward (the norms' ``add_forward``, ``rope_rolled``, the backend's ``attend``) and each 4-bit linear's kernel
directly (``Int4Linear.rows``), in the same order on the same values, so its hidden states are the layers' own.

It runs steps whose every row takes the 4-bit kernel (``RowPaths.all_packed``: generated tokens', e.g. decode
steps) of a model whose every layer is a dense Llama-2/3 layer with q/k/v, o_proj, gate/up and down_proj all 4-bit
(``pack_int4_linears``: the embedded default); other steps run the model's own forward, and any other model is not
wrapped.

It reads the layers by their parts (norms, fused linears), not by their classes, so it does not import
``llama.py``, which imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.model.architectures.norms import RMSNorm
from hybridkv.model.architectures.position_encoding import PositionTables, rope_rolled
from hybridkv.model.attention.base import AttentionBackend, OutputRows
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.int4_cpu import Int4Columns, Int4Linear


@dataclass(slots=True)
class _Layer:
    """What a decode step reads of one ``DecoderLayer``."""

    layer_id: int
    input_norm: RMSNorm
    post_norm: RMSNorm
    qkv: Int4Linear  # q, k and v rows as one layer
    o_proj: Int4Linear
    gate_up: Int4Linear  # gate rows, then up rows
    down_proj: Int4Linear
    scale: float
    qk_v_heads: tuple[int, int]  # (q + k heads, v heads): q and k are rotated as one
    q_k_heads: tuple[int, int]
    gate_up_sizes: tuple[int, int]


@dataclass(slots=True)
class CpuDecodeLayers:
    """A 4-bit Llama's layers as one loop (``CpuDecodeLlama``)."""

    layers: list[_Layer]
    head_dim: int

    @classmethod
    def of(cls, layers: list[nn.Module], is_llama4: bool) -> CpuDecodeLayers | None:
        """The loop over ``layers`` (``llama.DecoderLayer``), or None unless every one is a dense Llama-2/3 layer
        (no MoE: that is Llama-4's) with RoPE whose linears are all 4-bit, q/k/v and gate/up each packed as one."""
        if is_llama4:
            return None
        found = [_layer_of(layer) for layer in layers]
        if not found or any(layer is None for layer in found):
            return None
        return cls(found, layers[0].self_attn.cfg.head_dim)

    def runs(self, tokens: int) -> bool:
        """This loop runs a step of ``tokens`` rows: each takes the 4-bit kernel (``RowPaths``)."""
        return self.layers[0].qkv.paths.all_packed(tokens)

    def __call__(self, x: torch.Tensor, tables: PositionTables, attn: AttentionBackend
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it) of the embedded tokens ``x`` [T, hidden],
        as ``DecoderLayer.forward`` leaves them."""
        d, tokens, residual = self.head_dim, x.shape[0], None
        for layer in self.layers:
            if residual is None:
                residual, h = x, layer.input_norm.forward(x)
            else:
                h, residual = layer.input_norm.add_forward(x, residual)
            qk, v = layer.qkv.rows(h).view(tokens, -1, d).split_with_sizes(layer.qk_v_heads, dim=1)
            q, k = rope_rolled(qk, *tables.rolled).split_with_sizes(layer.q_k_heads, dim=1)
            out = attn.attend(layer.layer_id, q, k, v, layer.scale)
            h, residual = layer.post_norm.add_forward(layer.o_proj.rows(out.flatten(-2)), residual)
            gate, up = layer.gate_up.rows(h).split_with_sizes(layer.gate_up_sizes, dim=-1)
            x = layer.down_proj.rows(F.silu(gate) * up)
        return x, residual


def _layer_of(layer: nn.Module) -> _Layer | None:
    attn, mlp = layer.self_attn, layer.mlp  # a Llama-2/3 layer's MLP: ``llama.MLP``
    if not (attn.use_rope and isinstance(attn.o_proj, Int4Linear) and isinstance(mlp.down_proj, Int4Linear)):
        return None
    qkv, gate_up = attn.qkv, mlp.gate_up
    if not (isinstance(qkv, Int4Columns) and qkv.whole is not None and isinstance(gate_up, Int4Columns)
            and gate_up.whole is not None):
        return None
    q_heads, kv_heads = attn.local_heads
    return _Layer(attn.layer_id, layer.input_layernorm, layer.post_attention_layernorm, qkv.whole, attn.o_proj,
                  gate_up.whole, mlp.down_proj, attn.scale, (q_heads + kv_heads, kv_heads), (q_heads, kv_heads),
                  tuple(gate_up.sizes))


class CpuDecodeLlama(nn.Module):
    """A ``CausalLM``: a 4-bit Llama-2/3 (``llama.LlamaForCausalLM``, placed on the CPU) whose steps of generated
    tokens only (``RowPaths.all_packed``) run ``CpuDecodeLayers``; others, the model's own forward. The model is its
    one child: the same parameters and modules, their names prefixed with ``model.``."""

    supports_cuda_graphs = False
    supports_step_halves = False
    max_graph_tokens = 0

    def __init__(self, model: nn.Module, loop: CpuDecodeLayers) -> None:
        super().__init__()
        self.model, self.loop = model, loop
        self.cfg, self.tp, self.residual_branch_ends = model.cfg, model.tp, model.residual_branch_ends

    @classmethod
    def of(cls, model: nn.Module) -> CpuDecodeLlama | None:
        """``model`` wrapped, or None where its layers do not all run in the loop (``CpuDecodeLayers.of``)."""
        loop = CpuDecodeLayers.of(list(model.layers), model.cfg.is_llama4)
        return None if loop is None else cls(model, loop)

    @property
    def lm_head(self) -> nn.Module | None:
        return self.model.lm_head

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """``LlamaForCausalLM.forward``'s hidden states (one rank: no step halves)."""
        model = self.model
        if not self.loop.runs(input_ids.shape[0]):
            return model(input_ids, positions, attn, outputs=outputs)
        tables = model.position_tables(positions)
        x, residual = self.loop(model.embed_tokens(input_ids), tables, attn)
        hidden = model.norm.add_forward(x, residual)[0]
        return hidden if outputs is None else hidden[outputs.rows]

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor | None:
        return self.model.compute_logits(hidden, argmax_only)

    def place(self, device: torch.device | str, dtype: torch.dtype | None = None) -> CausalLM:
        return self.model.place(device, dtype)
