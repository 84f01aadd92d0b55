"""The Triton kernels behind ``quant_gemm.py``: the INT4 GEMM (W4A16) and FP8 activation quantization.

INT4 GEMM: program (tile of rows, tile of columns, K-split) reads its packed weights ``[K tile / 8, N tile]`` as
int32, spreads each word into its 8 nibbles (``[K tile / 8, 8, N tile]``, reshaped to the ``[K tile, N tile]``
tile in column order), turns the nibbles into floats without an integer conversion (``nibble | 0x4B000000`` is
the float32 2^23 + nibble, so subtracting 2^23 + 8 + zero leaves ``q - zero`` exactly), and multiplies on the
tensor cores in the activation dtype with a float32 accumulator. A K tile lies within one scale group, so the
group's scale multiplies either the tile's product (decode: a few rows, fewer multiplies than weights) or the
weights (prefill: each weight then equals ``dequantize_int4``'s, and the accumulator chains through the dots).

Decode-sized inputs (<= ``DECODE_ROWS`` rows) are bound by reading the weight, 0.5 byte a value: the columns are
split into tiles and K into as many splits as keep the grid within the tile's programs per SM (one wave); each
split stores a float32 partial, and the last program of a tile to finish (an arrival counter, left zero) sums the
splits in split order (the same bits every call), adds the bias and rounds: one launch, with programmatic
dependent launch (``launch.py``). E.g. 8192 x 8192 at batch 1 on 132 SMs, GEMV tiles of 64 columns, 8 programs an
SM: 128 column tiles x 8 splits of 1,024 = 1,024 programs reading 32 KB each.

INT4 GEMV (a few rows: ``int4_tile``): no tensor cores, whose dots would pad the rows to 16. A program reads its
words ``[columns, K tile / 8]`` 16 bytes a thread and leaves nibble i in place, at bits 4j of the word's low
(i < 4) or high half: ``(half & 0xF << 4j) | 0x4B000000`` is the float 2^23 + nibble * 16^j, and subtracting
2^23 + (8 + zero) * 16^j leaves (q - zero) * 16^j exactly; x times 16^-j (exact) undoes the 16^j in the product.
A weight then costs a LOP3, an FADD and an FFMA a row; the group scale multiplies each K tile's sum (or the
weights, for more rows). Each row of x has its own accumulator [columns, words], summed across the words once at
the end.

FP8 quantization: one program per row finds the row's absolute max, stores its scale and the e4m3 row (the row
is read twice; the second read hits L2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridkv.kernels.launch import pdl, pdl_start


# rows up to which a call takes the decode tiles (the weight read once, split along N and K)
DECODE_ROWS = 64
# rows the GEMV takes at most: an accumulator a row, in registers
GEMV_ROWS = 16
# float32 2^23 + 8: subtracted from (nibble | 0x4B000000) it leaves nibble - 8 = q
MAGIC = tl.constexpr(8388616.0)
# float32 2^23: (nibble << 4j) | 0x4B000000 is 2^23 + nibble * 16^j
MAGIC_23 = tl.constexpr(8388608.0)
# its bits, passed to the GEMV as an argument: a register operand, so each nibble's mask is the instruction's
# immediate (two constants would cost a move a weight)
MAGIC_BITS = 0x4B000000


@dataclass(frozen=True, slots=True)
class Int4Tile:
    """One launch's shape: rows x columns x K per program, programs per SM wanted (K is split until the grid has
    that many), warps, pipeline stages, whether the group scale multiplies the weights (else the product), whether
    each nibble gets its own dot (``NIBBLE_DOTS`` in the kernel; K tiles of 128 or more only), and whether the
    program is ``int4_gemv_kernel`` (no dots: every row of x in one program, ``block_m`` unused; up to
    ``GEMV_ROWS`` rows). A GEMV tile of as many columns as threads (32 a warp) or more reads its scales in the
    words' shape (``WIDE_TILE``): a [columns, 1] load would be laid out on its own, and the sums moved through
    shared memory into it every K tile."""

    block_m: int
    block_n: int
    block_k: int
    per_sm: int
    warps: int
    stages: int
    scale_weights: bool
    nibble_dots: bool = False
    gemv: bool = False


def int4_tile(rows: int) -> Int4Tile:
    """The default tile for ``rows`` rows (``benchmarks/gpu/quant_gemm.py --sweep`` times the candidates).

    Up to 4 rows the GEMV: tensor-core dots pad the rows to 16, and their operand's layout costs more than the
    FMAs. Up to 16 a dot per nibble, then the reshaped tile (an H100's sweep: 3-6x faster than per-nibble dots at
    32 and 64 rows)."""
    if rows <= 4:
        return Int4Tile(1, 64, 128, 8, 4, 1, False, gemv=True)
    if rows <= 16:
        return Int4Tile(16, 128, 128, 2, 8, 3, False, True)
    if rows <= DECODE_ROWS:
        return Int4Tile(triton.next_power_of_2(rows), 64, 128, 4, 4, 4, False)
    if rows <= 256:
        return Int4Tile(64, 128, 64, 1, 4, 4, True)
    return Int4Tile(128, 128, 64, 1, 8, 3, True)


@triton.jit
def int4_gemm_kernel(
    x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, arrived_ptr, rows, n, k, k_per_split, group,
    stride_xm, stride_pn, stride_sn, stride_zn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, ZERO: tl.constexpr, BIAS: tl.constexpr, SCALE_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr, NIBBLE_DOTS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if PDL:
        pdl_start()
    # tiles in groups of GROUP_M row tiles per column tile: those programs share the column tile's weights in L2
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    n_tiles = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    ms = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < rows
    ns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < n
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k)
    words = p_ptr + ns[None, :].to(tl.int64) * stride_pn
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        js = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        # every tile whole (EVEN_K): no mask along K, so the loads take 16 bytes a thread
        k_ok = (js < k_hi // 8) | EVEN_K
        p = tl.load(words + js[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        g = k0 // group  # the tile lies in one group (the launcher's BLOCK_K divides the group, or one group)
        s = tl.load(s_ptr + ns * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        if ZERO:
            offset = MAGIC + tl.load(z_ptr + ns * stride_zn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            offset = tl.full((BLOCK_N,), MAGIC, tl.float32)
        # (p | 0x4B000000) - offset is q - zero, exactly; a masked word gives -8 - zero, met by zeros of x
        if NIBBLE_DOTS:
            # a dot per nibble i, over columns 8 j + i: the nibbles are taken apart in the dot operand's registers
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + ms[:, None] * stride_xm + (8 * js + i)[None, :],
                             mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wi = (((p >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - offset[None, :]
                part = tl.dot(xi, wi.to(x_ptr.dtype.element_ty), part, input_precision=PRECISION)
            acc += part * s[None, :]
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :],
                        mask=m_ok[:, None] & ((ks < k_hi) | EVEN_K)[None, :], other=0.0)
            nib = tl.reshape((p[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            w = (nib | 0x4B000000).to(tl.float32, bitcast=True) - offset[None, :]
            if SCALE_WEIGHTS:
                acc = tl.dot(x, (w * s[None, :]).to(x_ptr.dtype.element_ty), acc, input_precision=PRECISION)
            else:
                acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=PRECISION) * s[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:  # the last split of the tile to finish sums them all
        parts = part_ptr + ms[:, None] * n + ns[None, :]
        tl.store(parts + split * rows * n, acc, mask=ok)
        # release our partial, acquire the others' (acq_rel): the last to arrive sees every split's stores
        if tl.atomic_add(arrived_ptr + pid, 1) != tl.num_programs(1) - 1:
            return
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for other in range(tl.num_programs(1)):  # in split order: the same bits every call
            acc += tl.load(parts + other * rows * n, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(arrived_ptr + pid, 0)
    if BIAS:
        acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + ms[:, None] * stride_om + ns[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def int4_gemv_kernel(
    x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, arrived_ptr, rows, n, k, tiles_per_split, magic,
    stride_xm, stride_pn, stride_sn, stride_zn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_TILES: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, ZERO: tl.constexpr, BIAS: tl.constexpr, SCALE_WEIGHTS: tl.constexpr, STAGES: tl.constexpr,
    X_WIDE: tl.constexpr = False, X_DTYPE: tl.constexpr = tl.bfloat16, WIDE_TILE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # program (column tile, K-split); a tuple of ROWS accumulators [BLOCK_N, WORDS], one a row of x: element (c, j)
    # sums the row's products with word j (of each K tile) of column c. Every tensor keeps the weights' layout
    # (16-byte loads along the words): nothing moves through shared memory
    if PDL:
        pdl_start()
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    WORDS: tl.constexpr = BLOCK_K // 8
    ns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < n
    # the split's words, whole K tiles: a multiple of WORDS, so the loads take 16 bytes a thread
    j_lo = split * tiles_per_split * WORDS
    j_hi = tl.minimum(j_lo + tiles_per_split * WORDS, k // 8)
    words = p_ptr + ns[:, None].to(tl.int64) * stride_pn
    acc = (tl.zeros((BLOCK_N, WORDS), dtype=tl.float32),) * ROWS
    for t in tl.range(0, tl.cdiv(j_hi - j_lo, WORDS), num_stages=STAGES):
        js = j_lo + t * WORDS + tl.arange(0, WORDS)
        k_ok = (js < j_hi) | EVEN_K
        p = tl.load(words + js[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        hi = p >> 16  # nibbles 4..7 in bits 0..15
        g = (split * tiles_per_split + t) // GROUP_TILES  # the tile lies in one group (of GROUP_TILES tiles)
        # [BLOCK_N, 1] loads: in the weights' layout (a [BLOCK_N] one would take another, then a conversion); from
        # BLOCK_N = threads on Triton lays those out on their own too, so they are read as the words' shape
        s_at = s_ptr + ns[:, None] * stride_sn + g
        z_at = z_ptr + ns[:, None] * stride_zn + g
        if WIDE_TILE:
            s_at = tl.broadcast_to(s_at, (BLOCK_N, WORDS))
            z_at = tl.broadcast_to(z_at, (BLOCK_N, WORDS))
        s = tl.load(s_at, mask=n_ok[:, None], other=0.0).to(tl.float32)
        if ZERO:
            z = tl.load(z_at, mask=n_ok[:, None], other=0).to(tl.float32)
        else:
            z = 0.0
        part = (tl.zeros((BLOCK_N, WORDS), dtype=tl.float32),) * ROWS
        x_lo, x_hi = (), ()
        if X_WIDE:  # x[8 j + 4 b .. + 3] of a row in one 8-byte load: 2 loads a word of weights, not 8
            for m in tl.static_range(ROWS):
                x_lo += (tl.load(x_ptr + m * stride_xm + 2 * js, mask=k_ok, other=0),)
                x_hi += (tl.load(x_ptr + m * stride_xm + 2 * js + 1, mask=k_ok, other=0),)
        for i in tl.static_range(8):
            # nibble i of a word left in place, at bits 4 j of its half: (half & mask) | 0x4B000000 is the float
            # 2^23 + nibble * 16^j, so subtracting 2^23 + (8 + zero) * 16^j leaves (q - zero) * 16^j exactly, and
            # x * 16^-j (exact) makes the product (q - zero) * x: no shift a nibble
            j = i % 4
            half = p if i < 4 else hi
            w = ((half & (0xF << (4 * j))) | magic).to(tl.float32, bitcast=True)
            w -= MAGIC_23 + (8.0 + z) * (1 << (4 * j))
            if SCALE_WEIGHTS:  # one multiply a weight, not one a row and word
                w *= s
            new = ()
            for m in tl.static_range(ROWS):
                if X_WIDE:
                    xq = x_lo[m] if i < 4 else x_hi[m]
                    xi = ((xq >> (16 * j)) & 0xFFFF).to(tl.int16).to(X_DTYPE, bitcast=True)
                else:
                    xi = tl.load(x_ptr + m * stride_xm + 8 * js + i, mask=k_ok, other=0.0)
                new += (part[m] + w * (xi.to(tl.float32) * (1.0 / (1 << (4 * j))))[None, :],)
            part = new
        new = ()
        for m in tl.static_range(ROWS):
            new += (part[m] + acc[m] if SCALE_WEIGHTS else acc[m] + part[m] * s,)
        acc = new
    outs = ()
    for m in tl.static_range(ROWS):
        outs += (tl.sum(acc[m], axis=1),)
    if SPLIT:  # the last split of the column tile to finish sums them all
        for m in tl.static_range(ROWS):
            tl.store(part_ptr + (split * rows + m) * n + ns, outs[m], mask=n_ok)
        # release our partials, acquire the others' (acq_rel): the last to arrive sees every split's stores
        if tl.atomic_add(arrived_ptr + tile_n, 1) != tl.num_programs(1) - 1:
            return
        sums = ()
        for m in tl.static_range(ROWS):
            out = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for other in range(tl.num_programs(1)):  # in split order: the same bits every call
                out += tl.load(part_ptr + (other * rows + m) * n + ns, mask=n_ok, other=0.0, cache_modifier=".cg")
            sums += (out,)
        outs = sums
        tl.store(arrived_ptr + tile_n, 0)
    for m in tl.static_range(ROWS):
        out = outs[m]
        if BIAS:
            out += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + ns, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def int4_gemm_counters(n: int, device: torch.device) -> torch.Tensor:
    """The arrival counters ``launch_int4_gemm`` needs for an output of ``n`` columns (zeros, left zero after each
    call): one a tile of a decode-sized call (<= DECODE_ROWS rows, tiles of 16 rows and 16 columns or more)."""
    return torch.zeros(triton.cdiv(DECODE_ROWS, 16) * triton.cdiv(n, 16), dtype=torch.int32, device=device)


def launch_int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     group: int, bias: torch.Tensor | None, arrived: torch.Tensor | None = None,
                     tile: Int4Tile | None = None) -> torch.Tensor:
    """``quant_gemm.int4_gemm`` on checked inputs: x [M, K] with contiguous rows, ``group`` columns a scale,
    ``arrived`` from ``int4_gemm_counters(N)`` (None: made for this call). K is split only while every tile has a
    counter: a split's program stores its float32 partial, and the tile's last to finish sums them."""
    rows, k = x.shape
    n = packed.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    t = tile or int4_tile(rows)
    block_k = t.block_k if group == k else min(t.block_k, group & -group)  # a K tile within one group
    if block_k < 16:
        raise ValueError(f"int4_gemm needs a group size that is a multiple of 16 (or one group a row), got {group}")
    if t.gemv and rows > GEMV_ROWS:
        raise ValueError(f"the int4 GEMV tile takes up to {GEMV_ROWS} rows (one accumulator a row), got {rows}")
    tiles = triton.cdiv(n, t.block_n) * (1 if t.gemv else triton.cdiv(rows, t.block_m))
    if arrived is None:
        arrived = int4_gemm_counters(n, x.device)
    # (an H200's count where there is no GPU: Triton's CPU interpreter)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    # at most per_sm programs an SM: one more than fit there would run as a second, nearly empty wave
    splits = max(1, min(t.per_sm * sms // tiles, triton.cdiv(k, block_k), 32))
    if tiles > arrived.numel():  # (a prefill's many tiles fill the GPU unsplit)
        splits = 1
    k_tiles = triton.cdiv(triton.cdiv(k, splits), block_k)  # K tiles a split
    splits = triton.cdiv(k, k_tiles * block_k)
    part = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    on = pdl(x)
    # bf16/fp16 x read 4 values an 8-byte load (the GEMV reads it in the weights' layout, a value per nibble)
    wide = (t.gemv and x.dtype != torch.float32 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0)
    xs = x.view(torch.int64) if wide else x
    args = (xs, packed, scale, zero if zero is not None else scale, bias if bias is not None else scale, out, part,
            arrived)
    strides = (xs.stride(0), packed.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0,
               out.stride(0))
    if t.gemv:
        int4_gemv_kernel[(tiles, splits)](
            *args, rows, n, k, k_tiles, MAGIC_BITS, *strides, ROWS=rows, BLOCK_N=t.block_n, BLOCK_K=block_k,
            GROUP_TILES=triton.cdiv(group, block_k), SPLIT=splits > 1, EVEN_K=k % block_k == 0, ZERO=zero is not None,
            BIAS=bias is not None, SCALE_WEIGHTS=t.scale_weights, STAGES=t.stages, X_WIDE=wide,
            WIDE_TILE=t.block_n >= 32 * t.warps,
            X_DTYPE=tl.float16 if x.dtype == torch.float16 else tl.bfloat16, PDL=on, num_warps=t.warps,
            launch_pdl=on,
        )
    else:
        int4_gemm_kernel[(tiles, splits)](
            *args, rows, n, k, k_tiles * block_k, group, *strides,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT=splits > 1,
            EVEN_K=k % block_k == 0, ZERO=zero is not None, BIAS=bias is not None, SCALE_WEIGHTS=t.scale_weights,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", NIBBLE_DOTS=t.nibble_dots and block_k >= 128,
            PDL=on, num_warps=t.warps, num_stages=t.stages, launch_pdl=on,
        )
    return out


@triton.jit
def fp8_quantize_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, k, stride_xm, stride_qm, BLOCK: tl.constexpr,
                        STATIC: tl.constexpr, ONE_TILE: tl.constexpr, E4M3_MAX: tl.constexpr,
                        E4M3_INV_MAX: tl.constexpr, E4M3_MIN_SCALE: tl.constexpr):
    """Row ``program_id``: scale = max(absmax * INV_MAX, MIN_SCALE) (or the static scale), q = e4m3(x / scale)
    saturated at +-MAX, the division rounded to nearest as torch's: the same bits as the torch reference.
    (The constants are quant_gemm's FP8_*.)"""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    cols = tl.arange(0, BLOCK)
    if ONE_TILE:
        x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        if ONE_TILE:
            amax = tl.max(tl.abs(x), axis=0)
        else:
            amax = 0.0
            for k0 in range(0, k, BLOCK):
                xt = tl.load(x_row + k0 + cols, mask=k0 + cols < k, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=0))
        s = tl.maximum(amax * E4M3_INV_MAX, E4M3_MIN_SCALE)
    tl.store(scale_ptr + row, s)
    if ONE_TILE:
        q = tl.clamp(tl.div_rn(x, s), -E4M3_MAX, E4M3_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < k)
    else:
        for k0 in range(0, k, BLOCK):
            xt = tl.load(x_row + k0 + cols, mask=k0 + cols < k, other=0.0).to(tl.float32)
            q = tl.clamp(tl.div_rn(xt, s), -E4M3_MAX, E4M3_MAX)
            tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < k)


def launch_fp8_quantize(x: torch.Tensor, input_scale: torch.Tensor | None, limits: tuple[float, float, float]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_gemm.quantize_fp8_per_token`` on checked inputs; ``limits``: (FP8_MAX, FP8_INV_MAX, FP8_MIN_SCALE)."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), 8192)  # a row of up to 8,192 values stays in registers
    fp8_quantize_kernel[(rows,)](
        x, q, scale, input_scale if input_scale is not None else scale, k, x.stride(0), q.stride(0),
        BLOCK=block, STATIC=input_scale is not None, ONE_TILE=k <= block, E4M3_MAX=limits[0], E4M3_INV_MAX=limits[1],
        E4M3_MIN_SCALE=limits[2], num_warps=8 if block >= 4096 else 4,
    )
    return q, scale
