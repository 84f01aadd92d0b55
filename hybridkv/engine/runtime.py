"""One rank's pieces, built the same way on every rank: the device and dtype it computes in, its weights, its KV
layout, and its cache tensors, attention backend and runner over them.

The engine's rank (rank 0, which also owns the block tables: ``rank_builder.py``) and each tensor-parallel worker
(``tp_workers.py``) build from these, so every rank's cache has the same layout and block count and the driver's
block tables address them all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.block_copier import BlockCopier
from hybridkv.engine.model_runner import ModelRunner
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.layout import KVLayout, plan_layout
from hybridkv.model.attention.base import PagedAttentionBackend
from hybridkv.model.attention.factory import AttentionChoice, make_paged_attention
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.int4_cpu import Int4Packing, int4_linear_count, pack_int4_linears
from hybridkv.model.int8_head_cpu import Int8ArgmaxHead, int8_kernel_available
from hybridkv.model.loading.weights import release_freed_memory

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
    """Intra-op threads on CPU: ``asked``, or (0) ``default_cpu_threads`` of this process's physical cores and the
    1-minute load average at start-up, logged with both."""
    if asked < 0:
        raise ValueError(f"cpu_threads must be >= 0 (0: the physical cores not busy at start-up), got {asked}")
    if asked:
        return asked
    cores, load = physical_cores(), os.getloadavg()[0]
    threads = default_cpu_threads(cores, load)
    log.info("cpu_threads %d: %d physical cores less 1 per whole unit of the 1-minute load average at start-up "
             "(%.2f), at least 1; --cpu-threads sets it", threads, cores, load)
    return threads


def default_cpu_threads(cores: int, load: float) -> int:
    """Every physical core on an idle machine (as llama.cpp's CLI), less one for each whole unit of the load average
    (other work's runnable threads), at least 1: a thread waiting on a busy core stalls every small op of a step (on 2
    busy cores, 2 threads decoded 3-7x slower than 1). E.g. 2 cores: load 0.6 -> 2, 1.3 -> 1, 3.0 -> 1; 8 cores,
    load 2.5 -> 6."""
    return max(1, cores - int(load))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (a core's hyper-threads count once), from sysfs; the
    CPU count where sysfs does not say."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def keep_4bit_weights(model: CausalLM, device: str, int4: Int4Packing | None) -> tuple[CausalLM, int]:
    """``int4`` (``int4_cpu.int4_packing``: ``quantization`` auto on CPU): a GGUF's Q4_1 linear layers packed 4-bit
    (``model/int4_cpu.py``; a generated token's rows through our Q4_1 kernel, ``model/q4_1_cpu.py``, where it was
    built; the load packs them as it goes, any left are packed here), and the
    output head given an int8 copy for greedy rows (``model/int8_head_cpu.py``); returns the model to run (placed
    again once packed: a 4-bit Llama's small steps run in one loop, ``CpuDecodeLlama``) and how many linears were
    packed (0: the model runs in its dtype, its head float32 for every row)."""
    if int4 is None:
        return model, 0
    kernel = int4.kernel
    pack_int4_linears(model, model.residual_branch_ends, kernel=kernel)  # any the load left float
    packed = int4_linear_count(model)
    if packed:
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        if int8_kernel_available():
            release_freed_memory()  # the load's freed heap, before the int8 copy's temporaries come on top
            head.argmax_head = Int8ArgmaxHead.of(head.weight)
        screen = ("the float32 head for every row (no int8 GEMM of this torch sums exactly)" if head.argmax_head is None
                  else f"greedy tokens screened by an int8 head ({head.argmax_head.kind}'s GEMM)")
        rows = kernel.name if kernel is not None else (
            "torch's int4 kernel (bf16 activations; our Q4_1 kernel not built, no AVX2, or failed its check)")
        log.info("%d linear layers kept 4-bit (Q4_1 weights), a generated token's rows through %s, %s; "
                 "quantization=none: float32", packed, rows, screen)
    return (model.place(device) if packed else model), packed


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
