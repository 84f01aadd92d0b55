"""Paged hybrid attention kernels vs torch SDPA (flash) and FlexAttention, Scout's per-rank shapes.

One Llama-4 Scout rank at TP 8: 5 query heads, 1 KV head, head_dim 128, bf16; full layers and chunked (8,192)
layers. Our kernels read K/V through a block table with randomly permuted pages (64 tokens for prefill, 16 for
decode, by default), as a busy server's
cache is; the peers read contiguous tensors.

- prefill: one sequence of n tokens, no cached prefix. TFLOP/s counts only unmasked work
  (causal: n(n+1)/2 query-key pairs; chunked: the same within each chunk). Ours includes writing the n tokens'
  K/V into the paged cache; in brackets, without it (the write timed alone and taken off), as the peers are
  given K/V in place. Ours and cuDNN are timed in turn, ``--rounds`` times each (medians, with the SM clock
  each ran at): under this load the clock drifts with the card's temperature by several percent over a
  table's minutes (H100: ours ran chunked 1M at 552 TFLOP/s in a table, timed once after the row before, and at
  589 in another script's rounds minutes later), so peers timed one after the other would compare clocks as
  much as kernels. SDPA's chunked row runs flash on the n/C chunks as a batch (the best a dense kernel
  can do); FlexAttention uses a block mask. All peers read the one KV head in place (``enable_gqa``).
- decode: one query at context n (split over the KV length). GB/s = K+V bytes read / time, against the
  device-to-device copy bandwidth measured in the same run (bytes read + written). Timed as CUDA-graph replays
  (KV write + attention + split combine), with the eager time (Python launches included) beside it.

Every output is checked against SDPA (relative error <= 1e-2) before it is timed.

- FP8 compute column (prefill and step rows): an fp8_e4m3 cache with ``fp8_compute=True`` (Q and P rounded to
  e4m3, FP8 tensor-core dots), the same inputs; it includes writing the K/V as e4m3 and the transposed-V pass.
  Checked before timing against SDPA over the same e4m3-rounded K/V (relative error <= 6e-2, the GPU tests' bound);
  its error against the bf16 reference (SDPA over the unrounded bf16 K/V: K/V quantization included) is printed
  beside it as max abs / relative.

    python benchmarks/gpu/attention.py [--lengths 8192,32768,131072,1048576] [--flex-max 131072] [--block-size 64]
        [--plot docs/img/attention.png]

``--plot PATH``: a PNG of this run's rows: prefill TFLOP/s by length for ours, cuDNN, flash and FlexAttention (full and
chunked layers), and full-layer decode as a share of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridkv.bench.tables import markdown_table
from hybridkv.kv.layout import plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.kernel_configs import HOPPER_PREFILL, PREFILL, KernelConfig, KernelOptions
from hybridkv.model.attention.triton_paged import TritonPagedAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root, for benchmarks.plots
from benchmarks.plots import Panel, Series, save_plot  # noqa: E402

HQ, HKV, D, CHUNK = 5, 1, 128, 8192
BLOCK = 64  # prefill pages: a 64-key tile is one page (the Hopper path's TMA copies); --block-size changes it
DECODE_BLOCK = 16
DEV = "cuda"


def bench(fn) -> float:
    """Median milliseconds; long calls get fewer repeats."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = start.elapsed_time(end)
    if once > 200:
        times = []
        for _ in range(3):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[1]
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


class SmClock:
    """The SM clock (MHz) and board power (W) while timed code runs, sampled by ``nvidia-smi`` every 50 ms in the
    background. A variant whose dots see stale data draws less power and may clock higher; its time alone would
    credit that to the change. ``window()`` marks a span; ``median(span)`` is the samples' median in it, or None
    (no nvidia-smi, or no sample landed). ``device``: the GPU's index (default: the current one)."""

    def __init__(self, device: int | None = None) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (monotonic s, MHz, W)
        try:
            gpu = torch.cuda.current_device() if device is None else device
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50",
                 "-i", str(gpu)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), mhz, watts))

    def window(self, fn):
        """Run ``fn``; return (its result, its (start, end) in monotonic seconds)."""
        start = time.monotonic()
        out = fn()
        return out, (start, time.monotonic())

    def median(self, span: tuple[float, float]) -> tuple[float, float] | None:
        inside = [(mhz, w) for t, mhz, w in list(self.samples) if span[0] <= t <= span[1]]
        if not inside:
            return None
        return statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def graphed(fn):
    """``fn`` captured in a CUDA graph: replays time the kernels without Python's launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (Triton compiles here)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6  # bytes per ms -> GB/s


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def paired(fns, clock: SmClock, rounds: int) -> list[tuple[float, float | None]]:
    """Median milliseconds and median SM clock (MHz; None without nvidia-smi) of each of ``fns``, timed in turn
    ``rounds`` times, so that each sees the same drift of the clock."""
    times: list[list[float]] = [[] for _ in fns]
    clocks: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t, c in zip(fns, times, clocks):
            ms, span = clock.window(lambda fn=fn: bench(fn))
            t.append(ms)
            if (sm := clock.median(span)) is not None:
                c.append(sm[0])
    return [(statistics.median(t), statistics.median(c) if c else None) for t, c in zip(times, clocks)]


def at_clock(tflops: str, mhz: float | None) -> str:
    return tflops if mhz is None else f"{tflops} @{mhz:.0f}"


def useful_pairs(n: int, chunked: bool) -> int:
    if not chunked:
        return n * (n + 1) // 2
    full, rest = divmod(n, CHUNK)
    return full * CHUNK * (CHUNK + 1) // 2 + rest * (rest + 1) // 2


def make_backend(spec, n: int, max_q: int, block: int = BLOCK, **kernel_options):
    layout = plan_layout([spec], block)
    blocks = n // block + 2
    backend = TritonPagedAttention(layout, blocks + 1, spec.dtype, HQ, DEV, options=KernelOptions(**kernel_options))
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(blocks, generator=gen) + 1).numpy().astype("int32")
    return backend, table


def sdpa(q, k, v, chunked: bool, cudnn: bool = False, repeat_kv: bool = False):
    """q [n, HQ, D], k/v [n, HKV, D] -> [n, HQ, D], flash (or cuDNN) backend, causal (per chunk if chunked).
    ``repeat_kv``: copy the KV head to every query head first, as an earlier version of this table did
    (``tools/kernel_dev/eager_graphed.py`` times both)."""
    n = q.shape[0]
    if chunked and n > CHUNK:
        assert n % CHUNK == 0
        shape = lambda x: x.view(n // CHUNK, CHUNK, x.shape[1], D).transpose(1, 2)  # noqa: E731
        qb, kb, vb = shape(q), shape(k), shape(v)
    else:
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    # enable_gqa: the 5 query heads read the one KV head in place; a repeat_interleave copy of K/V first made
    # cuDNN's chunked 128K row 500 TFLOP/s instead of 575 on an H100
    if repeat_kv:
        kb, vb = kb.repeat_interleave(HQ // HKV, 1), vb.repeat_interleave(HQ // HKV, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if cudnn else SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=not repeat_kv)
    return out.transpose(1, 2).reshape(n, HQ, D)


def flex_fn(n: int, chunked: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        return causal & (q_idx // CHUNK == kv_idx // CHUNK) if chunked else causal

    # compiled: the mask is built block by block, never as an n x n tensor (128K: 16G entries)
    block_mask = create_block_mask(mask, None, None, n, n, device=DEV, _compile=True)
    compiled = torch.compile(flex_attention)

    def run(q, k, v):
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return compiled(qb, kb, vb, block_mask=block_mask, enable_gqa=True).squeeze(0).transpose(0, 1)

    return run


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def fp8_errors(out, ref_e4m3, ref_bf16) -> tuple[float, str]:
    """Relative error against SDPA over the same e4m3 K/V (checked), and a note of max abs / relative error
    against the bf16 reference."""
    err = rel_err(out, ref_e4m3)
    assert err <= 6e-2 and not out.isnan().any(), f"FP8 compute: relative error {err:.2e} vs e4m3 K/V"
    return err, f"{(out.float() - ref_bf16.float()).abs().max().item():.1e} / {rel_err(out, ref_bf16):.1e}"


def fp8_prefill(n: int, chunked: bool, block: int, q, k, v, ref, flops: int, **kernel_options) -> tuple[float, str]:
    """The FP8-compute columns of a one-shot prefill row: TFLOP/s and its error."""
    spec_cls = (lambda dt: ChunkedLocalSpec(HKV, D, dt, chunk=CHUNK)) if chunked else (
        lambda dt: FullAttentionSpec(HKV, D, dt))
    backend, table = make_backend(spec_cls("fp8_e4m3"), n, n, block=block, fp8_compute=True, **kernel_options)
    backend.begin_step([StepSequence(0, n, [table])])
    out = backend.attend(0, q, k, v, D ** -0.5)
    _, note = fp8_errors(out, sdpa(q, e4m3(k), e4m3(v), chunked), ref)
    t = bench(lambda: backend.attend(0, q, k, v, D ** -0.5))
    return flops / t / 1e9, note


def triton_prefill(backend, spec, n: int, block: int, q, k, v, ref, flops: int) -> float | None:
    """TFLOP/s of the Triton kernel where ours is the CUDA kernel (Hopper), checked against SDPA first; None where
    ours is the Triton kernel."""
    if not backend.builder.configs.prefill.cuda:
        return None
    tri, table = make_backend(spec, n, n, block=block, hopper_kernel=False)
    tri.begin_step([StepSequence(0, n, [table])])
    err = rel_err(tri.attend(0, q, k, v, D ** -0.5), ref)
    assert err <= 1e-2, f"Triton prefill n={n}: relative error {err:.2e}"
    return flops / bench(lambda: tri.attend(0, q, k, v, D ** -0.5)) / 1e9


def one_shot(n: int, chunked: bool, block: int = BLOCK):
    """A one-shot prefill of n random tokens through a fresh backend (permuted pages): the layer's spec, the
    backend, q, k, v, and the call that attends them."""
    spec = ChunkedLocalSpec(HKV, D, "bfloat16", chunk=CHUNK) if chunked else FullAttentionSpec(HKV, D, "bfloat16")
    backend, table = make_backend(spec, n, n, block=block)
    q = torch.randn(n, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(n, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(n, HKV, D, device=DEV, dtype=torch.bfloat16)
    backend.begin_step([StepSequence(0, n, [table])])
    return spec, backend, q, k, v, lambda: backend.attend(0, q, k, v, D ** -0.5)


def prefill_row(n: int, chunked: bool, flex_max: int, block: int, clock: SmClock,
                rounds: int) -> tuple[list[str], dict[str, float]]:
    """The table's row, and the TFLOP/s of each kernel that ran (the plot's points)."""
    spec, backend, q, k, v, attend = one_shot(n, chunked, block)
    ref = sdpa(q, k, v, chunked)
    err = rel_err(attend(), ref)
    assert err <= 1e-2, f"prefill n={n} chunked={chunked}: relative error {err:.2e}"
    flops = 4 * HQ * D * useful_pairs(n, chunked)
    cudnn_fn = lambda: sdpa(q, k, v, chunked, cudnn=True)  # noqa: E731
    try:
        err_cudnn = rel_err(cudnn_fn(), ref)
        assert err_cudnn <= 1e-2, err_cudnn
    except Exception as e:  # report, don't hide: cuDNN may refuse a shape
        cudnn_fn, cudnn = None, f"error: {type(e).__name__}"
    timed = paired([attend] + ([cudnn_fn] if cudnn_fn else []), clock, rounds)
    t_ours, mhz_ours = timed[0]
    tflops = {"ours": flops / t_ours / 1e9}
    if cudnn_fn:
        tflops["SDPA cuDNN"] = flops / timed[1][0] / 1e9
        cudnn = at_clock(f"{tflops['SDPA cuDNN']:.0f}", timed[1][1])
    t_write = bench(lambda: backend.write(0, k, v))
    if (triton := triton_prefill(backend, spec, n, block, q, k, v, ref, flops)) is not None:
        tflops["Triton kernel"] = triton
    tflops["SDPA flash"] = flops / bench(lambda: sdpa(q, k, v, chunked)) / 1e9
    try:
        tflops["ours, FP8 compute"], fp8_note = fp8_prefill(n, chunked, block, q, k, v, ref, flops)
        fp8 = [f"{tflops['ours, FP8 compute']:.0f}", fp8_note]
    except Exception as e:  # noqa: BLE001 - report, don't hide
        fp8 = [f"error: {type(e).__name__}: {str(e)[:120]}", ""]
    flex = "not run"
    if n <= flex_max:
        try:
            run = flex_fn(n, chunked)
            err_flex = rel_err(run(q, k, v), ref)
            assert err_flex <= 1e-2, err_flex
            tflops["FlexAttention"] = flops / bench(lambda: run(q, k, v)) / 1e9
            flex = f"{tflops['FlexAttention']:.0f}"
        except Exception as e:  # report, don't hide: FlexAttention may not handle this length
            flex = f"error: {type(e).__name__}"
    kind = f"chunked({CHUNK})" if chunked else "full"
    ours = at_clock(f"{tflops['ours']:.0f} ({flops / (t_ours - t_write) / 1e9:.0f})", mhz_ours)
    row = [f"prefill {kind}", f"{n:,}", f"{t_ours:.2f}", ours, "(ours)" if triton is None else f"{triton:.0f}",
           f"{tflops['SDPA flash']:.0f}", cudnn, flex, f"{err:.1e}", *fp8]
    return row, tflops


def decode_row(n: int, chunked: bool, copy_gbs: float, block: int) -> tuple[list[str], dict[str, float]]:
    """The table's row, and ours and SDPA flash as a percentage of the copy bandwidth (the plot's points)."""
    spec = ChunkedLocalSpec(HKV, D, "bfloat16", chunk=CHUNK) if chunked else FullAttentionSpec(HKV, D, "bfloat16")
    if chunked:
        n += CHUNK // 2  # half a chunk in reach
    backend, table = make_backend(spec, n + 1, 1, block=block)
    scale = D ** -0.5
    # fill the cache with n random tokens (written by the KV-write kernel alone, in pieces), then decode token n
    piece = 1 << 16
    keys = []
    for start in range(0, n, piece):
        m = min(piece, n - start)
        kk = torch.randn(m, HKV, D, device=DEV, dtype=torch.bfloat16)
        vv = torch.randn(m, HKV, D, device=DEV, dtype=torch.bfloat16)
        backend.begin_step([StepSequence(start, m, [table])])
        backend.write(0, kk, vv)
        keys.append((kk, vv))
    k_all = torch.cat([kk for kk, _ in keys] + [torch.randn(1, HKV, D, device=DEV, dtype=torch.bfloat16)])
    v_all = torch.cat([vv for _, vv in keys] + [torch.randn(1, HKV, D, device=DEV, dtype=torch.bfloat16)])
    q = torch.randn(1, HQ, D, device=DEV, dtype=torch.bfloat16)
    backend.begin_step([StepSequence(n, 1, [table])])
    ours = backend.attend(0, q, k_all[n:], v_all[n:], scale)
    lo = (n // CHUNK) * CHUNK if chunked else 0
    kr, vr = k_all[lo:].transpose(0, 1).unsqueeze(0), v_all[lo:].transpose(0, 1).unsqueeze(0)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kr.repeat_interleave(HQ, 1),
                                         vr.repeat_interleave(HQ, 1)).squeeze(0).transpose(0, 1)
    err = rel_err(ours, ref)
    assert err <= 1e-2, f"decode n={n} chunked={chunked}: relative error {err:.2e}"
    t_eager = bench(lambda: backend.attend(0, q, k_all[n:], v_all[n:], scale))
    t_ours = bench(graphed(lambda: backend.attend(0, q, k_all[n:], v_all[n:], scale)))
    read = (n + 1 - lo) * HKV * D * 2 * 2
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), kr.expand(1, HQ, -1, D), vr.expand(1, HQ, -1, D)))
    gbs = read / t_ours / 1e6
    kind = f"chunked({CHUNK})" if chunked else "full"
    row = [f"decode {kind}", f"{n:,}", f"{t_ours * 1000:.1f} us (eager {t_eager * 1000:.0f})", f"{gbs:.0f} GB/s", "",
           f"{read / t_sdpa / 1e6:.0f} GB/s", "", f"{100 * gbs / copy_gbs:.0f}% of copy", f"{err:.1e}", "", ""]
    return row, {"ours": 100 * gbs / copy_gbs, "SDPA flash": 100 * read / t_sdpa / 1e6 / copy_gbs}


# The sweep's candidates (others timed, neither kept: Triton 3.6's warp-specialized loop, and exponentials half on
# the FMA pipe; docs/design/prefill-kernel.md)
SWEEP_CONFIGS = [
    PREFILL,  # pointer gathers (the portable kernel); every step row's error is against it
    HOPPER_PREFILL, KernelConfig(128, 64, 4, 2, tma=True, programs_per_sm=2), KernelConfig(128, 64, 4, 2, programs_per_sm=2),
    KernelConfig(128, 64, 4, 4, tma=True, programs_per_sm=2), KernelConfig(128, 64, 4, 3, programs_per_sm=2),
    KernelConfig(64, 64, 4, 3, tma=True, programs_per_sm=3), KernelConfig(128, 128, 8, 3, tma=True),
    KernelConfig(256, 64, 8, 3, tma=True), KernelConfig(128, 32, 4, 4, tma=True, programs_per_sm=2),
]


def filled_backend(spec, context: int, tokens: int, block: int, keys, values, **kernel_options):
    """A backend with ``context`` random keys already written through a permuted block table."""
    layout = plan_layout([spec], block)
    num_blocks = (context + tokens) // block + 2
    backend = TritonPagedAttention(layout, num_blocks + 1, spec.dtype, HQ, DEV,
                                   options=KernelOptions(**kernel_options))
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(num_blocks, generator=gen) + 1).numpy().astype("int32")
    piece = 1 << 16
    for start in range(0, context, piece):
        n = min(piece, context - start)
        backend.begin_step([StepSequence(start, n, [table])])
        backend.write(0, keys[start : start + n], values[start : start + n])
    return backend, table


def sweep(fp8: bool = False, step_context: int = 1 << 20, step_tokens: int = 16384, one_shot: int = 32768) -> None:
    """Time candidate Triton prefill tiles (SWEEP_CONFIGS; FP8_SWEEP_CONFIGS with ``fp8``: FP8 compute over an e4m3
    cache) on a one-shot causal prefill and on one engine step over a long context, pages of max(64, key tile)
    tokens. One-shot outputs are checked against SDPA (FP8: over the same e4m3 K/V, the error against bf16 K/V
    beside it), step outputs against the first config's (bounds 1e-2, FP8 6e-2)."""
    kv_dtype, options, bound = ("fp8_e4m3", {"fp8_compute": True}, 6e-2) if fp8 else ("bfloat16", {}, 1e-2)
    spec = FullAttentionSpec(HKV, D, kv_dtype)
    n = one_shot
    q1 = torch.randn(n, HQ, D, device=DEV, dtype=torch.bfloat16)
    k1, v1 = (torch.randn(n, HKV, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    ref1 = sdpa(q1, k1, v1, False)
    ref1_e4 = sdpa(q1, e4m3(k1), e4m3(v1), False) if fp8 else None
    flops1 = 4 * HQ * D * useful_pairs(n, False)
    keys = torch.randn(step_context + step_tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    q2 = torch.randn(step_tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
    flops2 = 4 * HQ * D * (step_tokens * step_context + step_tokens * (step_tokens + 1) // 2)
    rows = [] if fp8 else [["cuDNN SDPA", f"{flops1 / bench(lambda: sdpa(q1, k1, v1, False, cudnn=True)) / 1e9:.0f}",
                            "", ""]]
    backends, ref2 = {}, None
    for cfg in FP8_SWEEP_CONFIGS if fp8 else SWEEP_CONFIGS:
        block = max(64, cfg.block_n)
        try:
            one, table = make_backend(spec, n, n, block=block, prefill=cfg, **options)
            one.begin_step([StepSequence(0, n, [table])])
            out1 = one.attend(0, q1, k1, v1, D ** -0.5)
            if fp8:
                err1, note = fp8_errors(out1, ref1_e4, ref1)
                note = f" ({note} vs bf16)"
            else:
                err1, note = rel_err(out1, ref1), ""
            t1 = bench(lambda: one.attend(0, q1, k1, v1, D ** -0.5))
            del one
            if block not in backends:
                backends[block] = filled_backend(spec, step_context, step_tokens, block, keys, values, **options)
            step, table = backends[block]
            step.builder.configs = dataclasses.replace(step.builder.configs, prefill=cfg)
            step.begin_step([StepSequence(step_context, step_tokens, [table])])
            run = lambda: step.attend(0, q2, keys[step_context:], values[step_context:], D ** -0.5)  # noqa: E731
            out2 = run()
            if ref2 is None:
                ref2 = out2.clone()  # the first config (bf16: the portable kernel) is the step's reference
            err2 = rel_err(out2, ref2)
            assert err1 <= bound and err2 <= bound and not out2.isnan().any(), (err1, err2)
            t2 = bench(run)
            rows.append([str(cfg), f"{flops1 / t1 / 1e9:.0f}", f"{flops2 / t2 / 1e9:.0f}",
                         f"{err1:.1e}{note} / {err2:.1e}, splits {step.step_state.groups[0].num_splits}"])
        except Exception as e:  # noqa: BLE001 - report what failed to compile or check, keep sweeping
            rows.append([str(cfg), "", "", f"error {type(e).__name__}: {str(e)[:200]}"])
        print(rows[-1], flush=True)
    head = ["FP8 config" if fp8 else "config", f"{one_shot:,} one-shot TFLOP/s",
            f"{step_tokens:,} over {step_context:,} TFLOP/s", "rel err"]
    print("\n" + markdown_table(head, rows))


FP8_SWEEP_CONFIGS = [
    HOPPER_PREFILL, KernelConfig(128, 64, 4, 4, tma=True, programs_per_sm=2),
    KernelConfig(128, 64, 8, 3, tma=True), KernelConfig(256, 64, 8, 3, tma=True),
    KernelConfig(128, 128, 8, 3, tma=True), KernelConfig(128, 128, 4, 3, tma=True, programs_per_sm=2),
    KernelConfig(128, 64, 4, 3, programs_per_sm=2),
]


def first_query(q, k_seen, v_seen):
    """SDPA of a step's first query (q[0], at position ``context``) over the keys it sees, 0..context: the
    reference of a step row."""
    return F.scaled_dot_product_attention(
        q[:1].transpose(0, 1).unsqueeze(0), k_seen.transpose(0, 1).unsqueeze(0).expand(1, HQ, -1, D),
        v_seen.transpose(0, 1).unsqueeze(0).expand(1, HQ, -1, D)).squeeze(0).transpose(0, 1)


def engine_step_rows(context: int, tokens: int, kv_dtype: str = "bfloat16") -> list[list[str]]:
    """One prefill step as the engine runs it over a long prompt: ``tokens`` new queries over ``context`` cached
    random keys (full layer), with 16- and 64-token pages, the KV range unsplit and split as the backend chooses
    (whole waves of tiles). The first query's output is checked against SDPA over the keys it sees (for an FP8
    cache: over the same keys rounded to e4m3, scale 1). ``kv_dtype`` "fp8_compute": an fp8_e4m3 cache with FP8
    dots, its error against the bf16 keys beside it."""
    fp8_compute = kv_dtype == "fp8_compute"
    kv_dtype = "fp8_e4m3" if fp8_compute else kv_dtype
    rows = []
    keys = torch.randn(context + tokens, HKV, D, device=DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    q = torch.randn(tokens, HQ, D, device=DEV, dtype=torch.bfloat16)
    seen_k, seen_v = keys[: context + 1], values[: context + 1]
    ref_bf16 = first_query(q, seen_k, seen_v)
    ref = first_query(q, e4m3(seen_k), e4m3(seen_v)) if kv_dtype == "fp8_e4m3" else ref_bf16
    flops = 4 * HQ * D * (tokens * context + tokens * (tokens + 1) // 2)
    # page size, and the CUDA kernel (Hopper) or Triton; FP8 compute over 16-token pages is Triton's alone
    pairs = [(16, True), (16, False), (64, True), (64, False)][1 if fp8_compute else 0:]
    for block, hopper_kernel in pairs:
        backend, table = filled_backend(FullAttentionSpec(HKV, D, kv_dtype), context, tokens, block, keys, values,
                                        fp8_compute=fp8_compute, hopper_kernel=hopper_kernel)
        chosen = backend.builder.num_splits
        for forced in (1, None):
            backend.builder.num_splits = chosen if forced is None else (lambda step, reach, heads, config: 1)
            backend.begin_step([StepSequence(context, tokens, [table])])
            run = lambda: backend.attend(0, q, keys[context:], values[context:], D ** -0.5)  # noqa: E731
            out = run()[:1]
            if fp8_compute:
                err, note = fp8_errors(out, ref, ref_bf16)
            else:
                err, note = rel_err(out, ref), ""
                assert err <= 1e-2, f"step over {context}: relative error {err:.2e}"
            ms = bench(run)
            splits = backend.step_state.groups[0].num_splits
            name = "fp8_e4m3 KV, FP8 compute" if fp8_compute else f"{kv_dtype} KV"
            name += ", CUDA kernel" if backend.hopper is not None and backend.hopper.kernel.launches else ", Triton"
            segments = len(backend.step_state.groups[0].segments)
            rows.append([f"prefill step, {name}, {block}-token pages, {splits} split(s), {segments} segment(s)",
                         f"{tokens:,} over {context:,}", f"{ms:.1f}", f"{flops / ms / 1e9:.0f}", "", "", "", "",
                         f"{err:.1e}", f"{flops / ms / 1e9:.0f}" if fp8_compute else "", note])
            print(" | ".join(rows[-1]), flush=True)
        del backend
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,131072,1048576")
    ap.add_argument("--decode-lengths", default="131072,1048576,4194304")
    ap.add_argument("--flex-max", type=int, default=131072, help="longest prefill FlexAttention is timed on")
    ap.add_argument("--block-size", type=int, default=BLOCK, help="page size of the prefill rows")
    ap.add_argument("--decode-block-size", type=int, default=DECODE_BLOCK, help="page size of the decode rows")
    ap.add_argument("--sweep", action="store_true", help="time candidate tile shapes instead")
    ap.add_argument("--sweep-length", type=int, default=32768, help="the sweep's one-shot prefill length")
    ap.add_argument("--step-context", type=int, default=0,
                    help="also time one engine-sized prefill step (--step-tokens new tokens) over this many cached")
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--step-kv-dtypes", default="bfloat16",
                    help="cache dtypes of the step rows: bfloat16,fp8_e4m3,fp8_compute (an FP8 cache with FP8 dots)")
    ap.add_argument("--sweep-fp8", action="store_true", help="time candidate tile shapes of the FP8-compute path")
    ap.add_argument("--rounds", type=int, default=3, help="prefill rows: ours and cuDNN timed in turn this often")
    ap.add_argument("--plot", metavar="PATH", help="also draw this run's prefill and decode rows into a PNG")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.sweep or args.sweep_fp8:
        sweep(fp8=args.sweep_fp8, one_shot=args.sweep_length)
        return
    copy_gbs = copy_bandwidth()
    rows = []
    prefill_points: dict[bool, list[tuple[int, dict[str, float]]]] = {False: [], True: []}
    decode_points: list[tuple[int, dict[str, float]]] = []
    clock = SmClock()
    for chunked in (False, True):
        for n in (int(x) for x in args.lengths.split(",") if x):
            row, tflops = prefill_row(n, chunked, args.flex_max, args.block_size, clock, args.rounds)
            rows.append(row)
            prefill_points[chunked].append((n, tflops))
            print(" | ".join(rows[-1]), flush=True)
    clock.close()
    for chunked in (False, True):
        for n in (int(x) for x in args.decode_lengths.split(",") if x):
            row, shares = decode_row(n, chunked, copy_gbs, args.decode_block_size)
            rows.append(row)
            if not chunked:  # a chunked decode reads one chunk whatever n is: its share of copy says nothing
                decode_points.append((n, shares))
            print(" | ".join(rows[-1]), flush=True)
    if args.step_context:
        for kv_dtype in args.step_kv_dtypes.split(","):
            rows += engine_step_rows(args.step_context, args.step_tokens, kv_dtype)
    name = torch.cuda.get_device_name()
    print(f"\n{name}, copy bandwidth {copy_gbs:.0f} GB/s (read + write), bf16, Hq {HQ}, Hkv {HKV}, D {D}, "
          f"prefill pages {args.block_size}, decode pages {args.decode_block_size}")
    head = ["case", "tokens", "ours ms or us", "ours TFLOP/s (without the KV write) @MHz or GB/s", "Triton kernel",
            "SDPA flash", "SDPA cuDNN @MHz", "FlexAttention or share", "rel err", "FP8 compute TFLOP/s",
            "FP8 err vs bf16: max abs / rel"]
    print(markdown_table(head, rows))
    if args.plot:
        save_plot(args.plot, plot_panels(prefill_points, decode_points),
                  f"{name}: Scout rank shapes (5 query heads, 1 KV head, d128), {args.block_size}-token pages")
        print(f"plot: {args.plot}")


PREFILL_STYLES = {"ours": "o-", "ours, FP8 compute": "o:", "SDPA cuDNN": "s--", "SDPA flash": "^--",
                  "FlexAttention": "v--", "Triton kernel": "x:"}


def plot_panels(prefill: dict[bool, list[tuple[int, dict[str, float]]]],
                decode: list[tuple[int, dict[str, float]]]) -> list[Panel]:
    """Prefill TFLOP/s by length, full and chunked layers (``prefill[chunked]``: (tokens, TFLOP/s per kernel) as
    ``prefill_row`` gives them), and full-layer decode as a percentage of the copy bandwidth by context."""
    def series(points, styles):
        return [Series(label, [(n, values[label]) for n, values in points if label in values], style)
                for label, style in styles.items()]

    return [Panel(f"prefill, {name} layers", "prompt tokens (one-shot, causal)", "TFLOP/s",
                  series(prefill[chunked], PREFILL_STYLES), log_x=True)
            for chunked, name in ((False, "full"), (True, f"chunked({CHUNK})"))] + [
        Panel("decode, full layer (one query)", "context tokens", "% of device copy bandwidth",
              series(decode, {"ours": "o-", "SDPA flash": "^--"}), log_x=True)]


if __name__ == "__main__":
    main()
