"""Tensor-parallel building blocks: the group a rank belongs to, and layers that hold one rank's slice.

Megatron's split, as vLLM and nano-vllm do it: a column-parallel linear keeps a slice of the output features
(no communication), the row-parallel linear after it keeps the matching slice of the input features and sums
the ranks' partial outputs with one all-reduce. Attention splits heads (KV heads too, or replicates one KV head
per rank when there are fewer KV heads than ranks); MLPs split the intermediate dimension; the embedding and
LM head split the vocabulary.

With one rank every layer here is exactly its plain torch counterpart (same parameter names and shapes, same
kernels, no torch.distributed), so TP=1 models compute what they always did.

Each parallel module names its slice of a checkpoint tensor in ``load_shard(param_name, source)``; ``source`` is a
full tensor or a lazy safetensors slice, so a rank reads only its part from disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridkv.model.architectures.collectives import CopyEngineSums, OneShotAllReduce
from hybridkv.model.architectures.device_ops import DeviceOps
from hybridkv.model.quantization.quantized_layers import QUANT_PARAMS, QuantizedGemm, is_quantized

if TYPE_CHECKING:
    from hybridkv.model.int8_head_cpu import Int8ArgmaxHead


@dataclass(slots=True)
class TPGroup:
    """This process's place in its tensor-parallel group. ``size == 1``: torch.distributed is never touched."""

    rank: int = 0
    size: int = 1
    # small CUDA all-reduces (decode steps) over peer buffers instead of NCCL; set up by ``connect``
    one_shot: OneShotAllReduce | None = field(default=None, repr=False, compare=False)
    # while ``deferring``: the NCCL/gloo all-reduces launched since, to wait for before their results are read
    deferred: list[dist.Work] | None = field(default=None, repr=False, compare=False)
    # while ``summing_in_norms``: one-shot all-reduces are left to the RMSNorm after them (``add_norm``)
    norm_sums: bool = field(default=False, repr=False, compare=False)
    # prefill halves' all-reduces on the copy engines; set up by ``connect`` when given the slots' shape
    copy_sums: CopyEngineSums | None = field(default=None, repr=False, compare=False)
    # while ``pushing``: the step half whose all-reduces go to ``copy_sums``, summed by the RMSNorm after them
    pushing: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor_parallel_size must be >= 1 (and rank below it), got {self.rank} of {self.size}")

    def connect(self, store: dist.Store, backend: str, timeout_s: float, custom_all_reduce: bool = True,
                sum_slots: tuple[int, int, torch.dtype] | None = None) -> None:
        """Join the group's ranks (torch.distributed's default group); a collective that waits longer than
        ``timeout_s`` raises, so a hung rank cannot hang the others forever. On GPUs that reach each other's
        memory, small all-reduces then take the one-shot path unless ``custom_all_reduce`` is off, and with
        ``sum_slots`` (rows, hidden, dtype: half a step's message) prefill halves sum on the copy engines."""
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size, timeout=timeout)
        if backend == "nccl" and custom_all_reduce:
            device = torch.device("cuda", torch.cuda.current_device())
            if OneShotAllReduce.usable(device, self.size):
                # the store's port names the group: the same on every rank, new for every engine in a process
                self.one_shot = OneShotAllReduce(device, store, f"hybridkv-tp-{store.port}")
                if sum_slots is not None:
                    self.copy_sums = CopyEngineSums(device, self.one_shot.group, *sum_slots)

    def leave(self) -> None:
        self.one_shot = self.copy_sums = None
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def part(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``n`` items."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) cannot be split evenly over tensor_parallel_size {self.size}")
        length = n // self.size
        return self.rank * length, length

    def kv_head_part(self, num_kv_heads: int) -> tuple[int, int]:
        """(index, count) of this rank's KV-head shard: heads are split, or one is replicated when too few."""
        if num_kv_heads >= self.size:
            return self.rank, self.size
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {self.size} ranks")
        # rank r's query heads (r * H / size onwards) all read KV head r * kv / size
        return self.rank * num_kv_heads // self.size, num_kv_heads

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks: in place through NCCL/gloo, or a new tensor from the one-shot path."""
        if self.size == 1 or self.norm_sums:
            return x
        if self.pushing is not None:
            self.copy_sums.push(x, self.pushing)
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        if self.deferred is not None:
            self.deferred.append(dist.all_reduce(x, async_op=True))
            return x
        dist.all_reduce(x)
        return x

    @contextmanager
    def deferring(self) -> Iterator[list[dist.Work]]:
        """Inside, NCCL/gloo all-reduces are launched without waiting: ``x`` holds the sum only once every work
        in the yielded list has been waited for (on CUDA ``wait()`` orders the current stream after it, the host
        goes on). So a caller computes something else while the sum travels (``llama.py``'s prefill halves)."""
        self.deferred = works = []
        try:
            yield works
        finally:
            self.deferred = None

    @contextmanager
    def pushing_half(self, half: int) -> Iterator[None]:
        """Inside, with copy-engine sums set up, an all-reduce sends this rank's part of step half ``half`` to
        its peers and returns it unsummed; the caller passes it to ``add_norm`` (within ``pushing_half`` of the
        same half) and nothing else, as in ``summing_in_norms``. Without them, nothing changes."""
        self.pushing = half if self.copy_sums is not None else None
        try:
            yield
        finally:
            self.pushing = None

    @property
    def sums_in_norms(self) -> bool:
        """The all-reduce before the next norm left its sum to the norm (``add_norm``)."""
        return self.norm_sums or self.pushing is not None

    @contextmanager
    def summing_in_norms(self, x: torch.Tensor) -> Iterator[None]:
        """Inside, when the one-shot path takes messages of ``x``'s size, ``all_reduce`` returns this rank's part
        unsummed, and the RMSNorm that follows sums it (``add_norm``): the caller passes every such result to
        ``add_norm`` and nothing else. A decode step's layers, whose every all-reduce feeds a residual add and norm."""
        self.norm_sums = self.size > 1 and self.one_shot is not None and self.one_shot.fits(x)
        try:
            yield
        finally:
            self.norm_sums = False

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x + residual) * weight (into ``out`` if given) with ``x`` summed over ranks first, inside
        ``summing_in_norms``; the sum plus residual is left in ``residual``; within ``pushing_half``, ``x`` is
        that half's part of its last all-reduce."""
        if self.pushing is not None:
            return self.copy_sums.add_norm(x, residual, weight, eps, self.pushing, out)
        y = self.one_shot.add_norm(x, residual, weight, eps)
        return y if out is None else out.copy_(y)

    def gathers_one_shot(self, rows: int, cols: int, dtype: torch.dtype) -> bool:
        """``gather_last_dim`` of a [rows, cols] tensor goes through the one-shot buffer, not NCCL."""
        if self.one_shot is None:
            return False
        return self.one_shot.takes(rows * self.size * cols * dtype.itemsize, dtype)

    def from_rank0(self, x: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
        """Rank 0's int64 ``x`` [n] on every rank (a broadcast): the other ranks pass None and get a new tensor.
        Async scheduling's input ids, which exist only on rank 0's device when the workers get their step."""
        if self.size == 1:
            return x
        if self.rank != 0:
            x = torch.empty(n, dtype=torch.int64, device=device)
        elif x.shape != (n,) or x.dtype != torch.int64:
            raise ValueError(f"rank 0 broadcasts int64 [{n}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        dist.broadcast(x, src=0)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0; other ranks get None.

        An all-gather, not a gather: NCCL's gather is point-to-point sends, and a CUDA graph of a decode step
        holds the collective (the logits slices are small: rows x vocab / ranks)."""
        if self.size == 1:
            return x
        if self.gathers_one_shot(x.shape[0], x.shape[-1], x.dtype):
            # a sum where each entry has one non-zero term (exact), through the peer buffers: a CUDA graph holds it
            parts = x.new_zeros((x.shape[0], self.size, x.shape[-1]))
            parts[:, self.rank] = x
            gathered = self.one_shot(parts.view(x.shape[0], -1))
            return gathered if self.rank == 0 else None
        x = x.contiguous()
        parts = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # rank r's rows at r * rows (gloo's layout)
        # torch 2.13 renamed it; the GPU image's 2.11 has only the old name
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(parts, x)
        return torch.cat(parts.chunk(self.size), dim=-1) if self.rank == 0 else None


def source_shape(source: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or of a lazy safetensors slice."""
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def read_whole(source: Any) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


def shard_for_rank(model: nn.Module, name: str, source: Any) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``source`` for parameter ``name`` of a ``CausalLM``: all of it for
    replicated ones."""
    if model.tp.size == 1:
        return read_whole(source)  # not sharded: no slicing, no copies
    owner, _, leaf = name.rpartition(".")
    load_shard = getattr(model.get_submodule(owner), "load_shard", None)
    return read_whole(source) if load_shard is None else load_shard(leaf, source)


class DecodeGemm:
    """``F.linear`` of one weight on CUDA, through ``kernels/skinny_gemm.py`` for decode-sized inputs (a few rows),
    where cuBLAS's split-K GEMM and its reduce read the weight at a fraction of the memory bandwidth and stop the
    decode kernels' programmatic dependent launches. Holds that kernel's arrival counters (made at the first
    call, on the device ``bind_ops`` chose it for)."""

    def __init__(self) -> None:
        self.arrived: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from hybridkv.kernels.skinny_gemm import skinny_gemm, skinny_gemm_counters, skinny_gemm_fits  # GPU only

        if skinny_gemm_fits(x, weight):
            if self.arrived is None:
                self.arrived = skinny_gemm_counters(weight.shape[0], x.device)
            return skinny_gemm(x, weight, bias, self.arrived)
        return F.linear(x, weight, bias)


def gemm_for(device: torch.device):
    """A linear's GEMM ``(x, weight, bias) -> y`` on ``device``: ``F.linear``, or on CUDA a ``DecodeGemm``."""
    return DecodeGemm() if device.type == "cuda" else F.linear


class LinearOps(DeviceOps):
    """A linear (or a fused group of them) whose GEMM is chosen when the model is placed (``gemm_for``, or for
    quantized weights ``QuantizedGemm``)."""

    gemm = staticmethod(F.linear)  # until ``bind_ops``

    def bind_ops(self, device: torch.device) -> None:
        self.gemm = QuantizedGemm(self, device) if is_quantized(self) else gemm_for(device)


class ColumnParallelLinear(LinearOps, nn.Linear):
    """Output features split in ``count`` parts; this rank holds part ``index``. No communication."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None, part: tuple[int, int]
    ) -> None:
        self.index, self.count = part
        if out_features % self.count:
            raise ValueError(f"{out_features} output features cannot be split in {self.count}")
        super().__init__(in_features, out_features // self.count, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)

    def load_shard(self, name: str, source: Any) -> torch.Tensor:
        if name == "input_scale":
            return read_whole(source)
        n = source_shape(source)[0] // self.count  # rows: of the weight, its scales and zero points alike
        return source[self.index * n : (self.index + 1) * n]


class FusedColumns(LinearOps):
    """Linears that read the same input (q, k, v; gate, up) run as one GEMM over their concatenated weights: one
    launch and one pass over the input instead of several, and a wider GEMM (a decode step's q/k/v projections
    are 896 x 5120 together on a Scout rank, 128 x 5120 each for k and v).

    ``fuse()`` moves the weights into one tensor and re-points each linear's weight (and bias) at its rows, so no
    memory is added and the linears keep their names for loading. E.g. q [640, H], k [128, H], v [128, H] ->
    one [896, H]; ``q_proj.weight`` is then rows 0..640 of it. Before ``fuse()`` the linears run one by one."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        if self.weight is not None:
            return
        with_bias = [linear.bias is not None for linear in self.linears]
        if any(with_bias) != all(with_bias):
            raise ValueError("fused linears must all have a bias or none")
        self.weight = self._join("weight")
        if all(with_bias):
            self.bias = self._join("bias")
        if is_quantized(self.linears[0]):
            self._fuse_quantized()

    def _join(self, name: str) -> torch.Tensor:
        """The linears' ``name`` tensors as one, each linear's re-pointed at its rows of it."""
        joined = torch.cat([getattr(linear, name) for linear in self.linears])
        for linear, rows in zip(self.linears, joined.split(self.sizes)):
            getattr(linear, name).data = rows
        return joined

    def _fuse_quantized(self) -> None:
        """Scales and zero points are per output row, so they join like the weights; a static FP8 activation
        scale is one per linear, and the group takes the largest (as vLLM does), which none of them clips."""
        formats = {linear.weight_format for linear in self.linears}
        if len(formats) != 1:
            raise ValueError(f"fused linears must share one weight format, got {sorted(f.name for f in formats)}")
        self.weight_format = formats.pop()
        for name in QUANT_PARAMS[:2]:
            if getattr(self.linears[0], name, None) is not None:
                setattr(self, name, self._join(name))
        if getattr(self.linears[0], "input_scale", None) is not None:
            self.input_scale = torch.stack([linear.input_scale for linear in self.linears]).amax().reshape(1)
        self.gemm = QuantizedGemm(self, self.weight.device)  # the group's GEMM was bound before it had a format

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(linear(x) for linear in self.linears)
        return self.joint(x).split(self.sizes, dim=-1)

    def joint(self, x: torch.Tensor) -> torch.Tensor | None:
        """The linears' outputs side by side (one tensor, in their order), or None before ``fuse()``."""
        return None if self.weight is None else self.gemm(x, self.weight, self.bias)


def fuse_columns(model: nn.Module) -> None:
    """Fuse every ``FusedColumns`` group of ``model`` (once its weights are loaded and on their device)."""
    for module in model.modules():
        for group in vars(module).values():
            if isinstance(group, FusedColumns):
                group.fuse()


class RowParallelLinear(LinearOps, nn.Linear):
    """Input features split over ranks; the partial outputs are summed over ranks.

    ``reduce=False`` leaves the sum to the caller (MoE adds experts and shared expert first: one all-reduce)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None, tp: TPGroup,
        reduce: bool = True,
    ) -> None:
        self.tp, self.reduce = tp, reduce
        _, local = tp.part(in_features, "input features")
        super().__init__(local, out_features, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.gemm(x, self.weight, self.bias)
        # the bias joins the sum once, from rank 0 (also right while the sum is deferred: nothing follows it here)
        y = self.gemm(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y) if self.reduce else y

    def load_shard(self, name: str, source: Any) -> torch.Tensor:
        shape = source_shape(source)
        if len(shape) < 2:  # the bias, a per-row or static scale
            return read_whole(source)
        n = shape[1] // self.tp.size  # columns: of the weight (packed or not), its group scales and zero points
        return source[:, self.tp.rank * n : (self.tp.rank + 1) * n]


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    """Each rank's share of the vocabulary, the last one padded with zero rows to it."""
    return -(-vocab_size // size)


# On CPU the head's GEMM gives a row other numbers in a call of 1-3 or 5-7 rows than in a call of 8 (another
# kernel path, or the rows split otherwise across threads); padded to a multiple of this, a row's logits are the
# same in a batch of any size (checked for 1 to 264 rows, two threads), so a request's logprobs do not depend on
# what is batched with it.
HEAD_ROW_MULTIPLE = 8


class VocabParallelEmbedding(DeviceOps, nn.Embedding):
    """Vocabulary rows split over ranks, padded to equal parts; lookups outside a rank's rows give zeros there
    and the all-reduce fills them in from the rank that has them (a sum with one non-zero term: exact). As an
    output head, ``logits`` is its GEMM."""

    dispatched = ("logits",)

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype | None, tp: TPGroup) -> None:
        self.tp, self.vocab_size = tp, vocab_size
        rows = vocab_rows_per_rank(vocab_size, tp.size)
        self.vocab_start = tp.rank * rows
        weight = torch.empty(rows, hidden, dtype=dtype)
        if not weight.is_meta:  # nn.Embedding's own init; on the meta device (``build_model``) none: a meta
            nn.init.normal_(weight)  # tensor's normal_ imports torch._dynamo, with triton and sympy (~230 MB RSS)
        super().__init__(rows, hidden, _weight=weight, dtype=dtype)
        # as an output head on CPU: an int8 copy that finds a row's argmax exactly (``model/int8_head_cpu.py``)
        self.argmax_head: Int8ArgmaxHead | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0))

    def logits_native(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ weight.T`` through a call of a multiple of ``HEAD_ROW_MULTIPLE`` rows (zero rows added, their
        logits dropped): the head reads its weight once either way."""
        rows = hidden.shape[0]
        pad = -rows % HEAD_ROW_MULTIPLE
        if not pad:
            return F.linear(hidden, self.weight)
        return F.linear(F.pad(hidden, (0, 0, 0, pad)), self.weight)[:rows]

    def logits_cuda(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


    def load_shard(self, name: str, source: Any) -> torch.Tensor:
        rows = source[self.vocab_start : min(self.vocab_start + self.num_embeddings, self.vocab_size)]
        missing = self.num_embeddings - rows.shape[0]
        return F.pad(rows, (0, 0, 0, missing)) if missing else rows  # the last rank's padding rows: zero


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight, split by vocabulary like the embedding (``LlamaForCausalLM.compute_logits`` uses it
    as a linear layer and gathers the ranks' logits)."""


def vocab_parallel_logits(hidden: torch.Tensor, embed: VocabParallelEmbedding, lm_head: ParallelLMHead | None,
                          tp: TPGroup, vocab_size: int, argmax_only: bool = False) -> torch.Tensor | None:
    """float32 logits [N, vocab] of ``hidden`` through the output head (``lm_head``, or the tied ``embed``): under
    TP each rank computes its vocabulary slice, rank 0 gets them all (the padding cut off), the others None.

    ``argmax_only``: the caller reads only each row's argmax; a head with an ``argmax_head`` then returns logits
    exact where they could be the largest and within its bound elsewhere."""
    head = embed if lm_head is None else lm_head
    if argmax_only and head.argmax_head is not None:
        return head.argmax_head(hidden, head.weight)
    logits = tp.gather_last_dim(head.logits(hidden).float())
    return logits if logits is None or tp.size == 1 else logits[:, :vocab_size]
