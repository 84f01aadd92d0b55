"""The engine's rank (rank 0), built in the order its parts need each other, as nano-vllm's ``ModelRunner``:

1. device and threads (``auto``: CUDA when torch sees a GPU), the step knobs' device defaults, the dtype;
2. weights: the checkpoint (this rank's shard), on the device, Q4_1 linears kept 4-bit on the CPU;
3. the KV cache: its dtype, its layout (this rank's KV heads), its bytes (what the GPU has left after the weights
   and the step reserve), its blocks and ``max_model_len``, the host tier; the block tables (``KVCacheManager``);
4. the cache tensors, the attention backend and the ``ModelRunner`` over them (``runtime.build_runtime``);
5. with ``tensor_parallel_size`` > 1, the other ranks' processes (``tp_workers.py``), started last, when nothing
   is left to refuse, and rank 0's runner that sends them each step;
6. the decode steps' CUDA graphs, captured on every rank (unless ``enforce_eager``).

``LLMEngine`` takes the ``DriverRank`` and keeps only requests, the step and outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from hybridkv.engine.config import EngineConfig, resolve_step_budget
from hybridkv.engine.kv_events import parse_kv_events_config
from hybridkv.engine.kv_sizing import host_blocks, kv_cache_bytes, size_kv_cache
from hybridkv.engine.model_runner import ModelRunner
from hybridkv.engine.runtime import build_runtime, cpu_threads, keep_4bit_weights, rank_layout, resolve_device
from hybridkv.engine.tp_workers import TPDriverRunner, TPWorkers, WorkerSpec
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.dtypes import resolve_kv_dtype, resolve_model_dtype
from hybridkv.kv.layout import KVLayout
from hybridkv.model.architectures.collectives import CopyEngineSums, OneShotAllReduce
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.attention.base import PagedAttentionBackend
from hybridkv.model.attention.factory import AttentionChoice
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.dtypes import torch_dtype
from hybridkv.model.int4_cpu import int4_packing
from hybridkv.model.loading.checkpoint import LoadedModel, load_checkpoint
from hybridkv.model.loading.weights import release_freed_memory

log = logging.getLogger("hybridkv")


@dataclass(slots=True)
class DriverRank:
    """Rank 0 as built: what the engine steps with."""

    config: EngineConfig  # its device and step knobs resolved
    dtype: torch.dtype  # what the model computes in
    kv_dtype: str  # what the KV cache stores (``auto`` resolved)
    loaded: LoadedModel
    model: CausalLM
    int4_linears: int  # linear layers kept 4-bit (``runtime.keep_4bit_weights``)
    layout: KVLayout
    num_blocks: int  # of every rank's cache, the null block included
    host_blocks: int  # host tier pages per rank (0: none)
    max_model_len: int
    max_model_len_bound: str  # what bound ``max_model_len``, in words
    kv: KVCacheManager  # the block tables, for every rank
    backend: PagedAttentionBackend
    runner: ModelRunner  # a ``TPDriverRunner`` under tensor parallelism
    workers: TPWorkers | None = None  # ranks 1..N-1


def build_driver_rank(config: EngineConfig, loaded: LoadedModel | None = None) -> DriverRank:
    """Rank 0 for ``config``; ``loaded``: a model already loaded (one rank only)."""
    config, dtype_name = _on_device(config)
    dtype = torch_dtype(dtype_name)
    tp = TPGroup(0, config.tensor_parallel_size)
    if tp.size > 1 and loaded is not None:
        raise ValueError("tensor_parallel_size > 1 loads each rank's shard itself: pass model, not loaded")
    # the threads _on_device gave torch: the kernel splits its rows over as many
    int4 = int4_packing(config.quantization, config.device, tp.size, torch.get_num_threads())
    loaded = loaded or load_checkpoint(config.model, dtype, tokenizer=not config.skip_tokenizer_init, tp=tp,
                                       load_format=config.load_format, device=config.device, seed=config.seed,
                                       quantization=config.quantization, int4=int4)
    model, int4_linears = keep_4bit_weights(loaded.model.place(config.device, dtype), config.device, int4)
    if config.device == "cpu":
        release_freed_memory()
    if config.fp8_attention_compute and not config.kv_cache_dtype.startswith("fp8"):
        raise ValueError(f"fp8_attention_compute needs kv_cache_dtype=fp8_e4m3, got {config.kv_cache_dtype!r}")
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype_name)
    layout = rank_layout(loaded.hf_config, tp.size, kv_dtype, config.block_size)
    kv_bytes = kv_cache_bytes(config, loaded.hf_config, layout, model.cfg.hidden_size, model.cfg.vocab_size)
    num_blocks, max_model_len, bound = size_kv_cache(config, loaded.hf_config, layout, kv_bytes)
    host = host_blocks(config, layout)
    kv = KVCacheManager(layout, num_blocks, enable_prefix_caching=config.enable_prefix_caching,
                        hash_algorithm=config.prefix_caching_hash_algo,
                        max_step_tokens=config.max_num_batched_tokens, host_blocks=host,
                        kv_events=parse_kv_events_config(config.kv_events_config).enabled)
    attention = AttentionChoice(config.attention_backend, config.device, kv_dtype, dtype, config.fp8_attention_compute)
    runtime = build_runtime(model, layout, num_blocks, attention, kv, host, config.prefill_overlap_tokens)
    rank = DriverRank(config, dtype, kv_dtype, loaded, model, int4_linears, layout, num_blocks, host,
                      max_model_len, bound, kv, runtime.backend, runtime.runner)
    if tp.size > 1:
        _start_workers(rank, tp)
    if not config.enforce_eager:
        rank.runner.capture_decode_graphs(config.max_num_seqs, rank.max_model_len)
    return rank


def _on_device(config: EngineConfig) -> tuple[EngineConfig, str]:
    """``config`` with its device and the device's step defaults resolved, and the dtype the model computes in;
    on the CPU, torch's threads set (``cpu_threads``)."""
    device = resolve_device(config.device)
    config = resolve_step_budget(replace(config, device=device), device)
    if device == "cpu":
        torch.set_num_threads(cpu_threads(config.cpu_threads))
    return config, resolve_model_dtype(config.dtype, device)


def _start_workers(rank: DriverRank, tp: TPGroup) -> None:
    """Start ranks 1..N-1 (each loads its shard and builds its cache like this rank's) and give ``rank`` the
    runner that sends them each step."""
    c, hidden = rank.config, rank.model.cfg.hidden_size
    one_shot = not c.disable_custom_all_reduce and OneShotAllReduce.available_here()
    if not one_shot and not c.disable_custom_all_reduce:
        log.warning("all-reduces go through NCCL and decode runs eagerly: this process set up the one-shot "
                    "all-reduce for an earlier tensor-parallel engine (once per process)")
    sum_slots = (0, 0)
    if one_shot and c.prefill_overlap_tokens and rank.model.supports_step_halves and CopyEngineSums.scratch_bytes(
            c.tensor_parallel_size, c.max_num_batched_tokens, hidden):
        # half a step's rows (``ModelRunner._begin_step`` cuts at n // 2), kept out of the KV cache by
        # ``kv_sizing.step_reserve_bytes``
        sum_slots = (-(-c.max_num_batched_tokens // 2), hidden)
    spec = WorkerSpec(c, rank.dtype, rank.kv_dtype, rank.num_blocks, rank.max_model_len, one_shot,
                      host_blocks=rank.host_blocks, sum_slots=sum_slots)
    rank.workers = TPWorkers(spec, tp)
    rank.runner = TPDriverRunner(rank.model, rank.kv, rank.backend, rank.workers, rank.runner.copier,
                                 c.prefill_overlap_tokens)
