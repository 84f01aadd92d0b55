"""The MoE of prefill-sized batches around its two grouped GEMMs, and the gated MLP's activation: a few passes over
the rows instead of eager torch's many.

In eager torch a prefill MoE layer of a Scout rank was ~30 launches around the two ``grouped_mm``: a radix sort of
the expert ids (ten kernels and their memsets), ``searchsorted`` for the group ends, an inverse permutation, a row
gather and a separate multiply by the gates, ``silu`` and a multiply over strided halves of the gate/up output
(each a slow non-contiguous kernel), another row gather back to token order and the add of the shared expert. At
16,384 tokens on an H200 those took ~40 ms of a 174 ms step, and these kernels take ~13. Here:

1. ``sort_by_expert``: a counting sort of the (token, choice) pairs by expert, stable, in two launches (counts per
   block of pairs; then each block places its pairs after every earlier block's). It yields the grouped GEMMs'
   group ends, the pairs in expert order and each pair's place in that order;
2. ``gather_gated``: the sorted rows of the input, each times its pair's gate (Llama-4 scales the expert's input);
3. ``silu_mul``: ``silu(gate) * up`` of a ``[rows, 2 I]`` gate/up output (gate first), the routed experts' and any
   gated MLP's (the shared expert's, dense layers');
4. ``add_routed``: each token's routed rows, read back in token order and summed, added to the shared expert's
   output in place.

E.g. 4 tokens, top-1, 3 experts, ids [2, 0, 2, 1]: counts [1, 1, 2], ends [1, 2, 4], pairs in expert order
[1, 3, 0, 2], each pair's place [2, 0, 3, 1]; ``gather_gated`` writes rows x[1] g1, x[3] g3, x[0] g0, x[2] g2;
``add_routed`` adds routed row 2 to token 0, row 0 to token 1, row 3 to token 2 and row 1 to token 3.

Rounding is eager torch's: the gated input and ``silu`` each rounded to the dtype before the next multiply, a
token's choices summed in float32 and rounded before the shared expert's row is added.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# a counting-sort program holds a [pairs, experts] one-hot of this many values: 1,024 pairs a program for Scout's 16
# experts (a 16,384-token step, top-1, is 16 programs), 128 for 128 experts
SORT_VALUES = 16384
# and its placing programs each read every program's counts: at most this many (Scout's 16 experts: 4M pairs)
MAX_COUNTS = 1 << 16
# columns per program of the row kernels: 8 bf16 values (16 bytes) per thread of 4 warps
ROW_BLOCK = 1024


@triton.jit
def count_by_expert_kernel(ids_ptr, counts_ptr, n, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: how many of pairs [b * BLOCK, ...) picked each expert, into counts[b, :]."""
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_PAD)  # past the end: no expert
    experts = tl.arange(0, E_PAD)
    picked = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + b * E_PAD + experts, tl.sum(picked, axis=0))


@triton.jit
def place_by_expert_kernel(ids_ptr, counts_ptr, order_ptr, place_ptr, ends_ptr, n, num_experts, num_blocks,
                           E_PAD: tl.constexpr, B_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: the places of pairs [b * BLOCK, ...) in expert order, after every pair of a smaller expert and
    every earlier pair of the same one (``order[place] = pair``, ``place[pair]``); program 0 also writes each
    expert's end (``ends``, int32, what ``grouped_mm`` takes as ``offs``)."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    blocks = tl.arange(0, B_PAD)
    counts = tl.load(counts_ptr + blocks[:, None] * E_PAD + experts[None, :], mask=blocks[:, None] < num_blocks,
                     other=0)
    totals = tl.sum(counts, axis=0)
    ends = tl.cumsum(totals, axis=0)
    earlier = tl.sum(tl.where(blocks[:, None] < b, counts, 0), axis=0)  # this expert's pairs in earlier blocks
    first = ends - totals + earlier  # [E_PAD]: where this block's first pair of each expert goes
    if b == 0:
        tl.store(ends_ptr + experts, ends, mask=experts < num_experts)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_PAD)
    picked = (ids[:, None] == experts[None, :]).to(tl.int32)
    before = tl.cumsum(picked, axis=0) - picked  # earlier pairs of the same expert within the block
    place = tl.sum(picked * (first[None, :] + before), axis=1)
    tl.store(order_ptr + place, offs.to(order_ptr.dtype.element_ty), mask=offs < n)
    tl.store(place_ptr + offs, place.to(place_ptr.dtype.element_ty), mask=offs < n)


def _sort_blocks(n: int, num_experts: int) -> tuple[int, int, int]:
    """(experts padded to a power of two, pairs per program, programs) of the counting sort."""
    e_pad = triton.next_power_of_2(num_experts)
    block = max(64, min(1024, SORT_VALUES // e_pad))
    return e_pad, block, max(1, triton.cdiv(n, block))


def sorts(n: int, num_experts: int) -> bool:
    """``sort_by_expert`` takes ``n`` pairs over ``num_experts`` experts."""
    e_pad, _, blocks = _sort_blocks(n, num_experts)
    return triton.next_power_of_2(blocks) * e_pad <= MAX_COUNTS


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ends [num_experts] int32, order [n] int64, place [n] int64) of the flat expert ids [n] of a step's pairs:
    a stable sort by expert without a host sync. ``order[i]`` is the i-th pair in expert order, ``place`` its
    inverse; expert e's pairs are ``order[ends[e - 1]:ends[e]]``."""
    n = ids.numel()
    if not sorts(n, num_experts):
        raise ValueError(f"{n} pairs over {num_experts} experts: more than the counting sort's {MAX_COUNTS} counts")
    ids = ids.reshape(-1).to(torch.int32)
    e_pad, block, blocks = _sort_blocks(n, num_experts)
    counts = torch.empty((blocks, e_pad), dtype=torch.int32, device=ids.device)
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    place = torch.empty(n, dtype=torch.int64, device=ids.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    count_by_expert_kernel[(blocks,)](ids, counts, n, E_PAD=e_pad, BLOCK=block, num_warps=8)
    place_by_expert_kernel[(blocks,)](ids, counts, order, place, ends, n, num_experts, blocks, E_PAD=e_pad,
                                      B_PAD=triton.next_power_of_2(blocks), BLOCK=block, num_warps=8)
    return ends, order, place


@triton.jit
def gather_gated_kernel(x_ptr, gates_ptr, order_ptr, out_ptr, hidden, stride_x, stride_o,
                        TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, c): columns c of sorted row i, ``x[pair // TOP_K] * gates[pair]`` for its pair."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pair = tl.load(order_ptr + i)
    gate = tl.load(gates_ptr + pair).to(tl.float32)
    row = tl.load(x_ptr + (pair // TOP_K) * stride_x + cols, mask=cols < hidden)
    tl.store(out_ptr + i.to(tl.int64) * stride_o + cols, (row.to(tl.float32) * gate).to(out_ptr.dtype.element_ty),
             mask=cols < hidden)


def gather_gated(x: torch.Tensor, gates: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows ``x[order // top_k] * gates.flatten()[order]`` [n, hidden] of ``x`` [tokens, hidden]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((order.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    if order.numel():
        gather_gated_kernel[(order.numel(), triton.cdiv(x.shape[1], ROW_BLOCK))](
            x, gates.reshape(-1), order, out, x.shape[1], x.stride(0), out.stride(0), TOP_K=top_k, BLOCK=ROW_BLOCK)
    return out


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    """Program (r, c): columns c of row r, ``silu(gate) * up`` with gate = gate_up[r, :inter], up the rest."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + r * stride_g + cols, mask=ok).to(tl.float32)
    up = tl.load(gate_up_ptr + r * stride_g + inter + cols, mask=ok).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` [rows, I] of ``gate_up`` [rows, 2 I] (gate first)."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        silu_mul_kernel[(rows, triton.cdiv(inter, ROW_BLOCK))](gate_up, out, inter, gate_up.stride(0),
                                                               out.stride(0), BLOCK=ROW_BLOCK)
    return out


@triton.jit
def add_routed_kernel(shared_ptr, routed_ptr, place_ptr, hidden, stride_s, stride_r,
                      TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, c): columns c of token t, ``shared[t] += sum_j routed[place[t * TOP_K + j]]``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(place_ptr + t * TOP_K + j)
        total += tl.load(routed_ptr + row * stride_r + cols, mask=ok).to(tl.float32)
    dtype = shared_ptr.dtype.element_ty
    shared = tl.load(shared_ptr + t * stride_s + cols, mask=ok).to(tl.float32)
    tl.store(shared_ptr + t * stride_s + cols, (shared + total.to(dtype).to(tl.float32)).to(dtype), mask=ok)


def add_routed(shared: torch.Tensor, routed: torch.Tensor, place: torch.Tensor, top_k: int) -> torch.Tensor:
    """``shared`` [tokens, hidden] plus each token's ``top_k`` routed rows (``routed`` [tokens * top_k, hidden] in
    expert order, token t's choice j at row ``place[t * top_k + j]``), in place; returns ``shared``."""
    if shared.shape[0]:
        add_routed_kernel[(shared.shape[0], triton.cdiv(shared.shape[1], ROW_BLOCK))](
            shared, routed, place, shared.shape[1], shared.stride(0), routed.stride(0), TOP_K=top_k, BLOCK=ROW_BLOCK)
    return shared
