"""Triton paged attention against the torch reference backend, on fresh random inputs.

Runs on CUDA; skips cleanly without it. (During development the same checks run on the CPU through Triton's
interpreter: ``TRITON_INTERPRET=1 pytest tests/gpu``.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hybridkv.kv import CacheRequest, KVCacheManager, plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.torch_paged import TorchPagedAttention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels import cuda_build, hopper_attention  # noqa: E402
from hybridkv.model.attention.kernel_configs import HOPPER_PREFILL, KernelConfig, KernelOptions  # noqa: E402
from hybridkv.model.attention.triton_paged import TritonPagedAttention  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
HQ, HKV = 5, 1  # Scout's per-rank shape: 5 query heads share one KV head
D = 32 if INTERPRET else 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def specs(kv_dtype):
    return [
        FullAttentionSpec(HKV, D, kv_dtype),
        SlidingWindowSpec(HKV, D, kv_dtype, window=37),  # window boundary inside a block
        ChunkedLocalSpec(HKV, D, kv_dtype, chunk=48),  # chunk boundary inside a 64-block
        FullAttentionSpec(HKV, D, kv_dtype),
        SlidingWindowSpec(HKV, D, kv_dtype, window=37),
        ChunkedLocalSpec(HKV, D, kv_dtype, chunk=48),
    ]


def drive(block_size, kv_dtype, dtype, schedule, num_sms, num_blocks=400, kv_scales=None, hq=HQ, make_specs=None,
          splits=None, poison=None, **kernel_options):
    """Run both backends through the same steps; return the max relative error per layer kind.

    With ``kv_scales`` (FP8 only) the reference keeps a float32 cache and is given what the kernel's cache holds
    after quantization, ``e4m3(k / k_scale) * k_scale``, so both attend over the same values. ``splits`` forces
    the KV split count of every step (else the backend's choice); ``make_specs`` replaces ``specs``; ``poison``
    fills the cache under test before the first write (default NaN; 0 for an FP8 cache)."""
    torch.manual_seed(1234)
    make_specs = make_specs or specs
    layer_specs = make_specs(kv_dtype)
    layout = plan_layout(layer_specs, block_size)
    kv = KVCacheManager(layout, num_blocks, enable_prefix_caching=False, max_step_tokens=512)
    ref_dtype = "float32" if kv_scales else kv_dtype
    ref = TorchPagedAttention(plan_layout(make_specs(ref_dtype), block_size), num_blocks, ref_dtype, DEVICE)
    tri = TritonPagedAttention(layout, num_blocks, kv_dtype, hq, DEVICE, num_sms=num_sms, kv_scales=kv_scales,
                               dtype=dtype, options=KernelOptions(**kernel_options))
    if splits:
        tri.builder.num_splits = lambda step, reach, heads, config: splits
    # poison the cache of the backend under test: any read of an unwritten slot shows up
    if poison is None:
        poison = float("nan") if kv_dtype != "fp8_e4m3" else 0
    if kv_dtype == "fp8_e4m3" and poison != poison:
        tri.cache.buffer.view(torch.uint8).fill_(0x7F)  # e4m3's NaN
    else:
        tri.cache.buffer.fill_(poison)
    reqs = [CacheRequest(str(i), list(range(n))) for i, n in enumerate(schedule["lengths"])]
    worst = {"max_splits": 1, "cuda_launches": 0}
    for step in schedule["steps"]:
        batch = []
        for r, q_len in zip(reqs, step):
            if q_len:
                assert kv.allocate_slots(r, q_len)
                batch.append((r, q_len))
        seqs = [StepSequence(r.num_computed_tokens, n, kv.block_tables(r.request_id)) for r, n in batch]
        ref.begin_step(seqs)
        tri.begin_step(seqs)
        worst["max_splits"] = max([worst["max_splits"]] + [g.num_splits for g in tri.step_state.groups])
        segments = max(len(g.segments) for g in tri.step_state.groups)
        if segments:
            worst["max_segments"] = max(worst.get("max_segments", 0), segments)
        t = sum(n for _, n in batch)
        for layer, spec in enumerate(layer_specs):
            q = torch.randn(t, hq, D, device=DEVICE, dtype=dtype)
            k = torch.randn(t, HKV, D, device=DEVICE, dtype=dtype)
            v = torch.randn(t, HKV, D, device=DEVICE, dtype=dtype)
            if kv_scales:
                k_scale, v_scale = kv_scales[layer]
                expected = ref.attend(layer, q, dequantized(k, k_scale), dequantized(v, v_scale), D ** -0.5)
            else:
                expected = ref.attend(layer, q, k, v, D ** -0.5)
            got = tri.attend(layer, q, k, v, D ** -0.5)
            assert not torch.isnan(got).any(), f"layer {layer}: unwritten output or unwritten cache read"
            worst[spec.kind] = max(worst.get(spec.kind, 0.0), rel_err(got, expected))
            # the CUDA prefill kernel's launches (a step that fell back to Triton adds none)
            worst["cuda_launches"] = 0 if tri.hopper is None else tri.hopper.kernel.launches
        for r, n in batch:
            r.num_computed_tokens += n
            kv.on_tokens_computed(r)
    return worst


def _drive(*args, **kwargs):
    """``drive`` for tests that do not look at which prefill kernel ran."""
    worst = drive(*args, **kwargs)
    worst.pop("cuda_launches")
    return worst


def dequantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ((x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


# prefill in chunks, with cached prefixes, then mixed prefill + decode, then decode only
MIXED = {"lengths": [150, 90, 40], "steps": [[64, 64, 0], [64, 26, 40], [22, 1, 1], [1, 1, 1], [1, 1, 1]]}
LONG_DECODE = {"lengths": [1300], "steps": [[640], [640], [18], [1], [1]]}


@pytest.mark.parametrize("block_size", [16, 64])
def test_matches_reference_mixed_batches(block_size):
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    kv_dtype = "float32" if INTERPRET else "bfloat16"
    worst = _drive(block_size, kv_dtype, dtype, MIXED, num_sms=1)
    assert worst.pop("max_splits") == 1
    bound = 1e-4 if INTERPRET else 1e-2
    assert all(e <= bound for e in worst.values()), worst


@pytest.mark.parametrize("block_size", [16, 64, 128])  # 128: decode's 128-key tiles each lie in one page
def test_split_kv_decode_matches_reference(block_size):
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    kv_dtype = "float32" if INTERPRET else "bfloat16"
    worst = _drive(block_size, kv_dtype, dtype, LONG_DECODE, num_sms=64)  # few programs: the KV range splits
    assert worst.pop("max_splits") > 1
    bound = 1e-4 if INTERPRET else 1e-2
    assert all(e <= bound for e in worst.values()), worst


class _TorchWithNaNEmpty:
    """torch, except that float tensors from ``empty`` come filled with NaN: a read of an unwritten element shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("block_size", [16, 64])
def test_splits_past_the_reach_leave_no_partial_and_none_is_read(block_size, monkeypatch):
    """64 splits for at most 11 key tiles (a decode graph's split count is fixed by max_model_len): the splits
    without a key write only a -inf LSE, and the combine reads no partial of theirs (buffers start as NaN)."""
    from hybridkv.model.attention import triton_paged

    monkeypatch.setattr(triton_paged, "torch", _TorchWithNaNEmpty())
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    kv_dtype = "float32" if INTERPRET else "bfloat16"
    worst = _drive(block_size, kv_dtype, dtype, LONG_DECODE, num_sms=64, splits=64)
    assert worst.pop("max_splits") == 64
    bound = 1e-4 if INTERPRET else 1e-2
    assert all(e <= bound for e in worst.values()), worst


def test_prefill_over_long_context_splits_into_whole_waves_and_matches_reference():
    # 100 new tokens over 4,200 cached: 9 tiles of 12 tokens on 4 "SMs" fill 3 waves 75%; 4 splits fill 9 waves
    # (splits pay off from 256 key tiles of reach: 16-key tiles here).
    # Only the full layers split: the sliding and chunked layers' reach is too short to be worth it.
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    kv_dtype = "float32" if INTERPRET else "bfloat16"
    schedule = {"lengths": [4300], "steps": [[2100], [2100], [100]]}
    small_tiles = KernelConfig(rows=64, block_n=16, num_warps=4, num_stages=2)
    worst = _drive(16, kv_dtype, dtype, schedule, num_sms=4, num_blocks=1000, prefill=small_tiles)
    assert worst.pop("max_splits") == 4
    bound = 1e-4 if INTERPRET else 1e-2
    assert all(e <= bound for e in worst.values()), worst


def test_fp8_kv_cache_matches_reference_with_the_same_quantization():
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    worst = _drive(16, "fp8_e4m3", dtype, MIXED, num_sms=1)
    worst.pop("max_splits")
    # both backends read the same e4m3 values; they differ only in accumulation order and bf16 rounding
    assert all(e <= 2e-2 for e in worst.values()), worst


@pytest.mark.parametrize("block_size", [16, 64])
def test_fp8_kv_cache_applies_per_layer_scales(block_size):
    # scales far from 1 in both directions, different per layer and for K and V: a scale dropped or swapped
    # (K's for V, or one layer's for another's) moves the output far beyond the bound
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    scales = {0: (0.02, 0.5), 1: (0.25, 0.01), 2: (0.05, 3.0), 3: (0.4, 0.03), 4: (0.01, 0.2), 5: (1.7, 0.06)}
    worst = _drive(block_size, "fp8_e4m3", dtype, MIXED, num_sms=1, kv_scales=scales)
    worst.pop("max_splits")
    assert all(e <= 2e-2 for e in worst.values()), worst
    split = _drive(block_size, "fp8_e4m3", dtype, LONG_DECODE, num_sms=64, kv_scales=scales)
    assert split.pop("max_splits") > 1
    assert all(e <= 2e-2 for e in split.values()), split


def test_fp8_long_prefill_widens_the_reach_in_segments_and_matches_reference():
    # 100 new tokens over 4,200 cached, with 16-key tiles: the full layers' reach (>= 256 key tiles) is widened to
    # the model's dtype in segments, and 2 KV splits (10 tiles on 4 "SMs") accumulate across them. The scratch
    # budget is 1,024 tokens, less two blocks per sequence for rounding: 960. It must hold one segment of the long
    # sequence and the 301 keys a second sequence reaches, so segments are 656 keys (16-key tiles): 7 of them.
    # Sliding and chunked layers widen in the kernel.
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    schedule = {"lengths": [4300, 300], "steps": [[2100, 0], [2100, 300], [100, 1]]}
    small_tiles = KernelConfig(rows=64, block_n=16, num_warps=4, num_stages=2)
    segment_bytes = 1024 * 2 * HKV * D * 2
    worst = _drive(16, "fp8_e4m3", dtype, schedule, num_sms=4, num_blocks=1000, prefill=small_tiles,
                  segment_bytes=segment_bytes, kv_scales={i: (0.05, 0.5) for i in range(6)})
    assert worst.pop("max_segments") == 7
    assert worst.pop("max_splits") == 2
    assert all(e <= 2e-2 for e in worst.values()), worst


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
TMA_TILES = KernelConfig(rows=128, block_n=64, num_warps=4, num_stages=3, tma=True, programs_per_sm=2)
# 16,600 tokens of reach (>= 256 key tiles of 64) with 216 new: 10 tiles on 4 "SMs" x 2 programs -> 4 KV splits
LONG_PREFILL = {"lengths": [16600, 300], "steps": [[8192, 0], [8192, 300], [216, 1]]}


def loads_by_tma(block_size: int, kv_dtype: str) -> bool:
    """Whether the prefill kernel reads this layout's K/V through a TMA descriptor (else pointer gathers)."""
    tri = TritonPagedAttention(plan_layout(specs(kv_dtype), block_size), 64, kv_dtype, HQ, DEVICE,
                               options=KernelOptions(prefill=TMA_TILES))
    layer, prefill = tri.cache.layers[0], tri.builder.configs.prefill
    return tri.triton.descriptor(prefill, tri._base(layer), layer.spec, HKV * D, tri.cache.buffer.stride(0)) is not None


@pytest.mark.skipif(not HOPPER, reason="TMA tensor descriptors: Hopper (sm_90) only")
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_hopper_tma_prefill_matches_reference(kv_dtype):
    # 64-token pages: each 64-key tile is one page, copied by TMA (16-token pages fall back to gathers). All three
    # attention types, unsplit (mixed batches) and split into waves over a long reach; with an FP8 cache the long
    # reach is also widened in segments (4 here), sliding/chunked layers widen FP8 tiles after the TMA copy.
    assert loads_by_tma(64, kv_dtype) and not loads_by_tma(16, kv_dtype)
    fp8 = kv_dtype == "fp8_e4m3"
    scales = {i: (0.05 * (i + 1), 0.5 / (i + 1)) for i in range(6)} if fp8 else None
    bound = 2e-2 if fp8 else 1e-2
    worst = _drive(64, kv_dtype, torch.bfloat16, MIXED, num_sms=1, kv_scales=scales, prefill=TMA_TILES)
    assert worst.pop("max_splits") == 1
    assert all(e <= bound for e in worst.values()), worst
    segment_bytes = 5000 * 2 * HKV * D * 2
    split = _drive(64, kv_dtype, torch.bfloat16, LONG_PREFILL, num_sms=4, num_blocks=800, kv_scales=scales,
                  prefill=TMA_TILES, segment_bytes=segment_bytes)
    assert split.pop("max_splits") == 4
    assert split.pop("max_segments", 0) == (4 if fp8 else 0)
    assert all(e <= bound for e in split.values()), split


# FP8 compute: Q (per row) and P are rounded to e4m3 (3 mantissa bits) before their dots. Emulating exactly that in
# float32 on random inputs (q, k, v ~ N(0, 1), 200 to 5,000 keys) gives 3.4-3.8e-2 relative error against exact
# attention over the same e4m3 K/V: each rounding is off by up to 2^-4 of its value, and random attention spreads
# its weight over many keys, so the output's error is about the rounding's RMS whatever the length. 6e-2 leaves
# room for accumulation order; a dropped or swapped scale, a wrong V column or an unmasked key is off by O(1).
FP8_COMPUTE_BOUND = 6e-2
FP8_SCALES = {i: (0.05 * (i + 1), 0.5 / (i + 1)) for i in range(6)}
FP8_DOTS = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not FP8_DOTS, reason="FP8 tensor-core dots: compute capability 8.9+")
@pytest.mark.parametrize("block_size", [16, 64])
def test_fp8_compute_matches_reference(block_size):
    # all three attention types, mixed prefill/decode batches with cached prefixes (unsplit), then a long reach split
    # into waves and cut into several segments of transposed V; 64-token pages take the TMA path on Hopper
    tiles = TMA_TILES if HOPPER else KernelConfig(rows=128, block_n=64, num_warps=4, num_stages=3)
    worst = _drive(block_size, "fp8_e4m3", torch.bfloat16, MIXED, num_sms=1, kv_scales=FP8_SCALES, prefill=tiles,
                  fp8_compute=True)
    assert worst.pop("max_splits") == 1
    assert worst.pop("max_segments") == 1  # one transposed-V copy per layer group and step
    assert all(e <= FP8_COMPUTE_BOUND for e in worst.values()), worst
    segment_bytes = 5000 * HKV * D  # V's transposed e4m3 copy, 1 byte a value: 5,000 keys a segment
    split = _drive(block_size, "fp8_e4m3", torch.bfloat16, LONG_PREFILL, num_sms=4, num_blocks=800 * 64 // block_size,
                  kv_scales=FP8_SCALES, prefill=tiles, segment_bytes=segment_bytes, fp8_compute=True)
    assert split.pop("max_splits") == 4
    assert split.pop("max_segments") >= 3  # 16,600 keys in segments of under 5,000
    assert all(e <= FP8_COMPUTE_BOUND for e in split.values()), split


@pytest.mark.skipif(not FP8_DOTS, reason="FP8 tensor-core dots: compute capability 8.9+")
def test_fp8_compute_is_prefill_only_and_needs_an_fp8_cache():
    # decode steps keep the exact widening kernel (bandwidth-bound: FP8 dots would buy nothing), so they plan no
    # transposed V; a bf16 cache ignores the option
    fp8_compute = KernelOptions(fp8_compute=True)
    assert not TritonPagedAttention(plan_layout(specs("bfloat16"), 16), 64, "bfloat16", HQ, DEVICE,
                                    options=fp8_compute).fp8_compute
    tri = TritonPagedAttention(plan_layout(specs("fp8_e4m3"), 16), 64, "fp8_e4m3", HQ, DEVICE, options=fp8_compute)
    tables = [np.array([1, 2, 3], dtype=np.int32)] * 3
    tri.begin_step([StepSequence(0, 40, tables)])
    assert [len(g.segments) for g in tri.step_state.groups] == [1, 1, 1]
    tri.begin_step([StepSequence(40, 1, tables)])
    assert [len(g.segments) for g in tri.step_state.groups] == [0, 0, 0]


HOPPER_CUDA = HOPPER and cuda_build.hopper_unavailable(torch.device("cuda")) is None


def wide_specs(kv_dtype):
    """Reaches longer than the CUDA kernel's 128-key tiles, so sliding and chunked layers get interior (unmasked)
    tiles too: a window ending mid-tile, a chunk on tile boundaries and one across them."""
    return [
        FullAttentionSpec(HKV, D, kv_dtype),
        SlidingWindowSpec(HKV, D, kv_dtype, window=300),
        ChunkedLocalSpec(HKV, D, kv_dtype, chunk=256),
        ChunkedLocalSpec(HKV, D, kv_dtype, chunk=200),
    ]


@pytest.mark.skipif(not HOPPER_CUDA, reason="the CUDA prefill kernel: Hopper (sm_90) and cuda-bindings")
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("hq", [5, 8])  # 5: tiles packed across tokens (a tile may start inside a token), 8: not
def test_hopper_cuda_prefill_matches_reference(block_size, hq):
    # the default on Hopper for a bf16 cache: mixed prefill/decode batches over cached prefixes, unsplit; then a
    # long reach split 4 ways (the local layers' few tiles leave some splits empty; combine_splits_kernel merges)
    for make_specs in (specs, wide_specs):
        # both schedules have 3 steps with prefill rows: the CUDA kernel attends every layer of each
        launches = 3 * len(make_specs("bfloat16"))
        worst = drive(block_size, "bfloat16", torch.bfloat16, MIXED, num_sms=1, hq=hq, make_specs=make_specs)
        assert worst.pop("cuda_launches") == launches and worst.pop("max_splits") == 1
        assert all(e <= 1e-2 for e in worst.values()), worst
        split = drive(block_size, "bfloat16", torch.bfloat16, LONG_PREFILL, num_sms=4, hq=hq, make_specs=make_specs,
                      num_blocks=800 * 64 // block_size, splits=4)
        assert split.pop("cuda_launches") == launches and split.pop("max_splits") == 4
        assert all(e <= 1e-2 for e in split.values()), split


# a full layer's reach of 33,000+ keys: >= 256 of the CUDA kernel's 128-key tiles, so an FP8 cache widens segments
LONG_FP8_PREFILL = {"lengths": [33000, 300], "steps": [[16384, 0], [16384, 300], [232, 1]]}


@pytest.mark.skipif(not HOPPER_CUDA, reason="the CUDA prefill kernel: Hopper (sm_90) and cuda-bindings")
@pytest.mark.parametrize("block_size", [16, 64])
def test_hopper_cuda_prefill_attends_an_fp8_cache_in_widened_segments(block_size):
    # the long reach of an FP8 cache is widened to bf16 in segments of under 10,000 keys, each attended by the CUDA
    # kernel, its 4 splits' partial outputs merged across segments; short reaches (sliding, chunked, the mixed
    # batches) read e4m3 in the Triton kernel over the same tiles
    scales = {i: (0.05 * (i + 1), 0.5 / (i + 1)) for i in range(6)}
    split = drive(block_size, "fp8_e4m3", torch.bfloat16, LONG_FP8_PREFILL, num_sms=4, kv_scales=scales, splits=4,
                  num_blocks=1200 * 64 // block_size, segment_bytes=10000 * 2 * HKV * D * 2)
    # the 2 steps whose reach reaches 32,768 keys x 2 full layers x >= 4 segments; the rest read e4m3 in Triton
    assert split.pop("cuda_launches") >= 2 * 2 * 4 and split.pop("max_splits") == 4
    assert split.pop("max_segments") >= 4
    assert all(e <= 2e-2 for e in split.values()), split


@pytest.mark.skipif(not HOPPER_CUDA, reason="the CUDA prefill kernel: Hopper (sm_90) and cuda-bindings")
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("hq", [5, 8])
def test_hopper_cuda_fp8_compute_matches_reference(block_size, hq):
    # FP8 compute on Hopper with pages of 64+ tokens: the CUDA kernel's e4m3 dots (V^T in its own column order), per
    # layer K/V scales. Mixed prefill/decode batches over cached prefixes (one V^T segment each, unsplit), then a long
    # reach split 4 ways and cut into several V^T segments merged in the kernel; windows and chunks inside one tile
    # and across tiles (edge tiles zero V^T's columns outside the reach: the cache is poisoned with NaN there)
    for make_specs in (specs, wide_specs):
        launches = 3 * len(make_specs("fp8_e4m3"))
        worst = drive(block_size, "fp8_e4m3", torch.bfloat16, MIXED, num_sms=1, hq=hq, make_specs=make_specs,
                      kv_scales=FP8_SCALES, fp8_compute=True, poison=float("nan"))
        assert worst.pop("cuda_launches") == launches and worst.pop("max_splits") == 1
        assert worst.pop("max_segments") == 1
        assert all(e <= FP8_COMPUTE_BOUND for e in worst.values()), worst
        split = drive(block_size, "fp8_e4m3", torch.bfloat16, LONG_PREFILL, num_sms=4, hq=hq, make_specs=make_specs,
                      num_blocks=800 * 64 // block_size, splits=4, kv_scales=FP8_SCALES, fp8_compute=True,
                      segment_bytes=5000 * HKV * D, poison=float("nan"))
        assert split.pop("cuda_launches") >= launches and split.pop("max_splits") == 4
        assert split.pop("max_segments") >= 3  # 16,600 keys in segments of under 5,000
        assert all(e <= FP8_COMPUTE_BOUND for e in split.values()), split


@pytest.mark.skipif(not HOPPER_CUDA, reason="the CUDA prefill kernel: Hopper (sm_90) and cuda-bindings")
def test_hopper_cuda_prefill_leaves_what_it_does_not_cover_to_triton():
    # fp16 queries and cache: the steps use the CUDA kernel's 128-row tiles, every one attended by the Triton kernel
    fp16 = TritonPagedAttention(plan_layout(specs("float16"), 64), 64, "float16", HQ, DEVICE)
    assert fp16.hopper is not None and fp16.builder.configs.prefill.cuda
    worst = drive(64, "float16", torch.float16, MIXED, num_sms=1)
    assert worst.pop("cuda_launches") == 0
    worst.pop("max_splits")
    assert all(e <= 1e-2 for e in worst.values()), worst
    # FP8 compute over 16-token pages (V^T tiles by TMA need 64 columns): Triton's FP8 dots over the same tiles
    fp8 = drive(16, "fp8_e4m3", torch.bfloat16, MIXED, num_sms=1, kv_scales=FP8_SCALES, fp8_compute=True)
    assert fp8.pop("cuda_launches") == 0 and fp8.pop("max_segments") == 1
    fp8.pop("max_splits")
    assert all(e <= FP8_COMPUTE_BOUND for e in fp8.values()), fp8
    # the kernel turned off: Triton's own tiles
    off = TritonPagedAttention(plan_layout(specs("bfloat16"), 64), 64, "bfloat16", HQ, DEVICE,
                               options=KernelOptions(hopper_kernel=False))
    assert off.hopper is None and off.builder.configs.prefill == HOPPER_PREFILL


@pytest.mark.skipif(not HOPPER_CUDA or cuda_build.cuobjdump() is None,
                    reason="the CUDA prefill kernel (Hopper, cuda-bindings) and cuobjdump")
@pytest.mark.parametrize("fp8_tile", [(192, 4), (128, 5)])
def test_hopper_cuda_builds_leave_p_alone_while_p_v_dots_read_it(tmp_path, fp8_tile):
    # ptxas counts a P V dot's register A as read at issue and may hand those registers to other values while the dot
    # still reads them; only packing P after the dot's wait keeps them. Checked on each build's machine code, both
    # kernels (bf16 and FP8 compute), FP8 with its 192-key tile and the 128-key one with FP8_PROMOTE.
    block_n, stages = fp8_tile
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(hopper_attention.compile_cubin(fp8_block_n=block_n, fp8_stages=stages, cache_dir=None))
    functions = cuda_build.disassemble(cubin)
    assert sorted(functions) == ["paged_prefill_hopper", "paged_prefill_hopper_fp8"]
    for name, code in functions.items():
        # each kernel's P V dots take P from registers (else the check below would have nothing to look at)
        assert hopper_attention._RS_DOT.search(code), name
        assert hopper_attention.inflight_register_writes(code) == [], name


@pytest.mark.parametrize("heads, dim, block_size", [(1, 128, 64), (3, 64, 16)])  # one KV head; H * D not a power of 2
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_kv_write_and_v_transpose_place_every_value(heads, dim, block_size, kv_dtype):
    # 100 new tokens after 5 cached (slots start mid-page, the last program is partly masked), pages permuted
    if INTERPRET and kv_dtype == "fp8_e4m3":
        pytest.skip("Triton's interpreter rounds to e4m3 unlike the GPU (1.99 -> 1.0)")
    spec = FullAttentionSpec(heads, dim, kv_dtype)
    scales = {0: (0.5, 2.0)} if kv_dtype == "fp8_e4m3" else None
    tri = TritonPagedAttention(plan_layout([spec], block_size), 64, kv_dtype, heads, DEVICE, kv_scales=scales)
    table = np.random.default_rng(0).permutation(np.arange(1, 64, dtype=np.int32))
    tri.begin_step([StepSequence(5, 100, [table])])
    k = torch.randn(100, heads, dim, device=DEVICE, dtype=torch.bfloat16) * 4
    v = torch.randn_like(k) * 4
    tri.write(0, k, v)
    view = tri.cache.layers[0].view
    pos = torch.arange(5, 105, device=DEVICE)
    blocks = torch.as_tensor(table, device=DEVICE).long()[pos // block_size]
    k_scale, v_scale = scales[0] if scales else (1.0, 1.0)
    cast = lambda x, s: (x.float() / s).clamp(-448, 448).to(view.dtype)  # noqa: E731
    assert torch.equal(view[blocks, 0, pos % block_size].float(), cast(k, k_scale).float())
    assert torch.equal(view[blocks, 1, pos % block_size].float(), cast(v, v_scale).float())
    if kv_dtype == "fp8_e4m3":
        # V^T of three pages in a permuted column order, against torch's gather and transpose
        pages = torch.as_tensor(table[:3], device=DEVICE).long()
        columns = torch.as_tensor(hopper_attention.page_columns(block_size), device=DEVICE)
        raw = view.view(torch.uint8)
        vt = tri._v_transposed(raw, pages, columns, heads * dim)
        want = raw[pages[:, None], 1, columns[None, :]].permute(2, 3, 0, 1).reshape(heads * dim, -1)
        assert vt.shape == want.shape and torch.equal(vt.view(torch.uint8), want)
