"""Routed experts at decode sizes: each selected expert's weights read once, straight from the expert tensors.

The MoE's (token, choice) pairs are few at decode (batch x top_k), and each pair needs one expert's weights. The
naive graph-capturable way gathers ``gate_up_proj[ids]`` into a copy per pair and multiplies the copy: three
passes over an expert's bytes (read, write, read). Here two kernels read the weights in place:

1. ``gate_up_kernel``: program (expert e, column tile n, K-split s) finds the pairs routed to ``e`` (a mask over
   all pairs, no sorting: a program whose expert nobody picked returns before touching a weight), multiplies
   their gated inputs ``x * gate`` (Llama-4 scales the expert's input) by ``W_gate_up[e, ks, n]`` and writes the
   float32 partial sums of split ``s``. Splitting K keeps enough programs streaming at batch 1, where only one
   expert's 16 column tiles have work.
2. ``down_kernel``: program (expert e, column tile n) sums the splits, applies ``silu(gate) * up``, and multiplies
   by ``W_down[e, :, n]``; output rows are the pairs (summed over top_k by the caller).

E.g. 2 tokens, top-1, ids [3, 3], 16 experts, I = 1024, 64-column tiles, 4 splits: 16 x 16 x 4 programs start,
the 64 of expert 3 each read a [H/4, 64] tile of gate and of up for both rows at once; 960 return at once.

Both kernels take any float dtype; float32 weights use IEEE dots (Triton's default for float32 is tf32), so the
tiny float32 test models stay exact to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the most (token, choice) pairs one launch takes: rows of a program's tiles (register use grows with it)
MAX_PAIRS = 64


@triton.jit
def gate_up_kernel(
    x_ptr, gate_ptr, ids_ptr, w_ptr, part_ptr,
    num_pairs, hidden, inter, k_per_split,
    stride_xt, stride_we, stride_wk, stride_ps, stride_pp,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    e = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    pairs = tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    mine = ids == e
    if tl.sum(mine.to(tl.int32), 0) == 0:
        return
    gate = tl.load(gate_ptr + pairs, mask=mine, other=0.0).to(tl.float32)
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_e = w_ptr + e.to(tl.int64) * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, hidden)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
        # the gated input rounded to the weights' dtype, as (x * gate) is in eager torch
        xg = (x.to(tl.float32) * gate[:, None]).to(w_ptr.dtype.element_ty)
        w_rows = w_e + ks[:, None].to(tl.int64) * stride_wk
        ok = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_rows + cols[None, :], mask=ok, other=0.0)
        wu = tl.load(w_rows + (cols + inter)[None, :], mask=ok, other=0.0)
        if IEEE:
            acc_g += tl.dot(xg, wg, input_precision="ieee")
            acc_u += tl.dot(xg, wu, input_precision="ieee")
        else:
            acc_g += tl.dot(xg, wg)
            acc_u += tl.dot(xg, wu)
    out = part_ptr + split * stride_ps + pairs[:, None].to(tl.int64) * stride_pp
    ok = mine[:, None] & col_ok[None, :]
    tl.store(out + cols[None, :], acc_g, mask=ok)
    tl.store(out + (cols + inter)[None, :], acc_u, mask=ok)


@triton.jit
def down_kernel(
    part_ptr, ids_ptr, w_ptr, out_ptr,
    num_pairs, hidden, inter,
    stride_ps, stride_pp, stride_we, stride_wk, stride_op,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    e = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    pairs = tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    mine = ids == e
    if tl.sum(mine.to(tl.int32), 0) == 0:
        return
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_e = w_ptr + e.to(tl.int64) * stride_we
    rows = part_ptr + pairs[:, None].to(tl.int64) * stride_pp
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        ok = mine[:, None] & k_ok[None, :]
        g = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        u = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            g += tl.load(rows + s * stride_ps + ks[None, :], mask=ok, other=0.0)
            u += tl.load(rows + s * stride_ps + (ks + inter)[None, :], mask=ok, other=0.0)
        # eager torch rounds each projection's output to the weights' dtype before silu(gate) * up
        g = g.to(w_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(w_ptr.dtype.element_ty).to(tl.float32)
        h = (g * tl.sigmoid(g) * u).to(w_ptr.dtype.element_ty)
        w = tl.load(w_e + ks[:, None].to(tl.int64) * stride_wk + cols[None, :],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h, w, input_precision="ieee")
        else:
            acc += tl.dot(h, w)
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_op + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mine[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Routed experts' output [T, H] for ``x`` [T, H], top-k ``gates`` and expert ``ids`` [T, top_k].

    ``gate_up`` [E, H, 2I] (gate columns first), ``down`` [E, I, H]: transformers' Llama-4 layout. The caller
    guarantees ``T * top_k <= MAX_PAIRS``."""
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    if num_pairs > MAX_PAIRS:
        raise ValueError(f"fused_moe takes at most {MAX_PAIRS} (token, choice) pairs, got {num_pairs}")
    num_experts, hidden, inter = down.shape[0], down.shape[2], down.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.reshape(-1)
    gates = gates.reshape(-1)
    block_m = max(16, triton.next_power_of_2(num_pairs))
    block_n, block_k = 64, 128
    col_tiles = triton.cdiv(inter, block_n)
    # enough programs with work to keep ~128 SMs streaming: pairs touch at most min(E, pairs) experts
    busy = min(num_experts, num_pairs) * col_tiles
    splits = max(1, min(16, 128 // busy, triton.cdiv(hidden, 4 * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    splits = triton.cdiv(hidden, k_per_split)
    part = torch.empty((splits, num_pairs, 2 * inter), dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    gate_up_kernel[(num_experts, col_tiles, splits)](
        x, gates, ids, gate_up, part, num_pairs, hidden, inter, k_per_split,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), part.stride(0), part.stride(1),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=4, num_stages=3,
    )
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    down_n = 32 if num_pairs <= 4 else 64  # batch 1: 160 column tiles of one expert instead of 80
    down_kernel[(num_experts, triton.cdiv(hidden, down_n))](
        part, ids, down, out, num_pairs, hidden, inter,
        part.stride(0), part.stride(1), down.stride(0), down.stride(1), out.stride(0),
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=down_n, BLOCK_K=64, IEEE=ieee, num_warps=4, num_stages=3,
    )
    return out if top_k == 1 else out.view(tokens, top_k, hidden).sum(dim=1)
