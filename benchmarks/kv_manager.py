"""KV cache manager overhead on the Llama-4-Scout layout (TP 8, block 16), pure Python, no GPU.

Measures the scheduler-side cost of the hybrid KV cache manager: one decode step (``allocate_slots`` for one
token + ``on_tokens_computed``) and one 8,192-token prefill chunk, for one request at 128K, 1M and 10M tokens of
context (filled through the manager, prefix caching on), and freeing that request (the engine's loop waits for it
when a request ends); and for 32 concurrent 32K requests sharing a 16K prefix.

    python benchmarks/kv_manager.py            # full run (~1-3 min)
    python benchmarks/kv_manager.py --quick    # tiny run

Times are CPU time of this process (``time.process_time``), so other load on a shared machine does not inflate
them; each is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from hybridkv.bench.tables import markdown_table
from hybridkv.kv import CacheRequest, KVCacheManager, layer_specs_from_hf_config, plan_layout
from hybridkv.model.loading.hf_config import load_hf_config

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "scout-text-config.json"
CHUNK = 8192
BLOCK = 16
ROUNDS = 5  # timings are the median over rounds (prefill: over the timed chunks)


def scout_layout():
    return plan_layout(layer_specs_from_hf_config(load_hf_config(CONFIG), tensor_parallel_size=8), BLOCK)


class Tokens:
    """Distinct token blocks without one Python int per token: the base list's objects are reused."""

    def __init__(self, seed: int) -> None:
        self.base = [seed * 1_000_003 + i for i in range(CHUNK)]
        self.n = 0

    def next_chunk(self) -> list[int]:
        # Chained hashes make every block distinct; shift the chunk so no two chunks repeat anyway.
        self.n += 1
        return self.base[self.n % CHUNK :] + self.base[: self.n % CHUNK]


def prefill(kv: KVCacheManager, req: CacheRequest, n: int) -> None:
    assert kv.allocate_slots(req, n), "pool too small"
    req.num_computed_tokens += n
    kv.on_tokens_computed(req)


def decode(kv: KVCacheManager, req: CacheRequest) -> None:
    req.all_token_ids.append(7)
    assert kv.allocate_slots(req, 1), "pool too small"
    req.num_computed_tokens += 1
    kv.on_tokens_computed(req)


def single(context: int, steps: int, timed_chunks: int) -> tuple[float, float, float]:
    """(µs per decode step, ms per prefill chunk, ms to free the request) for one request at ``context`` tokens."""
    layout = scout_layout()
    probe = KVCacheManager(layout, 2)
    num_blocks = probe.peak_blocks(context + steps + CHUNK) + 64
    kv = KVCacheManager(layout, num_blocks, max_step_tokens=CHUNK)
    toks = Tokens(1)
    req = CacheRequest("long", [])
    chunk_times = []
    while req.num_computed_tokens + CHUNK <= context:
        req.all_token_ids.extend(toks.next_chunk())
        timed = req.num_computed_tokens + CHUNK * timed_chunks >= context
        t0 = time.process_time()
        prefill(kv, req, CHUNK)
        if timed:
            chunk_times.append(time.process_time() - t0)
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.process_time()
        for _ in range(steps // ROUNDS):
            decode(kv, req)
        rounds.append((time.process_time() - t0) / (steps // ROUNDS) * 1e6)
    t0 = time.process_time()
    kv.free(req)
    freed = time.process_time() - t0
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    return statistics.median(rounds), statistics.median(chunk_times) * 1e3, freed * 1e3


def batch(num_reqs: int, length: int, shared: int, steps: int) -> tuple[float, float, float]:
    """(µs per batch decode step, ms per prefill chunk, prefix hit rate) for ``num_reqs`` concurrent requests."""
    layout = scout_layout()
    probe = KVCacheManager(layout, 2)
    num_blocks = num_reqs * probe.peak_blocks(length + steps) + 64
    kv = KVCacheManager(layout, num_blocks, max_step_tokens=CHUNK)
    prefix = []
    ptoks = Tokens(2)
    while len(prefix) < shared:
        prefix += ptoks.next_chunk()[: shared - len(prefix)]
    reqs, chunk_times = [], []
    for r in range(num_reqs):
        req = CacheRequest(f"r{r}", list(prefix))
        toks = Tokens(100 + r)
        while len(req.all_token_ids) < length:
            req.all_token_ids.extend(toks.next_chunk()[: length - len(req.all_token_ids)])
        hit = kv.find_cache_hit(req)
        first = min(CHUNK, length - hit.num_tokens)
        assert kv.allocate_slots(req, first, hit)
        kv.record_hit(req, hit)  # what the scheduler does on admission: counts the lookup in the metrics
        req.num_computed_tokens = hit.num_tokens + first
        kv.on_tokens_computed(req)
        while req.num_computed_tokens < length:
            n = min(CHUNK, length - req.num_computed_tokens)
            t0 = time.process_time()
            prefill(kv, req, n)
            chunk_times.append(time.process_time() - t0)
        reqs.append(req)
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.process_time()
        for _ in range(steps // ROUNDS):
            for req in reqs:
                decode(kv, req)
        rounds.append((time.process_time() - t0) / (steps // ROUNDS) * 1e6)
    for req in reqs:
        kv.free(req)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    return statistics.median(rounds), statistics.median(chunk_times) * 1e3, kv.stats.hit_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny run: small contexts, few steps")
    args = ap.parse_args()
    if args.quick:
        contexts = [("32K", 32 * 1024), ("128K", 128 * 1024)]
        steps, timed, batch_args = 500, 3, (4, 32 * 1024, 16 * 1024, 100)
    else:
        contexts = [("128K", 128 * 1024), ("1M", 1024 * 1024), ("10M", 10 * 1024 * 1024)]
        steps, timed, batch_args = 20_000, 8, (32, 32 * 1024, 16 * 1024, 1000)

    rows = []
    for name, ctx in contexts:
        us, ms, free_ms = single(ctx, steps, timed)
        rows.append((f"1 request, {name} context", f"{us:.1f}", f"{ms:.2f}", f"{free_ms:.1f}", ""))
    decode_small, decode_big = float(rows[0][1]), float(rows[-1][1])
    n, length, shared, bsteps = batch_args
    us, ms, hit_rate = batch(n, length, shared, bsteps)
    rows.append(
        (f"{n} requests x {length // 1024}K, {shared // 1024}K shared", f"{us:.1f} (batch)", f"{ms:.2f}", "",
         f"prefix hit {hit_rate:.0%}")
    )
    head = ("scenario (Scout TP8, block 16)", "decode step µs", "prefill chunk ms", "free ms", "note")
    print(markdown_table(head, rows))
    ratio = decode_big / decode_small
    print(f"decode {contexts[-1][0]} / {contexts[0][0]}: {ratio:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
