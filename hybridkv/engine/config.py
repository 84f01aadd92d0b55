"""``EngineConfig``: every engine knob, in one place.

Each field's metadata carries its help text; ``args.py`` generates the CLI flags from the fields (``--max-num-seqs``
for ``max_num_seqs``), ``LLM(**kwargs)`` passes its keyword arguments straight through, and tensor-parallel
workers receive the whole config. Adding a knob is adding a field here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def knob(default: Any, help: str, cli: bool = True) -> Any:
    """A config field with its help text; ``cli=False``: not a command-line flag (set by a command itself)."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(slots=True)
class EngineConfig:
    model: str | None = knob(None, "known name, .gguf file or HF directory (default: SmolLM2)")
    dtype: str = knob("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, the checkpoint's on GPU)")
    block_size: int = knob(16, "tokens per KV cache block")
    enable_prefix_caching: bool = knob(True, "reuse KV blocks of shared prefixes")
    prefix_caching_hash_algo: str = knob("xxh3_128", "hash of a block's tokens for the prefix cache")
    max_model_len: int | None = knob(
        None, "longest prompt + output (default: the model's context, clamped to what the KV budget holds)")
    # an explicit max_model_len that does not fit: clamp (serve sets this) or raise
    clamp_max_model_len: bool = knob(False, "clamp a max_model_len the KV cache cannot hold", cli=False)
    max_num_seqs: int = knob(256, "most sequences in one step")
    max_num_batched_tokens: int = knob(8192, "most tokens in one step")
    kv_cache_memory_bytes: int | None = knob(
        None, "KV cache budget in bytes (default: 2 GiB on CPU; on GPU what --gpu-memory-utilization leaves)")
    gpu_memory_utilization: float = knob(0.9, "GPU only: the share of GPU memory the engine may use")
    attention_backend: str = knob("auto", "auto (triton on CUDA) | torch (reference) | triton (GPU kernels)")
    enforce_eager: bool = knob(False, "GPU: no CUDA graphs for decode steps")
    load_format: str = knob("auto", "auto | dummy (random weights from config.json alone)")
    kv_cache_dtype: str = knob("auto", "auto | bfloat16 | float16 | float32 | fp8_e4m3")
    # vLLM has no such knob (its FlashAttention-3 FP8 path is implied by the cache dtype); ours is opt-in because
    # it changes greedy tokens (docs/gpu.md, FP8 compute's accuracy)
    fp8_attention_compute: bool = knob(
        False, "with --kv-cache-dtype fp8_e4m3 on GPU: prefill attention dots in FP8 (faster, less exact)")
    seed: int = knob(0, "seed of the sampler (and of dummy weights)")
    device: str = knob("auto", "auto (CUDA when available) | cpu | cuda (Triton kernels)")
    skip_tokenizer_init: bool = knob(False, "load no tokenizer: prompts and outputs are token ids")
    tensor_parallel_size: int = knob(1, "ranks (processes) to split the model over; this one is rank 0")
    distributed_timeout_s: float = knob(300.0, "a collective that waits this long raises: a rank has hung")
    # the CLI names it in GiB (--kv-offload-gib, see args.py), like vLLM's --kv-offloading-size
    kv_offload_bytes: int = knob(0, "host-memory tier of the prefix cache, bytes per rank (0: off); see kv/host_tier.py",
                                 cli=False)
