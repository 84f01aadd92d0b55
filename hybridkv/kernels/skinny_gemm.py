"""``x @ W^T (+ b)`` for decode-sized inputs (a few rows): the weight read once, split along K over enough programs.

At decode a projection reads a weight of megabytes for one to a few token rows. cuBLAS runs such shapes as a split-K
GEMM and a separate reduce (a Scout rank's q/k/v: 896 x 5120, 7.2 us for 9.2 MB in a CUDA graph on an H200,
1.3 TB/s), and neither of its kernels takes part in programmatic dependent launch, so the Triton kernels around them
wait for a full drain.

Here program (column tile n, K-split s) multiplies the rows by ``W[n tile, s's K range]`` and stores a float32
partial; the last program of a column tile to finish (an arrival counter, reset after use) sums the splits in
split order, adds the bias, rounds to the output's dtype and stores. The sum's order is fixed: every run gives the
same bits.

E.g. q/k/v of a Scout rank at batch 1 on an H200's 132 SMs, 32-column tiles: 28 tiles x 14 splits of 384 = 392
programs of 24 KB each; the fourteenth program of each tile to finish writes its 32 outputs (7.2 -> 4.9 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.launch import pdl, pdl_start

# rows one launch takes: the M of the tensor-core dot (a decode batch up to this size)
MAX_ROWS = 16


@triton.jit
def skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, arrived_ptr, rows, n, k, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    BIAS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        pdl_start()
    tile = tl.program_id(0)
    split = tl.program_id(1)
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < rows
    ns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < n
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k)
    w_cols = w_ptr + ns[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLITS > 1:
        part = part_ptr + ms[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part + (tile * SPLITS + split) * stride_ps, acc, mask=ok)
        # release our partial, acquire the others' (acq_rel): the last to arrive sees every split's stores
        if tl.atomic_add(arrived_ptr + tile, 1) != SPLITS - 1:
            return
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part + (tile * SPLITS + s) * stride_ps, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(arrived_ptr + tile, 0)
    if BIAS:
        acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + ms[:, None] * stride_om + ns[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def skinny_gemm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``skinny_gemm`` takes this call: a 2-D CUDA input of 1..MAX_ROWS rows, K-contiguous operands."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and weight.stride(-1) == 1 and x.dtype == weight.dtype)


def skinny_gemm_counters(n: int, device: torch.device) -> torch.Tensor:
    """The arrival counters ``skinny_gemm`` needs for an output of ``n`` columns (zeros; left zero after each call)."""
    return torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, arrived: torch.Tensor,
                tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M <= MAX_ROWS, K], weight [N, K] (nn.Linear's layout); ``arrived``
    from ``skinny_gemm_counters(N)``. ``tile``: (columns, K, programs per SM, warps, stages), by default
    ``benchmarks/gpu/decode.py --projections``'s best on an H200."""
    rows, k = x.shape
    n = weight.shape[0]
    # short K (o, down): wide column tiles; long K (q/k/v, gate/up, LM head): narrow ones, split more
    block_n, block_k, per_sm, warps, stages = tile or ((64, 128, 4, 4, 3) if k <= 1024 else (32, 128, 4, 4, 4))
    col_tiles = triton.cdiv(n, block_n)
    if arrived.numel() < col_tiles:
        raise ValueError(f"skinny_gemm needs {col_tiles} arrival counters for {n} columns, got {arrived.numel()}")
    # (an H200's count where there is no GPU: Triton's CPU interpreter)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    splits = max(1, min(triton.cdiv(per_sm * sms, col_tiles), triton.cdiv(k, block_k), 32))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    part = (torch.empty((col_tiles * splits, MAX_ROWS * block_n), dtype=torch.float32, device=x.device)
            if splits > 1 else out)
    on = pdl(x)
    skinny_gemm_kernel[(col_tiles, splits)](
        x, weight, bias if bias is not None else weight, out, part, arrived, rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), part.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, PDL=on, num_warps=warps, num_stages=stages, launch_pdl=on,
    )
    return out
