"""One tensor-parallel rank of Llama-4-Scout at TP 8, on one GPU, through the whole engine.

The text config (`tests/data/scout-text-config.json`, = `../shared/scout-text-config.json`) with attention heads,
MLP/expert widths and the vocabulary divided by the TP size (KV heads: one per rank), all 48 layers and 16 experts,
seeded random bf16 weights built on the GPU (~25 GiB: no checkpoint travels). The all-reduces of real TP are absent;
per-GPU compute and memory are those of one rank. Reports:

- `hybridkv plan`'s max_model_len for the KV memory this GPU actually gives, vs the engine's;
- prefill wall time of one cold prompt (prefix caching off) of each length, time to first token;
- decode step latency at long contexts: the KV cache is FILLED WITH RANDOM VALUES (written, not computed by a
  prefill) up to the context, then the engine decodes; bf16 and fp8 KV;
- peak GPU memory.

    python benchmarks/gpu/scout_rank.py [--prefill-lengths 1048576,2845646] [--decode-contexts 1048576,5242880,10000000]
        [--kv-dtypes bfloat16,fp8_e4m3] [--block-size 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.sequence import SequenceStatus
from hybridkv.kv.planner import plan_capacity
from hybridkv.model.checkpoint import LoadedModel
from hybridkv.model.config import ModelConfig
from hybridkv.model.llama import LlamaForCausalLM
from hybridkv.model.dummy_weights import word_tokenizer

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "data" / "scout-text-config.json"


def rank_config(tp: int) -> dict:
    cfg = json.loads(CONFIG.read_text())
    cfg["num_attention_heads"] //= tp
    cfg["num_key_value_heads"] = max(1, cfg["num_key_value_heads"] // tp)
    cfg["intermediate_size"] //= tp
    cfg["intermediate_size_mlp"] //= tp
    cfg["vocab_size"] //= tp  # vocab-parallel embedding and LM head
    return cfg


def random_model(cfg: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf(cfg), dtype=torch.bfloat16)
    model = model.to_empty(device="cuda").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


# 64-token pages: a prefill key tile (64 keys) then lies in one page, one table entry per tile instead of one per
# key (16K-token step at 1M context on an H200: 441 TFLOP/s vs 400 with 16-token pages). --block-size changes it.
BLOCK_SIZE = 64


def engine_for(loaded: LoadedModel | None, kv_dtype: str, block_size: int = BLOCK_SIZE, **overrides) -> LLMEngine:
    config = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype=kv_dtype, block_size=block_size,
                          max_num_batched_tokens=16384, max_num_seqs=8, enable_prefix_caching=False,
                          gpu_memory_utilization=0.92)
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config, loaded)


def decode_after_prefill_ms(engine: LLMEngine, n: int, vocab: int, steps: int = 8) -> tuple[float, float]:
    """(prefill seconds, median decode step ms) of one request of ``n`` prompt tokens, its KV computed for real."""
    engine.add_request(f"real-{n}", prompt(n, vocab, n + 1), SamplingParams(
        temperature=0, max_tokens=steps + 3, ignore_eos=True))
    seq = engine._requests[f"real-{n}"].seqs[0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    while seq.num_output_tokens == 0:
        engine.step()
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    engine.step()
    return prefill, median_step_ms(engine, steps)


def tensor_parallel_rows(size: int, n: int) -> list[list[str]]:
    """Scout with the shapes of one TP-(8/size) rank, split over ``size`` GPUs by real tensor parallelism: each GPU
    holds what one GPU holds in the single-GPU run, plus the all-reduces. Weights: load_format=dummy."""
    import tempfile

    rows = []
    for tp in (1, size):
        cfg = rank_config(8 // tp)
        with tempfile.TemporaryDirectory() as path:
            Path(path, "config.json").write_text(json.dumps(cfg))
            engine = engine_for(None, "bfloat16", model=path, load_format="dummy", tensor_parallel_size=tp,
                                enforce_eager=True)
            vocab = cfg["vocab_size"]
            decode_after_prefill_ms(engine, 20000, vocab, steps=2)  # compiles the kernels; not reported
            seconds, ms = decode_after_prefill_ms(engine, n, vocab)
            label = f"TP {tp}, Scout/{8 // tp} split over {tp} GPU(s)"
            rows.append(["bfloat16", f"{label}: prefill {n:,} (cold)", f"{seconds:.1f} s", f"{n / seconds:,.0f} tok/s"])
            rows.append(["bfloat16", f"{label}: decode step after it (eager)", f"{ms:.1f} ms", ""])
            print(rows[-2], rows[-1], flush=True)
            engine.shutdown()
            del engine
            torch.cuda.empty_cache()
    return rows


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def prefill_seconds(engine: LLMEngine, n: int, vocab: int) -> float:
    engine.add_request(f"prefill-{n}", prompt(n, vocab, n), SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def fill_random(engine: LLMEngine) -> None:
    """Random K/V everywhere (not zeros: timing on zeros can flatter)."""
    buf = engine.backend.cache.buffer
    for rows in torch.split(torch.arange(buf.shape[0], device="cuda"), 4096):
        chunk = torch.randn(len(rows), buf.shape[1], device="cuda", dtype=torch.bfloat16)
        buf[rows] = chunk.to(buf.dtype)


def decode_ms(engine: LLMEngine, context: int, vocab: int, steps: int = 8) -> float:
    """Decode latency with ``context`` tokens already in a cache filled with random values."""
    engine.add_request(f"decode-{context}", prompt(context, vocab, 7), SamplingParams(
        temperature=0, max_tokens=steps + 2, ignore_eos=True))
    seq = engine.scheduler.waiting.popleft()
    # slots for all but the last prompt token, a piece at a time so chunked layers drop what left their chunk; the
    # KV of these tokens "exists" as the random values filled in before, it is not computed
    piece = 1 << 20
    while seq.num_computed_tokens < context - 1:
        n = min(piece, context - 1 - seq.num_computed_tokens)
        assert engine.kv.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        engine.kv.on_tokens_computed(seq)
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    engine.step()  # the last prompt token, then decodes
    engine.step()
    return median_step_ms(engine, steps)


def median_step_ms(engine: LLMEngine, steps: int) -> float:
    """Median wall time of the next ``steps`` engine steps; then runs the engine dry."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="1: one TP-8 rank on one GPU; 2, 4, 8: real TP over that many GPUs, each holding a TP-8 rank")
    ap.add_argument("--prefill-lengths", default="1048576")
    ap.add_argument("--decode-contexts", default="1048576,5242880,10000000")
    ap.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3")
    ap.add_argument("--tp-prefill-length", type=int, default=1048576)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    args = ap.parse_args()
    if args.tensor_parallel_size in (2, 4, 8):
        rows = tensor_parallel_rows(args.tensor_parallel_size, args.tp_prefill_length)
        print_table(rows, f"Llama-4-Scout, tensor parallelism {args.tensor_parallel_size} vs 1, block {BLOCK_SIZE}")
        return
    cfg = rank_config(8)
    model = random_model(cfg)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    loaded = LoadedModel("scout-rank (random weights)", model, word_tokenizer(cfg["vocab_size"]), cfg)
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        engine = engine_for(loaded, kv_dtype, args.block_size)
        kv_bytes = engine.kv.pool.num_blocks * engine.layout.page_bytes
        full = json.loads(CONFIG.read_text())
        plan = plan_capacity(full, tensor_parallel_size=8, kv_cache_dtype=kv_dtype,
                             block_size=args.block_size, kv_memory_bytes=kv_bytes, max_num_batched_tokens=16384)
        rows.append([kv_dtype, "KV memory allocated", f"{kv_bytes / 2**30:.2f} GiB", f"weights {weights_gib:.2f} GiB"])
        rows.append([kv_dtype, "max_model_len plan / engine", f"{plan.max_model_len:,} / {engine.max_model_len:,}",
                     "engine capped by max_position_embeddings" if engine.max_model_len < plan.max_model_len else ""])
        if args.prefill_lengths:
            prefill_seconds(engine, 20000, cfg["vocab_size"])  # compiles the kernels; not reported
            for n in (int(x) for x in args.prefill_lengths.split(",") if x):
                s = prefill_seconds(engine, n, cfg["vocab_size"])
                rows.append([kv_dtype, f"prefill {n:,} tokens (cold)", f"{s:.1f} s", f"{n / s:,.0f} tok/s"])
                print(rows[-1], flush=True)
        fill_random(engine)
        for ctx in (int(x) for x in args.decode_contexts.split(",") if x):
            if ctx > engine.max_model_len:
                rows.append([kv_dtype, f"decode step @ {ctx:,}", "does not fit", ""])
                continue
            ms = decode_ms(engine, ctx, cfg["vocab_size"])
            rows.append([kv_dtype, f"decode step @ {ctx:,} (random KV)", f"{ms:.1f} ms", ""])
            print(rows[-1], flush=True)
        rows.append([kv_dtype, "peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", ""])
        del engine
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print_table(rows, f"Llama-4-Scout rank shapes at TP 8, block {args.block_size}")


def print_table(rows: list[list[str]], title: str) -> None:
    print(f"\n{torch.cuda.get_device_name()} x {torch.cuda.device_count()}: {title} "
          "(48 layers, 12 full + 36 chunked(8192), 16 experts), batch 1, step 16,384 tokens")
    print("| KV dtype | measure | value | note |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
