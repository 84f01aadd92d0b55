"""One decode token's 4-bit matmuls of SmolLM2-135M (30 layers x q/k/v, o_proj, gate/up, down_proj: 120 calls, one
row each) through our Q4_1 kernel and through torch's int4 kernel, best of N wall times.

    python benchmarks/cpu_q4_1.py --threads 1 --repeats 50

Random 4-bit weights of the model's shapes (the time does not depend on the values), ~66 MB: more than the L3
cache of a laptop, read from memory as in a decode step. ``--threads``: the kernels' threads (torch's intra-op
threads and ours). Instruction counts, where wall times are noisy (a shared machine):

    valgrind --tool=callgrind python benchmarks/cpu_q4_1.py --kernel ours --repeats 5 --layers 1
    callgrind_annotate --inclusive=yes callgrind.out.<pid> | grep q4_1_cpu.c
    (the same with --repeats 0: the difference is 5 runs of one layer's 4 calls; for torch's kernel, --kernel torch
    and grep _weight_int4pack_mm_cpu. valgrind has no AVX-512: both run their AVX2 code there)
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridkv.model.q4_1_cpu import GROUP, Q41Kernel, pack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: q/k/v, o_proj, gate/up, down_proj


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kernel", choices=["ours", "torch", "both"], default="both")
    p.add_argument("--isa", choices=["best", "avx2", "scalar"], default="best", help="our kernel's instruction set")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ours = Q41Kernel.load(args.threads)
    if ours is None:
        raise SystemExit("our Q4_1 kernel is not built (pip install -e . with a C compiler, or python setup.py "
                         "build_ext --inplace) or this CPU has no AVX2")
    if args.isa != "best":
        ours.isa = {"avx2": 1, "scalar": 0}[args.isa]
    g = torch.Generator().manual_seed(0)
    calls = {"ours": [], "torch": []}
    for _ in range(args.layers):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
            d, m = torch.rand(n, k // GROUP, generator=g) * 0.01, torch.randn(n, k // GROUP, generator=g) * 0.05
            x = torch.randn(1, k, generator=g)
            packed = pack(q, d, m)
            calls["ours"].append(lambda packed=packed, n=n, x=x: ours(packed, n, x))
            int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            scales = torch.stack((d.t(), (m + 8 * d).t()), -1).bfloat16().contiguous()
            calls["torch"].append(lambda int4=int4, scales=scales, x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.bfloat16(), int4, GROUP, scales))
    kinds = ["ours", "torch"] if args.kernel == "both" else [args.kernel]
    best = {kind: float("inf") for kind in kinds}
    for _ in range(args.repeats + 1):  # the first: a warm-up
        for kind in kinds:  # interleaved: a busy moment of the machine hits both
            start = time.perf_counter()
            for call in calls[kind]:
                call()
            best[kind] = min(best[kind], time.perf_counter() - start)
    if args.repeats:
        for kind in kinds:
            name = ours.name if kind == "ours" else "torch's int4 kernel (bf16 activations)"
            print(f"{name}: {best[kind] * 1e3:.2f} ms for {len(calls[kind])} calls, best of {args.repeats}")


if __name__ == "__main__":
    main()
