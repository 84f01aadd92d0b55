"""Time to first token on an evicted 1M-token document: reloaded from the host tier vs recomputed.

One Llama-4-Scout TP-8 rank on one GPU (``scout_rank.py``'s builders: the text config's rank shapes, seeded random
bf16 weights), prefix caching on, block 64, a device pool of 1.25x what the document needs at its peak:

1. the document (1,048,576 tokens) and a first question are prefilled (timed: a cold prefill);
2. other requests then take every block of the pool (allocated directly, nothing computed, so nothing of theirs
   is cached), which evicts the document's cached blocks: the full-attention blocks and the chunked windows
   the retention rule keeps go to the host tier, the rest of the chunked blocks are dropped; a small request's step
   runs the write-backs (timed on the copy stream: device -> host GB/s);
3. a second question on the document: its prefix hit comes from the host tier, its pages are loaded before its
   step (time to first token, and the loads alone on the copy stream);
4. a third question, the document now on the device again: the same step without loads (what the reload adds);
5. the same second question on an engine without the tier, where the evicted document is simply not cached (its
   state after step 2): time to first token of the recompute;
6. a host -> device copy of pinned memory, the same bytes as the loads, one contiguous transfer: the bandwidth
   the loads are compared with.

Goal: reload >= 50x faster than recompute, loads >= 80% of the pinned copy bandwidth.

    python benchmarks/gpu/host_tier.py                    # H200: ~4 minutes (two 1M-token prefills)
    python benchmarks/gpu/host_tier.py --quick            # CPU, a tiny Scout-shaped model, a 2,048-token document
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scout_rank import BLOCK_SIZE, engine_for, prompt, random_model, rank_config  # noqa: E402

from hybridkv.bench.tables import markdown_table  # noqa: E402
from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.kv import KVCacheManager, layer_specs_from_hf_config, plan_layout  # noqa: E402
from hybridkv.model.loading.checkpoint import LoadedModel  # noqa: E402
from hybridkv.model.loading.tokenizer import word_tokenizer  # noqa: E402

STEP = 16384
QUESTION = 64


def tiny_config() -> dict:
    """Scout's layer pattern (every 4th layer full) and MoE at toy size, chunk 256: the --quick model."""
    cfg = rank_config(8)
    layers = 8
    cfg.update(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=1, intermediate_size=64,
               intermediate_size_mlp=128, num_hidden_layers=layers, num_local_experts=2, vocab_size=512,
               attention_chunk_size=256, floor_scale=256, bos_token_id=0, eos_token_id=[1], pad_token_id=2,
               moe_layers=list(range(layers)), no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(layers)])
    return cfg


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_to_first_token(engine, rid: str, tokens: list[int], device: str) -> tuple[float, object]:
    """Seconds from adding the request to its first token; the engine is then run dry. Returns the sequence."""
    engine.add_request(rid, tokens, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seq = engine._requests[rid].seqs[0]
    sync(device)
    start = time.perf_counter()
    while seq.num_output_tokens == 0:
        engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, seq


def evict_everything(engine) -> None:
    """Other requests take every free block of the pool (their pages are never computed, so when they give them
    back nothing of theirs is cached): every cached block is evicted."""
    pool = engine.kv.pool
    taken = pool.get_new_blocks(pool.num_free_blocks)
    assert pool.num_cached_blocks == 0
    pool.free_blocks(taken)


def pinned_copy_gbs(nbytes: int, device: str) -> float:
    """Best of 5 host -> device copies of ``nbytes`` of pinned memory (one transfer)."""
    if device != "cuda":
        return float("nan")
    n = min(nbytes, 8 << 30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, short document")
    ap.add_argument("--doc-tokens", type=int, default=None, help="default 1,048,576 (--quick: 2,048)")
    args = ap.parse_args()
    device = "cpu" if args.quick else "cuda"
    cfg = tiny_config() if args.quick else rank_config(8)
    doc_tokens = args.doc_tokens or (2048 if args.quick else 1 << 20)
    block = 16 if args.quick else BLOCK_SIZE
    kv_dtype = "float32" if args.quick else "bfloat16"
    vocab = cfg["vocab_size"]
    model = random_model(cfg, device)
    loaded = LoadedModel("scout-rank (random weights)", model, word_tokenizer(vocab), cfg)

    layout = plan_layout(layer_specs_from_hf_config(cfg, 1, kv_dtype), block)
    peak = KVCacheManager(layout, 2, max_step_tokens=STEP).peak_blocks(doc_tokens + 2 * QUESTION)
    pool_bytes = int(1.25 * peak + 1) * layout.page_bytes
    host_bytes = int(1.1 * peak) * layout.page_bytes
    common = dict(enable_prefix_caching=True, kv_cache_memory_bytes=pool_bytes, max_num_batched_tokens=STEP)
    if args.quick:
        common.update(device="cpu", dtype="float32")

    doc = prompt(doc_tokens, vocab, 1)
    q1, q2, q3 = (prompt(QUESTION, vocab, s) for s in (2, 3, 4))
    engine = engine_for(loaded, kv_dtype, block, kv_offload_bytes=host_bytes, **common)
    time_to_first_token(engine, "warmup", prompt(min(20000, doc_tokens // 2), vocab, 9), device)  # compiles
    cold, _ = time_to_first_token(engine, "doc-q1", doc + q1, device)
    host, copier = engine.kv.host, engine.runner.copier
    evict_everything(engine)
    written = host.stats.bytes_written
    time_to_first_token(engine, "flush", prompt(QUESTION, vocab, 5), device)  # its step runs the write-backs
    store_s = copier.last_run_seconds() if device == "cuda" else float("nan")
    read_before = host.stats.bytes_read
    reload, seq = time_to_first_token(engine, "doc-q2", doc + q2, device)
    loaded_bytes = host.stats.bytes_read - read_before
    load_s = copier.last_run_seconds() if device == "cuda" else float("nan")
    assert seq.num_cached_prompt_tokens >= doc_tokens - block and loaded_bytes > 0, "the document did not reload"
    resident, seq3 = time_to_first_token(engine, "doc-q3", doc + q3, device)
    assert seq3.num_cached_prompt_tokens >= doc_tokens - block
    del engine, copier, host
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    plain = engine_for(loaded, kv_dtype, block, **common)
    recompute, seq = time_to_first_token(plain, "doc-q2", doc + q2, device)
    assert seq.num_cached_prompt_tokens == 0
    del plain
    gc.collect()
    copy_gbs = pinned_copy_gbs(loaded_bytes, device)

    load_gbs = loaded_bytes / load_s / 1e9
    speedup = recompute / reload
    rows = [
        ["cold prefill, document + question 1", f"{cold:.2f} s", f"{doc_tokens + QUESTION:,} tokens"],
        ["write-back after eviction (device -> host)", mib(written),
         f"{written / store_s / 1e9:.1f} GB/s on the copy stream"],
        ["TTFT question 2, document reloaded from host", f"{reload:.3f} s",
         f"{mib(loaded_bytes)} loaded"],
        ["  of which the loads (copy stream)", f"{load_s:.3f} s",
         f"{load_gbs:.1f} GB/s = {load_gbs / copy_gbs:.0%} of the pinned copy"],
        ["TTFT question 3, document on the device", f"{resident:.3f} s",
         f"reload adds {reload - resident:.3f} s"],
        ["TTFT question 2 without the tier (recompute)", f"{recompute:.2f} s", ""],
        ["pinned host -> device copy, same bytes", f"{copy_gbs:.1f} GB/s", "one transfer, best of 5"],
        ["reload vs recompute", f"{speedup:.1f}x", "goal >= 50x"],
        ["loads vs pinned copy bandwidth", f"{load_gbs / copy_gbs:.0%}", "goal >= 80%"],
    ]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (--quick)"
    print(f"\n{name}: Scout TP-8 rank shapes, block {block}, {doc_tokens:,}-token document, host tier "
          f"{mib(host_bytes)}, device pool {mib(pool_bytes)}")
    print(markdown_table(["measure", "value", "note"], rows))


if __name__ == "__main__":
    main()
