"""Triton kernels over the paged hybrid KV cache: KV write (optionally FP8), and one attention kernel for prefill
and decode, varlen, with the KV length split across programs (flash-decoding) when few queries must fill the GPU.

Each program owns a tile of queries of one sequence and one KV head; the query heads sharing that KV head are
stacked into the tile's rows (Scout: 5 query heads per KV head -> 12 tokens x 5 heads in 64 rows), so prefill
wastes few rows and decode still feeds tensor cores.
Keys are visited only inside the layer type's reach: a chunked layer's tile starting at query position p reads
keys from ``(p // C) * C``, a sliding one from ``p - W + 1`` — work grows with n·C, not n².

The cache of one layer is addressed as ``base + block * stride_block + token_in_block * stride_tok
+ head * head_dim (+ v_offset for V)``, matching ``hybridkv.kv.layout``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.kernels.launch import pdl_start
from hybridkv.kv.specs import KERNEL_CHUNKED as CHUNKED, KERNEL_FULL as FULL, KERNEL_SLIDING as SLIDING  # noqa: F401


@triton.jit
def kv_write_kernel(
    k_ptr, v_ptr, cache_ptr, slot_block_ptr, slot_offset_ptr, k_scale, v_scale, n, stride_block, v_offset,
    HD: tl.constexpr, HD_PAD: tl.constexpr, TOKENS: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = False,
):
    """TOKENS new tokens a program: each token's K and V rows (its KV heads' H * D values, contiguous in the
    inputs and in a slot) go to its slot. One token a program wrote at 60% of copy speed (84 against 51 us for
    131,072 Scout tokens on an H100); 4,096 values a program write at copy speed."""
    if PDL:
        pdl_start()
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_ok = t < n
    t = t.to(tl.int64)
    block = tl.load(slot_block_ptr + t, mask=t_ok, other=0).to(tl.int64)
    offset = tl.load(slot_offset_ptr + t, mask=t_ok, other=0).to(tl.int64)
    j = tl.arange(0, HD_PAD)[None, :]
    ok = t_ok[:, None] & (j < HD)
    src = t[:, None] * HD + j
    dst = cache_ptr + block[:, None] * stride_block + offset[:, None] * HD + j
    k = tl.load(k_ptr + src, mask=ok)
    v = tl.load(v_ptr + src, mask=ok)
    if QUANT:
        # e4m3 saturates at 448; beyond it a cast would give NaN
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def v_transpose_kernel(
    cache_ptr, blocks_ptr, columns_ptr, vt_ptr, n_cols, stride_block, v_offset,
    HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, COLS: tl.constexpr,
):
    """FP8 compute: V^T of a segment's pages, COLS columns a program. Column c of ``vt`` [HD, n_cols] holds the V
    row (all KV heads) of offset ``columns[c % BLOCK_SIZE]`` in page ``blocks[c // BLOCK_SIZE]``. E.g. 4-token
    pages, blocks [7, 3], columns [0, 2, 1, 3]: vt's columns are page 7's offsets 0, 2, 1, 3, then page 3's.
    One pass, gather and transpose together (torch's index and permute took 4 ms for 1M keys, 8% of a step)."""
    c = tl.program_id(0) * COLS + tl.arange(0, COLS)
    c_ok = c < n_cols
    block = tl.load(blocks_ptr + c // BLOCK_SIZE, mask=c_ok, other=0).to(tl.int64)
    row = tl.load(columns_ptr + c % BLOCK_SIZE, mask=c_ok, other=0).to(tl.int64)
    j = tl.arange(0, HD_PAD)[:, None]
    ok = (j < HD) & c_ok[None, :]
    src = cache_ptr + v_offset + block[None, :] * stride_block + row[None, :] * HD + j
    tl.store(vt_ptr + j * n_cols + c[None, :], tl.load(src, mask=ok), mask=ok)


@triton.jit
def _visible(k_ok, k_pos, q_pos, KIND: tl.constexpr, REACH: tl.constexpr):
    """[queries, keys]: which keys of an edge tile each query sees (causal, and its window or chunk)."""
    seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if KIND == 1:
        seen = seen & (k_pos[None, :] > q_pos[:, None] - REACH)
    elif KIND == 2:
        seen = seen & ((k_pos[None, :] // REACH) == (q_pos[:, None] // REACH))
    return seen


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, n, lo, end, cache_ptr, kv_desc, table, d, kv_head,
    stride_block, stride_tok, v_offset, qk_scale, rows_per_block, vt_ptr, vt_desc, vt_table, stride_vt,
    KIND: tl.constexpr, REACH: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr,
    TMA: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """One BLOCK_N tile of keys into the online softmax (base-2: ``qk_scale`` holds log2(e)).

    FP8_DOT: ``q`` is e4m3 and ``qk_scale`` one factor per row (its quantization scale folded in); K comes from
    the cache's e4m3 pages as they are, V^T from the step's transposed e4m3 copy (``vt_*``), and both dots are
    FP8 tensor-core dots accumulating in float32."""
    k_pos = n + tl.arange(0, BLOCK_N)
    if MASKED:
        k_ok = (k_pos < end) & (k_pos >= lo)
    if TMA:
        # Hopper: the tile is one page's rows [n % BLOCK_SIZE, + BLOCK_N), one TMA copy each for K and V
        row = tl.load(table + n // BLOCK_SIZE) * rows_per_block + n % BLOCK_SIZE
        k_raw = kv_desc.load([row, kv_head * D])
        if not FP8_DOT:
            v_raw = kv_desc.load([row + BLOCK_SIZE, kv_head * D])
        if MASKED and not FP8_DOT:
            # rows outside [lo, end) are whatever the page holds (NaN too): P is 0 there, but 0 * NaN is not
            v_raw = tl.where(k_ok[:, None], v_raw, tl.zeros_like(v_raw))
    elif BLOCK_SIZE >= BLOCK_N:
        # tiles start on BLOCK_N boundaries, so a tile lies inside one page: one table entry, contiguous rows
        block = tl.load(table + n // BLOCK_SIZE).to(tl.int64)
        kv_row = block * stride_block + (n % BLOCK_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_tok
    elif MASKED:
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_row = block * stride_block + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_tok
    else:
        block = tl.load(table + k_pos // BLOCK_SIZE).to(tl.int64)
        kv_row = block * stride_block + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_tok
    if not TMA:
        kv_row += kv_head * D
        ptrs = cache_ptr + kv_row[:, None] + d[None, :]
        d_ok = d[None, :] < D
        if MASKED:
            k_raw = tl.load(ptrs, mask=k_ok[:, None] & d_ok, other=0.0)
            if not FP8_DOT:
                v_raw = tl.load(ptrs + v_offset, mask=k_ok[:, None] & d_ok, other=0.0)
        else:
            k_raw = tl.load(ptrs, mask=d_ok, other=0.0)
            if not FP8_DOT:
                v_raw = tl.load(ptrs + v_offset, mask=d_ok, other=0.0)
    if FP8_DOT:
        acc, m_new, l_i = _attend_tile_fp8(acc, m_i, l_i, q, q_pos, n, lo, end, k_raw, vt_ptr, vt_desc, vt_table,
                                           stride_vt, d, kv_head, qk_scale, KIND, REACH, BLOCK_SIZE, D, BLOCK_N,
                                           MASKED, TMA)
    else:
        if QUANT:
            # e4m3 values are exact in float32, bf16 and fp16, so no scale is applied per value: k_scale sits in
            # qk_scale, v_scale in the final normalisation. Through float32 is faster than Triton's direct
            # e4m3 -> bf16 (16K queries over 1M FP8 keys on an H200: 122 ms vs 147).
            k = k_raw.to(tl.float32).to(q.dtype)
            v = v_raw.to(tl.float32).to(q.dtype)
        else:
            k = k_raw.to(q.dtype)
            v = v_raw.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            s = tl.where(_visible(k_ok, k_pos, q_pos, KIND, REACH), qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # interior tiles are most of a long prefill. qk_scale > 0, so the max of the scaled scores is the
            # scaled max, and scaling and subtracting the max is one FMA.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # accumulate inside the tensor-core dot instead of adding its result in a separate pass
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tile_fp8(
    acc, m_i, l_i, q, q_pos, n, lo, end, k, vt_ptr, vt_desc, vt_table, stride_vt, d, kv_head, qk_scale,
    KIND: tl.constexpr, REACH: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, TMA: tl.constexpr,
):
    """The FP8-compute tile: e4m3 Q.K^T and P.V with float32 accumulation.

    Hopper's FP8 wgmma takes its B operand K-major only: K as stored ([keys, D], D contiguous) is, V is not, so V
    is read from a transposed copy ``[heads * D, columns]`` whose columns are the step's key slots (page
    ``vt_table[n // BLOCK_SIZE]``, offset ``n % BLOCK_SIZE``). P is scaled by 2^8 before its e4m3 rounding (the
    sum ``l_i`` carries the same factor, so it cancels): weights down to 2^-17 survive instead of flushing to zero
    below e4m3's 2^-9."""
    k_pos = n + tl.arange(0, BLOCK_N)
    if MASKED:
        k_ok = (k_pos < end) & (k_pos >= lo)
    if TMA:
        col = tl.load(vt_table + n // BLOCK_SIZE) * BLOCK_SIZE + n % BLOCK_SIZE
        vt = vt_desc.load([kv_head * D, col])
        if MASKED:
            # columns outside [lo, end) hold whatever the page held (NaN too): P is 0 there, but 0 * NaN is not
            vt = tl.where(k_ok[None, :], vt, tl.zeros_like(vt))
    else:
        if BLOCK_SIZE >= BLOCK_N:
            col = (tl.load(vt_table + n // BLOCK_SIZE).to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
                   + tl.arange(0, BLOCK_N))
        elif MASKED:
            col = (tl.load(vt_table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64) * BLOCK_SIZE
                   + k_pos % BLOCK_SIZE)
        else:
            col = tl.load(vt_table + k_pos // BLOCK_SIZE).to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        vt_ptrs = vt_ptr + (kv_head * D + d).to(tl.int64)[:, None] * stride_vt + col[None, :]
        if MASKED:
            vt = tl.load(vt_ptrs, mask=(d[:, None] < D) & k_ok[None, :], other=0.0)
        else:
            vt = tl.load(vt_ptrs, mask=d[:, None] < D, other=0.0)
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(_visible(k_ok, k_pos, q_pos, KIND, REACH), qk * qk_scale[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - (m_new[:, None] - 8.0))
    else:
        m_new = tl.maximum(m_i, tl.max(qk * qk_scale[:, None], 1))
        p = tl.exp2(qk * qk_scale[:, None] - (m_new[:, None] - 8.0))
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _type_lo(pos, KIND: tl.constexpr, REACH: tl.constexpr):
    """First key position a query at ``pos`` can see."""
    if KIND == 1:
        return tl.maximum(pos - REACH + 1, 0)
    elif KIND == 2:
        return (pos // REACH) * REACH
    else:
        return pos * 0


@triton.jit
def paged_attention_kernel(
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr, cache_ptr, kv_desc, table_ptr, vt_ptr, vt_desc, vt_table_ptr,
    tile_seq_ptr, tile_q0_ptr, q_loc_ptr, q_len_ptr, ctx_len_ptr,
    scale, k_scale, v_scale, seg_lo, seg_hi, rows_per_block,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_block, stride_tok, v_offset,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_vt,
    KIND: tl.constexpr, REACH: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, ROWS: tl.constexpr, TOKENS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, QUANT: tl.constexpr, FP16_DOT: tl.constexpr,
    SEGMENTED: tl.constexpr, ACCUMULATE: tl.constexpr,
    TMA: tl.constexpr = False, FP8_DOT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Attention of one query tile over the keys it may see inside ``[seg_lo, seg_hi)``.

    Unsegmented calls pass the whole key range. A segmented call (SEGMENTED) reads one segment of it, always writes
    partial outputs and their LSE, and with ACCUMULATE merges them into what earlier segments left in the same
    split slots; ``seg_lo`` is then a multiple of BLOCK_N.

    TMA (Hopper, pages holding whole key tiles): K and V tiles arrive by TMA through ``kv_desc``, a 2-D tensor
    descriptor over the layer's token rows (``[rows, kv_heads * D]``; a page is ``rows_per_block`` rows, its V
    ``BLOCK_SIZE`` rows after its K).

    FP8_DOT (an e4m3 cache, prefill): each query row is quantized to e4m3 with its own scale (its max |q| maps to
    448), folded with the softmax scale and ``k_scale`` into a per-row score factor; K is read from the e4m3
    pages, V from the transposed e4m3 copy ``vt_ptr`` / ``vt_desc`` (``[kv_heads * D, columns]``, its block table
    ``vt_table_ptr``).

    PDL (decode): the step's metadata is read before the wait (no kernel writes it), q and the cache after."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_loc = tl.load(q_loc_ptr + seq)
    q_len = tl.load(q_len_ptr + seq)
    ctx = tl.load(ctx_len_ptr + seq)

    # row r holds query token q0 + r // GROUP, head r % GROUP of this KV head: TOKENS * GROUP <= ROWS rows used
    rows = tl.arange(0, ROWS)
    tok = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (tok < q_len) & (rows < TOKENS * GROUP)
    q_pos = ctx + tok
    # head dims below 16 or not a power of two are padded with zeros (tensor-core dots need K >= 16)
    d = tl.arange(0, D_PAD)
    d_ok = d < D

    # keys this tile can see: [lo, hi). Tiles start on BLOCK_N boundaries, but nothing below lo is read:
    # those blocks may be dropped (null) or reused by another request.
    first = ctx + q0
    last = ctx + tl.minimum(q0 + TOKENS, q_len) - 1
    hi = tl.minimum(last + 1, seg_hi)
    lo = tl.maximum(_type_lo(first, KIND, REACH), seg_lo)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(hi - lo_tile, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = lo_tile + split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, hi)
    # interior tiles: every query of the tile sees every key of the tile, so no mask is computed
    inner_lo = tl.minimum(tl.maximum(tl.cdiv(_type_lo(last, KIND, REACH), BLOCK_N) * BLOCK_N, start), end)
    inner_hi = tl.maximum(tl.minimum(start + ((first + 1 - start) // BLOCK_N) * BLOCK_N, end), inner_lo)
    if PDL:
        pdl_start()
    q = tl.load(q_ptr + (q_loc + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP16_DOT:
        # decode over an FP8 cache: the dots run in fp16 (1M keys on an H200: 131 us vs 145 in bf16). fp16 holds
        # every e4m3 value and every bf16 query exactly, up to its range (clamped beyond); P is finer than in bf16.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    vt_table = vt_table_ptr + seq.to(tl.int64) * stride_table
    qk_scale = scale * k_scale * 1.4426950408889634
    if FP8_DOT:
        q_max = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30)
        q = (q.to(tl.float32) * (448.0 / q_max)[:, None]).to(tl.float8e4nv)
        qk_scale = qk_scale * (q_max / 448.0)
    for n in range(start, inner_lo, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n, lo, end, cache_ptr, kv_desc, table, d, kv_head,
                                     stride_block, stride_tok, v_offset, qk_scale, rows_per_block,
                                     vt_ptr, vt_desc, vt_table, stride_vt,
                                     KIND, REACH, BLOCK_SIZE, D, BLOCK_N, PRECISION, True, QUANT, TMA, FP8_DOT)
    for n in range(inner_lo, inner_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n, lo, end, cache_ptr, kv_desc, table, d, kv_head,
                                     stride_block, stride_tok, v_offset, qk_scale, rows_per_block,
                                     vt_ptr, vt_desc, vt_table, stride_vt,
                                     KIND, REACH, BLOCK_SIZE, D, BLOCK_N, PRECISION, False, QUANT, TMA, FP8_DOT)
    for n in range(inner_hi, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n, lo, end, cache_ptr, kv_desc, table, d, kv_head,
                                     stride_block, stride_tok, v_offset, qk_scale, rows_per_block,
                                     vt_ptr, vt_desc, vt_table, stride_vt,
                                     KIND, REACH, BLOCK_SIZE, D, BLOCK_N, PRECISION, True, QUANT, TMA, FP8_DOT)

    if FP8_DOT:
        m_i = m_i - 8.0  # P was scaled by 2^8 (see _attend_tile_fp8): the LSE below is of the unscaled weights
    t_idx = (q_loc + tok).to(tl.int64)
    out = acc / tl.maximum(l_i, 1e-30)[:, None] * v_scale
    if NUM_SPLITS == 1 and not SEGMENTED:
        tl.store(out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # natural-log LSE of this split; -inf where it saw no key
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, float("-inf"))
        row_base = split * stride_ps + t_idx * stride_pt + head * stride_ph
        out_ptrs = part_out_ptr + row_base[:, None] + d[None, :]
        lse_ptrs = part_lse_ptr + split * stride_ls + t_idx * stride_lt + head
        if ACCUMULATE:
            prev_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
            # a slot whose earlier segments saw no key holds no partial (stored only with a finite LSE, below)
            seen = row_ok & (prev_lse > float("-inf"))
            prev = tl.load(out_ptrs, mask=seen[:, None] & d_ok[None, :], other=0.0)
            m = tl.maximum(prev_lse, lse)
            m = tl.where(m > float("-inf"), m, 0.0)
            w_prev = tl.exp(prev_lse - m)
            w_new = tl.exp(lse - m)
            total = w_prev + w_new
            out = (prev * w_prev[:, None] + out * w_new[:, None]) / tl.maximum(total, 1e-30)[:, None]
            lse = tl.where(total > 0, m + tl.log(tl.maximum(total, 1e-30)), float("-inf"))
        # a row that saw no key (a split past the reach: at 16K, half of a graph's 256) writes only its -inf
        # LSE, and the combine does not read its partial
        tl.store(out_ptrs, out, mask=(row_ok & (lse > float("-inf")))[:, None] & d_ok[None, :])
        tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr, D_SLICE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (token, query head, slice of the head dim): softmax-weighted sum of the splits' partial
    outputs, CHUNK splits at a time. Slicing the head dim spreads a long decode's few rows over more programs.

    A split whose LSE is -inf saw no key and left its partial unwritten: it is not read."""
    if PDL:
        pdl_start()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * D_SLICE + tl.arange(0, D_SLICE)
    d_ok = d < D
    lse_ptr = part_lse_ptr + t * stride_lt + h
    m = tl.max(tl.load(lse_ptr + tl.arange(0, NUM_SPLITS) * stride_ls), 0)
    acc = tl.zeros([D_SLICE], tl.float32)
    total = 0.0
    for c in range(0, NUM_SPLITS, CHUNK):
        s = c + tl.arange(0, CHUNK)
        lse = tl.load(lse_ptr + s * stride_ls)
        live = lse > float("-inf")
        w = tl.where(live, tl.exp(lse - m), 0.0)
        parts = tl.load(part_out_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                        mask=live[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(parts * w[:, None], 0)
        total += tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty), mask=d_ok)
