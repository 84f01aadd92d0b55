"""Routed experts at decode sizes: each selected expert's weights read once, straight from the expert tensors.

The MoE's (token, choice) pairs are few at decode (batch x top_k), and each pair needs one expert's weights. The
naive graph-capturable way gathers ``gate_up_proj[ids]`` into a copy per pair and multiplies the copy: three
passes over an expert's bytes (read, write, read). Here the kernels read the weights in place:

1. ``gate_up_kernel``: program (slot j, column tile n, K-split s) takes the j-th distinct expert ``e`` the pairs
   picked and the pairs routed to it (a mask over all pairs, no sorting; there are min(experts, pairs) slots, and
   a slot past the last picked expert returns before touching a weight), multiplies their gated inputs
   ``x * gate`` (Llama-4 scales the expert's input) by ``W_gate_up[e, ks, n]`` and writes the float32 partial
   sums of split ``s``. Splitting K keeps enough programs streaming at batch 1, where only one
   expert's 16 column tiles have work. The last split of a tile to finish sums the splits and writes
   ``silu(gate) * up`` (an arrival counter per tile: no kernel of its own, and none of the down kernel's programs
   holds every split's tiles in registers, which spilled);
2. ``down_kernel``: program (slot j, column tile n) multiplies the pairs of slot j's expert ``e`` by
   ``W_down[e, :, n]``; the last program of a column tile to finish adds each token's rows (its top_k choices,
   its shared-expert row).

Before them, ``route_kernel`` computes the router's logits, top-k and gates in one launch.

The shared expert (Llama-4's, ungated, on every token) can run as one more expert, the last slot, in the gate/up
and down kernels: its nn.Linear weights are read transposed in place (K-contiguous), and each token gets one more
output row, added to its routed ones at the end.

E.g. 2 tokens, top-1, ids [3, 3], 16 experts, I = 1024, 64-column tiles, 4 splits: 2 x 16 x 4 programs start;
slot 0's 64 (expert 3) each read a [H/4, 64] tile of gate and of up for both rows at once, slot 1's 64 find no
second expert and return; the fourth of slot 0's programs on column tile n to finish writes h[0:2, 64n:64n + 64].
(A grid over all 16 experts would launch 1,024 programs, 960 of them idle.)

The kernels take any float dtype; float32 weights use IEEE dots (Triton's default for float32 is tf32), so the
tiny float32 test models stay exact to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.launch import pdl, pdl_start

# the most rows one launch takes ((token, choice) pairs, plus one per token for the shared expert): rows of a
# program's tiles (register and shared-memory use grow with it)
MAX_PAIRS = 64
# the gate/up kernel splits K until about this many programs have work (see ``fused_moe``): two per SM. A Scout
# rank's batch-1 step on an H200 (graph replay, `tools/kernel_dev/decode_stages.py --variants`): 2.49 -> 2.42 ms
# at 16K with 256 (8 splits) instead of 128 (4), 2.45 with 512
SPLIT_PROGRAMS = 256
# up to this many rows the down kernel's pipeline is deeper (5 stages, not 3): the batch-1 step 2.42 -> 2.38 ms,
# where batch 8 went 6.51 -> 6.71 and batch 32 15.99 -> 16.14
FEW_ROWS = 4


@triton.jit
def route_kernel(
    x_ptr, w_ptr, logits_ptr, arrived_ptr, ids_ptr, gates_ptr, hidden, num_experts, stride_xt, stride_we,
    E_PAD: tl.constexpr, PER_PROGRAM: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (token t, p): router logits of experts [p * PER_PROGRAM, ...) for token t, rounded to the model's
    dtype as nn.Linear's output is. The token's last program to finish (an arrival counter, reset after use)
    picks the top_k experts (the first index among equal logits) and their gates ``sigmoid(logit)``. Spreading
    the router's rows over programs keeps a 16-expert router from being one SM's serial read.

    ONE_TILE (hidden <= BLOCK_K): the program's weight rows are read before the PDL wait (no kernel writes them),
    so only x's read follows it."""
    t = tl.program_id(0).to(tl.int64)
    es = tl.program_id(1) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    e_ok = es < num_experts
    if ONE_TILE:
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        w = tl.load(w_ptr + es[:, None] * stride_we + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        if PDL:
            pdl_start()
        x = tl.load(x_ptr + t * stride_xt + ks, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    else:
        if PDL:
            pdl_start()
        acc = tl.zeros((PER_PROGRAM,), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(x_ptr + t * stride_xt + ks, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + es[:, None] * stride_we + ks[None, :], mask=e_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    dtype = gates_ptr.dtype.element_ty
    tl.store(logits_ptr + t * E_PAD + es, acc.to(dtype).to(tl.float32), mask=e_ok)
    # release our logits, acquire the others' (acq_rel): the last to arrive sees every program's stores
    if tl.atomic_add(arrived_ptr + t, 1) == tl.num_programs(1) - 1:
        all_es = tl.arange(0, E_PAD)
        logits = tl.load(logits_ptr + t * E_PAD + all_es, mask=all_es < num_experts, other=float("-inf"),
                         cache_modifier=".cg")
        for j in tl.static_range(TOP_K):
            best = tl.max(logits, 0)
            pick = tl.min(tl.where(logits == best, all_es, E_PAD), 0)
            tl.store(ids_ptr + t * TOP_K + j, pick.to(tl.int64))
            tl.store(gates_ptr + t * TOP_K + j, tl.sigmoid(best).to(dtype))
            logits = tl.where(all_es == pick, float("-inf"), logits)
        tl.store(arrived_ptr + t, 0)


@triton.jit
def _slot_expert(ids, routed, slot, num_experts, E_PAD: tl.constexpr):
    """The expert of grid slot ``slot``: the slot-th distinct expert among the routed rows' ``ids``, in expert
    order; ``num_experts + 1`` (nobody's) past the last. E.g. ids [5, 2, 5], slots 0, 1, 2 -> experts 2, 5, none."""
    es = tl.arange(0, E_PAD)
    picked = tl.max(((ids[:, None] == es[None, :]) & routed[:, None]).to(tl.int32), 0)
    hit = (picked > 0) & (tl.cumsum(picked, 0) == slot + 1)
    return tl.where(tl.sum(hit.to(tl.int32), 0) > 0, tl.sum(tl.where(hit, es, 0), 0), num_experts + 1)


@triton.jit
def _gate_up_dots(x_ptr, tokens, gate, mine, w_ptr, stride_wk, stride_wn, hidden, inter, k_lo, k_hi, stride_xt,
                  cols, col_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  IEEE: tl.constexpr):
    """Rows ``mine`` of the gated input times columns ``cols`` of gate and of up (``inter`` further on), over K in
    [k_lo, k_hi). The weight is read as w[k, n] = w_ptr[k * stride_wk + n * stride_wn]: experts are stored N-major,
    the shared expert's nn.Linear weight K-major (a stride of 1 is a compile-time constant either way)."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
        # the gated input rounded to the weights' dtype, as (x * gate) is in eager torch
        xg = (x.to(tl.float32) * gate[:, None]).to(w_ptr.dtype.element_ty)
        w_rows = w_ptr + ks[:, None].to(tl.int64) * stride_wk
        ok = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_rows + cols[None, :].to(tl.int64) * stride_wn, mask=ok, other=0.0)
        wu = tl.load(w_rows + (cols + inter)[None, :].to(tl.int64) * stride_wn, mask=ok, other=0.0)
        if IEEE:
            acc_g += tl.dot(xg, wg, input_precision="ieee")
            acc_u += tl.dot(xg, wu, input_precision="ieee")
        else:
            acc_g += tl.dot(xg, wg)
            acc_u += tl.dot(xg, wu)
    return acc_g, acc_u


@triton.jit
def gate_up_kernel(
    x_ptr, gate_ptr, ids_ptr, w_ptr, sw_ptr, part_ptr, h_ptr, arrived_ptr,
    num_pairs, num_tokens, num_experts, hidden, inter, k_per_split,
    stride_xt, stride_we, stride_wk, stride_wn, stride_swk, stride_swn, stride_ps, stride_pp,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    IEEE: tl.constexpr, SHARED: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Rows 0..num_pairs are the (token, choice) pairs; with SHARED, rows num_pairs.. are each token once more for
    the shared expert (the last slot, gate 1).

    With SPLITS > 1 each program stores its float32 partial sums; the last split of an (expert, column tile) to
    finish (an arrival counter, reset after use) sums them in split order. That program, or the only one, writes
    ``h = silu(gate) * up`` for its rows and columns, each projection rounded to the weights' dtype first as eager
    torch rounds it.

    Under PDL the shared expert's programs read x and their weights before waiting for the router (the kernel
    before): this kernel starts only once every router program has passed its own wait, so x (the router's input
    too) is complete. They wait before their first store, as the buffers they write may be memory the router still
    reads. The routed experts' programs wait first: the ids and gates are the router's output."""
    slot = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    routed = rows < num_pairs
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, hidden)
    e = num_experts  # the shared expert's counters follow the routed experts'
    if SHARED and slot == tl.num_programs(0) - 1:
        mine = (rows >= num_pairs) & (rows < num_pairs + num_tokens)
        tokens = (rows - num_pairs).to(tl.int64)
        gate = tl.full((BLOCK_M,), 1.0, tl.float32)
        acc_g, acc_u = _gate_up_dots(x_ptr, tokens, gate, mine, sw_ptr, stride_swk, stride_swn, hidden, inter,
                                     k_lo, k_hi, stride_xt, cols, col_ok, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        if PDL:
            pdl_start()
    else:
        if PDL:
            pdl_start()
        ids = tl.load(ids_ptr + rows, mask=routed, other=-1)
        e = _slot_expert(ids, routed, slot, num_experts, E_PAD)
        mine = routed & (ids == e)
        if tl.sum(mine.to(tl.int32), 0) == 0:
            return
        tokens = (rows // TOP_K).to(tl.int64)
        gate = tl.load(gate_ptr + rows, mask=mine, other=0.0).to(tl.float32)
        acc_g, acc_u = _gate_up_dots(x_ptr, tokens, gate, mine, w_ptr + e.to(tl.int64) * stride_we, stride_wk,
                                     stride_wn, hidden, inter, k_lo, k_hi, stride_xt, cols, col_ok, BLOCK_M,
                                     BLOCK_N, BLOCK_K, IEEE)
    ok = mine[:, None] & col_ok[None, :]
    if SPLITS > 1:
        part = part_ptr + rows[:, None].to(tl.int64) * stride_pp
        tl.store(part + split * stride_ps + cols[None, :], acc_g, mask=ok)
        tl.store(part + split * stride_ps + (cols + inter)[None, :], acc_u, mask=ok)
        # release our partials, acquire the others' (acq_rel): the last to arrive sees every split's stores
        counter = arrived_ptr + e * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1) != SPLITS - 1:
            return
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc_g += tl.load(part + s * stride_ps + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            acc_u += tl.load(part + s * stride_ps + (cols + inter)[None, :], mask=ok, other=0.0,
                             cache_modifier=".cg")
        tl.store(counter, 0)
    dtype = h_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], (g * tl.sigmoid(g) * u).to(dtype), mask=ok)


@triton.jit
def _down_dots(h_ptr, mine, rows, w_ptr, stride_wk, stride_wn, inter, cols, col_ok,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    h_rows = h_ptr + rows[:, None].to(tl.int64) * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        h = tl.load(h_rows + ks[None, :], mask=mine[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + ks[:, None].to(tl.int64) * stride_wk + cols[None, :].to(tl.int64) * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h, w, input_precision="ieee")
        else:
            acc += tl.dot(h, w)
    return acc


@triton.jit
def down_kernel(
    h_ptr, ids_ptr, w_ptr, sw_ptr, out_ptr, sum_ptr, arrived_ptr,
    num_pairs, num_tokens, num_experts, hidden, inter,
    stride_we, stride_wk, stride_wn, stride_swk, stride_swn, stride_op, stride_st,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    SHARED: tl.constexpr, SUM: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Output rows are the pairs (and the shared expert's rows), rounded to the output's dtype. With SUM, the last
    program of a column tile to finish (every program arrives, idle ones too) adds each token's rows as eager torch
    does: its top_k routed rows summed in float32 and rounded, then the shared expert's row added and rounded."""
    if PDL:
        pdl_start()
    slot = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    out = out_ptr + rows[:, None].to(tl.int64) * stride_op + cols[None, :]
    if SHARED and slot == tl.num_programs(0) - 1:
        mine = (rows >= num_pairs) & (rows < num_pairs + num_tokens)
        acc = _down_dots(h_ptr, mine, rows, sw_ptr, stride_swk, stride_swn, inter, cols, col_ok, BLOCK_M, BLOCK_N,
                         BLOCK_K, IEEE)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mine[:, None] & col_ok[None, :])
    else:
        pair = rows < num_pairs
        ids = tl.load(ids_ptr + rows, mask=pair, other=-1)
        e = _slot_expert(ids, pair, slot, num_experts, E_PAD)
        mine = pair & (ids == e)
        if tl.sum(mine.to(tl.int32), 0) > 0:
            acc = _down_dots(h_ptr, mine, rows, w_ptr + e.to(tl.int64) * stride_we, stride_wk, stride_wn, inter,
                             cols, col_ok, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mine[:, None] & col_ok[None, :])
    if SUM:
        # release our rows, acquire the others' (acq_rel): the last to arrive sees every program's stores
        counter = arrived_ptr + tl.program_id(1)
        if tl.atomic_add(counter, 1) == tl.num_programs(0) - 1:
            tokens = tl.arange(0, BLOCK_M)
            ok = (tokens < num_tokens)[:, None] & col_ok[None, :]
            routed = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                row = (tokens * TOP_K + j).to(tl.int64)
                routed += tl.load(out_ptr + row[:, None] * stride_op + cols[None, :], mask=ok, other=0.0,
                                  cache_modifier=".cg").to(tl.float32)
            dtype = sum_ptr.dtype.element_ty
            total = routed.to(dtype)
            if SHARED:
                row = (num_pairs + tokens).to(tl.int64)
                shared = tl.load(out_ptr + row[:, None] * stride_op + cols[None, :], mask=ok, other=0.0,
                                 cache_modifier=".cg")
                total = (total.to(tl.float32) + shared.to(tl.float32)).to(dtype)
            tl.store(sum_ptr + tokens[:, None].to(tl.int64) * stride_st + cols[None, :], total, mask=ok)
            tl.store(counter, 0)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
          arrived: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, top_k] int64, gates [T, top_k] in x's dtype) of Llama-4's router: ``topk(x @ W^T)`` and
    the sigmoid of the picked logits, in one launch (a GEMM, a top-k and two elementwise kernels in torch).
    ``arrived``: int32 zeros, at least T of them, that the kernel leaves zero again (one buffer per model)."""
    tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    gates = torch.empty((tokens, top_k), dtype=x.dtype, device=x.device)
    if tokens:
        if arrived.numel() < tokens:
            raise ValueError(f"route needs an arrival counter per token ({tokens}), got {arrived.numel()}")
        e_pad = triton.next_power_of_2(num_experts)
        per_program = max(1, e_pad // 16)
        # a Scout rank's router row (5,120 values) in one tile, read before the PDL wait
        one_tile = per_program * triton.next_power_of_2(hidden) <= 8192
        block_k = triton.next_power_of_2(hidden) if one_tile else 2048
        logits = torch.empty((tokens, e_pad), dtype=torch.float32, device=x.device)
        x = x if x.stride(-1) == 1 else x.contiguous()
        on = pdl(x)
        route_kernel[(tokens, triton.cdiv(num_experts, per_program))](
            x, router_weight, logits, arrived, ids, gates, hidden, num_experts, x.stride(0),
            router_weight.stride(0), E_PAD=e_pad, PER_PROGRAM=per_program, TOP_K=top_k, BLOCK_K=block_k,
            ONE_TILE=one_tile, PDL=on, num_warps=4, launch_pdl=on,
        )
    return ids, gates


def _counter_offsets(num_experts: int, inter: int, hidden: int) -> tuple[int, int, int]:
    """Where the gate/up kernel's and the down kernel's arrival counters start, and how many there are in all:
    ``route``'s MAX_PAIRS first, then one per (expert or shared expert, gate/up column tile), then one per down
    column tile, for any tile of 16 columns or more."""
    down = MAX_PAIRS + (num_experts + 1) * triton.cdiv(inter, 16)
    return MAX_PAIRS, down, down + triton.cdiv(hidden, 16)


def fused_moe_counters(num_experts: int, inter: int, hidden: int, device: torch.device) -> torch.Tensor:
    """The arrival counters ``route`` and ``fused_moe`` need for experts of this size (zeros; each kernel leaves
    them zero)."""
    return torch.zeros(_counter_offsets(num_experts, inter, hidden)[2], dtype=torch.int32, device=device)


def fused_moe(x: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, arrived: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              gate_up_tile: tuple[int, int, int, int] | None = None,
              down_tile: tuple[int, int, int, int] | None = None, splits: int | None = None) -> torch.Tensor:
    """Routed experts' output [T, H] for ``x`` [T, H], top-k ``gates`` and expert ``ids`` [T, top_k], plus the
    shared expert's when ``shared`` = (its gate/up weight [2I, H], gate rows first; its down weight [H, I]) is given
    (nn.Linear's layout): it runs as one more expert on every token, ungated, in the same launches.

    ``gate_up`` [E, H, 2I] (gate columns first), ``down`` [E, I, H]: transformers' Llama-4 layout; ``arrived``
    from ``fused_moe_counters``. The caller guarantees ``T * top_k`` (plus T with ``shared``) <= MAX_PAIRS. The
    tiles (columns, K, warps, pipeline stages) and the gate/up kernel's K-splits are
    ``benchmarks/gpu/decode.py --moe-tiles``'s best on an H200, and at batch 1 what the whole step's graph replays
    fastest with (``SPLIT_PROGRAMS``, ``FEW_ROWS``)."""
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    num_rows = num_pairs + (tokens if shared is not None else 0)
    if num_rows > MAX_PAIRS:
        raise ValueError(f"fused_moe takes at most {MAX_PAIRS} rows ((token, choice) pairs and shared-expert "
                         f"tokens), got {num_rows}")
    num_experts, hidden, inter = down.shape[0], down.shape[2], down.shape[1]
    gate_up_at, down_at, need = _counter_offsets(num_experts, inter, hidden)
    if arrived.numel() < need:
        raise ValueError(f"fused_moe needs {need} arrival counters (fused_moe_counters), got {arrived.numel()}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.reshape(-1)
    gates = gates.reshape(-1)
    # the shared expert's weights read as w[k, n]: its [2I, H] gate/up and [H, I] down transposed in place
    s_gate_up, s_down = (shared[0].t(), shared[1].t()) if shared is not None else (gate_up[0], down[0])
    # one grid slot per expert the rows can touch (the slot-th picked, found by each program), the shared expert
    # last: at batch 1, 2 slots instead of 17 (a Scout rank), so no wave of idle programs queues before the busy
    programs = min(num_experts, num_pairs) + (shared is not None)
    e_pad = triton.next_power_of_2(num_experts)
    block_m = max(16, triton.next_power_of_2(num_rows))
    # longer K tiles once several experts share the SMs (a Scout rank's batch 8 with its shared expert: 67.5 us
    # instead of 71.6); at 64 rows, or in float32, they no longer fit in shared memory
    if gate_up_tile is None:
        wide = x.element_size() == 2 and 4 < num_pairs and num_rows <= 32
        gate_up_tile = (64, 256, 4, 3) if wide else (64, 128, 4, 3 if x.element_size() == 2 else 2)
    block_n, block_k, warps, stages = gate_up_tile
    col_tiles = triton.cdiv(inter, block_n)
    if splits is None:
        # enough programs with work to keep ~128 SMs streaming: rows touch at most min(experts, rows) experts
        busy = min(programs, num_rows) * col_tiles
        splits = max(1, min(16, SPLIT_PROGRAMS // busy, triton.cdiv(hidden, 4 * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    splits = triton.cdiv(hidden, k_per_split)
    part = torch.empty((splits, num_rows, 2 * inter), dtype=torch.float32, device=x.device)
    h = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    on = pdl(x)
    gate_up_kernel[(programs, col_tiles, splits)](
        x, gates, ids, gate_up, s_gate_up, part, h, arrived[gate_up_at:], num_pairs, tokens, num_experts, hidden,
        inter, k_per_split, x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        s_gate_up.stride(0), s_gate_up.stride(1), part.stride(0), part.stride(1),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, IEEE=ieee,
        SHARED=shared is not None, E_PAD=e_pad, PDL=on, num_warps=warps, num_stages=stages, launch_pdl=on,
    )
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    # one row per token at the end: the routed rows summed and the shared row added, by the down kernel itself
    summed = shared is not None or top_k > 1
    total = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device) if summed else out
    if down_tile is None:
        down_tile = (64, 64, 4, 2) if x.element_size() != 2 else (64, 128, 4, 5 if num_rows <= FEW_ROWS else 3)
    down_n, down_k, warps, stages = down_tile
    down_kernel[(programs, triton.cdiv(hidden, down_n))](
        h, ids, down, s_down, out, total, arrived[down_at:],
        num_pairs, tokens, num_experts, hidden, inter, down.stride(0), down.stride(1), down.stride(2),
        s_down.stride(0), s_down.stride(1), out.stride(0), total.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=down_n, BLOCK_K=down_k, IEEE=ieee, SHARED=shared is not None,
        SUM=summed, E_PAD=e_pad, PDL=on, num_warps=warps, num_stages=stages, launch_pdl=on,
    )
    return total
