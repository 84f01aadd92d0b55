"""``EngineConfig``: every engine knob, in one place.

Each field's metadata carries its help text; ``args.py`` generates the CLI flags from the fields (``--max-num-seqs``
for ``max_num_seqs``), ``LLM(**kwargs)`` passes its keyword arguments straight through, and tensor-parallel
workers receive the whole config. Adding a knob is adding a field here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


# Default step budgets (max_num_batched_tokens). On CPU, SmolLM2-135M prefills ~230 tokens/s on one core whatever
# the chunk from 128 to 1024 tokens (a 2048-token prompt: 8.8, 9.0, 8.8, 9.3 s), so the step is small: a long
# prompt's chunk (half the step, long_prefill_token_threshold) takes ~1 s, and other streams get a token a step.
GPU_STEP_TOKENS = 8192
CPU_STEP_TOKENS = 512


def knob(default: Any, help: str, cli: bool = True) -> Any:
    """A config field with its help text; ``cli=False``: not a command-line flag (set by a command itself)."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(slots=True)
class EngineConfig:
    model: str | None = knob(None, "known name, .gguf file or HF directory (default: SmolLM2)")
    dtype: str = knob("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on GPU)")
    block_size: int = knob(16, "tokens per KV cache block")
    enable_prefix_caching: bool = knob(True, "reuse KV blocks of shared prefixes")
    prefix_caching_hash_algo: str = knob("xxh3_128", "hash of a block's tokens for the prefix cache")
    max_model_len: int | None = knob(
        None, "longest prompt + output (default: the model's context, clamped to what the KV budget holds)")
    # an explicit max_model_len that does not fit: clamp (serve sets this) or raise
    clamp_max_model_len: bool = knob(False, "clamp a max_model_len the KV cache cannot hold", cli=False)
    max_num_seqs: int = knob(256, "most sequences in one step")
    max_num_batched_tokens: int | None = knob(
        None, f"most tokens in one step (default: {GPU_STEP_TOKENS} on GPU, {CPU_STEP_TOKENS} on CPU)")
    # vLLM's name; its scheduler caps a long prompt's chunk the same way
    long_prefill_token_threshold: int | None = knob(
        None, "most tokens of one prompt in one step, the rest of the step left to other requests "
              "(0: no cap; default: none on GPU, half the step on CPU)")
    quantization: str = knob(
        "auto", "linear weights: auto (the checkpoint's own quantization_config; on CPU a GGUF's Q4_1 weights also "
                "stay 4-bit, for our Q4_1 kernel or, where it was not built, torch's int4 kernel) | none (every weight in --dtype; a quantized checkpoint is "
                "dequantized) | fp8 (e4m3 weights, per-channel scales, dynamic per-token activations) | int4 "
                "(W4A16, group 128) | awq | compressed-tensors. On GPU quantized weights stay quantized; on CPU they "
                "are dequantized at load (the same values)")
    cpu_threads: int = knob(
        0, "CPU: torch's intra-op threads (0: every physical core, less one per whole unit of the 1-minute load "
           "average at start-up, at least 1; logged. A thread waiting on a busy core stalls each op: on 2 busy cores "
           "2 threads decoded 3-7x slower than 1)")
    kv_cache_memory_bytes: int | None = knob(
        None, "KV cache budget in bytes (default on CPU: room for 2 requests of max_model_len, 64 MiB to 2 GiB; "
        "on GPU what --gpu-memory-utilization leaves)")
    gpu_memory_utilization: float = knob(0.9, "GPU only: the share of GPU memory the engine may use")
    attention_backend: str = knob("auto", "auto (triton on CUDA) | torch (reference) | triton (GPU kernels)")
    enforce_eager: bool = knob(False, "GPU: no CUDA graphs for decode steps")
    load_format: str = knob("auto", "auto | dummy (random weights from config.json alone)")
    kv_cache_dtype: str = knob(
        "auto", "auto (what the model computes in, --dtype) | bfloat16 | float16 | float32 | fp8_e4m3")
    # vLLM has no such knob (its FlashAttention-3 FP8 path is implied by the cache dtype); ours is opt-in because
    # it changes greedy tokens (docs/gpu.md, FP8 compute's accuracy)
    fp8_attention_compute: bool = knob(
        False, "with --kv-cache-dtype fp8_e4m3 on GPU: prefill attention dots in FP8 (faster, less exact)")
    seed: int = knob(0, "seed of the sampler (and of dummy weights)")
    device: str = knob("auto", "auto (CUDA when available) | cpu | cuda (Triton kernels)")
    skip_tokenizer_init: bool = knob(False, "load no tokenizer: prompts and outputs are token ids")
    # a tool with a 100,000-value enum takes minutes to compile: answer at once rather than hold the request
    grammar_compile_timeout_s: float = knob(
        10.0, "structured outputs: a grammar (JSON schema, regex, EBNF) not compiled within this many seconds is "
              "refused; its compile goes on in the background and is cached (0: no bound)")
    tensor_parallel_size: int = knob(1, "ranks (processes) to split the model over; this one is rank 0")
    # vLLM's name. Replica r runs on GPUs [r*tp, (r+1)*tp) or, on the CPU, its share of the cores
    # (``server/replica.py``); the front end routes each request to one of them (``server/router.py``)
    data_parallel_size: int = knob(
        1, "hybridkv serve: engine replicas, each its own process with its own devices, behind one front end "
           "(see docs/data-parallel.md)")
    # vLLM's name and choices: Ray places each replica (a placement group bundle: its GPUs, or CPUs) on any host of
    # the cluster ``ray.init()`` finds, or a local one it starts
    data_parallel_backend: str = knob(
        "mp", "hybridkv serve --data-parallel-size N: mp (processes on this host) | ray (Ray actors, placement "
              "groups; replicas on other hosts of the Ray cluster)")
    # which replica this engine is (its KV events carry it, as vLLM's ``data_parallel_rank``)
    data_parallel_rank: int = knob(0, "this replica's index under data parallelism", cli=False)
    distributed_timeout_s: float = knob(300.0, "a collective that waits this long raises: a rank has hung")
    # vLLM's name: its own custom all-reduce is on by default too
    disable_custom_all_reduce: bool = knob(
        False, "GPU tensor parallelism: every all-reduce through NCCL (default: small ones, as in decode steps, "
               "one-shot over peer GPU memory)")
    # SGLang overlaps two micro-batches' communication the same way ("two-batch overlap"), for expert parallelism
    prefill_overlap_tokens: int = knob(
        4096, "tensor parallelism: a step of at least this many tokens runs in two halves, each half's all-reduces "
              "travelling while the other half computes (0: off)")
    # vLLM's name
    async_scheduling: bool | None = knob(
        None, "schedule and launch the next decode step before this step's tokens reach the host, so the host's "
              "work of a step overlaps the GPU's (decode steps without logprobs; others run as before). Default: "
              "on with CUDA, at any tensor-parallel size; off on the CPU, where nothing overlaps and a stop would "
              "be found a step late")
    # vLLM's flag and JSON (engine/kv_events.py), so a deployment's router reads our events unchanged
    kv_events_config: str | None = knob(
        None, "KV cache events over ZMQ in vLLM's format, vLLM's JSON: '{\"enable_kv_cache_events\": true, "
              "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' (keys: "
              "enable_kv_cache_events, publisher zmq|null, endpoint, replay_endpoint, buffer_steps, hwm, "
              "max_queue_size, topic); see docs/kv-events.md")
    # the CLI names it in GiB (--kv-offload-gib, see args.py), like vLLM's --kv-offloading-size
    kv_offload_bytes: int = knob(0, "host-memory tier of the prefix cache, bytes per rank (0: off); see kv/host_tier.py",
                                 cli=False)


def resolve_step_budget(config: EngineConfig, device: str) -> EngineConfig:
    """``config`` with its step knobs (left None: the step budget, the prompt chunk cap, async scheduling) set to
    ``device``'s defaults; explicit values are checked."""
    on_cpu = device == "cpu"
    step = config.max_num_batched_tokens
    if step is None:
        step = CPU_STEP_TOKENS if on_cpu else GPU_STEP_TOKENS
    cap = config.long_prefill_token_threshold
    if cap is None:
        cap = max(1, step // 2) if on_cpu else 0
    if step < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {step}")
    if cap < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), got {cap}")
    if config.prefill_overlap_tokens < 0:
        raise ValueError(f"prefill_overlap_tokens must be >= 0 (0: off), got {config.prefill_overlap_tokens}")
    asynchronous = config.async_scheduling
    if asynchronous is None:
        asynchronous = not on_cpu
    return replace(config, max_num_batched_tokens=step, long_prefill_token_threshold=cap,
                   async_scheduling=asynchronous)
