"""One-shot prefill rows of ``attention.py`` timed eager and as CUDA-graph replays, the CPU time of one attend()
call, and SDPA (flash, cuDNN) given the KV head by a repeat_interleave copy (as ``attention.py`` did before run 124)
or in place (``enable_gqa=True``, as it does now). Every output is checked against SDPA before it is timed.

    python benchmarks/gpu/eager_graphed.py     # run 123 (thirteenth session, docs/benchmarks.md)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as A  # noqa: E402

from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec  # noqa: E402
from hybridkv.model.attention.base import StepSequence  # noqa: E402


def sdpa_peer(q, k, v, chunked: bool, cudnn: bool, gqa: bool):
    """SDPA over Scout's rank shapes; ``gqa``: the KV head read in place, else copied to every query head first."""
    n = q.shape[0]
    if chunked and n > A.CHUNK:
        shape = lambda x: x.view(n // A.CHUNK, A.CHUNK, x.shape[1], A.D).transpose(1, 2)  # noqa: E731
        qb, kb, vb = shape(q), shape(k), shape(v)
    else:
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if not gqa:
        kb, vb = kb.repeat_interleave(A.HQ // A.HKV, 1), vb.repeat_interleave(A.HQ // A.HKV, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if cudnn else SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(n, A.HQ, A.D)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def row(n: int, chunked: bool) -> str:
    spec = (ChunkedLocalSpec(A.HKV, A.D, "bfloat16", chunk=A.CHUNK) if chunked
            else FullAttentionSpec(A.HKV, A.D, "bfloat16"))
    backend, table = A.make_backend(spec, n, n)
    q = torch.randn(n, A.HQ, A.D, device=A.DEV, dtype=torch.bfloat16)
    k = torch.randn(n, A.HKV, A.D, device=A.DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    backend.begin_step([StepSequence(0, n, [table])])
    fn = lambda: backend.attend(0, q, k, v, A.D ** -0.5)  # noqa: E731
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
        copied = lambda: sdpa_peer(q, k, v, chunked, cudnn, gqa=False)  # noqa: E731
        in_place = lambda: sdpa_peer(q, k, v, chunked, cudnn, gqa=True)  # noqa: E731
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
