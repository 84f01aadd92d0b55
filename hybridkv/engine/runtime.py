"""One rank's pieces, built the same way on every rank: the device and dtype it computes in, its weights, its KV
layout, and its cache tensors, attention backend and runner over them.

The engine's rank (rank 0, which also owns the block tables: ``rank_builder.py``) and each tensor-parallel worker
(``tp_workers.py``) build from these, so every rank's cache has the same layout and block count and the driver's
block tables address them all.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.block_copier import BlockCopier
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.model_runner import ModelRunner
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.layout import KVLayout, plan_layout
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.attention.base import PagedAttentionBackend
from hybridkv.model.attention.factory import AttentionChoice, make_paged_attention
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.int4_cpu import int4_kernel_available, pack_int4_linears
from hybridkv.model.int8_head_cpu import Int8ArgmaxHead, int8_kernel_available
from hybridkv.model.q4_1_cpu import Q41Kernel

log = logging.getLogger("hybridkv")


@dataclass(slots=True)
class RankRuntime:
    layout: KVLayout
    backend: PagedAttentionBackend  # holds this rank's KV cache tensor
    runner: ModelRunner


def resolve_device(device: str) -> str:
    """``auto``: CUDA when torch sees a GPU, else the CPU (as vLLM picks); an unusable device names why."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA GPU; use cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


def cpu_threads(asked: int) -> int:
    """Intra-op threads on CPU: ``asked``, or (0) half the cores this process may use, at least 1."""
    if asked < 0:
        raise ValueError(f"cpu_threads must be >= 0 (0: half the cores), got {asked}")
    return asked or max(1, len(os.sched_getaffinity(0)) // 2)


def keep_4bit_weights(model: CausalLM, config: EngineConfig, tp: TPGroup) -> tuple[CausalLM, int]:
    """``quantization`` auto on CPU: a GGUF's Q4_1 linear layers packed 4-bit (``model/int4_cpu.py``; a generated
    token's rows through our Q4_1 kernel, ``model/q4_1_cpu.py``, where it was built), and the
    output head given an int8 copy for greedy rows (``model/int8_head_cpu.py``); returns the model to run (placed
    again once packed: a 4-bit Llama's small steps run in one loop, ``CpuDecodeLlama``) and how many linears were
    packed (0: the model runs in its dtype, its head float32 for every row)."""
    if config.quantization != "auto" or config.device != "cpu" or tp.size > 1 or not int4_kernel_available():
        return model, 0
    kernel = Q41Kernel.load(cpu_threads(config.cpu_threads))
    packed = pack_int4_linears(model, model.residual_branch_ends, kernel)
    if packed:
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        if int8_kernel_available():
            head.argmax_head = Int8ArgmaxHead.of(head.weight)
        screen = ("the float32 head for every row (no int8 GEMM of this torch sums exactly)" if head.argmax_head is None
                  else f"greedy tokens screened by an int8 head ({head.argmax_head.kind}'s GEMM)")
        rows = kernel.name if kernel is not None else (
            "torch's int4 kernel (bf16 activations; our Q4_1 kernel not built, no AVX2, or failed its check)")
        log.info("%d linear layers kept 4-bit (Q4_1 weights), a generated token's rows through %s, %s; "
                 "quantization=none: float32", packed, rows, screen)
    return (model.place(config.device) if packed else model), packed


def release_freed_memory() -> None:
    """Hand back to the OS the heap pages the load freed (the float32 weights packed 4-bit, the loader's
    temporaries): glibc keeps freed pages of its heap resident until asked, ~130 MB after the default model's load.
    A no-op where the C library has no ``malloc_trim`` (not glibc)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def rank_layout(hf_config: dict[str, Any], tensor_parallel_size: int, kv_dtype: str, block_size: int) -> KVLayout:
    """The KV layout of one rank (its share of the KV heads)."""
    return plan_layout(layer_specs_from_hf_config(hf_config, tensor_parallel_size, kv_dtype), block_size)


def build_runtime(model: CausalLM, layout: KVLayout, num_blocks: int, attention: AttentionChoice,
                  kv: KVCacheManager | None = None, host_blocks: int = 0, halves_from_tokens: int = 0) -> RankRuntime:
    """``kv``: the block tables' owner (rank 0); None on worker ranks, which only execute. ``host_blocks``: pages
    of this rank's host-memory tier (0: none), copied to and from the cache by the runner. ``halves_from_tokens``:
    see ``ModelRunner``."""
    heads = model.cfg.num_heads // model.tp.size
    backend = make_paged_attention(attention, layout, num_blocks, heads)
    copier = BlockCopier(backend.cache.buffer, host_blocks) if host_blocks else None
    return RankRuntime(layout, backend, ModelRunner(model, kv, backend, copier, halves_from_tokens))
