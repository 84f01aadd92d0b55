"""The page copies of the host tier on one rank: stores and loads in recorded order, runs of host slots, the
staging buffer on CUDA (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.engine import block_copier
from hybridkv.engine.block_copier import BlockCopier
from hybridkv.kv.host_tier import BlockCopy

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def copy(to_host, blocks, slots):
    return BlockCopy(to_host, np.array(blocks, dtype=np.int64), np.array(slots, dtype=np.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_pages_go_to_host_slots_and_come_back_into_other_blocks(device, monkeypatch):
    monkeypatch.setattr(block_copier, "STAGING_BYTES", 3 * 64)  # 3 pages: runs are split into chunks
    cache = torch.randn(12, 64, device=device).to(torch.float8_e4m3fn)  # an fp8 cache: copied as bytes
    copier = BlockCopier(cache, num_host_blocks=8)
    pages = cache.view(torch.uint8)
    original = pages.clone()
    # slot 2 is written twice in one batch: the later write (block 9) wins
    copier.run([copy(True, [3, 7, 1, 4, 5, 9], [0, 1, 2, 3, 4, 2])])
    pages.zero_()
    copier.run([copy(False, [10, 11, 2, 6, 8], [0, 1, 2, 3, 4])])
    if device == "cuda":
        torch.cuda.synchronize()
    for dst, src in [(10, 3), (11, 7), (2, 9), (6, 4), (8, 5)]:
        assert torch.equal(pages[dst], original[src]), (dst, src)
    assert torch.count_nonzero(pages[[0, 1, 3, 4, 5, 7, 9]]) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_back_runs_before_a_load_into_the_same_block(device):
    pages = torch.arange(4 * 8, dtype=torch.float32, device=device).view(4, 8)
    copier = BlockCopier(pages, num_host_blocks=4)
    copier.run([copy(True, [1], [0])])
    old = pages[1].clone()
    copier.run([copy(True, [2], [1]), copy(False, [2], [0])])  # block 2 written back, then reused for slot 0
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(pages[2], old)
    assert torch.equal(copier.host[1].view(torch.float32), torch.arange(16, 24, dtype=torch.float32))
