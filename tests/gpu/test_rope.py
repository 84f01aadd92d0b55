"""The fused position-encoding kernel against the eager torch it replaces: RoPE (interleaved and halves),
Llama-4's QK-norm after RoPE, and the NoPE layers' q temperature, on q/k that are strided views of one fused
QKV output as the model hands them over."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.rope import rope_qk  # noqa: E402
from hybridkv.model.architectures.llama_config import RopeConfig  # noqa: E402
from hybridkv.model.architectures.norms import unit_rms  # noqa: E402
from hybridkv.model.architectures.position_encoding import (  # noqa: E402
    rope_cos_sin, rope_halves, rope_interleaved, rope_inv_freq, temperature_scales,
)

DEVICE = "cpu" if INTERPRET else "cuda"
# bitwise on a GPU; Triton 3.6's interpreter rounds float32 -> bf16 its own way (one bf16 step apart at most)
EXACT_ROUNDING = dict(rtol=8e-3, atol=0) if INTERPRET else dict(rtol=0, atol=0)


def fused_qkv(tokens, q_heads, kv_heads, d, dtype):
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * d) * 2).to(dtype)
    q, k, _ = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return qkv, q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d))


def tables(tokens, d):
    positions = torch.randint(0, 3_000_000, (tokens,))
    inv_freq = rope_inv_freq(RopeConfig(theta=500000.0), d)
    return positions, rope_cos_sin(inv_freq, positions)


def on_device(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved,qk_norm", [(True, True), (True, False), (False, False)])
def test_rope_matches_eager(dtype, interleaved, qk_norm):
    torch.manual_seed(0)
    _, q, k = fused_qkv(7, 5, 1, 64, dtype)
    _, (cos, sin) = tables(7, 64)
    encode = rope_interleaved if interleaved else rope_halves
    want_q, want_k = encode(q, cos, sin), encode(k, cos, sin)
    if qk_norm:
        want_q, want_k = unit_rms(want_q, 1e-5), unit_rms(want_k, 1e-5)
    got_q, got_k = rope_qk(*on_device(q, k, cos, sin), rotate=True, interleaved=interleaved, qk_norm=qk_norm,
                           eps=1e-5)
    assert got_q.is_contiguous() and got_q.shape == q.shape and got_k.shape == k.shape
    # bf16: the norm's row sum in another order may move a rounding by one step
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_q.cpu(), want_q, **tol)
    torch.testing.assert_close(got_k.cpu(), want_k, **tol)


def test_temperature_scales_q_only():
    torch.manual_seed(1)
    _, q, k = fused_qkv(9, 4, 2, 32, torch.bfloat16)
    positions, (cos, sin) = tables(9, 32)
    temperature = temperature_scales(positions, 8192.0, 0.1)
    assert temperature.max() > 1.1  # positions far past floor_scale: the scale does something
    got_q, got_k = rope_qk(*on_device(q, k, cos, sin), rotate=False, interleaved=True,
                           temperature=temperature.to(DEVICE))
    torch.testing.assert_close(got_q.cpu(), (q * temperature).to(q.dtype), **EXACT_ROUNDING)
    assert got_k.data_ptr() == k.to(DEVICE).data_ptr() or torch.equal(got_k.cpu(), k)


@pytest.mark.parametrize("rotate,qk_norm,store", [(True, True, False), (True, False, False), (False, False, False),
                                                  (True, True, True), (False, False, True)])
def test_prefill_tiles_match_one_token_programs(rotate, qk_norm, store, monkeypatch):
    """A prefill-sized step (not a whole number of tiles) runs 16 tokens of a row per program: the same q, k and
    cache slots as one token per program (bitwise; with QK-norm the row sum's order may move a bf16 rounding by one
    step), and as eager torch. The default picks the tiles for this many tokens."""
    from hybridkv.kernels import rope
    from hybridkv.kernels.rope import PREFILL_TILE, TILED_TOKENS

    grids = []  # each launch's grid: how many tokens a program took
    kernel = rope.rope_qk_kernel
    monkeypatch.setattr(rope, "rope_qk_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    torch.manual_seed(3)
    tokens, q_heads, kv_heads, d = TILED_TOKENS + 37, 5, 1, 64
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * d) * 2).to(torch.bfloat16)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1))
    positions, (cos, sin) = tables(tokens, d)
    temp = None if rotate else temperature_scales(positions, 8192.0, 0.1).to(DEVICE)
    args = on_device(q, k, cos, sin)
    kwargs = dict(rotate=rotate, interleaved=True, qk_norm=qk_norm, eps=1e-5, temperature=temp)
    got, caches = [], []
    pages = -(-tokens // 8)
    order = torch.randperm(tokens).tolist()  # slots out of order across pages
    for tile in (None, PREFILL_TILE, (1, 1)):
        cache = paged_cache(pages, 8, kv_heads, d, torch.bfloat16)
        slots = slots_for(cache, [o // 8 for o in order], [o % 8 for o in order]) if store else None
        got.append(rope_qk(*args, v=v.to(DEVICE) if store else None, slots=slots, tile=tile, **kwargs))
        caches.append(cache.cpu())
    (q_def, k_def), (q_tiled, k_tiled), (q_one, k_one) = got
    tiles = -(-tokens // PREFILL_TILE[0])
    assert [g[0] for g in grids] == [tiles, tiles, tokens]  # the default tiles a step of TILED_TOKENS or more
    rope_qk(*on_device(q[:TILED_TOKENS - 1], k[:TILED_TOKENS - 1], cos[:TILED_TOKENS - 1], sin[:TILED_TOKENS - 1]),
            **{**kwargs, "temperature": None if temp is None else temp[:TILED_TOKENS - 1]})
    assert grids[-1][0] == TILED_TOKENS - 1  # and a smaller one runs a token a program
    assert torch.equal(q_def.cpu(), q_tiled.cpu()) and torch.equal(caches[0].view(torch.int16),
                                                                   caches[1].view(torch.int16))
    same = torch.equal if not qk_norm else lambda a, b: torch.testing.assert_close(a, b, rtol=1e-2, atol=0) is None
    assert same(q_tiled.cpu(), q_one.cpu())
    if store:
        # every token's slot written, only those: the last page's unused slots still NaN
        assert k_tiled is None and caches[1].isnan().sum() == (pages * 8 - tokens) * 2 * kv_heads * d
        # NaN (the unused slots) is never equal to itself: its bits are
        assert same(*(c.view(torch.int16) for c in caches[1:])) if not qk_norm else same(
            *(c.nan_to_num() for c in caches[1:]))
    elif rotate:
        assert same(k_tiled.cpu(), k_one.cpu())
    want_q = rope_interleaved(q, cos, sin) if rotate else (q * temp.cpu()).to(q.dtype)
    if qk_norm:
        want_q = unit_rms(want_q, 1e-5)
    torch.testing.assert_close(q_tiled.cpu(), want_q, rtol=2e-2, atol=1 / 32)  # a bf16 step at |x| < 8


def paged_cache(blocks, block_size, kv_heads, d, dtype):
    """A layer's cache as the paged layout holds it: [blocks, K then V, block_size, kv heads, d], NaN-filled so a
    value nobody stored shows."""
    return torch.full((blocks, 2, block_size, kv_heads, d), float("nan")).to(dtype).to(DEVICE)


def slots_for(cache, blocks, offsets, k_scale=1.0, v_scale=1.0):
    from hybridkv.kernels.kv_slots import KVSlots

    _, _, block_size, kv_heads, d = cache.shape
    as_int = lambda a: torch.tensor(a, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return KVSlots(cache.view(-1), as_int(blocks), as_int(offsets), cache.stride(0), block_size * kv_heads * d,
                   k_scale, v_scale, cache.dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rotate,temperature", [(True, False), (False, True), (False, False)])
def test_k_and_v_stored_in_their_slots(kv_dtype, rotate, temperature):
    """With the cache's slots the kernel stores k (encoded as it would return it) and v into each token's slot,
    as the KV-write kernel would (an FP8 cache: over the layer's scales, saturated at 448), and q as before. The
    slots are out of order across pages; every other slot stays untouched."""
    if kv_dtype == torch.float8_e4m3fn and INTERPRET:
        pytest.skip("Triton's interpreter rounds float32 -> e4m3 its own way (one e4m3 step apart)")
    torch.manual_seed(2)
    tokens, q_heads, kv_heads, d = 5, 4, 2, 32
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * d) * 40).to(torch.bfloat16)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1))
    positions, (cos, sin) = tables(tokens, d)
    temp = temperature_scales(positions, 8192.0, 0.1) if temperature else None
    kwargs = dict(rotate=rotate, interleaved=True, qk_norm=rotate, eps=1e-5)
    want_q, want_k = rope_qk(*on_device(q, k, cos, sin), temperature=None if temp is None else temp.to(DEVICE),
                             **kwargs)
    scales = (0.5, 0.25) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    cache = paged_cache(4, 4, kv_heads, d, kv_dtype)
    blocks, offsets = [2, 0, 2, 3, 1], [1, 3, 0, 2, 2]
    got_q, got_k = rope_qk(*on_device(q, k, cos, sin), temperature=None if temp is None else temp.to(DEVICE),
                           v=v.to(DEVICE), slots=slots_for(cache, blocks, offsets, *scales), **kwargs)
    assert got_k is None
    assert torch.equal(got_q.cpu(), want_q.cpu())
    expect = paged_cache(4, 4, kv_heads, d, kv_dtype).cpu()
    for t, (b, o) in enumerate(zip(blocks, offsets)):
        for part, value, scale in ((0, want_k[t].cpu(), scales[0]), (1, v[t], scales[1])):
            if kv_dtype == torch.float8_e4m3fn:
                value = (value.float() / scale).clamp(-448, 448)
            expect[b, part, o] = value.to(kv_dtype)
    got = cache.cpu()
    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))  # NaN untouched slots compare bitwise
    if kv_dtype == torch.float8_e4m3fn:
        assert (got.float().abs() == 448).any()  # saturation happened: the clamp is exercised
