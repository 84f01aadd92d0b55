"""Engine flags with vLLM's names, shared by ``hybridkv generate`` and ``hybridkv serve``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.engine.llm_engine import EngineConfig


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help="known name, .gguf file or HF directory")
    else:
        p.add_argument("--model", default=None, help="known name, .gguf file or HF directory (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse KV blocks of shared prefixes",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | float16 | float32 | fp8_e4m3")
    p.add_argument("--fp8-attention-compute", action="store_true",
                   help="with --kv-cache-dtype fp8_e4m3 on GPU: prefill attention dots in FP8 (faster, less exact)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache budget in bytes")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU only")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (processes) to split the model over")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when available) | cpu | cuda (Triton kernels)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts and outputs are token ids")
    p.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs for decode steps")
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights from config.json alone)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from hybridkv.engine.llm_engine import EngineConfig  # torch loads only when an engine is built

    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        fp8_attention_compute=args.fp8_attention_compute,
        seed=args.seed,
        device=args.device,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        skip_tokenizer_init=args.skip_tokenizer_init,
    )
