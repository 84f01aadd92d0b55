"""One-shot prefill rows of ``attention.py`` timed eager and as CUDA-graph replays, the CPU time of one attend()
call, and SDPA (flash, cuDNN) given the KV head by a repeat_interleave copy (as an earlier ``attention.py`` did)
or in place (``enable_gqa=True``, as it does now). Every output is checked against SDPA before it is timed.

    python tools/kernel_dev/eager_graphed.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import attention as A  # noqa: E402


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def row(n: int, chunked: bool) -> str:
    _, _, q, k, v, fn = A.one_shot(n, chunked)
    ref = A.sdpa(q, k, v, chunked)
    assert A.rel_err(fn(), ref) < 1e-2
    flops = 4 * A.HQ * A.D * A.useful_pairs(n, chunked)
    tflops = lambda ms: f"{flops / ms / 1e9:.0f}"  # noqa: E731
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    cpu_us = (time.perf_counter() - t0) * 1e6
    graph = A.graphed(fn)
    assert A.rel_err(fn(), ref) < 1e-2
    cells = [f"ours eager {tflops(median_ms(fn))}", f"ours graphed {tflops(median_ms(graph))}",
             f"attend CPU {cpu_us:.0f} us"]
    for cudnn in (False, True):
        name = "cuDNN" if cudnn else "flash"
        copied = lambda: A.sdpa(q, k, v, chunked, cudnn, repeat_kv=True)  # noqa: E731
        in_place = lambda: A.sdpa(q, k, v, chunked, cudnn)  # noqa: E731
        try:
            err = A.rel_err(in_place(), ref)
            assert err < 1e-2, err
            cells += [f"{name} repeat {tflops(median_ms(copied))}", f"{name} gqa {tflops(median_ms(in_place))}",
                      f"{name} gqa graphed {tflops(median_ms(A.graphed(in_place)))}"]
        except Exception as e:  # noqa: BLE001 - report, don't hide
            cells += [f"{name} gqa error {type(e).__name__}: {str(e)[:100]}"]
    return f"{'chunked' if chunked else 'full'} {n:,}: " + " | ".join(cells)


def main() -> None:
    for n, chunked in ((131072, True), (1 << 20, True), (131072, False)):
        print(row(n, chunked), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
