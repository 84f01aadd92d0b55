"""The Hopper prefill kernel on one shape, a few launches and nothing else: a target for Nsight Compute.

    ncu --clock-control none -k regex:paged_prefill_hopper --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o prof python tools/kernel_dev/hopper_once.py --chunked
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv   # warp-stall samples per instruction

Prints the largest difference from SDPA over the same inputs, so a profile is never taken of a wrong kernel.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu.attention import D
from tools.kernel_dev.hopper_kernel import shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=131072, help="one-shot causal prefill")
    ap.add_argument("--chunked", action="store_true", help="a chunked(8192) layer instead of a full one")
    ap.add_argument("--fp8", action="store_true", help="the FP8-compute kernel over an e4m3 cache")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    backend, _, seqs, q, k, v, want, _ = shapes(args.fp8, args.length, 0, 0, chunked=args.chunked)[0]
    backend.begin_step(seqs)
    for _ in range(args.launches):
        out = backend.attend(0, q, k, v, D ** -0.5)
    torch.cuda.synchronize()
    print(f"max |out - SDPA| = {(out[: want.shape[0]].float() - want.float()).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
