"""Where one attend() call's GPU time goes, kernel by kernel (torch.profiler), and the KV write against the
one-token-a-program kernel it replaced (kept here as ``old_write``) and a device copy of the same bytes.

- KV write, bf16 and fp8_e4m3 caches, 1 to 1M tokens: the new kernel's cache bytes must equal the old one's.
- Scout-rank one-shot prefill (chunked 128K and 1M, full 128K; checked against SDPA first) and the FP8-compute
  16K step over 1M (64-token pages).

    python tools/kernel_dev/attend_parts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import attention as A  # noqa: E402

from hybridkv.kv.specs import FullAttentionSpec  # noqa: E402
from hybridkv.model.attention.base import StepSequence  # noqa: E402


@triton.jit
def old_write(k_ptr, v_ptr, cache_ptr, slot_block_ptr, slot_offset_ptr, k_scale, v_scale,
              stride_kt, stride_kh, stride_block, stride_tok, v_offset,
              H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr):
    """The KV write it replaced: one program per token."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.load(slot_block_ptr + t).to(tl.int64)
    offset = tl.load(slot_offset_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    ok = (h < H) & (d < D)
    src = t * stride_kt + h * stride_kh + d
    dst = cache_ptr + block * stride_block + offset * stride_tok + h * D + d
    k = tl.load(k_ptr + src, mask=ok).to(tl.float32)
    v = tl.load(v_ptr + src, mask=ok).to(tl.float32)
    if QUANT:
        k = tl.clamp(k / k_scale, -448.0, 448.0)
        v = tl.clamp(v / v_scale, -448.0, 448.0)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=ok)


def run_old(backend, k, v) -> None:
    layer = backend.cache.layers[0]
    meta = backend.step_state.groups[layer.group_id]
    old_write[(k.shape[0],)](
        k, v, backend._base(layer), meta.slot_block, meta.slot_offset, 1.0, 1.0,
        k.stride(0), k.stride(1), backend.cache.buffer.stride(0), A.D, backend.block_size * A.D,
        H=1, H_PAD=1, D=A.D, D_PAD=A.D, QUANT=backend.quantized,
    )


def kernel_times(fn, reps: int = 3) -> list[tuple[str, float]]:
    """(kernel name, microseconds per call), longest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] = total.get(e.name, 0) + e.device_time_total / reps
    return sorted(total.items(), key=lambda x: -x[1])


def write_row(kv_dtype: str, n: int) -> None:
    backend, table = A.make_backend(FullAttentionSpec(A.HKV, A.D, kv_dtype), n, n)
    backend.begin_step([StepSequence(0, n, [table])])
    k = torch.randn(n, A.HKV, A.D, device=A.DEV, dtype=torch.bfloat16) * 3
    v = torch.randn_like(k) * 3
    backend.cache.buffer.zero_()
    run_old(backend, k, v)
    old = backend.cache.buffer.clone()
    backend.cache.buffer.zero_()
    backend.write(0, k, v)
    same = torch.equal(old.view(torch.uint8), backend.cache.buffer.view(torch.uint8))
    t_old = triton.testing.do_bench(lambda: run_old(backend, k, v))
    t_new = triton.testing.do_bench(lambda: backend.write(0, k, v))
    dst = torch.empty_like(k)
    t_copy = triton.testing.do_bench(lambda: (dst.copy_(k), dst.copy_(v)))
    print(f"write {kv_dtype} n={n:,}: identical={same} old {t_old * 1e3:.1f} us new {t_new * 1e3:.1f} us, "
          f"copy of K and V {t_copy * 1e3:.1f} us", flush=True)
    assert same


def print_kernels(fn) -> None:
    for name, us in kernel_times(fn):
        print(f"   {us:10.1f} us  {name[:90]}")


def prefill_rows() -> None:
    for n, chunked in ((131072, True), (1 << 20, True), (131072, False)):
        _, backend, q, k, v, fn = A.one_shot(n, chunked)
        err = A.rel_err(fn(), A.sdpa(q, k, v, chunked))
        assert err < 1e-2
        flops = 4 * A.HQ * A.D * A.useful_pairs(n, chunked)
        ms = A.bench(fn)
        print(f"\n{'chunked' if chunked else 'full'} {n:,}: attend {ms:.3f} ms = {flops / ms / 1e9:.0f} TFLOP/s "
              f"(err {err:.1e})")
        print_kernels(fn)
        del backend
        torch.cuda.empty_cache()


def fp8_step_row(context: int = 1 << 20, tokens: int = 16384) -> None:
    keys = torch.randn(context + tokens, A.HKV, A.D, device=A.DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    q = torch.randn(tokens, A.HQ, A.D, device=A.DEV, dtype=torch.bfloat16)
    backend, table = A.filled_backend(FullAttentionSpec(A.HKV, A.D, "fp8_e4m3"), context, tokens, 64, keys, values,
                                      fp8_compute=True)
    backend.begin_step([StepSequence(context, tokens, [table])])
    fn = lambda: backend.attend(0, q, keys[context:], values[context:], A.D ** -0.5)  # noqa: E731
    out = fn()[:1]
    ref = A.first_query(q, A.e4m3(keys[: context + 1]), A.e4m3(values[: context + 1]))
    assert A.rel_err(out, ref) <= 6e-2
    flops = 4 * A.HQ * A.D * (tokens * context + tokens * (tokens + 1) // 2)
    ms = A.bench(fn)
    group = backend.step_state.groups[0]
    print(f"\nFP8 step 16K over 1M: {ms:.2f} ms = {flops / ms / 1e9:.0f} TFLOP/s, splits {group.num_splits}, "
          f"segments {len(group.segments)}")
    print_kernels(fn)


def main() -> None:
    for kv_dtype in ("bfloat16", "fp8_e4m3"):
        for n in (1, 7, 16384, 131072, 1 << 20):
            write_row(kv_dtype, n)
    prefill_rows()
    fp8_step_row()


if __name__ == "__main__":
    main()
