"""A MoE's routed experts over INT4 (W4A16) or FP8 (W8A16) weights: decode in four launches after the router,
prefill as a grouped GEMM that dequantizes its weight tiles as it multiplies. One kernel body serves both formats
(the ``FP8`` constexpr picks the weight tile, ``_weight_tile``).

Each projection of every expert is a stack, one expert after another, output-major ([E, N, K]: for Llama-4
gate_up N = 2I (the expert's gate rows, then its up rows), K = H; down N = H, K = I), passed as ``(weight, scale,
zero)``:

- INT4, ``quant_gemm.py``'s layout: ``weight`` int32 [E, N, K // 8], ``scale`` [E, N, K // G] (the model dtype),
  ``zero`` int8 [E, N, K // G] or None. A weight tile is dequantized in registers as ``quant_triton.py`` does it
  (``nibble | 0x4B000000`` is the float 2^23 + nibble, so subtracting ``MAGIC`` + zero leaves ``q - zero``
  exactly), times its group's scale, rounded to the activations' dtype: each weight is ``dequantize_int4``'s.
- FP8: ``weight`` float8_e4m3fn [E, N, K], ``scale`` float32 [E, N] (one per output channel), ``zero`` None. W8A16:
  the activations stay in their dtype (no per-token FP8 quantization, unlike the FP8 linears' W8A8); a weight tile
  is converted to the activations' dtype (exact: every e4m3 value is a bf16 value) and the channel's scale
  multiplies the float32 accumulator after the dots, ``sum_k x_k (q_k s) = s sum_k x_k q_k``. The product is then
  that of ``dequantize_fp8``'s float32 weights up to float32 rounding, and closer to it than the bf16 native path,
  which rounds each ``q * s`` to bf16 first.

Either way the kernels compute what the float MoE computes over the dequantized experts (``Experts.stacks``), to
the order of float32 sums.

Decode (``quant_moe_decode``, at most ``fused_moe.MAX_PAIRS`` (token, choice) pairs):

1. ``quant_moe_gemm_kernel`` over gate_up: program (slot j, column tile, K-split) takes the j-th distinct expert the
   pairs picked (``fused_moe._slot_expert``: a slot past the last returns at once) and all the pairs routed to it,
   so each picked expert's weights are read once; its rows are the gated inputs ``x * gate`` (Llama-4 scales the
   expert's input), rounded to the dtype as eager torch rounds them. It stores float32 partial sums per split;
2. ``silu_splits_kernel``: the splits summed in split order, gate and up each rounded, ``silu(gate) * up``;
3. ``quant_moe_gemm_kernel`` over down, the pairs' hidden rows as they are;
4. ``sum_choices_kernel``: each pair's splits summed and rounded, a token's choices summed in float32 and rounded.

No host sync, no shape that depends on the routing, sums in a fixed order: a CUDA graph holds it and replays the
same bits. E.g. batch 1, top-1, a Scout rank (H 5120, I 8192, group 128): 1 busy slot x 256 column tiles of 64
for gate_up (each reading 64 x 5120 weights, 160 KB in INT4, 320 KB in FP8), 80 tiles x 3 splits for down.

Prefill (``quant_grouped_gemm``): rows sorted by expert (``moe_prefill.sort_by_expert``; ``ends`` its group ends),
program (tile t, column tile) finds the expert whose row tiles hold t (each expert's rows in tiles of BLOCK_M of
their own, so the grid's bound, rows / BLOCK_M + E tiles, does not depend on the routing) and multiplies its rows
by the dequantized tiles. No bf16 copy of any expert is made: the step needs no scratch but its rows.

Tiles are first choices, not yet tuned on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridkv.kernels.fused_moe import MAX_PAIRS, _slot_expert
from hybridkv.kernels.quant_triton import MAGIC

# the decode GEMMs split K until about this many programs have work (two per SM of an H100/H200)
SPLIT_PROGRAMS = 256


@dataclass(frozen=True, slots=True)
class Tile:
    """A launch's tile: BLOCK_M (0: the decode's, the pairs rounded up to a power of two, at least 16), BLOCK_N,
    the largest BLOCK_K (a power of two within one group), warps and pipeline stages. ``split_programs``: decode's
    K-splits aim at about this many programs."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split_programs: int = SPLIT_PROGRAMS


DECODE_TILE = Tile(0, 64, 128)
PREFILL_TILE = Tile(64, 128, 64)
FLOAT32_PREFILL_TILE = Tile(32, 64, 32)  # float32 tiles (the interpreter's checks) take less shared memory


@triton.jit
def _int4_tile(p_ptr, s_ptr, z_ptr, cols, col_ok, k0, group, stride_pn, stride_sn, stride_zn,
               BLOCK_K: tl.constexpr, ZERO: tl.constexpr, dtype: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile ``W[cols, k0 : k0 + BLOCK_K]^T`` of one expert's [N, K] INT4 weight,
    dequantized to ``dtype``: ``(q - zero) * scale`` in float32, rounded once. The tile lies in one group."""
    js = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    rows = cols.to(tl.int64)
    p = tl.load(p_ptr + rows[None, :] * stride_pn + js[:, None], mask=col_ok[None, :], other=0)
    g = k0 // group
    s = tl.load(s_ptr + rows * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO:
        offset = MAGIC + tl.load(z_ptr + rows * stride_zn + g, mask=col_ok, other=0).to(tl.float32)
    else:
        offset = tl.zeros_like(s) + MAGIC
    shifts = tl.arange(0, 8) * 4
    nib = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, p.shape[1]))
    w = (nib | 0x4B000000).to(tl.float32, bitcast=True) - offset[None, :]
    return (w * s[None, :]).to(dtype)


@triton.jit
def _weight_tile(p_ptr, s_ptr, z_ptr, cols, col_ok, k0, group, stride_pn, stride_sn, stride_zn,
                 BLOCK_K: tl.constexpr, FP8: tl.constexpr, ZERO: tl.constexpr, dtype: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile ``W[cols, k0 : k0 + BLOCK_K]^T`` of one expert's weight in ``dtype``: FP8 its e4m3
    values as they are (the channel scale comes after the dots, ``_scaled``), INT4 dequantized (``_int4_tile``)."""
    if FP8:
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(p_ptr + cols.to(tl.int64)[None, :] * stride_pn + ks[:, None], mask=col_ok[None, :], other=0.0)
        w = w.to(dtype)
    else:
        w = _int4_tile(p_ptr, s_ptr, z_ptr, cols, col_ok, k0, group, stride_pn, stride_sn, stride_zn, BLOCK_K, ZERO,
                       dtype)
    return w


@triton.jit
def _scaled(acc, s_ptr, cols, col_ok, stride_sn, FP8: tl.constexpr):
    """FP8: the float32 sums times each output channel's scale (INT4 tiles carry their scales already)."""
    if FP8:
        acc = acc * tl.load(s_ptr + cols.to(tl.int64) * stride_sn, mask=col_ok, other=0.0)[None, :]
    return acc


@triton.jit
def quant_moe_gemm_kernel(
    x_ptr, gate_ptr, ids_ptr, p_ptr, s_ptr, z_ptr, part_ptr,
    num_pairs, num_experts, n, k_per_split, k, group,
    stride_xr, stride_pe, stride_pn, stride_se, stride_sn, stride_ze, stride_zn, stride_ps, stride_pr,
    TOP_K: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, ZERO: tl.constexpr, E_PAD: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (slot, column tile, split): the float32 partial over K [split * k_per_split, ...) of the rows routed
    to the slot's expert times its columns. GATED: row r is token ``r // TOP_K``'s input times gate r (gate_up);
    else row r of ``x`` (down, over the pairs' hidden rows)."""
    slot = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    pair = rows < num_pairs
    ids = tl.load(ids_ptr + rows, mask=pair, other=-1)
    e = _slot_expert(ids, pair, slot, num_experts, E_PAD)
    mine = pair & (ids == e)
    if tl.sum(mine.to(tl.int32), 0) == 0:
        return
    col_ok = cols < n
    dtype = x_ptr.dtype.element_ty
    if GATED:
        x_rows = x_ptr + (rows // TOP_K).to(tl.int64)[:, None] * stride_xr
        gate = tl.load(gate_ptr + rows, mask=mine, other=0.0).to(tl.float32)
    else:
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    e64 = e.to(tl.int64)
    p_e, s_e, z_e = p_ptr + e64 * stride_pe, s_ptr + e64 * stride_se, z_ptr + e64 * stride_ze
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=mine[:, None], other=0.0)
        if GATED:  # the gated input rounded to the dtype, as (x * gate) is in eager torch
            x = (x.to(tl.float32) * gate[:, None]).to(dtype)
        w = _weight_tile(p_e, s_e, z_e, cols, col_ok, k0, group, stride_pn, stride_sn, stride_zn, BLOCK_K, FP8, ZERO,
                         dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    acc = _scaled(acc, s_e, cols, col_ok, stride_sn, FP8)  # a split's partial, scaled: the splits' sum is linear
    out = part_ptr + split * stride_ps + rows.to(tl.int64)[:, None] * stride_pr + cols[None, :]
    tl.store(out, acc, mask=mine[:, None] & col_ok[None, :])


@triton.jit
def silu_splits_kernel(part_ptr, h_ptr, inter, splits, stride_ps, stride_pr, stride_hr, BLOCK: tl.constexpr):
    """Program (row, c): ``silu(gate) * up`` of the row's gate_up partials summed over the splits (in order), each
    projection rounded to the dtype and ``silu`` rounded before the product, as eager torch rounds them."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        row = part_ptr + s * stride_ps + r * stride_pr
        g += tl.load(row + cols, mask=ok, other=0.0)
        u += tl.load(row + inter + cols, mask=ok, other=0.0)
    dtype = h_ptr.dtype.element_ty
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(h_ptr + r * stride_hr + cols, (silu * u).to(dtype), mask=ok)


@triton.jit
def sum_choices_kernel(part_ptr, out_ptr, hidden, splits, stride_ps, stride_pr, stride_or,
                       TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token t, c): each of t's TOP_K pairs' down partials summed over the splits and rounded (a pair's
    output, as the grouped GEMM rounds it), then the choices summed in float32 and rounded."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(splits):
            pair += tl.load(part_ptr + s * stride_ps + (t * TOP_K + j) * stride_pr + cols, mask=ok, other=0.0)
        total += pair.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_or + cols, total.to(dtype), mask=ok)


@triton.jit
def quant_grouped_gemm_kernel(
    a_ptr, ends_ptr, p_ptr, s_ptr, z_ptr, out_ptr, n, k, num_experts, group,
    stride_am, stride_pe, stride_pn, stride_se, stride_sn, stride_ze, stride_zn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
    FP8: tl.constexpr, ZERO: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (tile t, column tile): expert e's rows of its tile t - (tiles of the experts before e), times e's
    dequantized weight (FP8: its e4m3 values, then the channel scales); tiles past the last expert's return at once."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    es = tl.arange(0, E_PAD)
    e_ok = es < num_experts
    ends = tl.load(ends_ptr + es, mask=e_ok, other=0)
    starts = tl.load(ends_ptr + es - 1, mask=e_ok & (es > 0), other=0)
    tiles = tl.where(e_ok, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    e = tl.sum((tile_ends <= t).to(tl.int32), 0)  # the first expert whose tiles reach past t
    if e >= num_experts:
        return
    mine = es == e
    first_row = tl.sum(tl.where(mine, starts, 0), 0) + (t - tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.sum(tl.where(mine, ends, 0), 0)
    col_ok = cols < n
    dtype = a_ptr.dtype.element_ty
    e64 = e.to(tl.int64)
    p_e, s_e, z_e = p_ptr + e64 * stride_pe, s_ptr + e64 * stride_se, z_ptr + e64 * stride_ze
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        a = tl.load(a_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_ok[:, None], other=0.0)
        w = _weight_tile(p_e, s_e, z_e, cols, col_ok, k0, group, stride_pn, stride_sn, stride_zn, BLOCK_K, FP8, ZERO,
                         dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    acc = _scaled(acc, s_e, cols, col_ok, stride_sn, FP8)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


QuantStack = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # (weight, scale, zero) of every expert


@dataclass(frozen=True, slots=True)
class StackShape:
    """What the kernels need to know of a well-formed stack (``check_stack``): FP8's ``group`` is K (one scale a
    row)."""

    experts: int
    n: int
    group: int
    fp8: bool


def check_stack(stack: QuantStack, k: int, what: str) -> StackShape:
    """The shape of a well-formed INT4 or FP8 stack whose K is ``k``; a ValueError naming what is wrong else."""
    weight, scale, zero = stack
    if weight.dtype == torch.float8_e4m3fn:
        return _check_fp8_stack(weight, scale, zero, k, what)
    if weight.dtype != torch.int32 or weight.dim() != 3 or weight.shape[2] * 8 != k:
        raise ValueError(f"{what}: quantized experts are int32 [E, N, {k // 8}] (int4) or float8_e4m3fn [E, N, {k}] "
                         f"(fp8), got {weight.dtype} {list(weight.shape)}")
    e, n, _ = weight.shape
    if scale.dim() != 3 or scale.shape[:2] != (e, n) or k % scale.shape[2] or not scale.is_floating_point():
        raise ValueError(f"{what}: scales must be float [{e}, {n}, K // G], got {scale.dtype} {list(scale.shape)}")
    if zero is not None and (zero.shape != scale.shape or zero.dtype != torch.int8):
        raise ValueError(f"{what}: zero points must be int8 {list(scale.shape)}, got {zero.dtype} {list(zero.shape)}")
    if any(t.stride(-1) != 1 for t in (weight, scale) + ((zero,) if zero is not None else ())):
        raise ValueError(f"{what}: the experts' tensors need contiguous rows")
    return StackShape(e, n, k // scale.shape[2], False)


def _check_fp8_stack(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int,
                     what: str) -> StackShape:
    if weight.dim() != 3 or weight.shape[2] != k:
        raise ValueError(f"{what}: fp8 experts are float8_e4m3fn [E, N, {k}], got {list(weight.shape)}")
    e, n, _ = weight.shape
    if scale.shape != (e, n) or scale.dtype != torch.float32:
        raise ValueError(f"{what}: fp8 expert scales must be float32 [{e}, {n}] (one per output channel), got "
                         f"{scale.dtype} {list(scale.shape)}")
    if zero is not None:
        raise ValueError(f"{what}: fp8 experts take no zero points")
    if weight.stride(-1) != 1:
        raise ValueError(f"{what}: the experts' tensors need contiguous rows")
    return StackShape(e, n, k, True)


def _block_k(group: int, most: int) -> int:
    """A power-of-two K tile within one group (the largest dividing it, up to ``most``; FP8's group is K)."""
    block = min(most, group & -group)
    if block < 16:
        raise ValueError(f"quantized experts need a group size (fp8: input features) that is a multiple of 16, "
                         f"got {group}")
    return block


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _launch_gemm(x: torch.Tensor, gates: torch.Tensor | None, ids: torch.Tensor, stack: QuantStack,
                 top_k: int, tile: Tile) -> torch.Tensor:
    """float32 partials [splits, pairs, N] of the pairs' rows (gated tokens' inputs, or ``x``'s own rows) times
    their experts' weights: ``quant_moe_gemm_kernel``."""
    weight, scale, zero = stack
    num_pairs = ids.numel()
    shape = check_stack(stack, x.shape[1], "quant_moe_decode")
    n, k = shape.n, x.shape[1]
    block_m = max(16, triton.next_power_of_2(num_pairs))
    block_n, block_k = tile.block_n, _block_k(shape.group, tile.block_k)
    slots = min(shape.experts, num_pairs)
    col_tiles = triton.cdiv(n, block_n)
    splits = max(1, min(16, tile.split_programs // (slots * col_tiles), k // block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, num_pairs, n), dtype=torch.float32, device=x.device)
    z = zero if zero is not None else scale
    quant_moe_gemm_kernel[(slots, col_tiles, splits)](
        x, gates if gates is not None else x, ids, weight, scale, z, part,
        num_pairs, shape.experts, n, k_per_split, k, shape.group,
        x.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1), z.stride(0), z.stride(1),
        part.stride(0), part.stride(1),
        TOP_K=top_k, GATED=gates is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP8=shape.fp8, ZERO=zero is not None, E_PAD=triton.next_power_of_2(shape.experts), PRECISION=_precision(x),
        num_warps=tile.warps, num_stages=tile.stages,
    )
    return part


def quant_moe_decode(x: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, gate_up: QuantStack,
                     down: QuantStack, tile: Tile = DECODE_TILE) -> torch.Tensor:
    """The routed experts' output [T, H] for ``x`` [T, H], top-k ``gates`` (x's dtype) and expert ``ids`` (int64)
    [T, top_k]: each pair's expert MLP on its gated input, summed over the token's choices. ``gate_up`` [E, 2I, H]
    (gate rows first) and ``down`` [E, H, I] are INT4 or FP8 stacks (the module docstring; INT4 scales of any float
    dtype). At most ``MAX_PAIRS`` pairs; CUDA-graph capturable."""
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    if num_pairs > MAX_PAIRS:
        raise ValueError(f"quant_moe_decode takes at most {MAX_PAIRS} (token, choice) pairs, got {num_pairs}")
    hidden = x.shape[1]
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, gates = ids.reshape(-1), gates.reshape(-1)
    part = _launch_gemm(x, gates, ids, gate_up, top_k, tile)
    inter = part.shape[2] // 2
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    silu_splits_kernel[(num_pairs, triton.cdiv(inter, block))](
        part, h, inter, part.shape[0], part.stride(0), part.stride(1), h.stride(0), BLOCK=block)
    part = _launch_gemm(h, None, ids, down, top_k, tile)
    block = min(1024, triton.next_power_of_2(hidden))
    sum_choices_kernel[(tokens, triton.cdiv(hidden, block))](
        part, out, hidden, part.shape[0], part.stride(0), part.stride(1), out.stride(0), TOP_K=top_k, BLOCK=block)
    return out


def quant_grouped_gemm(a: torch.Tensor, ends: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       zero: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """``F.grouped_mm(a, W^T, offs=ends)`` over INT4 or FP8 experts without a bf16 copy of any: ``a`` [M, K] rows
    sorted by expert (expert e's rows ``ends[e - 1]:ends[e]``, int32 ``ends`` [E]), the stack ``weight`` (INT4
    [E, N, K // 8], FP8 [E, N, K]) with its ``scale`` and ``zero``; returns [M, N] in a's dtype. Float32
    accumulation. ``tile``: None, ``PREFILL_TILE`` (``FLOAT32_PREFILL_TILE`` for float32 rows)."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    rows, k = a.shape
    shape = check_stack((weight, scale, zero), k, "quant_grouped_gemm")
    experts, n = shape.experts, shape.n
    if ends.shape != (experts,) or ends.dtype != torch.int32:
        raise ValueError(f"quant_grouped_gemm: ends must be int32 [{experts}], got {ends.dtype} {list(ends.shape)}")
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if not rows:
        return out
    tile = tile or (FLOAT32_PREFILL_TILE if a.dtype == torch.float32 else PREFILL_TILE)
    block_m, block_n, block_k = tile.block_m, tile.block_n, _block_k(shape.group, tile.block_k)
    z = zero if zero is not None else scale
    grid = (triton.cdiv(rows, block_m) + experts, triton.cdiv(n, block_n))
    quant_grouped_gemm_kernel[grid](
        a, ends, weight, scale, z, out, n, k, experts, shape.group,
        a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1), z.stride(0), z.stride(1),
        out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, E_PAD=triton.next_power_of_2(experts),
        FP8=shape.fp8, ZERO=zero is not None, PRECISION=_precision(a), num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return out
