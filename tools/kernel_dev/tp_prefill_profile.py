"""One prefill step of Scout (16,384 tokens unless ``--step-tokens`` says otherwise) with a TP-8 rank's shapes per
GPU, at TP 1 or split over TP 2 GPUs: wall time over a chosen context, layers whole and in two halves, then rank 0's
GPU profiled over one step of each: busy, idle within the step, and the kernels' (and copies') time summed by name,
side by side. At TP 1 the halves communicate nothing: what they cost there is the split's own.

    PYTHONPATH=. python tools/kernel_dev/tp_prefill_profile.py --tensor-parallel-size 2 --context 0
    PYTHONPATH=. python tools/kernel_dev/tp_prefill_profile.py --tensor-parallel-size 1 --context 0

Run one size per process (an engine's GPU memory is only all given back when its process ends). The KV cache is
filled with random values, as in ``benchmarks/gpu/scout_rank.py``, whose engine and step this uses.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu import scout_rank  # noqa: E402


def profiled_step(engine, context: int, vocab: int) -> tuple[float, float, float, dict[str, list[float]]]:
    """(wall ms, busy ms, ms from the first kernel to the last, {name: [ms, count]}) of one step on rank 0."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        scout_rank.step_seconds(engine, context, vocab)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:60]][0] += (e.time_range.end - e.time_range.start) / 1000
            by_name[e.name[:60]][1] += 1
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, reach = 0.0, spans[0][0]
    for s, e in spans:  # the union of the intervals: kernels and copies overlap across streams
        busy += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    return 1000 * wall, busy / 1000, (reach - spans[0][0]) / 1000, by_name


def compare(engine, tp: int, context: int, top: int) -> None:
    """Step times with the layers whole and in halves, then a profile of each, side by side."""
    vocab, halves = engine.model.cfg.vocab_size, engine.config.prefill_overlap_tokens
    engine.collective_rpc(scout_rank.fill_random_cache)
    scout_rank.step_seconds(engine, 0, vocab)  # compiles the kernels
    ways = [(0, "layers whole"), (halves, "two halves")]  # at TP 1 the halves only show their own cost
    profiles = []
    for tokens, how in ways:
        engine.collective_rpc(scout_rank.set_prefill_halves, tokens)
        best = min(scout_rank.step_seconds(engine, context, vocab) for _ in range(3))
        print(f"TP {tp} {how}: step over {context:,}: {1000 * best:.1f} ms (best of 3)", flush=True)
    for tokens, how in ways:  # profiles last: after torch's profiler, launches cost more host time
        engine.collective_rpc(scout_rank.set_prefill_halves, tokens)
        wall, busy, span, by_name = profiled_step(engine, context, vocab)
        print(f"TP {tp} {how} profiled: wall {wall:.1f} ms, busy {busy:.1f} ms, "
              f"idle {span - busy:.1f} of {span:.1f} ms")
        profiles.append(by_name)
    whole, split = profiles
    print(f"{'whole ms':>9} {'n':>5} {'halves ms':>9} {'n':>5}  kernel")
    for name in sorted(whole.keys() | split.keys(), key=lambda k: -split.get(k, [0.0])[0])[:top]:
        (a, n), (b, m) = whole.get(name, (0.0, 0)), split.get(name, (0.0, 0))
        print(f"{a:9.2f} {n:5d} {b:9.2f} {m:5d}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor-parallel-size", type=int, default=2, choices=(1, 2))
    ap.add_argument("--context", type=int, default=0, help="cached tokens the step comes after")
    ap.add_argument("--step-tokens", type=int, default=scout_rank.STEP_TOKENS, help="the step's new tokens")
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    tp = args.tensor_parallel_size
    scout_rank.on_dummy_engine(scout_rank.rank_config(8 // tp), tp,
                               lambda engine: compare(engine, tp, args.context, args.top),
                               max_num_batched_tokens=args.step_tokens)


if __name__ == "__main__":
    main()
