"""How big one rank's KV cache is: its bytes (given, or what the GPU has left after the step reserve), its host
tier's pages, its blocks, and the longest request it holds (``max_model_len``).

The formulas are ``hybridkv.kv.capacity``'s, which ``hybridkv plan`` (``kv/planner.py``) calls too: from the same
inputs both reach the same block count and length (``tests/engine/test_plan_matches_engine.py``).
"""

from __future__ import annotations

import logging

import torch

from hybridkv.engine.config import EngineConfig, resolve_step_budget
from hybridkv.kv.capacity import cpu_default_kv_bytes, longest_fitting
from hybridkv.kv.capacity import step_reserve_bytes as _step_reserve_formula
from hybridkv.kv.layer_specs import text_config
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.planner import planned_kv_bytes, planned_weight_bytes
from hybridkv.model.architectures.collectives import CopyEngineSums
from hybridkv.model.attention.factory import paged_attention_capabilities

log = logging.getLogger("hybridkv")

def step_reserve_bytes(config: EngineConfig, hidden_size: int, vocab_size: int) -> int:
    """GPU memory kept out of the KV cache for one step's working set: ``hybridkv.kv.capacity``'s formula (the
    planner's too), with the scratch the attention backend and the tensor-parallel collectives declare.

    E.g. ``EngineConfig()``, 2,048 wide, 49,152 tokens: 1 GiB + 1 GiB + 144 MiB (no scratch)."""
    # what the backend declares it widens beside the cache (an FP8 cache's prefill segments on the kernels)
    segments = paged_attention_capabilities(config.attention_backend, "cuda", config.kv_cache_dtype).segment_bytes
    step = resolve_step_budget(config, "cuda").max_num_batched_tokens  # a GPU reserve: the GPU's default step
    sums = CopyEngineSums.scratch_bytes(config.tensor_parallel_size, step, hidden_size)
    return _step_reserve_formula(step, config.max_num_seqs, hidden_size, vocab_size, segments, sums)


def kv_cache_bytes(config: EngineConfig, hf_config: dict, layout: KVLayout, hidden_size: int, vocab_size: int) -> int:
    """The KV cache's bytes per rank: ``kv_cache_memory_bytes``; unset, on the CPU room for a few requests of
    ``max_model_len`` (``capacity.cpu_default_kv_bytes``), and on a GPU what ``gpu_memory_utilization`` leaves
    after the step reserve and what is in use (the weights loaded, the CUDA context), at most what ``hybridkv plan``
    gives from the card's memory (``planner.planned_kv_bytes``: its weights estimate and ``RUNTIME_BYTES`` in place
    of what is measured in use). So ``hybridkv plan --gpu-memory-gib`` with the card's total finds the engine's
    ``max_model_len``, unless less is free than the plan assumes (another process, a larger context)."""
    if config.kv_cache_memory_bytes:
        return config.kv_cache_memory_bytes
    if not config.device.startswith("cuda"):
        step = resolve_step_budget(config, config.device).max_num_batched_tokens
        return cpu_default_kv_bytes(layout, _wanted_len(config, hf_config), step)
    # blocks the loader freed (dummy weights drawn and quantized a chunk at a time) would count as in use
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(config.device))
    reserve = step_reserve_bytes(config, hidden_size, vocab_size)
    measured = int(total * config.gpu_memory_utilization) - (total - free) - reserve
    weights = planned_weight_bytes(hf_config, config.quantization, config.tensor_parallel_size)
    planned = planned_kv_bytes(total, config.gpu_memory_utilization, weights, reserve)
    budget = min(measured, planned)
    # what the planner can only estimate (``planner.RUNTIME_BYTES``): memory in use that torch did not allocate
    outside = (total - free) - torch.cuda.memory_reserved(torch.device(config.device))
    log.info("GPU memory: %.3f GiB total, %.2f GiB in use (%.2f GiB outside torch: CUDA context, collectives), "
             "step reserve %.2f GiB; KV cache %.2f GiB (%s; the plan's estimate %.2f GiB, free after the reserve "
             "%.2f GiB)", total / 2**30, (total - free) / 2**30, outside / 2**30, reserve / 2**30, budget / 2**30,
             "the plan's" if planned <= measured else "what is free", planned / 2**30, measured / 2**30)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room for the KV cache: "
            f"{(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB (the plan estimates "
            f"{weights / 2**30:.1f} GiB of weights and a {reserve / 2**30:.1f} GiB step reserve)"
        )
    return budget


def host_blocks(config: EngineConfig, layout: KVLayout) -> int:
    """Host tier pages (``kv_offload_bytes`` per rank, in pages of the device pool's size); 0: no tier."""
    want = config.kv_offload_bytes
    if want < 0:
        raise ValueError(f"kv_offload_bytes must be >= 0, got {want}")
    if want and not config.enable_prefix_caching:
        raise ValueError("kv_offload_bytes needs prefix caching: the host tier keeps evicted cached blocks")
    pages = want // layout.page_bytes
    if want and pages < 1:
        raise ValueError(f"kv_offload_bytes={want} holds no page of {layout.page_bytes} bytes; give at least one page")
    return pages


def size_kv_cache(config: EngineConfig, hf_config: dict, layout: KVLayout,
                  kv_bytes: int) -> tuple[int, int, str]:
    """The engine's KV sizing of ``layout`` (one rank's, ``runtime.rank_layout``) for ``kv_bytes`` per rank: (number
    of blocks with the null block, max_model_len, what bound it). ``hybridkv plan`` (``plan_capacity``) reaches the
    same numbers from the same inputs."""
    num_blocks = layout.num_blocks(kv_bytes)
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory_bytes={kv_bytes} holds {num_blocks} blocks of {layout.page_bytes} bytes; "
            "at least 2 are needed"
        )
    return num_blocks, *resolve_max_model_len(config, hf_config, layout, num_blocks)


def resolve_max_model_len(config: EngineConfig, hf_config: dict, layout: KVLayout,
                          num_blocks: int) -> tuple[int, str]:
    """The model's context (``max_position_embeddings``) or the asked length, within what the KV cache holds; and
    which of these bound it, in words.

    Too long for the model or the cache: raise naming the limit, or clamp and log it (``clamp_max_model_len``).
    """
    model_len = _model_len(hf_config)
    asked = config.max_model_len
    wanted = model_len if asked is None else asked
    limits = []
    if wanted > model_len:
        limits.append((model_len, f"the model's context (max_position_embeddings) is {model_len}"))
    usable = num_blocks - 1  # block 0 is the null block
    step = resolve_step_budget(config, config.device).max_num_batched_tokens  # unresolved "auto": the GPU's step
    cache_fits = longest_fitting(layout, usable, step, wanted)
    if cache_fits < wanted:
        limits.append((cache_fits, (
            f"the KV cache ({usable} blocks of {layout.block_size} tokens, "
            f"{layout.page_bytes} bytes each) holds at most {cache_fits} tokens for one request"
        )))
    if not limits:
        return wanted, ("asked for with max_model_len" if asked is not None
                        else f"the model's context (max_position_embeddings) is {model_len}")
    length, why = min(limits)
    if asked is not None and not config.clamp_max_model_len:
        raise ValueError(f"max_model_len {asked} is too long: {why}; lower it or raise kv_cache_memory_bytes")
    log.warning("max_model_len %d clamped to %d: %s", wanted, length, why)
    return length, why


def _model_len(hf_config: dict) -> int:
    """The model's context: ``max_position_embeddings`` (2,048 where the config has none)."""
    return int(text_config(hf_config).get("max_position_embeddings") or 2048)


def _wanted_len(config: EngineConfig, hf_config: dict) -> int:
    """The ``max_model_len`` to size a default CPU cache for: the asked one, at most the model's context."""
    model_len = _model_len(hf_config)
    return model_len if config.max_model_len is None else min(config.max_model_len, model_len)
