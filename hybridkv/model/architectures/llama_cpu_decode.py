"""A decode step of a 4-bit Llama-2/3 on CPU without the modules around it: as one call into C
(``NativeDecode``, ``hybridkv/model/cpu_decode.c``) where our Q4_1 kernel runs the layers, else as one flat torch
loop (``CpuDecodeLayers``): ``LlamaForCausalLM.forward``'s arithmetic, bit for bit. ``LlamaForCausalLM.place``
returns the model wrapped in ``CpuDecodeLlama`` once its layers are packed 4-bit, so the model's own forward never
asks which path to take.

A decode step of SmolLM2-135M (30 layers, one token) on one core spends ~3.5 ms in the 4-bit kernels (our Q4_1
kernel: ``q4_1_cpu.py``) and ~1.5 ms in the int8 head. In torch, ~30 small calls a layer (norms, RoPE, the K/V
store, attention's gathers and its kernel, SiLU) and the Python between them took ~6 ms more, and a second thread
did not shorten them. The C step runs every layer's norms, RoPE, K/V store, attention over the paged cache, SiLU
and the 4-bit linears in one OpenMP parallel region, the threads meeting at barriers between phases.

Its norms, SiLU and attention are its own arithmetic (float32, within a few ulps of torch's, the same bits at
every instruction set and thread count), not torch's, so a generated token's row must always take it: a step
holding prompt rows too runs its generated sequences apart (``CausalLM.decodes_apart``, the runner), through the
C step, and a row's numbers do not depend on what else the step holds.

The torch loop calls the same helpers as the layers' own forward (the norms' ``add_forward``, ``rope_rolled``, the
backend's ``attend``) and each 4-bit linear's kernel directly (``Int4Linear.rows``), in the same order on the same
values, so its hidden states are the layers' own (going through the modules cost ~1.1 ms more a step). It runs
where the C step does not: torch's int4 kernel (our kernel not built), another attention backend, a KV cache that
is not float32.

Either runs steps whose every row takes the 4-bit kernel (``RowPaths.all_packed``: generated tokens', e.g. decode
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
from hybridkv.model.attention.torch_paged import TorchPagedAttention
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.int4_cpu import Int4Columns, Int4Linear
from hybridkv.model.q4_1_cpu import Q41Kernel


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


@dataclass(slots=True)
class NativeDecode:
    """A decode step of every layer and the final norm in one C call (``cpu_decode.c``, through our Q4_1 kernel's
    module): the layers' weights as a table of data pointers made once, the cache's and the step's from the
    attention backend (``TorchPagedAttention.decode_caches``, ``decode_rows``)."""

    kernel: Q41Kernel  # its instruction set and threads are the step's
    table: torch.Tensor  # int64 [layers, 10]: cpu_decode.c's LAYER_* fields
    sizes: tuple[int, ...]  # hidden, q heads, KV heads, head_dim, intermediate
    eps: float
    scale: float
    final_norm: torch.Tensor
    tensors: list[torch.Tensor]  # every tensor ``table`` points into, kept alive with it

    @classmethod
    def of(cls, loop: CpuDecodeLayers, final_norm: RMSNorm) -> NativeDecode | None:
        """The C step of ``loop``'s layers, or None where our Q4_1 kernel does not run them all, or their sizes or
        norms differ from what the C step takes (float32 norms of one eps, blocks of 32 inputs)."""
        layers = loop.layers
        linears = [linear for layer in layers for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
        kernel = linears[0].kernel
        norms = [norm for layer in layers for norm in (layer.input_norm, layer.post_norm)] + [final_norm]
        q_heads, kv_heads = layers[0].q_k_heads
        sizes = (linears[0].in_features, q_heads, kv_heads, loop.head_dim, layers[0].gate_up_sizes[0])
        if (kernel is None or any(linear.kernel is not kernel for linear in linears)
                or [layer.layer_id for layer in layers] != list(range(len(layers)))
                or len({norm.eps for norm in norms}) != 1 or len({layer.scale for layer in layers}) != 1
                or any(t.dtype != torch.float32 for t in [n.weight for n in norms] + [l.bias for l in linears
                                                                                    if l.bias is not None])
                or any(size % 32 for size in (sizes[0], sizes[3], sizes[4]))):
            return None
        tensors = [_layer_tensors(layer) for layer in layers]
        table = torch.tensor([[0 if t is None else t.data_ptr() for t in row] for row in tensors])
        return cls(kernel, table, sizes, norms[0].eps, layers[0].scale, final_norm.weight,
                   [t for row in tensors for t in row if t is not None])

    def __call__(self, x: torch.Tensor, tables: PositionTables, attn: AttentionBackend) -> torch.Tensor | None:
        """The final-normed hidden states [R, hidden] of the embedded tokens ``x``, one generated token a sequence,
        their K/V stored in the cache; None where the C step does not run this step: another backend, a cache
        that is not float32, a step that is not a decode step."""
        if not isinstance(attn, TorchPagedAttention) or x.dtype != torch.float32:
            return None
        caches, step = attn.decode_caches(), attn.decode_rows()
        if caches is None or step is None:
            return None
        rows, blocks = step
        cos, sin = (t.contiguous() for t in tables.rolled)
        x = x.contiguous()
        out = torch.empty_like(x)
        code = self.kernel.ext.decode_step(
            self.table.data_ptr(), caches.data_ptr(), rows.data_ptr(), blocks.data_ptr(), x.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), self.final_norm.data_ptr(), out.data_ptr(), len(self.table),
            *self.sizes, x.shape[0], attn.block_size, self.eps, self.scale, self.kernel.threads, self.kernel.isa)
        if code:
            raise RuntimeError(f"the C decode step failed ({'out of memory' if code == -2 else 'bad arguments'})")
        return out


def _layer_tensors(layer: _Layer) -> list[torch.Tensor | None]:
    """What ``NativeDecode.table`` points at for one layer, in cpu_decode.c's LAYER_* order (None: no bias)."""
    return [layer.input_norm.weight, layer.post_norm.weight, *(t for linear in (layer.qkv, layer.o_proj,
            layer.gate_up, layer.down_proj) for t in (linear.q4_1, linear.bias))]


class CpuDecodeLlama(nn.Module):
    """A ``CausalLM``: a 4-bit Llama-2/3 (``llama.LlamaForCausalLM``, placed on the CPU) whose steps of generated
    tokens only (``RowPaths.all_packed``) run the C step (``NativeDecode``) where it runs them, else
    ``CpuDecodeLayers``; others, the model's own forward. The model is its one child: the same parameters and
    modules, their names prefixed with ``model.``."""

    supports_cuda_graphs = False
    supports_step_halves = False
    max_graph_tokens = 0
    native: NativeDecode | None

    def __init__(self, model: nn.Module, loop: CpuDecodeLayers) -> None:
        super().__init__()
        self.model, self.loop = model, loop
        self.cfg, self.tp, self.residual_branch_ends = model.cfg, model.tp, model.residual_branch_ends
        self.native = NativeDecode.of(loop, model.norm)

    @property
    def decodes_apart(self) -> bool:
        """A generated token's row takes the C step (``NativeDecode``), whose numbers are not the model's own
        forward's: the runner runs a step's generated sequences apart from its prompt sequences."""
        return self.native is not None

    def _apply(self, fn, recurse: bool = True):
        # the C step's table holds data pointers: made again for the tensors a move leaves
        super()._apply(fn, recurse)
        self.native = NativeDecode.of(self.loop, self.model.norm)
        return self

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
        tables, x = model.position_tables(positions), model.embed_tokens(input_ids)
        hidden = None if self.native is None else self.native(x, tables, attn)
        if hidden is None:
            x, residual = self.loop(x, tables, attn)
            hidden = model.norm.add_forward(x, residual)[0]
        return hidden if outputs is None else hidden[outputs.rows]

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor | None:
        return self.model.compute_logits(hidden, argmax_only)

    def place(self, device: torch.device | str, dtype: torch.dtype | None = None) -> CausalLM:
        return self.model.place(device, dtype)
