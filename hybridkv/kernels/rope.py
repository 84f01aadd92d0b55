"""Position encoding of q and k in one launch per layer: RoPE, Llama-4's QK-norm and its NoPE layers' attention
temperature, each (token, head) row read once and written once.

Eager torch spends about ten launches per tensor on it (upcast, two products per half, a difference, a sum, a
stack, a downcast, then the norm): at decode, ~20 tiny kernels per layer, a large share of a step's launches.

Same arithmetic as ``llama.rope_interleaved`` / ``rope_halves``, ``unit_rms`` and ``temperature_scales`` (float32
inside, each stage rounded to the input dtype where eager torch rounds); ``cos``/``sin`` are the step's
``rope_cos_sin`` tables, shared by every layer.

Given the paged cache's slots (``KVSlots``), the same launch stores the step's k and v into the cache, as the
backend's KV-write kernel would (e4m3 with its scales for an FP8 cache): one kernel fewer in a decode step's
chain of dependent launches (a Scout rank's batch-1 step lost 0.06 ms of 2.63 without its 48 KV writes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.kv_slots import KVSlots
from hybridkv.kernels.launch import pdl, pdl_start


@triton.jit
def _load_pairs(src, m, BLOCK_T: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The rotated pairs of BLOCK_T rows of D values, (a, b) [BLOCK_T, D/2] in float32: (2i, 2i+1), or (i, i + D/2).
    An interleaved row is read whole and split in registers, so that a warp's loads and stores are contiguous."""
    HALF: tl.constexpr = D // 2
    if INTERLEAVED:
        x = tl.load(src + tl.arange(0, D)[None, :], mask=m, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, (BLOCK_T, HALF, 2)))
    else:
        i = tl.arange(0, HALF)[None, :]
        a = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        b = tl.load(src + i + HALF, mask=m, other=0.0).to(tl.float32)
    return a, b


@triton.jit
def _store_pairs(dst, a, b, m, BLOCK_T: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``_load_pairs``' inverse: (a, b), already in the stored dtype, written as BLOCK_T rows of D values."""
    HALF: tl.constexpr = D // 2
    if INTERLEAVED:
        tl.store(dst + tl.arange(0, D)[None, :], tl.reshape(tl.join(a, b), (BLOCK_T, D)), mask=m)
    else:
        i = tl.arange(0, HALF)[None, :]
        tl.store(dst + i, a, mask=m)
        tl.store(dst + i + HALF, b, mask=m)


@triton.jit
def rope_qk_kernel(
    q_ptr, k_ptr, v_ptr, q_out, k_out, cos_ptr, sin_ptr, scale_ptr,
    cache_ptr, slot_block_ptr, slot_offset_ptr, k_scale, v_scale, stride_block, v_offset,
    stride_qt, stride_kt, stride_vt, stride_cos, num_q_heads, num_k_heads, num_tokens, eps,
    D: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, QK_NORM: tl.constexpr,
    TEMPERATURE: tl.constexpr, STORE: tl.constexpr = False, QUANT: tl.constexpr = False, PDL: tl.constexpr = False,
    BLOCK_T: tl.constexpr = 1,
):
    """Program (tokens BLOCK_T x i .. BLOCK_T x (i + 1), row h): h < num_q_heads is q's head h, the next num_k_heads
    are k's heads, and with STORE the rest are v's. A q head is rotated (ROTATE) or scaled (TEMPERATURE), a k head
    rotated (ROTATE); STORE puts k and v into each token's cache slot (``kv_write_kernel``'s addressing and FP8
    rounding) instead of ``k_out``."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < num_tokens
    h = tl.program_id(1)
    if STORE:
        # the slots are step metadata (copied in before the step's first kernel): read before the wait
        block = tl.load(slot_block_ptr + t, mask=live, other=0).to(tl.int64)[:, None]
        offset = tl.load(slot_offset_ptr + t, mask=live, other=0).to(tl.int64)[:, None]
    if PDL:
        pdl_start()
    dtype = q_out.dtype.element_ty
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)[None, :]  # a rotated pair's index: (2i, 2i+1), or (i, i + D/2)
    rows = t[:, None]
    m = live[:, None]
    is_q = h < num_q_heads
    kv_row = h - num_q_heads
    is_v = kv_row >= num_k_heads
    kh = tl.where(is_v, kv_row - num_k_heads, kv_row)  # the row's KV head (k's or v's)
    if is_q:
        src = q_ptr + rows * stride_qt + h * D
    elif is_v:
        src = v_ptr + rows * stride_vt + kh * D
    else:
        src = k_ptr + rows * stride_kt + kh * D
    a, b = _load_pairs(src, m, BLOCK_T, D, INTERLEAVED)
    if ROTATE:
        if not is_v:
            c = tl.load(cos_ptr + rows * stride_cos + i, mask=m, other=0.0)
            s = tl.load(sin_ptr + rows * stride_cos + i, mask=m, other=0.0)
            a, b = a * c - b * s, a * s + b * c
            a = a.to(dtype).to(tl.float32)
            b = b.to(dtype).to(tl.float32)
            if QK_NORM:
                inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
                a = (a * inv).to(dtype).to(tl.float32)
                b = (b * inv).to(dtype).to(tl.float32)
    elif TEMPERATURE:
        if is_q:
            scale = tl.load(scale_ptr + rows, mask=m, other=1.0)
            a = a * scale
            b = b * scale
    if is_q:
        dst = q_out + (rows * num_q_heads + h) * D
        _store_pairs(dst, a.to(dtype), b.to(dtype), m, BLOCK_T, D, INTERLEAVED)
    elif STORE:
        heads = tl.num_programs(1) - num_q_heads - num_k_heads
        slot = cache_ptr + block * stride_block + (offset * heads + kh) * D + tl.where(is_v, v_offset, 0)
        if QUANT:
            # as kv_write_kernel: the value in the model's dtype over its scale, saturated at e4m3's 448
            factor = tl.where(is_v, v_scale, k_scale)
            qa = tl.clamp(a.to(dtype).to(tl.float32) / factor, -448.0, 448.0)
            qb = tl.clamp(b.to(dtype).to(tl.float32) / factor, -448.0, 448.0)
            _store_pairs(slot, qa.to(cache_ptr.dtype.element_ty), qb.to(cache_ptr.dtype.element_ty), m, BLOCK_T, D,
                         INTERLEAVED)
        else:
            cached = cache_ptr.dtype.element_ty
            _store_pairs(slot, a.to(dtype).to(cached), b.to(dtype).to(cached), m, BLOCK_T, D, INTERLEAVED)
    else:
        dst = k_out + (rows * num_k_heads + kh) * D
        _store_pairs(dst, a.to(dtype), b.to(dtype), m, BLOCK_T, D, INTERLEAVED)


# Steps of this many tokens or more (prefill) run 16 tokens of one row a program, in 2 warps: a Scout rank's 16K-token
# step 139.0 -> 19.8 us a layer on an H200 against a 15.8 us floor, where one (token, row) a program is 115K
# programs of 256 bytes each way (docs/benchmarks.md#rope). Fewer tokens (decode) keep a token and a warp a program:
# the most programs for the fewest tokens.
TILED_TOKENS = 128
PREFILL_TILE = (16, 2)  # tokens, warps


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rotate: bool,
            interleaved: bool, qk_norm: bool = False, eps: float = 1e-6, temperature: torch.Tensor | None = None,
            v: torch.Tensor | None = None, slots: KVSlots | None = None,
            tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, k) [T, heads, D] from ``q``/``k`` [T, heads, D] (rows may be strided views of a fused QKV output).
    ``rotate``: RoPE by ``cos``/``sin`` [T, 1, D/2] (then QK-norm when ``qk_norm``), both new tensors; else q
    times ``temperature`` [T, 1, 1] (a new q) and k as it is.

    With ``slots`` (and ``v`` [T, kv heads, D]): k and v are stored into the cache's slots instead, and the k
    returned is None. ``tile``: (tokens, warps) a program (default: ``PREFILL_TILE`` from ``TILED_TOKENS`` tokens on,
    else a token and a warp)."""
    tokens, q_heads, d = q.shape
    k_heads = k.shape[1]
    for t in (q, k) if v is None else (q, k, v):
        if t.stride(-1) != 1 or t.stride(1) != d:
            raise ValueError("rope_qk needs each token's heads contiguous")
    store = slots is not None
    q_done = rotate or temperature is not None  # q is computed, not passed through
    if not q_done and not store:
        return q, k
    q_out = torch.empty((tokens, q_heads, d), dtype=q.dtype, device=q.device) if q_done else q
    k_out = None if store else torch.empty((tokens, k_heads, d), dtype=k.dtype, device=k.device) if rotate else k
    if tokens == 0:
        return q_out, k_out
    scale = temperature.reshape(-1) if temperature is not None else cos
    num_q = q_heads if q_done else 0
    rows = num_q + (k_heads if rotate or store else 0) + (k_heads if store else 0)
    cache, block, offset, stride_block, v_offset, k_scale, v_scale, quant = (
        (slots.cache, slots.block, slots.offset, slots.stride_block, slots.v_offset, slots.k_scale, slots.v_scale,
         slots.quantized) if store else (q_out, cos, cos, 0, 0, 1.0, 1.0, False))
    on = pdl(q)
    tile_tokens, warps = tile or (PREFILL_TILE if tokens >= TILED_TOKENS else (1, 1))
    rope_qk_kernel[(triton.cdiv(tokens, tile_tokens), rows)](
        q, k, k if v is None else v, q_out, q_out if k_out is None else k_out, cos, sin, scale,
        cache, block, offset, k_scale, v_scale, stride_block, v_offset,
        q.stride(0), k.stride(0), k.stride(0) if v is None else v.stride(0), cos.stride(0), num_q, k_heads, tokens,
        eps, D=d, ROTATE=rotate, INTERLEAVED=interleaved, QK_NORM=qk_norm, TEMPERATURE=temperature is not None,
        STORE=store, QUANT=quant, PDL=on, BLOCK_T=tile_tokens, num_warps=warps,
        launch_pdl=on,
    )
    return q_out, k_out
