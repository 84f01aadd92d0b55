"""A prompt chunk's attention on CPU: hybridkv's kernel (``hybridkv/model/prompt_attention_cpu.c``, float32 on
AVX-512, reading the paged cache) against torch's float32 CPU flash kernel (what ``torch_paged._by_segments`` runs
where ours does not), on SmolLM2-135M's heads (9 query heads over 3 KV heads of 64), for a chunk of queries at the
end of a prompt.

    python benchmarks/cpu_prompt_attention.py --threads 2

Torch's kernel gets the chunk's earlier keys already gathered, its KV heads repeated for the query heads (not
timed) and no mask: the unmasked part over earlier keys, the bulk of ``_by_segments``' work, so a lower bound on
that path's time. GFLOP/s count 4 x queries x heads x head size x keys seen (causal for ours). Both outputs are
first checked against float64 (max |difference|).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from hybridkv.kv import FullAttentionSpec, plan_layout
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.prompt_attention_cpu import PromptAttentionKernel
from hybridkv.model.attention.torch_paged import TorchPagedAttention

HQ, HKV, D, PAGE, SCALE = 9, 3, 64, 16, 0.125


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def row(n: int, chunk: int, repeats: int, g: torch.Generator) -> str:
    spec, pages, start = FullAttentionSpec(HKV, D, "float32"), -(-n // PAGE), n - chunk
    attn = TorchPagedAttention(plan_layout([spec], PAGE), pages, "float32")
    table = np.random.default_rng(0).permutation(pages)
    k, v, q = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g), torch.randn(chunk, HQ, D,
                                                                                                    generator=g)
    attn.begin_step([StepSequence(0, n, [table])])
    attn.write(0, k, v)
    attn.begin_step([StepSequence(start, chunk, [table])])
    ours = lambda: attn.attend_stored(0, q, SCALE)  # noqa: E731
    as_4d = lambda x: x.repeat_interleave(HQ // x.shape[1], 1).transpose(0, 1)[None].contiguous()  # noqa: E731
    q4, k4, v4 = as_4d(q), as_4d(k[:start]), as_4d(v[:start])
    theirs = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(  # noqa: E731
        q4, k4, v4, 0.0, False, scale=SCALE)[0]
    causal = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
    want = F.scaled_dot_product_attention(q4.double(), as_4d(k).double(), as_4d(v).double(), attn_mask=causal,
                                          scale=SCALE)[0].transpose(0, 1)
    want_past = F.scaled_dot_product_attention(q4.double(), k4.double(), v4.double(), scale=SCALE)[0]
    diff_ours, diff_theirs = (ours() - want).abs().max().item(), (theirs()[0] - want_past).abs().max().item()
    t_ours, t_theirs = best_of(ours, repeats), best_of(theirs, repeats)
    rate_ours = 4 * HQ * D * sum(range(start + 1, n + 1)) / t_ours / 1e9
    rate_theirs = 4 * HQ * D * chunk * start / t_theirs / 1e9
    return (f"| {n:,} | {t_ours * 1e3:.1f} | {rate_ours:.0f} | {diff_ours:.1e} | {t_theirs * 1e3:.1f} | "
            f"{rate_theirs:.0f} | {diff_theirs:.1e} | {rate_ours / rate_theirs:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=256, help="query tokens (the CPU's prompt chunk)")
    p.add_argument("--contexts", default="1024,4096,8000", help="prompt lengths, the chunk at the end of each")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if PromptAttentionKernel.load() is None:
        raise SystemExit("hybridkv's prompt attention kernel does not run here (needs AVX-512 and the build)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print("| prompt | ours ms | GFLOP/s | max diff | torch flash ms | GFLOP/s | max diff | ours / torch, rate |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(c) for c in args.contexts.split(",")):
        print(row(n, args.chunk, args.repeats, g), flush=True)
    load = os.getloadavg()
    print(f"\nthe last {args.chunk} queries of each prompt, {args.threads} thread(s), best of {args.repeats}; load "
          f"average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")


if __name__ == "__main__":
    main()
