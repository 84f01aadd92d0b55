"""What the engine, the runner and the loaders may use of a model: the ``CausalLM`` protocol.

Every architecture in ``architectures/`` implements it, so no caller probes a model with ``getattr``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.attention.base import AttentionBackend, OutputRows


class ModelShape(Protocol):
    """The parts of an architecture's config the engine reads (sizes of this model, not of one TP rank)."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@runtime_checkable
class CausalLM(Protocol):
    cfg: ModelShape
    tp: TPGroup  # which tensor-parallel shard this is (rank 0 of 1: the whole model)
    lm_head: torch.nn.Module | None  # None: tied to the input embedding (a checkpoint's copy is not loaded)
    # the forward holds no host sync and no host-to-device copy in the steady state, so a CUDA graph can hold it
    supports_cuda_graphs: bool
    # ``forward`` also takes ``halves`` (``attention.base.StepHalf``): a tensor-parallel step's tokens in two halves,
    # one's all-reduces overlapping the other's compute
    supports_step_halves: bool
    # a generated token's row (one a sequence and step) is computed another way than the model's own forward
    # computes it, always: the runner runs a step's generated sequences in a forward of their own, apart from its
    # prompt sequences (a 4-bit Llama's C decode step on the CPU: ``llama_cpu_decode.NativeDecode``)
    decodes_apart: bool
    # linears whose output only ever feeds a residual add: a 4-bit one may output bf16 (``pack_int4_linears``)
    residual_branch_ends: tuple[str, ...]

    @property
    def max_graph_tokens(self) -> int:
        """The most tokens one captured CUDA graph's forward may hold."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for flattened tokens ``input_ids`` [T] at ``positions`` [T].
        ``outputs`` (a paged ``attn``): only those rows' [N, hidden], the last layer computing only them."""
        ...

    def place(self, device: torch.device | str, dtype: torch.dtype | None = None) -> CausalLM:
        """This model on ``device`` (in ``dtype``; None: as it is) with its layers' ops bound for that device, once
        (``architectures/device_ops.py``), or a wrapper of it that runs its steps (a 4-bit Llama on the CPU). A
        model never placed runs its eager torch ops, on the CPU."""
        ...

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor | None:
        """float32 logits [N, vocab] for the picked hidden rows; None on tensor-parallel ranks other than 0.
        ``argmax_only``: only each row's argmax is read, and only it must be exact."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                 outputs: OutputRows | None = None) -> torch.Tensor:
        ...
