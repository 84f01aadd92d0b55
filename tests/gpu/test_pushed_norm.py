"""The norm that ends a prefill half's all-reduce on the copy engines (``pushed_add_norm``), on one device with the
peers' parts already landed in its slots and their flags set: it adds every rank's part in rank order, rounds the
sum as a summed tensor would be, adds the residual (left in place, bit for bit on a GPU) and normalises, as
``rms_norm`` does after the rank-order sum. Slots skip this rank; a flag already past the message still counts.
Runs on a GPU, or on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.one_shot_norm import pushed_add_norm  # noqa: E402
from hybridkv.kernels.rms_norm import rms_norm  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# the interpreter rounds float32 to bf16 its own way (an ulp of the sum apart at times); compiled kernels round as torch
EXACT_BF16 = dict(rtol=2 ** -7, atol=2 ** -4) if INTERPRET else dict(rtol=0, atol=0)


@pytest.mark.parametrize("rank,world,rows,dtype", [(0, 2, 7, torch.bfloat16), (2, 4, 5, torch.bfloat16),
                                                   (1, 4, 3, torch.float32)])
def test_the_landed_parts_are_summed_in_rank_order_then_normalised(rank, world, rows, dtype):
    n, slot_rows, eps, seq = 96, 8, 1e-5, 5
    g = torch.Generator().manual_seed(rank + world)
    parts = [(torch.randn(rows, n, generator=g) * (r + 1)).to(dtype).to(DEVICE) for r in range(world)]
    residual = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE)
    weight = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    slots = torch.full((world - 1, slot_rows * n), float("nan"), dtype=dtype, device=DEVICE)
    for peer, r in enumerate(r for r in range(world) if r != rank):
        slots[peer, : rows * n] = parts[r].reshape(-1)
    flags = torch.full((world,), seq, dtype=torch.int32, device=DEVICE)
    flags[(rank + 1) % world] = seq + 1  # that peer already sent its next message too
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    want_res = (total.to(dtype).float() + residual.float()).to(dtype)
    out = torch.full((rows + 2, n), 7.0, dtype=dtype, device=DEVICE)  # the norm goes into rows 2.. only
    got = pushed_add_norm(parts[rank], residual, weight, eps, slots, flags, seq, rank, world, out=out[2:])
    assert got.data_ptr() == out[2:].data_ptr() and bool((out[:2] == 7.0).all())
    torch.testing.assert_close(residual, want_res, **(dict(rtol=0, atol=0) if dtype == torch.float32 else EXACT_BF16))
    # and the norm of that sum, as the plain norm kernel takes it (the two reduce a row in different orders)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, rms_norm(residual, eps, weight), rtol=tol, atol=tol)


def test_parts_that_do_not_fit_the_slots_are_refused():
    slots = torch.zeros(1, 4 * 96, dtype=torch.bfloat16, device=DEVICE)
    flags = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    part = torch.zeros(5, 96, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        pushed_add_norm(part, part.clone(), torch.ones(96, dtype=torch.bfloat16, device=DEVICE), 1e-5, slots, flags,
                        1, 0, 2)
