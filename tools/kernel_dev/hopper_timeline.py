"""Where a work item's time goes in the Hopper prefill kernel: timestamps from inside the kernel, per CTA.

A copy of the kernel (``hopper_kernel.variant``, plus the edits below) has consumer 0's first thread note, for its
CTA: the SM clock at entry, once its queries are in shared memory, once the first K/V tile has landed, after the
last P V, after the epilogue; and the global timer at entry and exit, with the SM it ran on. They go to the LSE
buffer, which a one-shot, unsplit launch never uses. Printed per variant (``--cases`` of ``hopper_kernel.py``'s
edits): the SM clock inside the kernel (its cycles over its nanoseconds), the mean of each phase in microseconds
at that clock, and the gap between one CTA's exit and the next CTA's entry on the same SM. Chunked(8192) by
default: its work items are short (32 key tiles on average), so their fixed costs show.

The SM clock under this load moves with temperature and with the data the dots multiply, by several percent between
two launches of the same kernel; a work item's cycles do not. ``--baseline FILE`` times another version of the
kernel's source (e.g. ``git show REV:hybridkv/kernels/hopper_attention.cu``, with the same launch parameters) beside
each case, interleaved over ``--rounds``, so a change is judged by its cycles per item in the same run.

    python tools/kernel_dev/hopper_timeline.py [--length 131072] [--full] [--fp8] [--cases "as built,no Q load"]
        [--baseline FILE] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.attention import D, SmClock, bench, rel_err
from tools.kernel_dev.hopper_kernel import shapes, variant
from hybridkv.bench.tables import markdown_table
from hybridkv.kernels import hopper_attention

PRELUDE = """
__device__ __forceinline__ u64 tl_global() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 tl_smid() {
  u32 r;
  asm volatile("mov.u32 %0, %smid;" : "=r"(r));
  return r;
}
"""
PREFILL = "template <bool FP8>\n__device__ __forceinline__ void prefill("
STAMP = ("  if (tid == 128) {\n"
         "    u64* b = reinterpret_cast<u64*>(p.lse) + 8ull * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * "
         "blockIdx.z));\n"
         "    b[0] = tl_g0; b[2] = tl_c0; b[3] = tl_q; b[4] = tl_k; b[5] = tl_loop; b[6] = clock64();\n"
         "    b[7] = tl_smid() | ((u64)n_iter << 32); b[1] = tl_global();\n  }\n")
FIELDS = 8  # u64 per CTA: global entry, global exit, clock at entry, Q in, first tile, loop done, exit, smid|n_iter
TIMELINE = [
    (PREFILL, PRELUDE + PREFILL),
    ("  const int tid = threadIdx.x;\n",
     "  const u64 tl_g0 = tl_global(), tl_c0 = clock64();\n  u64 tl_q = 0, tl_k = 0, tl_loop = 0;\n"
     "  const int tid = threadIdx.x;\n"),
    ("  fence_proxy_async();\n  bar_sync(4 + cw, 128);\n",
     "  fence_proxy_async();\n  bar_sync(4 + cw, 128);\n  tl_q = clock64();\n"),
    ("    mbar_wait(full_bar, 0);\n", "    mbar_wait(full_bar, 0);\n    tl_k = clock64();\n"),
    ("  // ---------------- epilogue:", "  tl_loop = clock64();\n  // ---------------- epilogue:"),
    ("    }\n  }\n}\n\nextern \"C\"", "    }\n  }\n" + STAMP + "}\n\nextern \"C\""),
    ("    return;\n  }\n  const float NEG_INF", STAMP + "    return;\n  }\n  const float NEG_INF"),  # bf16's staged O
]


def timeline_source(edits: list[str], text: str | None = None) -> str:
    text = variant(edits, text)
    for old, new in TIMELINE:
        assert text.count(old) == 1, f"the kernel's source changed ({old[:40]!r} found {text.count(old)} times)"
        text = text.replace(old, new)
    return text


def phases(stamps: np.ndarray) -> list[str]:
    """The SM clock inside the kernel (cycles over nanoseconds), the mean microseconds of each phase over the CTAs
    at that clock, and the gap between CTAs on one SM."""
    g0, g1, c0, cq, ck, cl, c1 = (stamps[:, i].astype(np.int64) for i in range(7))
    sm, n_iter = stamps[:, 7] & 0xFFFFFFFF, stamps[:, 7] >> 32
    live = n_iter > 0
    mhz = (c1 - c0).sum() / (g1 - g0).sum() * 1e3
    us = lambda cycles: cycles[live].mean() / mhz  # noqa: E731
    gaps = []
    for s in np.unique(sm):
        on = np.flatnonzero(sm == s)
        order = on[np.argsort(g0[on])]
        gaps.append(g0[order[1:]] - g1[order[:-1]])
    gap = np.concatenate(gaps)
    span = g1.max() - g0.min()
    busy = (g1 - g0).sum() / (span * len(np.unique(sm)))
    return [f"{mhz:.0f}", f"{live.sum():,}", f"{n_iter[live].mean():.1f}", f"{us(cq - c0):.2f}", f"{us(ck - c0):.2f}",
            f"{us(cl - ck) / n_iter[live].mean():.2f}", f"{us(c1 - cl):.2f}", f"{us(c1 - c0):.2f}",
            f"{(c1 - c0)[live].mean():,.0f}", f"{np.median(gap) / 1e3:.2f}", f"{busy:.1%}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=131072, help="one-shot causal prefill")
    ap.add_argument("--full", action="store_true", help="a full layer instead of chunked(8192)")
    ap.add_argument("--fp8", action="store_true", help="the FP8-compute kernel over an e4m3 cache")
    ap.add_argument("--cases", default="as built,no Q load", help="comma-separated: 'as built' or hopper_kernel "
                    "edits joined by ' + '")
    ap.add_argument("--baseline", help="another version of hopper_attention.cu, timed beside each case")
    ap.add_argument("--rounds", type=int, default=1, help="times each case (and its baseline) is timed, interleaved")
    args = ap.parse_args()
    sources = [("", None)] + ([("baseline: ", Path(args.baseline).read_text())] if args.baseline else [])
    torch.manual_seed(0)
    backend, _, seqs, q, k, v, want, flop = shapes(args.fp8, args.length, 0, 0, chunked=not args.full)[0]
    # no KV splits: the stamps take the LSE buffer, which only a split launch uses (a full layer's long items split
    # to fill the last wave of SMs; with one SM counted, every split count fills it)
    backend.builder.device = dataclasses.replace(backend.builder.device, num_sms=1)
    clock = SmClock()
    rows = []
    runs = [(label, case, text) for _ in range(args.rounds) for case in args.cases.split(",")
            for label, text in sources]
    for label, case, text in runs:
        edits = [] if case == "as built" else case.split(" + ")
        kernel = hopper_attention.HopperPrefill(torch.device("cuda"), source=timeline_source(edits, text),
                                                cache_dir=None)
        backend.hopper.kernel = kernel
        stamps = torch.zeros(0, dtype=torch.int64, device="cuda")
        launch = kernel.launch

        def stamped(grid, tensors, *rest, launch=launch):
            # one buffer for every launch (every slot is rewritten), so the timed launches run no extra memset
            nonlocal stamps
            if stamps.shape[0] != grid[0] * grid[1] * grid[2]:
                stamps = torch.zeros(grid[0] * grid[1] * grid[2], FIELDS, dtype=torch.int64, device="cuda")
            assert tensors.get("lse") is None, "the timeline needs an unsplit one-shot launch (no LSE)"
            launch(grid, dict(tensors, lse=stamps), *rest)

        kernel.launch = stamped
        backend.begin_step(seqs)
        err = rel_err(backend.attend(0, q, k, v, D ** -0.5)[: want.shape[0]], want)
        ms, span = clock.window(lambda: bench(lambda: backend.attend(0, q, k, v, D ** -0.5)))
        torch.cuda.synchronize()
        sm = clock.median(span)
        row = [label + case, f"{ms:.2f}", f"{flop / ms / 1e9:.0f}", f"{err:.1e}",
               "n/a" if sm is None else f"{sm[0]:.0f}"]
        rows.append(row + phases(stamps.cpu().numpy().view(np.uint64)))
        print(" | ".join(rows[-1]), flush=True)
    clock.close()
    print(f"\n{torch.cuda.get_device_name()}, 64-token pages: one-shot causal prefill of {args.length:,} tokens, "
          + ("full" if args.full else "chunked(8192)") + (", FP8 compute" if args.fp8 else ", bf16")
          + "; per CTA (one work item), means in microseconds at the SM clock inside the kernel")
    print(markdown_table(["variant", "ms", "TFLOP/s", "rel err", "nvidia-smi MHz", "in-kernel MHz", "work items",
                          "key tiles / item", "entry -> Q in", "entry -> 1st tile", "per key tile", "last P V -> exit",
                          "entry -> exit", "cycles / item", "gap on SM (median)", "SMs busy"], rows))


if __name__ == "__main__":
    main()
