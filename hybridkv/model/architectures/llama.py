"""Llama-2/3 (and Mistral/Qwen2 layouts) and Llama-4 text decoders in plain torch.

All sequences of a step are flattened into one token dimension T; ``positions`` are each token's absolute
position within its own sequence. Attention itself (masks, caches, which tokens belong together) is the
backend's business: each layer hands it q, k, v after position encoding (see ``attention/base.py``).

Llama-4 differs from Llama-3 in ways that are easy to get wrong (checked against transformers 5.x):

- RoPE rotates interleaved pairs (dims 2i, 2i+1: the complex-number form of Meta's code), not the two halves
  of the head as Llama-3's ``rotate_half`` does.
- RoPE layers (``no_rope_layers[i] == 1``) are the chunked-attention layers; the others are NoPE full-attention
  layers.
- QK-norm, on RoPE layers only and after RoPE, is ``x * rsqrt(mean(x^2) + eps)`` with no weight (transformers
  calls it L2 norm but it is an RMS norm: unit RMS, not unit length).
- NoPE layers scale q by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (temperature tuning).
- MoE: sigmoid of the top-k router logits scales the expert's *input*, not its output; a shared expert is
  always added; non-MoE layers use a dense MLP of ``intermediate_size_mlp``.

Device dispatch is decided once, when the model is placed (``LlamaForCausalLM.place``, ``device_ops.py``): on CUDA
the norms, the position encoding, the MLP's activation and the MoE's routing run Triton kernels, elsewhere eager
torch; no forward asks which device it is on. A 4-bit model on the CPU is placed as ``CpuDecodeLlama``
(``llama_cpu_decode.py``).

Tensor parallelism (``tp``, see ``parallel.py``): each rank holds its query heads and their KV heads, a slice of
every MLP's, expert's and the shared expert's intermediate dimension, and a slice of the vocabulary. Norms and
the router are replicated, so every rank routes every token the same way; QK-norm (per head) and temperature
tuning (per token) need nothing from other ranks.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels.kv_slots import KVSlots
from hybridkv.model.attention.base import (
    AttentionBackend, OutputRows, PagedAttentionBackend, StepHalf, StoresKVFromKernels,
)
from hybridkv.model.architectures.device_ops import DeviceOps, bind_ops
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.llama_cpu_decode import CpuDecodeLlama
from hybridkv.model.architectures.norms import RMSNorm, unit_rms, unit_rms_kernel
from hybridkv.model.architectures.parallel import (
    ColumnParallelLinear,
    FusedColumns,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    source_shape,
    vocab_parallel_logits,
)
from hybridkv.model.architectures.position_encoding import (
    PositionTables, rope_cos_sin, rope_halves, rope_halves_tables, rope_interleaved, rope_inv_freq, rope_rolled,
    temperature_scales,
)
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.quantization.quantized_experts import float_stack, quantized_stack
from hybridkv.model.quantization.quantized_layers import is_quantized, move_model


@dataclass(slots=True)
class _HalfRun:
    """A step half's way through the layers (``LlamaForCausalLM._layers_in_halves``): its hidden rows, its residual
    stream, its position tables, and the all-reduces of its last block, still travelling."""

    x: torch.Tensor
    residual: torch.Tensor | None
    tables: PositionTables
    pending: list = field(default_factory=list)

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []


class Attention(DeviceOps, nn.Module):
    dispatched = ("_encode",)

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype | None, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.use_rope = cfg.uses_rope(layer_id)
        self.scale = cfg.head_dim**-0.5
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        tp.part(cfg.num_heads, "attention heads")
        h, q_part, kv_part = cfg.hidden_size, (tp.rank, tp.size), tp.kv_head_part(cfg.num_kv_heads)
        self.q_proj = ColumnParallelLinear(h, q_size, qkv_bias, dtype, q_part)
        self.k_proj = ColumnParallelLinear(h, kv_size, qkv_bias, dtype, kv_part)
        self.v_proj = ColumnParallelLinear(h, kv_size, qkv_bias, dtype, kv_part)
        self.o_proj = RowParallelLinear(q_size, h, cfg.attention_bias, dtype, tp)
        self.qkv = FusedColumns(self.q_proj, self.k_proj, self.v_proj)
        self.local_heads = (self.q_proj.out_features // cfg.head_dim, self.k_proj.out_features // cfg.head_dim)
        self.rope_kernel_fits = cfg.head_dim & (cfg.head_dim - 1) == 0  # CUDA's encoding kernel takes this head_dim

    def forward(self, x: torch.Tensor, tables: PositionTables, attn: AttentionBackend) -> torch.Tensor:
        q, kv = self._encode(x, tables, attn)
        if kv is None:
            out = attn.attend_stored(self.layer_id, q, self.scale)
        else:
            out = attn.attend(self.layer_id, q, *kv, self.scale)
        return self.o_proj(out.flatten(-2))

    def store(self, x: torch.Tensor, tables: PositionTables, attn: PagedAttentionBackend) -> torch.Tensor:
        """The first half of ``forward`` (``OutputRows``): every row's K/V stored in the cache; returns the
        position-encoded queries of every row."""
        q, kv = self._encode(x, tables, attn)
        if kv is not None:
            attn.write(self.layer_id, *kv)
        return q

    def attend_rows(self, q: torch.Tensor, attn: PagedAttentionBackend, outputs: OutputRows) -> torch.Tensor:
        """The second half: the output rows' queries (of ``store``) attend, and go through the output projection."""
        return self.o_proj(outputs.attend(attn, self.layer_id, q, self.scale).flatten(-2))

    def _encode_native(self, x: torch.Tensor, tables: PositionTables,
                       attn: AttentionBackend) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(q, (k, v)) position-encoded: ``_encode``'s eager torch."""
        qkv = self.qkv.joint(x) if tables.rolled is not None and self.use_rope else None
        if qkv is not None:  # q and k are neighbours in the fused output: one rotation over both
            q_heads, kv_heads = self.local_heads
            qk, v = qkv.view(x.shape[0], -1, self.cfg.head_dim).split_with_sizes((q_heads + kv_heads, kv_heads), dim=1)
            q, k = rope_rolled(qk, *tables.rolled).split_with_sizes((q_heads, kv_heads), dim=1)
            return q, (k, v)
        q, k, v = self._heads(x)
        q, k = self._position_encode(q, k, tables, unit_rms)
        return q, (k, v)

    def _encode_cuda(self, x: torch.Tensor, tables: PositionTables,
                     attn: AttentionBackend) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(q, (k, v)) position-encoded, or (q, None) where one kernel encoded q and k and stored k and v in the
        cache already (``kernels/rope.py``, for a power-of-two head_dim)."""
        q, k, v = self._heads(x)
        if not self.rope_kernel_fits:
            q, k = self._position_encode(q, k, tables, unit_rms_kernel)
        elif isinstance(attn, StoresKVFromKernels):
            return self._rope_kernel(q, k, tables, v, attn.kv_slots(self.layer_id))[0], None
        else:
            q, k = self._rope_kernel(q, k, tables)
        return q, (k, v)


    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        q, k, v = (part.unflatten(-1, (-1, d)) for part in self.qkv(x))
        return q, k, v

    def _encoding(self) -> tuple[bool, bool]:
        """(rotate, qk_norm): this layer rotates q and k (RoPE), and RMS-normalises them after (Llama-4's RoPE
        layers); a layer that does not rotate scales q by the temperature, if any."""
        cfg = self.cfg
        return self.use_rope or not cfg.is_llama4, cfg.is_llama4 and self.use_rope and cfg.use_qk_norm

    def _position_encode(self, q: torch.Tensor, k: torch.Tensor, tables: PositionTables,
                         norm) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k position-encoded in eager torch, QK-norm by ``norm`` (``unit_rms`` or, on CUDA, its kernel)."""
        rotate, qk_norm = self._encoding()
        if rotate:
            encode = rope_interleaved if self.cfg.is_llama4 else rope_halves
            q, k = encode(q, tables.cos, tables.sin), encode(k, tables.cos, tables.sin)
            if qk_norm:
                q, k = norm(q, self.cfg.rms_norm_eps), norm(k, self.cfg.rms_norm_eps)
        elif tables.temperature is not None:
            q = (q * tables.temperature).to(q.dtype)
        return q, k

    def _rope_kernel(self, q: torch.Tensor, k: torch.Tensor, tables: PositionTables, v: torch.Tensor | None = None,
                     slots: KVSlots | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_position_encode`` in one Triton kernel, which also stores k and v in the cache given ``slots``."""
        from hybridkv.kernels.rope import rope_qk  # triton is only needed on GPU

        cfg = self.cfg
        rotate, qk_norm = self._encoding()
        temperature = None if rotate else tables.temperature
        return rope_qk(q, k, tables.cos, tables.sin, rotate=rotate, interleaved=cfg.is_llama4, qk_norm=qk_norm,
                       eps=cfg.rms_norm_eps, temperature=temperature, v=v, slots=slots)


class MLP(DeviceOps, nn.Module):
    dispatched = ("forward",)

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype | None, tp: TPGroup, reduce: bool = True
    ) -> None:
        super().__init__()
        tp.part(intermediate, "MLP intermediate size")
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, bias, dtype, (tp.rank, tp.size))
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias, dtype, (tp.rank, tp.size))
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype, tp, reduce)
        self.gate_up = FusedColumns(self.gate_proj, self.up_proj)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """Once gate and up are one GEMM (``fuse_columns``), the activation in one kernel over its output."""
        if self.gate_up.weight is None:
            return self.forward_native(x)
        from hybridkv.kernels.moe_prefill import silu_mul  # triton is only needed on GPU

        return self.down_proj(silu_mul(self.gate_up.joint(x)))



class Experts(nn.Module):
    """Expert weights fused as transformers stores them: gate_up [E, H, 2I] (gate first), down [E, I, H]. Under an
    INT4 or FP8 format each is stacked output-major instead, a quantized linear's layout per expert: gate_up
    [E, 2I, H] (INT4: int32 [E, 2I, H // 8]), down [E, H, I], with their scales
    (``quantization/quantized_experts.py``).

    Under TP every rank holds every expert, sliced along I (gate and up alike): any expert's partial output is
    summed like a dense MLP's, and the load stays even however tokens route."""

    stacked_weights = ("gate_up_proj", "down_proj")  # the [E, K, N] stacks a format may quantize

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype | None, tp: TPGroup
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.start, self.local = tp.part(intermediate, "expert intermediate size")
        self.ranks = tp.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * self.local, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, self.local, hidden, dtype=dtype))

    @property
    def quantized(self) -> bool:
        return is_quantized(self)

    def load_shard(self, name: str, source) -> torch.Tensor:
        """This rank's slice of I: a float checkpoint stack in transformers' layout (its last dim for gate_up, its
        middle one for down), or the quantized stacks the reader gathers (gate_up's rows, down's input columns:
        packed words, e4m3 values, group scales and zero points alike; FP8's down scales, one per output channel,
        whole)."""
        lo, hi, full = self.start, self.start + self.local, self.intermediate
        float_stack = name in self.stacked_weights and (
            not isinstance(source, torch.Tensor)
            or (source.is_floating_point() and source.dtype != torch.float8_e4m3fn))
        if float_stack:
            if name == "down_proj":
                return source[:, lo:hi]
            return torch.cat((source[:, :, lo:hi], source[:, :, full + lo : full + hi]), dim=-1)
        if name.startswith("gate_up_proj"):
            return torch.cat((source[:, lo:hi], source[:, full + lo : full + hi]), dim=1)
        if len(source_shape(source)) == 2:  # FP8's down_proj_scale [E, H]: per output channel, on every rank
            return source
        cols = source_shape(source)[2]
        if cols % self.ranks:
            raise ValueError(f"experts.{name}: {cols} columns do not split over {self.ranks} ranks (the "
                             f"quantization group must divide each rank's {self.local} expert inputs)")
        part = cols // self.ranks
        rank = lo // self.local
        return source[:, :, rank * part : (rank + 1) * part]

    def stacks(self, dtype: torch.dtype, experts: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [e, H, 2I], down [e, I, H]) of ``experts`` in transformers' float layout: the parameters, or
        quantized experts' weights dequantized to ``dtype`` (the reference the quantized kernels are tested against)."""
        return (float_stack(self, "gate_up_proj", dtype, experts), float_stack(self, "down_proj", dtype, experts))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.stacks(x.dtype, slice(e, e + 1))
        gate, up = (x @ gate_up[0]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ down[0]


def fused_moe_max_pairs() -> int:
    """Decode-sized MoE batches (up to this many (token, choice) pairs) run the fused CUDA kernels."""
    from hybridkv.kernels.fused_moe import MAX_PAIRS  # triton is only needed on GPU

    return MAX_PAIRS


class MoE(DeviceOps, nn.Module):
    dispatched = ("forward", "fused", "routed")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False, dtype=dtype)
        self.experts = Experts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, dtype, tp)
        # summed together with the routed experts below: one all-reduce per MoE layer
        self.shared_expert = MLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, tp, reduce=False)
        # grouped_mm needs every row stride to be a multiple of 16 bytes (true of real models, not of every
        # tiny or oddly split one)
        item = self.experts.down_proj.element_size()
        local = self.experts.local
        self._grouped_mm_ok = hasattr(F, "grouped_mm") and all(
            (n * item) % 16 == 0 for n in (cfg.hidden_size, local, 2 * local))
        self._arrived: torch.Tensor | None = None  # the fused kernels' arrival counters (zero between launches)

    # the shared expert joins the fused kernels up to this many rows (tokens x (top_k + 1)): a Scout rank's batch
    # 1 step 4.50 -> 4.06 ms on an H200; at batch 32 cuBLAS reads it faster (benchmarks/gpu/decode.py)
    SHARED_IN_FUSED_ROWS = 16

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.routed(x).added_to(self.shared_expert(x)))

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused(x):
            return self.tp.all_reduce(self._fused_decode(x))
        return self.forward_native(x)

    def fused_native(self, x: torch.Tensor) -> bool:
        """``x``'s rows run the fused decode kernels (``_fused_decode``), shared and routed experts together."""
        return False

    def fused_cuda(self, x: torch.Tensor) -> bool:
        return x.shape[0] * self.top_k <= fused_moe_max_pairs()

    def routed_native(self, x: torch.Tensor) -> RoutedRows:
        """The routed experts' outputs for the rows of ``x``, each row's to be added to its shared-expert output."""
        top_ids, gates = self._route(x)
        return RoutedRows(self._routed(x, top_ids, gates), None, self.top_k)

    def routed_cuda(self, x: torch.Tensor) -> RoutedRows:
        top_ids, gates = self._route(x)
        if self.experts.quantized and self._sorts(top_ids):
            return self._routed_by_quantized_kernels(x, top_ids, gates)
        if self._grouped_mm_ok and not self.experts.quantized and self._sorts(top_ids):
            return self._routed_by_kernels(x, top_ids, gates)
        return RoutedRows(self._routed(x, top_ids, gates), None, self.top_k)


    def bind_ops(self, device: torch.device) -> None:
        super().bind_ops(device)
        self._arrived = None  # made on the device at the first fused step

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's top-k expert ids, their gates in ``x``'s dtype)."""
        top_logits, top_ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return top_ids, torch.sigmoid(top_logits.float()).to(x.dtype)

    def _fused_decode(self, x: torch.Tensor) -> torch.Tensor:
        """Decode sizes: the router in one launch, then the selected experts (with the shared expert, for few
        tokens once its gate/up is one weight) in three more; no host sync, so a CUDA graph holds it. Quantized (INT4,
        FP8) experts run ``kernels/quant_moe.py``'s decode kernels, the shared expert its own GEMMs."""
        from hybridkv.kernels.fused_moe import fused_moe, fused_moe_counters, route

        experts = self.experts
        if self._arrived is None:
            self._arrived = fused_moe_counters(experts.num_experts, experts.local, experts.hidden, x.device)
        top_ids, gates = route(x, self.router.weight, self.top_k, self._arrived)
        shared = self.shared_expert
        if experts.quantized:
            from hybridkv.kernels.quant_moe import quant_moe_decode

            routed = quant_moe_decode(x, gates, top_ids, quantized_stack(experts, "gate_up_proj").parts(),
                                      quantized_stack(experts, "down_proj").parts())
            return shared(x) + routed
        # the fused kernels read bf16 weights: a quantized shared expert runs its own GEMMs
        if (shared.gate_up.weight is None or is_quantized(shared.gate_up)
                or x.shape[0] * (self.top_k + 1) > self.SHARED_IN_FUSED_ROWS):
            routed = fused_moe(x, gates, top_ids, experts.gate_up_proj, experts.down_proj, self._arrived)
            return shared(x) + routed
        return fused_moe(x, gates, top_ids, experts.gate_up_proj, experts.down_proj, self._arrived,
                         shared=(shared.gate_up.weight, shared.down_proj.weight))

    def _routed(self, x: torch.Tensor, top_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        if self._grouped_mm_ok:
            return self._routed_by_grouped_mm(x, top_ids, gates)
        return self._routed_by_expert(x, top_ids, gates)

    def _routed_by_expert(self, x: torch.Tensor, top_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Only experts some token picked run, on only the tokens that picked them (reads the routing on the host).
        The reference the other two dispatches are tested against, and the path where torch lacks grouped_mm."""
        routed = torch.zeros_like(x)
        for e in top_ids.unique().tolist():
            rows, slot = (top_ids == e).nonzero(as_tuple=True)
            gated_in = x[rows] * gates[rows, slot, None]
            routed.index_add_(0, rows, self.experts.expert(e, gated_in))
        return routed

    def _routed_by_grouped_mm(self, x: torch.Tensor, top_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Prefill-sized batches on the CPU (on CUDA ``_routed_by_kernels``, unless the step is past its counting
        sort): (token, choice) pairs sorted by expert, then one grouped GEMM per projection.

        E.g. 3 tokens, top-1, ids [2, 0, 2] -> order [1, 0, 2], ends per expert [1, 1, 3]: rows 0..1 run through
        expert 0, none through expert 1, rows 1..3 through expert 2. No host sync and two launches instead of a
        Python loop over experts with a gather and scatter each."""
        num_experts = self.experts.num_experts
        gate_up_w, down_w = self.experts.stacks(x.dtype)
        ids = top_ids.reshape(-1)
        order = torch.argsort(ids, stable=True)
        # where each expert's rows end in the sorted ids; not bincount, whose CUDA kernel reads the ids' maximum on
        # the host: a sync per layer, after which the GPU idles while the host launches the layer's next kernels
        experts = torch.arange(num_experts, device=ids.device, dtype=ids.dtype)
        ends = torch.searchsorted(ids[order], experts, right=True).to(torch.int32)
        gated_in = x[order // self.top_k] * gates.reshape(-1)[order, None]
        gate, up = F.grouped_mm(gated_in, gate_up_w, offs=ends).chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, down_w, offs=ends)
        # back to (token, choice) order by a gather, much faster on GPU than scattering the rows into out[order]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        by_choice = out[inverse]
        if self.top_k == 1:
            return by_choice
        return by_choice.view(x.shape[0], self.top_k, -1).sum(dim=1)

    def _sorts(self, top_ids: torch.Tensor) -> bool:
        from hybridkv.kernels.moe_prefill import sorts  # triton is only needed on GPU

        return sorts(top_ids.numel(), self.experts.num_experts)

    def _routed_by_kernels(self, x: torch.Tensor, top_ids: torch.Tensor, gates: torch.Tensor) -> RoutedRows:
        """``_routed_by_grouped_mm``'s dispatch on CUDA, its sort, gathers and elementwise work in five Triton
        launches (``kernels/moe_prefill.py``, the last when the rows are added to the shared expert's output)."""
        from hybridkv.kernels.moe_prefill import gather_gated, silu_mul, sort_by_expert

        experts = self.experts
        ends, order, place = sort_by_expert(top_ids, experts.num_experts)
        gated_in = gather_gated(x, gates, order, self.top_k)
        hidden = silu_mul(F.grouped_mm(gated_in, experts.gate_up_proj, offs=ends))
        return RoutedRows(F.grouped_mm(hidden, experts.down_proj, offs=ends), place, self.top_k)

    def _routed_by_quantized_kernels(self, x: torch.Tensor, top_ids: torch.Tensor, gates: torch.Tensor
                                     ) -> RoutedRows:
        """``_routed_by_kernels`` over INT4 or FP8 experts: the same sort and gathers, each grouped GEMM a Triton
        kernel that dequantizes the expert's weight tiles as it multiplies (``kernels/quant_moe.py``): no bf16 copy
        of any expert, so the step needs no scratch beyond the rows' own activations."""
        from hybridkv.kernels.moe_prefill import gather_gated, silu_mul, sort_by_expert
        from hybridkv.kernels.quant_moe import quant_grouped_gemm

        experts = self.experts
        ends, order, place = sort_by_expert(top_ids, experts.num_experts)
        gated_in = gather_gated(x, gates, order, self.top_k)
        hidden = silu_mul(quant_grouped_gemm(gated_in, ends, *quantized_stack(experts, "gate_up_proj").parts()))
        out = quant_grouped_gemm(hidden, ends, *quantized_stack(experts, "down_proj").parts())
        return RoutedRows(out, place, self.top_k)


@dataclass(slots=True)
class RoutedRows:
    """A MoE step's routed-expert outputs (``MoE.routed``), added to the shared expert's output a row range at a
    time: the prefill halves run the routed experts over the whole step (``LlamaForCausalLM._moe_in_halves``).

    ``place`` None: ``out`` is [tokens, hidden], a row per token. Else ``out`` is [tokens * top_k, hidden] in expert
    order, token t's choice j at row ``place[t * top_k + j]``. E.g. top 1, tokens picking experts [2, 0, 2]:
    ``out`` holds token 1's row, then tokens 0 and 2's; ``place`` is [1, 0, 2]."""

    out: torch.Tensor
    place: torch.Tensor | None
    top_k: int

    def added_to(self, shared: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """``shared`` (the shared expert's output for token ``rows``) plus those tokens' routed outputs; on CUDA
        in ``shared``'s memory. Each row the same bits whether the rows come whole or in ranges."""
        if self.place is None:
            return shared + self.out[rows]
        from hybridkv.kernels.moe_prefill import add_routed

        k = self.top_k
        start, stop, _ = rows.indices(self.place.numel() // k)
        return add_routed(shared, self.out, self.place[start * k : stop * k], k)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype | None, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_id, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoE(cfg, dtype, tp)
        else:
            size = cfg.intermediate_size_mlp if cfg.is_llama4 else cfg.intermediate_size
            self.mlp = MLP(cfg.hidden_size, size, cfg.mlp_bias, dtype, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, tables: PositionTables, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add of each sublayer is done
        by the next norm, fused with it (``residual`` None: the first layer, ``x`` is the embedding)."""
        return self.mlp_block(*self.attention_block(x, residual, tables, attn), tables, attn)

    # The layer's two blocks, each ending in its one all-reduce under tensor parallelism.
    def attention_block(
        self, x: torch.Tensor, residual: torch.Tensor | None, tables: PositionTables, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(x, residual)
        return self.self_attn(h, tables, attn), residual

    def input_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual stream): ``residual`` None in the first layer, ``x`` the embedding."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.add_forward(x, residual, self.tp)

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor, tables: PositionTables, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.post_attention_layernorm.add_forward(x, residual, self.tp)
        return self.mlp(h), residual


class LlamaForCausalLM(DeviceOps, nn.Module):
    """Decoder + LM head. Parameter names follow transformers' with ``model.`` dropped and ``feed_forward`` ->
    ``mlp`` (see ``loading.weights.hf_to_local_name``). ``tp``: which tensor-parallel shard this is (default: the whole)."""

    # linears whose output only ever feeds a residual add (``DecoderLayer``'s, or the MoE's sum of its shared and
    # routed experts): any dtype that promotes to the residual's exactly may come out of them (``pack_int4_linears``)
    residual_branch_ends = ("o_proj", "down_proj")
    dispatched = ("position_tables",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        # on the model's device (``place``): no host-to-device copy in the steady state (and none in a CUDA graph)
        self._inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)

    # A CUDA graph can hold a forward of this many tokens (the fused MoE kernels have no host sync up to it).
    @property
    def max_graph_tokens(self) -> int:
        moe = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        return min((fused_moe_max_pairs() // m.top_k for m in moe), default=1 << 30)

    supports_cuda_graphs = True
    supports_step_halves = True
    decodes_apart = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                halves: list[StepHalf] | None = None, outputs: OutputRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for flattened tokens ``input_ids`` [T] at ``positions`` [T].

        ``halves`` (tensor parallelism, a paged ``attn``): the step's rows in two halves, each with its attention
        state, run block by block in turn so that one half's all-reduce travels while the other half computes.
        ``outputs`` (a paged ``attn``): only those rows' hidden states [N, hidden] are returned, and the last
        layer computes only them, past storing every row's K/V (``_output_layer``)."""
        tables = self.position_tables(positions)
        x, residual = self.embed_tokens(input_ids), None
        if halves:
            return self._layers_in_halves(x, tables, attn, halves, outputs)
        layers = self.layers if outputs is None else self.layers[:-1]
        with self.tp.summing_in_norms(x):  # under TP, small steps sum each layer's parts inside its next norm
            for layer in layers:
                x, residual = layer(x, residual, tables, attn)
            if outputs is not None:
                return self._output_layer([_HalfRun(x, residual, tables)], [None], attn, outputs)
            return self.norm.add_forward(x, residual, self.tp)[0] if residual is not None else self.norm(x)

    def place(self, device: torch.device | str, dtype: torch.dtype | None = None) -> CausalLM:
        """This model on ``device`` (in ``dtype``; None: as it is), every layer's ops bound for the device
        (``device_ops.py``). A 4-bit Llama-2/3 (``pack_int4_linears``) comes back as ``CpuDecodeLlama``: its
        small steps run its layers as one loop."""
        move_model(self, device, dtype)
        self.eval()
        bind_ops(self, device)
        self._inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim).to(device)
        return CpuDecodeLlama.of(self) or self

    def position_tables_native(self, positions: torch.Tensor) -> PositionTables:
        """What position encoding needs of ``positions`` in every layer; Llama-2/3's with ``rope_rolled``'s
        full-width tables, for one rotation over q and k together on the CPU."""
        tables = self.position_tables_cuda(positions)
        if not self.cfg.is_llama4:
            tables.rolled = rope_halves_tables(tables.cos, tables.sin)
        return tables

    def position_tables_cuda(self, positions: torch.Tensor) -> PositionTables:
        """cos, sin (and Llama-4's temperature) of ``positions``: what CUDA's encoding kernel reads."""
        cfg = self.cfg
        temperature = None
        if cfg.is_llama4 and cfg.attn_temperature_tuning:
            temperature = temperature_scales(positions, cfg.floor_scale, cfg.attn_scale)
        return PositionTables(*rope_cos_sin(self._inv_freq, positions), temperature)


    def _layers_in_halves(self, x: torch.Tensor, tables: PositionTables, attn, halves: list[StepHalf],
                          outputs: OutputRows | None = None):
        """Every layer's blocks, half A then half B, each block's all-reduce travelling while the other half
        computes. E.g. attention(A), attention(B) while A's sum travels, MLP(A) while B's does, ... Returns the
        final-normed hidden states of the whole step (of ``outputs``' rows, if given).

        On the copy engines (``TPGroup.pushing_half``) a half's next norm sums its part; through NCCL the
        all-reduce is deferred, and waited for when the half's next block starts."""
        runs = [_HalfRun(x[h.rows], None, tables.rows(h.rows)) for h in halves]
        tp = self.tp
        for layer in self.layers if outputs is None else self.layers[:-1]:
            self._block_in_halves(layer.attention_block, halves, runs, attn)
            if isinstance(layer.mlp, MoE) and not layer.mlp.fused(x):
                self._moe_in_halves(layer, halves, runs)
            else:
                self._block_in_halves(layer.mlp_block, halves, runs, attn)
        if outputs is not None:
            return self._output_layer(runs, [h.state for h in halves], attn, outputs)
        out = []
        for i, run in enumerate(runs):
            run.wait()
            with tp.pushing_half(i):
                out.append(self.norm.add_forward(run.x, run.residual, tp)[0])
        return torch.cat(out)

    def _output_layer(self, runs: list[_HalfRun], states: list, attn: PagedAttentionBackend,
                      outputs: OutputRows) -> torch.Tensor:
        """The last layer for ``outputs``' rows alone: each run (the whole step, or its two halves with their
        attention states; None: the current one) stores its rows' K/V, then only the output rows attend, and go
        through the MLP and the final norm. Returns their hidden states [N, hidden] (none in a mid-prompt chunk).

        No other row's output of this layer reaches the cache or the logits, so this is the same function of the
        output rows as the whole layer; their attention runs as decode queries (``OutputRows``)."""
        layer, tp = self.layers[-1], self.tp
        queries, residuals = [], []
        for i, (run, state) in enumerate(zip(runs, states)):
            run.wait()
            if state is not None:
                attn.step_state = state
            with tp.pushing_half(i) if state is not None else nullcontext():
                h, residual = layer.input_norm(run.x, run.residual)
            queries.append(layer.self_attn.store(h, run.tables, attn))
            residuals.append(residual)
        if outputs.state is None:
            return residuals[0].new_empty((0, residuals[0].shape[1]))
        pick = lambda parts: (parts[0] if len(parts) == 1 else torch.cat(parts))[outputs.rows]  # noqa: E731
        x = layer.self_attn.attend_rows(pick(queries), attn, outputs)
        x, residual = layer.mlp_block(x, pick(residuals), None, attn)
        return self.norm.add_forward(x, residual, tp)[0]

    def _block_in_halves(self, block, halves: list[StepHalf], runs: list[_HalfRun], attn) -> None:
        tp = self.tp
        for i, (half, run) in enumerate(zip(halves, runs)):
            run.wait()
            attn.step_state = half.state
            with tp.pushing_half(i), tp.deferring() as run.pending:
                run.x, run.residual = block(run.x, run.residual, run.tables, attn)

    def _moe_in_halves(self, layer: DecoderLayer, halves: list[StepHalf], runs: list[_HalfRun]) -> None:
        """A MoE block of both halves with its routed experts over the whole step's rows: the grouped GEMMs on
        half the rows took 43.5 ms of a Scout rank's 16K step over no context against 38.7 whole (one H200). Each
        half's sum still travels while other work runs: norm A, shared expert A (B's attention sum travelling),
        norm B, routed experts of all rows, A's output sent, shared expert B (A's travelling), B's output sent
        (the next layer's attention of A hides it)."""
        tp, moe = self.tp, layer.mlp
        # the residual's dtype: a CPU model's packed o_proj may hand a narrower one to the norm, which promotes it
        residual = runs[0].residual
        normed = residual.new_empty((sum(run.x.shape[0] for run in runs), residual.shape[1]))
        shared = []
        for i, (half, run) in enumerate(zip(halves, runs)):
            run.wait()
            with tp.pushing_half(i):
                run.residual = layer.post_attention_layernorm.add_forward(
                    run.x, run.residual, tp, normed[half.rows])[1]
            if i == 0:
                shared.append(moe.shared_expert(normed[half.rows]))
        routed = moe.routed(normed)
        for i, (half, run) in enumerate(zip(halves, runs)):
            if i:
                shared.append(moe.shared_expert(normed[half.rows]))
            with tp.pushing_half(i), tp.deferring() as run.pending:
                run.x = tp.all_reduce(routed.added_to(shared[i], half.rows))

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor | None:
        """float32 logits [N, vocab] for the hidden rows the caller picked (e.g. each sequence's last token).

        Under TP each rank computes its vocabulary slice; rank 0 gets them all, the other ranks None. ``argmax_only``:
        the caller reads only each row's argmax (``vocab_parallel_logits``)."""
        return vocab_parallel_logits(hidden, self.embed_tokens, self.lm_head, self.tp, self.cfg.vocab_size,
                                     argmax_only)
