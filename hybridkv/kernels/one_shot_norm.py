"""A tensor-parallel step's all-reduce, residual add and RMSNorm in one kernel, over peer GPU memory.

Two kernels. ``one_shot_add_norm`` (decode steps) sends this rank's part from inside the kernel;
``pushed_add_norm`` (prefill halves) finds the peers' parts already copied into its buffer by their copy engines
(``collectives.CopyEngineSums``) and only waits, sums and normalises.

After a row-parallel linear every rank holds a part of each row's sum; the next thing a decoder layer does with the
sum is add the residual and normalise. Here each program owns one row: it writes its part into every peer's
buffer (NVLink stores into their symmetric memory), waits until every peer's part has arrived in its own buffer,
sums the parts in rank order (so every rank computes the same bits), adds the residual and normalises. One launch
where the one-shot all-reduce and the norm took two, and no barrier: a slot holds a value nobody writes (an
all-ones NaN pattern) until its part lands, so the arrival of the data is its own signal (the "Lamport" scheme
TensorRT-LLM's one-shot all-reduce uses). A part whose bits happen to be that pattern is sent as the canonical NaN:
the sum is NaN either way.

E.g. 2 ranks, one row: rank 0's part [1, 2], rank 1's [10, 20], residual [100, 100] on both. Rank 0 stores [1, 2]
into slot 0 of rank 1's buffer, rank 1 stores [10, 20] into slot 1 of rank 0's; each spins until the slot it reads
is no longer empty, then both write the residual [111, 122] and the same normalised row.

Each buffer generation is used once, then reset by its reader: three generations rotate, chosen by a counter on
each GPU (0, 1, 2, 0, ...) that the last program of a launch advances. The counter lives on the device, so a CUDA graph replays the
kernel with the generation the step has reached, whatever graphs or eager steps ran before. A generation is written
again only three launches later, which a peer cannot reach before this rank's next two launches have sent it
their parts, and those start after this launch has reset its slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GENERATIONS = 3
EMPTY_BYTE = 0xFF  # every slot's bytes while it waits: all ones, a NaN pattern in every float dtype


@triton.jit
def _add_residual_and_norm(total, res_ptr, w_ptr, out_ptr, at, cols, ok, eps, N: tl.constexpr, dtype: tl.constexpr):
    """A row's parts summed in float32 (``total``), rounded as a summed tensor would be, plus the residual (stored
    back at ``at``), then RMSNorm times the weight into ``out_ptr``: the end of both kernels below."""
    r = tl.load(res_ptr + at, mask=ok, other=0.0)
    h = (total.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)  # as a summed tensor + residual rounds
    tl.store(res_ptr + at, h, mask=ok)
    hf = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = ((hf * inv_rms).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
    tl.store(out_ptr + at, y, mask=ok)


@triton.jit
def one_shot_add_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, peers_ptr, counter_ptr, num_rows, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, SLOT: tl.constexpr,
    BITS: tl.constexpr, NAN_BITS: tl.constexpr, GENS: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dtype = x_ptr.dtype.element_ty
    generation = tl.load(counter_ptr)
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    bits = x.to(BITS, bitcast=True)
    bits = tl.where(bits == -1, NAN_BITS, bits)  # never send the empty pattern
    slot_of = (generation * WORLD) * SLOT + row * N + cols  # + peer * SLOT: slot ``peer`` of this generation
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(peers_ptr + peer).to(tl.pointer_type(BITS))
            tl.store(theirs + slot_of + RANK * SLOT, bits, mask=ok)
    mine = tl.load(peers_ptr + RANK).to(tl.pointer_type(BITS))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            total += x.to(tl.float32)
        else:
            slot = mine + slot_of + peer * SLOT
            got = tl.load(slot, mask=ok, other=0, volatile=True)
            while tl.max(tl.where(got == -1, 1, 0), 0) > 0:
                got = tl.load(slot, mask=ok, other=0, volatile=True)
            tl.store(slot, tl.full([BLOCK], -1, BITS), mask=ok)  # empty again for its next use
            total += got.to(dtype, bitcast=True).to(tl.float32)
    _add_residual_and_norm(total, res_ptr, w_ptr, out_ptr, row * N + cols, cols, ok, eps, N, dtype)
    # the launch's last program moves this GPU to the next generation (every program read it before arriving)
    arrived = tl.atomic_add(counter_ptr + 1, 1)
    if arrived == num_rows - 1:
        tl.store(counter_ptr + 1, 0)
        tl.store(counter_ptr, (generation + 1) % GENS)


@triton.jit
def pushed_add_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, slots_ptr, flags_ptr, seq, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, SLOT: tl.constexpr,
):
    """One row: wait until every peer's flag says its part of message ``seq`` has landed in its slot (the peers
    index their slots skipping this rank), sum the parts in rank order, then as ``one_shot_add_norm_kernel``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dtype = x_ptr.dtype.element_ty
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            total += tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        else:
            # the flag is written by the peer's stream after its copy completed; acquire orders the reads after it
            arrived = tl.atomic_add(flags_ptr + src, 0, sem="acquire", scope="sys")
            while arrived < seq:
                arrived = tl.atomic_add(flags_ptr + src, 0, sem="acquire", scope="sys")
            if src < RANK:
                slot = slots_ptr + src * SLOT
            else:
                slot = slots_ptr + (src - 1) * SLOT
            # L2, not L1: an earlier message in the same slot may sit in this SM's L1
            got = tl.load(slot + row * N + cols, mask=ok, other=0.0, cache_modifier=".cg")
            total += got.to(tl.float32)
    _add_residual_and_norm(total, res_ptr, w_ptr, out_ptr, row * N + cols, cols, ok, eps, N, dtype)


def pushed_add_norm(part: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    slots: torch.Tensor, flags: torch.Tensor, seq: int, rank: int, world: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """norm(sum over ranks of ``part`` + ``residual``) * ``weight`` [rows, N] (into ``out`` if given), the sum +
    residual left in ``residual``, where each peer copies its part of message ``seq`` into ``slots`` (this GPU's,
    [world - 1, slot elements] of ``part``'s dtype, peers in rank order without this rank) and then sets its entry
    of ``flags`` (int32 [world]) to ``seq`` or more."""
    rows, n = part.shape
    if not (part.is_contiguous() and residual.is_contiguous()):
        raise ValueError("the part and the residual must be contiguous")
    if slots.shape[0] != world - 1 or rows * n > slots.shape[1] or slots.dtype != part.dtype:
        raise ValueError(f"{rows} x {n} {part.dtype} does not fit slots {tuple(slots.shape)} {slots.dtype}")
    if out is None:
        out = torch.empty_like(part)
    elif not out.is_contiguous() or out.shape != part.shape or out.dtype != part.dtype:
        raise ValueError(f"out must be contiguous {part.dtype} {tuple(part.shape)}, got {out.dtype} {tuple(out.shape)}")
    block = triton.next_power_of_2(n)
    pushed_add_norm_kernel[(rows,)](
        part, residual, weight, out, slots, flags, seq, eps, RANK=rank, WORLD=world, N=n, BLOCK=block,
        SLOT=slots.shape[1], num_warps=8 if block >= 4096 else 4,
    )
    return out


_BITS = {torch.bfloat16: (tl.int16, 0x7FC0), torch.float16: (tl.int16, 0x7E00), torch.float32: (tl.int32, 0x7FC00000)}


def one_shot_add_norm(part: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      peers: torch.Tensor, counter: torch.Tensor, rank: int, world: int,
                      slot_bytes: int) -> torch.Tensor:
    """norm(sum over ranks of ``part`` + ``residual``) * ``weight`` [rows, N]; the sum + residual is left in
    ``residual``. ``peers``: int64 [world], each rank's slot region as this GPU addresses it (``GENERATIONS`` x
    ``world`` slots of ``slot_bytes``, filled with ``EMPTY_BYTE`` before first use); ``counter``: int32 [2], zeros."""
    rows, n = part.shape
    part = part.contiguous()
    if not residual.is_contiguous():
        raise ValueError("the residual must be contiguous: the kernel updates it in place")
    bits, nan_bits = _BITS[part.dtype]
    if rows * n * part.element_size() > slot_bytes:
        raise ValueError(f"{rows} x {n} {part.dtype} does not fit a one-shot slot of {slot_bytes} bytes")
    out = torch.empty_like(part)
    block = triton.next_power_of_2(n)
    one_shot_add_norm_kernel[(rows,)](
        part, residual, weight, out, peers, counter, rows, eps, RANK=rank, WORLD=world, N=n, BLOCK=block,
        SLOT=slot_bytes // part.element_size(), BITS=bits, NAN_BITS=nan_bits, GENS=GENERATIONS,
        num_warps=8 if block >= 4096 else 4,
    )
    return out
